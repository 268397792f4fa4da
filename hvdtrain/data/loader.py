"""ShmLoader: persistent producer processes hand batches to the trainer through shared memory, without pickling.

The producer side is workers.py, the messages between the two protocol.py, the trainer's end of the wire and the
receive state of a pass over an epoch receiver.py (NOTE [one receiver]), the loader's errors errors.py. Process and
segment lifetimes and shutdown: NOTE [loader shutdown] in resources.py.

NOTE [epoch ahead]
The order of the epoch that comes next is known, so the loader starts it before it is asked for: otherwise every
`iter()` would begin with a round trip (StartEpoch to the workers, which only then build the epoch's shard and
produce) that the trainer waits for on each epoch's first step.
(a) When an iteration has received every worker's EpochDone (the loop ran to its end), the loader sends StartEpoch
    for the iteration it expects next — the next epoch from its first batch, or the same epoch again if the user's
    last iteration repeated its epoch without a resume — under a new generation, and remembers (generation, start
    state). The workers fill their free slots as for any iteration; nobody reads their sockets until the next
    `iter()`. Not at construction: a resumed run asks for another epoch first, and a streamed dataset would fetch
    shards of an epoch nobody reads.
(b) `iter()` takes that iteration over when its own start state is the one remembered (no load_state_dict(), the
    epoch guessed): it reads that generation and sends nothing. Otherwise it starts a new generation: the workers
    drop the early one at their next batch, and its batches are given back as they are read (a stale generation),
    so a wrong guess costs at most `prefetch + 2` batches of work per worker, never a wrong batch.
(c) `ShmLoader(dataset)` only: a generator's epochs are user code that need not be repeatable, so they start
    when asked.
    A failure in an epoch started early is reported only if that epoch is taken over (the iteration that replaces
    a dropped one meets it again).
(d) `epochs=N` (the recipes pass theirs) names the last epoch, N - 1: no epoch >= N is started ahead. Without it,
    after the last epoch the workers make the first batches of an epoch nobody asks for, until `close()`, and a
    streamed dataset also fetches that epoch's first shards (hvdtrain/stream/fetcher.py): egress for nothing.
"""

from __future__ import annotations

import copy
import socket
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from hvdtrain.data import forked, ring
from hvdtrain.data.boot import ProducerProcess, start_producer
from hvdtrain.data.channel import Channel
from hvdtrain.data.errors import LoaderError
from hvdtrain.data.protocol import FreeSlot
from hvdtrain.data.receiver import END, Receiver
from hvdtrain.data.resources import Resources, trainer_fds
from hvdtrain.data.sharding import ShardSampler, check_positive, check_rank, check_unconsumed
from hvdtrain.data.workers import WorkerConfig
from hvdtrain.settings.loader import PREFETCH, SLOT_BYTES  # SLOT_BYTES: each slot's first segment

__all__ = ["ShmLoader"]



class EpochIterator:
    """What `iter(loader)` returns: iteration `gen`'s batches from the loader's receiver while it is armed for it
    (NOTE [one receiver] in receiver.py); `ended()` is the loader's, called once when the iteration ran out."""

    __slots__ = ("_done", "_ended", "_gen", "_rx")

    def __init__(self, rx: Receiver, gen: int, ended: Callable[[], None]) -> None:
        self._rx, self._gen, self._ended, self._done = rx, gen, ended, False

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        rx = self._rx
        if rx.closed or rx.gen != self._gen:
            raise LoaderError("this iterator is stale: the loader was closed or iterated again")
        try:
            batch = rx.next_batch()
        except LoaderError:
            self._done = True
            raise
        except BaseException:  # e.g. KeyboardInterrupt while waiting: the iteration goes on if nothing was lost
            self._done = rx.spent
            raise
        if batch is END:
            self._done = True
            self._ended()
            raise StopIteration
        return batch


