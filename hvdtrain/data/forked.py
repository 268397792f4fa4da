"""Producers forked from the trainer (`start_method="fork"`, the default on Linux): the trainer's side
(`fork_producer`, `ForkedProcess`) and what the child does before it serves batches (`_child`).

NOTE [forked producers]
A forked producer starts in about a millisecond with everything the trainer has imported, where a fresh interpreter
(NOTE [producer start] in boot.py) pays Python's start, `import torch` and the dataset's own modules before its
first batch (2.5 s on a quiet machine, 10-16 s on a loaded 2-core one; bench/first_batch.py). It is also what
torch's DataLoader does. It copies the whole trainer, so the child first undoes what must not carry over; each
point below keeps one guarantee of the fresh interpreter:
(a) Liveness. The child inherits every fd of the trainer, among them the trainer's end of its own channel and of
    every other producer's (of this loader and of any other live one), their process sentinels and the slots'
    segment fds. Holding them would keep a channel open after the trainer died (no EOF for the producer) and keep
    unlinked segments' memory. The child points each of them at /dev/null (dup2: the numbers stay taken, so no
    object of the trainer's that the child still holds can close a file the child opens later); it keeps its
    channel end, the gate's end (NOTE [first producer first] in boot.py), the resource tracker's fd and stdout/
    stderr; stdin becomes /dev/null. Slot mappings are not inherited at all: every segment the trainer makes is
    MADV_DONTFORK (shm.create_segment), so a producer never pins memory the trainer has given back.
(b) Nothing of the trainer runs in the child. Signal handlers the trainer installed (a recipe's stop request,
    SIGTERM's checkpoint) are reset to the default, SIGINT and SIGUSR1 ignored (NOTE [loader shutdown]), the
    signal wake-up fd dropped and the signal mask cleared; the garbage collector is frozen over the trainer's
    objects at the fork (gc.freeze), so a finalizer of an unreachable trainer object (a loader's shutdown, which
    would stop its producers and unlink its segments) never runs in the child; the child leaves with os._exit,
    so no atexit hook (Horovod's shutdown, a loader's) runs either; stdout and stderr are flushed before the fork,
    so nothing the trainer had buffered is printed twice.
(c) Math threads. The child's numpy/OpenBLAS and OpenMP pools (threadpoolctl), torch's intra-op threads and
    OpenCV's are set to one thread unless the user set their variable (the environment variables of NOTE [producer
    start] (c) are also set, for what the child imports later). libgomp is not fork-safe after the trainer ran a
    parallel region with more than one thread; one thread never starts a team (DataLoader's workers do the same).
(d) Threads of the trainer do not exist in the child; what one of them held at the fork (a lock inside torch or
    TensorFlow) stays held. The producer's own code takes none of them: it runs numpy, the socket and the dataset.
    A dataset that uses CUDA or a Horovod collective cannot run in a forked producer (torch says so on CUDA);
    neither can anything of the trainer that needs its threads. One such runtime is found by itself: Rust's tokio
    (obstore, which streamed datasets read object stores with, and other Rust-backed I/O) hangs in a child forked
    after its runtime started, so while the trainer runs tokio's threads (`fork_hazard`), the default start method
    is "spawn". Choose `start_method="spawn"` yourself for the rest, and where the trainer's transport is not
    fork-safe (InfiniBand verbs without RDMAV_FORK_SAFE: Horovod's own examples use forkserver there).
The dataset, collate and generator are the trainer's objects (copied on write), not a cloudpickled copy: one that
does not pickle (an open file, a lock) works here, and the trainer's later changes to them never reach a producer.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import sys
import time
import traceback
import warnings
from typing import TYPE_CHECKING

from hvdtrain.data.boot import SINGLE_THREADED, WAIT_S

if TYPE_CHECKING:
    from hvdtrain.data.channel import Channel
    from hvdtrain.data.workers import WorkerConfig

START_METHODS = ("fork", "spawn")
SUPPORTED = hasattr(os, "fork") and sys.platform.startswith("linux")  # the default start method's choice
UNSAFE_THREADS = ("tokio-",)  # names (prefixes) of threads whose runtime a forked child cannot use: (d)


def choose_start_method(start_method: str | None, import_main: bool) -> str:
    """The loader's start method: `start_method` checked (ValueError naming what is allowed), or for None 'fork'
    on Linux unless `import_main` asks for a fresh interpreter or the trainer runs a runtime a fork breaks (d),
    else 'spawn'."""
    if start_method is None:
        return "fork" if SUPPORTED and not import_main and fork_hazard() is None else "spawn"
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS} or None (the default: 'fork' on Linux, else "
                         f"'spawn'; 'forkserver' would re-run the training script in each producer), got "
                         f"{start_method!r}")
    if start_method == "fork" and import_main:
        raise ValueError("import_main=True runs the training script in each producer, which only a fresh interpreter "
                         "needs: use it with start_method='spawn' (a forked producer has the trainer's modules)")
    if start_method == "fork" and not hasattr(os, "fork"):
        raise ValueError("start_method='fork' needs os.fork, which this platform lacks: use 'spawn'")
    return start_method


def fork_hazard() -> str | None:
    """Why a child forked now could hang, or None: a thread of a runtime that does not survive a fork (d)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(UNSAFE_THREADS):
            return f"this process runs a {name!r} thread (Rust's tokio, e.g. obstore), whose runtime a fork breaks"
    return None


