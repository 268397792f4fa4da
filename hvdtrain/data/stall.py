"""StallMeter: how long each training step waited for its batch, next to how long the step took.

A step runs from one request for a batch to the next: `step = wait + compute`. The figure users need is the wait
share, `sum(wait) / sum(step)`: the fraction of the run the accelerator sat idle waiting for input. On a GPU the
host-side step time is the dispatch time until something synchronizes (a `.item()`, an allreduce); averaged over
many steps it follows the device time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


class StallMeter:
    """Per-step wait-for-data and step time.

    Use `for batch in meter.wrap(loader): ...` (one call per epoch; each `next()` is timed, and the step ends at
    the following `next()`, or at the end of the epoch; a fetch inside the step goes through `wait_inside`), or
    call `record(wait_s, step_s)` yourself. The first
    `warmup_steps` steps (worker start-up, first-touch of shared memory, compilation) are kept in `waits`/`steps`
    but left out of the summary's statistics; the summary reports their wait separately.
    """

    def __init__(self, warmup_steps: int = 1) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.waits: list[float] = []
        self.steps: list[float] = []
        self._inside = 0.0  # the step's waits for data inside it (`wait_inside`)

    def wait_inside(self, fetch: Callable[[], object]) -> None:
        """Call `fetch` in the middle of a step of `wrap()` (e.g. DevicePrefetcher.ahead: the next batch fetched
        while the GPU computes) and count the time it takes as that step's wait for data, next to the wait in
        `next()` (steps given to `record()` directly do not include it)."""
        t0 = time.perf_counter()
        try:
            fetch()
        finally:
            self._inside += time.perf_counter() - t0

    def record(self, wait_s: float, step_s: float) -> None:
        if wait_s < 0 or step_s < wait_s:
            raise ValueError(f"need 0 <= wait_s <= step_s, got wait_s={wait_s!r}, step_s={step_s!r}")
        self.waits.append(float(wait_s))
        self.steps.append(float(step_s))

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield `iterable`'s items, timing the wait for each and the step that follows it."""
        it = iter(iterable)
        clock = time.perf_counter
        started = clock()
        try:
            while True:
                try:
                    item = next(it)
                except StopIteration:
                    return
                got = clock()
                wait, self._inside = got - started, 0.0
                yield item
                now = clock()
                self.record(wait + self._inside, now - started)
                started = now
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def summary(self) -> dict[str, Any]:
        """JSON-ready statistics (seconds) over the steps after warm-up."""
        waits = np.asarray(self.waits[self.warmup_steps:], dtype=np.float64)
        steps = np.asarray(self.steps[self.warmup_steps:], dtype=np.float64)
        out: dict[str, Any] = {"steps": len(waits), "warmup_steps": min(self.warmup_steps, len(self.waits)),
                               "warmup_wait_s": float(sum(self.waits[:self.warmup_steps]))}
        if len(waits) == 0:
            return {**out, "mean_wait_s": None, "p50_wait_s": None, "p99_wait_s": None, "max_wait_s": None,
                    "mean_step_s": None, "wait_share": None}
        total_step = float(steps.sum())
        return {**out, "mean_wait_s": float(waits.mean()), "p50_wait_s": float(np.percentile(waits, 50)),
                "p99_wait_s": float(np.percentile(waits, 99)), "max_wait_s": float(waits.max()),
                "mean_step_s": float(steps.mean()), "total_wait_s": float(waits.sum()),
                "wait_share": float(waits.sum() / total_step) if total_step > 0 else 0.0}

    def plot(self, path: str | Path, title: str = "input pipeline stall") -> Path:
        """Write a PNG of step time and wait-for-data per step (matplotlib, Agg backend)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise RuntimeError("StallMeter.plot needs matplotlib: pip install matplotlib") from exc
        path = Path(path)
        fig = Figure(figsize=(8, 3.5))  # no pyplot: the Agg canvas directly, global backend state untouched
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        x = np.arange(1, len(self.steps) + 1)
        ax.plot(x, np.asarray(self.steps) * 1e3, label="step time", linewidth=1.2)
        ax.plot(x, np.asarray(self.waits) * 1e3, label="wait for data", linewidth=1.2)
        s = self.summary()
        if s["wait_share"] is not None:
            title += f" — wait share {s['wait_share']:.1%}, p99 wait {s['p99_wait_s'] * 1e3:.1f} ms"
        ax.set(xlabel="step", ylabel="ms", title=title)
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        return path
