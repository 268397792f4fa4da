"""`hvdtrain doctor --hosts a:1,b:1` / `--hostfile FILE`: can a job start on these hosts? Checked before any job.

For each host, one ssh call (BatchMode, ConnectTimeout, StrictHostKeyChecking=accept-new, and a subprocess
timeout) runs this machine's own interpreter path with hvdtrain.doctor.probe (mode `versions`): the host's Python,
Horovod and torch versions and its IPv4 network interfaces. From the answers:

    <host>: ssh      reachable, or why not (refused, timed out, key rejected, host key changed, ...)
    <host>: Python   the same Python (major.minor) as here (a different patch level is a warning)
    <host>: Horovod  the same Horovod version as here
    Common NIC       interface names every reachable host has (horovodrun --network-interfaces needs one)
    Launcher NIC     whether this machine has that interface too (Gloo's rendezvous server listens on it)

Hosts that horovodrun would treat as local (localhost, loopback or one of this machine's addresses) are probed
without ssh, as horovodrun starts their ranks without ssh. Hosts are probed in parallel.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hvdtrain.doctor import probe as host_probe
from hvdtrain.doctor.local import Check
from hvdtrain.doctor.probe import Facts
from hvdtrain.doctor.ssh import CALL_TIMEOUT_S, SSH_UNREACHABLE, is_local, local_addresses, ssh_argv, ssh_failure
from hvdtrain.job.hosts import Host, HostError, parse_hostfile, parse_hosts
from hvdtrain.textfile import fix_for, read_text


@dataclass(frozen=True)
class Probe:
    """One host's answer, or why there is none (`error`, with `fix`)."""

    host: str
    facts: Facts = field(default_factory=Facts)
    error: str = ""
    fix: str = ""
    local: bool = False
    seconds: float = 0.0


def load_hosts(hosts: str | None, hostfile: str | None) -> list[Host]:
    """The hosts named by `--hosts a:1,b:1` or `--hostfile FILE`, parsed by hvdtrain.job.hosts (HostError if bad)."""
    if hostfile is not None:
        try:
            text = read_text(hostfile)
        except OSError as exc:  # NotText too: the file is not UTF-8 (line and fix in the message)
            raise HostError(f"{hostfile}: cannot read the hostfile: {exc.strerror or exc}; "
                            f"{fix_for(exc, 'check the path')}") from None
        return parse_hostfile(text, origin=hostfile)
    return parse_hosts(hosts or "", origin="--hosts")


def interpret(host: str, returncode: int, stdout: str, stderr: str, python: str,
              port: int | None = None, identity_file: str | None = None) -> Probe:
    """Turn one probe call's exit status and output into a Probe (pure: unit-tested from data)."""
    if returncode == SSH_UNREACHABLE:
        error, fix = ssh_failure(host, stderr, port, identity_file)
        return Probe(host, error=error, fix=fix)
    if returncode in (126, 127):
        return Probe(host, error=f"reachable, but {python} cannot run there (exit {returncode})",
                     fix=f"install hvdtrain on {host} at the same path ({python}): a shared filesystem or "
                         "scripts/setup.sh in the same folder")
    facts = host_probe.parse(stdout)
    if facts is None:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return Probe(host, error=f"reachable, but the probe failed (exit {returncode}): {tail}",
                     fix=f"run {python} -c 'import horovod' on {host} and fix what it reports")
    return Probe(host, facts=facts)


def probe_host(host: str, python: str, port: int | None, identity_file: str | None, local: bool) -> Probe:
    """Run the probe on one host (over ssh unless local), bounded by CALL_TIMEOUT_S."""
    argv = host_probe.command(python, "versions")
    if not local:
        argv = ssh_argv(host, shlex.join(argv), port, identity_file)
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


def version_checks(probe: Probe, here: Facts) -> list[Check]:
    """Python (major.minor must match; another patch level warns) and Horovod (must match) against this machine."""
    name, facts = probe.host, probe.facts
    theirs, ours = facts.python or "?", here.python
    same_minor = theirs.split(".")[:2] == ours.split(".")[:2]
    python_fix = f"use Python {ours} on {name} (the same interpreter path, {here.executable})"
    checks = [Check(f"{name}: Python", theirs == ours, f"{theirs}" + ("" if theirs == ours else f" (here: {ours})"),
                    python_fix, required=not same_minor)]
    hvd = facts.horovod
    detail = f"{hvd}" if hvd == here.horovod else f"{hvd or 'not installed'} (here: {here.horovod})"
    if facts.torch and facts.torch != here.torch:
        detail += f"; torch {facts.torch} (here: {here.torch})"
    checks.append(Check(f"{name}: Horovod", hvd is not None and hvd == here.horovod, detail,
                        f"run scripts/setup.sh on {name} so that it builds Horovod {here.horovod} "
                        "against the same torch"))
    return checks


def common_interfaces(nics_by_host: Mapping[str, Sequence[str]]) -> list[str]:
    """Interface names present on every host (sorted); [] when there is none or no host."""
    sets = [set(nics) for nics in nics_by_host.values()]
    return sorted(set.intersection(*sets)) if sets else []


def nic_checks(nics_by_host: Mapping[str, Sequence[str]], local_nics: Sequence[str]) -> list[Check]:
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


def local_facts(python: str = sys.executable) -> Facts:
    """This machine's side of the comparison, read by the same probe as a host's."""
    return host_probe.run(python, "versions")


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
            nics[probe.host] = list(probe.facts.nics)
    local_nics = [n for n, addrs in _local_nic_addrs().items() if addrs]
    return checks + nic_checks(nics, local_nics)


def _local_nic_addrs() -> dict[str, list[str]]:
    try:
        import psutil
    except ImportError:
        return {}
    return {n: [a.address for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")]
            for n, addrs in psutil.net_if_addrs().items()}
