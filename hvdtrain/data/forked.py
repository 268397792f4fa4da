"""Producers forked from the trainer (`start_method="fork"`, the default on Linux): the trainer's side
(`fork_producer`, `ForkedProcess`) and what the child does before it serves batches (`_child`).

NOTE [forked producers]
A forked producer starts in about a millisecond with everything the trainer has imported, where a fresh interpreter
(NOTE [producer start] in boot.py) pays Python's start, `import torch` and the dataset's own modules before its
first batch (1.4 s on a quiet 2-core machine, bench/first_batch.py; 10-16 s on a loaded one). It is also what
torch's DataLoader does. It copies the whole trainer, so the child first undoes what must not carry over; each
point below keeps one guarantee of the fresh interpreter:
(a) Liveness. The child inherits every fd of the trainer. It points at /dev/null (dup2: the numbers stay taken, so
    no object of the trainer's that the child still holds can close a file the child opens later) every socket
    and pipe (its own loader's and every other live loader's channel ends and sentinels, Gloo's and MPI's
    connections, listening sockets, a parent's liveness pipe), every file in /dev/shm (the slots' segments: their
    memory would stay taken) and the loaders' own fds, and stdin; it keeps its channel end, the gate's end (NOTE
    [first producer first] in boot.py), its liveness pipe, the resource tracker's fd, stdout and stderr. Holding a
    trainer end would keep a channel open after the trainer died (no EOF for the producer). The run directory's
    lock goes the same way (an at-fork hook in hvdtrain/rundir.py), so a producer never holds it after the trainer
    released it. Slot mappings are not inherited at all: every segment the trainer makes is MADV_DONTFORK
    (shm.create_segment). Regular files stay open: a dataset's own (below).
(b) Nothing of the trainer runs in the child. Signals are blocked across the fork; the child resets every Python
    handler the trainer installed (a recipe's stop request, SIGTERM's checkpoint) to the default, ignores SIGINT
    and SIGUSR1 (NOTE [loader shutdown]), drops the signal wake-up fd and then clears the mask. The garbage
    collector is off across the fork and the child freezes everything it inherited (gc.freeze), so a finalizer of
    an unreachable trainer object (a loader's shutdown, which would stop its producers and unlink its segments)
    never runs in the child. The child leaves with os._exit, so no atexit hook (Horovod's shutdown, a loader's) runs
    either; stdout and stderr are flushed before the fork, so nothing the trainer had buffered is printed twice.
(c) Math threads. OpenMP (libgomp is not fork-safe after the trainer ran a parallel region with more than one
    thread; one thread never starts a team) and torch's intra-op threads are set to one thread in the child,
    whatever OMP_NUM_THREADS says (it sizes the trainer's); OpenBLAS, MKL and OpenCV to one unless the user set
    their variable (threadpoolctl; the environment variables of NOTE [producer start] (c) are also set, for what the
    child imports later). DataLoader's workers set one thread too.
(d) Threads of the trainer do not exist in the child; what one of them held at the fork (a lock inside torch or
    TensorFlow) stays held. The producer's own code takes none of them: it runs numpy, the socket and the dataset,
    and multiprocessing's resource-tracker lock, which attaching a segment takes, is held across the fork. A dataset
    that uses CUDA or a Horovod collective cannot run in a forked producer (torch says so on CUDA); neither can
    anything of the trainer that needs its threads. One such runtime is found by itself: Rust's tokio (obstore,
    which streamed datasets read object stores with, and other Rust-backed I/O) hangs in a child forked after its
    runtime started, so once the trainer has imported obstore or runs tokio's threads (`fork_hazard`), the default
    start method is "spawn". Choose `start_method="spawn"` yourself for the rest, and where the trainer's
    transport is not fork-safe (InfiniBand verbs without RDMAV_FORK_SAFE: Horovod's own examples use forkserver
    there).
The dataset, collate and generator are the trainer's objects, copied on write, with one exception: a dataset that
defines how it is pickled (`__getstate__`, `__setstate__`, `__reduce__`: per-process state made again, as
hvdtrain's streamed and sharded datasets do for their files, clients and fetch threads) is given its own copy
through cloudpickle, as a spawned producer is. Any other keeps what it holds: an open file object's offset is shared
with the trainer and every sibling (open files in `worker_info()`'s process, or read with os.pread), and a lock a
trainer thread held at the fork stays held. The trainer's later changes to them never reach a producer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import select
import signal
import socket
import stat
import sys
import time
import traceback
import warnings
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any

from hvdtrain.data.boot import SINGLE_THREADED, WAIT_S

if TYPE_CHECKING:
    from hvdtrain.data.channel import Channel
    from hvdtrain.data.workers import WorkerConfig

START_METHODS = ("fork", "spawn")
SUPPORTED = hasattr(os, "fork") and sys.platform.startswith("linux")  # the default start method's choice
UNSAFE_THREADS = ("tokio-",)  # names (prefixes) of threads whose runtime a forked child cannot use: (d)
UNSAFE_MODULES = ("obstore",)  # Rust-backed modules whose tokio runtime may have started (its threads name themselves
# a moment after they start, so the threads alone can be missed right after a first request)
# Python >= 3.12 warns of any fork with threads: (d) is why this one is safe.
warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning,
                        r"hvdtrain\.data\.forked")


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
    if start_method == "fork" and not SUPPORTED:
        raise ValueError(f"start_method='fork' is for Linux (NOTE [forked producers]), this is {sys.platform}: use "
                         f"'spawn'")
    return start_method


def fork_hazard() -> str | None:
    """Why a child forked now could hang, or None: a module or thread of a runtime that does not survive a fork
    (d)."""
    for module in UNSAFE_MODULES:
        if module in sys.modules:
            return f"this process imported {module} (Rust's tokio runtime), which a fork breaks"
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
        poller = select.poll()
        if self.sentinel >= 0:
            poller.register(self.sentinel, select.POLLIN)
        while self.exitcode is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            poller.poll(min(left, 0.05) * 1000)  # at once once it has exited (EOF); the reaping follows

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
    `started`/`wait_for` the first-batch gate (NOTE [first producer first] in boot.py), `trainer_fds` the loaders'
    fds, which the child must not hold (a)."""
    keep = {channel.fileno(), *(s.fileno() for s in (started, wait_for) if s is not None)}
    for stream in (sys.stdout, sys.stderr):  # (b): nothing buffered is printed twice
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.flush()
    pools = _math_pools()
    sentinel, alive = os.pipe()
    try:
        pid = _fork()
    except BaseException:
        os.close(sentinel)
        os.close(alive)
        raise
    if pid == 0:
        try:
            _child(config, channel, started, wait_for, keep | {alive}, [*trainer_fds, sentinel], pools)
        finally:
            os._exit(1)  # _child leaves by os._exit itself; never return into the trainer's code
    os.close(alive)
    return ForkedProcess(pid, sentinel)


