"""Test-only "hosts" on this machine: Linux network namespaces joined by a bridge, each running its own sshd.

    root namespace: bridge hb<tok> 10.213.<n>.1/24
      ├─ veth hv<tok>1 ── netns hvdt<tok>h1: eth0 10.213.<n>.11, sshd on :22 (generated host key), hostname hvdt<tok>h1
      └─ veth hv<tok>2 ── netns hvdt<tok>h2: eth0 10.213.<n>.12, sshd on :22, hostname hvdt<tok>h2

The hosts share this machine's filesystem, so a job started over ssh runs the same venv and scripts. Keys are
generated per fixture in a temporary directory; everything (sshd and every other process still inside the
namespaces, the namespaces, bridge, known_hosts entries) is removed on exit. Only addresses inside the namespaces
this module creates are ever contacted.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
CMD_TIMEOUT_S = 30


@dataclass(frozen=True)
class SshHost:
    namespace: str
    address: str
    host_veth: str  # the bridge-side end: `ip link set <it> down` cuts the host off

    @property
    def hostname(self) -> str:
        """What `hostname` says on this host (processes started over ssh see it)."""
        return self.namespace


@dataclass(frozen=True)
class SshCluster:
    hosts: list[SshHost]
    identity_file: Path
    bridge: str


def unavailable_reason() -> str | None:
    """Why namespaces + sshd cannot be used here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "ssh", "ssh-keygen", "unshare", SSHD):
        if shutil.which(tool) is None and not Path(tool).exists():
            return f"{tool} is not installed (scripts/setup.sh installs openssh-server and iproute2)"
    probe = f"hvdtprobe{os.getpid()}"
    if _run(["ip", "netns", "add", probe], check=False).returncode != 0:
        return "this machine does not allow creating network namespaces"
    _run(["ip", "netns", "del", probe], check=False)
    bridge = f"hvdtpb{os.getpid() % 100000}"
    if _run(["ip", "link", "add", bridge, "type", "bridge"], check=False).returncode != 0:
        return "this machine does not allow creating a network bridge"
    _run(["ip", "link", "del", bridge], check=False)
    return None


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _sshd_config(tmp: Path, host: SshHost) -> Path:
    cfg = tmp / f"sshd_{host.namespace}.conf"
    cfg.write_text("\n".join([
        "Port 22",
        f"ListenAddress {host.address}",
        f"HostKey {tmp / 'host_key'}",
        f"PidFile {tmp / (host.namespace + '.pid')}",
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
        "PermitRootLogin prohibit-password",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "LogLevel ERROR",
        "",
    ]))
    return cfg


def _wait_for_ssh(host: SshHost, identity: Path, deadline_s: float = 20) -> None:
    deadline = time.monotonic() + deadline_s
    argv = ["ssh", "-i", str(identity), "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes",
            "-o", "ConnectTimeout=2", host.address, "true"]
    while time.monotonic() < deadline:
        if _run(argv, check=False).returncode == 0:
            return
        time.sleep(0.3)
    raise RuntimeError(f"sshd in {host.namespace} ({host.address}) did not accept a connection in {deadline_s} s")


def _add_host(tok: str, i: int, subnet: str, bridge: str) -> SshHost:
    host = SshHost(f"hvdt{tok}h{i}", f"{subnet}.{10 + i}", f"hv{tok}{i}")
    ns = ["ip", "netns", "exec", host.namespace]
    _run(["ip", "netns", "add", host.namespace])
    _run(["ip", "link", "add", host.host_veth, "type", "veth", "peer", "name", f"hp{tok}{i}"])
    _run(["ip", "link", "set", f"hp{tok}{i}", "netns", host.namespace])
    _run(["ip", "link", "set", host.host_veth, "master", bridge, "up"])
    _run([*ns, "ip", "link", "set", f"hp{tok}{i}", "name", "eth0"])
    _run([*ns, "ip", "addr", "add", f"{host.address}/24", "dev", "eth0"])
    _run([*ns, "ip", "link", "set", "eth0", "up"])
    _run([*ns, "ip", "link", "set", "lo", "up"])
    _run([*ns, "ip", "route", "add", "default", "via", f"{subnet}.1"])
    return host


def namespace_processes(namespace: str) -> dict[int, str]:
    """pid -> command line of every process inside a namespace (`ip netns pids`)."""
    found = {}
    for pid in _run(["ip", "netns", "pids", namespace], check=False).stdout.split():
        try:
            found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:  # exited in between
            continue
    return found


def _kill_namespace_processes(namespace: str, deadline_s: float = 10) -> None:
    """SIGKILL whatever still runs in the namespace (an sshd session whose client vanished with a cut link, a
    stray rank): `ip netns del` only unmounts the name, and those processes would keep it alive unseen."""
    deadline = time.monotonic() + deadline_s
    while (pids := namespace_processes(namespace)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _teardown(tok: str, n: int, bridge: str, sshds: list[subprocess.Popen], hosts: list[SshHost]) -> None:
    for proc in sshds:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    for i in range(1, n + 1):
        _kill_namespace_processes(f"hvdt{tok}h{i}")
        _run(["ip", "netns", "del", f"hvdt{tok}h{i}"], check=False)
        _run(["ip", "link", "del", f"hv{tok}{i}"], check=False)
    _run(["ip", "link", "del", bridge], check=False)
    for host in hosts:  # StrictHostKeyChecking=no records the throwaway host keys: forget them
        _run(["ssh-keygen", "-R", host.address], check=False)


def _free_subnet() -> str:
    """A 10.213.N/24 no interface here uses yet (two test sessions at once must not share a subnet)."""
    used = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    start = os.getpid() % 200
    for k in range(200):
        subnet = f"10.213.{(start + k) % 200 + 20}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.213.N.0/24 subnet for the test hosts")


@contextlib.contextmanager
def ssh_cluster(tmp: Path, n: int = 2) -> Iterator[SshCluster]:
    """Start n namespace hosts with sshd; yield their addresses and the client key; tear everything down."""
    tok = str(os.getpid() % 100000)
    subnet = _free_subnet()
    bridge = f"hb{tok}"
    sshds: list[subprocess.Popen] = []
    hosts: list[SshHost] = []
    try:
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{subnet}.1/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        identity = tmp / "id_ed25519"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(identity)])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key")])
        shutil.copy(tmp / "id_ed25519.pub", tmp / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for i in range(1, n + 1):
            _run(["ssh-keygen", "-R", f"{subnet}.{10 + i}"], check=False)  # a crashed earlier run's host key
            host = _add_host(tok, i, subnet, bridge)
            hosts.append(host)
            # Its own UTS namespace too, so that the host's hostname (what ranks see) is its namespace's name.
            sshd = f"hostname {host.hostname} && exec {SSHD} -D -e -f {shlex.quote(str(_sshd_config(tmp, host)))}"
            sshds.append(subprocess.Popen(
                ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "sh", "-c", sshd],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        for host in hosts:
            _wait_for_ssh(host, identity)
        yield SshCluster(hosts, identity, bridge)
    finally:
        _teardown(tok, n, bridge, sshds, hosts)
