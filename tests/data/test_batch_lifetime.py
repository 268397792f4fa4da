"""A batch stays valid as long as the user holds it: no aliasing, no use-after-unmap, no deadlock (issue 14.1,
NOTE [batch lifetime] in hvdtrain/data/lending.py). Real producer processes; crashes are caught in a subprocess."""

from __future__ import annotations

import gc
import queue
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from hvdtrain.data import DevicePrefetcher, ShardSampler, ShmLoader, TorchLoader
from tests.support import harness
from tests.support import loaders as fx

pytestmark = pytest.mark.timeout(120)


def sample_ids(batch) -> list[int]:
    """The indices an IndexDataset batch holds, read from both arrays (they must agree)."""
    x, y = batch
    assert np.array_equal(np.asarray(x)[:, 0].astype(np.int64), np.asarray(y)), (x, y)
    return np.asarray(y).tolist()


HELD_AFTER_THE_LOADER = r"""
import gc, os, sys
sys.path.insert(0, sys.argv[1])
print("PID", os.getpid(), flush=True)
from hvdtrain.data import ShmLoader
from tests.support import loaders as fx

with ShmLoader(fx.IndexDataset(64), rank=0, size=1, batch_size=8, num_workers=1, shuffle=False) as ld:
    for b in ld:
        last = b
print("AFTER-WITH", last[1].tolist(), last[0][:, 0].tolist(), flush=True)
ld2 = ShmLoader(fx.IndexDataset(16), rank=0, size=1, batch_size=8, num_workers=2, shuffle=False)
kept = list(ld2)
del ld2
gc.collect()
print("AFTER-GC", [b[1].tolist() for b in kept], flush=True)
ld3 = ShmLoader(fx.IndexDataset(8), rank=0, size=1, batch_size=4, num_workers=1, shuffle=False)
at_exit = next(iter(ld3))  # held in a global, loader never closed: interpreter exit must not crash
print("DONE", flush=True)
"""


def test_a_batch_held_after_close_gc_and_exit_is_intact_and_nothing_crashes(tmp_path: Path) -> None:
    script = tmp_path / "held.py"
    script.write_text(HELD_AFTER_THE_LOADER)
    result = harness.run_bounded([sys.executable, str(script), str(harness.REPO)], timeout=90, cwd=tmp_path)
    assert result.returncode == 0, result.describe()  # was -11 (SIGSEGV): the views outlived the mapping
    assert "AFTER-WITH [56, 57, 58, 59, 60, 61, 62, 63] [56.0, 57.0, 58.0, 59.0, 60.0, 61.0, 62.0, 63.0]" \
        in result.output, result.describe()
    assert "AFTER-GC [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]" in result.output, result.describe()
    assert "DONE" in result.output and "Traceback" not in result.output, result.describe()
    pid = result.output.split("PID ", 1)[1].split()[0]
    assert not list(Path("/dev/shm").glob(f"hvdtrain_{pid}_*")), result.describe()  # nothing leaked at exit


def test_cpu_prefetcher_labels_collected_without_clone_are_right() -> None:
    loader = ShmLoader(fx.IndexDataset(160), rank=0, size=1, batch_size=32, num_workers=2, shuffle=False)
    with DevicePrefetcher(loader, "cpu") as pf:
        labels = []
        for _x, y in pf:
            labels.append(y)
        assert torch.cat(labels).tolist() == list(range(160))  # was [32..63, 32..63, ...]: slots rewritten
        again = [y for _, y in pf]  # a second epoch while the first epoch's tensors are still held
        assert torch.cat(labels).tolist() == list(range(160)) == torch.cat(again).tolist()