def _fork() -> int:
    """os.fork with, around it: every signal blocked in this thread (no handler of the trainer's runs in the child
    before `_reset_signals`), the garbage collector off (the child freezes what it inherited, (b), first thing) and
    multiprocessing's resource tracker lock held (no other thread of the trainer holds it in the child, whose
    segments register with the tracker, (d))."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    collecting = gc.isenabled()
    gc.disable()
    lock = getattr(resource_tracker._resource_tracker, "_lock", None)
    locked = lock is not None and lock.acquire(timeout=10.0)
    pid = -1
    try:
        pid = os.fork()
    finally:
        if locked and lock is not None:
            lock.release()  # in the parent, and the child's copy (same thread id)
        if pid == 0:
            gc.freeze()
            gc.enable()  # the mask stays blocked: _reset_signals clears it
        else:
            if collecting:
                gc.enable()
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return pid


def _child(config: WorkerConfig, channel: Channel, started: socket.socket | None, wait_for: socket.socket | None,
           keep: set[int], drop: list[int], pools: Any) -> None:
    """The forked producer: undo what the fork copied (NOTE [forked producers]), then serve; leaves by os._exit."""
    code = 1
    try:
        _reset_signals()
        _point_at_devnull(_trainer_fds(keep, drop))
        _name(f"hvdtrain-data-r{config.rank}-w{config.local_id} (forked)")
        _single_threaded(pools)
        config = _own_copy(config)
        if wait_for is not None:
            poller = select.poll()
            poller.register(wait_for.fileno(), select.POLLIN)
            poller.poll(WAIT_S * 1000)
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


def _name(title: str) -> None:
    """This producer's command line in ps and top, as a spawned one's names it (it would read as the trainer's).
    Within the trainer's argv (SPT_NOENV): the environment stays where /proc/PID/environ (Slurm's tools, ps e) reads
    it."""
    os.environ["SPT_NOENV"] = "1"
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    finally:
        os.environ.pop("SPT_NOENV", None)


def _trainer_fds(keep: set[int], drop: list[int]) -> list[int]:
    """(a): the fds to release: `drop` (the loaders' own), stdin, and every socket and pipe but `keep`, stdout,
    stderr and the resource tracker's (the trainer's Gloo/MPI connections, listening sockets, liveness pipes), and
    every file in /dev/shm (the slots' segments: an mmap keeps a copy of its fd)."""
    tracker = getattr(resource_tracker._resource_tracker, "_fd", None)
    spare = keep | {1, 2} | ({tracker} if tracker is not None else set())
    found = {fd for fd in drop if fd >= 0} | {0}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                fd = int(name)
                mode = os.fstat(fd).st_mode
                if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode) or os.readlink(f"/proc/self/fd/{fd}").startswith(
                        "/dev/shm/"):
                    found.add(fd)
    return sorted(found - spare)


