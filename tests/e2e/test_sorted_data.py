"""Class-sorted data trains as well as shuffled data (issue 37): the recipe on the digits sorted by class, written by
MDSWriter in that order (as Mosaic's writer keeps the order it is given) and read with the automatic shuffle block,
reaches the accuracy of a shuffled copy; a class-sorted source converted by `hvdtrain data convert` trains even with
small shuffle blocks; and blocks of a few shards over sorted data (the old default) stay at chance."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.formats import cachedir
from hvdtrain.stream import MDSWriter
from hvdtrain.stream.order import AUTO_BLOCK_SAMPLES, auto_block_shards
from hvdtrain.train import recipe_data
from tests.support.harness import REPO, expect_ok, run_bounded

COLUMNS = {"x": "ndarray:float32:1,8,8", "y": "int64"}
SHARD_BYTES = 100 * 280  # ~100 samples per shard: 15 train shards


def test_auto_block_spans_the_default_samples_and_fits_half_the_cache_limit() -> None:
    assert auto_block_shards([100] * 15, [28_000] * 15) == 15  # a small dataset: one uniform shuffle
    assert auto_block_shards([1000] * 1000, [10**6] * 1000) == -(-AUTO_BLOCK_SAMPLES // 1000)  # 263 shards
    # under a limit: 4 blocks (previous, current, next, ahead) within half of it; never below one shard
    assert auto_block_shards([1000] * 1000, [10**6] * 1000, limit=40 * 10**6) == 5
    assert auto_block_shards([1000] * 1000, [10**6] * 1000, limit=10**6) == 1
    assert auto_block_shards([], []) == 1


def _write(root: Path, order: str) -> Path:
    splits = recipe_data.load("digits")
    for name, split in (("train", splits.train), ("val", splits.val)):
        rows = (np.argsort(split.y, kind="stable") if order == "sorted"
                else np.random.default_rng(0).permutation(len(split)))
        with MDSWriter(root / name, COLUMNS, size_limit=SHARD_BYTES, meta={"num_classes": 10}) as w:
            for i in rows:
                w.write({"x": split.x[i], "y": int(split.y[i])})
    return root


def _converted_from_sorted(base: Path) -> Path:
    splits = recipe_data.load("digits")
    for name, split in (("train", splits.train), ("val", splits.val)):
        for label in range(10):  # one file per class, as per-class archives arrive
            keep = split.y == label
            (base / "npz" / name).mkdir(parents=True, exist_ok=True)
            np.savez(base / "npz" / name / f"class{label}.npz", x=split.x[keep], y=split.y[keep])
    expect_ok(run_bounded([str(REPO / ".venv" / "bin" / "hvdtrain"), "data", "convert", str(base / "npz"),
                           str(base / "mds"), "--shard-size", str(SHARD_BYTES), "--no-progress"], timeout=120))
    return base / "mds"


def _val_accuracy(dataset: Path, run_dir: Path, *args: str) -> float:
    """One rank of the PyTorch recipe (hvd.init() without horovodrun: a job of size 1), 4 epochs."""
    expect_ok(run_bounded([str(REPO / ".venv" / "bin" / "python"), str(REPO / "recipes" / "pytorch_train.py"),
                           "--dataset", str(dataset), "--epochs", "4", "--warmup-epochs", "1", "--threads", "1",
                           "--run-dir", str(run_dir), "--no-tensorboard", *args],
                          timeout=180, env={cachedir.ENV_DIR: str(run_dir.parent / "node-cache")}))
    return float(json.loads((run_dir / "summary.json").read_text())["val_accuracy"])


@pytest.mark.slow
def test_class_sorted_data_trains_like_shuffled_data(tmp_path: Path) -> None:
    shuffled = _val_accuracy(_write(tmp_path / "shuffled", "shuffled"), tmp_path / "r1")
    sorted_auto = _val_accuracy(_write(tmp_path / "sorted", "sorted"), tmp_path / "r2")
    converted = _val_accuracy(_converted_from_sorted(tmp_path / "conv"), tmp_path / "r3", "--shuffle-block", "2")
    small_blocks = _val_accuracy(tmp_path / "sorted", tmp_path / "r4", "--shuffle-block", "2")
    assert shuffled > 0.9, shuffled
    assert abs(sorted_auto - shuffled) < 0.04 and abs(converted - shuffled) < 0.04, (shuffled, sorted_auto, converted)
    assert small_blocks < 0.5, small_blocks  # what blocks of a few shards did to sorted data: at chance
