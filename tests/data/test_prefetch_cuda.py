"""DevicePrefetcher on a real CUDA device: the side stream, the pinned staging buffers and the hand-off of
NOTE [stream sync] (hvdtrain/data/prefetch.py). Skipped without CUDA (tests/data/test_prefetch.py checks the
iteration logic with the copies faked).

Every test consumes the device tensors on the compute stream (the current stream when the batch is handed over:
the default stream, or a stream of the test's own made current with `torch.cuda.stream(s)`) and checks their values
exactly, without a host sync per step where it matters (mismatch counts and reductions stay on the device and are
read once at the end), so the host runs ahead of the GPU as in training. Run them under `TORCH_CUDA_SANITIZER=1` too:
torch's CUDA sanitizer then raises on any kernel that touches a batch without being ordered after its copy.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from hvdtrain.data import DevicePrefetcher, ShardSampler, ShmLoader
from tests.support import loaders as fx

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the side stream and pinned staging buffers need a GPU"),
              pytest.mark.timeout(120)]

ROWS, COLS = 16, 4096  # a small batch: float32[16, 4096] = 256 KiB
BIG = (12, 1_000_000)  # a big batch: float32[12, 1e6] = 48 MB (bench B1's size); arange values stay exact in float32


class Batches:
    """A re-iterable loader of `n` host batches, `make(i)` built when asked for (one epoch per `iter()`)."""

    def __init__(self, n: int, make: Callable[[int], Any]) -> None:
        self.n, self.make = n, make

    def __iter__(self) -> Iterator[Any]:
        return (self.make(i) for i in range(self.n))

    def __len__(self) -> int:
        return self.n


def host_batch(i: int) -> tuple[torch.Tensor, np.ndarray]:
    """Batch i: x = float32[ROWS, COLS] = arange + 1000 i (every element different, exact), y = int64[ROWS] = i
    (a numpy leaf: the prefetcher converts it)."""
    x = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * i
    return x, np.full(ROWS, i, np.int64)


def host_sum(i: int) -> float:
    """sum(2 x + y) of batch i, what `check_batch` computes on the device (exact in float64)."""
    n = ROWS * COLS
    return float(2 * (n * (n - 1) // 2 + 1000 * i * n) + i * n)


def stream_ctx(kind: str) -> contextlib.AbstractContextManager[Any]:
    """The compute stream of a test: the default stream, or a fresh stream made current (hand-off must wait there)."""
    return contextlib.nullcontext() if kind == "default" else torch.cuda.stream(torch.cuda.Stream())


def check_batch(batch: Any, i: int, device: torch.device, bad: list[torch.Tensor], sums: list[torch.Tensor]) -> None:
    """Structure, device and dtypes on the host; on the device, the mismatches against batch i (built afresh on the
    current stream) and a computation on the batch, both left on the device (no sync) for `finish` to read."""
    x, y = batch
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    assert x.device == device and y.device == device
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (ROWS, COLS) and y.shape == (ROWS,)
    ref = torch.arange(ROWS * COLS, dtype=torch.float32, device=device).reshape(ROWS, COLS) + 1000 * i
    bad.append((x != ref).sum() + (y != i).sum())
    sums.append((x.double() * 2 + y.double()[:, None]).sum())


def finish(bad: list[torch.Tensor], sums: list[torch.Tensor], n: int) -> None:
    assert len(bad) == n
    if n:
        assert torch.stack(bad).cpu().tolist() == [0] * n
        assert torch.stack(sums).cpu().tolist() == [host_sum(i) for i in range(n)]


def run_epoch(pf: DevicePrefetcher, n: int, device: torch.device) -> None:
    bad: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    for i, batch in enumerate(pf):
        check_batch(batch, i, device, bad, sums)
    finish(bad, sums, n)


def this_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@functools.cache
def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of `torch.cuda._sleep` (a kernel that spins: a slow consumer on demand)."""
    torch.cuda._sleep(10_000_000)  # the kernel loaded, the clocks up
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 100_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def slow_kernel(ms: float) -> None:
    """Keep the current stream busy for about `ms` milliseconds."""
    torch.cuda._sleep(int(ms * cycles_per_ms()))


# ---- counts of batches, epochs, structures ---------------------------------------------------------------------

