"""Lifetimes of the producer processes and shared-memory segments (the loader's errors: errors.py).

NOTE [loader shutdown]
Who owns what, and how everything ends — normally, on an exception, on interpreter exit and after a crash:
- The trainer creates every shared-memory segment (`hvdtrain_<trainer pid>_<token>`: one per slot up front, and a bigger
  one on a worker's GrowSlot request, since only the worker knows a batch's size) and sends its name (FreeSlot); the
  worker attaches as soon as it reads that message and unlinks the name at once (shm.attach_segment). From then on the
  segment has no /dev/shm entry: both mappings stay valid and the memory is freed when the last process unmaps it, so a
  later SIGKILL of anyone leaks nothing. A name therefore exists only between `create_segment` and the worker reading
  the socket — and the worker still reads it after the trainer has died, since the message is already in its socket
  buffer. On close the trainer unlinks every name it created (FileNotFoundError = the worker already did); if trainer
  and worker are both killed inside that window, multiprocessing's resource tracker (a separate process, with which the
  trainer registered the segment) unlinks it when the last of them is gone. Only if that tracker is killed too does a
  name outlive the job; no loader removes other processes' files on its own: the application calls
  `sweep_stale_segments()` (shm.py) once at start, and scripts/fresh_state.sh cleans up between runs. A worker's ring
  segment (NOTE [ring] in ring.py) is created before the worker starts, named in its start-up config, attached and
  unlinked by the worker first thing, and released like a slot's.
- Resources live in `Resources`, not in the loader, and `weakref.finalize(receiver, resources.shutdown)` (the
  loader's one Receiver: NOTE [one receiver] in receiver.py, held by the loader and its iterators only) calls
  `shutdown` exactly once: from `close()`, from `__exit__`, when the loader is garbage-collected, or at interpreter
  exit. `close()` is therefore idempotent. Shutdown copes with workers already dead, and the segments are ours to
  unlink either way.
- shutdown: send Stop(), unlink and unmap our segments, join each worker for a grace period, then SIGTERM, then
  SIGKILL. A worker blocked in user code stops at its next socket check; one stuck for longer is killed.
- A worker ignores SIGINT (Ctrl-C reaches the whole process group; the trainer handles it). It ends when it
  reads Stop(), when the socket reports EOF (the trainer is gone: checked at least every
  `poll_s` while it waits and between batches), or when a segment it must attach was already unlinked.
- The trainer never blocks without a deadline: it waits on the worker sockets *and* the process sentinels with
  `Watch.wait(timeout=poll_s)` (one poll(2) set; at most 50 ms with rings: NOTE [ring] (d) in ring.py), so a dead
  worker is reported at once (WorkerDiedError, and the loader closes itself), an exception in a worker is re-raised
  with its traceback (WorkerError), and a silent worker raises LoaderTimeoutError after `timeout` s.
- Batches the user still holds keep their mapping alive after close (a lent batch holds a memoryview export that
  makes shm.Segment.close() leave the mapping to it); the memory is returned when the last view is dropped.
  NOTE [batch lifetime] in lending.py says when a slot goes back to its worker.
"""

from __future__ import annotations

import contextlib
import math
import select
import signal
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from hvdtrain.data import shm
from hvdtrain.data.protocol import Stop

if TYPE_CHECKING:
    from hvdtrain.data.boot import ProducerProcess
    from hvdtrain.data.channel import Channel
    from hvdtrain.data.forked import ForkedProcess
    from hvdtrain.data.ring import Ring


class Resources:
    """Everything that must be released: processes, sockets and segments (see NOTE [loader shutdown])."""

    def __init__(self) -> None:
        self.procs: list[ProducerProcess | ForkedProcess] = []
        self.conns: list[Channel] = []
        self.segments: dict[int, shm.Segment] = {}
        self.rings: list[Ring] = []  # one per worker when the ring is used (NOTE [ring] in ring.py)
        # run with a slot mapping's address before it is dropped (NOTE [registered slots] in pinning.py)
        self.release_hooks: list[Callable[[int], None]] = []
        _LIVE.add(self)

    def fds(self) -> list[int]:
        """The trainer's fds of this loader that a forked producer must not hold (NOTE [forked producers] (a))."""
        segs = [*self.segments.values(), *(r.seg for r in self.rings)]
        return [*(c.fileno() for c in self.conns), *(p.sentinel for p in self.procs), *(s.fd for s in segs)]

    def drop_segment(self, seg: shm.Segment) -> None:
        """Unlink and unmap a slot segment, after the release hooks saw its address."""
        for hook in self.release_hooks:
            hook(seg.address)
        shm.release_segment(seg, unlink=True)

    def shutdown(self, grace_s: float = 2.0) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(Stop())
        for seg in self.segments.values():
            self.drop_segment(seg)
        self.segments.clear()
        self.release_hooks.clear()
        for ring in self.rings:
            ring.close()
            shm.release_segment(ring.seg, unlink=True)
        self.rings.clear()
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for stop in ("terminate", "kill"):
            alive = [p for p in self.procs if p.is_alive()]
            for proc in alive:
                getattr(proc, stop)()
            for proc in alive:
                proc.join(timeout=2.0)
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.close()


_LIVE: weakref.WeakSet[Resources] = weakref.WeakSet()  # every loader's, for `trainer_fds`


def trainer_fds() -> list[int]:
    """The fds of every live loader in this process (NOTE [forked producers] (a) in forked.py); closed ones are < 0."""
    return [fd for res in list(_LIVE) for fd in res.fds() if fd >= 0]


class Watch:
    """One persistent poll(2) set over the workers' sockets and process sentinels, made once per loader.

    `multiprocessing.connection.wait` and `Connection.poll` build a selector on every call, which costs more than
    the rest of a small batch's hand-off; these are one system call each."""

    def __init__(self, conns: list[Channel], procs: list[ProducerProcess | ForkedProcess]) -> None:
        self._all = select.poll()
        self._owner: dict[int, tuple[int, bool]] = {}  # fd -> (worker, is its process sentinel)
        for w, (conn, proc) in enumerate(zip(conns, procs, strict=True)):
            for fd, sentinel in ((conn.fileno(), False), (proc.sentinel, True)):
                self._all.register(fd, select.POLLIN)
                self._owner[fd] = (w, sentinel)

    def wait(self, timeout: float) -> tuple[list[int], list[int]]:
        """Wait up to `timeout` s for any socket or process; (workers with socket events, workers that exited)."""
        piped: list[int] = []
        exited: list[int] = []
        for fd, _ in self._all.poll(max(0, math.ceil(timeout * 1000))):
            w, sentinel = self._owner[fd]
            (exited if sentinel else piped).append(w)
        return piped, exited


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code == -signal.SIGBUS:  # the loader's own segments are reserved (NOTE [shm reservation] in shm.py)
        return (f"signal SIGBUS (a write to shared memory that is not there: is /dev/shm full? It has "
                f"{shm.shm_space()}; docker run --shm-size=8g or --ipc=host gives it more)")
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"
