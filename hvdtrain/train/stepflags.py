"""Per-step values computed on the device and read on the host a step later: the recipe's finite check and its
progress bar's loss without making the host wait for the GPU each step.

NOTE [flags read a step late]
Reading a CUDA value on the host (`bool(t)`, `.item()`) copies it on the compute stream and waits for *everything*
queued there before it: the host stops queueing until the GPU has caught up, and the GPU then idles while the host
queues the next step (the step becomes host-synchronous). So the step's few values (a flag "the averaged gradients
hold NaN/Inf", NOTE [divergence checks] in divergence.py, and the losses) go into one small vector, copied into
page-locked host memory with `non_blocking=True` and an event recorded right after the copy; `push` then reads the
vector of the step `lag` steps back, waiting only for *that* event, which the GPU passed a step ago while this
step's kernels are already queued behind it.
- Every rank reads the same flags at the same step count (the flag is computed from values every rank shares, and
  the read is by count, never by whether an event happens to be done), so every rank stops at the same step.
- Pending values are read (`drain`) before anything leaves the epoch's loop: the end of the epoch's steps, a stop
  request's checkpoint. A flagged step is therefore always caught before a checkpoint or the epoch's metrics are
  written; the weights in memory may have taken the `lag` steps after it, and die with the process.
- The host buffers are a ring of `lag + 1`: a buffer is written again only after it was read.
On a CPU everything is synchronous anyway: the copy is immediate and there are no events; the values are read `lag`
steps late all the same, so CPU and GPU runs stop at the same step.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


class LateReads:
    """Vectors of `width` values pushed once per step, each read `lag` steps later (NOTE [flags read a step late])."""

    def __init__(self, device: torch.device | str, width: int, lag: int = 1) -> None:
        if not isinstance(lag, int) or lag < 0:
            raise ValueError(f"lag must be an integer >= 0, got {lag!r}")
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an integer >= 1, got {width!r}")
        self.lag, self.width = lag, width
        cuda = torch.device(device).type == "cuda"
        self._host = [torch.zeros(width, dtype=torch.float32, pin_memory=cuda) for _ in range(lag + 1)]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(lag + 1)]
        self._pending: deque[tuple[int, int]] = deque()  # (step, ring index)
        self._next = 0

    def push(self, step: int, values: torch.Tensor) -> list[tuple[int, np.ndarray]]:
        """Queue this step's values (`width` numbers on any device; nothing waits for them); returns the (step,
        values) now `lag` steps old, oldest first (one per push once `lag` steps have been pushed)."""
        if values.numel() != self.width:
            raise ValueError(f"expected {self.width} values, got a tensor of shape {tuple(values.shape)}")
        i = self._next
        self._host[i].copy_(values.detach().reshape(-1).float(), non_blocking=True)
        event = self._events[i]
        if event is not None:
            event.record()  # on the current stream, right after the copy
        self._pending.append((step, i))
        self._next = (i + 1) % len(self._host)
        return self._read(keep=self.lag)

    def drain(self) -> list[tuple[int, np.ndarray]]:
        """Every pending step's values (waiting for their copies), oldest first."""
        return self._read(keep=0)

    def _read(self, keep: int) -> list[tuple[int, np.ndarray]]:
        out = []
        while len(self._pending) > keep:
            step, i = self._pending.popleft()
            event = self._events[i]
            if event is not None:
                event.synchronize()
            out.append((step, self._host[i].numpy().copy()))
        return out
