"""GpuIdleMeter's bookkeeping, on the host's clock (no GPU here): which gap counts as idle, which as busy, per
epoch, warm-up, the summary and the recipe's per-epoch share. The same meter on real CUDA events is checked in
tests/data/test_prefetch_cuda.py (scripts/gpu_check.sh runs it on a GPU)."""

from __future__ import annotations

import time

import pytest

from hvdtrain.data.idle import GpuIdleMeter
from hvdtrain.train.metrics import combine_stall
from hvdtrain.train.torchkit import Meters


class HostClockEvent:
    """What a CUDA event on an always-ready stream would report: recorded = the moment the host reached it."""

    def __init__(self) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self) -> None:
        assert self.at is not None, "synchronize() on an event never recorded"

    def elapsed_time(self, end: HostClockEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


def slow_loader(n: int, wait_s: float):
    for i in range(n):
        time.sleep(wait_s)  # the host fetching the batch: the GPU, having nothing queued, idles
        yield i


def test_idle_is_the_gap_before_each_step_and_busy_the_step_itself():
    meter = GpuIdleMeter("cpu", warmup_steps=0, events=HostClockEvent)
    for _ in meter.wrap(slow_loader(4, 0.02)):
        time.sleep(0.01)  # the step's work being queued
    assert len(meter.idle_ms) == len(meter.busy_ms) == 4
    assert meter.idle_ms[0] == 0.0  # the epoch's first step has no gap before it
    for ms in meter.idle_ms[1:]:
        assert 18 <= ms < 60, meter.idle_ms
    for ms in meter.busy_ms:
        assert 9 <= ms < 50, meter.busy_ms
    s = meter.summary()
    assert s["measured"] and s["steps"] == 4
    share = sum(meter.idle_ms) / (sum(meter.idle_ms) + sum(meter.busy_ms))
    assert s["idle_share"] == pytest.approx(share)
    assert 0.4 < s["idle_share"] < 0.8  # 3 gaps of 20 ms against 4 steps of 10 ms


def test_each_epoch_starts_without_a_gap_and_warmup_is_left_out_of_the_summary():
    meter = GpuIdleMeter("cpu", warmup_steps=2, events=HostClockEvent)
    for epoch in range(2):
        for _ in meter.wrap(slow_loader(3, 0.01)):
            pass
        if epoch == 0:
            time.sleep(0.05)  # validation between epochs: not the loader's gap
    assert meter.idle_ms[0] == 0.0 and meter.idle_ms[3] == 0.0
    assert all(ms >= 8 for i, ms in enumerate(meter.idle_ms) if i not in (0, 3))
    assert meter.summary()["steps"] == 4
    assert meter.share_since(3) > 0.5  # the second epoch alone, all of its steps


def test_a_host_that_keeps_ahead_leaves_no_gap():
    meter = GpuIdleMeter("cpu", warmup_steps=0, events=HostClockEvent)
    for _ in meter.wrap(range(50)):
        pass
    assert meter.summary()["mean_idle_s"] < 1e-3


def test_on_a_cpu_device_nothing_is_measured_and_the_items_pass_through():
    meter = GpuIdleMeter("cpu")
    assert not meter.measured
    assert list(meter.wrap(range(5))) == [0, 1, 2, 3, 4]
    s = meter.summary()
    assert s == {"measured": False, "steps": 0, "idle_share": 0.0, "mean_idle_s": 0.0, "p99_idle_s": 0.0,
                 "mean_busy_s": None}
    assert meter.share_since(0) == 0.0


def test_steps_are_read_only_once_their_events_completed():
    class Late(HostClockEvent):
        """An event the GPU has not reached yet, until synchronize()."""

        def query(self) -> bool:
            return False

    meter = GpuIdleMeter("cpu", warmup_steps=0, events=Late)
    it = meter.wrap(range(3))
    next(it)
    next(it)
    assert len(meter._pending) == 1  # step 1 recorded, not yet read: no wait for the GPU mid-epoch
    list(it)  # the epoch's end reads them all (synchronize on the last)
    assert not meter._pending and len(meter.busy_ms) == 3


def test_meters_report_both_figures_and_combine_over_ranks():
    meters = Meters(Meters.on("cpu").stall, GpuIdleMeter("cpu", warmup_steps=0, events=HostClockEvent))
    mark = meters.mark()
    for _ in meters.wrap(slow_loader(3, 0.01)):
        pass
    row = meters.epoch_shares(mark)
    assert set(row) == {"data_wait_share", "gpu_idle_share"} and row["gpu_idle_share"] > 0
    assert set(Meters.on("cpu").epoch_shares((0, 0))) == {"data_wait_share"}  # no GPU: no idle column
    per_rank = [meters.summary(), {**meters.summary(), "gpu_idle": {"measured": True, "idle_share": 0.0}}]
    combined = combine_stall(per_rank)
    assert combined["gpu_idle_share"] == pytest.approx(meters.idle.summary()["idle_share"] / 2)
    assert combine_stall([Meters.on("cpu").summary()])["gpu_idle_share"] is None


def test_warmup_must_be_a_count():
    with pytest.raises(ValueError, match="warmup_steps"):
        GpuIdleMeter("cpu", warmup_steps=-1)
