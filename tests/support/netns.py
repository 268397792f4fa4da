"""Test-only "hosts" on this machine: Linux network namespaces joined by a bridge, each running its own sshd.

    root namespace: bridge hb<tok> 10.213.<n>.1/24
      ├─ veth hv<tok>1 ── netns hvdt<tok>h1: eth0 10.213.<n>.11, sshd on :22 (generated host key), hostname hvdt<tok>h1
      └─ veth hv<tok>2 ── netns hvdt<tok>h2: eth0 10.213.<n>.12, sshd on :22, hostname hvdt<tok>h2

The hosts share this machine's filesystem, so a job started over ssh runs the same venv and scripts. Keys are
generated per fixture in a temporary directory; everything (sshd and every other process still inside the
namespaces, the namespaces, bridge, and /run/sshd if this module made it) is removed on exit. Only addresses inside
the namespaces this module creates are ever contacted.

NOTE [ The user's ssh state is never touched ]
The test hosts get a fresh host key every run, so whatever ssh records about them is garbage the next time. Every
ssh client of a test (ours, horovodrun's, mpirun's plm_rsh_agent, the doctor's) goes through the cluster's `ssh`
wrapper (`SshCluster.client_env()`: first on PATH, and OMPI_MCA_plm_rsh_agent), which runs the real ssh with a
private config (`-F`): known hosts in the fixture's temporary directory, never ~/.ssh/known_hosts, and nothing from
~/.ssh/config. Options given with `-o` (horovodrun's StrictHostKeyChecking=no) still apply on top of it. The config
also names each host by its hostname (HostName its address, the fixture's key): a Slurm node's name
(tests/support/slurm.py).
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
SSH = "/usr/bin/ssh"
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start (even `sshd -T`) without it; /run is a tmpfs
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
    client_bin: Path  # holds the `ssh` wrapper: see NOTE [ The user's ssh state is never touched ]
    hosts_file: Path  # /etc/hosts inside the hosts: see NOTE [ Each host's names ]

    def client_env(self) -> dict[str, str]:
        """Environment under which every ssh started by a job, a test or hvdtrain uses the private config."""
        return {"PATH": f"{self.client_bin}{os.pathsep}{os.environ.get('PATH', '')}",
                "OMPI_MCA_plm_rsh_agent": str(self.client_bin / "ssh")}


# NOTE [ Each host's names ]
# Inside a host, every process (sshd's sessions, a Slurm node's slurmd and its jobs) sees a hostname of its own
# (a UTS namespace) and an /etc/hosts of its own (a mount namespace, private: nothing leaks to this machine's):
# this machine's /etc/hosts plus every test host's name at its address, as on a cluster whose nodes know each other.
# Without it horovodrun's lookups of the node names (its local-host filter, each rank's ssh-or-not) wait for a DNS
# server the namespaces cannot reach: ~30 s per job, and the node that runs horovodrun counted as remote.
def write_hosts_file(tmp: Path, hosts: list[SshHost]) -> Path:
    path = tmp / "hosts"
    path.write_text(Path("/etc/hosts").read_text() + "".join(f"{h.address} {h.hostname}\n" for h in hosts))
    return path


def as_host(host: SshHost, hosts_file: Path, argv: list[str]) -> list[str]:
    """argv run as `host` runs it (NOTE [ Each host's names ]); prefix with how to enter its network namespace."""
    inside = f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts && hostname {host.hostname} && exec "
    return ["unshare", "--uts", "--mount", "sh", "-c", inside + shlex.join(argv)]


@contextlib.contextmanager
def privsep_dir() -> Iterator[Path]:
    """sshd's privilege-separation directory for the duration: made if missing, and then removed again (only then:
    a directory this module did not make is left as it was). A fresh machine or a reboot has no /run/sshd."""
    made = False
    try:
        PRIVSEP_DIR.mkdir(mode=0o755)
        made = True
    except FileExistsError:
        pass
    try:
        yield PRIVSEP_DIR
    finally:
        if made:
            with contextlib.suppress(OSError):  # not empty: something else uses it now; leave it
                PRIVSEP_DIR.rmdir()


def write_ssh_client(tmp: Path) -> Path:
    """A private ssh client config and an `ssh` wrapper using it, in tmp/bin; returns that bin directory."""
    config = tmp / "ssh_config"
    config.write_text("\n".join([
        "Host *",
        f"  UserKnownHostsFile {tmp / 'known_hosts'}",
        "  GlobalKnownHostsFile /dev/null",
        "  StrictHostKeyChecking accept-new",
        "  BatchMode yes",
        "  LogLevel ERROR",
        "",
    ]))
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {SSH} -F {shlex.quote(str(config))} "$@"\n')
    wrapper.chmod(0o755)
    return bin_dir


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


def _wait_for_ssh(host: SshHost, identity: Path, client_bin: Path, deadline_s: float = 20) -> None:
    deadline = time.monotonic() + deadline_s
    argv = [str(client_bin / "ssh"), "-i", str(identity), "-o", "ConnectTimeout=2", host.address, "true"]
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


def _free_token() -> str:
    """The N of a new cluster's names (namespaces hvdt<N>h<I>, bridge hb<N>, veths hv<N><I>/hp<N><I>) that no
    namespace or link here has: a test's own cluster beside a folder's shared one (tests/cluster/conftest.py, alive
    while other tests run in any order), and two test sessions at once, never share a name. Sharing one made the
    second cluster's setup fail, and its cleanup then removed the first's namespaces (a reverse-order run,
    2026-12-02). scripts/fresh_state.sh matches these names: keep them in step."""
    taken = _run(["ip", "netns", "list"], check=False).stdout + _run(["ip", "-o", "link", "show"], check=False).stdout
    start = os.getpid() % 100000
    for k in range(100000):
        tok = str((start + k) % 100000)
        if not any(name in taken for name in (f"hvdt{tok}h", f"hb{tok}", f"hv{tok}", f"hp{tok}")):
            return tok
    raise RuntimeError("no free name for the test hosts")


def _free_subnet() -> str:
    """A 10.213.N/24 no interface here uses yet (two test sessions at once must not share a subnet).
    scripts/fresh_state.sh knows this range (N = 20..219, hosts .11, .12) and these names: keep them in step."""
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
    tok = _free_token()
    subnet = _free_subnet()
    bridge = f"hb{tok}"
    sshds: list[subprocess.Popen] = []
    hosts: list[SshHost] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(privsep_dir())  # left last, once every sshd is gone
        stack.callback(_teardown, tok, n, bridge, sshds, hosts)
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{subnet}.1/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        identity = tmp / "id_ed25519"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(identity)])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key")])
        shutil.copy(tmp / "id_ed25519.pub", tmp / "authorized_keys")
        client_bin = write_ssh_client(tmp)
        hosts.extend(_add_host(tok, i, subnet, bridge) for i in range(1, n + 1))
        hosts_file = write_hosts_file(tmp, hosts)
        for host in hosts:
            sshd = [SSHD, "-D", "-e", "-f", str(_sshd_config(tmp, host))]
            sshds.append(subprocess.Popen(["ip", "netns", "exec", host.namespace, *as_host(host, hosts_file, sshd)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        with (tmp / "ssh_config").open("a") as config:  # each host by its hostname too (a Slurm node's name)
            config.writelines(f"Host {host.hostname}\n  HostName {host.address}\n  IdentityFile {identity}\n"
                              for host in hosts)
        for host in hosts:
            _wait_for_ssh(host, identity, client_bin)
        yield SshCluster(hosts, identity, bridge, client_bin, hosts_file)
