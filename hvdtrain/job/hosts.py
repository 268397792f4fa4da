"""Hosts and slots: parse hostfiles and `-H` strings into `Host` values. Text in, values out; no I/O.

Accepted hostfile lines (one host per line):

    server1 slots=4          # MPI / DeepSpeed style
    server2:4                # the same as -H uses
    # a whole-line comment; blank lines are skipped

Every error quotes where it came from (`file:lineno: the line`) and says how to fix it. Hostnames must be
valid DNS names or IPv4 addresses: horovodrun pastes them into shell and ssh commands unquoted, so nothing else
may reach it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_SLOTS_KV = re.compile(r"slots=(\S*)")
MAX_SLOTS = 4096


class HostError(ValueError):
    """A hostfile line or a `-H` entry that cannot be used; the message quotes it."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def hosts_arg(hosts: Iterable[Host]) -> str:
    """The value of horovodrun's `-H`: `a:4,b:4`."""
    return ",".join(str(h) for h in hosts)


def total_slots(hosts: Iterable[Host]) -> int:
    return sum(h.slots for h in hosts)


def rank_hosts(hosts: Iterable[Host], np: int) -> list[str]:
    """The host of each of `np` ranks as horovodrun places them (Gloo, and MPI's `-map-by slot`): every slot of
    the first host, then the next host's."""
    placed = [h.name for h in hosts for _ in range(h.slots)]
    return placed[:np]


def is_loopback(name: str) -> bool:
    """`localhost` or a loopback address: ranks there run on this machine (no ssh), whatever its other names."""
    if name.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def hostname_problem(name: str) -> str | None:
    """Why `name` is not a usable host name, or None when it is a DNS name or an IPv4 address."""
    if not name:
        return "the host name is empty"
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.version == 6:
            return "IPv6 addresses cannot be written as host:slots for horovodrun; use a host name"
        return None
    labels = name.rstrip(".").split(".") if len(name) <= 253 else []
    if not labels or not all(_LABEL.fullmatch(label) for label in labels):
        return (f"{name!r} is not a valid host name (letters, digits and '-' in dot-separated labels of "
                "1-63 characters) nor an IPv4 address")
    if labels[-1].isdigit():
        return f"{name!r} looks like an IP address but is not a valid one"
    return None


def parse_slots(text: str) -> int | str:
    """The slot count in `text`, or a message saying why it is not one."""
    if not text.isdigit():
        return f"slot count {text!r} is not a whole number"
    slots = int(text)
    if not 1 <= slots <= MAX_SLOTS:
        return f"slot count {slots} is out of range (1..{MAX_SLOTS})"
    return slots


def parse_host_entry(entry: str, hostfile: bool = True) -> Host | str:
    """`host:N` (or, in a hostfile, `host slots=N`) as a Host, or a message saying what is wrong with it."""
    tokens = entry.split()
    if len(tokens) == 1 and ":" in entry:
        name, _, slots_text = entry.rpartition(":")
    elif len(tokens) == 2 and (m := _SLOTS_KV.fullmatch(tokens[1])):
        name, slots_text = tokens[0], m.group(1)
    elif len(tokens) == 1:
        return f"no slot count for {entry!r}; write " + (f"'{entry} slots=N' or " if hostfile else "") + f"'{entry}:N'"
    else:
        return "expected 'host slots=N' or 'host:N'"
    problem = hostname_problem(name)
    if problem:
        return problem
    slots = parse_slots(slots_text)
    if isinstance(slots, str):
        return slots + "; it must be an integer >= 1 (the number of ranks to run on that host)"
    return Host(name, slots)


def _add(found: dict[str, tuple[Host, str]], host: Host, label: str, where: str) -> None:
    key = host.name.lower()
    if key in found:
        raise HostError(f"{where}\n  host {host.name!r} is listed twice (first at {found[key][1]}); "
                        "list each host once with its total slots")
    found[key] = (host, label)


def parse_hostfile(text: str, origin: str = "<hostfile>") -> list[Host]:
    """Parse a hostfile's text. `origin` names it in errors (`origin:lineno: the line`)."""
    found: dict[str, tuple[Host, str]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{origin}:{lineno}: {raw.strip()}"
        host = parse_host_entry(line)
        if isinstance(host, str):
            raise HostError(f"{where}\n  {host}")
        _add(found, host, f"{origin}:{lineno}", where)
    if not found:
        raise HostError(f"{origin}: no hosts found; add lines like 'server1 slots=4'")
    return [host for host, _ in found.values()]


def parse_hosts(value: str | list[str], origin: str = "hosts") -> list[Host]:
    """Parse `"a:4,b:4"` (or `["a:4", "b:4"]`). `origin` names the source in errors."""
    entries = value.split(",") if isinstance(value, str) else list(value)
    found: dict[str, tuple[Host, str]] = {}
    for index, entry in enumerate(entries):
        label = f"{origin} entry {index + 1}" if isinstance(value, str) else f"{origin}[{index}]"
        where = f"{label}: {entry!r}"
        if " " in entry.strip() or not entry.strip():
            raise HostError(f"{where}\n  expected 'host:N' (no spaces, no empty entries), e.g. 'server1:4'")
        host = parse_host_entry(entry.strip(), hostfile=False)
        if isinstance(host, str):
            raise HostError(f"{where}\n  {host}")
        _add(found, host, label, where)
    if not found:
        raise HostError(f"{origin}: no hosts given; write e.g. 'server1:4,server2:4'")
    return [host for host, _ in found.values()]


def check_np(hosts: list[Host], np: int, origin: str) -> None:
    """np must fit in the slots the hosts offer."""
    slots = total_slots(hosts)
    if np > slots:
        raise HostError(f"{origin}: np = {np} but the hosts offer only {slots} slot(s) ({hosts_arg(hosts)}); "
                        f"lower np to at most {slots} or add hosts/slots")
