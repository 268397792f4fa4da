"""ssh as hvdtrain uses it (the doctor's host checks, naming a host a failed job lost): never prompts, bounded.

Hosts horovodrun treats as local (localhost, loopback or one of this machine's addresses) get no ssh, as
horovodrun starts their ranks without it.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from hvdtrain.job.hosts import is_loopback

CONNECT_TIMEOUT_S = 5
CALL_TIMEOUT_S = 40  # ssh connect + the remote interpreter's start on a busy host
SSH_UNREACHABLE = 255  # ssh's own exit status for connection and authentication failures


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
