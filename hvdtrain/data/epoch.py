"""One pass of an ShmLoader over an epoch: receiving the workers' messages and yielding their batches in order."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from hvdtrain.data import shm
from hvdtrain.data.lifecycle import LoaderError, LoaderTimeoutError, WorkerError
from hvdtrain.data.protocol import Batch, EpochDone, EpochMessage, FromWorker, GrowSlot, WorkerFailed

if TYPE_CHECKING:
    from hvdtrain.data.loader import ShmLoader

Key = tuple[int, int]  # (worker, seq): where a worker's batch `seq` (or its EpochDone/WorkerFailed) is filed


class EpochIterator:
    """What `iter(loader)` returns: round robin over the workers, each worker's batches in its order (with
    `ordered=False`: whichever batch arrives first).

    It owns the iteration's receive state: the messages that arrived ahead of their turn (`stash`, by (worker,
    seq)), the workers still producing, the seq each is due to send next and the round robin's position. The loader
    keeps a reference to `stash` only, so that the next `iter()` can give the slots of batches received but never
    yielded back to their workers even when this iterator is gone. The resume position (batches consumed) is the
    loader's: it outlives the iterator (`state_dict()` after the epoch, `load_state_dict()` before the next one).
    """

    def __init__(self, loader: ShmLoader, gen: int, skip: int) -> None:
        self.loader, self.gen = loader, gen
        self.skip = skip  # batches still to produce and drop (generator mode resuming mid-epoch)
        self.stash: dict[Key, EpochMessage] = {}
        self.active = list(range(loader.num_workers))  # workers that have not sent EpochDone
        self.next_seq = [0] * loader.num_workers
        self.pos = 0  # index into `active` of the worker whose batch is due (ordered mode)
        self.done = False

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        ld = self.loader
        if self.done:
            raise StopIteration
        if ld._closed or ld._gen != self.gen:
            raise LoaderError("this iterator is stale: the loader was closed or iterated again")
        with ld._lender:  # NOTE [batch lifetime] (d)
            return self._next_batch()

    # ---- yielding --------------------------------------------------------------------------------------------

    def _next_batch(self) -> Any:
        # The hot path of a small batch (NOTE [wire] in channel.py): a Batch is tested first, with `type() is`.
        ld = self.loader
        while True:
            limit = ld.batches_per_epoch
            if not self.active or (limit is not None and ld._consumed >= limit):
                return self._finish()
            w, msg = self._receive_due()
            if type(msg) is Batch:
                self._advance(w, ended=False)
                ld._count_consumed()
                if self.skip > 0:
                    self.skip -= 1
                    ld._give_back(msg.slot)
                    continue
                return self._lend(msg.slot, ld._layouts[msg.slot])
            if isinstance(msg, WorkerFailed):
                self.done = True
                raise WorkerError(f"data worker {w} of rank {ld.rank} failed in epoch {ld.epoch} at its batch "
                                  f"{msg.seq}:\n{msg.traceback}", message=msg.message, bad_data=msg.bad_data)
            self._advance(w, ended=True)  # EpochDone

    def _lend(self, slot: int, reader: shm.Reader) -> Any:
        ld = self.loader
        try:
            batch, lent = ld._lender.lend(ld._res.segments[slot], slot, reader)
        except BaseException:  # e.g. KeyboardInterrupt mid-hand-off: the slot must not be lost
            if not ld._lender.tracks(slot):
                ld._give_back(slot, quiet=True)
            raise
        if not lent:  # handed out as a copy: NOTE [batch lifetime] (c)
            ld._give_back(slot)
        return batch

    def _advance(self, w: int, ended: bool) -> None:
        """Move the round robin on: past worker w, or dropping w when it has no more batches."""
        if ended:
            self.active.remove(w)
        else:
            self.next_seq[w] += 1
        if self.active and self.loader.ordered:
            self.pos = self.pos % len(self.active) if ended else (self.pos + 1) % len(self.active)

    def _finish(self) -> Any:
        self.done = True
        ld = self.loader
        ld._completed_epoch = ld.epoch
        if not self.active:  # the epoch ended: the next one can start now (NOTE [epoch ahead] in loader.py)
            ld._start_ahead()
        raise StopIteration

    # ---- receiving -------------------------------------------------------------------------------------------

    def _receive_due(self) -> tuple[int, EpochMessage]:
        """(worker, message) of the next message to act on: the due worker's next one, or (unordered) any."""
        if self.loader.ordered:
            w = self.active[self.pos]
            key = (w, self.next_seq[w])
            msg = self.stash.pop(key, None)
            if msg is None:
                self._drain(w, key)  # fast path: it is usually in the socket already
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
        """Wait (with a deadline, watching every worker) until message `key` — or with key=None any message of
        this iteration — has arrived; returns (key, message)."""
        ld = self.loader
        for w in [key[0]] if key is not None else range(ld.num_workers):
            self._drain(w, key)
        deadline = time.monotonic() + ld.timeout
        while (key not in self.stash) if key is not None else not self.stash:
            ld._lender.flush()  # batches released by other threads: NOTE [batch lifetime] (d)
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoaderTimeoutError(f"no {_what(key)} from the data workers of rank {ld.rank} within "
                                         f"{ld.timeout:g} s (epoch {ld.epoch}); the workers are alive")
            piped, exited = ld._watch.wait(min(left, ld.poll_s))
            for w in piped:  # a dead worker's last messages (its failure) are read before its death is reported
                self._drain(w, key)
            for w in exited:
                ld._fail_dead(w, f"while the trainer waited for {_what(key)}")
        key = key if key is not None else next(iter(self.stash))  # arrival order
        return key, self.stash.pop(key)

    def _drain(self, w: int, due: Key | None) -> None:
        """Take in every message worker `w` has sent so far (one read: NOTE [wire] in channel.py)."""
        try:
            msgs = self.loader._res.conns[w].receive()
        except (EOFError, OSError):
            self.loader._fail_dead(w, f"while the trainer waited for {_what(due)}")
        for msg in msgs:
            if type(msg) is Batch and msg.layout is None and msg.generation == self.gen:
                self.stash[(w, msg.seq)] = msg  # the common case, ahead of _on_message's match
            else:
                self._on_message(w, msg)

    def _on_message(self, w: int, msg: FromWorker) -> None:
        if isinstance(msg, Batch) and msg.layout is not None:  # every Batch is read, in order: protocol.Batch
            self.loader._layouts[msg.slot] = shm.Reader(msg.layout)
        match msg:
            case GrowSlot(slot=slot, nbytes=nbytes):
                self.loader._grow(slot, nbytes)
            case Batch() | EpochDone() | WorkerFailed() if msg.generation == self.gen:
                self.stash[(w, msg.seq)] = msg
            case Batch(slot=slot):  # from an abandoned iteration: the slot goes straight back
                self.loader._give_back(slot)
            case EpochDone() | WorkerFailed():
                pass  # the end or failure of an abandoned iteration


def _what(key: Key | None) -> str:
    return "a batch" if key is None else f"batch {key[1]} of worker {key[0]}"
