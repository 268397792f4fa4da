"""`hvdtrain data convert` and `hvdtrain data inspect`: array shard directories and image folders written as MDS
read back sample for sample; the output is deterministic; bad input is a named error (exit 2) that leaves nothing
behind."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hvdtrain.data.errors import DataError
from hvdtrain.formats import cachedir
from hvdtrain.stream import StreamError, StreamingDataset
from hvdtrain.stream.convert import convert, parse_image_size, parse_size
from hvdtrain.stream.inspect import describe, render
from tests.support.harness import BIN, run_bounded

HVDTRAIN = str(BIN / "hvdtrain")


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cachedir.ENV_DIR, str(tmp_path / "cache"))  # compressed shards are decompressed here


def _arrays(seed: int, n: int, shape=(3, 4, 4), dtype=np.float64, classes: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, *shape)) * 100).astype(dtype)
    return x, rng.integers(0, classes, size=n)


def _npz(path: Path, **arrays: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    ds = StreamingDataset(path)
    samples = [ds[i] for i in range(len(ds))]
    ds.close()
    return np.stack([s["x"] for s in samples]), np.array([s["y"] for s in samples])


def _assert_same(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    got_x, got_y = _read(path)
    assert got_x.dtype == x.dtype and got_x.shape == x.shape
    assert np.array_equal(got_x, x) and np.array_equal(got_y, y) and got_y.dtype == np.int64


def _meta(path: Path) -> dict:
    return json.loads((path / "index.json").read_text())["hvdtrain"]


# ---- array shard directories ------------------------------------------------------------------------------

def test_flat_shard_dir_round_trips_every_sample_in_file_order(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    xa, ya = _arrays(0, 7)
    xb, yb = _arrays(1, 5)
    np.savez(src / "b.npz", x=xb, y=yb)  # sorted by name: a_x.npy before b.npz
    np.save(src / "a_x.npy", xa)
    np.save(src / "a_y.npy", ya)
    summary = convert(src, tmp_path / "out", shuffle=False, progress=False)
    _assert_same(tmp_path / "out" / "train", np.concatenate([xa, xb]), np.concatenate([ya, yb]))
    assert not (tmp_path / "out" / "val").exists()
    assert [s.name for s in summary.splits] == ["train"] and "no val/ split" in summary.render()
    meta = _meta(tmp_path / "out" / "train")
    assert meta == {"num_classes": int(max(ya.max(), yb.max())) + 1, "x_shape": [3, 4, 4],
                    "source": str(src.resolve()), "order": "source order"}


def test_train_val_dirs_become_splits_and_num_classes_counts_both(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "train").mkdir(parents=True)
    (src / "val").mkdir()
    xt, yt = _arrays(2, 9, shape=(6,), dtype=np.uint8, classes=3)
    xv, yv = _arrays(3, 4, shape=(6,), dtype=np.uint8, classes=3)
    yv[2] = 11  # only val holds the largest label
    np.savez(src / "train" / "t.npz", x=xt, y=yt.astype(np.int32))
    np.savez_compressed(src / "val" / "v.npz", x=xv, y=yv)
    summary = convert(src, tmp_path / "out", shuffle=False, progress=False)
    _assert_same(tmp_path / "out" / "train", xt, yt)
    _assert_same(tmp_path / "out" / "val", xv, yv)
    assert [(s.name, s.samples) for s in summary.splits] == [("train", 9), ("val", 4)]
    assert _meta(tmp_path / "out" / "train")["num_classes"] == 12 == _meta(tmp_path / "out" / "val")["num_classes"]


def test_the_recipes_load_a_converted_dataset(tmp_path: Path) -> None:
    """hvdtrain.train.recipe_data.load streams the converted root, with num_classes from the index's metadata."""
    from hvdtrain.train import recipe_data

    src = tmp_path / "src"
    x, y = _arrays(10, 10, shape=(1, 3, 3), dtype=np.uint8, classes=4)
    _npz(src / "a.npz", x=x, y=y)
    convert(src, tmp_path / "out", val_fraction=0.3, progress=False)
    splits = recipe_data.load(str(tmp_path / "out"))
    assert splits.num_classes == int(y.max()) + 1 and splits.sample_shape == (1, 3, 3)
    assert (len(splits.train), len(splits.val)) == (7, 3)


