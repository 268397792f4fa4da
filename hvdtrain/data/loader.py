"""ShmLoader: persistent producer processes hand batches to the trainer through shared memory, without pickling.

The producer side is workers.py, the messages between the two protocol.py, one pass over an epoch (receiving and
ordering the batches) epoch.py, the loader's errors errors.py. Process and segment lifetimes and shutdown: NOTE
[loader shutdown] in resources.py.

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

import contextlib
import copy
import socket
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from hvdtrain.data import forked, ring, shm
from hvdtrain.data.boot import ProducerProcess, start_producer
from hvdtrain.data.channel import Channel
from hvdtrain.data.epoch import EpochIterator, EpochLink, Key
from hvdtrain.data.errors import LoaderError, SharedMemoryFullError, WorkerDiedError
from hvdtrain.data.lending import Lender
from hvdtrain.data.protocol import Batch, EpochMessage, FreeSlot, StartEpoch, ToWorker
from hvdtrain.data.resources import Resources, Watch, describe_exit, trainer_fds
from hvdtrain.data.sharding import ShardSampler, check_positive, check_rank, check_unconsumed
from hvdtrain.data.workers import WorkerConfig
from hvdtrain.settings.loader import PREFETCH, SLOT_BYTES  # SLOT_BYTES: each slot's first segment

__all__ = ["ShmLoader"]



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
        self._consumed = 0  # generator mode's resume position: batches of this epoch consumed (else the sampler's)
        self._resume_pending = False
        self._completed_epoch: int | None = None
        # NOTE [epoch ahead]: the iteration started before `iter()` asked for it, as (generation, sampler state),
        # and whether the user's iterations move on to the next epoch (else the same epoch is predicted).
        self._ahead: tuple[int, dict[str, Any]] | None = None
        self._last_epoch: int | None = None
        self._advancing = True
        self._spw = prefetch + 1  # slots per worker: prefetch ahead + the one the step holds
        self_ref = weakref.ref(self)  # the lender must not keep the loader (and its workers) alive

        def give_back(slot: int) -> None:
            loader = self_ref()
            if loader is not None and not loader._closed:
                loader._give_back(slot, quiet=True)

        self._lender = Lender(self._spw, give_back)
        # The current iteration's messages received ahead of their turn: its EpochIterator's `stash`, kept here so
        # that the next iteration gives their slots back even if that iterator is gone.
        self._unclaimed: dict[Key, EpochMessage] = {}
        # Per worker, state the EpochIterators use (EpochLink) that outlives them: layout number -> that layout,
        # made ready to read (protocol.Batch); its ring's `sent` count at our last socket read (NOTE [ring]).
        self._layouts: list[dict[int, shm.CompiledLayout]] = [{} for _ in range(self.num_workers)]
        self._seen = [0] * self.num_workers
        self._res = Resources()
        self._finalizer = weakref.finalize(self, _shut_down, self._res, self._lender)
        self._closed = False
        try:
            self._start(base, start[1])
        except BaseException:
            self.close()
            raise

    def _start(self, base: WorkerConfig, import_main: bool) -> None:
        gate = socket.socketpair() if self.num_workers > 1 else None  # NOTE [first producer first] in boot.py
        try:
            for w in range(self.num_workers):
                base.local_id = w
                if ring.SUPPORTED:  # NOTE [ring] in ring.py
                    seg = self._new_segment(ring.Ring.nbytes(self._spw), "ring")
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
                    seg = self._res.segments[slot] = self._new_segment(SLOT_BYTES, "first slot")
                    mine.send(FreeSlot(slot, seg.name, seg.size))
        finally:
            for end in gate or ():
                end.close()  # the producers have their copies: only producer 0's can signal or close it
        self._watch = Watch(self._res.conns, self._res.procs)

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
        if self.sampler is not None:
            return self.sampler.state_dict(unconsumed=unconsumed)
        return {"epoch": self.epoch, "batches_consumed": self._consumed - check_unconsumed(unconsumed, self._consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration resumes after the consumed batches (generator mode: they are produced and skipped)."""
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
        it = EpochIterator(self._link(self._gen), self._gen, skip)
        with self._lender:
            for msg in self._unclaimed.values():  # received by the previous iteration, never yielded
                if isinstance(msg, Batch):
                    self._give_back(msg.slot)
            self._unclaimed.clear()
            self._unclaimed = it.stash
            if not adopt:
                for w in range(self.num_workers):
                    self._send(w, StartEpoch(self._gen, self.epoch, state))
        return it

    def _link(self, gen: int) -> EpochLink:
        """What the EpochIterator of iteration `gen` may use of this loader (epoch.py never imports loader.py)."""
        return EpochLink(
            rank=self.rank, num_workers=self.num_workers, ordered=self.ordered, timeout=self.timeout,
            poll_s=self.poll_s, batches_per_epoch=self.batches_per_epoch, conns=self._res.conns,
            rings=self._res.rings, segments=self._res.segments, watch=self._watch, layouts=self._layouts,
            seen=self._seen, lender=self._lender, current=lambda: not self._closed and self._gen == gen,
            epoch=lambda: self.epoch, consumed=lambda: self._consumed, count_consumed=self._count_consumed,
            finished=self._finished, give_back=self._give_back, grow=self._grow, fail_dead=self._fail_dead)

    def _finished(self, ended: bool) -> None:
        """An iteration stopped: at its cap, or `ended` (every EpochDone in): NOTE [epoch ahead] (a)."""
        self._completed_epoch = self.epoch
        if ended:
            self._start_ahead()

    def _start_ahead(self) -> None:
        """Have the workers start the epoch the next `iter()` is expected to ask for, from its beginning, so that its
        first batches are ready when it is (NOTE [epoch ahead]). Called when an epoch ends; dataset mode only."""
        if self.sampler is None or self._closed:
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
        for conn in self._res.conns:  # a dead worker is reported by the next iteration's wait, not here
            with contextlib.suppress(OSError):
                conn.send(StartEpoch(self._gen, epoch, state))

    def close(self) -> None:
        """Stop the workers and free every segment (idempotent; see NOTE [loader shutdown])."""
        self._closed = True
        self._lender.close()
        self._unclaimed.clear()
        self._finalizer()

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
        if self._closed:
            raise LoaderError("this ShmLoader is closed")

    def _send(self, w: int, msg: ToWorker) -> None:
        try:
            self._res.conns[w].send(msg)
        except OSError:
            self._fail_dead(w, "when the trainer wrote to it")

    def _give_back(self, slot: int, *, quiet: bool = False) -> None:
        """Hand `slot` back to its worker. quiet: a dead worker is left for the epoch iterator's wait to report (its
        sentinel)."""
        seg = self._res.segments.get(slot)
        w, msg = slot // self._spw, FreeSlot(slot, seg.name if seg else None, seg.size if seg else 0)
        if not quiet:
            self._send(w, msg)
            return
        with contextlib.suppress(OSError):
            self._res.conns[w].send(msg)

    def _grow(self, slot: int, nbytes: int, full: str = "") -> None:
        """Answer a GrowSlot: a new segment, made sparse (its producer reserves it: NOTE [shm reservation] in
        shm.py); `full`: the producer could not reserve the last one."""
        old = self._res.segments.pop(slot, None)
        if old is not None:
            self._res.drop_segment(old)
        try:
            if full:
                raise self._full(SharedMemoryFullError(full), nbytes, "batch")
            self._res.segments[slot] = self._new_segment(max(nbytes, 1), reserve=False)
        except SharedMemoryFullError:
            self.close()  # the producers wait for this slot: no batch can come
            raise
        self._give_back(slot)

    def _full(self, exc: SharedMemoryFullError, nbytes: int, what: str) -> SharedMemoryFullError:
        text = shm.full_message(exc, rank=self.rank, batch_bytes=SLOT_BYTES if what != "batch" else nbytes,
                                workers=self.num_workers, slots_per_worker=self._spw, first=what != "batch")
        return SharedMemoryFullError(text)

    def _new_segment(self, nbytes: int, what: str = "batch", *, reserve: bool = True) -> shm.Segment:
        try:
            return shm.create_segment(nbytes, what, reserve=reserve)
        except SharedMemoryFullError as exc:  # NOTE [shm reservation] in shm.py: before any producer wrote
            raise self._full(exc, nbytes, what) from None

    def _fail_dead(self, w: int, when: str) -> NoReturn:
        proc = self._res.procs[w]
        proc.join(timeout=1.0)
        msg = (f"data worker {w} (pid {proc.pid}) of rank {self.rank} died with {describe_exit(proc.exitcode)} "
               f"{when} (epoch {self.epoch}); the loader is closed")
        self.close()
        raise WorkerDiedError(msg)

    def _count_consumed(self) -> None:
        """One more batch of this epoch consumed (yielded, or produced and skipped when resuming)."""
        if self.sampler is not None:  # its epoch's batch count is never passed: the workers make exactly that many
            self.sampler.batches_consumed += 1
        else:
            self._consumed += 1


def _shut_down(res: Resources, lender: Lender) -> None:
    """The loader's finalizer (close(), GC or interpreter exit): batches released later go nowhere."""
    lender.close()
    res.shutdown()
