"""How a producer process starts: the trainer's side (`start_producer`, `ProducerProcess`) and the first code the
producer runs (`main`). Standard library only at import: the producer imports this first.

NOTE [producer start]
With `start_method="spawn"` (the default forks: NOTE [forked producers] in forked.py), a producer is its own
program, `python -P -c BOOTSTRAP`, not a multiprocessing child, so that it is configured by its own entry point
and nothing process-wide in the trainer changes (not its environment, `__main__`, or multiprocessing's default start
method):
(a) Its path. BOOTSTRAP reads the boot message from stdin and sets `sys.path` to the trainer's (its '' made the
    trainer's working directory) before it imports hvdtrain, so the producer imports the trainer's hvdtrain and the
    trainer's modules that cloudpickle names. `-P` keeps its own working directory off the path; the trainer's
    interpreter flags (-O, -W, -X, ...) are passed on, as multiprocessing's spawn does.
(b) The main module. A multiprocessing spawn child re-runs the training script as `__mp_main__`, importing its
    torch or horovod again in every producer (B5 times it). Everything a producer runs arrives cloudpickled,
    objects defined in `__main__` included, so it needs none; `import_main=True` runs it, as multiprocessing would
    (`spawn.prepare`), and a loader that such a run starts at module level is refused (`ImportingMainError`).
(c) Math threads. numpy's OpenBLAS starts one thread per core at import (a large share of a producer's start-up
    CPU), and N producers' pools would oversubscribe the cores the trainer needs. `main` sets OPENBLAS, OMP, MKL
    and OpenCV to one thread (unless the user set them: the child inherits the trainer's environment) before it imports
    anything that imports numpy, like torch's DataLoader workers' `torch.set_num_threads(1)`.
(d) Liveness. The child holds the write end of a pipe and nothing else does; its read end, `sentinel`, reports EOF
    when the child is gone (multiprocessing's sentinel, made the same way), for the loader's poll set.
(e) Shared memory. The child uses the trainer's multiprocessing resource tracker (its fd, as spawn passes it):
    attaching a segment registers it there, and a tracker of its own would be one more process per producer.
(f) The boot message goes through the child's stdin, which it reads at once and then replaces with /dev/null. The
    trainer writes it within the loader's `timeout`: a child that never reads it is stopped, not waited for.

NOTE [first producer first]
The trainer waits only for producer 0 at first: it makes the rank's first batch (the sampler's batches are dealt
round robin from the resume point; workers.py `dataset_batches`), producer 1 the second, a step later. N producers
of every rank starting at once would share a small machine's cores and delay that first batch (B5 and B6 measure
it). So the loader starts them all, but every producer other than producer 0 waits (a spawned one in `main`, before
importing anything beyond the standard library: the package's `__init__` is lazy; a forked one in
forked.py `_child`), until producer 0 has sent its
first batch, ended its first epoch or exited (it writes a byte to its end of a socket pair and closes it; its
death closes it too), or for `WAIT_S` at most. The trainer keeps no end of that pair, so nothing else can hold it
open. Later epochs do not wait. A rank's second batch can come later by one producer's start-up at most: a step
the trainer is running anyway.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

WAIT_S = 1.0  # the longest a producer waits for producer 0's first batch before it starts anyway
# NOTE [producer start] (c); OpenCV's own pool (image decoding, hvdtrain.stream.images) reads the last one
SINGLE_THREADED = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENCV_FOR_THREADS_NUM")
BOOTSTRAP = ("import pickle, sys; boot = pickle.load(sys.stdin.buffer); sys.path[:] = boot['sys_path']; "
             "from hvdtrain.data.boot import main; main(boot)")  # NOTE [producer start] (a)
_importing_main = False  # this process is a producer running the training script (NOTE [producer start] (b))


class ImportingMainError(RuntimeError):
    """A producer's run of the training script (`import_main=True`) tried to start producers of its own."""


