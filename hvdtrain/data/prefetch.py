"""DevicePrefetcher: copy batch k+1 host -> GPU on a side stream while the model computes on batch k.

NOTE [stream sync]
Three hazards, one guard each (letters are referred to from the code):
(a) read-before-written: the compute stream must not read batch k before its copy on the side stream is done.
    At hand-off the *consumer's current stream* waits on the per-batch event recorded after the copy
    (`compute.wait_event(ready)`); the host never blocks here. The batch is ordered for the stream current at
    hand-off only: a caller that uses it on another stream later orders that stream itself (`wait_stream`).
(b) device memory reused too early: batch k's device tensors are allocated by the caching allocator while the side
    stream is current, so the allocator ties them to that stream and would hand the memory to the next copy as soon
    as Python frees them — possibly while kernels on the compute stream still read them. `t.record_stream(compute)`
    at hand-off makes the allocator wait for the compute stream's work queued before the free. This is the
    "other direction" of ordering: because no device buffer is ever reused by us (fresh allocations only), the
    side stream never has to `wait_stream(compute)`; with reused device buffers it would have to.
(c) pinned source overwritten during its copy: `non_blocking=True` is asynchronous only from pinned memory, and
    the pinned buffer must stay alive and unchanged until the DMA is done. A ShmLoader's batch is copied straight
    out of its shared-memory slot, page-locked once (NOTE [registered slots] in pinning.py): its host views, and
    so the slot, are kept in `held` until the copy's event completed, and only then can the slot go back to its
    worker (NOTE [batch lifetime] in lending.py). Any other batch (or where registration fails) is memcpy'd into
    one of two pinned staging buffers, used in turn, that live as long as the prefetcher; before the CPU writes into
    staging buffer i again, the host waits on the event of the last copy out of it (`copied[i].synchronize()`,
    normally long done).
There is no helper thread: the host-side work (fetching from the loader, the memcpy, enqueueing the copy) runs in
`__next__`, while the GPU still executes the previous step's queued kernels, or, once the training loop calls
`ahead()` during a step (the recipe: after queueing the backward pass), there, while the GPU runs the step's backward
pass. Either way one batch is in flight and the same guards hold. So no thread has to
`torch.cuda.set_device` (it would default to GPU 0), and nothing can leak across epochs or hang in `close()`.
All CUDA calls run under `torch.cuda.device(self.device)`, so the stream and events belong to the right GPU even
when another device is current. tests/data/test_prefetch_cuda.py checks these rules on a GPU: run it under
`TORCH_CUDA_SANITIZER=1`.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from hvdtrain.data.pinning import SlotRegistry
from hvdtrain.data.torch_adapter import map_leaves, to_torch

_END = object()


def _leaves(batch: Any) -> list[Any]:
    found: list[Any] = []
    map_leaves(found.append, batch)
    return found


class DevicePrefetcher:
    """Yield `loader`'s batches as tensors on `device`, the next one already in flight.

    On a CUDA device: one batch of look-ahead (the loader's own workers provide the deeper buffering), a side
    stream for host->device copies from two pinned staging buffers, ordering as in NOTE [stream sync]. Any other device
    (CPU): a pass-through without look-ahead; its tensors view the loader's slot and keep it for as long as they
    live (NOTE [batch lifetime] in lending.py), so collecting `y` without `.clone()` is correct.
    Yields the last batch, yields nothing for an empty loader, and starts afresh on every `iter()` (per epoch).
    `state_dict()` reports the batches handed to the caller, not those fetched ahead: it asks the loader for
    `state_dict(unconsumed=k)` with the `k` batches in flight (ShmLoader and TorchLoader take it; for another
    loader, `batches_consumed` in its state is lowered by `k`).
    """

    def __init__(self, loader: Any, device: torch.device | str, *, register_slots: bool = True) -> None:
        self.loader = loader
        self.register_slots = register_slots  # NOTE [registered slots] in pinning.py; False: always the staging buffers
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._queue: deque[tuple[Any, Any]] = deque()  # (device batch, ready event): copies not yet handed over
        self._it: Iterator[Any] | None = None  # this epoch's loader iterator (CUDA)
        self._exhausted = self._deferred = False  # the loader's epoch is over; ahead() is called each step
        self._fetched = 0  # this epoch's batches taken from the loader: they take the staging buffers in turn
        self._stream: Any = None
        self._pinned: list[Any] = [None, None]
        self._copied: list[Any] = [None, None]
        self._held: list[tuple[Any, Any]] = []  # (copy event, host batch) of copies straight out of a slot: (c)
        self._slots: SlotRegistry | None = None
        self._slots_looked_up = False

    def __iter__(self) -> Iterator[Any]:
        self._queue.clear()
        if self.device.type != "cuda":
            self._it = None
            return self._passthrough()
        self._it, self._exhausted, self._deferred, self._fetched = iter(self.loader), False, False, 0
        return self._cuda_iter(self._it)

    def _passthrough(self) -> Iterator[Any]:
        for batch in self.loader:
            yield to_torch(batch)

    def _cuda_iter(self, it: Iterator[Any]) -> Iterator[Any]:
        try:
            while self._queue or self._fetch():
                pending = self._queue.popleft()
                if not self._deferred:
                    self._fetch()  # the next batch's copy starts before this one is handed over (one batch ahead)
                yield self._hand_off(*pending)
            self._drain_held(wait=True)  # the epoch's last slots go back to their workers
        finally:  # finished or closed (a loop left early): the loader's iterator goes with it; the batch in flight
            if self._it is it:  # stays queued, so that state_dict() still leaves it out
                self._it = None

    def ahead(self) -> None:
        """Start the next batch's copy now. Call it once per step while the GPU is busy (the recipe: after queueing
        the backward pass, before waiting for the gradients' allreduce): from then on in this epoch `next()` only
        hands over the batch started here, so the loader's host-side work (its `next()`, a memcpy, queueing the
        copy) is no longer on the host's path between one step's work and the next. A no-op off CUDA, outside an
        epoch, or with a batch already in flight."""
        if self.device.type != "cuda" or self._it is None:
            return
        self._deferred = True
        if not self._queue:
            self._fetch()

    def _fetch(self) -> bool:
        """Take the loader's next batch and start its copy (queued); False at the end of the epoch."""
        if self._exhausted or self._it is None:
            return False
        self._drain_held(wait=False)  # slots whose copy is done go back before the next batch is asked for
        host = next(self._it, _END)
        if host is _END:
            self._exhausted = True
            return False
        # The host views are dropped here (copied into a staging buffer: the slot goes back to its worker before the
        # next batch is asked for), or, copied straight out of the slot, once that copy is done (`_held`, NOTE
        # [stream sync] (c); NOTE [batch lifetime] in lending.py).
        self._queue.append(self._issue(host, self._fetched % 2))
        self._fetched += 1
        del host
        return True

    def _issue(self, host: Any, slot: int) -> tuple[Any, Any]:
        """Start copying one host batch to the device on the side stream; returns (device batch, ready event)."""
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            tensors = to_torch(host)
            registry = self._registry()
            direct = registry is not None and registry.covers(_leaves(tensors))
            if not direct:
                if self._copied[slot] is not None:
                    self._copied[slot].synchronize()  # NOTE [stream sync] (c)
                tensors = self._pin(slot, tensors)
            with torch.cuda.stream(self._stream):
                dev = map_leaves(lambda t: t.to(self.device, non_blocking=True)
                                 if isinstance(t, torch.Tensor) else t, tensors)
                ready = torch.cuda.Event()
                ready.record(self._stream)
            if direct:
                self._held.append((ready, host))  # the slot stays ours until the copy is done: (c)
            else:
                self._copied[slot] = ready
        return dev, ready

    def _drain_held(self, wait: bool) -> None:
        """Let go of the host batches whose copy out of their slot has completed (all of them, waiting, if `wait`)."""
        while self._held and (wait or self._held[0][0].query()):
            self._held.pop(0)[0].synchronize()

    def _registry(self) -> SlotRegistry | None:
        """The page-locked slots of the ShmLoader under `loader` (itself, or the loader a wrapper such as
        TorchLoader holds), found on first use; None for other loaders or with register_slots=False."""
        if not self._slots_looked_up:
            self._slots_looked_up = True
            source, depth = self.loader, 0
            while not hasattr(source, "slot_region") and hasattr(source, "loader") and depth < 8:
                source, depth = source.loader, depth + 1
            if self.register_slots and hasattr(source, "slot_region"):
                self._slots = SlotRegistry(source.slot_region, self._wait_held)
                source.on_slot_release(self._slots.release)
        return self._slots

    def _wait_held(self) -> None:
        """Wait for every copy straight out of a slot (before a slot is unregistered: NOTE [registered slots] (b))."""
        self._drain_held(wait=True)

    @property
    def slots_registered(self) -> bool | None:
        """Whether batches are copied straight out of page-locked slots: None before the first batch or for a loader
        without slots, False where registration failed (`slots_failed` says why) or was turned off."""
        if self._slots is None:
            return None if not self._slots_looked_up or self.register_slots else False
        return self._slots.failed is None

    @property
    def slots_failed(self) -> str | None:
        return None if self._slots is None else self._slots.failed

    def _pin(self, slot: int, host: Any) -> Any:
        """memcpy the host batch into pinned staging buffer `slot` (reallocated only when shapes/dtypes change)."""
        ring = self._pinned[slot]
        leaves = _leaves(host)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if ring is None or [(t.shape, t.dtype) for t in ring] != [(t.shape, t.dtype) for t in tensors]:
            ring = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            self._pinned[slot] = ring
        for dst, src in zip(ring, tensors, strict=True):
            dst.copy_(src)
        it = iter(ring)
        return map_leaves(lambda t: next(it) if isinstance(t, torch.Tensor) else t, host)

    def _hand_off(self, dev: Any, ready: Any) -> Any:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)  # NOTE [stream sync] (a)
        for t in _leaves(dev):
            if isinstance(t, torch.Tensor):
                t.record_stream(compute)  # NOTE [stream sync] (b)
        return dev

    # ---- pass-through of the loader's API ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        ahead = len(self._queue)  # batches taken from the loader but not yet handed to the caller
        if ahead == 0:  # nothing in flight: any loader's plain state_dict() will do
            return dict(self.loader.state_dict())
        if "unconsumed" in inspect.signature(self.loader.state_dict).parameters:
            return dict(self.loader.state_dict(unconsumed=ahead))
        state = dict(self.loader.state_dict())  # another loader: take back the batches fetched ahead by count
        if "batches_consumed" in state:
            state["batches_consumed"] -= ahead
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        if self._slots is not None:
            with torch.cuda.device(self.device):
                self._slots.close()  # waits for the copies in flight, then unregisters: NOTE [registered slots]
        self.loader.close()

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