@pytest.mark.parametrize("workers,prefetch", [(1, 1), (1, 2), (2, 1), (3, 2)])
def test_keeping_every_batch_is_correct_bounded_and_never_deadlocks(workers: int, prefetch: int) -> None:
    with ShmLoader(fx.IndexDataset(200), rank=1, size=2, batch_size=4, num_workers=workers, prefetch=prefetch,
                   seed=5, timeout=20) as ld:
        sampler = ShardSampler(200, 1, 2, seed=5, batch_size=4)
        expect = [b.tolist() for b in sampler.batches()]
        kept = list(ld)  # the user holds all 25 batches: more than the 2-9 slots of the ring
        ids = [sample_ids(b) for b in kept]
        assert ids == expect
        assert ld._rx.lender.copies == len(kept) - workers * prefetch  # `prefetch` per worker zero-copy, then copies
        assert len(ld._rx.lender.held_slots()) <= workers * prefetch  # at most `prefetch` slots of each worker held
        del kept, ids
        gc.collect()
        ld.set_epoch(1)
        sampler.set_epoch(1)
        assert [sample_ids(b) for b in ld] == [b.tolist() for b in sampler.batches()]  # the slots came back
        assert not ld._rx.lender.held_slots()


def test_a_plain_loop_stays_zero_copy_and_a_batch_kept_past_the_next_is_intact() -> None:
    with ShmLoader(fx.IndexDataset(40), rank=0, size=1, batch_size=4, num_workers=1, prefetch=2,
                   shuffle=False) as ld:
        seg_ranges = []
        for b in ld:  # the loop variable still holds batch k while batch k+1 is requested
            seg_ranges.append(any(seg._mmap is not None and _inside(b[0], seg) for seg in ld._res.segments.values()))
        assert all(seg_ranges) and ld._rx.lender.copies == 0  # no copy in a plain loop with prefetch=2
        it = iter(ld)
        first, second = next(it), next(it)
        rest = [sample_ids(b) for b in it]
        assert sample_ids(first) == [0, 1, 2, 3] and sample_ids(second) == [4, 5, 6, 7]
        assert rest == [list(range(i, i + 4)) for i in range(8, 40, 4)]


def _inside(arr: np.ndarray, seg) -> bool:
    start = np.frombuffer(seg.buf, np.uint8).ctypes.data
    return start <= arr.ctypes.data < start + seg.size


def test_torch_views_of_views_keep_the_slot_across_epochs() -> None:
    with TorchLoader(ShmLoader(fx.IndexDataset(12), rank=0, size=1, batch_size=3, num_workers=1, prefetch=1,
                               shuffle=False)) as tl:
        x, y = next(iter(tl))
        tail = x[1:, 0]  # a tensor view of a tensor view of the numpy view: only this is kept
        del x, y
        assert len(tl.loader._rx.lender.held_slots()) == 1  # held by `tail` alone
        for epoch in range(1, 4):
            tl.set_epoch(epoch)
            assert [y.tolist() for _, y in tl] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
        assert tail.tolist() == [1.0, 2.0]
    assert tail.tolist() == [1.0, 2.0]  # and after close


def test_batches_released_in_another_thread_come_back() -> None:
    checked: list[list[int]] = []
    handed: queue.Queue = queue.Queue(maxsize=3)

    def consumer() -> None:
        while (batch := handed.get(timeout=30)) is not None:
            checked.append(sample_ids(batch))
            del batch  # the last reference dies in this thread

    thread = threading.Thread(target=consumer)
    thread.start()
    with ShmLoader(fx.IndexDataset(120), rank=0, size=1, batch_size=4, num_workers=1, prefetch=2,
                   shuffle=False, timeout=20) as ld:
        for batch in ld:
            handed.put(batch, timeout=30)
            del batch
        handed.put(None, timeout=30)
        thread.join(timeout=30)
        gc.collect()
        assert not ld._rx.lender.held_slots()  # every slot was released in the consumer thread
        copies = ld._rx.lender.copies
        ld.set_epoch(1)
        assert [len(sample_ids(b)) for b in ld] == [4] * 30  # the released slots were given back to the worker:
        assert ld._rx.lender.copies == copies  # a plain loop after them is all zero-copy, no slot missing
    assert checked == [list(range(i, i + 4)) for i in range(0, 120, 4)]