def _own_copy(config: WorkerConfig) -> WorkerConfig:
    """A dataset that defines how it is pickled (its per-process state: open files, clients, threads, locks, made
    again in each process, as hvdtrain's streamed and sharded datasets do) gets its own copy, as a spawned producer
    would; any other is used as the fork copied it."""
    cls = type(config.dataset)
    own = [name for name in ("__getstate__", "__reduce_ex__", "__reduce__")
           if getattr(cls, name, None) is not getattr(object, name)]
    if config.dataset is None or not (own or hasattr(cls, "__setstate__")):
        return config
    import cloudpickle

    return dataclasses.replace(config, dataset=cloudpickle.loads(cloudpickle.dumps(config.dataset)))


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


_POOLS: tuple[int, Any] | None = None  # (len(sys.modules) when made, threadpoolctl's controller)


def _math_pools() -> Any:
    """threadpoolctl's view of the math libraries loaded here, made in the trainer (10 ms: it inspects every loaded
    library) and again only when modules were imported since, not in each producer."""
    global _POOLS
    if _POOLS is None or _POOLS[0] != len(sys.modules):
        from threadpoolctl import ThreadpoolController

        _POOLS = (len(sys.modules), ThreadpoolController())
    return _POOLS[1]


def _single_threaded(pools: Any) -> None:
    """(c): one thread for OpenMP and torch, and for each BLAS library unless the user set its variable."""
    chosen = {name for name in SINGLE_THREADED if name in os.environ}
    for name in SINGLE_THREADED:
        os.environ.setdefault(name, "1")  # for what the child imports later
    apis = ["openmp"]  # always: more than one thread is what a fork breaks
    apis += [api for api, name in (("openblas", "OPENBLAS_NUM_THREADS"), ("mkl", "MKL_NUM_THREADS"))
             if name not in chosen]
    pools.select(internal_api=apis).limit(limits=1)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    cv2 = sys.modules.get("cv2")
    if cv2 is not None and "OPENCV_FOR_THREADS_NUM" not in chosen:
        cv2.setNumThreads(1)
