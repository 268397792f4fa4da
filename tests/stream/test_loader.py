"""Sharded datasets through the sampler and real ShmLoader producers: shuffle blocks, exactly once per epoch on
every rank count, mid-epoch resume, elastic resharding, reading only in the producers, bad data named."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import ShardSampler, ShmLoader, WorkerError
from hvdtrain.formats import arrays, cachedir
from hvdtrain.stream import BlockShuffle, MDSWriter, StreamingDataset
from hvdtrain.train import recipe_data
from hvdtrain.train.streamed import load_splits

SHARD_SIZES = [7, 0, 12, 5, 9, 3, 11, 8]  # uneven, one empty


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cachedir.ENV_DIR, str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_dataset(out: Path, n: int, *, per_shard: int = 10, compression: str | None = None,
                  bad_label_at: int | None = None, classes: int = 5) -> Path:
    """Samples whose x encodes their own index (x[0] == i), labels i % classes."""
    sample_bytes = 3 * 4 + 8 + 4
    with MDSWriter(out, {"x": "ndarray:float32:3", "y": "int64"}, compression=compression,
                   size_limit=per_shard * sample_bytes + 200, meta={"num_classes": classes}) as w:
        for i in range(n):
            label = classes + 3 if i == bad_label_at else i % classes
            w.write({"x": np.array([i, i + 0.5, -i], np.float32), "y": label})
    return out


def test_block_shuffle_is_a_permutation_made_of_whole_blocks() -> None:
    order = BlockShuffle.of(SHARD_SIZES, block_shards=3)
    starts = np.concatenate([[0], np.cumsum(SHARD_SIZES)[:-1]])
    for epoch in range(3):
        o = order(7, epoch)
        assert sorted(o.tolist()) == list(range(sum(SHARD_SIZES)))
        shards = order.shard_order(7, epoch)
        pos = 0
        for k in range(0, len(shards), 3):  # each block of the epoch holds exactly its shards' samples
            members = {int(s) for s in shards[k:k + 3]}
            want = {int(starts[s]) + r for s in members for r in range(SHARD_SIZES[s])}
            assert set(o[pos:pos + len(want)].tolist()) == want
            pos += len(want)
    assert not np.array_equal(order(7, 0), order(7, 1)) and np.array_equal(order(7, 1), order(7, 1))


def test_shards_go_serpentine_each_epoch_the_last_one_backwards_within_two_blocks() -> None:
    """NOTE [serpentine epochs]: what a bounded cache holds at an epoch's end is read first in the next."""
    order = BlockShuffle.of([10] * 64, block_shards=4)
    epochs = [order.shard_order(5, e) for e in range(6)]
    for before, after in itertools.pairwise(epochs):
        assert sorted(after.tolist()) == list(range(64))
        where_before = np.argsort(before)
        moved = np.abs(where_before[after] - (63 - np.arange(64)))  # position in `before`, mirrored, vs in `after`
        assert moved.max() < 8 and moved.any()  # backwards, each shard shuffled by less than 2 blocks
        blocks = [{frozenset(o[k:k + 4].tolist()) for k in range(0, 64, 4)} for o in (before, after)]
        assert len(blocks[0] & blocks[1]) < 8  # most blocks change members
    from hvdtrain.stream import order as order_module

    order_module._computed.clear()  # computed afresh, in another order of calls: the same orders
    assert all(np.array_equal(order.shard_order(5, e), epochs[e]) for e in (4, 2, 5, 0, 3))
    assert not np.array_equal(epochs[2], epochs[0])
    with pytest.raises(ValueError, match="epoch must be an integer >= 0, got -1"):
        order.shard_order(5, -1)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_sample_once_per_epoch_across_ranks(size: int) -> None:
    n = sum(SHARD_SIZES)
    order = BlockShuffle.of(SHARD_SIZES, 2)
    for epoch in (0, 5):
        seen = collections.Counter()
        for rank in range(size):
            sampler = ShardSampler(n, rank, size, seed=3, batch_size=4, order=order)
            sampler.set_epoch(epoch)
            seen.update(sampler.indices().tolist())
        assert set(seen) == set(range(n))
        assert sum(seen.values()) - n == (-n) % size  # the padding: at most size - 1 repeats


def test_elastic_resharding_continues_the_same_order() -> None:
    """3 ranks consume 2 batches each; 2 ranks (the job shrank) take the rest of the same epoch's order."""
    n, order = sum(SHARD_SIZES), BlockShuffle.of(SHARD_SIZES, 2)
    consumed = []
    state = None
    for rank in range(3):
        s = ShardSampler(n, rank, 3, seed=1, batch_size=4, order=order, drop_last=False)
        s.set_epoch(2)
        consumed += s.indices()[:8].tolist()
        s.advance(2)
        state = s.state_dict()
    rest = collections.Counter()
    for rank in range(2):
        s = ShardSampler(n, rank, 2, seed=1, batch_size=4, order=order)
        s.load_state_dict(state)
        rest.update(s.indices().tolist())
    assert sorted(consumed) == sorted(order(1, 2)[:24].tolist())  # the first 24 of the global order
    assert set(rest) | set(consumed) == set(range(n)) and not set(rest) & set(consumed)