class ProducerProcess:
    """A producer started by `start_producer`: the part of multiprocessing.Process the loader uses."""

    def __init__(self, popen: subprocess.Popen[bytes], sentinel: int) -> None:
        self._popen, self.sentinel, self.pid = popen, sentinel, popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or -N after signal N (as multiprocessing)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=timeout)

    def terminate(self) -> None:
        if self._popen.poll() is None:
            self._popen.terminate()

    def kill(self) -> None:
        if self._popen.poll() is None:
            self._popen.kill()

    def close(self) -> None:
        """Close the sentinel (after the process has been joined)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def start_producer(name: str, payload: bytes, channel: socket.socket, started: socket.socket | None,
                   wait_for: socket.socket | None, *, import_main: bool, timeout: float) -> ProducerProcess:
    """Start one producer (NOTE [producer start]); `payload` is its cloudpickled WorkerConfig, `channel` its end
    of the trainer's socket pair, `started`/`wait_for` the first-batch gate (NOTE [first producer first]),
    `timeout` the longest the child may take to read its start-up data."""
    if _importing_main:
        raise ImportingMainError(
            "a data loader was started while a producer process ran the training script (import_main=True): put the "
            "script's training code under `if __name__ == \"__main__\":`, or leave import_main off")
    from multiprocessing import resource_tracker

    sentinel, alive = os.pipe()
    fds = {"channel": channel.fileno(), "alive": alive, "tracker": resource_tracker.getfd(),
           "started": started.fileno() if started else None, "wait_for": wait_for.fileno() if wait_for else None}
    # (a); the flags as multiprocessing's spawn passes them (a private helper of subprocess's, used by both):
    flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]  # not in typeshed
    argv = [sys.executable, *flags, "-P", "-c", BOOTSTRAP, name]
    try:
        popen = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=[fd for fd in fds.values() if fd is not None])
    except BaseException:
        os.close(sentinel)
        raise
    finally:
        os.close(alive)
    proc = ProducerProcess(popen, sentinel)
    boot = {"sys_path": [os.getcwd() if p == "" else p for p in sys.path], "sys_argv": sys.argv, "fds": fds,
            "payload": payload, "main": _main_module() if import_main else {}}
    try:
        _send_boot(popen, boot, timeout)
    except BaseException:
        proc.kill()
        proc.join(timeout=2.0)
        proc.close()
        raise
    return proc


def _main_module() -> dict[str, str]:
    """How multiprocessing's spawn names the training script for its children (`spawn.prepare` reads this)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return {"init_main_from_name": name}
    path = getattr(main, "__file__", None)
    return {} if path is None else {"init_main_from_path": os.path.normpath(os.path.abspath(path))}


def _send_boot(popen: subprocess.Popen[bytes], boot: dict[str, Any], timeout: float) -> None:
    """Write `boot` to the child's stdin and close it. A child that reads none of it for `timeout` seconds (stopped,
    or stuck before its first line) raises LoaderTimeoutError; one that died at once is left to the loader's wait
    to report (its sentinel)."""
    if popen.stdin is None:  # stdin=PIPE makes one
        raise RuntimeError("the producer was started without a stdin pipe")
    data, fd = memoryview(pickle.dumps(boot)), popen.stdin.fileno()
    os.set_blocking(fd, False)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    deadline = time.monotonic() + timeout
    try:
        while data:
            if poller.poll(min(max(deadline - time.monotonic(), 0.0), 1.0) * 1000):
                try:
                    data = data[os.write(fd, data):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    return
                deadline = time.monotonic() + timeout  # progress: the child reads
            elif time.monotonic() >= deadline:
                from hvdtrain.data.errors import LoaderTimeoutError  # local: boot.py imports only the stdlib

                raise LoaderTimeoutError(
                    f"producer pid {popen.pid} read none of its start-up data ({len(data)} bytes left) for the "
                    f"loader's timeout of {timeout:g} s; it is stopped")
    finally:
        with contextlib.suppress(BrokenPipeError):
            popen.stdin.close()


def main(boot: dict[str, Any]) -> None:
    """The producer program (NOTE [producer start]): configure this process, wait for producer 0's first batch
    (the others: NOTE [first producer first]), then run the producer on its end of the trainer's channel."""
    fds = _configure(boot)

    def sock(key: str) -> socket.socket | None:
        return None if fds[key] is None else socket.socket(fileno=fds[key])

    started, wait_for = sock("started"), sock("wait_for")
    if wait_for is not None:
        select.select([wait_for], [], [], WAIT_S)
        wait_for.close()
    import cloudpickle

    from hvdtrain.data.channel import Channel
    from hvdtrain.data.workers import worker_main

    worker_main(Channel(socket.socket(fileno=fds["channel"])), cloudpickle.loads(boot["payload"]), started)


def _configure(boot: dict[str, Any]) -> dict[str, int | None]:
    """Make this interpreter the producer the trainer asked for; returns the inherited fds by role."""
    global _importing_main
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the trainer stops us
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a stop request sent to the group is the trainer's to act on
    for name in SINGLE_THREADED:  # (c): before anything imports numpy
        os.environ.setdefault(name, "1")
    fds: dict[str, int | None] = boot["fds"]
    for fd in fds.values():
        if fd is not None:
            os.set_inheritable(fd, False)  # nothing this producer starts holds the trainer's channel or the pipe
    devnull = os.open(os.devnull, os.O_RDONLY)  # (f)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv[:] = boot["sys_argv"]
    from multiprocessing import resource_tracker

    tracker: Any = resource_tracker._resource_tracker  # (e): what multiprocessing's spawn_main does (private)
    tracker._fd = fds["tracker"]
    if boot["main"]:  # (b)
        from multiprocessing import spawn

        _importing_main = True
        try:
            spawn.prepare(boot["main"])
        finally:
            _importing_main = False
    return fds
