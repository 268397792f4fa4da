""".npy/.npz shard directories read through memory maps, never whole (issue 15.1): every sample `take` returns
equals an eager load, for .npy pairs, stored and deflated .npz mixed in one directory, split by a fixed permutation
or by train/ and val/; a deflated member is decompressed once per node (a rewritten archive gets a new copy); NaN/Inf
is named (file, index in it) when its batch is read, in the trainer and in a loader's producer processes; a dataset
larger than this machine's memory loads and serves batches in a process whose peak RSS stays small."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import ShmLoader
from hvdtrain.data.errors import WorkerError
from hvdtrain.formats import arrays, cachedir
from hvdtrain.formats.arrays import DatasetError
from hvdtrain.train.recipe_data import load

RNG = np.random.default_rng(5)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cachedir.ENV_DIR, str(tmp_path / "cache"))  # deflated members are decompressed here
    return tmp_path / "cache"


def mixed_dir(d: Path, *, n: tuple[int, int, int] = (23, 17, 31)) -> tuple[np.ndarray, np.ndarray]:
    """A .npy pair (float64, Fortran order), a stored .npz (int16) and a deflated .npz (float32) of 2×3×4 samples;
    returns what an eager load gives: the shards in file-name order, x as float32, y as int64."""
    d.mkdir(parents=True, exist_ok=True)
    xa = np.asfortranarray(RNG.standard_normal((n[0], 2, 3, 4)))
    xb = RNG.integers(-1000, 1000, (n[1], 2, 3, 4)).astype(np.int16)
    xc = RNG.standard_normal((n[2], 2, 3, 4)).astype(np.float32)
    dtypes = (np.int64, np.uint8, np.int32)
    ya, yb, yc = (RNG.integers(0, 5, k).astype(dtype) for k, dtype in zip(n, dtypes, strict=True))
    np.save(d / "a_x.npy", xa)
    np.save(d / "a_y.npy", ya)
    np.savez(d / "b.npz", x=xb, y=yb)
    np.savez_compressed(d / "c.npz", x=xc, y=yc)
    x = np.concatenate([xa.astype(np.float32), xb.astype(np.float32), xc])
    y = np.concatenate([ya, yb, yc]).astype(np.int64)
    return x, y


def take_all(split, order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    return split.take(np.arange(len(split)) if order is None else order)


def assert_batch(got: tuple[np.ndarray, np.ndarray], x: np.ndarray, y: np.ndarray) -> None:
    assert got[0].dtype == np.float32 and got[0].flags.c_contiguous and got[1].dtype == np.int64
    assert np.array_equal(got[0], x) and np.array_equal(got[1], y)


# ---- every sample as an eager load gives it -------------------------------------------------------------------

def test_a_mixed_directory_without_splits_is_the_fixed_permutation_split_of_all_shards(tmp_path):
    x, y = mixed_dir(tmp_path / "data")
    splits = load(str(tmp_path / "data"), val_fraction=0.25, split_seed=3)
    tr, va = arrays.split_indices(len(y), 0.25, 3)
    assert (len(splits.train), len(splits.val), splits.num_classes) == (len(tr), len(va), int(y.max()) + 1)
    assert splits.sample_shape == (2, 3, 4) and splits.train.order is None
    assert_batch(take_all(splits.train), x[tr], y[tr])
    assert_batch(take_all(splits.val), x[va], y[va])
    order = RNG.integers(0, len(tr), 200)  # any order, repeats, every shard touched
    assert_batch(splits.train.take(order), x[tr][order], y[tr][order])
    xi, yi = splits.val[4]
    assert np.array_equal(xi, x[va][4]) and yi == y[va][4]
    n_val = len(va)
    with pytest.raises(IndexError, match=f"sample {n_val} is out of range for a split of {n_val} samples"):
        splits.val.take(np.array([0, n_val]))


def test_train_and_val_directories_are_the_split(tmp_path):
    xt, yt = mixed_dir(tmp_path / "data" / "train")
    xv, yv = mixed_dir(tmp_path / "data" / "val", n=(3, 5, 4))
    splits = load(str(tmp_path / "data"))
    assert (len(splits.train), len(splits.val)) == (len(yt), len(yv))
    assert_batch(take_all(splits.train), xt, yt)
    order = RNG.permutation(len(yv))
    assert_batch(take_all(splits.val, order), xv[order], yv[order])


@pytest.mark.parametrize("split", [False, True])
def test_an_image_folder_given_as_a_dataset_names_the_convert_command(tmp_path, split):
    """Issue 59 item 9: the recipes read datasets, not image files; the error said only that no shards were found."""
    from PIL import Image

    src = tmp_path / "photos"
    for part in ("train", "val") if split else ("",):
        (src / part / "cat" / "2024").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(src / part / "cat" / "2024" / "a.jpg")
    with pytest.raises(DatasetError) as err:
        load(str(src))
    assert (f"no .npz or NAME_x.npy/NAME_y.npy shards found; it is an image folder (cat/2024/a.jpg): convert it to a "
            f"dataset first, e.g. `hvdtrain data convert {src} {src}-mds{'' if split else ' --val-fraction 0.1'}` "
            in str(err.value)) and str(err.value).endswith(f"then train with --dataset {src}-mds"), str(err.value)


def test_a_split_pickles_without_its_data_and_reads_after_unpickling(tmp_path):
    x, y = mixed_dir(tmp_path / "data", n=(2000, 1000, 1000))
    splits = load(str(tmp_path / "data"))
    take_all(splits.train)  # maps every shard in this process
    blob = pickle.dumps(splits.train)
    assert len(blob) < 8000, len(blob)  # paths, offsets, shapes: no samples, no maps, no index array
    again = pickle.loads(blob)
    tr, _ = arrays.split_indices(len(y), 0.2, 0)
    assert_batch(take_all(again), x[tr], y[tr])


def test_at_most_max_open_arrays_stay_mapped(tmp_path):
    x, y = mixed_dir(tmp_path / "data" / "train")
    mixed_dir(tmp_path / "data" / "val")
    train = load(str(tmp_path / "data")).train
    train.shards.max_open = 2
    for _ in range(3):
        order = RNG.permutation(len(y))
        assert_batch(train.take(order), x[order], y[order])
        assert len(train.shards._maps) <= 2


def test_the_loaders_producers_read_every_sample_once_per_epoch(tmp_path):
    x, y = mixed_dir(tmp_path / "data")
    train = load(str(tmp_path / "data")).train
    tr, _ = arrays.split_indices(len(y), 0.2, 0)
    with ShmLoader(train, rank=0, size=1, batch_size=8, num_workers=2, fetch=arrays.take, drop_last=False,
                   even=False) as loader:
        got = [(bx.copy(), by.copy()) for bx, by in loader]
    gx, gy = np.concatenate([b[0] for b in got]), np.concatenate([b[1] for b in got])
    assert len(gy) == len(tr)  # the same samples, whatever the shuffle
    assert sorted(zip(map(bytes, gx), gy.tolist(), strict=True)) == sorted(zip(map(bytes, x[tr]), y[tr].tolist(),
                                                                              strict=True))


# ---- deflated members: decompressed once per node ---------------------------------------------------------------

def cached(cache_dir: Path, suffix: str) -> list[Path]:
    return sorted(p for p in cache_dir.rglob(f"*{suffix}") if not p.name.startswith("."))


def test_a_deflated_member_is_decompressed_once_and_a_rewritten_archive_again(tmp_path, _cache_dir):
    d = tmp_path / "data"
    d.mkdir()
    x1 = RNG.standard_normal((12, 6)).astype(np.float32)
    np.savez_compressed(d / "a.npz", x=x1, y=np.arange(12) % 3)
    first = load(str(d))
    copies = cached(_cache_dir, ".npy")
    assert [p.name.split(".")[:3] for p in copies] == [["a", "npz", "x"], ["a", "npz", "y"]]
    stamps = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in copies]
    second = load(str(d))
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in cached(_cache_dir, ".npy")] == stamps  # read, not made
    assert second.train.shards.shards[0].x.path == str(copies[0])
    assert np.array_equal(take_all(second.train)[0], take_all(first.train)[0])

    x2 = x1 + 100
    np.savez_compressed(d / "a.npz", x=x2, y=np.arange(12) % 3)
    os.utime(d / "a.npz", ns=(time.time_ns(), time.time_ns() + 10**9))  # a distinct mtime, even on coarse clocks
    third = load(str(d))
    assert len(cached(_cache_dir, ".npy")) == 4  # a new copy of each member; the old ones are never read
    tr, _ = arrays.split_indices(12, 0.2, 0)
    assert np.array_equal(take_all(third.train)[0], x2[tr])


def test_a_stored_archive_is_crc_checked_once_and_mapped_in_place(tmp_path, _cache_dir):
    d = tmp_path / "data"
    d.mkdir()
    x = RNG.standard_normal((12, 6))
    np.savez(d / "a.npz", x=x, y=np.arange(12) % 3)
    splits = load(str(d))
    assert len(cached(_cache_dir, ".crc-ok")) == 2 and not cached(_cache_dir, ".npy")
    ref = splits.train.shards.shards[0].x
    assert ref.path == str(d / "a.npz") and ref.offset is not None
    raw = (d / "a.npz").read_bytes()[ref.offset:ref.offset + x.nbytes]
    assert raw == x.tobytes()  # the offset is where x's data lies in the archive


def test_a_truncated_npy_and_a_changed_shard_are_named(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    np.save(d / "a_x.npy", np.ones((8, 4), np.float32))
    np.save(d / "a_y.npy", np.arange(8) % 2)
    data = (d / "a_x.npy").read_bytes()
    (d / "a_x.npy").write_bytes(data[:-20])
    with pytest.raises(DatasetError, match=re.escape(
            f"{d / 'a_x.npy'}: cannot read as numpy data: truncated: its header says float32 of shape (8, 4) (128 "
            "bytes of data), but only 108 bytes follow")):
        load(str(d))
    (d / "a_x.npy").write_bytes(data)
    train = load(str(d)).train
    np.save(d / "a_x.npy", np.ones((9, 4), np.float32))  # rewritten while "training"
    with pytest.raises(DatasetError, match=re.escape(f"{d / 'a_x.npy'}: changed since the dataset was loaded")):
        take_all(train)


# ---- NaN/Inf: named when its batch is read -----------------------------------------------------------------------

def nan_dir(d: Path) -> int:
    """Shards a.npz (20 samples) and b_x.npy/b_y.npy (30), b's sample 13 NaN; returns its index in the whole."""
    d.mkdir()
    np.savez(d / "a.npz", x=RNG.random((20, 4, 4)), y=np.arange(20) % 4)
    x = RNG.random((30, 4, 4)).astype(np.float32)
    x[13, 2, 1] = np.nan
    np.save(d / "b_x.npy", x)
    np.save(d / "b_y.npy", np.arange(30) % 4)
    return 20 + 13