def test_no_batches_from_an_empty_loader() -> None:
    pf = DevicePrefetcher(Batches(0, host_batch), "cuda")
    for _ in range(2):
        assert list(pf) == []
    with ShmLoader(fx.IndexDataset(0), rank=0, size=1, batch_size=4, num_workers=1) as ld:
        pf = DevicePrefetcher(ld, "cuda")
        assert list(pf) == [] and pf.state_dict()["batches_consumed"] == 0


@pytest.mark.parametrize("stream", ["default", "side"])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_n_batches_arrive_intact_on_the_compute_stream(n: int, stream: str) -> None:
    """1 batch (nothing ahead of it), 2 (one of each ring slot), 7 (the two pinned slots each reused)."""
    with stream_ctx(stream):
        pf = DevicePrefetcher(Batches(n, host_batch), "cuda")
        assert pf.device == this_device()  # "cuda" is the current device
        run_epoch(pf, n, pf.device)
        if stream == "side":
            assert pf._stream != torch.cuda.current_stream()


@pytest.mark.parametrize("stream", ["default", "side"])
def test_several_epochs_of_the_same_prefetcher(stream: str) -> None:
    n = 5  # odd: an epoch ends on ring slot 0 and the next one starts on it again
    with stream_ctx(stream):
        pf = DevicePrefetcher(Batches(n, host_batch), "cuda")
        assert len(pf) == n
        ring = None
        for _ in range(3):
            run_epoch(pf, n, pf.device)
            pinned = [t.data_ptr() for slot in pf._pinned for t in slot]
            assert all(t.is_pinned() for slot in pf._pinned for t in slot)
            assert ring is None or pinned == ring  # same shapes: the pinned staging buffers are reused, not reallocated
            ring = pinned


def nested_dict(i: int) -> dict[str, Any]:
    x = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16) + i
    return {"x": x, "xt": x.t(),  # a non-contiguous view
            "half": torch.full((4,), i, dtype=torch.float16), "mask": np.arange(6) % 2 == i % 2,
            "u8": np.full(3, i, np.uint8), "name": f"batch-{i}", "i": i, "none": None}


@pytest.mark.parametrize("stream", ["default", "side"])
def test_tuple_list_dict_and_bare_tensor_structures_with_non_tensor_leaves(stream: str) -> None:
    n = 5
    with stream_ctx(stream):
        device = this_device()
        bad: list[torch.Tensor] = []
        for i, b in enumerate(DevicePrefetcher(Batches(n, nested_dict), "cuda")):
            assert list(b) == ["x", "xt", "half", "mask", "u8", "name", "i", "none"]
            assert (b["name"], b["i"], b["none"]) == (f"batch-{i}", i, None)
            for key, dtype in (("x", torch.float32), ("xt", torch.float32), ("half", torch.float16),
                               ("mask", torch.bool), ("u8", torch.uint8)):
                assert b[key].device == device and b[key].dtype == dtype, key
            x = torch.arange(8 * 16, dtype=torch.float32, device=device).reshape(8, 16) + i
            mask = torch.arange(6, device=device) % 2 == i % 2
            bad += [(b["x"] != x).sum(), (b["xt"] != x.t()).sum(), (b["half"] != i).sum(), (b["mask"] != mask).sum(),
                    (b["u8"] != i).sum(), (b["x"] @ b["xt"] != x @ x.t()).sum()]
        assert torch.stack(bad).cpu().tolist() == [0] * len(bad) and len(bad) == 6 * n

        def as_tuple(i: int) -> tuple[Any, ...]:
            return torch.full((7,), i, dtype=torch.int32), np.full((2, 3), i, np.float64), f"t{i}", i

        for cls in (tuple, list):
            got = list(DevicePrefetcher(Batches(n, lambda i, cls=cls: cls(as_tuple(i))), "cuda"))
            assert len(got) == n
            for i, b in enumerate(got):
                assert type(b) is cls and b[2:] == cls((f"t{i}", i))
                assert b[0].device == device and b[0].dtype == torch.int32 and b[1].dtype == torch.float64
                assert torch.equal(b[0], torch.full((7,), i, dtype=torch.int32, device=device))
                assert torch.equal(b[1] * 2, torch.full((2, 3), 2.0 * i, dtype=torch.float64, device=device))

        bare = list(DevicePrefetcher(Batches(3, lambda i: torch.full((5,), i)), "cuda"))
        assert [b.device for b in bare] == [device] * 3
        assert torch.stack(bare).sum(1).cpu().tolist() == [0, 5, 10]


