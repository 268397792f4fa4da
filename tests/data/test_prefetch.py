"""TorchLoader and DevicePrefetcher: the CPU pass-through, and the CUDA path's iteration logic with the copies faked
(the real CUDA test is skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvdtrain.data import DevicePrefetcher, ShardSampler, ShmLoader, TorchLoader, to_torch
from tests.support import loaders as fx

pytestmark = pytest.mark.timeout(120)


def test_torch_loader_tensors_view_the_shared_memory_slot() -> None:
    with TorchLoader(ShmLoader(fx.IndexDataset(10), rank=1, size=2, batch_size=2, num_workers=1, seed=2)) as tl:
        assert len(tl) == 3
        shm_loader = tl.loader
        for x, y in tl:
            assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and y.dtype == torch.int64
            (slot,) = shm_loader._rx.lender.held_slots()
            seg = shm_loader._res.segments[slot]
            base = np.frombuffer(seg.buf, np.uint8)
            start = base.ctypes.data
            assert start <= x.data_ptr() < start + seg.size  # no copy: the tensor lives in the slot
            assert torch.equal(x[:, 0].long(), y)
            del base, x, y  # the slot goes back when its last tensor is released
        tl.set_epoch(1)
        copies = [x for x, _ in TorchLoader(shm_loader, copy=True)]
        assert all(c.untyped_storage().data_ptr() != copies[0].untyped_storage().data_ptr() for c in copies[1:])
        assert tl.state_dict()["epoch"] == 1


def test_to_torch_keeps_the_structure() -> None:
    out = to_torch({"a": np.zeros(2), "b": 3})
    assert isinstance(out["a"], torch.Tensor) and out["b"] == 3
    assert isinstance(to_torch([np.ones(1)]), list) and isinstance(to_torch((np.ones(1),)), tuple)


def test_nested_batches_are_converted_at_every_depth() -> None:
    """(x, (y1, y2)) and {"a": {"b": arr}} leave no numpy array behind (they were left unconverted before, and a
    CUDA prefetcher left such inner arrays on the host); named tuples keep their type."""
    from collections import namedtuple

    pair = namedtuple("pair", "x y")
    out = to_torch((np.zeros(2), (np.ones(1), [np.arange(3)]), {"a": {"b": np.ones(2)}, "n": 3}, pair(np.ones(1), 7)))
    assert isinstance(out[0], torch.Tensor) and isinstance(out[1], tuple) and isinstance(out[1][1], list)
    assert all(isinstance(t, torch.Tensor) for t in (out[1][0], out[1][1][0], out[2]["a"]["b"], out[3].x))
    assert out[2]["n"] == 3 and type(out[3]) is pair and out[3].y == 7
    assert out[1][1][0].tolist() == [0, 1, 2]


def test_cpu_prefetcher_is_a_pass_through_that_yields_every_batch() -> None:
    with DevicePrefetcher(TorchLoader(ShmLoader(fx.IndexDataset(9), rank=0, size=1, batch_size=2, num_workers=2,
                                                shuffle=False)), "cpu") as pf:
        for _ in range(2):  # re-iteration starts afresh
            got = [y.tolist() for _, y in pf]
            assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]  # the last, partial batch included
        it = iter(pf)
        next(it)
        assert pf.state_dict()["batches_consumed"] == 1  # no look-ahead on CPU
    assert list(DevicePrefetcher([], "cpu")) == []
    numpy_in = list(DevicePrefetcher([np.arange(3)], "cpu"))
    assert isinstance(numpy_in[0], torch.Tensor)


class _FakeLoader:
    def __init__(self, n: int) -> None:
        self.n, self.yielded = n, 0

    def __iter__(self):
        self.yielded = 0
        for i in range(self.n):
            self.yielded += 1
            yield torch.full((2,), i)

    def __len__(self) -> int:
        return self.n

    def state_dict(self, unconsumed: int = 0) -> dict:
        return {"epoch": 0, "batches_consumed": self.yielded - unconsumed}


def _fake_cuda(monkeypatch, log: list) -> None:
    """Replace the two CUDA calls by recorders: what remains is the prefetcher's own iteration logic."""
    monkeypatch.setattr(DevicePrefetcher, "_issue", lambda self, host, slot: log.append(("issue", int(host[0]), slot))
                        or (host, None))
    monkeypatch.setattr(DevicePrefetcher, "_hand_off", lambda self, dev, ev: log.append(("hand", int(dev[0])))
                        or dev)


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_cuda_path_iteration_semantics_with_faked_copies(monkeypatch, n: int) -> None:
    log: list = []
    _fake_cuda(monkeypatch, log)
    loader = _FakeLoader(n)
    pf = DevicePrefetcher(loader, "cuda:0")
    for _ in range(2):  # every epoch starts afresh, the last batch is always yielded, an empty loader is fine
        log.clear()
        got, states = [], []
        for batch in pf:
            got.append(int(batch[0]))
            states.append(pf.state_dict()["batches_consumed"])
        assert got == list(range(n))
        assert states == list(range(1, n + 1))  # consumed = handed to the caller, not fetched ahead
        # batch k+1's copy is issued before batch k is handed over; pinned slots alternate 0, 1
        expect = [("issue", 0, 0)] if n else []
        for k in range(n):
            if k + 1 < n:
                expect.append(("issue", k + 1, (k + 1) % 2))
            expect.append(("hand", k))
        assert log == expect


