"""NOTE [epoch ahead] (hvdtrain/data/loader.py): the loader starts the next epoch before `iter()` asks for it, and
an iteration that asks for what was started takes those batches instead of producing them again. Real producer
processes; each batch a worker produces is logged (epoch, first index), so "produced once" is counted, not timed."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from hvdtrain.data import ShardSampler, ShmLoader
from tests.support import loaders as fx

pytestmark = pytest.mark.timeout(120)

N, BS = 40, 4  # 10 batches per epoch with one rank


def produced(log: Path) -> Counter[tuple[int, int]]:
    """(epoch, first index of the batch) -> how many times a worker produced that batch."""
    text = log.read_text() if log.exists() else ""
    return Counter(tuple(int(v) for v in line.split()) for line in text.splitlines())  # type: ignore[misc]


def wait_for(log: Path, epoch: int, count: int) -> None:
    deadline = time.monotonic() + 30
    while sum(n for (e, _), n in produced(log).items() if e == epoch) < count:
        assert time.monotonic() < deadline, f"the workers did not start epoch {epoch} ahead: {produced(log)}"
        time.sleep(0.02)


def expected(epoch: int, *, consumed: int = 0) -> list[list[int]]:
    sampler = ShardSampler(N, 0, 1, seed=3, batch_size=BS)
    sampler.set_epoch(epoch)
    return [b.tolist() for b in sampler.batches()][consumed:]


def loader(log: Path, monkeypatch: pytest.MonkeyPatch, **kwargs) -> ShmLoader:
    monkeypatch.setenv("HVDTRAIN_TEST_LOG", str(log))
    return ShmLoader(fx.IndexDataset(N), rank=0, size=1, batch_size=BS, num_workers=2, seed=3, prefetch=2,
                     fetch=fx.logged_fetch, **kwargs)


def test_the_next_epoch_is_produced_before_iter_and_taken_as_it_is(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "log"
    with loader(log, monkeypatch) as ld:
        assert [y.tolist() for _, y in ld] == expected(0)
        wait_for(log, 1, 6)  # the epoch ended: epoch 1 is under way before anyone asked for it
        ld.set_epoch(1)
        assert [y.tolist() for _, y in ld] == expected(1)
        ld.set_epoch(2)
        assert [y.tolist() for _, y in ld] == expected(2)
        counts = produced(log)
        for epoch in (0, 1, 2):  # every batch of every epoch produced exactly once: the early ones were used
            assert sorted(i for (e, i), n in counts.items() if e == epoch for _ in range(n)) == \
                sorted(b[0] for b in expected(epoch))
        assert ld._rx.lender.copies == 0  # still zero-copy


@pytest.mark.filterwarnings("ignore:ShmLoader. iterating epoch")
def test_a_wrong_guess_is_dropped_and_every_iteration_is_still_exact(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "log"
    with loader(log, monkeypatch) as ld:
        ld.set_epoch(5)
        assert [y.tolist() for _, y in ld] == expected(5)
        wait_for(log, 6, 6)
        it = iter(ld)  # epoch 5 again, not 6: the early epoch 6 is dropped, its slots come back
        assert [next(it)[1].tolist() for _ in range(3)] == expected(5)[:3]
        state = ld.state_dict()
        del it
        assert [y.tolist() for _, y in ld] == expected(5)  # broke off: the epoch starts over
        wait_for(log, 5, 10 + 3 + 10 + 6)  # the user repeats epoch 5: epoch 5 is what is started next
        ld.load_state_dict(state)  # resume mid-epoch: not the start state that was guessed
        assert [y.tolist() for _, y in ld] == expected(5, consumed=3)
        ld.set_epoch(6)
        assert [y.tolist() for _, y in ld] == expected(6)
        assert ld._rx.lender.copies == 0


def test_an_epoch_started_early_by_a_user_who_repeats_epochs_is_the_same_epoch(tmp_path: Path,
                                                                                monkeypatch) -> None:
    log = tmp_path / "log"
    with loader(log, monkeypatch, shuffle=False) as ld:  # evaluation style: iterate, never call set_epoch
        for _ in range(4):
            assert [y.tolist() for _, y in ld] == [list(range(i, i + BS)) for i in range(0, N, BS)]
        time.sleep(0.5)
        epochs = Counter(e for (e, _), n in produced(log).items() for _ in range(n))
        # epoch 1 was guessed once, after the first pass; from the second pass on, epoch 0 is started ahead and
        # taken: 4 passes of 10 batches + what is started ahead after the last one. A worker makes at most 4
        # batches nobody asked for: one in each of its 3 slots and one that waits for a slot.
        assert epochs[1] <= 2 * 4 and 40 <= epochs[0] <= 40 + 2 * 4, epochs


def test_no_epoch_is_started_past_the_last_one_the_job_named(tmp_path: Path, monkeypatch) -> None:
    log = tmp_path / "log"
    with loader(log, monkeypatch, epochs=2) as ld:
        assert [y.tolist() for _, y in ld] == expected(0)
        wait_for(log, 1, 6)  # epoch 1 < epochs: started ahead as before
        ld.set_epoch(1)
        assert [y.tolist() for _, y in ld] == expected(1)
        time.sleep(1.5)  # epoch 1 was under way within wait_for's first polls; epoch 2 would be by now
        assert not [e for e, _ in produced(log) if e >= 2], produced(log)
    with pytest.raises(ValueError, match=r"epochs must be .*>= 1.*got 0"):
        ShmLoader(fx.IndexDataset(N), rank=0, size=1, batch_size=BS, epochs=0)
