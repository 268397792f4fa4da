"""Copies straight out of page-locked slots (NOTE [registered slots] in hvdtrain/data/pinning.py), the parts that
need no GPU: the loader's slot regions and release hooks with real producer processes, and SlotRegistry's
bookkeeping with the CUDA runtime's register/unregister calls recorded instead of made (the real calls, and the
copies, run in tests/data/test_prefetch_cuda.py on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvdtrain.data import DevicePrefetcher, ShmLoader, TorchLoader, pinning
from tests.support import loaders as fx

pytestmark = pytest.mark.timeout(120)


def region_of(ld: ShmLoader, a: np.ndarray) -> tuple[int, int] | None:
    return ld.slot_region(a.ctypes.data)


def test_every_lent_array_lies_in_its_slots_region_and_nothing_else_does() -> None:
    with ShmLoader(fx.IndexDataset(40), rank=0, size=1, batch_size=8, num_workers=2, seed=1) as ld:
        regions = set()
        for x, y in ld:
            for a in (x, y):
                found = region_of(ld, a)
                assert found is not None, "a lent array outside every slot"
                start, size = found
                assert start <= a.ctypes.data and a.ctypes.data + a.nbytes <= start + size
                regions.add(found)
        assert 1 <= len(regions) <= 2 * (2 + 1)  # 2 workers x (prefetch + 1) slots
        assert region_of(ld, np.zeros(8)) is None  # the trainer's own memory is no slot


def test_release_hooks_see_each_slot_before_it_is_dropped_when_grown_and_at_close() -> None:
    released: list[int] = []
    ld = ShmLoader.from_generator(fx.growing_batches, rank=0, size=1, num_workers=1, prefetch=1)
    ld.on_slot_release(released.append)
    mapped = {seg.address for seg in ld._res.segments.values()}  # every slot mapping this process has had
    got = []
    for b in ld:  # 300_000 and 600_000 float64 outgrow a slot's first 1 MiB
        got.append(b.copy())
        mapped |= {seg.address for seg in ld._res.segments.values()}
    assert [len(b) for b in got] == [0, 10, 1000, 300_000, 50, 600_000, 3]
    grown = set(released)
    assert grown, "no release hook ran when slots grew"
    assert grown <= mapped, "a hook was given an address that was never a slot mapping"
    live = {seg.address for seg in ld._res.segments.values()}
    ld.close()
    assert set(released) - grown == live  # close(): every remaining slot, once
    assert len(released) == len(set(released))


class FakeCudart:
    """Records cudaHostRegister/cudaHostUnregister; `fail` makes registration return a CUDA error code."""

    def __init__(self, fail: int = 0) -> None:
        self.fail, self.calls = fail, []

    def cudaHostRegister(self, addr: int, size: int, flags: int) -> int:
        self.calls.append(("register", addr, size, flags))
        return self.fail

    def cudaHostUnregister(self, addr: int) -> int:
        self.calls.append(("unregister", addr))
        return 0


@pytest.fixture
def cudart(monkeypatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_registry_registers_each_slot_once_and_unregisters_after_the_copies(cudart) -> None:
    buf = torch.zeros(4096, dtype=torch.uint8)
    start = buf.data_ptr()
    waited: list[int] = []
    reg = pinning.SlotRegistry(lambda p: (start, 4096) if start <= p < start + 4096 else None,
                               lambda: waited.append(1))
    assert reg.covers([buf[:100], buf[100:200], "not a tensor"])
    assert reg.covers([buf[1000:]])
    assert cudart.calls == [("register", start, 4096, 1)]  # once, portable
    assert not reg.covers([torch.zeros(10)])  # not in a slot: the pinned staging buffers
    assert not reg.covers([buf.view(64, 64).t()])  # not contiguous: the pinned staging buffers
    reg.release(start + 1)  # not a registered start: nothing
    assert waited == []
    reg.release(start)
    assert waited == [1] and cudart.calls[-1] == ("unregister", start) and reg.regions == {}
    reg.close()
    assert cudart.calls[-1] == ("unregister", start)  # nothing left to unregister


def test_a_failed_registration_falls_back_for_good_and_clears_the_error(cudart, monkeypatch) -> None:
    consumed: list[int] = []
    monkeypatch.setattr(pinning, "_consume_error", lambda: consumed.append(1))
    cudart.fail = 712  # cudaErrorHostMemoryAlreadyRegistered
    buf = torch.zeros(64)
    reg = pinning.SlotRegistry(lambda p: (buf.data_ptr(), 256), lambda: None)
    assert not reg.covers([buf]) and consumed == [1]
    assert reg.failed == "cudaHostRegister failed with CUDA error 712"
    cudart.fail = 0
    assert not reg.covers([buf]) and len(cudart.calls) == 1  # given up: no second try


def test_the_prefetcher_finds_the_slots_through_a_wrapper_unless_told_not_to() -> None:
    with ShmLoader(fx.IndexDataset(8), rank=0, size=1, batch_size=4, num_workers=1) as ld:
        pf = DevicePrefetcher(TorchLoader(ld), "cuda:0")  # no CUDA call until a batch is copied
        assert pf.slots_registered is None
        reg = pf._registry()
        assert isinstance(reg, pinning.SlotRegistry) and ld._res.release_hooks == [reg.release]
        assert pf.slots_registered is True
        off = DevicePrefetcher(ld, "cuda:0", register_slots=False)
        assert off._registry() is None and off.slots_registered is False
        assert DevicePrefetcher([np.zeros(2)], "cuda:0")._registry() is None  # a loader without slots
