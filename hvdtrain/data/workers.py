"""The producer process: runs the user's dataset/collate or generator and writes batches into shared memory.

It speaks the protocol of protocol.py over its socket (channel.py) and publishes most batches in its ring (ring.py);
only small messages cross, never array data.
Back-pressure: a worker owns `prefetch + 1` slots; with all of them full or held it waits (polling the socket with a
timeout) until the trainer hands one back (NOTE [batch lifetime] in lending.py). See NOTE [loader shutdown] in
resources.py for how the worker ends.
"""

from __future__ import annotations

import contextlib
import math
import random
import select
import signal
import socket
import sys
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.data import shm
from hvdtrain.data.channel import Channel
from hvdtrain.data.errors import DataError, SharedMemoryFullError
from hvdtrain.data.protocol import (
    MAX_LAYOUTS,
    Batch,
    EpochDone,
    FreeSlot,
    FromWorker,
    GrowSlot,
    StartEpoch,
    Stop,
    WorkerFailed,
    begins_epochs,
    plans_epochs,
)
from hvdtrain.data.ring import Ring
from hvdtrain.data.sharding import ShardSampler


@dataclass(frozen=True)
class WorkerInfo:
    """What `worker_info()` returns inside a producer process (None in the trainer).

    `worker_id`/`num_workers` count over all ranks: `rank * workers_per_rank + local id` of `size * workers_per_rank`.
    """

    worker_id: int
    num_workers: int
    local_id: int
    rank: int
    size: int
    epoch: int
    seed: int


_INFO: WorkerInfo | None = None


def worker_info() -> WorkerInfo | None:
    return _INFO


