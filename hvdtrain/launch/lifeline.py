"""How the processes of a job learn that the launcher is gone, for NOTE [no orphans] in hvdtrain/rank.py.

- `die_with_parent(signum)`: a `preexec_fn` that makes the kernel send `signum` to the child when its parent dies
  (Linux `PR_SET_PDEATHSIG`), whatever killed the parent, SIGKILL included.
- `output_gone(fds)`: whether the reader of our stdout/stderr pipe (or socket) has closed its end: horovodrun's
  forwarding thread locally, sshd for a rank on another host (sshd closes the command's pipes when the ssh client's
  connection ends, but sends no signal to a command that has no terminal).
- `python -m hvdtrain.launch.lifeline PGID` (`guard`): a watcher in a session of its own that stops process group PGID
  (horovodrun's) when its stdin, a pipe from the launcher, closes without the launcher saying "done" first.

Standard library only: `python -m hvdtrain.rank` imports this before every rank starts.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import select
import signal
import stat
import sys
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DONE = b"done\n"  # the launcher's word to the guard: the job ended under its supervision, stand down
GUARD_POLL_S = 1.0
GUARD_GRACE_S = 15.0  # horovodrun's own teardown takes up to 10 s (5 s SIGTERM grace, then SIGKILL, 5 s more)


def die_with_parent(signum: int) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child gets `signum` when the thread that started it exits.

    The kernel ties the signal to the *thread* that forked: call Popen from a thread that lives as long as the
    child should (hvdtrain does so from the main thread). None where prctl is not available (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died between fork and prctl: the signal would never come
            os._exit(126)

    return preexec


def watchable(fds: tuple[int, ...] = (1, 2)) -> tuple[int, ...]:
    """The fds among `fds` that are pipes or sockets: the only kinds whose reader can go away (not files, ttys)."""
    found = []
    for fd in fds:
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            found.append(fd)
    return tuple(found)


def output_gone(fds: tuple[int, ...]) -> bool:
    """True when any of `fds` (writing ends) reports POLLERR or POLLHUP: nobody reads what we write any more.

    A pipe's writing end shows POLLERR once its last reader closed; a socket shows POLLHUP once the peer shut
    down. Never blocks.
    """
    if not fds:
        return False
    poller = select.poll()
    for fd in fds:
        poller.register(fd, 0)  # no events asked for: POLLERR/POLLHUP/POLLNVAL are always reported
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie (an exited process nobody reaped yet:
    where PID 1 does not reap, `killpg(pgid, 0)` would say yes for ever)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # The leader first (one read while it runs); the whole of /proc only once it has exited.
    names = itertools.chain([str(pgid)], (e.name for e in os.scandir("/proc") if e.name.isdigit()))
    for name in names:
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def stop_group(pgid: int, grace_s: float) -> None:
    """SIGTERM process group `pgid`; SIGKILL what is left of it after `grace_s`."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)


def guard(pgid: int, fd: int = 0) -> int:
    """Wait until the launcher's pipe on `fd` closes; unless it said DONE first, stop group `pgid`. Returns when
    that is done, or as soon as the group is gone by itself (nothing left to guard)."""
    said = b""
    while group_alive(pgid):
        ready, _, _ = select.select([fd], [], [], GUARD_POLL_S)
        if not ready:
            continue
        chunk = os.read(fd, 64)
        if chunk:
            said += chunk
            continue
        if said != DONE:  # EOF without DONE: the launcher died
            stop_group(pgid, GUARD_GRACE_S)
        return 0
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        print("usage: python -m hvdtrain.launch.lifeline PGID  (stdin: a pipe from the launcher)", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(guard(int(sys.argv[1])))