# ---- big batches, overlap, early free ---------------------------------------------------------------------------

def test_48mb_copies_overlap_a_slow_kernel_on_the_compute_stream() -> None:
    """When batch 0 is handed over, batch 1's copy is on its way; the next `next()` issues batch 2's copy and returns
    without waiting for the compute stream, and that copy completes while batch 0's slow kernel still runs."""
    n = 5
    cycles_per_ms()  # calibrated before: it synchronizes the device
    base_host = torch.arange(BIG[0] * BIG[1], dtype=torch.float32).reshape(BIG)
    pf = DevicePrefetcher(Batches(n, lambda i: base_host + i), "cuda")
    base = base_host.cuda()
    expect = float(base.double().sum())
    total = BIG[0] * BIG[1]
    for batch in pf:  # a warm-up epoch: the staging buffers and the allocator's blocks exist (no cudaMalloc later)
        del batch
    torch.cuda.synchronize()
    compute = torch.cuda.current_stream()
    sums: list[torch.Tensor] = []
    bad: list[torch.Tensor] = []
    it = iter(pf)
    x = next(it)
    slow_kernel(1000)  # the compute stream is busy for about a second ...
    bad.append((x != base).sum())  # ... before it reads batch 0
    sums.append(x.double().sum())
    done0 = torch.cuda.Event()
    done0.record(compute)
    del x
    started = time.perf_counter()
    x1 = next(it)  # batch 2 into pinned slot 0 and its copy issued; batch 1 handed over
    took = time.perf_counter() - started
    assert not done0.query(), f"next() took {took * 1e3:.0f} ms: it waited for the compute stream"
    copy2 = pf._copied[0]  # the event recorded after batch 2's copy (ring slot 0)
    while not copy2.query() and time.perf_counter() - started < 0.8:
        time.sleep(0.001)
    assert copy2.query(), "batch 2's copy did not complete within 0.8 s"
    assert not done0.query(), "batch 2's copy completed only after batch 0's compute: no overlap"
    for i, x in enumerate(itertools.chain([x1], it), start=1):
        slow_kernel(5)
        bad.append((x != base + i).sum())
        sums.append(x.double().sum())
    assert len(sums) == n
    assert torch.stack(bad).cpu().tolist() == [0] * n
    assert torch.stack(sums).cpu().tolist() == [expect + i * total for i in range(n)]


@pytest.mark.parametrize("stream", ["default", "side"])
def test_tensors_freed_while_compute_still_reads_them_are_not_overwritten(stream: str) -> None:
    """The record_stream path, NOTE [stream sync] (b): the compute stream lags ~20 ms a batch behind the host; each
    step keeps only a reduction of its batch, deletes the batch and allocates new tensors. Without record_stream the
    allocator would hand a freed batch's memory to a later copy on the side stream before the compute stream has
    read it, and the reductions would come out wrong."""
    n, size = 12, 1_000_000
    base_host = torch.arange(size, dtype=torch.float32)
    pf = DevicePrefetcher(Batches(n, lambda i: (base_host + 1000 * i,)), "cuda")
    with stream_ctx(stream):
        for batch in pf:  # warm-up: the side stream's pool now holds freed blocks of exactly this size
            del batch
        torch.cuda.synchronize()
        sums: list[torch.Tensor] = []
        fresh: list[torch.Tensor] = []
        for i, (x,) in enumerate(pf):
            slow_kernel(20)
            sums.append(x.double().sum())  # read after the sleep: the host is far ahead by then
            y = torch.empty_like(x).fill_(-1.0)  # new allocations while x is still to be read
            z = x * 0 + i
            fresh.append((z != i).sum() + (y != -1).sum())
            del x, y, z
        base_sum = size * (size - 1) // 2
        assert torch.stack(sums).cpu().tolist() == [float(base_sum + 1000 * i * size) for i in range(n)]
        assert torch.stack(fresh).cpu().tolist() == [0] * n


