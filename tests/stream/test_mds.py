"""The MDS format: datasets written by mosaicml-streaming itself read exactly; hvdtrain's writer writes the same
bytes; damaged shards and indexes are named errors; compressed shards are decompressed once per node."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.formats import cachedir
from hvdtrain.stream import MDSWriter, StreamError, StreamingDataset, encodings, mds

# Written by scripts/make_mosaic_fixtures.py (mosaicml-streaming).
MOSAIC = Path(__file__).resolve().parents[1] / "fixtures" / "mosaic"


def mosaic_sample(i: int) -> dict:
    """The sample `i` scripts/make_mosaic_fixtures.py wrote (same seeds), with the image as its array."""
    rng = np.random.default_rng(i)
    img = rng.integers(0, 256, size=(4, 5, 3)).astype(np.uint8)
    return {"x": rng.standard_normal((2, 3)).astype(np.float32), "y": i * 7 - 3,
            "dyn": np.arange(i + 1, dtype=np.int16).reshape(1, i + 1), "name": f"sample-{i}",
            "blob": bytes(range(i % 7)), "meta": {"i": i, "tags": ["a", str(i)]}, "f": float(i) / 4,
            "png": img, "u8": i % 256}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cachedir.ENV_DIR, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("variant", ["raw", "zstd"])
def test_mosaic_written_dataset_reads_exactly(variant: str) -> None:
    ds = StreamingDataset(MOSAIC / variant)
    assert len(ds) == 23 and ds.num_shards > 1
    for i in range(len(ds)):
        got, want = ds[i], mosaic_sample(i)
        assert set(got) == set(want)
        for key, value in want.items():
            if isinstance(value, np.ndarray):
                assert got[key].dtype == value.dtype and np.array_equal(got[key], value), (i, key)
            else:
                assert got[key] == value, (i, key)
    idx = np.array([22, 0, 7, 7, 13, 1])
    batch = StreamingDataset(MOSAIC / variant, fields=("x", "y", "f", "u8", "png")).take(idx)
    assert np.array_equal(batch["x"], np.stack([mosaic_sample(int(i))["x"] for i in idx]))
    assert batch["y"].tolist() == [mosaic_sample(int(i))["y"] for i in idx] and batch["y"].dtype == np.int64
    assert batch["png"].shape == (6, 4, 5, 3) and batch["u8"].dtype == np.uint8


def test_writer_writes_mosaics_bytes(tmp_path: Path) -> None:
    """Same samples, columns, size limit and hashes: every shard file and the index are byte-identical to
    mosaicml-streaming's (the PNG column is copied as the stored bytes: PNG encoders differ by Pillow version)."""
    source = StreamingDataset(MOSAIC / "raw")
    index = json.loads((MOSAIC / "raw" / "index.json").read_text())
    columns = dict(zip(index["shards"][0]["column_names"], index["shards"][0]["column_encodings"], strict=True))
    with MDSWriter(tmp_path / "ours", columns, size_limit=2000, hashes=("sha1", "xxh64")) as writer:
        for i in range(len(source)):
            sample = mosaic_sample(i)
            s, row = source.locate(np.array([i]))
            info = source.index.shards[int(s[0])]
            data = (MOSAIC / "raw" / info.raw.basename).read_bytes()
            offsets = np.frombuffer(data, np.uint32, count=info.samples + 1, offset=4)
            sample["png"] = _column_bytes(info, data[offsets[row[0]]:offsets[row[0] + 1]], "png")
            writer.write(sample)
    for f in sorted((MOSAIC / "raw").iterdir()):
        assert (tmp_path / "ours" / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == sorted(p.name for p in (MOSAIC / "raw").iterdir())


def _column_bytes(info: mds.ShardInfo, raw: bytes, name: str) -> bytes:
    names = [n for n, _ in info.columns]
    encs = [e for _, e in info.columns]
    var = [i for i, e in enumerate(encs) if e.size is None]
    sizes = np.frombuffer(raw, np.uint32, count=len(var))
    pos = 4 * len(var)
    for i, enc in enumerate(encs):
        size = enc.size if enc.size is not None else int(sizes[var.index(i)])
        if names[i] == name:
            return raw[pos:pos + size]
        pos += size
    raise KeyError(name)


def test_zstd_round_trip_and_one_decompression(tmp_path: Path, _cache_dir: Path) -> None:
    x = np.arange(600, dtype=np.float32).reshape(100, 6)
    with MDSWriter(tmp_path / "d", {"x": "ndarray:float32:6", "y": "int64"}, compression="zstd:3",
                   size_limit=1000) as w:
        for i in range(100):
            w.write({"x": x[i], "y": i})
    ds = StreamingDataset(tmp_path / "d")
    assert ds.num_shards > 3 and all(s.zip is not None for s in ds.index.shards)
    batch = ds.take(np.arange(100)[::-1])
    assert np.array_equal(batch["x"], x[::-1]) and batch["y"].tolist() == list(range(99, -1, -1))
    cached = sorted(p.name.rsplit(".", 1)[0] for p in _cache_dir.rglob("shard.*"))  # NAME.<version digest>
    assert cached == sorted(s.raw.basename for s in ds.index.shards)  # raw files in the cache, not in the source
    assert not list((tmp_path / "d").glob("*.mds"))


def _without_hashes(root: Path) -> Path:
    """The index without checksums (as Mosaic's MDSWriter writes by default), so that the structural checks of a
    damaged shard are what meets it, not the checksum verified before first use (tests/stream/test_integrity.py)."""
    index = json.loads((root / "index.json").read_text())
    for shard in index["shards"]:
        shard["raw_data"]["hashes"] = {}
    (root / "index.json").write_text(json.dumps(index))
    return root


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-5]), "truncated or replaced"),
    (lambda p: p.write_bytes(p.read_bytes()[:4] + b"\xff\xff\xff\x7f" + p.read_bytes()[8:]), "offsets"),
])
def test_damaged_raw_shard_is_named(tmp_path: Path, damage, message: str) -> None:
    _without_hashes(shutil.copytree(MOSAIC / "raw", tmp_path / "d"))
    damage(tmp_path / "d" / "shard.00001.mds")
    ds = StreamingDataset(tmp_path / "d", fields=("x", "y"))
    ds.take(np.array([0]))  # shard 0 is fine
    with pytest.raises(StreamError, match=message) as err:
        ds.take(np.arange(len(ds)))
    assert "shard.00001.mds" in str(err.value)


