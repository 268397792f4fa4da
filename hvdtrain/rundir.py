"""One writer per run directory: the job that trains into it holds an exclusive lock for as long as it runs.

Rank 0 writes a run directory's checkpoints, TensorBoard files and summary.json, so rank 0 takes the lock before
it reads or writes anything there, and every rank learns the outcome (`claim`): a second job on the same directory
stops at once, on all its ranks, with RunDirBusy naming the holder, instead of training beside the first and
overwriting its newest checkpoint and summary.

The lock is `flock(LOCK_EX)` on `<run-dir>/hvdtrain.lock`: the kernel releases it when the holder exits, however
it exits (SIGKILL, a crash), so a lock is never left stuck. The file also holds the holder's host, pid and start
time, for the message. On NFS, Linux maps flock onto NFS byte-range locks, so jobs on different hosts sharing
the directory exclude each other too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCK_NAME = "hvdtrain.lock"


class RunDirBusy(RuntimeError):
    """Another job holds the run directory (its message names the holder and what to do)."""


_HELD: set[int] = set()  # the fds of this process's locks, which a forked child must not share


def _forget_in_child() -> None:
    """A forked child (a loader's producer, a DataLoader worker) would share the lock's open file, and hold the lock
    after this process released it: the child's copy is pointed at /dev/null (the number stays taken)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.dup2(devnull, fd, inheritable=False)
    os.close(devnull)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class RunDirLock:
    """An exclusive lock on a run directory, held until release() or until this process ends (not a child it
    forks)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd  # None once released
        _HELD.add(fd)

    def release(self) -> None:
        if self._fd is not None:
            _HELD.discard(self._fd)
            os.close(self._fd)  # closing the only descriptor of the open file releases the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def describe_holder(text: str) -> str:
    """The lock file's content as words: 'pid 12 on host h (started 2026-11-23 11:50:02 UTC, python train.py)'."""
    try:
        info = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(info["started"])))
        return f"pid {int(info['pid'])} on host {info['host']} (started {started}: {info.get('command', '?')})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def busy_message(run_dir: Path | str, holder: str) -> str:
    return (f"run directory {run_dir} is in use by another job: its writer is {holder}. Two jobs on one run "
            f"directory would overwrite each other's checkpoints and summary.json. Wait for that job to end (or "
            f"stop it), or give this one another run directory (--run-dir).")


def lock(run_dir: Path | str) -> RunDirLock:
    """Take the run directory's lock (creating the directory) or raise RunDirBusy at once; never waits."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise RunDirBusy(f"cannot use run directory {run_dir}: {exc.strerror or exc}; check that the path is a "
                         f"directory you may write to, or give another one (--run-dir)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirBusy(busy_message(run_dir, holder)) from None
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
          "command": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv))[:200]}
    data = json.dumps(me).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    return RunDirLock(path, fd)


def _read_holder(fd: int) -> str:
    text = ""
    for _ in range(10):  # the holder writes its name right after locking: give it a moment
        with contextlib.suppress(OSError):
            text = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        if text:
            break
        time.sleep(0.05)
    return describe_holder(text)


def claim(run_dir: Path | str, rank: int, share: Callable[[Any], Any], *, held: RunDirLock | None = None,
          wait_s: float = 0.0) -> RunDirLock | None:
    """Rank 0 takes the lock; `share` (a broadcast from rank 0, e.g. hvd.broadcast_object) tells every rank whether
    it got it, so all ranks raise the same RunDirBusy together. Returns the lock on rank 0, None elsewhere.

    Elastic jobs call this again after every reset, passing the lock they hold (`held`): rank 0 keeps its lock; a
    process that is no longer rank 0 releases it; a new rank 0 retries for up to `wait_s` seconds while the
    previous one lets go.
    """
    refused = None
    if rank != 0 and held is not None:
        held.release()
        held = None
    if rank == 0 and held is None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                held = lock(run_dir)
                break
            except RunDirBusy as exc:
                if time.monotonic() >= deadline:
                    refused = str(exc)
                    break
                time.sleep(0.2)
    refused = share(refused)
    if refused:
        raise RunDirBusy(refused)
    return held


def held_here(run_dir: Path | str) -> str | None:
    """Who holds `run_dir`'s lock, if a process on this machine does; None otherwise. Touches nothing: it reads
    /proc/locks (so `hvdtrain run` can refuse before starting any process; rank 0's lock() stays the real guard,
    also for holders on other hosts)."""
    path = Path(run_dir) / LOCK_NAME
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            table = f.read()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 7374 fe:00:2146548 0 EOF" ("->" marks a waiter)
        if "->" not in fields and len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            try:
                return describe_holder(path.read_text(errors="replace"))
            except OSError:
                return describe_holder("")
    return None