@pytest.mark.parametrize("compression", [None, "zstd", "zstd:7"])
def test_shard_size_makes_several_shards_and_compressed_ones_read_back(tmp_path: Path, compression) -> None:
    src = tmp_path / "src"
    src.mkdir()
    x, y = _arrays(4, 60, shape=(8,), dtype=np.float32)
    np.savez(src / "a.npz", x=x[:25], y=y[:25])
    np.savez(src / "b.npz", x=x[25:], y=y[25:])
    summary = convert(src, tmp_path / "out", shard_bytes=parse_size("1KiB"), compression=compression,
                      shuffle=False, progress=False)
    out = tmp_path / "out" / "train"
    assert summary.splits[0].shards == StreamingDataset(out).num_shards > 3
    suffix = ".mds.zstd" if compression else ".mds"
    assert {p.name.split(".", 2)[-1] for p in out.glob("shard.*")} == {suffix[1:]}
    _assert_same(out, x, y)


def test_val_fraction_holds_out_evenly_spaced_samples(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    x, y = _arrays(5, 20, shape=(2,), dtype=np.int16)
    np.savez(src / "a.npz", x=x, y=y)
    summary = convert(src, tmp_path / "out", val_fraction=0.25, shuffle=False, progress=False)
    held = np.array([i % 4 == 3 for i in range(20)])  # floor((i+1)/4) > floor(i/4)
    _assert_same(tmp_path / "out" / "train", x[~held], y[~held])
    _assert_same(tmp_path / "out" / "val", x[held], y[held])
    assert [(s.name, s.samples) for s in summary.splits] == [("train", 15), ("val", 5)] and not summary.notes


def test_a_stray_large_label_is_noted(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    np.savez(src / "a.npz", x=np.zeros((3, 2), np.float32), y=np.array([0, 1, 1000]))
    summary = convert(src, tmp_path / "out", val_fraction=0.4, progress=False)
    assert summary.num_classes == 1001 and _meta(tmp_path / "out" / "val")["num_classes"] == 1001
    assert "num_classes is 1001 (the largest label + 1) but only 3 distinct labels occur" in summary.render()


def test_converting_twice_gives_identical_bytes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "train").mkdir(parents=True)
    (src / "val").mkdir()
    for split, seed in (("train", 6), ("val", 7)):
        x, y = _arrays(seed, 40, shape=(5, 3), dtype=np.float32)
        np.savez(src / split / "s.npz", x=x, y=y)
    for out in ("one", "two"):
        convert(src, tmp_path / out, shard_bytes=700, compression="zstd", progress=False)
    one = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    two = sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    assert one == two and len(one) > 4
    for rel in one:
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes(), rel


@pytest.mark.parametrize("bucket_bytes", [None, 300])  # None: one bucket; 300 bytes: ~20 buckets per split
def test_each_split_is_written_in_a_seeded_shuffle(tmp_path: Path, bucket_bytes, monkeypatch) -> None:
    """A class-sorted source comes out as a uniform shuffle of each split: every (x, y) pair once, val held out in
    the source's order (the same samples as --keep-order), the same bytes for the same seed, another order for
    another seed, and no temporary buckets left."""
    from hvdtrain.stream import convert as convert_module

    if bucket_bytes:
        monkeypatch.setattr(convert_module, "SHUFFLE_BUCKET_BYTES", bucket_bytes)
    src = tmp_path / "src"
    x, _ = _arrays(8, 120, shape=(4,), dtype=np.float32)
    y = np.repeat(np.arange(4), 30)  # sorted by class, as image folders and per-class files arrive
    _npz(src / "a.npz", x=x[:70], y=y[:70])
    _npz(src / "b.npz", x=x[70:], y=y[70:])
    for out, seed in (("one", 0), ("two", 0), ("three", 1)):
        convert(src, tmp_path / out, val_fraction=0.25, seed=seed, shard_bytes=200, progress=False)
    convert(src, tmp_path / "kept", val_fraction=0.25, shuffle=False, progress=False)
    for split in ("train", "val"):
        got_x, got_y = _read(tmp_path / "one" / split)
        kept_x, kept_y = _read(tmp_path / "kept" / split)
        order = np.argsort(got_x[:, 0])
        want = np.argsort(kept_x[:, 0])
        assert np.array_equal(got_x[order], kept_x[want]) and np.array_equal(got_y[order], kept_y[want])
        assert not np.array_equal(got_y, kept_y)  # shuffled
        assert np.array_equal(_read(tmp_path / "two" / split)[0], got_x)  # the same seed: the same order
        assert not np.array_equal(_read(tmp_path / "three" / split)[0], got_x)
    first = StreamingDataset(tmp_path / "one" / "train")
    assert first.num_shards > 3 and len(np.unique(first.take(np.arange(20))["y"])) == 4  # every class early on
    assert _meta(tmp_path / "one" / "train")["order"] == "shuffled (seed 0)"
    assert not (tmp_path / "one" / convert_module.SHUFFLE_DIR).exists()


def test_a_class_sorted_image_folder_is_shuffled(tmp_path: Path) -> None:
    src = tmp_path / "img"
    for label, name in enumerate(("a", "b", "c")):
        for i in range(8):
            _image(src / name / f"{i}.png", 10 * label + i, (4, 4))
    convert(src, tmp_path / "out", progress=False)
    _, y = _read(tmp_path / "out" / "train")
    assert sorted(y.tolist()) == [0] * 8 + [1] * 8 + [2] * 8 and y.tolist() != sorted(y.tolist())


# ---- image folders ----------------------------------------------------------------------------------------

def _image(path: Path, seed: int, size: tuple[int, int], mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path)


def _decoded(path: Path, size: tuple[int, int] | None = None) -> np.ndarray:
    with Image.open(path) as image:
        rgb = image.convert("RGB")
    if size is not None:
        rgb = rgb.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return np.asarray(rgb).transpose(2, 0, 1)


def test_image_folder_classes_numbered_by_name_and_stored_channels_first(tmp_path: Path) -> None:
    src = tmp_path / "img"
    files = [src / "zebra" / "1.png", src / "ant" / "b.jpg", src / "ant" / "a.png", src / "cat" / "x.JPEG"]
    for i, path in enumerate(files):
        _image(path, i, (5, 7), mode="L" if i == 3 else "RGB")  # a grayscale one becomes RGB
    (src / "cat" / "notes.txt").write_text("not an image")
    summary = convert(src, tmp_path / "out", val_fraction=0.5, shuffle=False, progress=False)
    ordered = [src / "ant" / "a.png", src / "ant" / "b.jpg", src / "cat" / "x.JPEG", src / "zebra" / "1.png"]
    x = np.stack([_decoded(p) for p in ordered])
    y = np.array([0, 0, 1, 2])
    _assert_same(tmp_path / "out" / "train", x[[0, 2]], y[[0, 2]])
    _assert_same(tmp_path / "out" / "val", x[[1, 3]], y[[1, 3]])
    assert summary.x_encoding == "ndarray:uint8:3,5,7" and summary.num_classes == 3
    meta = _meta(tmp_path / "out" / "val")
    assert meta["classes"] == ["ant", "cat", "zebra"] and meta["num_classes"] == 3 and meta["x_shape"] == [3, 5, 7]


def test_webp_gif_bmp_tiff_are_images_and_other_files_are_counted(tmp_path: Path) -> None:
    src = tmp_path / "img"
    names = ["a/0.webp", "a/1.gif", "b/2.bmp", "b/3.tiff", "b/4.png"]
    for i, name in enumerate(names):
        _image(src / name, i, (4, 4))
    (src / "a" / "readme.txt").write_text("notes")
    (src / "b" / "5.heic").write_bytes(b"not decoded here")
    summary = convert(src, tmp_path / "out", shuffle=False, progress=False)
    got, y = _read(tmp_path / "out" / "train")
    assert y.tolist() == [0, 0, 1, 1, 1] and np.array_equal(got, np.stack([_decoded(src / n) for n in names]))
    assert "skipped 2 files of the class directories that are not images (.heic: 1, .txt: 1)" in summary.render()


def test_image_size_resizes_every_image_of_each_split(tmp_path: Path) -> None:
    src = tmp_path / "img"
    _image(src / "train" / "a" / "0.png", 0, (9, 12))
    _image(src / "train" / "b" / "0.jpg", 1, (4, 4))
    _image(src / "val" / "b" / "0.png", 2, (6, 8))
    convert(src, tmp_path / "out", image_size=parse_image_size("6x8"), shuffle=False, progress=False)
    train = [src / "train" / "a" / "0.png", src / "train" / "b" / "0.jpg"]
    _assert_same(tmp_path / "out" / "train", np.stack([_decoded(p, (6, 8)) for p in train]), np.array([0, 1]))
    _assert_same(tmp_path / "out" / "val", _decoded(src / "val" / "b" / "0.png")[None], np.array([1]))


def test_differing_image_sizes_without_image_size_name_the_file(tmp_path: Path) -> None:
    src = tmp_path / "img"
    _image(src / "a" / "0.png", 0, (5, 5))
    _image(src / "b" / "0.png", 1, (5, 6))
    with pytest.raises(StreamError, match=r"b/0\.png: image is 5x6 \(HxW\) but .*a/0\.png is 5x5; pass --image-size"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---- bad input --------------------------------------------------------------------------------------------

BAD = {  # case: (make the source in SRC, the error's words; "{src}" is the source directory)
    "float_labels": (lambda s: _npz(s / "a.npz", x=np.zeros((2, 3)), y=np.zeros(2)),
                     r"{src}/a\.npz\['y'\]: labels must be a 1-D integer array .* got dtype float64"),
    "length_mismatch": (lambda s: _npz(s / "a.npz", x=np.zeros((3, 2)), y=np.zeros(2, int)),
                        r"{src}/a\.npz\['x'\] has 3 samples but {src}/a\.npz\['y'\] has 2 labels"),
    "complex_dtype": (lambda s: _npz(s / "a.npz", x=np.zeros((2, 2), np.complex64), y=np.zeros(2, int)),
                      r"{src}/a\.npz\['x'\]: dtype complex64 cannot be stored in MDS; allowed: uint8, int8"),
    "bool_dtype": (lambda s: _npz(s / "a.npz", x=np.zeros((2, 2), bool), y=np.zeros(2, int)),
                   r"{src}/a\.npz\['x'\]: dtype bool cannot be stored"),
    "negative_label": (lambda s: _npz(s / "a.npz", x=np.zeros((2, 2)), y=np.array([1, -4])),
                       r"{src}/a\.npz\['y'\]\[1\]: label -4 is not a class id"),
    "one_dim_samples": (lambda s: _npz(s / "a.npz", x=np.zeros(2), y=np.zeros(2, int)),
                        r"{src}/a\.npz\['x'\]: samples must be an array of shape \(N, \.\.\.\)"),
    "missing_x": (lambda s: _npz(s / "a.npz", y=np.zeros(2, int)), r"{src}/a\.npz: no array 'x'"),
    "shapes_differ": (lambda s: (_npz(s / "a.npz", x=np.zeros((2, 2)), y=np.zeros(2, int)),
                                 _npz(s / "b.npz", x=np.zeros((2, 3)), y=np.zeros(2, int))),
                      r"{src}/b\.npz\['x'\]: samples are float64 of shape \(3,\), but {src}/a\.npz\['x'\] holds "
                      r"float64 of shape \(2,\)"),
    "unpaired_npy": (lambda s: (s.mkdir(), np.save(s / "a_x.npy", np.zeros((2, 2)))),
                     r"{src}/a_x\.npy: missing its labels file a_y\.npy"),
    "not_numpy": (lambda s: (s.mkdir(), (s / "a.npz").write_bytes(b"PK\x03\x04 no zip")), r"{src}/a\.npz: cannot read"),
    "nothing": (lambda s: (s / "empty_class").mkdir(parents=True), r"{src}: no \.npz/\.npy shards and no images"),
    "only_train": (lambda s: (s / "train").mkdir(parents=True), r"{src} has train/ but no val/"),
    "unreadable_image": (lambda s: (_image(s / "a" / "0.png", 0, (4, 4)), (s / "b").mkdir(),
                                    (s / "b" / "1.jpg").write_bytes(b"not a jpeg")),
                         r"1 image file cannot be converted:\n  {src}/b/1\.jpg: not an image Pillow can read"),
    "not_a_dir": (lambda s: s.write_text("x"), r"{src}: not a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_named_error_and_writes_nothing(case: str, tmp_path: Path) -> None:
    make, words = BAD[case]
    src = tmp_path / "src"
    make(src)
    with pytest.raises(DataError, match=words.format(src=str(src))):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_refuses_a_non_empty_dst_and_one_inside_the_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _npz(src / "a.npz", x=np.zeros((2, 2)), y=np.zeros(2, int))
    convert(src, tmp_path / "out", progress=False)
    before = (tmp_path / "out" / "train" / "index.json").read_bytes()
    with pytest.raises(StreamError, match=r"out: exists and holds an MDS dataset; convert never overwrites"):
        convert(src, tmp_path / "out", progress=False)
    assert (tmp_path / "out" / "train" / "index.json").read_bytes() == before
    with pytest.raises(StreamError, match=r"is inside the source"):
        convert(src, src / "mds", progress=False)
    with pytest.raises(StreamError, match=r"--image-size applies to image folders only"):
        convert(src, tmp_path / "other", image_size=(4, 4), progress=False)


def test_a_failure_while_writing_removes_what_was_written(tmp_path: Path) -> None:
    """A file whose header is fine but whose data is cut off fails only when read: the shards written before it
    are removed, and an empty dst that existed stays (empty)."""
    src = tmp_path / "src"
    _npz(src / "a.npz", x=np.ones((50, 4)), y=np.zeros(50, int))
    np.save(src / "b_x.npy", np.ones((50, 4)))
    np.save(src / "b_y.npy", np.zeros(50, int))
    data = (src / "b_x.npy").read_bytes()
    (src / "b_x.npy").write_bytes(data[:-40])
    (tmp_path / "out").mkdir()
    with pytest.raises(DataError, match=r"b_x\.npy: cannot read as numpy data"):
        convert(src, tmp_path / "out", shard_bytes=600, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def test_parse_size_and_image_size() -> None:
    assert parse_size("1000000") == 10**6 and parse_size("64MiB") == 64 << 20 and parse_size("1GB") == 10**9
    assert parse_size("1.5 KiB") == 1536 and parse_size("2kb") == 2000
    for bad in ("", "MiB", "12 parsecs", "-3", "0", "5GiB"):
        with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
            parse_size(bad)
    assert parse_image_size("224x160") == (224, 160) and parse_image_size("3X4") == (3, 4)
    for bad in ("224", "0x3", "ax4"):
        with pytest.raises(ValueError, match="HEIGHTxWIDTH"):
            parse_image_size(bad)


# ---- inspect and the CLI ----------------------------------------------------------------------------------

def test_inspect_a_root_and_a_single_split(tmp_path: Path) -> None:
    src = tmp_path / "src"
    x, y = _arrays(8, 30, shape=(4,), dtype=np.float32)
    _npz(src / "a.npz", x=x, y=y)
    convert(src, tmp_path / "out", shard_bytes=400, compression="zstd:3", val_fraction=0.2, progress=False)
    desc = describe(tmp_path / "out")
    assert desc["layout"] == "root" and list(desc["splits"]) == ["train", "val"]
    train = desc["splits"]["train"]
    assert train["samples"] == 24 and train["shards"] > 1 and train["compression"] == ["zstd:3"]
    assert train["columns"] == [{"name": "x", "encoding": "ndarray:float32:4", "bytes_per_sample": 16},
                                {"name": "y", "encoding": "int64", "bytes_per_sample": 8}]
    assert train["raw_bytes"] > 24 * 24 and train["stored_bytes"] > 0 and train["hashes"] == ["sha1"]
    assert train["hvdtrain"]["x_shape"] == [4] and train["missing_shards"] == []
    text = render(desc)
    assert "train: 24 samples in" in text and "val: 6 samples in 1 shard," in text
    assert "column x: ndarray:float32:4 (16 B/sample)" in text
    one = describe(tmp_path / "out" / "val")
    assert one["layout"] == "split" and list(one["splits"]) == ["val"]
    with pytest.raises(StreamError, match=r"no index\.json in it or in its subdirectories"):
        describe(src)


def _cli(*args: str):
    return run_bounded([HVDTRAIN, *args], timeout=60)


def test_cli_convert_then_inspect_text_and_json(tmp_path: Path) -> None:
    src = tmp_path / "src"
    x, y = _arrays(9, 12, shape=(2, 2), dtype=np.uint16)
    _npz(src / "train" / "a.npz", x=x, y=y)
    _npz(src / "val" / "a.npz", x=x[:3], y=y[:3])
    out = tmp_path / "out"
    res = _cli("data", "convert", str(src), str(out), "--shard-size", "100B", "--compression", "zstd:1",
               "--no-progress", "--keep-order")
    assert res.returncode == 0, res.describe()
    assert f"wrote {out}: arrays" in res.output and "train: 12 samples in" in res.output, res.describe()
    _assert_same(out / "train", x, y)
    res = _cli("data", "inspect", str(out))
    assert res.returncode == 0 and f"{out}: MDS dataset root, 2 splits (train, val)" in res.output, res.describe()
    res = _cli("data", "inspect", str(out), "--json")
    assert res.returncode == 0, res.describe()
    assert json.loads(res.output) == describe(out)


def test_sigterm_during_convert_removes_what_it_wrote(tmp_path: Path) -> None:
    """As SIGINT does: a conversion stopped by SIGTERM (a scheduler's kill) leaves no index-less shards, and the
    same command then runs on the directory."""
    src, out = tmp_path / "src", tmp_path / "out"
    _npz(src / "a.npz", x=np.zeros((200_000, 2), np.uint8), y=np.zeros(200_000, np.int64))
    argv = [HVDTRAIN, "data", "convert", str(src), str(out), "--shard-size", "2KB", "--keep-order", "--no-progress"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "train" / "shard.00003.mds").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no shard written in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "interrupted (SIGTERM); nothing was written that looks complete" in output
    assert not out.exists() or not any(out.iterdir()), sorted(out.rglob("*"))[:5]


@pytest.mark.parametrize("args", [["schema"], ["data", "inspect", "{out}", "--json"]])
def test_output_into_a_closed_pipe_ends_quietly(args: list[str], tmp_path: Path) -> None:
    """`hvdtrain schema | head -1`: the reader is gone; exit 141 (as a tool killed by SIGPIPE), no traceback."""
    src, out = tmp_path / "src", tmp_path / "out"
    _npz(src / "a.npz", x=np.zeros((3000, 2), np.uint8), y=np.zeros(3000, np.int64))
    convert(src, out, shard_bytes=600, progress=False)  # ~100 shards: --json is longer than a pipe's buffer
    proc = subprocess.Popen([HVDTRAIN, *(a.format(out=out) for a in args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before anything is written: every write meets a closed pipe
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


@pytest.mark.parametrize(("args", "words"), [
    (["data", "convert", "{src}", "{out}"], "hvdtrain data convert: error: {src}/a.npz['y']: labels must be"),
    (["data", "convert", "{src}", "{out}", "--shard-size", "12 parsecs"],
     "argument --shard-size: '12 parsecs' is not a size"),
    (["data", "convert", "{src}", "{out}", "--compression", "gzip"], "compression 'gzip' is not supported"),
    (["data", "inspect", "{src}"], "hvdtrain data inspect: error: {src}: no index.json"),
])
def test_cli_bad_input_is_exit_2_naming_the_file(args: list[str], words: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    _npz(src / "a.npz", x=np.zeros((2, 2)), y=np.zeros(2))
    res = _cli(*(a.format(src=src, out=tmp_path / "out") for a in args))
    assert res.returncode == 2, res.describe()
    assert words.format(src=src) in res.output and "Traceback" not in res.output, res.describe()
    assert not (tmp_path / "out").exists()
