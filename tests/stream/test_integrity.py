"""Raw shards read in place (a local dataset) are checked against the index's checksums once per node before first
use (NOTE [local shards verified] in hvdtrain/stream/integrity.py): flipped bytes are a StreamError naming the shard,
and exit 2 in the recipe, where they used to be trained on."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.formats import cachedir
from hvdtrain.stream import MDSWriter, StreamError, StreamingDataset, integrity
from tests.support.harness import REPO, run_bounded


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cachedir.ENV_DIR, str(tmp_path / "cache"))


def _write(out: Path, n: int = 60, hashes: tuple[str, ...] = ("sha1",)) -> Path:
    with MDSWriter(out, {"x": "ndarray:uint8:16", "y": "int64"}, size_limit=20 * 40, hashes=hashes,
                   meta={"num_classes": 3}) as w:
        for i in range(n):
            w.write({"x": np.full(16, i, np.uint8), "y": i % 3})
    return out


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    stat = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same size and mtime: only the hash can tell


def test_a_flipped_byte_in_a_local_raw_shard_is_named_before_it_is_read(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds")
    shard = root / "shard.00001.mds"
    _flip(shard, shard.stat().st_size - 5)  # inside a sample's bytes: the offsets still agree
    ds = StreamingDataset(root)
    assert ds.take(np.arange(5))["y"].tolist() == [0, 1, 2, 0, 1]  # shard 0 is intact
    with pytest.raises(StreamError, match=rf"{shard}: sha1 checksum \w+ differs from the index's \w+ \(corrupt"):
        ds.take(np.arange(len(ds)))


def test_each_shard_is_hashed_once_per_node_and_again_when_rewritten(tmp_path: Path, monkeypatch) -> None:
    root = _write(tmp_path / "ds")
    hashed: list[str] = []
    check = integrity._check
    monkeypatch.setattr(integrity, "_check", lambda path, info, where: (hashed.append(Path(path).name),
                                                                   check(path, info, where)))
    first = StreamingDataset(root)
    first.take(np.arange(len(first)))
    shards = sorted({name for name in hashed})
    assert len(shards) == first.num_shards > 2 and len(hashed) == len(shards)
    again = StreamingDataset(root)  # another process of the node: the markers are there
    again.take(np.arange(len(again)))
    assert len(hashed) == len(shards)
    (root / "shard.00000.mds").write_bytes((root / "shard.00000.mds").read_bytes())  # rewritten: a new mtime
    os.utime(root / "shard.00000.mds", ns=(0, 1))
    StreamingDataset(root).take(np.arange(5))
    assert hashed[len(shards):] == ["shard.00000.mds"]


def test_shards_without_checksums_are_read_with_a_warning_saying_so(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds", hashes=())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = StreamingDataset(root)
    assert any("3 of 3 shards cannot be verified before use: the index records no checksums" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert len(ds.take(np.arange(len(ds)))["y"]) == 60


@pytest.mark.slow
def test_the_recipe_stops_with_exit_2_naming_a_corrupt_local_shard(tmp_path: Path) -> None:
    from hvdtrain.train import recipe_data

    splits = recipe_data.load("digits")
    for name, split in (("train", splits.train), ("val", splits.val)):
        with MDSWriter(tmp_path / "ds" / name, {"x": "ndarray:float32:1,8,8", "y": "int64"}, size_limit=100 * 280,
                       meta={"num_classes": 10}) as w:
            for i in range(len(split)):
                w.write({"x": split.x[i], "y": int(split.y[i])})
    shard = tmp_path / "ds" / "train" / "shard.00003.mds"
    index = json.loads((shard.parent / "index.json").read_text())
    assert index["shards"][3]["raw_data"]["hashes"]
    _flip(shard, shard.stat().st_size - 100)
    result = run_bounded([str(REPO / ".venv" / "bin" / "python"), str(REPO / "recipes" / "pytorch_train.py"),
                          "--dataset", str(tmp_path / "ds"), "--epochs", "1", "--threads", "1",
                          "--run-dir", str(tmp_path / "run"), "--no-tensorboard", "--no-check-finite"],
                         timeout=180, env={cachedir.ENV_DIR: str(tmp_path / "cache")})
    assert result.returncode == 2, result.describe()
    assert f"{shard}: sha1 checksum" in result.output and "(corrupt shard)" in result.output, result.output
