"""One pass of an ShmLoader over an epoch: receiving the workers' messages and yielding their batches in order.

The iterator sees its loader only through an `EpochLink`, which the loader fills in at each `iter()`: this module
never imports loader.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from hvdtrain.data import shm
from hvdtrain.data.errors import LoaderError, LoaderTimeoutError, WorkerError
from hvdtrain.data.protocol import Batch, EpochDone, EpochMessage, FromWorker, GrowSlot, WorkerFailed
from hvdtrain.data.ring import RECHECK_MAX_S, RECHECK_S

if TYPE_CHECKING:
    from hvdtrain.data.channel import Channel
    from hvdtrain.data.lending import Lender
    from hvdtrain.data.resources import Watch
    from hvdtrain.data.ring import Ring

Key = tuple[int, int]  # (worker, seq): where a worker's batch `seq` (or its EpochDone/WorkerFailed) is filed


@dataclass(frozen=True)
class EpochLink:
    """Everything an EpochIterator uses of its loader, and nothing else; the loader builds one per `iter()`.

    The lists and dicts are the loader's own (shared, not copied): the workers' sockets, rings (empty without
    them: NOTE [ring] in ring.py) and slot segments, and the receive state that outlives an iteration — each
    worker's numbered layouts (protocol.Batch) and its ring's `sent` count at our last socket read (NOTE [ring]
    (e)). The callables are the loader's: they read its state when called (its epoch may be set mid-iteration)."""

    # the loader's settings
    rank: int
    num_workers: int
    ordered: bool
    timeout: float
    poll_s: float
    batches_per_epoch: int | None  # generator mode's cap on an epoch (None: no cap)
    # the wiring to the workers, by worker (segments: by slot)
    conns: list[Channel]
    rings: list[Ring]
    segments: dict[int, shm.Segment]
    watch: Watch  # waits on the sockets and the process sentinels
    layouts: list[dict[int, shm.CompiledLayout]]  # layout number -> that layout, made ready to read
    seen: list[int]
    lender: Lender  # NOTE [batch lifetime] in lending.py
    # the loader's side
    current: Callable[[], bool]  # False once the loader is closed or iterated again: the iterator is stale
    epoch: Callable[[], int]  # for messages
    consumed: Callable[[], int]  # generator mode: batches of this epoch consumed so far
    count_consumed: Callable[[], None]  # one more batch consumed (yielded, or skipped when resuming)
    finished: Callable[[bool], None]  # the iteration stopped; True: every worker sent EpochDone
    give_back: Callable[..., None]  # (slot, *, quiet=False): the slot goes back to its worker
    grow: Callable[[int, int, str], None]  # (slot, nbytes, full): a GrowSlot, answered
    fail_dead: Callable[[int, str], NoReturn]  # (worker, when): WorkerDiedError, the loader closed


