"""ShardSampler: every rank's shard checked together in one process (and ShmLoaders re-sharded, the same way)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import ShardSampler, ShmLoader, expected_batches
from tests.support import loaders as fx


def shards(n: int, size: int, **kw) -> list[ShardSampler]:
    return [ShardSampler(n, r, size, **kw) for r in range(size)]


@pytest.mark.parametrize("n", [0, 1, 5, 10, 103])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_padded_shards_are_even_and_cover_every_sample(n: int, size: int) -> None:
    samplers = shards(n, size, seed=3)
    per_rank = [list(s) for s in samplers]
    assert {len(p) for p in per_rank} == {-(-n // size)}  # same length on every rank: ceil(n / size)
    counts = Counter(i for p in per_rank for i in p)
    assert set(counts) == set(range(n))  # every sample at least once
    padding = sum(counts.values()) - n
    assert padding == (-n) % size
    # the repeats are the last samples of the epoch's order (still local for a streamed dataset), nothing else
    order = samplers[0].global_order().tolist()
    repeated = Counter({i: c - 1 for i, c in counts.items() if c > 1})
    assert sum(repeated.values()) == padding
    if n > 0 and padding < n:
        assert set(repeated) == set(order[n - padding:])


@pytest.mark.parametrize("n,size", [(10, 3), (103, 4), (2, 3), (8, 4)])
def test_drop_last_drops_the_tail_and_repeats_nothing(n: int, size: int) -> None:
    samplers = shards(n, size, seed=1, drop_last=True)
    per_rank = [list(s) for s in samplers]
    assert {len(p) for p in per_rank} == {n // size}
    seen = [i for p in per_rank for i in p]
    assert len(seen) == len(set(seen))
    order = samplers[0].global_order().tolist()
    assert set(seen) == set(order[: n // size * size])


def test_shards_are_disjoint_strided_slices_of_one_order() -> None:
    samplers = shards(12, 3, seed=5)
    order = samplers[0].global_order()
    for r, s in enumerate(samplers):
        assert np.array_equal(s.indices(), order[r::3])
        assert np.array_equal(s.global_order(), order)  # every rank computes the same order


def test_order_is_deterministic_per_seed_and_epoch() -> None:
    a, b = ShardSampler(50, 1, 2, seed=7), ShardSampler(50, 1, 2, seed=7)
    assert list(a) == list(b)
    epoch0 = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != epoch0
    assert list(ShardSampler(50, 1, 2, seed=8)) != epoch0
    a.set_epoch(0)
    assert list(a) == epoch0  # going back to an epoch gives its order again


def test_no_shuffle_is_strided_arange() -> None:
    s = ShardSampler(10, 1, 3, shuffle=False)
    assert list(s) == [1, 4, 7, 8]  # padded with the order's last 2 samples (8, 9): position 10 is 8
    s.set_epoch(4)
    assert list(s) == [1, 4, 7, 8]


def test_batches_and_lengths() -> None:
    s = ShardSampler(103, 0, 4, batch_size=5)
    assert len(s) == 26 and s.num_batches == 6 == expected_batches(103, 4, 5)
    batches = s.batches()
    assert [len(b) for b in batches] == [5, 5, 5, 5, 5, 1]
    assert np.array_equal(np.concatenate(batches), s.indices())
    assert expected_batches(103, 4, 5, drop_last=True) == 5 and expected_batches(100, 4, 5, drop_last=True) == 5


def test_resume_mid_epoch_with_the_same_world() -> None:
    s = ShardSampler(103, 2, 4, seed=9, batch_size=4)
    s.set_epoch(3)
    full = s.indices()
    s.advance(2)
    state = s.state_dict()
    assert state["epoch"] == 3 and state["batches_consumed"] == 2 and state["samples_consumed"] == 2 * 4 * 4
    resumed = ShardSampler(103, 2, 4, seed=9, batch_size=4)
    resumed.load_state_dict(state)
    assert resumed.epoch == 3
    assert np.array_equal(resumed.indices(), full[8:])
    assert len(resumed) == len(full) - 8 and resumed.num_batches == s.num_batches
    resumed.set_epoch(3)  # the same epoch again keeps the position (recipes call set_epoch after loading)
    assert np.array_equal(resumed.indices(), full[8:])
    resumed.set_epoch(4)  # a new epoch starts at its beginning
    assert resumed.batches_consumed == 0 and len(resumed) == len(full)


def test_resume_state_is_exact_at_the_end_and_capped() -> None:
    s = ShardSampler(10, 0, 2, batch_size=2)
    s.advance(100)
    assert s.batches_consumed == 3 and len(s) == 0 and list(s) == [] and s.samples_consumed == 10


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("n,size,bs", [(10, 1, 4), (10, 4, 1), (103, 3, 5), (12, 2, 3)])
def test_state_with_unconsumed_batches_is_the_state_they_were_taken_at(n: int, size: int, bs: int,
                                                                       even: bool) -> None:
    """state_dict(unconsumed=k) (a prefetcher's look-ahead) equals the state saved k batches earlier, the
    capped last batch of a padded epoch included."""
    s = ShardSampler(n, size - 1, size, seed=4, batch_size=bs, even=even)
    s.set_epoch(1)
    states = [s.state_dict()]
    for _ in range(s.shard_batches):
        s.advance(1)
        states.append(s.state_dict())
    for k in range(len(states)):
        assert s.state_dict(unconsumed=k) == states[-1 - k]
    for bad in (-1, len(states), 1.0, True):
        with pytest.raises(ValueError, match="unconsumed"):
            s.state_dict(unconsumed=bad)


@pytest.mark.parametrize("old,new", [(4, 3), (2, 5), (3, 1), (1, 4)])
def test_elastic_reshard_sees_every_sample_once(old: int, new: int) -> None:
    n, bs, consumed_batches = 120, 5, 2
    before = shards(n, old, seed=11, batch_size=bs)
    consumed = []
    for s in before:
        s.set_epoch(2)
        consumed += s.indices()[: consumed_batches * bs].tolist()
        s.advance(consumed_batches)
    state = before[0].state_dict()
    after = shards(n, new, seed=11, batch_size=bs)
    rest = []
    for s in after:
        s.load_state_dict(state)
        assert s.epoch == 2 and s.offset == consumed_batches * bs * old
        rest += s.indices().tolist()
    assert {len(s) for s in after} == {-(-(n - len(consumed)) // new)}
    counts = Counter(consumed + rest)
    assert set(counts) == set(range(n))
    assert sum(counts.values()) - n == (-(n - len(consumed))) % new  # only the new world's padding repeats
    # and a state saved after re-sharding resumes in that world
    after[-1].advance(1)
    again = ShardSampler(n, new - 1, new, seed=11, batch_size=bs)
    again.load_state_dict(after[-1].state_dict())
    assert np.array_equal(again.indices(), after[-1].indices())


@pytest.mark.parametrize("args,kwargs,words", [
    ((10, 2, 2), {}, ["rank", "2"]),
    ((10, -1, 2), {}, ["rank", "-1"]),
    ((10, 0, 0), {}, ["size", "0"]),
    ((-1, 0, 1), {}, ["num_samples", "-1"]),
    ((10, 0, 1), {"batch_size": 0}, ["batch_size", "0"]),
    ((10, 0, 1), {"seed": -3}, ["seed", "-3"]),
])
def test_bad_arguments_are_named(args: tuple, kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        ShardSampler(*args, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_foreign_state_is_refused() -> None:
    s = ShardSampler(10, 0, 2)
    with pytest.raises(ValueError, match="num_samples"):
        s.load_state_dict({**ShardSampler(11, 0, 2).state_dict()})
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-1)


@pytest.mark.parametrize("n,size", [(10, 3), (2, 3), (9, 3), (0, 2)])
def test_uneven_shards_for_evaluation_are_exact(n: int, size: int) -> None:
    samplers = shards(n, size, shuffle=False, even=False, batch_size=2)
    per_rank = [list(s) for s in samplers]
    assert per_rank == [list(range(r, n, size)) for r in range(size)]  # every sample exactly once, no padding
    assert sorted(i for p in per_rank for i in p) == list(range(n))
    s = samplers[0]
    s.advance(100)
    assert s.samples_consumed <= n and len(s) == 0


def consume(samplers: list[ShardSampler], batches: int) -> list[int]:
    """Every rank trains on its next `batches` batches (as a step of the job: all ranks together)."""
    seen = []
    for s in samplers:
        seen += s.indices()[: batches * s.batch_size].tolist()
        s.advance(batches)
    return seen


@pytest.mark.parametrize("sizes", [(3, 2, 3), (4, 1, 2), (2, 3, 5, 1)])
def test_elastic_chain_of_world_changes_within_an_epoch(sizes: tuple[int, ...]) -> None:
    """The elastic recipe's path: each world commits rank 0's state; the next world (any rank) loads it."""
    n, bs, seed = 203, 4, 13
    state, seen = None, []
    for k, size in enumerate(sizes):
        world = shards(n, size, seed=seed, batch_size=bs)
        for s in world:
            s.set_epoch(6)
            if state is not None:
                s.load_state_dict(state)
        assert {s.samples_consumed for s in world} == {len(seen)}  # every rank agrees how far the epoch is
        last = k == len(sizes) - 1
        seen += consume(world, world[0].num_batches if last else 3)
        state = world[0].state_dict()
    counts = Counter(seen)
    assert set(counts) == set(range(n))  # nothing skipped...
    repeats = sum(counts.values()) - n
    assert repeats == (-(n - 3 * bs * sum(sizes[:-1]))) % sizes[-1]  # ...and only the last world's padding repeats
    assert state["samples_consumed"] == n


def test_a_restored_commit_resumes_under_another_world_exactly_where_it_was_taken() -> None:
    """A failure after a commit: the state saved at the commit, not the one reached since, is what a new world
    loads; the samples trained after the commit are trained again (by the new world), none is lost."""
    n, bs = 120, 5
    old = shards(n, 3, seed=2, batch_size=bs)
    committed_seen = consume(old, 2)
    committed = old[0].state_dict()
    consume(old, 1)  # trained, then lost with the failure (not committed)
    new = shards(n, 2, seed=2, batch_size=bs)
    for s in new:
        s.load_state_dict(committed)
    rest = consume(new, new[0].num_batches)
    assert sorted(committed_seen + rest) == sorted(set(committed_seen + rest)) == list(range(n))


def loaders_for(n: int, size: int, state: dict | None) -> list[ShmLoader]:
    world = [ShmLoader(fx.IndexDataset(n), rank=r, size=size, batch_size=4, num_workers=1, seed=3)
             for r in range(size)]
    for ld in world:
        ld.set_epoch(1)
        if state is not None:
            ld.load_state_dict(state)
    return world


@pytest.mark.timeout(120)
def test_shm_loaders_closed_and_rebuilt_for_a_new_world_resume_from_the_committed_state() -> None:
    """What pytorch_elastic.py does on a world change: close every loader (producers stopped, shared memory
    freed), build loaders for the new (rank, size) and load the state rank 0 committed in the old world."""
    n, seen = 50, []
    old = loaders_for(n, 3, None)
    try:
        iterators = [iter(ld) for ld in old]
        for _ in range(2):
            seen += [i for it in iterators for i in next(it)[1].tolist()]
        state = old[0].state_dict()
    finally:
        for ld in old:
            ld.close()
    assert state["samples_consumed"] == 2 * 4 * 3 == len(seen)
    assert not any(p.is_alive() for ld in old for p in ld._res.procs)
    assert list(Path("/dev/shm").glob(f"hvdtrain_{os.getpid()}_*")) == []
    new = loaders_for(n, 2, state)
    try:
        assert [len(ld) for ld in new] == [4, 4]  # the 26 samples left, 13 per rank, in batches of 4
        rest = [[i for _, y in ld for i in y.tolist()] for ld in new]
    finally:
        for ld in new:
            ld.close()
    assert sorted(seen + rest[0] + rest[1]) == list(range(n))  # every sample of the epoch exactly once
    order = ShardSampler(n, 0, 1, seed=3)
    order.set_epoch(1)
    assert rest[0] + rest[1] != [] and set(rest[0] + rest[1]) == set(order.global_order()[24:].tolist())


def test_set_epoch_to_a_new_epoch_starts_it_at_zero_consumed_in_generator_mode() -> None:
    """As in dataset mode (ShardSampler.set_epoch): a state saved right after set_epoch(new) must not skip the new
    epoch's first batches; setting the same epoch again keeps the position (recipes call it after loading)."""
    with ShmLoader.from_generator(fx.endless, rank=0, size=1, num_workers=2, batches_per_epoch=5) as ld:
        assert len(list(ld)) == 5 and ld.state_dict() == {"epoch": 0, "batches_consumed": 5}
        ld.set_epoch(0)
        assert ld.state_dict() == {"epoch": 0, "batches_consumed": 5}
        ld.set_epoch(1)
        state = ld.state_dict()  # a checkpoint taken at the start of epoch 1
        assert state == {"epoch": 1, "batches_consumed": 0}
        ld.load_state_dict(state)  # resuming from it yields the whole epoch
        assert len(ld) == 5
        assert [(int(x[0, 0]), *y.tolist()) for x, y in ld] == [(0, 1, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1), (0, 1, 2)]
        ld.load_state_dict({"epoch": 1, "batches_consumed": 2})
        ld.set_epoch(1)  # the same epoch: the loaded position stands
        assert ld.state_dict() == {"epoch": 1, "batches_consumed": 2} and len(ld) == 3
        ld.set_epoch(2)  # a new epoch: the loaded position is dropped
        assert ld.state_dict() == {"epoch": 2, "batches_consumed": 0} and len(ld) == 5
    with ShmLoader(fx.IndexDataset(10), rank=0, size=1, batch_size=2, num_workers=1) as ld:  # dataset mode: same
        list(ld)
        ld.set_epoch(0)
        assert ld.state_dict()["batches_consumed"] == 5
        ld.set_epoch(1)
        assert ld.state_dict()["batches_consumed"] == 0