def _check_common(num_workers: int, prefetch: int, epochs: int | None, timeout: float, poll_s: float,
                  start_method: str | None, import_main: bool) -> str:
    """ValueError naming the argument, its value and what is allowed (the arguments both constructors take); the
    start method to use (forked.choose_start_method)."""
    check_positive("num_workers", num_workers)
    check_positive("prefetch", prefetch)
    if epochs is not None:
        check_positive("epochs", epochs)
    for name, value in (("timeout", timeout), ("poll_s", poll_s)):
        if not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return forked.choose_start_method(start_method, import_main)


class ShmLoader:
    """Batches for one rank from `num_workers` persistent producer processes, handed over in shared memory.

    - `ShmLoader(dataset, rank=, size=, batch_size=)`: `dataset[i]` returns an array, a tuple/list or a dict of
      arrays, batched by `collate(list of samples)` (default: stack) or `fetch(dataset, indices) -> batch`, and
      sharded by a `ShardSampler(len(dataset), rank, size, seed=, shuffle=, drop_last=, even=)` (even=False:
      exact, possibly uneven shards for evaluation); `order(seed, epoch) -> permutation` replaces its shuffle (a
      streamed split's `.order`: blocks of a few shards). The next epoch starts ahead (NOTE [epoch ahead]).
    - `ShmLoader.from_generator(generator, rank=, size=)`: `generator(worker_id, num_workers, epoch, seed) ->
      iterator of batches`, where `worker_id`/`num_workers` count over all ranks (`rank * num_workers + local id`,
      `size * num_workers`: shard with `range(worker_id, n, num_workers)`) and `seed` is derived from (seed, rank,
      worker, epoch). `batches_per_epoch` caps an epoch (make it equal on every rank); ranks must otherwise yield
      the same number of batches themselves. Batches come worker 0, 1, ... round robin, or with `ordered=False`
      each worker's in its order, the workers' interleaved as they arrive (one slow producer does not hold up the
      others, at the price of a run-dependent order).
    Every worker seeds `random`, numpy and torch from its seed each epoch. `epochs` (optional): how many epochs the
    job iterates; no epoch past the last is started ahead (NOTE [epoch ahead]).

    Iterating yields numpy arrays that *view* a shared-memory slot (no copy), valid as long as any view of it (or
    a tensor made from one) is alive, also after `close()`. Each worker owns `prefetch + 1` slots; a batch that
    would leave its worker none is handed out as a private copy, so holding batches never aliases and never
    deadlocks (NOTE [batch lifetime] in lending.py). Workers live from the constructor to `close()` (idempotent;
    also on garbage collection and at exit; a context manager). `start_method`: None (the default) forks them from
    the trainer on Linux, as DataLoader does (NOTE [forked producers] in forked.py: they start in milliseconds and
    use the trainer's `dataset`, `collate`, `fetch` and `generator` as they are), unless the trainer runs a runtime
    a fork breaks (obstore's) or `import_main=True`; 'spawn' starts fresh interpreters, sent those objects with
    cloudpickle (lambdas, closures and `__main__` objects work), that do not re-run the training script unless
    `import_main=True` (NOTE [producer start] in boot.py). `start_method` (the attribute) says which was used. A
    loader creates and removes only its own segments (`sweep_stale_segments()` removes a crashed run's).
    """

    def __init__(self, dataset: Any, *, rank: int, size: int, batch_size: int, num_workers: int = 2, seed: int = 0,
                 collate: Callable[[list[Any]], Any] | None = None,
                 fetch: Callable[[Any, np.ndarray], Any] | None = None, shuffle: bool = True,
                 drop_last: bool = False, even: bool = True, order: Callable[[int, int], np.ndarray] | None = None,
                 prefetch: int = PREFETCH, epochs: int | None = None, timeout: float = 300.0, poll_s: float = 0.2,
                 start_method: str | None = None, import_main: bool = False) -> None:
        if dataset is None:
            raise ValueError("dataset is None: give an indexable dataset, or use ShmLoader.from_generator(generator, "
                             "...) for fn(worker_id, num_workers, epoch, seed) -> iterator of batches")
        check_positive("batch_size", batch_size)
        method = _check_common(num_workers, prefetch, epochs, timeout, poll_s, start_method, import_main)
        check_rank(rank, size)
        sampler = ShardSampler(len(dataset), rank, size, seed=seed, shuffle=shuffle, drop_last=drop_last,
                               batch_size=batch_size, even=even, order=order)
        plan = {"num_samples": len(dataset), "shuffle": shuffle, "drop_last": drop_last, "batch_size": batch_size,
                "even": even, "order": order}
        config = WorkerConfig(0, num_workers, rank, size, seed, poll_s, epochs=epochs, dataset=dataset,
                              collate=collate, fetch=fetch, sampler_args=plan)
        self._open(config, sampler, batch_size=batch_size, prefetch=prefetch, timeout=timeout,
                   batches_per_epoch=None, ordered=True, start=(method, import_main))

    @classmethod
    def from_generator(cls, generator: Callable[[int, int, int, int], Any], *, rank: int, size: int,
                       batches_per_epoch: int | None = None, ordered: bool = True, num_workers: int = 2,
                       seed: int = 0, prefetch: int = PREFETCH, epochs: int | None = None, timeout: float = 300.0,
                       poll_s: float = 0.2, start_method: str | None = None, import_main: bool = False) -> ShmLoader:
        """A loader whose workers run `generator` (see the class docstring); its epochs start when asked."""
        if not callable(generator):
            raise ValueError(f"generator must be callable as fn(worker_id, num_workers, epoch, seed) -> iterator of "
                             f"batches, got {type(generator).__name__}")
        if batches_per_epoch is not None:
            check_positive("batches_per_epoch", batches_per_epoch)
        method = _check_common(num_workers, prefetch, epochs, timeout, poll_s, start_method, import_main)
        check_rank(rank, size)
        loader = cls.__new__(cls)
        config = WorkerConfig(0, num_workers, rank, size, seed, poll_s, epochs=epochs, generator=generator)
        loader._open(config, None, batch_size=None, prefetch=prefetch, timeout=timeout,
                     batches_per_epoch=batches_per_epoch, ordered=ordered, start=(method, import_main))
        return loader

    def _open(self, base: WorkerConfig, sampler: ShardSampler | None, *, batch_size: int | None, prefetch: int,
              timeout: float, batches_per_epoch: int | None, ordered: bool, start: tuple[str, bool]) -> None:
        """State both constructors share, then the workers' start (a failed start closes what was made)."""
        self.sampler, self.rank, self.size, self.batch_size = sampler, base.rank, base.size, batch_size
        self.num_workers, self.seed, self.prefetch = base.workers_per_rank, base.seed, prefetch
        self.timeout, self.poll_s, self.start_method = timeout, base.poll_s, start[0]
        self.batches_per_epoch, self.ordered, self.epochs = batches_per_epoch, ordered, base.epochs
        self.dataset, self.collate, self.fetch, self.generator = base.dataset, base.collate, base.fetch, base.generator
        self.epoch, self._gen = 0, 0  # _gen numbers the iterations: StartEpoch and every EpochMessage carry it
        self._consumed = 0  # generator mode's position: batches of this epoch consumed (else the sampler's)
        self._settled = 0  # of the receiver's `consumed`, what is in the position already (`_settle`)
        self._resume_pending = False
        self._completed_epoch: int | None = None
        # NOTE [epoch ahead]: the iteration started before `iter()` asked for it, as (generation, sampler state),
        # and whether the user's iterations move on to the next epoch (else the same epoch is predicted).
        self._ahead: tuple[int, dict[str, Any]] | None = None
        self._last_epoch: int | None = None
        self._advancing = True
        self._spw = prefetch + 1  # slots per worker: prefetch ahead + the one the step holds
        self._res = Resources()  # the workers start into it; the receiver reads from it and shuts it down
        self._rx = Receiver(self._res, rank=self.rank, num_workers=self.num_workers, slots_per_worker=self._spw,
                            ordered=ordered, timeout=timeout, poll_s=self.poll_s, cap=batches_per_epoch)
        try:
            self._start(base, start[1])
            self._rx.connected()
        except BaseException:
            self.close()
            raise

    def _start(self, base: WorkerConfig, import_main: bool) -> None:
        gate = socket.socketpair() if self.num_workers > 1 else None  # NOTE [first producer first] in boot.py
        try:
            for w in range(self.num_workers):
                base.local_id = w
                if ring.SUPPORTED:  # NOTE [ring] in ring.py
                    seg = self._rx.new_segment(ring.Ring.nbytes(self._spw), "ring")
                    self._res.rings.append(ring.Ring(seg, self._spw))
                    base.ring, base.ring_capacity = self._res.rings[-1].seg.name, self._spw
                mine, theirs = Channel.pair()
                started = gate[0] if gate is not None and w == 0 else None  # producer 0 signals its first batch
                wait_for = gate[1] if gate is not None and w > 0 else None  # the others wait for it
                self._res.conns.append(mine)
                try:
                    self._res.procs.append(self._start_one(base, theirs, started, wait_for, gate, import_main))
                finally:
                    theirs.close()
                for slot in range(w * self._spw, (w + 1) * self._spw):  # slot memory up front: SLOT_BYTES
                    seg = self._res.segments[slot] = self._rx.new_segment(SLOT_BYTES, "first slot")
                    mine.send(FreeSlot(slot, seg.name, seg.size))
        finally:
            for end in gate or ():
                end.close()  # the producers have their copies: only producer 0's can signal or close it

    def _start_one(self, base: WorkerConfig, theirs: Channel, started: socket.socket | None,
                   wait_for: socket.socket | None, gate: tuple[socket.socket, socket.socket] | None,
                   import_main: bool) -> ProducerProcess | forked.ForkedProcess:
        """Producer `base.local_id`, forked (NOTE [forked producers] in forked.py) or a fresh interpreter (NOTE
        [producer start] in boot.py)."""
        if self.start_method == "fork":
            others = [*trainer_fds(), *(end.fileno() for end in gate or ())]  # the gate end not its own, too
            return forked.fork_producer(base, theirs, started, wait_for, others)
        import cloudpickle

        return start_producer(f"hvdtrain-data-r{self.rank}-w{base.local_id}", cloudpickle.dumps(base), theirs.sock,
                              started, wait_for, import_main=import_main, timeout=self.timeout)

    # ---- public API ----------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch than the current one starts at its beginning (0 batches consumed,
        a loaded resume state dropped), the same one keeps its position (as `ShardSampler.set_epoch`)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self._settle()
        if epoch != self.epoch:
            self._consumed, self._resume_pending = 0, False
        self.epoch = epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        """Epoch and batches consumed (= yielded to the trainer) so far in it (dataset mode: the sampler's state).

        `unconsumed=k`: the state before the last `k` batches yielded, for a caller that has taken `k` batches it
        has not trained on yet (DevicePrefetcher's look-ahead); resuming from it yields those `k` again.
        ValueError unless 0 <= k <= batches consumed."""
        self._settle()
        if self.sampler is not None:
            return self.sampler.state_dict(unconsumed=unconsumed)
        return {"epoch": self.epoch, "batches_consumed": self._consumed - check_unconsumed(unconsumed, self._consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration resumes after the consumed batches (generator mode: they are produced and skipped)."""
        self._settle()  # the armed iteration's count belongs to the position this replaces
        if self.sampler is not None:
            self.sampler.load_state_dict(state)
            self.epoch = self.sampler.epoch
        else:
            self.epoch, self._consumed = int(state["epoch"]), int(state["batches_consumed"])
        self._resume_pending = True

    def __len__(self) -> int:
        if self.sampler is not None:
            return self.sampler.shard_batches - (self.sampler.batches_consumed if self._resume_pending else 0)
        if self.batches_per_epoch is None:
            raise TypeError("a generator ShmLoader has no length unless batches_per_epoch is given")
        return self.batches_per_epoch - (self._consumed if self._resume_pending else 0)

    def __iter__(self) -> EpochIterator:
        self._check_open()
        self._settle()
        if (self._completed_epoch == self.epoch and not self._resume_pending and self.sampler is not None
                and self.sampler.shuffle):
            warnings.warn(f"ShmLoader: iterating epoch {self.epoch} again with the same order; call "
                          "set_epoch(epoch) every epoch", stacklevel=2)
        # Generator mode resumes by producing and skipping the consumed batches (the order is deterministic).
        skip = self._consumed if self._resume_pending and self.sampler is None else 0
        if not self._resume_pending and self.sampler is not None:
            self.sampler.rewind()
        resumed = self._resume_pending
        self._consumed, self._resume_pending = 0, False
        state = None if self.sampler is None else self.sampler.state_dict()
        ahead, self._ahead = self._ahead, None
        adopt = ahead is not None and ahead == (self._gen, state)  # NOTE [epoch ahead]
        self._advancing = self.epoch != self._last_epoch or resumed  # a resumed epoch is followed by the next
        self._last_epoch = self.epoch
        if not adopt:
            self._gen += 1
        self._rx.arm(self._gen, self.epoch, skip)
        self._settled = 0
        if not adopt:
            self._rx.start_epoch(self._gen, self.epoch, state)
        return EpochIterator(self._rx, self._gen, self._ended)

    def _ended(self) -> None:
        """An iteration ran to its end (or its cap): when every worker ended it, the next epoch starts ahead (NOTE
        [epoch ahead] (a))."""
        self._completed_epoch = self.epoch
        if self._rx.ended:
            self._start_ahead()

    def _settle(self) -> None:
        """Add what the armed iteration consumed since the last call to this loader's position (the sampler's in
        dataset mode): the receiver counts the batches, the loader keeps the position (NOTE [one receiver])."""
        counted = self._rx.consumed - self._settled
        if counted:
            self._settled = self._rx.consumed
            if self.sampler is not None:  # its epoch's batch count is never passed: the workers make exactly that
                self.sampler.advance(counted)
            else:
                self._consumed += counted

    def _start_ahead(self) -> None:
        """Have the workers start the epoch the next `iter()` is expected to ask for, from its beginning, so that its
        first batches are ready when it is (NOTE [epoch ahead]). Called when an epoch ends; dataset mode only."""
        if self.sampler is None or self._rx.closed:
            return
        epoch = self.epoch + 1 if self._advancing else self.epoch
        if self.epochs is not None and epoch >= self.epochs:
            return  # the job's last epoch has ended: nothing to make or fetch ahead (NOTE [epoch ahead] (d))
        start = copy.copy(self.sampler)
        start.set_epoch(epoch)
        start.rewind()
        state = start.state_dict()
        self._gen += 1
        self._ahead = (self._gen, state)
        self._rx.start_epoch(self._gen, epoch, state, quiet=True)  # a dead worker: the next iteration's wait says so

    def close(self) -> None:
        """Stop the workers and free every segment (idempotent; see NOTE [loader shutdown])."""
        self._rx.close()

    def __enter__(self) -> ShmLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def slot_region(self, address: int) -> tuple[int, int] | None:
        """(start, size) of this process's mapping of the slot that holds `address` (a lent batch's data), or None;
        with `on_slot_release`, what DevicePrefetcher page-locks (NOTE [registered slots] in pinning.py)."""
        for seg in self._res.segments.values():
            if seg.address <= address < seg.address + seg.size:
                return seg.address, seg.size
        return None

    def on_slot_release(self, hook: Callable[[int], None]) -> None:
        """Call `hook(start)` before a slot's mapping is dropped here (a slot grown for a bigger batch, close())."""
        self._res.release_hooks.append(hook)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._res.procs]

    # ---- internals -----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._rx.closed:
            raise LoaderError("this ShmLoader is closed")
