"""SlotRegistry: page-lock the producers' shared-memory slots in the trainer, so the GPU copies straight out of them.

NOTE [registered slots]
A memcpy of each batch from its slot into the prefetcher's pinned staging buffers runs on the trainer thread, and
where the step is bound by the host's kernel launches (a small model at bf16) every moment the trainer thread spends
copying is a moment the GPU idles. With the slot page-locked (cudaHostRegister) the copy engine reads it directly
and the trainer thread only enqueues the copy. (B8 compares the two feeds: docs/gpu.md.)
(a) A segment is registered once, the first time a batch from it is copied, and unregistered before its mapping can
    go away: the loader calls its release hooks (`release` here) before it drops a segment (a slot grown,
    close()), and `close()` unregisters whatever is left. Registration pins the physical pages behind the addresses:
    a mapping unmapped while registered, and a new one at the same addresses, would be copied from stale pages.
(b) A slot must not be rewritten while a copy out of it is in flight: the prefetcher keeps the batch's host views
    (and so the slot: NOTE [batch lifetime] (b) in lending.py) until the copy's event has completed, and `release`
    waits for every copy in flight before it unregisters.
(c) Registration can fail (a platform without it, a driver limit): then, for the rest of the run, and for any batch
    that is not in a slot (a private copy: NOTE [batch lifetime] (c); another loader's arrays), the prefetcher copies
    through its pinned staging buffers. A failed call leaves its error as the thread's CUDA "last error", which torch
    would raise at the next kernel launch check; it is consumed on the spot (`_consume_error`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

Finder = Callable[[int], "tuple[int, int] | None"]  # an address -> (start, size) of the slot mapping holding it


class SlotRegistry:
    """The slot mappings page-locked in this process, found through the loader (NOTE [registered slots])."""

    def __init__(self, find: Finder, before_unregister: Callable[[], None]) -> None:
        self._find = find
        self._before_unregister = before_unregister  # waits for the copies in flight: NOTE (b)
        self.regions: dict[int, int] = {}  # start -> size, registered
        self.failed: str | None = None  # why registration was given up (NOTE (c)); None while it works

    def covers(self, tensors: Iterable[Any]) -> bool:
        """True if every tensor lies in one registered slot mapping, registering mappings on first sight."""
        if self.failed is not None:
            return False
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if t.device.type != "cpu" or not t.is_contiguous():
                return False
            start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            if not self._registered(start, end) and not self._register(start, end):
                return False
        return True

    def _registered(self, start: int, end: int) -> bool:
        return any(a <= start and end <= a + n for a, n in self.regions.items())

    def _register(self, start: int, end: int) -> bool:
        found = self._find(start)
        if found is None or not (found[0] <= start and end <= found[0] + found[1]):
            return False  # not a slot of ours (a private copy, another loader's array): the staging buffers
        addr, size = found
        err = int(torch.cuda.cudart().cudaHostRegister(addr, size, 1))  # 1: cudaHostRegisterPortable
        if err != 0:
            _consume_error()
            self.failed = f"cudaHostRegister failed with CUDA error {err}"
            return False
        self.regions[addr] = size
        return True

    def release(self, addr: int) -> None:
        """The loader is about to drop the mapping at `addr`: unregister it if registered (after the copies)."""
        if addr in self.regions:
            self._before_unregister()
            del self.regions[addr]
            torch.cuda.cudart().cudaHostUnregister(addr)

    def close(self) -> None:
        if self.regions:
            self._before_unregister()
        for addr in list(self.regions):
            torch.cuda.cudart().cudaHostUnregister(addr)
        self.regions.clear()


def _consume_error() -> None:
    """Take a failed runtime call's error off the thread (a launch check reads and clears it), so that torch's next
    kernel launch does not raise it as its own."""
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device="cuda").add_(1)
