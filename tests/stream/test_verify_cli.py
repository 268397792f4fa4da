"""`hvdtrain data verify` (issue 37): every shard against the index's checksum, every sample decoded, labels checked,
locally and from an HTTP store; exit 2 naming the split, the shard, the sample and the fix. `hvdtrain data inspect`
and verify report how labels spread over shards and warn on a class-sorted split (NOTE [label spread] in
hvdtrain/stream/labels.py). `hvdtrain --help` is written for users."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.formats import cachedir
from hvdtrain.stream import MDSWriter, labels
from hvdtrain.stream.convert import convert
from hvdtrain.stream.inspect import describe
from tests.support.harness import BIN, REPO, run_bounded
from tests.support.stores import HttpStore

HVDTRAIN = str(BIN / "hvdtrain")
COLUMNS = {"x": "ndarray:float32:4", "y": "int64"}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cachedir.ENV_DIR, str(tmp_path / "cache"))  # verify must write nothing, here included
    return tmp_path / "cache"


def _cli(*args: str):
    return run_bounded([HVDTRAIN, *map(str, args)], timeout=60)


def _converted(tmp_path: Path, compression: str | None = None) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    np.savez(src / "a.npz", x=rng.standard_normal((300, 4)).astype(np.float32), y=np.repeat(np.arange(6), 50))
    convert(src, tmp_path / "mds", shard_bytes=1500, compression=compression, val_fraction=0.2, progress=False)
    return tmp_path / "mds"


def _write(out: Path, ys: list, columns: dict[str, str] = COLUMNS, **options) -> Path:
    with MDSWriter(out, columns, size_limit=options.pop("size_limit", 30 * 36), **options) as w:
        for y in ys:
            w.write({"x": np.zeros(4, np.float32), "y": y})
    return out


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_fresh_converted_dataset_verifies_and_nothing_is_written(tmp_path: Path, compression, _cache_dir) -> None:
    root = _converted(tmp_path, compression)
    before = _files(tmp_path)
    res = _cli("data", "verify", root)
    assert res.returncode == 0, res.describe()
    lines = res.output.splitlines()
    assert any(line.startswith("train: ") and ", 240 samples, 6 classes (labels 0..5), " in line and "verified (sha1)"
               in line and line.endswith(": OK") for line in lines), res.describe()
    assert any(line.startswith("val: ") and ", 60 samples, 6 classes" in line for line in lines), res.describe()
    assert lines[-1] == f"OK: {root}: 2 split(s), {len(list(root.rglob('shard.*')))} shards, 300 samples"
    assert "warning" not in res.output  # convert writes a shuffled dataset
    assert _files(tmp_path) == before and not _cache_dir.exists()
    one = _cli("data", "verify", root, "--split", "val")
    assert one.returncode == 0 and "train:" not in one.output and "val: " in one.output, one.describe()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_flipped_bytes_are_exit_2_naming_the_split_the_shard_and_the_fix(tmp_path: Path, compression) -> None:
    root = _converted(tmp_path, compression)
    shard = sorted((root / "train").glob("shard.00001.*"))[0]
    _flip(shard, shard.stat().st_size - 7)
    res = _cli("data", "verify", root)
    assert res.returncode == 2, res.describe()
    assert f"hvdtrain data verify: error: train: {shard}: sha1 checksum" in res.output, res.describe()
    assert "(corrupt shard); fix: copy or upload it again" in res.output and "hvdtrain data convert" in res.output
    assert "FAILED (1 problem(s))" in res.output and f"FAILED: {root}: 1 problem(s), in 1 of" in res.output
    assert "val: " in res.output and "Traceback" not in res.output  # the other split was still checked


@pytest.mark.parametrize(("bad", "column", "words"), [
    (-1, "int64", "label -1 is negative (1 such sample(s) in this shard"),
    (2.5, "float32", "label 2.5 is not an integer (1 such sample(s) in this shard"),
    (7, "int64", "label 7 is out of range for the index's num_classes 3 (labels must be 0..2"),
])
def test_a_bad_label_is_exit_2_naming_the_sample(tmp_path: Path, bad, column, words) -> None:
    ys = [0, 1, 2] * 20
    ys[45] = bad  # in the second shard
    root = _write(tmp_path / "ds", ys, {"x": "ndarray:float32:4", "y": column}, meta={"num_classes": 3})
    first = json.loads((root / "index.json").read_text())["shards"][0]["samples"]
    res = _cli("data", "verify", root)
    assert res.returncode == 2, res.describe()
    assert f"error: ds: {root / 'shard.00001.mds'} sample {45 - first}: {words}" in res.output, res.describe()
    assert ("index.json: column 'y' is 'float32': labels must be an integer column" in res.output) == (column
                                                                                                    == "float32")
    assert "fix: fix the labels at the source and re-convert it" in res.output


def test_a_column_that_changes_shape_is_named(tmp_path: Path) -> None:
    with MDSWriter(tmp_path / "ds", {"x": "ndarray:uint8", "y": "int64"}) as w:
        for i in range(6):
            w.write({"x": np.zeros((2, 2) if i != 4 else (3, 2), np.uint8), "y": i % 2})
    res = _cli("data", "verify", tmp_path / "ds")
    assert res.returncode == 2, res.describe()
    assert "shard.00000.mds sample 4: column 'x' is uint8 of shape (3, 2), but uint8 of shape (2, 2) in" in res.output


def test_an_index_without_checksums_is_said_and_still_decoded(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds", [0, 1, 2] * 20, hashes=[])
    res = _cli("data", "verify", root)
    assert res.returncode == 0, res.describe()
    assert "the index records no checksums for them" in res.output and "not verified (no checksums): OK" in res.output
    bad = _write(tmp_path / "bad", [0, 1, 2] * 20 + [-4], hashes=[])
    assert "label -4 is negative" in _cli("data", "verify", bad).output


def test_from_an_http_store_ok_and_corrupt(tmp_path: Path) -> None:
    root = _converted(tmp_path, "zstd")
    server = HttpStore(tmp_path / "mds", tmp_path / "http.log")
    server.start()
    try:
        url = f"{server.url}/train"
        res = _cli("data", "verify", url)
        assert res.returncode == 0 and f"OK: {url}: 1 split(s)" in res.output, res.describe()
        _flip(root / "train" / "shard.00000.mds.zstd", 40)
        res = _cli("data", "verify", url)
        assert res.returncode == 2, res.describe()
        assert f"error: train: {url}/shard.00000.mds.zstd: sha1 checksum" in res.output, res.describe()
    finally:
        server.stop()
    assert not (tmp_path / "cache").exists()


def test_an_unknown_split_and_a_closed_pipe(tmp_path: Path) -> None:
    root = _converted(tmp_path)
    res = _cli("data", "verify", root, "--split", "test")
    assert res.returncode == 2 and f"{root}: no split 'test'; its splits are train, val" in res.output, res.describe()
    proc = subprocess.Popen([HVDTRAIN, "data", "verify", str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head` gone before the first line
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()


# ---- label spread ---------------------------------------------------------------------------------------------

def _sorted_and_shuffled(tmp_path: Path) -> tuple[Path, Path]:
    ys = np.repeat(np.arange(5), 60)
    sorted_root = _write(tmp_path / "sorted" / "train", [int(v) for v in ys], meta={"num_classes": 5})
    shuffled = np.random.default_rng(1).permutation(ys)
    shuffled_root = _write(tmp_path / "shuffled" / "train", [int(v) for v in shuffled], meta={"num_classes": 5})
    return sorted_root.parent, shuffled_root.parent


def test_inspect_and_verify_warn_on_a_class_sorted_split_only(tmp_path: Path) -> None:
    sorted_root, shuffled_root = _sorted_and_shuffled(tmp_path)
    _write(sorted_root / "val", [int(v) for v in np.repeat(np.arange(5), 60)], meta={"num_classes": 5})
    spread = describe(sorted_root)["splits"]["train"]["labels"]
    assert spread["sorted"] and spread["shards_read"] == 8 and spread["mean_shard_classes"] < 2, spread
    val = describe(sorted_root)["splits"]["val"]["labels"]  # validation reads every sample: its order is no matter
    assert val["sorted"] and not val["warning"], val
    assert not describe(shuffled_root)["splits"]["train"]["labels"]["sorted"]
    for command in ("inspect", "verify"):
        res = _cli("data", command, sorted_root)
        assert res.returncode == 0, res.describe()
        assert f"hvdtrain data {command}: warning: train looks sorted by class: the average shard holds" in res.output
        assert "val looks sorted" not in res.output, res.describe()
        assert "--shuffle-block auto: 262,144 samples' worth of shards, here all 10 shards" in res.output
        assert "Fix: re-convert it (`hvdtrain data convert`" in res.output and "raise --shuffle-block" in res.output
        res = _cli("data", command, shuffled_root)
        assert res.returncode == 0 and "warning" not in res.output, res.describe()
    res = _cli("data", "inspect", sorted_root)
    assert "labels (y, 8 of 10 shards read): the average shard holds" in res.output, res.describe()


def test_inspect_reads_few_shards_and_can_skip_labels(tmp_path: Path, monkeypatch) -> None:
    sorted_root, _ = _sorted_and_shuffled(tmp_path)
    opened = []
    from hvdtrain.stream import verify

    real = verify.open_shard
    monkeypatch.setattr(verify, "open_shard", lambda src, info, check: (opened.append(info), real(src, info, check))[1])
    assert describe(sorted_root, label_shards=3)["splits"]["train"]["labels"]["shards_read"] == 3 and len(opened) == 3
    assert describe(sorted_root, label_shards=0)["splits"]["train"]["labels"]["note"] == "not read (--label-shards 0)"
    assert "no column 'label'" in describe(sorted_root, label_field="label")["splits"]["train"]["labels"]["note"]


def test_the_sorted_criterion_holds_for_few_and_many_classes() -> None:
    rng = np.random.default_rng(0)

    def shards(y: np.ndarray, size: int) -> list[np.ndarray]:
        return [y[i:i + size] for i in range(0, len(y), size)]

    for classes, size in ((2, 100), (10, 50), (1000, 500)):
        y = np.repeat(np.arange(classes), 20_000 // classes)
        assert labels.spread(shards(y, size))["sorted"], (classes, size)
        assert not labels.spread(shards(rng.permutation(y), size))["sorted"], (classes, size)
    assert not labels.spread([np.repeat(np.arange(3), 10)])["sorted"]  # one shard: the block shuffle mixes it
    assert not labels.spread(shards(np.arange(40) % 4, 1))["sorted"]  # shards of one sample cannot tell


def test_help_is_written_for_users() -> None:
    res = _cli("--help")
    assert res.returncode == 0 and "No logic lives here" not in res.output, res.describe()
    first = res.output.split("\n\n")[1]
    assert first.startswith("hvdtrain launches Horovod data-parallel training jobs"), first
    for words in ("run JOB.yaml", "data verify DATASET", "example:", "hvdtrain data convert ./images ./mds"):
        assert words in res.output, words
    named = re.findall(r"\bjobs/[\w.-]+\.yaml", res.output)  # issue 59: it named jobs/digits.yaml, never shipped
    assert named and all((REPO / job).is_file() for job in named), named


def test_the_warning_says_when_a_sorted_split_spans_several_shuffle_blocks(tmp_path: Path) -> None:
    import dataclasses

    from hvdtrain.stream import mds

    root = _write(tmp_path / "ds", [0] * 30)
    one = mds.parse_index((root / "index.json").read_text(), "index.json").shards[0]
    big = mds.Index(tuple(dataclasses.replace(one, samples=1000) for _ in range(300)), {})
    spread = labels.spread([np.full(1000, c // 30) for c in range(300)])
    warning = labels.sorted_warning("train", spread, big)
    assert "here 263 of its 300 shards), so each batch holds few classes and training may stay near chance" in warning
    assert labels.sorted_warning("train", labels.spread([np.arange(1000) % 10] * 300), big) is None


def test_a_failing_store_stops_verify_at_once_and_a_missing_shard_is_one_problem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An outage would otherwise cost every shard the store's retry window and be blamed on each shard."""
    from hvdtrain.stream import mds, store, verify
    from hvdtrain.stream.errors import StreamError

    root = _converted(tmp_path, "zstd")  # compressed shards are read through the store's get()
    index = mds.parse_index((root / "train" / mds.INDEX).read_text(), str(root / "train"))
    asked: list[str] = []

    def down(self: store.LocalStore, name: str) -> bytes:
        asked.append(name)
        raise StreamError(f"{name}: the store did not answer for 1 s of retries (connection refused)")

    monkeypatch.setattr(store.LocalStore, "get", down)
    with pytest.raises(verify.StoreFailed, match="did not answer"):
        verify.verify_split("train", str(root / "train"), index, "y", lambda n: None)
    assert len(asked) == 1, asked
    monkeypatch.undo()
    (root / "train" / "shard.00001.mds.zstd").unlink()
    result = verify.verify_split("train", str(root / "train"), index, "y", lambda n: None)
    assert [p.shard for p in result.problems] == [str(root / "train" / "shard.00001.mds.zstd")], result.problems
    assert result.shards == len(index.shards) > 2