def test_corrupt_compressed_shard_fails_its_checksum(tmp_path: Path, _cache_dir: Path) -> None:
    shutil.copytree(MOSAIC / "zstd", tmp_path / "d")
    shard = tmp_path / "d" / "shard.00002.mds.zstd"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    ds = StreamingDataset(tmp_path / "d", fields=("x",))
    with pytest.raises(StreamError, match=r"shard\.00002\.mds\.zstd: sha1 checksum .* \(corrupt shard\)"):
        ds.take(np.arange(len(ds)))
    left = [p for p in _cache_dir.rglob("*shard.00002.mds*") if not p.name.endswith(".lock")]
    assert not left  # nothing half-made is left to be read later


@pytest.mark.parametrize("edit, message", [
    (lambda t: "{not json", "not JSON"),
    (lambda t: json.dumps({"version": 1, "shards": []}), "index version 1"),
    (lambda t: t.replace('"ndarray:float32:2,3"', '"pkl"'), "'pkl' is not read"),
    (lambda t: t.replace('"ndarray:float32:2,3"', '"ndarray:complex64"'), "dtype 'complex64'"),
    (lambda t: t.replace('"format": "mds"', '"format": "json"', 1), r"shards\[0\]: format 'json' is not read"),
    (lambda t: t.replace('"basename": "shard.00000.mds"', '"basename": "../etc/passwd"', 1), r"no '\.\.'"),
    (lambda t: t.replace('"basename": "shard.00000.mds"', '"basename": "/etc/passwd"', 1), "not absolute"),
])
def test_bad_index_is_named(tmp_path: Path, edit, message: str) -> None:
    shutil.copytree(MOSAIC / "raw", tmp_path / "d")
    index = tmp_path / "d" / "index.json"
    index.write_text(edit(index.read_text()))
    with pytest.raises(StreamError, match=message) as err:
        StreamingDataset(tmp_path / "d")
    assert "index.json" in str(err.value)


def test_missing_index_and_unknown_field_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(StreamError, match="hvdtrain data convert"):
        StreamingDataset(tmp_path)
    with pytest.raises(StreamError, match=r"no column 'image'; columns: \['blob'"):
        StreamingDataset(MOSAIC / "raw", fields=("image",))
    with pytest.raises(StreamError, match="'name' is 'str', which does not decode to an array"):
        StreamingDataset(MOSAIC / "raw", fields=("name",))
    with pytest.raises(IndexError, match="sample 23 is out of range"):
        StreamingDataset(MOSAIC / "raw").take(np.array([3, 23]))


