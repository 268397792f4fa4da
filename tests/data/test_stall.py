"""StallMeter: timing of waits and steps, the summary's statistics, the PNG."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import StallMeter


def slow_source(n: int, delay: float):
    for i in range(n):
        time.sleep(delay)
        yield i


def test_wrap_measures_wait_and_step() -> None:
    meter = StallMeter(warmup_steps=0)
    items = []
    for item in meter.wrap(slow_source(5, 0.05)):
        time.sleep(0.1)  # the "step"
        items.append(item)
    assert items == [0, 1, 2, 3, 4] and len(meter.waits) == len(meter.steps) == 5
    assert all(0.05 <= w < 0.5 for w in meter.waits)
    assert all(s >= w + 0.1 for s, w in zip(meter.steps, meter.waits, strict=True))
    s = meter.summary()
    assert s["steps"] == 5 and 0.2 < s["wait_share"] < 0.5  # ~0.05 / 0.15 on an idle machine


def test_summary_statistics_and_warmup() -> None:
    meter = StallMeter(warmup_steps=2)
    meter.record(5.0, 6.0)  # start-up: excluded from the statistics
    meter.record(1.0, 2.0)
    waits = np.linspace(0.0, 0.99, 100)
    for w in waits:
        meter.record(float(w), 1.0)
    s = meter.summary()
    assert s["steps"] == 100 and s["warmup_steps"] == 2 and s["warmup_wait_s"] == 6.0
    assert s["mean_wait_s"] == pytest.approx(waits.mean())
    assert s["p50_wait_s"] == pytest.approx(np.percentile(waits, 50))
    assert s["p99_wait_s"] == pytest.approx(np.percentile(waits, 99))
    assert s["wait_share"] == pytest.approx(waits.sum() / 100.0) and s["mean_step_s"] == 1.0


def test_empty_summary_and_bad_records() -> None:
    s = StallMeter().summary()
    assert s["steps"] == 0 and s["mean_wait_s"] is None and s["wait_share"] is None
    with pytest.raises(ValueError, match="wait_s"):
        StallMeter().record(2.0, 1.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        StallMeter(warmup_steps=-1)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    meter = StallMeter()
    for i in range(20):
        meter.record(0.01 * (i % 3), 0.1)
    out = meter.plot(tmp_path / "sub" / "stall.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
