"""The loader's receiving end: its wiring to the workers and the receive state of one pass over an epoch.

NOTE [one receiver]
ShmLoader makes one `Receiver` when its workers have started and re-arms it at every `iter()` (`arm`), as torch's
DataLoader with persistent workers resets its one `_MultiProcessingDataLoaderIter`. The Receiver owns everything
the trainer's side of the wire needs and nothing of the loader's policy:
- what outlives an iteration: the workers' sockets, rings (NOTE [ring] in ring.py) and slot segments (`res`, shared
  with the loader, which starts the workers into it), the poll set, each worker's numbered layouts (protocol.Batch)
  and its ring's `sent` count at our last socket read (NOTE [ring] (e)), the lender (NOTE [batch lifetime] in
  lending.py) and the shutdown (NOTE [loader shutdown] in resources.py);
- what one iteration needs: its generation and epoch, the messages that arrived ahead of their turn (`stash`, by
  (worker, seq)), the workers still producing, the seq each is due to send next, the round robin's position, the
  batches still to skip and the batches `consumed` (yielded or skipped).
It never calls back: the loader reads `consumed` and `ended` when it needs them (its position, NOTE [epoch ahead] in
loader.py) and decides which epoch comes next. What `iter(loader)` returns is the loader's `EpochIterator`: it
reads the receiver while it is armed for its generation (else it is stale), ends for good after a LoaderError or a
hand-off interrupted mid-batch (`spent`), and tells the loader when the epoch ended. Batches of an earlier
generation (an abandoned iteration, or an epoch started ahead that was not taken over) are recognised by their
generation and their slots given back as they arrive; those received but never yielded are given back at the next
`arm`.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, NoReturn

from hvdtrain.data import shm
from hvdtrain.data.errors import LoaderError, LoaderTimeoutError, SharedMemoryFullError, WorkerDiedError, WorkerError
from hvdtrain.data.lending import Lender
from hvdtrain.data.protocol import (
    Batch,
    EpochDone,
    EpochMessage,
    FreeSlot,
    FromWorker,
    GrowSlot,
    StartEpoch,
    ToWorker,
    WorkerFailed,
)
from hvdtrain.data.resources import Watch, describe_exit
from hvdtrain.data.ring import RECHECK_MAX_S, RECHECK_S
from hvdtrain.settings.loader import SLOT_BYTES

if TYPE_CHECKING:
    from hvdtrain.data.resources import Resources

Key = tuple[int, int]  # (worker, seq): where a worker's batch `seq` (or its EpochDone/WorkerFailed) is filed
END = object()  # what `next_batch` returns when the iteration has no more batches


class Receiver:
    """Round robin over the workers, each worker's batches in its order (with `ordered=False`: whichever worker's
    next batch arrives first); see NOTE [one receiver]. `cap`: generator mode's limit on an epoch's batches."""

    def __init__(self, res: Resources, *, rank: int, num_workers: int, slots_per_worker: int, ordered: bool,
                 timeout: float, poll_s: float, cap: int | None) -> None:
        self.res, self.rank, self.num_workers, self.spw = res, rank, num_workers, slots_per_worker
        self.ordered, self.timeout, self.poll_s, self.cap = ordered, timeout, poll_s, cap
        self.watch: Watch | None = None  # once the workers have started (`connected`)
        self.layouts: list[dict[int, shm.CompiledLayout]] = [{} for _ in range(num_workers)]
        self.seen = [0] * num_workers
        self_ref = weakref.ref(self)  # the lender must not keep the receiver (and the workers) alive

        def give_back(slot: int) -> None:
            rx = self_ref()
            if rx is not None and not rx.closed:
                rx.give_back(slot, quiet=True)

        self.lender = Lender(slots_per_worker, give_back)
        self.closed = False
        self._finalizer = weakref.finalize(self, _shut_down, res, self.lender)
        # the armed iteration
        self.gen = self.epoch = self.skip = self.consumed = self.pos = 0
        self.stash: dict[Key, EpochMessage] = {}
        self.active: list[int] = []  # workers that have not sent EpochDone
        self.next_seq: list[int] = []

    def connected(self) -> None:
        """The workers have started: watch their sockets and processes."""
        self.watch = Watch(self.res.conns, self.res.procs)

    def arm(self, gen: int, epoch: int, skip: int) -> None:
        """Receive iteration `gen` (of `epoch`) from its first batch; `skip`: batches to produce and drop first
        (generator mode resuming mid-epoch). The last iteration's batches received and never yielded go back."""
        with self.lender:
            for msg in self.stash.values():
                if isinstance(msg, Batch):
                    self.give_back(msg.slot)
        self.gen, self.epoch, self.skip, self.consumed, self.pos = gen, epoch, skip, 0, 0
        self.spent = False  # an interrupted hand-off lost its place: this iteration cannot go on
        self.stash = {}
        self.active = list(range(self.num_workers))
        self.next_seq = [0] * self.num_workers

    @property
    def ended(self) -> bool:
        """Every worker sent the armed iteration's EpochDone."""
        return not self.active

    def start_epoch(self, gen: int, epoch: int, state: dict[str, Any] | None, *, quiet: bool = False) -> None:
        """Every worker starts iteration `gen` (quiet: a dead worker is left for the next wait to report)."""
        with self.lender:
            for w in range(self.num_workers):
                self.send(w, StartEpoch(gen, epoch, state), quiet=quiet)

    def close(self) -> None:
        """Stop the workers and free every segment (idempotent; NOTE [loader shutdown] in resources.py)."""
        self.closed = True
        self.lender.close()
        self.stash.clear()
        self._finalizer()

    # ---- yielding --------------------------------------------------------------------------------------------

    def next_batch(self) -> Any:
        """The armed iteration's next batch, or END."""
        with self.lender:  # NOTE [batch lifetime] (d)
            return self._next_batch()

    def _next_batch(self) -> Any:
        # The hot path of a small batch (NOTE [wire] in channel.py): a Batch is tested first, with `type() is`.
        while True:
            if not self.active or (self.cap is not None and self.consumed >= self.cap):
                return END
            w, msg = self._receive_due()
            if type(msg) is Batch:
                try:
                    reader = self._reader(w, msg)
                except BaseException:  # e.g. KeyboardInterrupt in its socket read: the slot must not be lost
                    self.spent = True
                    self.give_back(msg.slot, quiet=True)
                    raise
                self._advance(w, ended=False)
                self.consumed += 1
                if self.skip > 0:
                    self.skip -= 1
                    self.give_back(msg.slot)
                    continue
                return self._lend(msg.slot, reader)
            if isinstance(msg, WorkerFailed):
                raise WorkerError(f"data worker {w} of rank {self.rank} failed in epoch {self.epoch} at its batch "
                                  f"{msg.seq}:\n{msg.traceback}", message=msg.message, bad_data=msg.bad_data)
            self._advance(w, ended=True)  # EpochDone

    def _lend(self, slot: int, reader: shm.CompiledLayout) -> Any:
        try:
            batch, lent = self.lender.lend(self.res.segments[slot], slot, reader)
        except BaseException:  # e.g. KeyboardInterrupt mid-hand-off: the slot must not be lost
            if not self.lender.tracks(slot):
                self.give_back(slot, quiet=True)
            raise
        if not lent:  # handed out as a copy: NOTE [batch lifetime] (c)
            self.give_back(slot)
        return batch

    def _reader(self, w: int, msg: Batch) -> shm.CompiledLayout:
        """The layout of batch `msg` of worker `w`, resolved now, in the worker's order (protocol.Batch)."""
        if msg.layout_id < 0:
            return shm.CompiledLayout(msg.layout)  # type: ignore[arg-type]  # not numbered: always sent
        known = self.layouts[w]
        if msg.layout_id not in known:  # its layout is still in the socket: NOTE [ring] (a) in ring.py
            self._drain(w, None)
        try:
            return known[msg.layout_id]
        except KeyError:
            raise LoaderError(f"data worker {w} of rank {self.rank} sent batch {msg.seq} with layout "
                              f"{msg.layout_id}, which it never described") from None

    def _advance(self, w: int, ended: bool) -> None:
        """Move the round robin on: past worker w, or dropping w when it has no more batches."""
        if ended:
            self.active.remove(w)
        else:
            self.next_seq[w] += 1
        if self.active and self.ordered:
            self.pos = self.pos % len(self.active) if ended else (self.pos + 1) % len(self.active)

    # ---- receiving -------------------------------------------------------------------------------------------

    def _receive_due(self) -> tuple[int, EpochMessage]:
        """(worker, message) of the next message to act on: the due worker's next one, or (unordered) any."""
        for w, ring in enumerate(self.res.rings):  # any worker's GrowSlot or EpochDone: NOTE [ring] (e)
            if ring.sent() != self.seen[w]:
                self._read_socket(w, None)
        key = None
        if self.ordered:
            w = self.active[self.pos]
            key = (w, self.next_seq[w])
            msg = self.stash.pop(key, None)
            if msg is None:
                self._drain(w, key)  # fast path: it is usually in the ring (or the socket) already
                msg = self.stash.pop(key, None)
            if msg is not None:
                return w, msg
        (w, _), msg = self._receive(key)
        return w, msg

    def _receive(self, key: Key | None) -> tuple[Key, EpochMessage]:
        """Wait (with a deadline, watching every worker) until message `key` — or with key=None any worker's next
        message (`_ready`) — has arrived; returns (key, message)."""
        for w in [key[0]] if key is not None else range(self.num_workers):
            self._drain(w, key)
        deadline, recheck = time.monotonic() + self.timeout, RECHECK_S
        while (key not in self.stash) if key is not None else (ready := self._ready()) is None:
            self.lender.flush()  # batches released by other threads: NOTE [batch lifetime] (d)
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoaderTimeoutError(f"no {_what(key)} from the data workers of rank {self.rank} within "
                                         f"{self.timeout:g} s (epoch {self.epoch}); the workers are alive")
            piped, exited = self._sleep(min(left, self.poll_s), recheck)
            recheck = min(2 * recheck, RECHECK_MAX_S)
            for w in range(self.num_workers):  # a dead worker's last messages (its failure) are read before its
                self._drain(w, key, woke=w in piped)  # death is reported
            for w in exited:
                self.fail_dead(w, f"while the trainer waited for {_what(key)}")
        if key is None:
            assert ready is not None  # the loop above ends only when a message is ready
            key = ready
        return key, self.stash.pop(key)

    def _ready(self) -> Key | None:
        """Unordered: of the messages each worker is due to send next, the one received first. A worker's own
        messages are still taken in its order: its socket and its ring may deliver them out of it (NOTE [ring] (a)
        in ring.py), and an EpochDone must not overtake the batches before it."""
        for key in self.stash:
            if key[1] == self.next_seq[key[0]]:
                return key
        return None

    def _sleep(self, timeout: float, recheck: float) -> tuple[list[int], list[int]]:
        """Wait for the workers' sockets and processes (Watch.wait); with rings, NOTE [ring] (d)'s wake-up protocol
        and at most `recheck` s."""
        rings, watch = self.res.rings, self.watch
        assert watch is not None  # armed only after `connected`
        if not rings:
            return watch.wait(timeout)
        for ring in rings:
            ring.set_waiting(True)
        try:
            if any(ring.published() for ring in rings):  # published before the flag was seen: no doorbell
                return [], []
            return watch.wait(min(timeout, recheck))
        finally:
            for ring in rings:
                ring.set_waiting(False)

    def _take_ring(self, w: int) -> None:
        """Take in the batches worker `w` has published in its ring (NOTE [ring] in ring.py)."""
        try:
            taken = self.res.rings[w].take()
        except ValueError as exc:
            raise LoaderError(f"data worker {w} of rank {self.rank}: {exc}") from exc
        filed = 0
        try:
            for gen, seq, slot, layout_id in taken:
                if gen == self.gen:
                    self.stash[(w, seq)] = Batch(gen, seq, slot, layout_id)
                else:  # from an abandoned iteration: the slot goes straight back
                    self.give_back(slot)
                filed += 1
        except BaseException:  # e.g. KeyboardInterrupt: the slots of descriptors not filed must not be lost
            self.spent = True
            for _, _, slot, _ in taken[filed + 1:]:
                self.give_back(slot, quiet=True)
            raise

    def _drain(self, w: int, due: Key | None, *, woke: bool = False) -> None:
        """Take in every message worker `w` has sent so far: its ring, then its socket if anything was sent on it
        or it woke our poll (`woke`) (NOTE [ring] (e) in ring.py; without rings, always the socket)."""
        rings = self.res.rings
        if rings:
            self._take_ring(w)
            if not woke and rings[w].sent() == self.seen[w]:
                return
        self._read_socket(w, due)

    def _read_socket(self, w: int, due: Key | None) -> None:
        """One read of worker `w`'s socket, taking in every message in it (NOTE [wire] in channel.py)."""
        if self.res.rings:
            self.seen[w] = self.res.rings[w].sent()  # before the read: every message it counts is in the socket
        try:
            msgs = self.res.conns[w].receive()
        except (EOFError, OSError):
            self.fail_dead(w, f"while the trainer waited for {_what(due)}")
        except ValueError as exc:  # a corrupt frame
            raise LoaderError(f"data worker {w} of rank {self.rank}: {exc}") from exc
        for msg in msgs:
            if type(msg) is Batch and msg.layout is None and msg.generation == self.gen:
                self.stash[(w, msg.seq)] = msg  # the common case, ahead of _on_message's match
            else:
                self._on_message(w, msg)

    def _on_message(self, w: int, msg: FromWorker) -> None:
        if isinstance(msg, Batch) and msg.layout is not None and msg.layout_id >= 0:  # protocol.Batch
            self.layouts[w][msg.layout_id] = shm.CompiledLayout(msg.layout)
        match msg:
            case GrowSlot(slot=slot, nbytes=nbytes, full=full):
                self.grow(slot, nbytes, full)
            case Batch() | EpochDone() | WorkerFailed() if msg.generation == self.gen:
                self.stash[(w, msg.seq)] = msg
            case Batch(slot=slot):  # from an abandoned iteration: the slot goes straight back
                self.give_back(slot)
            case EpochDone() | WorkerFailed():
                pass  # the end or failure of an abandoned iteration

    # ---- the wire and the slots --------------------------------------------------------------------------------

    def send(self, w: int, msg: ToWorker, *, quiet: bool = False) -> None:
        """quiet: a dead worker is left for the next wait to report (its sentinel); else WorkerDiedError."""
        try:
            self.res.conns[w].send(msg)
        except OSError:
            if not quiet:
                self.fail_dead(w, "when the trainer wrote to it")

    def give_back(self, slot: int, *, quiet: bool = False) -> None:
        """Hand `slot` back to its worker."""
        seg = self.res.segments.get(slot)
        self.send(slot // self.spw, FreeSlot(slot, seg.name if seg else None, seg.size if seg else 0), quiet=quiet)

    def grow(self, slot: int, nbytes: int, full: str = "") -> None:
        """Answer a GrowSlot: a new segment, made sparse (its producer reserves it: NOTE [shm reservation] in
        shm.py); `full`: the producer could not reserve the last one."""
        old = self.res.segments.pop(slot, None)
        if old is not None:
            self.res.drop_segment(old)
        try:
            if full:
                raise self._full(SharedMemoryFullError(full), nbytes, "batch")
            self.res.segments[slot] = self.new_segment(max(nbytes, 1), reserve=False)
        except SharedMemoryFullError:
            self.close()  # the producers wait for this slot: no batch can come
            raise
        self.give_back(slot)

    def new_segment(self, nbytes: int, what: str = "batch", *, reserve: bool = True) -> shm.Segment:
        try:
            return shm.create_segment(nbytes, what, reserve=reserve)
        except SharedMemoryFullError as exc:  # NOTE [shm reservation] in shm.py: before any producer wrote
            raise self._full(exc, nbytes, what) from None

    def _full(self, exc: SharedMemoryFullError, nbytes: int, what: str) -> SharedMemoryFullError:
        text = shm.full_message(exc, rank=self.rank, batch_bytes=SLOT_BYTES if what != "batch" else nbytes,
                                workers=self.num_workers, slots_per_worker=self.spw, first=what != "batch")
        return SharedMemoryFullError(text)

    def fail_dead(self, w: int, when: str) -> NoReturn:
        proc = self.res.procs[w]
        proc.join(timeout=1.0)
        msg = (f"data worker {w} (pid {proc.pid}) of rank {self.rank} died with {describe_exit(proc.exitcode)} "
               f"{when} (epoch {self.epoch}); the loader is closed")
        self.close()
        raise WorkerDiedError(msg)


def _what(key: Key | None) -> str:
    return "a batch" if key is None else f"batch {key[1]} of worker {key[0]}"


def _shut_down(res: Resources, lender: Lender) -> None:
    """The receiver's finalizer (close(), GC or interpreter exit): batches released later go nowhere."""
    lender.close()
    res.shutdown()