class ForkedProcess:
    """A producer started by `fork_producer`: the part of multiprocessing.Process the loader uses."""

    def __init__(self, pid: int, sentinel: int) -> None:
        self.pid, self.sentinel = pid, sentinel
        self._code: int | None = None

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or -N after signal N (as multiprocessing)."""
        if self._code is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): as subprocess, call it 0
                self._code = 0
            else:
                if pid == self.pid:
                    self._code = os.waitstatus_to_exitcode(status)
        return self._code

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` s for the process to end (its sentinel reports EOF at its exit) and reap it."""
        deadline = time.monotonic() + timeout
        while self.exitcode is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.sentinel >= 0:
                select.select([self.sentinel], [], [], min(left, 0.05))
            else:
                time.sleep(min(left, 0.01))

    def terminate(self) -> None:
        if self.exitcode is None:  # not reaped: the pid is still ours
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.exitcode is None:
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """Close the sentinel (after the process has been joined)."""
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def fork_producer(config: WorkerConfig, channel: Channel, started: socket.socket | None,
                  wait_for: socket.socket | None, trainer_fds: list[int]) -> ForkedProcess:
    """Fork one producer (NOTE [forked producers]); `channel` is its end of the trainer's socket pair,
    `started`/`wait_for` the first-batch gate (NOTE [first producer first] in boot.py), `trainer_fds` every fd the
    child must not hold (a)."""
    keep = {channel.fileno(), *(s.fileno() for s in (started, wait_for) if s is not None)}
    drop = sorted({fd for fd in trainer_fds if fd >= 0} - keep - {0, 1, 2})
    sentinel, alive = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # (b): nothing buffered is printed twice
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()
    freeze = gc.get_freeze_count() == 0  # a trainer that froze its own objects keeps them frozen
    if freeze:
        gc.freeze()
    try:
        with warnings.catch_warnings():  # Python >= 3.12 warns of any fork with threads: (d) is why this one is safe
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _child(config, channel, started, wait_for, [*drop, sentinel])  # never returns
    except BaseException:
        os.close(sentinel)
        raise
    finally:
        if freeze:
            gc.unfreeze()
        os.close(alive)
    return ForkedProcess(pid, sentinel)


def _child(config: WorkerConfig, channel: Channel, started: socket.socket | None, wait_for: socket.socket | None,
           drop: list[int]) -> None:
    """The forked producer: undo what the fork copied (NOTE [forked producers]), then serve; leaves by os._exit."""
    code = 1
    try:
        _reset_signals()
        _point_at_devnull([0, *drop])
        _single_threaded()
        if wait_for is not None:
            select.select([wait_for], [], [], WAIT_S)
            wait_for.close()
        from hvdtrain.data.workers import worker_main

        worker_main(channel, config, started)
        code = 0
    except BaseException:  # the child's last word; the trainer reports its exit code
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _reset_signals() -> None:
    """(b): the trainer's Python handlers do not run here."""
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the trainer stops us
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a stop request sent to the group is the trainer's to act on
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _point_at_devnull(fds: list[int]) -> None:
    """(a): release what each fd referred to, keeping the number taken."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd, inheritable=fd == 0)
    finally:
        os.close(devnull)


def _single_threaded() -> None:
    """(c): one thread for every math pool the trainer loaded, unless the user set its variable."""
    chosen = {name for name in SINGLE_THREADED if name in os.environ}
    for name in SINGLE_THREADED:
        os.environ.setdefault(name, "1")
    from threadpoolctl import threadpool_limits

    if not chosen & {"OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}:
        threadpool_limits(1, user_api="blas")
    if "OMP_NUM_THREADS" not in chosen:
        threadpool_limits(1, user_api="openmp")
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)
    cv2 = sys.modules.get("cv2")
    if cv2 is not None and "OPENCV_FOR_THREADS_NUM" not in chosen:
        cv2.setNumThreads(1)