def derive_seed(seed: int, rank: int, worker_id: int, epoch: int) -> int:
    """A 32-bit seed that differs for every (base seed, rank, worker, epoch) and is reproducible."""
    return int(np.random.SeedSequence([seed, rank, worker_id, epoch]).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    """Seed the global RNGs a dataset's augmentation may use: random, numpy, and torch if it is imported."""
    random.seed(seed)
    np.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def default_collate(samples: list[Any]) -> Any:
    """Stack samples (arrays, tuples/lists of arrays, or dicts of arrays) into one batch."""
    first = samples[0]
    if isinstance(first, Mapping):
        return {k: np.stack([np.asarray(s[k]) for s in samples]) for k in first}
    if isinstance(first, tuple | list):
        return tuple(np.stack([np.asarray(s[i]) for s in samples]) for i in range(len(first)))
    return np.stack([np.asarray(s) for s in samples])


@dataclass
class WorkerConfig:
    local_id: int
    workers_per_rank: int
    rank: int
    size: int
    seed: int
    poll_s: float
    dataset: Any = None
    collate: Callable[[list[Any]], Any] | None = None
    fetch: Callable[[Any, np.ndarray], Any] | None = None
    generator: Callable[[int, int, int, int], Any] | None = None
    sampler_args: dict[str, Any] | None = None
    epochs: int | None = None  # the loader's `epochs`: a streamed dataset fetches nothing of epoch `epochs` ahead
    ring: str | None = None  # the segment of this worker's descriptor ring (NOTE [ring] in ring.py); None: none
    ring_capacity: int = 0


class TrainerGone(Exception):
    """The trainer closed its end of the socket (exited, crashed or is shutting down)."""


def worker_main(conn: Channel, cfg: WorkerConfig, started: socket.socket | None = None) -> None:
    """A producer process (started by boot.py or forked.py); `started` is signalled after its first batch is sent
    (NOTE [first producer first] in boot.py)."""
    # Ctrl-C reaches the whole process group: the trainer handles it and stops us (NOTE [loader shutdown]).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a stop request (hvdtrain/train/preempt.py): the trainer's
    try:
        worker = _Worker(conn, cfg, started)
    except TrainerGone:
        conn.close()
        return
    try:
        worker.serve()
    except TrainerGone:
        pass
    finally:
        worker.signal_started()
        worker.unmap_all()
        conn.close()


class _Worker:
    def __init__(self, conn: Channel, cfg: WorkerConfig, started: socket.socket | None = None) -> None:
        self.conn, self.cfg, self.started = conn, cfg, started
        self.granted: dict[int, FreeSlot] = {}  # slot -> the message that last handed it over (segment, size)
        self.mapped: dict[int, shm.Segment] = {}
        self.free: deque[int] = deque()
        self.growing: set[int] = set()  # slots sent back to be grown, not yet returned
        self.layout_ids: dict[shm.BatchLayout, int] = {}  # layout -> its number (protocol.Batch)
        self.pending: deque[StartEpoch | Stop] = deque()
        self.poller = select.poll()  # persistent: a selector built per call costs more than a small batch
        self.poller.register(conn.fileno(), select.POLLIN)
        self.ring: Ring | None = None
        if cfg.ring is not None:
            try:
                # attach (and so unlink) the ring's segment: NOTE [loader shutdown]
                self.ring = Ring(shm.attach_segment(cfg.ring), cfg.ring_capacity)
            except FileNotFoundError as exc:  # the trainer unlinked it: it is shutting down
                raise TrainerGone from exc

    def pump(self, timeout: float) -> None:
        """Take in whatever the trainer sent within `timeout` s (slots are kept, commands queued)."""
        try:
            if not self.poller.poll(math.ceil(timeout * 1000)):
                return
            for msg in self.conn.receive():
                match msg:
                    case FreeSlot(slot=slot, segment=segment):
                        self.growing.discard(slot)
                        self.granted[slot] = msg
                        # attach (and so unlink) a new segment at once: NOTE [loader shutdown]
                        if segment is None or self.map(slot):
                            self.free.append(slot)
                    case StartEpoch() | Stop():
                        self.pending.append(msg)
                    case _:
                        raise TypeError(f"unexpected message from the trainer: {msg!r}")
        except (EOFError, OSError) as exc:
            raise TrainerGone from exc

    def serve(self) -> None:
        while True:
            while not self.pending:
                self.pump(self.cfg.poll_s)
            match self.pending.popleft():
                case Stop():
                    return
                case StartEpoch(generation=gen, epoch=epoch, sampler_state=state):
                    self.run_epoch(gen, epoch, state)

    def run_epoch(self, gen: int, epoch: int, state: dict[str, Any] | None) -> None:
        global _INFO
        cfg = self.cfg
        seed = derive_seed(cfg.seed, cfg.rank, cfg.local_id, epoch)
        seed_everything(seed)
        info = WorkerInfo(cfg.rank * cfg.workers_per_rank + cfg.local_id, cfg.size * cfg.workers_per_rank,
                          cfg.local_id, cfg.rank, cfg.size, epoch, seed)
        _INFO = info
        seq = 0
        source: Iterator[Any] | None = None
        try:
            source = iter(self.batches(info, state))
            while True:
                self.pump(0)
                if self.pending:  # a newer command: abandon this epoch
                    return
                try:
                    batch = next(source)
                except StopIteration:
                    break
                if not self.send_batch(gen, seq, batch):
                    return
                self.signal_started()
                seq += 1
            self.send(EpochDone(gen, seq))
        except TrainerGone:
            raise
        except Exception as exc:
            self.send(WorkerFailed(gen, seq, traceback.format_exc(), str(exc), isinstance(exc, DataError)))
        finally:
            self.signal_started()  # (an epoch without batches, failed or abandoned: nothing to wait for)
            close = getattr(source, "close", None)
            if close is not None:
                close()  # run the user generator's finally blocks when an epoch is abandoned

    def signal_started(self) -> None:
        """The other producers of the rank may start now (NOTE [first producer first] in boot.py)."""
        started, self.started = self.started, None
        if started is not None:
            with contextlib.suppress(OSError):
                started.send(b"s")
            started.close()

    def batches(self, info: WorkerInfo, state: dict[str, Any] | None) -> Iterator[Any]:
        if self.cfg.generator is not None:
            return self.cfg.generator(info.worker_id, info.num_workers, info.epoch, info.seed)
        return self.dataset_batches(state)

    def dataset_batches(self, state: dict[str, Any] | None) -> Iterator[Any]:
        cfg = self.cfg
        sampler = ShardSampler(rank=cfg.rank, size=cfg.size, seed=cfg.seed, **(cfg.sampler_args or {}))
        if state is not None:
            sampler.load_state_dict(state)
        mine = sampler.batches()[cfg.local_id::cfg.workers_per_rank]  # 0 makes the rank's next batch
        if begins_epochs(cfg.dataset):  # its augmentation is keyed on (seed, epoch)
            cfg.dataset.begin_epoch(sampler.seed, sampler.epoch)
        if plans_epochs(cfg.dataset) and sampler.shuffle:  # a streamed dataset fetches ahead (hvdtrain.stream.fetcher)
            last = cfg.epochs is not None and sampler.epoch >= cfg.epochs - 1  # the job's last: fetch no more
            cfg.dataset.plan_epoch(sampler.seed, sampler.epoch, last=last, leads=cfg.local_id == 0 and len(mine) > 0)
        collate = cfg.collate or default_collate
        for idx in mine:
            if cfg.fetch is not None:
                yield cfg.fetch(cfg.dataset, idx)
            else:
                yield collate([cfg.dataset[int(i)] for i in idx])

    def send(self, msg: FromWorker) -> None:
        try:
            self.conn.send(msg)
        except OSError as exc:
            raise TrainerGone from exc
        if self.ring is not None:
            self.ring.count_sent()  # NOTE [ring] (e)

    def send_batch(self, gen: int, seq: int, batch: Any) -> bool:
        layout, arrays = shm.plan_layout(batch)
        slot = self.acquire(layout.nbytes)
        if slot is None:
            return False
        shm.write_batch(self.mapped[slot].buf, layout, arrays)
        lid = self.layout_ids.get(layout, -1)
        known = lid >= 0
        if not known and len(self.layout_ids) < MAX_LAYOUTS:
            lid = self.layout_ids[layout] = len(self.layout_ids)
        if known and self.ring is not None and self.ring.post(gen, seq, slot, lid):  # NOTE [ring] (a)
            if self.ring.trainer_waiting():
                try:
                    self.conn.doorbell()  # NOTE [ring] (d)
                except OSError as exc:
                    raise TrainerGone from exc
            return True
        self.send(Batch(gen, seq, slot, lid, None if known else layout))
        return True

    def acquire(self, nbytes: int) -> int | None:
        """A free slot of at least `nbytes`, mapped; None if a newer command arrived while waiting.

        Every slot comes with `loader.SLOT_BYTES`; slots are grown one at a time, when no free slot is big enough
        (a FreeSlot without a segment counts as too small)."""
        while not self.pending:
            big = [s for s in self.free if self.granted[s].segment is not None and self.granted[s].nbytes >= nbytes]
            if big:
                self.free.remove(big[0])
                if self.map(big[0]):
                    return big[0]
                continue
            if self.free and not self.growing:  # every free slot is too small: have one replaced by a bigger one
                slot = self.free.popleft()
                self.growing.add(slot)
                self.send(GrowSlot(slot, nbytes))
            self.pump(self.cfg.poll_s)
        return None

    def map(self, slot: int) -> bool:
        """Map the slot's segment and reserve its pages (NOTE [shm reservation] in shm.py); False when /dev/shm
        cannot hold it: the slot went back to the trainer, which raises SharedMemoryFullError and stops us."""
        name = self.granted[slot].segment
        seg = self.mapped.pop(slot, None)
        if seg is not None and seg.name.lstrip("/") == (name or "").lstrip("/"):
            self.mapped[slot] = seg
            return True
        if seg is not None:
            shm.release_segment(seg, unlink=False)
        try:
            seg = shm.attach_segment(name or "")
        except FileNotFoundError as exc:  # the trainer unlinked it: it is shutting down
            raise TrainerGone from exc
        try:
            shm.reserve_segment(seg)
        except (SharedMemoryFullError, OSError) as exc:  # OSError: an errno the reservation did not expect
            shm.release_segment(seg, unlink=False)
            why = str(exc) if isinstance(exc, SharedMemoryFullError) else f"reserving a segment failed: {exc!r}"
            self.send(GrowSlot(slot, seg.size, full=why))
            return False
        self.mapped[slot] = seg
        return True

    def unmap_all(self) -> None:
        for seg in self.mapped.values():
            shm.release_segment(seg, unlink=False)
        self.mapped.clear()
        if self.ring is not None:
            self.ring.close()
            shm.release_segment(self.ring.seg, unlink=False)
            self.ring = None
