"""Batches lent to the user: a slot goes back to its producer when the last view of it is released.

NOTE [batch lifetime]
A batch handed out by ShmLoader is a set of numpy views on one shared-memory slot (zero-copy). torch's DataLoader
hands out tensors that live as long as the user holds them; hvdtrain's batches must be at least that safe:
(a) No use-after-unmap. Each lend makes a fresh memoryview of the slot's segment (`seg.buf[:]`) and one uint8
    base array over it; every view of the batch is built on that base, so numpy (and `torch.from_numpy`, and any
    view of a view) keeps the base alive, the base keeps the memoryview alive, and a live memoryview export makes
    `mmap.close()` refuse (BufferError). `shm.Segment.close()` then just drops its own reference: the mapping is
    unmapped by the last holder, after `close()`, after the loader is garbage-collected, at interpreter exit.
(b) No aliasing. A slot is given back to its worker — and so may be rewritten — only when the base array dies
    (a `weakref.ref` callback): the last numpy view, tensor or memoryview derived from the batch is gone.
    Holding `y` alone holds the whole slot (its `x` too); copy what you keep for long (`y.clone()`).
(c) Never a deadlock. Each worker owns `prefetch + 1` slots: `prefetch` batches ready ahead of the one the step
    holds. A batch is lent zero-copy only if that leaves the worker at least one slot the user does not hold;
    otherwise it is handed out as a private copy (one memcpy per array) and its slot goes back at once. So a user
    who keeps every batch (collecting labels in a list) gets correct data, bounded shared memory, and a loader
    that keeps going; a plain `for batch in loader` loop (which still references batch k while asking for k+1)
    stays zero-copy with prefetch >= 2 (with prefetch=1 only while consecutive batches come from different
    workers). A batch kept alive by a reference cycle comes back at the next garbage collection.
(d) Threads and GC. The callback runs in whichever thread drops the last reference, possibly inside a garbage
    collection triggered while the loader itself is talking to a worker. It only appends the slot to a deque
    (atomic) and, if it runs on the loader's own thread while the loader is idle (`busy` False), gives the slot
    back on the spot; otherwise the loader gives queued slots back at its next call, and while it waits for a
    batch it checks the queue every `poll_s` (a release in another thread reaches the worker up to `poll_s`
    late; (c) keeps that from ever blocking). After `close()` returned slots are dropped.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from hvdtrain.data import shm


class Lender:
    """Which slots the user holds, and when they come back (NOTE [batch lifetime])."""

    def __init__(self, slots_per_worker: int, give_back: Callable[[int], None]) -> None:
        self.slots_per_worker = slots_per_worker
        self._give_back = give_back  # sends one slot back to its worker; never raises
        self._held: dict[int, dict[int, weakref.ref[np.ndarray]]] = {}  # worker -> {slot: ref to its base}
        self._returned: deque[int] = deque()
        self.busy = False
        self.closed = False
        self.owner = threading.get_ident()
        self.copies = 0  # batches handed out as copies to keep a worker from starving: NOTE [batch lifetime] (c)

    def __enter__(self) -> None:
        """`with lender:` around the loader's own socket traffic: a release meanwhile (GC, this thread) only queues its
        slot, which is given back at the end: NOTE [batch lifetime] (d). (A plain class context manager: it runs
        once per batch, where a generator-based one costs more than the rest of a small batch's hand-off.)"""
        self.owner, self.busy = threading.get_ident(), True
        if self._returned:
            self.flush()

    def __exit__(self, *exc: object) -> None:
        self.busy = False
        if self._returned:
            self.flush()

    def held_slots(self) -> list[int]:
        """The slots the user holds now (any worker's)."""
        return [slot for slots in list(self._held.values()) for slot in list(slots)]

    def lend(self, seg: shm.Segment, slot: int, reader: shm.CompiledLayout) -> tuple[Any, bool]:
        """(batch, lent): views tied to the slot's lifetime, or a private copy when the worker would starve."""
        base = np.frombuffer(seg.buf[:], np.uint8)  # NOTE [batch lifetime] (a)
        batch = reader.read(base)
        if self._returned:
            self.flush()
        held = self._held.setdefault(slot // self.slots_per_worker, {})  # dict ops: atomic against (d)'s callback
        if len(held) + 1 >= self.slots_per_worker:  # NOTE [batch lifetime] (c)
            self.copies += 1
            return shm.map_batch(lambda a: np.array(a, copy=True), batch), False
        held[slot] = weakref.ref(base, lambda _ref: self._released(slot))
        return batch, True

    def tracks(self, slot: int) -> bool:
        """Whether `slot` is lent or waiting to be given back (then it must not be given back by anyone else)."""
        return slot in self._held.get(slot // self.slots_per_worker, ()) or slot in self._returned

    def _released(self, slot: int) -> None:
        """Weakref callback: the last view of `slot` died (any thread, possibly mid-GC): NOTE [batch lifetime] (d)."""
        self._held.get(slot // self.slots_per_worker, {}).pop(slot, None)
        if self.closed:
            return
        self._returned.append(slot)
        if not self.busy and threading.get_ident() == self.owner:
            self.flush()

    def flush(self) -> None:
        """Give back every slot whose last view died since the last call."""
        while self._returned and not self.closed:
            self._give_back(self._returned.popleft())

    def close(self) -> None:
        self.closed = True
        self._returned.clear()
