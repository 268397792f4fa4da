"""`hvdtrain doctor --hosts a:1,b:1` / `--hostfile FILE`: can a job start on these hosts? Checked before any job.

For each host, one ssh call (BatchMode, ConnectTimeout, StrictHostKeyChecking=accept-new, and a subprocess
timeout) runs this machine's own interpreter path with a small probe that prints the host's Python, Horovod and
torch versions and its IPv4 network interfaces. From the answers:

    <host>: ssh      reachable, or why not (refused, timed out, key rejected, host key changed, ...)
    <host>: Python   the same Python (major.minor) as here (a different patch level is a warning)
    <host>: Horovod  the same Horovod version as here
    Common NIC       interface names every reachable host has (horovodrun --network-interfaces needs one)
    Launcher NIC     whether this machine has that interface too (Gloo's rendezvous server listens on it)

`unreachable_hosts` is the ssh part alone, for naming the host a failed job lost.

Hosts that horovodrun would treat as local (localhost, loopback or one of this machine's addresses) are probed
without ssh, as horovodrun starts their ranks without ssh. Hosts are probed in parallel.
"""

from __future__ import annotations

import json
import platform
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata

from hvdtrain.doctor import Check
from hvdtrain.hosts import Host, HostError, is_loopback, parse_hostfile, parse_hosts
from hvdtrain.textfile import fix_for, read_text

CONNECT_TIMEOUT_S = 5
CALL_TIMEOUT_S = 40  # ssh connect + the remote interpreter's start on a busy host
MARKER = "HVDTRAIN_HOST_PROBE "
SSH_UNREACHABLE = 255  # ssh's own exit status for connection and authentication failures

# Runs on each host with this machine's interpreter path: prints one marked JSON line (login shells may print more).
PROBE = r"""
import json, platform, socket, sys
from importlib import metadata
out = {"python": platform.python_version(), "executable": sys.executable}
for pkg in ("horovod", "torch"):
    try:
        out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
        out[pkg] = None
try:
    import psutil
    up = {n for n, s in psutil.net_if_stats().items() if s.isup}
    out["nics"] = sorted(n for n, addrs in psutil.net_if_addrs().items() if n in up and any(
        a.family == socket.AF_INET and not a.address.startswith("127.") for a in addrs))
except ImportError:
    out["nics"] = sorted(n for _, n in socket.if_nameindex() if n != "lo")
print("HVDTRAIN_HOST_PROBE " + json.dumps(out))
"""


@dataclass(frozen=True)
class Probe:
    """One host's answer, or why there is none (`error`, with `fix`)."""

    host: str
    facts: dict = field(default_factory=dict)
    error: str = ""
    fix: str = ""
    local: bool = False
    seconds: float = 0.0


def load_hosts(hosts: str | None, hostfile: str | None) -> list[Host]:
    """The hosts named by `--hosts a:1,b:1` or `--hostfile FILE`, parsed by hvdtrain.hosts (HostError if bad)."""
    if hostfile is not None:
        try:
            text = read_text(hostfile)
        except OSError as exc:  # NotText too: the file is not UTF-8 (line and fix in the message)
            raise HostError(f"{hostfile}: cannot read the hostfile: {exc.strerror or exc}; "
                            f"{fix_for(exc, 'check the path')}") from None
        return parse_hostfile(text, origin=hostfile)
    return parse_hosts(hosts or "", origin="--hosts")


def ssh_argv(host: str, command: str, port: int | None = None, identity_file: str | None = None) -> list[str]:
    """ssh that never prompts, gives up connecting after CONNECT_TIMEOUT_S, and accepts only new host keys."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            "-o", "StrictHostKeyChecking=accept-new", "-o", "LogLevel=ERROR"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity_file is not None:
        argv += ["-i", identity_file, "-o", "IdentitiesOnly=yes"]
    return [*argv, host, command]


def local_addresses() -> set[str]:
    """This machine's IPv4 addresses (what horovodrun compares a host's address with to skip ssh)."""
    try:
        import psutil
    except ImportError:
        return set()
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}


def is_local(name: str, addresses: set[str]) -> bool:
    """Would horovodrun start this host's ranks without ssh? (No DNS look-up: names other than localhost and
    this machine's hostname count as remote.)"""
    return is_loopback(name) or name == socket.gethostname() or name in addresses