def test_two_ranks_of_producers_read_every_sample_once_from_compressed_shards(tmp_path: Path,
                                                                             _cache_dir: Path) -> None:
    ds = StreamingDataset(write_dataset(tmp_path / "d", 97, compression="zstd"), fields=("x", "y"))
    assert ds.num_shards >= 9
    got = collections.Counter()
    loaders = [ShmLoader(ds, rank=r, size=2, batch_size=8, num_workers=2, seed=4, fetch=arrays.take,
                         order=ds.order, timeout=60) for r in range(2)]
    try:
        for loader in loaders:
            loader.set_epoch(1)
            for batch in loader:
                x = batch["x"]
                assert np.array_equal(x[:, 1], x[:, 0] + 0.5) and np.array_equal(batch["y"], x[:, 0] % 5)
                got.update(x[:, 0].astype(int).tolist())
    finally:
        for loader in loaders:
            loader.close()
    assert set(got) == set(range(97)) and sum(got.values()) == 98  # one padding repeat
    assert ds._readers == {}  # the trainer process opened no shard: the producers did
    cached = [p.name.rsplit(".", 1)[0] for p in _cache_dir.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert sorted(cached) == sorted(s.raw.basename for s in ds.index.shards)  # decompressed once per node
    assert not list(_cache_dir.rglob(".*.part.*"))


def test_mid_epoch_resume_yields_exactly_the_rest(tmp_path: Path) -> None:
    ds = StreamingDataset(write_dataset(tmp_path / "d", 64), fields=("x",))
    with ShmLoader(ds, rank=1, size=2, batch_size=4, num_workers=2, seed=9, fetch=arrays.take,
                   order=ds.order, timeout=60) as full:
        full.set_epoch(3)
        everything = [b["x"][:, 0].copy() for b in full]
    with ShmLoader(ds, rank=1, size=2, batch_size=4, num_workers=2, seed=9, fetch=arrays.take,
                   order=ds.order, timeout=60) as first:
        first.set_epoch(3)
        it = iter(first)
        head = [next(it)["x"][:, 0].copy() for _ in range(3)]
        state = first.state_dict()
    with ShmLoader(ds, rank=1, size=2, batch_size=4, num_workers=1, seed=9, fetch=arrays.take,
                   order=ds.order, timeout=60) as second:
        second.load_state_dict(state)
        tail = [b["x"][:, 0].copy() for b in second]
    assert [a.tolist() for a in head + tail] == [a.tolist() for a in everything]


def test_bad_label_in_a_shard_is_named_by_the_producer(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_dataset(root / "train", 40, bad_label_at=23)
    write_dataset(root / "val", 10)
    splits = load_splits(root, num_classes=None)
    assert splits.num_classes == 5 and len(splits.train) == 40 and splits.sample_shape == (3,)
    assert splits.train.data._readers == {}  # the shape came from the index: the trainer read no shard
    with ShmLoader(splits.train, rank=0, size=1, batch_size=8, num_workers=2, fetch=arrays.take,
                   order=splits.train.order, timeout=60) as loader, pytest.raises(WorkerError) as err:
        for _ in loader:
            pass
    assert err.value.bad_data
    shard, row = splits.train.data.locate(np.array([23]))
    assert err.value.message == (f"{root / 'train'}/shard.{int(shard[0]):05}.mds sample {int(row[0])} (index 23) "
                                 "field 'y': label 8 is out of range for --num-classes 5 (labels must be 0..4)")


def test_a_root_without_splits_or_classes_says_what_to_do(tmp_path: Path) -> None:
    write_dataset(tmp_path / "one", 10)
    with pytest.raises(arrays.DatasetError, match="one MDS split; a dataset root holds train/ and val/"):
        recipe_data.load(str(tmp_path / "one"))
    write_dataset(tmp_path / "r" / "train", 10)
    with pytest.raises(arrays.DatasetError, match="has no val/ split"):
        recipe_data.load(str(tmp_path / "r"))
    with MDSWriter(tmp_path / "nc" / "train", {"x": "ndarray:float32:3", "y": "int64"}) as w:
        w.write({"x": np.zeros(3, np.float32), "y": 0})
    write_dataset(tmp_path / "nc" / "val", 4)
    with pytest.raises(arrays.DatasetError, match="pass --num-classes N"):
        recipe_data.load(str(tmp_path / "nc"))
    assert recipe_data.load(str(tmp_path / "nc"), num_classes=3).num_classes == 3


def test_an_index_with_one_class_is_named(tmp_path: Path) -> None:
    write_dataset(tmp_path / "r" / "train", 4, classes=1)
    write_dataset(tmp_path / "r" / "val", 4, classes=1)
    with pytest.raises(arrays.DatasetError, match="its index says num_classes=1; training needs 2 or more"):
        recipe_data.load(str(tmp_path / "r"))


def test_resuming_under_another_order_is_refused() -> None:
    n = sum(SHARD_SIZES)
    saved = ShardSampler(n, 0, 2, seed=1, batch_size=4, order=BlockShuffle.of(SHARD_SIZES, 4))
    saved.advance(2)
    for order in (BlockShuffle.of(SHARD_SIZES, 2), None, BlockShuffle.of([*SHARD_SIZES[:-2], 10, 9], 4)):
        with pytest.raises(ValueError, match=r"sampler state has order=.* another data set or order"):
            ShardSampler(n, 0, 2, seed=1, batch_size=4, order=order).load_state_dict(saved.state_dict())
    same = ShardSampler(n, 1, 3, seed=1, batch_size=4, order=BlockShuffle.of(SHARD_SIZES, 4))
    same.load_state_dict(saved.state_dict())  # another world size, the same order: re-sharded
    assert same.offset == 16
