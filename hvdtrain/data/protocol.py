"""The messages between the trainer and its producer processes (a socket pair per worker: channel.py; most Batch
messages go through a ring in shared memory instead: ring.py).

Only these small frozen dataclasses cross, never array data: a batch's bytes are in a shared-memory slot,
and its message names the slot and the `shm.BatchLayout` to read it with. Both ends dispatch on the type
(`match msg: case Batch(seq=seq, slot=slot): ...`).

    trainer -> worker   FreeSlot(slot, segment, nbytes)          a free slot, now the worker's, with its shared
                                                                 memory (every slot has some from the start)
                        StartEpoch(generation, epoch, sampler_state)  produce this epoch (aborts the current one)
                        Stop()
    worker -> trainer   Batch(generation, seq, slot, layout_id, layout)  batch `seq` of this worker is in `slot`,
                                                                 laid out as the worker's layout number `layout_id`
                                                                 (`layout`: that layout, sent once per number)
                        GrowSlot(slot, nbytes, full)             `slot` is too small: send it back bigger
                                                                 (`full`: its new segment could not be reserved)
                        EpochDone(generation, seq)               no more batches (`seq` = how many there were)
                        WorkerFailed(generation, seq, traceback) user code raised before batch `seq`

`generation` numbers the trainer's iterations (`iter(loader)`): a message of an abandoned iteration is recognised
by it, dropped, and its slot given back. Batch, EpochDone and WorkerFailed are the `EpochMessage`s: the trainer
files them under (worker, seq), so a worker's stream is read in order however they arrive.
Slot ownership and back-pressure: workers.py and NOTE [batch lifetime] in lending.py; how a worker ends: NOTE
[loader shutdown] in resources.py.

The one thing a worker asks of a dataset beyond `len()` and indexing, optionally: `PlansEpochs` (at the end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, runtime_checkable

from hvdtrain.data.shm import BatchLayout

# ---- trainer -> worker -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FreeSlot:
    """Slot `slot` is the worker's to fill: `segment` names its shared memory of `nbytes` (None: none; a worker
    asks for a segment with GrowSlot)."""

    slot: int
    segment: str | None
    nbytes: int


@dataclass(frozen=True)
class StartEpoch:
    """Produce epoch `epoch` (dataset mode: from `sampler_state`, the trainer's ShardSampler state; else None)."""

    generation: int
    epoch: int
    sampler_state: dict[str, Any] | None


@dataclass(frozen=True)
class Stop:
    """Exit: the loader is closing."""


# ---- worker -> trainer -----------------------------------------------------------------------------------------


MAX_LAYOUTS = 64
"""Layouts a worker numbers (Batch.layout_id); more distinct ones (variable shapes) are sent with every batch."""


@dataclass(frozen=True)
class Batch:
    """The worker's batch number `seq` of this epoch is in `slot`, laid out as the worker's layout number
    `layout_id`. `layout` is that layout, sent with the first batch of each number only (None afterwards: the
    trainer keeps them; unpickling a layout costs more than the rest of a small batch's hand-off). A worker numbers
    its first MAX_LAYOUTS distinct layouts and never renumbers one; past that, `layout_id` is -1 and `layout` is
    always sent. The number is resolved when the batch is lent, in the worker's order (NOTE [ring] (a) in ring.py)."""

    generation: int
    seq: int
    slot: int
    layout_id: int
    layout: BatchLayout | None = None


@dataclass(frozen=True)
class GrowSlot:
    """Free slot `slot` is too small for the next batch: replace its segment by one of at least `nbytes`. With
    `full` (the SharedMemoryFullError's text), the worker could not reserve the segment it was given: /dev/shm is
    full (NOTE [shm reservation] in shm.py)."""

    slot: int
    nbytes: int
    full: str = ""


@dataclass(frozen=True)
class EpochDone:
    """The worker has no more batches this epoch; it produced `seq` of them."""

    generation: int
    seq: int


@dataclass(frozen=True)
class WorkerFailed:
    """User code raised in the worker after it produced `seq` batches; `traceback` is the formatted traceback,
    `message` the exception's text, `bad_data` whether it is a DataError (the dataset is at fault, not the code)."""

    generation: int
    seq: int
    traceback: str
    message: str = ""
    bad_data: bool = False


ToWorker = FreeSlot | StartEpoch | Stop
FromWorker = Batch | GrowSlot | EpochDone | WorkerFailed
EpochMessage = Batch | EpochDone | WorkerFailed


# ---- worker -> dataset ----------------------------------------------------------------------------------------


@runtime_checkable
class PlansEpochs(Protocol):
    """A dataset that wants to know each epoch's order before it is read (a streamed one fetches shards ahead of
    it: `hvdtrain.stream.StreamingDataset.plan_epoch`).

    Each producer of a shuffled dataset-mode ShmLoader calls `plan_epoch(seed, epoch, last=..., leads=...)` at the
    start of every epoch it makes, before its first read (workers.py): the coming reads follow the loader's `order`
    for (`seed`, `epoch`). `last`: the job's last epoch (the loader's `epochs=`): fetch nothing of a next one ahead;
    `leads`: this producer makes the rank's first batch of the epoch. A dataset without it is simply read."""

    def plan_epoch(self, seed: int, epoch: int, last: bool = False, leads: bool = True) -> None: ...


@runtime_checkable
class BeginsEpochs(Protocol):
    """A dataset whose samples depend on the epoch (random augmentation: `hvdtrain.train.streamed.StreamSplit`).
    Each producer of a dataset-mode ShmLoader calls `begin_epoch(seed, epoch)` at the start of every epoch it makes,
    shuffled or not, before its first read: the loader's `seed` and the epoch about to be read."""

    def begin_epoch(self, seed: int, epoch: int) -> None: ...


def begins_epochs(dataset: Any) -> TypeGuard[BeginsEpochs]:
    """Whether `dataset` has a callable `begin_epoch` (BeginsEpochs), looked up as `plans_epochs` does."""
    return callable(getattr(dataset, "begin_epoch", None))


def plans_epochs(dataset: Any) -> TypeGuard[PlansEpochs]:
    """Whether `dataset` has a callable `plan_epoch` (PlansEpochs). Looked up as any attribute, unlike
    `isinstance(dataset, PlansEpochs)` on Python 3.12, which does not ask `__getattr__`: a wrapper that forwards
    its attributes to a streamed dataset plans as that dataset would."""
    return callable(getattr(dataset, "plan_epoch", None))