# ---- a real ShmLoader ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", ["default", "side"])
@pytest.mark.parametrize("register_slots", [True, False])
@pytest.mark.parametrize("ahead", [False, True])
def test_a_shm_loader_with_two_workers_feeds_the_right_samples(stream: str, register_slots: bool,
                                                               ahead: bool) -> None:
    """IndexDataset sample i is (float32[3] = i, int64 i): every batch names its indices; they must be the sampler's,
    in its order, over two shuffled epochs (50 samples in batches of 4: the last is partial, the ring reallocates).
    register_slots: copied straight out of the page-locked slots (NOTE [registered slots]), or through the ring.
    ahead: each step starts the next copy itself (DevicePrefetcher.ahead, as the recipe does during backward)."""
    n, bs = 50, 4
    sampler = ShardSampler(n, 0, 1, seed=3, batch_size=bs)
    with ShmLoader(fx.IndexDataset(n), rank=0, size=1, batch_size=bs, num_workers=2, seed=3, epochs=2) as ld, \
            stream_ctx(stream):
        pf = DevicePrefetcher(ld, "cuda", register_slots=register_slots)
        device = this_device()
        for epoch in range(2):
            pf.set_epoch(epoch)
            sampler.set_epoch(epoch)
            expected = sampler.batches()
            assert len(pf) == len(expected) == 13
            bad, sums, seen = [], [], 0
            for k, (x, y) in enumerate(pf):
                assert x.device == device and x.dtype == torch.float32 and y.dtype == torch.int64
                assert x.shape == (len(expected[k]), 3)
                idx = torch.as_tensor(expected[k], device=device)
                bad.append((y != idx).sum() + (x != idx.float()[:, None]).sum())
                sums.append((x.sum(1) - 3 * y).abs().sum())  # computed on the batch: 0
                if ahead:
                    slow_kernel(0.2)  # the step still computing while the next copy starts
                    pf.ahead()
                seen += 1
            assert seen == len(expected)
            assert torch.stack(bad).cpu().tolist() == [0] * seen
            assert torch.stack(sums).cpu().tolist() == [0.0] * seen
            assert ld._rx.lender.held_slots() == []  # the epoch's last slots went back after their copies
        assert pf.slots_registered is register_slots, pf.slots_failed
        assert bool(pf._slots and pf._slots.regions) is register_slots
    assert pf._slots is None or pf._slots.regions == {}  # close() unregistered every slot