def test_a_nan_sample_is_named_with_its_file_and_index_when_its_batch_is_read(tmp_path):
    bad = nan_dir(tmp_path / "data")
    splits = load(str(tmp_path / "data"))  # nothing of the samples read yet: no error
    split = splits.train if bad in splits.train.rows() else splits.val
    at = int(np.searchsorted(split.rows(), bad))
    clean = np.delete(np.arange(len(split)), at)
    assert np.isfinite(split.take(clean)[0]).all()
    with pytest.raises(DatasetError, match=re.escape(
            f"{tmp_path / 'data' / 'b_x.npy'}[13]: sample holds nan at position (2, 1); fix the data, or pass "
            "--no-check-finite to train on it anyway")):
        split.take(np.array([0, at, 1]))
    unchecked = load(str(tmp_path / "data"), check_finite=False)
    values = np.concatenate([take_all(unchecked.train)[0], take_all(unchecked.val)[0]])
    assert (~np.isfinite(values)).sum() == 1


def test_a_nan_sample_read_by_a_producer_is_bad_data_naming_it(tmp_path):
    nan_dir(tmp_path / "data")
    splits = load(str(tmp_path / "data"), val_fraction=0.5)
    with pytest.raises(WorkerError) as e:
        for split in (splits.train, splits.val):
            with ShmLoader(split, rank=0, size=1, batch_size=4, num_workers=1, fetch=arrays.take) as loader:
                for _ in loader:
                    pass
    assert e.value.bad_data
    assert e.value.message.startswith(f"{tmp_path / 'data' / 'b_x.npy'}[13]: sample holds nan at position (2, 1)")