@pytest.mark.parametrize("n", [1, 2, 5])
def test_ahead_moves_the_next_batchs_copy_into_the_step(monkeypatch, n: int) -> None:
    """A loop that calls ahead() in each step: the first batch is handed over with the next already in flight (as
    without ahead), then each copy starts in the step before its batch is handed over, never in next(); state counts
    only the batches handed over; a second epoch starts the same way; ahead() outside an epoch does nothing."""
    log: list = []
    _fake_cuda(monkeypatch, log)
    pf = DevicePrefetcher(_FakeLoader(n), "cuda:0")
    pf.ahead()
    assert log == []
    for _ in range(2):
        log.clear()
        got, states = [], []
        for batch in pf:
            got.append(int(batch[0]))
            log.append("step")
            pf.ahead()
            states.append(pf.state_dict()["batches_consumed"])
        assert got == list(range(n)) and states == list(range(1, n + 1))
        expect = [("issue", 0, 0)] + ([("issue", 1, 1)] if n > 1 else []) + [("hand", 0), "step"]
        for k in range(1, n):
            expect += [("hand", k), "step"] + ([("issue", k + 1, (k + 1) % 2)] if k + 1 < n else [])
        assert log == expect


def test_cuda_path_break_and_restart(monkeypatch) -> None:
    _fake_cuda(monkeypatch, [])
    pf = DevicePrefetcher(_FakeLoader(4), "cuda:0")
    for batch in pf:
        if int(batch[0]) == 1:
            break
    assert [int(b[0]) for b in pf] == [0, 1, 2, 3]


@pytest.mark.parametrize("wrap", [False, True])
def test_cuda_path_state_of_a_real_loader_leaves_out_the_batch_in_flight(monkeypatch, wrap: bool) -> None:
    """The prefetcher asks the loader for its state minus the batches fetched ahead; resuming from it yields the
    batch that was in flight again (3 batches of 4 of 10 samples: the last is partial, samples_consumed capped)."""
    monkeypatch.setattr(DevicePrefetcher, "_issue", lambda self, host, slot: (to_torch(host, copy=True), None))
    monkeypatch.setattr(DevicePrefetcher, "_hand_off", lambda self, dev, ev: dev)
    n, bs = 10, 4
    with ShmLoader(fx.IndexDataset(n), rank=0, size=1, batch_size=bs, num_workers=2, shuffle=False) as ld:
        pf = DevicePrefetcher(TorchLoader(ld) if wrap else ld, "cuda:0")
        trained = ShardSampler(n, 0, 1, shuffle=False, batch_size=bs)
        for _, y in pf:
            trained.advance(1)
            assert pf.state_dict() == trained.state_dict(), y.tolist()
        assert pf.state_dict()["samples_consumed"] == n
        _, y = next(iter(pf))
        assert y.tolist() == [0, 1, 2, 3] and pf.state_dict()["batches_consumed"] == 1  # batch 1 is in flight
        pf.load_state_dict(pf.state_dict())
        assert [y.tolist() for _, y in pf] == [[4, 5, 6, 7], [8, 9]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the real stream/pinned path needs a GPU")
def test_cuda_prefetcher_copies_right_data() -> None:
    batches = [(torch.full((64, 1024), float(i)), torch.tensor([i])) for i in range(6)]
    pf = DevicePrefetcher(batches, "cuda")
    for i, (x, y) in enumerate(pf):
        assert x.is_cuda and float((x * 2).sum()) == 2.0 * i * 64 * 1024 and int(y) == i


class _PlainStateLoader(_FakeLoader):
    """A loader whose state_dict() takes no arguments (a user's own, or another library's)."""

    def state_dict(self) -> dict:  # type: ignore[override]
        return {"epoch": 0, "batches_consumed": self.yielded}


def test_a_loader_without_unconsumed_gets_its_count_lowered_by_the_batches_in_flight(monkeypatch) -> None:
    _fake_cuda(monkeypatch, [])
    pf = DevicePrefetcher(_PlainStateLoader(4), "cuda:0")
    states = [pf.state_dict()["batches_consumed"] for _ in pf]
    assert states == [1, 2, 3, 4]