def test_registered_slots_survive_growth_and_slow_consumers() -> None:
    """Batches that outgrow their slot (a new segment: the old one is unregistered first, NOTE [registered slots]
    (a)) and a compute stream that lags behind (a slot must not go back while its copy may be in flight, (b)):
    every value right, checked on the device."""
    with ShmLoader.from_generator(fx.growing_batches, rank=0, size=1, num_workers=2, prefetch=1, epochs=2) as ld:
        pf = DevicePrefetcher(ld, "cuda")
        sizes = (0, 10, 1000, 300_000, 50, 600_000, 3)
        for epoch in range(2):
            pf.set_epoch(epoch)
            bad = []
            for k, x in enumerate(pf):
                n, w = sizes[k // 2], k % 2
                torch.cuda._sleep(2_000_000)  # the compute stream lags: copies queue up behind nothing
                want = torch.arange(n, dtype=torch.float64, device=x.device) + w
                bad.append((x != want).sum())
            assert torch.stack(bad).cpu().tolist() == [0] * 14
        assert pf.slots_registered is True
    assert pf._slots.regions == {}


@pytest.mark.parametrize("stream", ["default", "side"])
def test_break_mid_epoch_then_iterate_again(stream: str) -> None:
    n = 7
    with stream_ctx(stream):
        pf = DevicePrefetcher(Batches(n, host_batch), "cuda")
        bad: list[torch.Tensor] = []
        sums: list[torch.Tensor] = []
        for i, batch in enumerate(pf):
            check_batch(batch, i, pf.device, bad, sums)
            if i == 2:
                break  # batch 3's copy is in flight, its pinned slot busy
        finish(bad, sums, 3)
        for _ in range(2):
            run_epoch(pf, n, pf.device)
        bad, sums = [], []
        for batch in pf:  # a break on the very first batch
            check_batch(batch, 0, pf.device, bad, sums)
            break
        finish(bad, sums, 1)
        run_epoch(pf, n, pf.device)


def test_state_dict_leaves_out_the_batch_in_flight_and_resumes_there() -> None:
    """The real-CUDA version of tests/data/test_prefetch.py's faked one: the state names the batches handed over, not
    the one being copied; resuming from it yields that one again. Then a resume in a fresh loader (a restarted job)."""
    n, bs = 10, 4
    device = this_device()
    with ShmLoader(fx.IndexDataset(n), rank=0, size=1, batch_size=bs, num_workers=2, shuffle=False) as ld:
        pf = DevicePrefetcher(ld, "cuda")
        trained = ShardSampler(n, 0, 1, shuffle=False, batch_size=bs)
        got = []
        for x, y in pf:
            trained.advance(1)
            assert pf.state_dict() == trained.state_dict(), y.tolist()
            assert torch.equal(x[:, 0].long(), y)
            got.append(y.tolist())
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert pf.state_dict()["samples_consumed"] == n
        it = iter(pf)
        x, y = next(it)
        assert y.device == device and y.tolist() == [0, 1, 2, 3]
        state = pf.state_dict()
        assert state["batches_consumed"] == 1  # batch 1 is in flight
        del it, x, y
        pf.load_state_dict(state)
        rest = []
        for x, y in pf:
            assert torch.equal(x[:, 0].long(), y)
            rest.append(y.tolist())
        assert rest == [[4, 5, 6, 7], [8, 9]]

    n, bs, seed = 30, 4, 5
    sampler = ShardSampler(n, 0, 1, seed=seed, batch_size=bs)
    sampler.set_epoch(1)
    expected = [b.tolist() for b in sampler.batches()]
    with ShmLoader(fx.IndexDataset(n), rank=0, size=1, batch_size=bs, num_workers=2, seed=seed) as ld:
        pf = DevicePrefetcher(ld, "cuda")
        pf.set_epoch(1)
        head = []
        for x, y in pf:
            head.append(y.tolist())
            assert torch.equal(x, y.float()[:, None].expand(-1, 3))
            if len(head) == 3:
                break
        state = pf.state_dict()  # 3 handed over, the 4th in flight
        assert state["epoch"] == 1 and state["batches_consumed"] == 3
    with ShmLoader(fx.IndexDataset(n), rank=0, size=1, batch_size=bs, num_workers=2, seed=seed) as ld:
        pf = DevicePrefetcher(ld, "cuda")
        pf.load_state_dict(state)
        tail = [y.tolist() for _, y in pf]
    assert head + tail == expected


# ---- another device ------------------------------------------------------------------------------------------------

def test_prefetch_to_another_device_than_the_current_one() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices to prefetch to cuda:1 while cuda:0 is current "
                    f"({torch.cuda.device_count()} here)")
    target = torch.device("cuda", 1)
    n = 5
    with torch.cuda.device(0):
        pf = DevicePrefetcher(Batches(n, host_batch), target)
        for _ in range(2):
            bad: list[torch.Tensor] = []
            sums: list[torch.Tensor] = []
            for i, batch in enumerate(pf):  # next() runs with cuda:0 current
                assert torch.cuda.current_device() == 0
                # The checks run with cuda:1 current: the sanitizer files every kernel under the current device's
                # current stream, whatever device the tensors are on.
                with torch.cuda.device(1):
                    check_batch(batch, i, target, bad, sums)
            with torch.cuda.device(1):
                finish(bad, sums, n)
        assert torch.cuda.current_device() == 0
        assert pf._stream.device == target
        assert all(t.is_pinned() for slot in pf._pinned for t in slot)
    with torch.cuda.device(1):
        assert DevicePrefetcher([], "cuda").device == target  # "cuda" is the device current at construction


def test_gpu_idle_meter_sees_a_starved_stream_and_a_fed_one() -> None:
    """GpuIdleMeter on real CUDA events (hvdtrain/data/idle.py): a host that sleeps 5 ms per batch while the GPU
    has ~nothing queued leaves ~5 ms gaps; a host that queues a long kernel per step keeps the stream busy (~0)."""
    from hvdtrain.data.idle import GpuIdleMeter

    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(2048, 2048, device=dev)

    def starved() -> Iterator[int]:
        for i in range(12):
            time.sleep(0.005)
            yield i

    meter = GpuIdleMeter(dev, warmup_steps=1)
    for _ in meter.wrap(starved()):
        a.add_(1.0)  # a few microseconds of work
    s = meter.summary()
    assert s["measured"] and s["steps"] == 11 and s["mean_idle_s"] > 0.004 and s["idle_share"] > 0.8, s

    fed = GpuIdleMeter(dev, warmup_steps=1)
    for _ in fed.wrap(range(12)):
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)  # milliseconds of queued work per step: the host stays ahead
    s = fed.summary()
    assert s["mean_idle_s"] < 1e-4 and s["idle_share"] < 0.02, s