def ssh_failure(host: str, stderr: str, port: int | None, identity_file: str | None) -> tuple[str, str]:
    """(what went wrong, how to fix it) for an ssh exit status 255, from ssh's message."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    message = lines[-1] if lines else "ssh failed without a message"
    retry = shlex.join(ssh_argv(host, "true", port, identity_file))
    low = message.lower()
    if "host key verification failed" in low or "remote host identification has changed" in stderr.lower():
        fix = f"the host key of {host} changed: if that is expected, run ssh-keygen -R {host}, then retry"
    elif "permission denied" in low:
        key = identity_file or "your key"
        fix = f"install {key}'s public key in {host}'s authorized_keys (ssh-copy-id), or pass --ssh-identity-file"
    elif "could not resolve" in low or "name or service not known" in low:
        fix = f"{host} does not resolve: fix the name in the host list or in DNS/hosts"
    else:
        fix = f"check that {host} is up and sshd listens on port {port or 22} (try: {retry})"
    return f"unreachable: {message}", fix


def interpret(host: str, returncode: int, stdout: str, stderr: str, python: str,
              port: int | None = None, identity_file: str | None = None) -> Probe:
    """Turn one probe call's exit status and output into a Probe (pure: unit-tested from data)."""
    if returncode == SSH_UNREACHABLE:
        error, fix = ssh_failure(host, stderr, port, identity_file)
        return Probe(host, error=error, fix=fix)
    marked = [line[len(MARKER):] for line in stdout.splitlines() if line.startswith(MARKER)]
    if returncode in (126, 127):
        return Probe(host, error=f"reachable, but {python} cannot run there (exit {returncode})",
                     fix=f"install hvdtrain on {host} at the same path ({python}): a shared filesystem or "
                         "scripts/setup.sh in the same folder")
    try:
        facts = json.loads(marked[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return Probe(host, error=f"reachable, but the probe failed (exit {returncode}): {tail}",
                     fix=f"run {python} -c 'import horovod' on {host} and fix what it reports")
    return Probe(host, facts=facts)


def probe_host(host: str, python: str, port: int | None, identity_file: str | None, local: bool) -> Probe:
    """Run the probe on one host (over ssh unless local), bounded by CALL_TIMEOUT_S."""
    remote = f"{shlex.quote(python)} -c {shlex.quote(PROBE)}"
    argv = [python, "-c", PROBE] if local else ssh_argv(host, remote, port, identity_file)
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CALL_TIMEOUT_S, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Probe(host, error=f"no answer within {CALL_TIMEOUT_S} s", local=local,
                     fix=f"check that {host} is up and not overloaded, and that its sshd answers on port {port or 22}")
    except OSError as exc:
        return Probe(host, error=f"cannot start {argv[0]}: {exc.strerror or exc}", local=local,
                     fix="install the OpenSSH client (apt-get install -y openssh-client)")
    probe = interpret(host, proc.returncode, proc.stdout, proc.stderr, python, port, identity_file)
    return Probe(probe.host, probe.facts, probe.error, probe.fix, local, time.monotonic() - start)


def unreachable_hosts(names: Sequence[str], port: int | None = None,
                      identity_file: str | None = None) -> dict[str, str]:
    """The hosts ssh cannot reach right now (name -> why), tried in parallel, each bounded. Meant for naming the
    lost host after a job failed: horovodrun's Gloo output does not say which host went away."""

    def why(name: str) -> str | None:
        try:
            proc = subprocess.run(ssh_argv(name, "true", port, identity_file), capture_output=True, text=True,
                                  timeout=CALL_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"no answer within {CALL_TIMEOUT_S} s"
        return ssh_failure(name, proc.stderr, port, identity_file)[0] if proc.returncode == SSH_UNREACHABLE else None

    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        answers = dict(zip(names, pool.map(why, names), strict=True))
    return {name: reason for name, reason in answers.items() if reason is not None}


def version_checks(probe: Probe, here: dict) -> list[Check]:
    """Python (major.minor must match; another patch level warns) and Horovod (must match) against this machine."""
    name, facts = probe.host, probe.facts
    theirs, ours = facts.get("python") or "?", here["python"]
    same_minor = theirs.split(".")[:2] == ours.split(".")[:2]
    python_fix = f"use Python {ours} on {name} (the same interpreter path, {here['executable']})"
    checks = [Check(f"{name}: Python", theirs == ours, f"{theirs}" + ("" if theirs == ours else f" (here: {ours})"),
                    python_fix, required=not same_minor)]
    hvd = facts.get("horovod")
    detail = f"{hvd}" if hvd == here["horovod"] else f"{hvd or 'not installed'} (here: {here['horovod']})"
    if facts.get("torch") and facts.get("torch") != here.get("torch"):
        detail += f"; torch {facts['torch']} (here: {here.get('torch')})"
    checks.append(Check(f"{name}: Horovod", hvd is not None and hvd == here["horovod"], detail,
                        f"run scripts/setup.sh on {name} so that it builds Horovod {here['horovod']} "
                        "against the same torch"))
    return checks


def common_interfaces(nics_by_host: dict[str, Sequence[str]]) -> list[str]:
    """Interface names present on every host (sorted); [] when there is none or no host."""
    sets = [set(nics) for nics in nics_by_host.values()]
    return sorted(set.intersection(*sets)) if sets else []


def nic_checks(nics_by_host: dict[str, Sequence[str]], local_nics: Sequence[str]) -> list[Check]:
    """Common NIC (required) and, when there is one, whether this machine has it too (a warning if not)."""
    if not nics_by_host:
        return [Check("Common NIC", False, "no host answered", "fix the hosts' ssh first")]
    common = common_interfaces(nics_by_host)
    if not common:
        listing = "; ".join(f"{h}: {', '.join(n) or 'none'}" for h, n in nics_by_host.items())
        return [Check("Common NIC", False, f"no interface name on every host ({listing})",
                      "horovodrun --network-interfaces needs one name present on every host: rename the hosts' "
                      "interfaces alike, or use hosts on the same network")]
    checks = [Check("Common NIC", True, f"{', '.join(common)} (on all {len(nics_by_host)} reachable host(s); "
                                        f"pin it with network_interfaces: [{common[0]}] in the job spec)")]
    here = [n for n in common if n in local_nics]
    checks.append(Check("Launcher NIC", bool(here), f"{', '.join(here)} here too" if here else
                        f"this machine has no {', '.join(common)}", required=False,
                        fix="horovodrun --gloo serves rendezvous on this machine's address on that interface: "
                            "launch from a machine on the hosts' network, or use controller: mpi"))
    return checks


def local_facts(python: str = sys.executable) -> dict:
    """This machine's side of the comparison, read the same way the probe reads a host's."""
    facts: dict = {"python": platform.python_version(), "executable": python}
    for pkg in ("horovod", "torch"):
        try:
            facts[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            facts[pkg] = None
    return facts


def host_checks(hosts: Sequence[Host], *, port: int | None = None, identity_file: str | None = None,
                python: str = sys.executable) -> list[Check]:
    """Probe every host in parallel; one ssh check per host, its versions when reachable, then the NIC checks."""
    addresses = local_addresses()
    names = [h.name for h in hosts]
    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        probes = list(pool.map(lambda n: probe_host(n, python, port, identity_file, is_local(n, addresses)), names))
    here = local_facts(python)
    checks: list[Check] = []
    nics: dict[str, list[str]] = {}
    for probe in probes:
        how = "local (no ssh)" if probe.local else f"reachable (port {port or 22})"
        checks.append(Check(f"{probe.host}: ssh", not probe.error,
                            probe.error or f"{how}, {probe.seconds:.1f} s", probe.fix))
        if not probe.error:
            checks += version_checks(probe, here)
            nics[probe.host] = list(probe.facts.get("nics") or [])
    local_nics = [n for n, addrs in _local_nic_addrs().items() if addrs]
    return checks + nic_checks(nics, local_nics)


def _local_nic_addrs() -> dict[str, list[str]]:
    try:
        import psutil
    except ImportError:
        return {}
    return {n: [a.address for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")]
            for n, addrs in psutil.net_if_addrs().items()}