def test_encoding_round_trips() -> None:
    for text, value in [("ndarray", np.arange(300, dtype=np.uint16).reshape(3, 100)),
                        ("ndarray:int8", np.array([[-1, 2]], np.int8)),
                        ("ndarray:float64:2", np.array([0.5, -2.0])), ("int", -5), ("float16", 1.5),
                        ("str", "héllo"), ("json", {"a": [1, 2]}), ("str_int", 12), ("bytes", b"\x00\x01")]:
        enc = encodings.parse(text)
        out = encodings.decode(enc, encodings.encode(enc, value))
        assert np.array_equal(out, value) if isinstance(value, np.ndarray) else out == value, text
    with pytest.raises(StreamError, match="shape"):
        encodings.encode(encodings.parse("ndarray:float64:3"), np.zeros(2))


def test_dataset_pickles_without_open_shards() -> None:
    import pickle

    ds = StreamingDataset(MOSAIC / "raw", fields=("x",))
    ds.take(np.arange(5))
    assert ds._readers
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._readers == {} and np.array_equal(clone.take(np.arange(5))["x"], ds.take(np.arange(5))["x"])


# ---- the node cache: once per node, never half-written, a killed producer blocks nobody ------------------------

def _slow_ensure(path: str, started: mp.synchronize.Event, delay: float, out: mp.Queue, barrier=None) -> None:
    if barrier is not None:
        barrier.wait(60)  # all ask at once: the lock, not luck, must make one of them the producer

    def produce(f) -> None:
        started.set()
        f.write(b"a" * 1000)
        f.flush()
        time.sleep(delay)
        f.write(b"b" * 1000)

    got, produced = cachedir.ensure(Path(path), produce, timeout=30)
    out.put((produced, got.read_bytes() == b"a" * 1000 + b"b" * 1000))


