"""ShmLoader: persistent producer processes hand batches to the trainer through shared memory, without pickling.

Process and segment lifetimes, errors and shutdown: NOTE [shutdown] in lifecycle.py.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from typing import Any

import numpy as np

from hvdtrain.data import shm
from hvdtrain.data.lending import Lender
from hvdtrain.data.lifecycle import (
    LoaderError,
    LoaderTimeoutError,
    Resources,
    WorkerDiedError,
    WorkerError,
    describe_exit,
    main_module_hidden,
)
from hvdtrain.data.sharding import ShardSampler, check_positive, check_rank
from hvdtrain.data.workers import WorkerConfig, worker_main

START_METHODS = ("spawn", "forkserver")


def _check_args(dataset: Any, generator: Any, batch_size: int | None, num_workers: int, prefetch: int,
                batches_per_epoch: int | None, timeout: float, poll_s: float, start_method: str) -> None:
    """ValueError naming the argument, its value and what is allowed."""
    if (dataset is None) == (generator is None):
        raise ValueError("give exactly one of dataset= (indexable) or generator= "
                         "(fn(worker_id, num_workers, epoch, seed) -> iterator of batches)")
    if dataset is not None:
        if batch_size is None:
            raise ValueError("batch_size is required with dataset= (an integer >= 1)")
        check_positive("batch_size", batch_size)
        if batches_per_epoch is not None:
            raise ValueError("batches_per_epoch is for generator mode; with a dataset an epoch is the shard")
    if batches_per_epoch is not None:
        check_positive("batches_per_epoch", batches_per_epoch)
    check_positive("num_workers", num_workers)
    check_positive("prefetch", prefetch)
    for name, value in (("timeout", timeout), ("poll_s", poll_s)):
        if not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS} ('fork' is unsafe once torch has started "
                         f"threads), got {start_method!r}")


class ShmLoader:
    """Batches for one rank from `num_workers` persistent producer processes, handed over in shared memory.

    Give either `dataset` (indexable: `dataset[i]` returns an array, a tuple/list or a dict of arrays; batched by
    `collate(list of samples)`, default: stack; or by `fetch(dataset, indices) -> batch` in one call) sharded by a
    `ShardSampler(len(dataset), rank, size, seed=seed, shuffle=shuffle, drop_last=drop_last, even=even)` (even=False:
    exact, possibly uneven shards for evaluation) — or `generator`,
    `generator(worker_id, num_workers, epoch, seed) -> iterator of batches`, where `worker_id`/`num_workers` count
    over all ranks (`rank * num_workers + local id`, `size * num_workers`: shard with `range(worker_id, n,
    num_workers)`) and `seed` is derived from (seed, rank, worker, epoch). Every worker also seeds `random`, numpy
    and torch from that seed each epoch. In generator mode `batches_per_epoch` caps an epoch (make it equal on every
    rank); ranks must otherwise yield the same number of batches themselves.

    Iterating yields the batches in a fixed order (worker 0, 1, ... round robin; in dataset mode exactly the
    sampler's order; generator mode with `ordered=False`: as they arrive, so one slow producer does not hold up
    the others, at the price of a run-dependent order) as numpy arrays that *view* a shared-memory slot (no copy).
    A batch stays valid as long as any view of it (or a tensor made from one) is alive, also after `close()`: the
    slot goes back to its worker when the last view is released. Each worker owns `prefetch + 1` slots; a batch
    that would leave its worker none (the user keeps batches) is handed out as a private copy instead, so holding
    batches never aliases and never deadlocks (NOTE [batch lifetime] in lending.py). Workers start in the
    constructor and live until `close()` (idempotent; also on garbage collection and at interpreter exit; a
    context manager). Workers are started with 'spawn' (default; 'forkserver' is accepted; bench B5 times both), never
    'fork', which is unsafe once torch has started its threads. `dataset`, `collate`, `fetch` and `generator` are
    sent to the workers with cloudpickle (lambdas, closures and `__main__` objects work; a big in-memory dataset is
    copied once per worker), so workers do not re-import the training script (its torch/horovod imports) unless
    `import_main=True`.
    """

    def __init__(self, dataset: Any = None, *, rank: int, size: int, batch_size: int | None = None,
                 num_workers: int = 2, seed: int = 0, generator: Callable[[int, int, int, int], Any] | None = None,
                 collate: Callable[[list[Any]], Any] | None = None,
                 fetch: Callable[[Any, np.ndarray], Any] | None = None, shuffle: bool = True,
                 drop_last: bool = False, even: bool = True, prefetch: int = 2, batches_per_epoch: int | None = None,
                 timeout: float = 300.0, poll_s: float = 0.2, start_method: str = "spawn",
                 import_main: bool = False, ordered: bool = True) -> None:
        _check_args(dataset, generator, batch_size, num_workers, prefetch, batches_per_epoch, timeout, poll_s,
                    start_method)
        if not ordered and dataset is not None:
            raise ValueError("ordered=False is for generator mode: a dataset's batches follow its sampler (resume "
                             "state counts them in order)")
        check_rank(rank, size)
        self.sampler: ShardSampler | None = None
        if dataset is not None and batch_size is not None:
            self.sampler = ShardSampler(len(dataset), rank, size, seed=seed, shuffle=shuffle, drop_last=drop_last,
                                        batch_size=batch_size, even=even)
        self.rank, self.size, self.batch_size, self.num_workers = rank, size, batch_size, num_workers
        self.seed, self.prefetch, self.timeout, self.poll_s = seed, prefetch, timeout, poll_s
        self.batches_per_epoch, self.ordered = batches_per_epoch, ordered
        self.dataset, self.collate, self.fetch, self.generator = dataset, collate, fetch, generator
        self.epoch = 0
        self._gen = 0
        self._consumed = 0  # batches yielded in the current epoch (generator mode; the sampler counts otherwise)
        self._resume_pending = False
        self._completed_epoch: int | None = None
        self._spw = prefetch + 1  # slots per worker: prefetch ahead + the one the step holds
        self_ref = weakref.ref(self)  # the lender must not keep the loader (and its workers) alive

        def give_back(slot: int) -> None:
            loader = self_ref()
            if loader is not None and not loader._closed:
                loader._give_back(slot, quiet=True)

        self._lender = Lender(self._spw, give_back)
        self._stash: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._res = Resources()
        self._finalizer = weakref.finalize(self, _shut_down, self._res, self._lender)
        self._closed = False
        base = WorkerConfig(0, num_workers, rank, size, seed, poll_s, dataset, collate, fetch, generator,
                            None if dataset is None else {"num_samples": len(dataset), "shuffle": shuffle,
                                                          "drop_last": drop_last, "batch_size": batch_size,
                                                          "even": even})
        shm.sweep_stale()  # segments a crashed (SIGKILLed) trainer could not unlink: their creator pid is dead
        try:
            self._start(base, mp.get_context(start_method), import_main)
        except BaseException:
            self.close()
            raise

    def _start(self, base: WorkerConfig, ctx: Any, import_main: bool) -> None:
        import cloudpickle

        for w in range(self.num_workers):
            base.local_id = w
            payload = cloudpickle.dumps(base)
            mine, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(theirs, payload), daemon=True,
                               name=f"hvdtrain-data-r{self.rank}-w{w}")
            self._res.conns.append(mine)
            with contextlib.nullcontext() if import_main else main_module_hidden():
                proc.start()
            self._res.procs.append(proc)
            theirs.close()
            for slot in range(w * self._spw, (w + 1) * self._spw):
                mine.send(("slot", slot, None, 0))

    # ---- public API ----------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self._resume_pending = False
        self.epoch = epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Epoch and batches consumed (= yielded to the trainer) so far in it."""
        if self.sampler is not None:
            return self.sampler.state_dict()
        return {"epoch": self.epoch, "batches_consumed": self._consumed}

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

    def __iter__(self) -> Iterator[Any]:
        self._check_open()
        if (self._completed_epoch == self.epoch and not self._resume_pending and self.sampler is not None
                and self.sampler.shuffle):
            warnings.warn(f"ShmLoader: iterating epoch {self.epoch} again with the same order; call "
                          "set_epoch(epoch) every epoch", stacklevel=2)
        self._gen += 1
        # Generator mode resumes by producing and skipping the consumed batches (the order is deterministic).
        skip = self._consumed if self._resume_pending and self.sampler is None else 0
        if not self._resume_pending and self.sampler is not None:
            self.sampler.rewind()
        self._consumed, self._resume_pending = 0, False
        state = None if self.sampler is None else self.sampler.state_dict()
        with self._lender.talking():
            for msg in self._stash.values():
                if msg[0] == "batch":
                    self._give_back(msg[3])
            self._stash.clear()
            for w in range(self.num_workers):
                self._send(w, ("epoch", self._gen, self.epoch, state))
        return _EpochIterator(self, self._gen, skip)

    def close(self) -> None:
        """Stop the workers and free every segment (idempotent; see NOTE [shutdown])."""
        self._closed = True
        self._lender.close()
        self._stash.clear()
        self._finalizer()

    def __enter__(self) -> ShmLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._res.procs]

    # ---- internals -----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise LoaderError("this ShmLoader is closed")

    def _send(self, w: int, msg: tuple[Any, ...]) -> None:
        try:
            self._res.conns[w].send(msg)
        except OSError:
            self._fail_dead(w, "when the trainer wrote to it")

    def _give_back(self, slot: int, *, quiet: bool = False) -> None:
        """Hand `slot` back to its worker. quiet: a dead worker is left for `_receive` to report (its sentinel)."""
        seg = self._res.segments.get(slot)
        w, msg = slot // self._spw, ("slot", slot, seg.name if seg else None, seg.size if seg else 0)
        if not quiet:
            self._send(w, msg)
            return
        with contextlib.suppress(OSError):
            self._res.conns[w].send(msg)

    def _grow(self, slot: int, nbytes: int) -> None:
        old = self._res.segments.pop(slot, None)
        if old is not None:
            shm.release_segment(old, unlink=True)
        self._res.segments[slot] = shm.create_segment(max(nbytes, 1))
        self._give_back(slot)

    def _fail_dead(self, w: int, when: str) -> None:
        proc = self._res.procs[w]
        proc.join(timeout=1.0)
        msg = (f"data worker {w} (pid {proc.pid}) of rank {self.rank} died with {describe_exit(proc.exitcode)} "
               f"{when} (epoch {self.epoch}); the loader is closed")
        self.close()
        raise WorkerDiedError(msg)

    def _on_message(self, w: int, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "grow":
            self._grow(msg[1], msg[2])
        elif msg[1] == self._gen:
            self._stash[(w, msg[2])] = msg
        elif kind == "batch":  # from an abandoned iteration: the slot goes straight back
            self._give_back(msg[3])

    def _drain(self, w: int, what: str) -> None:
        conn = self._res.conns[w]
        try:
            while conn.poll(0):
                self._on_message(w, conn.recv())
        except (EOFError, OSError):
            self._fail_dead(w, f"while the trainer waited for {what}")

    def _receive(self, key: tuple[int, int] | None, what: str) -> tuple[tuple[int, int], tuple[Any, ...]]:
        """Wait (with a deadline, watching every worker) until message `key` = (worker, seq) — or with key=None
        any message of the current iteration — has arrived; returns (key, message)."""
        for w in [key[0]] if key is not None else range(self.num_workers):
            self._drain(w, what)  # fast path: it is usually there already
        deadline = time.monotonic() + self.timeout
        conns, procs = self._res.conns, self._res.procs
        sentinels = {p.sentinel: w for w, p in enumerate(procs)}
        while (key not in self._stash) if key is not None else not self._stash:
            self._lender.flush()  # batches released by other threads: NOTE [batch lifetime] (d)
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoaderTimeoutError(f"no {what} from the data workers of rank {self.rank} within "
                                         f"{self.timeout:g} s (epoch {self.epoch}); the workers are alive")
            ready = wait([*conns, *sentinels], timeout=min(left, self.poll_s))
            for w, conn in enumerate(conns):
                if conn in ready:
                    self._drain(w, what)
            for sentinel, w in sentinels.items():
                if sentinel in ready:
                    self._fail_dead(w, f"while the trainer waited for {what}")
        key = key if key is not None else next(iter(self._stash))  # arrival order
        return key, self._stash.pop(key)


def _shut_down(res: Resources, lender: Lender) -> None:
    """The loader's finalizer (close(), GC or interpreter exit): batches released later go nowhere."""
    lender.close()
    res.shutdown()


class _EpochIterator:
    """One pass over an epoch: round robin over the workers, each worker's batches in its order."""

    def __init__(self, loader: ShmLoader, gen: int, skip: int) -> None:
        self.loader, self.gen, self.skip = loader, gen, skip
        self.active = list(range(loader.num_workers))
        self.next_seq = [0] * loader.num_workers
        self.pos = 0
        self.done = False

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        ld = self.loader
        if self.done:
            raise StopIteration
        if ld._closed or ld._gen != self.gen:
            raise LoaderError("this iterator is stale: the loader was closed or iterated again")
        with ld._lender.talking():
            return self._next_batch()

    def _next_batch(self) -> Any:
        ld = self.loader
        ld._lender.flush()
        while True:
            limit = ld.batches_per_epoch
            if not self.active or (limit is not None and ld._consumed >= limit):
                return self._finish()
            key = (self.active[self.pos], self.next_seq[self.active[self.pos]]) if ld.ordered else None
            try:
                (w, _), msg = ld._receive(key, f"batch {key[1]} of worker {key[0]}" if key else "a batch")
            except LoaderError:
                self.done = True
                raise
            if msg[0] == "error":
                self.done = True
                raise WorkerError(f"data worker {w} of rank {ld.rank} failed in epoch {ld.epoch} at its batch "
                                  f"{msg[2]}:\n{msg[3]}")
            self._advance(w, ended=msg[0] == "end")
            if msg[0] == "end":
                continue
            ld._consumed += 1
            if ld.sampler is not None:
                ld.sampler.advance(1)
            if self.skip > 0:
                self.skip -= 1
                ld._give_back(msg[3])
                continue
            try:
                batch, lent = ld._lender.lend(ld._res.segments[msg[3]], msg[3], msg[4])
            except BaseException:  # e.g. KeyboardInterrupt mid-hand-off: the slot must not be lost
                if not ld._lender.tracks(msg[3]):
                    ld._give_back(msg[3], quiet=True)
                raise
            if not lent:  # handed out as a copy: NOTE [batch lifetime] (c)
                ld._give_back(msg[3])
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
        raise StopIteration