# ---- larger than memory ------------------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    from hvdtrain.train.recipe_data import load

    start = time.monotonic()
    splits = load(sys.argv[1])
    loaded = time.monotonic() - start
    rng = np.random.default_rng(0)
    sums = []
    for split in (splits.train, splits.val):
        for _ in range(5):
            x, y = split.take(rng.integers(0, len(split), 64))
            sums.append(float(x.sum()) + float(y.sum()))
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"train": len(splits.train), "val": len(splits.val), "shape": splits.sample_shape,
                      "classes": splits.num_classes, "loaded_s": loaded, "total_s": time.monotonic() - start,
                      "hwm_kib": hwm, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "sums": sums}))
""")


def test_a_dataset_larger_than_this_machines_memory_loads_and_serves_batches_in_little_memory(tmp_path):
    n, shape = 1 << 20, (10, 32, 32)  # 40 KiB per float32 sample: 40 GiB
    d = tmp_path / "big"
    d.mkdir()
    header = {"descr": "<f4", "fortran_order": False, "shape": (n, *shape)}
    with open(d / "big_x.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        data_start = f.tell()
    size = data_start + n * int(np.prod(shape)) * 4
    os.truncate(d / "big_x.npy", size)  # sparse: zeros, no disk blocks
    np.save(d / "big_y.npy", np.arange(n, dtype=np.int64) % 10)
    st = os.stat(d / "big_x.npy")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert st.st_size > memory and st.st_blocks * 512 < 1 << 20, (st.st_size, st.st_blocks, memory)
    env = {**os.environ, "HVDTRAIN_DATA_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", CHILD, str(d)], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["train"], report["val"], tuple(report["shape"]), report["classes"]) == (
        n - round(n * 0.2), round(n * 0.2), shape, 10)
    assert all(s == s for s in report["sums"])  # zeros read back, finite
    assert report["hwm_kib"] < 400 * 1024, report  # peak resident memory, mapped pages included


@pytest.mark.slow
def test_the_pytorch_recipe_exits_2_naming_a_nan_sample_met_while_training(tmp_path):
    from tests.support.harness import REPO, run_bounded

    nan_dir(tmp_path / "data")
    result = run_bounded([sys.executable, str(REPO / "recipes" / "pytorch_train.py"), "--dataset",
                          str(tmp_path / "data"), "--run-dir", str(tmp_path / "run"), "--epochs", "1", "--batch-size",
                          "8", "--threads", "1", "--no-tensorboard", "--no-progress"], timeout=300)
    assert result.returncode == 2, result.describe()
    assert result.output.strip().splitlines()[-1] == (
        f"pytorch_train.py: error: {tmp_path / 'data' / 'b_x.npy'}[13]: sample holds nan at position (2, 1); fix the "
        "data, or pass --no-check-finite to train on it anyway"), result.describe()
    assert "Traceback" not in result.output