class EpochIterator:
    """What `iter(loader)` returns: round robin over the workers, each worker's batches in its order (with
    `ordered=False`: whichever worker's next batch arrives first).

    It owns the iteration's receive state: the messages that arrived ahead of their turn (`stash`, by (worker,
    seq)), the workers still producing, the seq each is due to send next and the round robin's position. The loader
    keeps a reference to `stash` only, so that the next `iter()` can give the slots of batches received but never
    yielded back to their workers even when this iterator is gone. The resume position (batches consumed) is the
    loader's: it outlives the iterator (`state_dict()` after the epoch, `load_state_dict()` before the next one).
    """

    def __init__(self, link: EpochLink, gen: int, skip: int) -> None:
        self.link, self.gen = link, gen
        self.skip = skip  # batches still to produce and drop (generator mode resuming mid-epoch)
        self.stash: dict[Key, EpochMessage] = {}
        self.active = list(range(link.num_workers))  # workers that have not sent EpochDone
        self.next_seq = [0] * link.num_workers
        self.pos = 0  # index into `active` of the worker whose batch is due (ordered mode)
        self.done = False

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        if not self.link.current():
            raise LoaderError("this iterator is stale: the loader was closed or iterated again")
        with self.link.lender:  # NOTE [batch lifetime] (d)
            return self._next_batch()

    # ---- yielding --------------------------------------------------------------------------------------------

    def _next_batch(self) -> Any:
        # The hot path of a small batch (NOTE [wire] in channel.py): a Batch is tested first, with `type() is`.
        link = self.link
        while True:
            limit = link.batches_per_epoch
            if not self.active or (limit is not None and link.consumed() >= limit):
                return self._finish()
            w, msg = self._receive_due()
            if type(msg) is Batch:
                try:
                    reader = self._reader(w, msg)
                except BaseException:  # e.g. KeyboardInterrupt in its socket read: the slot must not be lost
                    self.done = True
                    link.give_back(msg.slot, quiet=True)
                    raise
                self._advance(w, ended=False)
                link.count_consumed()
                if self.skip > 0:
                    self.skip -= 1
                    link.give_back(msg.slot)
                    continue
                return self._lend(msg.slot, reader)
            if isinstance(msg, WorkerFailed):
                self.done = True
                raise WorkerError(f"data worker {w} of rank {link.rank} failed in epoch {link.epoch()} at its batch "
                                  f"{msg.seq}:\n{msg.traceback}", message=msg.message, bad_data=msg.bad_data)
            self._advance(w, ended=True)  # EpochDone

    def _lend(self, slot: int, reader: shm.CompiledLayout) -> Any:
        link = self.link
        try:
            batch, lent = link.lender.lend(link.segments[slot], slot, reader)
        except BaseException:  # e.g. KeyboardInterrupt mid-hand-off: the slot must not be lost
            if not link.lender.tracks(slot):
                link.give_back(slot, quiet=True)
            raise
        if not lent:  # handed out as a copy: NOTE [batch lifetime] (c)
            link.give_back(slot)
        return batch

    def _reader(self, w: int, msg: Batch) -> shm.CompiledLayout:
        """The layout of batch `msg` of worker `w`, resolved now, in the worker's order (protocol.Batch)."""
        if msg.layout_id < 0:
            return shm.CompiledLayout(msg.layout)  # type: ignore[arg-type]  # not numbered: always sent
        known = self.link.layouts[w]
        if msg.layout_id not in known:  # its layout is still in the socket: NOTE [ring] (a) in ring.py
            self._drain(w, None)
        try:
            return known[msg.layout_id]
        except KeyError:
            raise LoaderError(f"data worker {w} of rank {self.link.rank} sent batch {msg.seq} with layout "
                              f"{msg.layout_id}, which it never described") from None

    def _advance(self, w: int, ended: bool) -> None:
        """Move the round robin on: past worker w, or dropping w when it has no more batches."""
        if ended:
            self.active.remove(w)
        else:
            self.next_seq[w] += 1
        if self.active and self.link.ordered:
            self.pos = self.pos % len(self.active) if ended else (self.pos + 1) % len(self.active)

    def _finish(self) -> Any:
        self.done = True
        # with every EpochDone in, the epoch ended: the next one can start now (NOTE [epoch ahead] in loader.py)
        self.link.finished(not self.active)
        raise StopIteration

    # ---- receiving -------------------------------------------------------------------------------------------

    def _receive_due(self) -> tuple[int, EpochMessage]:
        """(worker, message) of the next message to act on: the due worker's next one, or (unordered) any."""
        link = self.link
        try:
            for w, ring in enumerate(link.rings):  # any worker's GrowSlot or EpochDone: NOTE [ring] (e)
                if ring.sent() != link.seen[w]:
                    self._read_socket(w, None)
        except LoaderError:
            self.done = True
            raise
        if link.ordered:
            w = self.active[self.pos]
            key = (w, self.next_seq[w])
            msg = self.stash.pop(key, None)
            if msg is None:
                self._drain(w, key)  # fast path: it is usually in the ring (or the socket) already
                msg = self.stash.pop(key, None)
            if msg is not None:
                return w, msg
        else:
            key = None
        try:
            (w, _), msg = self._receive(key)
        except LoaderError:
            self.done = True
            raise
        return w, msg

    def _receive(self, key: Key | None) -> tuple[Key, EpochMessage]:
        """Wait (with a deadline, watching every worker) until message `key` — or with key=None any worker's next
        message (`_ready`) — has arrived; returns (key, message)."""
        link = self.link
        for w in [key[0]] if key is not None else range(link.num_workers):
            self._drain(w, key)
        deadline, recheck = time.monotonic() + link.timeout, RECHECK_S
        while (key not in self.stash) if key is not None else (ready := self._ready()) is None:
            link.lender.flush()  # batches released by other threads: NOTE [batch lifetime] (d)
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoaderTimeoutError(f"no {_what(key)} from the data workers of rank {link.rank} within "
                                         f"{link.timeout:g} s (epoch {link.epoch()}); the workers are alive")
            piped, exited = self._sleep(min(left, link.poll_s), recheck)
            recheck = min(2 * recheck, RECHECK_MAX_S)
            for w in range(link.num_workers):  # a dead worker's last messages (its failure) are read before its
                self._drain(w, key, woke=w in piped)  # death is reported
            for w in exited:
                link.fail_dead(w, f"while the trainer waited for {_what(key)}")
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
        rings, watch = self.link.rings, self.link.watch
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
            taken = self.link.rings[w].take()
        except ValueError as exc:
            raise LoaderError(f"data worker {w} of rank {self.link.rank}: {exc}") from exc
        filed = 0
        try:
            for gen, seq, slot, layout_id in taken:
                if gen == self.gen:
                    self.stash[(w, seq)] = Batch(gen, seq, slot, layout_id)
                else:  # from an abandoned iteration: the slot goes straight back
                    self.link.give_back(slot)
                filed += 1
        except BaseException:  # e.g. KeyboardInterrupt: the slots of descriptors not filed must not be lost
            self.done = True
            for _, _, slot, _ in taken[filed + 1:]:
                self.link.give_back(slot, quiet=True)
            raise

    def _drain(self, w: int, due: Key | None, *, woke: bool = False) -> None:
        """Take in every message worker `w` has sent so far: its ring, then its socket if anything was sent on it
        or it woke our poll (`woke`) (NOTE [ring] (e) in ring.py; without rings, always the socket)."""
        rings = self.link.rings
        if rings:
            self._take_ring(w)
            if not woke and rings[w].sent() == self.link.seen[w]:
                return
        self._read_socket(w, due)

    def _read_socket(self, w: int, due: Key | None) -> None:
        """One read of worker `w`'s socket, taking in every message in it (NOTE [wire] in channel.py)."""
        link = self.link
        if link.rings:
            link.seen[w] = link.rings[w].sent()  # before the read: every message it counts is in the socket
        try:
            msgs = link.conns[w].receive()
        except (EOFError, OSError):
            link.fail_dead(w, f"while the trainer waited for {_what(due)}")
        except ValueError as exc:  # a corrupt frame
            raise LoaderError(f"data worker {w} of rank {link.rank}: {exc}") from exc
        for msg in msgs:
            if type(msg) is Batch and msg.layout is None and msg.generation == self.gen:
                self.stash[(w, msg.seq)] = msg  # the common case, ahead of _on_message's match
            else:
                self._on_message(w, msg)

    def _on_message(self, w: int, msg: FromWorker) -> None:
        if isinstance(msg, Batch) and msg.layout is not None and msg.layout_id >= 0:  # protocol.Batch
            self.link.layouts[w][msg.layout_id] = shm.CompiledLayout(msg.layout)
        match msg:
            case GrowSlot(slot=slot, nbytes=nbytes, full=full):
                self.link.grow(slot, nbytes, full)
            case Batch() | EpochDone() | WorkerFailed() if msg.generation == self.gen:
                self.stash[(w, msg.seq)] = msg
            case Batch(slot=slot):  # from an abandoned iteration: the slot goes straight back
                self.link.give_back(slot)
            case EpochDone() | WorkerFailed():
                pass  # the end or failure of an abandoned iteration


def _what(key: Key | None) -> str:
    return "a batch" if key is None else f"batch {key[1]} of worker {key[0]}"
