"""GpuIdleMeter: how long the GPU's compute stream sat idle between training steps, seen from the GPU.

StallMeter times the host's wait in `next()`. That is not what the GPU sees: a host that waits 2 ms while the GPU
still runs 5 ms of queued kernels costs nothing, and a host that never waits can still starve the GPU (a
synchronous memcpy, launch overhead, a `.item()` before the next step is queued). This meter records two CUDA
events on the compute stream per step, one when the step's batch is handed over (before its first kernel) and one
when the step's work has been queued (the loop asks for the next batch). The events run in stream order, so

    idle(k) = elapsed(end of step k-1, start of step k)    busy(k) = elapsed(start of step k, end of step k)

idle(k) is zero when the host queued step k before the GPU finished step k-1, and otherwise the time the stream
had nothing to do (including any wait for the batch's host->device copy, which the prefetcher orders before the
start event: NOTE [stream sync] (a) in prefetch.py). The figure to judge a loader by is the idle share,
`sum(idle) / sum(idle + busy)` over the steps after warm-up. Elapsed times are read only from events that have
completed (`query()`), or at the end of the epoch (`synchronize()` on the last one), so measuring never makes the
host wait for the GPU mid-epoch. The first step of each epoch has no idle gap (validation and the epoch's
bookkeeping ran in between; that is not the loader's to answer for). A wait of the GPU *inside* a step (for the host
to queue its next kernels, e.g. while the host fetches the next batch in `DevicePrefetcher.ahead()`) counts as busy:
the rate next to data already on the GPU (bench/gpu_feed.py's "resident") is the figure that catches it.

On any device but CUDA there is no stream to watch: the meter measures nothing and says so (`measured: false`,
shares 0.0); StallMeter's wait share is then the figure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import numpy as np

T = TypeVar("T")


class Event(Protocol):
    """What the meter needs of a CUDA event (torch.cuda.Event with enable_timing=True)."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Any) -> float: ...  # milliseconds


def cuda_events(device: Any) -> Callable[[], Event] | None:
    """A factory of timing events recorded on `device`'s current stream, or None if `device` is not CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None

    def make() -> Event:
        ev = torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream(device)
        return _Recorded(ev, stream)

    return make


class _Recorded:
    """A torch.cuda.Event bound to the stream it is recorded on."""

    def __init__(self, event: Any, stream: Any) -> None:
        self.event, self.stream = event, stream

    def record(self) -> None:
        self.event.record(self.stream)

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_time(self, end: Any) -> float:
        return float(self.event.elapsed_time(end.event))


class GpuIdleMeter:
    """Per-step idle gap and busy time of the compute stream (see the module docstring).

    `for batch in meter.wrap(loader): step(batch)`, one call per epoch, innermost next to the training step (wrap
    the StallMeter's iterator, not the other way round). `events` makes timing events (default: CUDA events on
    `device`'s current stream, and nothing measured on another device). The first `warmup_steps` steps overall (cuDNN
    autotuning, torch.compile) are left out of the summary.
    """

    def __init__(self, device: Any, warmup_steps: int = 1, events: Callable[[], Event] | None = None) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.events = events if events is not None else cuda_events(device)
        self.warmup_steps = warmup_steps
        self.idle_ms: list[float] = []  # per step; 0.0 for each epoch's first step
        self.busy_ms: list[float] = []
        self._pending: deque[tuple[int, Event, Event, Event | None]] = deque()  # (step, start, end, previous end)

    @property
    def measured(self) -> bool:
        return self.events is not None

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield `iterable`'s items, recording an event before and after each step's work is queued."""
        if self.events is None:
            yield from iterable
            return
        previous_end: Event | None = None
        try:
            for item in iterable:
                start = self.events()
                start.record()
                yield item
                end = self.events()
                end.record()
                self._pending.append((len(self.idle_ms), start, end, previous_end))
                self.idle_ms.append(0.0)
                self.busy_ms.append(0.0)
                previous_end = end
                self._collect(wait=False)
        finally:
            self._collect(wait=True)

    def _collect(self, wait: bool) -> None:
        """Read the elapsed times of steps whose events have completed (all of them if `wait`)."""
        while self._pending:
            step, start, end, previous_end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            self.busy_ms[step] = max(0.0, start.elapsed_time(end))
            if previous_end is not None:
                self.idle_ms[step] = max(0.0, previous_end.elapsed_time(start))

    def summary(self) -> dict[str, Any]:
        """JSON-ready statistics over the steps after warm-up: idle share, mean/p99 idle and busy (seconds)."""
        self._collect(wait=True)
        idle = np.asarray(self.idle_ms[self.warmup_steps:], dtype=np.float64) / 1e3
        busy = np.asarray(self.busy_ms[self.warmup_steps:], dtype=np.float64) / 1e3
        out: dict[str, Any] = {"measured": self.measured, "steps": len(idle)}
        if not self.measured or len(idle) == 0:
            return {**out, "idle_share": 0.0, "mean_idle_s": 0.0, "p99_idle_s": 0.0, "mean_busy_s": None}
        total = float(idle.sum() + busy.sum())
        return {**out, "idle_share": float(idle.sum() / total) if total > 0 else 0.0,
                "mean_idle_s": float(idle.mean()), "p99_idle_s": float(np.percentile(idle, 99)),
                "mean_busy_s": float(busy.mean())}

    def share_since(self, step0: int) -> float:
        """Idle share of the steps from `step0` on (an epoch's), counting warm-up steps too; 0.0 if unmeasured."""
        self._collect(wait=True)
        idle, busy = sum(self.idle_ms[step0:]), sum(self.busy_ms[step0:])
        return idle / (idle + busy) if idle + busy > 0 else 0.0