def test_cache_file_is_produced_once_by_racing_processes(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    started, out, barrier = ctx.Event(), ctx.Queue(), ctx.Barrier(4)
    procs = [ctx.Process(target=_slow_ensure, args=(str(tmp_path / "f"), started, 0.5, out, barrier))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sorted(results) == [(False, True)] * 3 + [(True, True)]


def test_killed_producer_leaves_nothing_that_blocks_or_is_read(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    started, out = ctx.Event(), ctx.Queue()
    victim = ctx.Process(target=_slow_ensure, args=(str(tmp_path / "f"), started, 60, out))
    victim.start()
    assert started.wait(30)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=30)
    assert not (tmp_path / "f").exists() and list(tmp_path.glob(".f.part.*"))  # a partial file, never visible as f
    path, produced = cachedir.ensure(tmp_path / "f", lambda f: f.write(b"fresh"), timeout=5)
    assert produced and path.read_bytes() == b"fresh" and not list(tmp_path.glob(".f.part.*"))


def test_full_cache_disk_is_a_clear_error(tmp_path: Path) -> None:
    def produce(f) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(cachedir.CacheFull, match=r"cache directory .* is full .*HVDTRAIN_DATA_CACHE"):
        cachedir.ensure(tmp_path / "f", produce, timeout=5, what="shard 3")
    assert not list(tmp_path.glob(".f.part.*")) and not (tmp_path / "f").exists()


def test_writer_refuses_a_bad_level_and_an_empty_dataset(tmp_path: Path) -> None:
    with pytest.raises(StreamError, match=r"compression 'zstd:abc' is not supported.*level 1\.\.22"):
        MDSWriter(tmp_path / "a", {"y": "int64"}, compression="zstd:abc")
    with pytest.raises(StreamError, match="no samples were written"):
        MDSWriter(tmp_path / "b", {"y": "int64"}).finish()
    assert not (tmp_path / "b" / "index.json").exists()


def test_unusable_cache_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(cachedir.CacheError, match=r"cannot use the cache directory .*file/sub while shard 3"):
        cachedir.ensure(tmp_path / "file" / "sub" / "f", lambda f: f.write(b"x"), timeout=5, what="shard 3")


# ---- damaged samples, stale caches, many shards, merged indexes ---------------------------------------------

def _rewrite_sample(path: Path, edit) -> None:
    data = bytearray(path.read_bytes())
    edit(data, int(np.frombuffer(bytes(data[4:8]), np.uint32)[0]))  # the first sample's offset
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("edit, message", [
    # the 'blob' column's size (first of the size table) made huge, or one byte smaller (shifting later columns)
    (lambda d, at: d.__setitem__(slice(at, at + 4), np.uint32(1 << 30).tobytes()), "do not add up"),
    (lambda d, at: d.__setitem__(slice(at, at + 4), (np.frombuffer(bytes(d[at:at + 4]), np.uint32) + 1).tobytes()),
     "do not add up"),
])
def test_a_damaged_sample_size_table_is_named_not_misread(tmp_path: Path, edit, message: str) -> None:
    _without_hashes(shutil.copytree(MOSAIC / "raw", tmp_path / "d"))
    _rewrite_sample(tmp_path / "d" / "shard.00000.mds", edit)
    ds = StreamingDataset(tmp_path / "d", fields=("x", "y"))
    with pytest.raises(StreamError, match=rf"shard\.00000\.mds: sample 0's column sizes .* {message}"):
        ds.take(np.array([0]))


def test_fixed_size_shard_with_wrong_offsets_is_refused(tmp_path: Path) -> None:
    with MDSWriter(tmp_path / "d", {"x": "ndarray:float32:2", "y": "int64"}, hashes=()) as w:
        for i in range(4):
            w.write({"x": np.full(2, i, np.float32), "y": i})
    shard = tmp_path / "d" / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    off = np.frombuffer(bytes(data[4:24]), np.uint32).copy()
    off[2] += 4  # sample 1 longer, sample 2 shorter: same file size
    data[4:24] = off.tobytes()
    shard.write_bytes(bytes(data))
    with pytest.raises(StreamError, match="samples are not 16 bytes each"):
        StreamingDataset(tmp_path / "d").take(np.array([0]))


def test_a_rewritten_dataset_never_reads_the_old_cached_copy(tmp_path: Path, monkeypatch) -> None:
    """Same path, same sizes, new values (no hashes in the index): the cache must not serve the old shards."""
    def write(value: float) -> None:
        shutil.rmtree(tmp_path / "d", ignore_errors=True)
        with MDSWriter(tmp_path / "d", {"x": "ndarray:float32:2"}, compression="zstd", hashes=()) as w:
            for _ in range(3):
                w.write({"x": np.full(2, value, np.float32)})

    write(1.0)
    assert StreamingDataset(tmp_path / "d").take(np.arange(3))["x"].tolist() == [[1.0, 1.0]] * 3
    time.sleep(0.01)  # a new mtime
    write(2.0)
    assert StreamingDataset(tmp_path / "d").take(np.arange(3))["x"].tolist() == [[2.0, 2.0]] * 3
    monkeypatch.chdir(tmp_path)  # a relative path names the same dataset, and only it
    assert StreamingDataset("d").cache_dir == StreamingDataset(tmp_path / "d").cache_dir


def test_many_shards_keep_few_mapped(tmp_path: Path) -> None:
    with MDSWriter(tmp_path / "d", {"x": "ndarray:int64:1"}, size_limit=200) as w:
        for i in range(300):
            w.write({"x": np.array([i])})
    ds = StreamingDataset(tmp_path / "d", block_shards=2)
    assert ds.num_shards > 40

    def shard_fds() -> int:  # only this dataset's files: other tests' daemon threads may open files meanwhile
        return sum(os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "d"))
                   for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))

    got = ds.take(np.random.default_rng(0).permutation(300))["x"][:, 0]
    assert sorted(got.tolist()) == list(range(300))
    assert len(ds._readers) == ds.max_open == 8 and 0 < shard_fds() <= 8
    ds.close()
    assert len(ds._readers) == 0 and shard_fds() == 0


def test_a_merged_index_with_shards_in_subdirectories_reads(tmp_path: Path) -> None:
    """Mosaic's merge_index names shards SUBDIR/shard.NNNNN.mds (parallel conversion)."""
    index = json.loads((MOSAIC / "zstd" / "index.json").read_text())
    for i, shard in enumerate(index["shards"]):
        sub = tmp_path / "d" / str(i)
        sub.mkdir(parents=True)
        shutil.copy(MOSAIC / "zstd" / shard["zip_data"]["basename"], sub)
        shard["zip_data"]["basename"] = f"{i}/{shard['zip_data']['basename']}"
        shard["raw_data"]["basename"] = f"{i}/{shard['raw_data']['basename']}"
    (tmp_path / "d" / "index.json").write_text(json.dumps(index))
    ds = StreamingDataset(tmp_path / "d")
    assert [ds[i]["name"] for i in range(len(ds))] == [f"sample-{i}" for i in range(23)]
