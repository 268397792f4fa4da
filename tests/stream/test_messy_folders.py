"""Image folders as they arrive (issue 59 items 1-3): images in sub-folders of a class are found (as torchvision's
ImageFolder finds them), a class folder with no image is an error naming it, every image is decoded before
anything is written (both modes) and every bad one is listed in one run, or left out and counted with --skip-bad;
`hvdtrain data verify` tells a bad source image from a damaged shard."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hvdtrain.formats import cachedir
from hvdtrain.stream import MDSWriter, StreamError, StreamingDataset
from hvdtrain.stream.convert import convert
from tests.support.harness import BIN, run_bounded


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cachedir.ENV_DIR, str(tmp_path / "cache"))


def jpeg_bytes(seed: int, size: int = 24) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def put(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def labels_by_file(root: Path) -> list[int]:
    ds = StreamingDataset(root)
    ys = sorted(int(ds[i]["y"]) for i in range(len(ds)))
    ds.close()
    return ys


def test_images_in_sub_folders_of_a_class_are_that_class(tmp_path: Path) -> None:
    """The user's folder: half of `cat`'s images under cat/2024/batch0/; a hidden folder and macOS's ._ copies are
    not images."""
    src = tmp_path / "src"
    for i in range(3):
        put(src / "cat" / f"{i}.jpg", jpeg_bytes(i))
        put(src / "cat" / "2024" / "batch0" / f"{i}.jpg", jpeg_bytes(10 + i))
        put(src / "dog" / "deeper" / f"{i}.jpg", jpeg_bytes(20 + i))
    put(src / "cat" / "._0.jpg", b"\x00\x05\x16\x07 AppleDouble")
    put(src / "dog" / ".thumbs" / "t.jpg", b"not read")
    for encoded in (False, True):
        out = tmp_path / f"out-{encoded}"
        summary = convert(src, out, encoded=encoded, progress=False)
        assert labels_by_file(out / "train") == [0] * 6 + [1] * 3, encoded
        assert summary.num_classes == 2 and not summary.notes[:-1], summary.notes


def test_a_class_folder_with_no_image_is_an_error_naming_it(tmp_path: Path) -> None:
    src = tmp_path / "src"
    put(src / "cat" / "0.jpg", jpeg_bytes(0))
    (src / "dog" / "2024").mkdir(parents=True)
    put(src / "owl" / "readme.txt", b"no images yet")
    with pytest.raises(StreamError, match=rf"class directories with no image: {src}/dog, {src}/owl; every class "
                                          "needs images"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def messy(src: Path) -> dict[str, Path]:
    """Two classes of good JPEGs, one truncated (its header is fine), one that is not an image at all, one empty."""
    for i in range(4):
        put(src / "a" / f"{i}.jpg", jpeg_bytes(i))
        put(src / "b" / "sub" / f"{i}.jpg", jpeg_bytes(10 + i))
    whole = jpeg_bytes(99, size=64)
    return {"trunc": put(src / "a" / "trunc.jpg", whole[:len(whole) // 2]),
            "garbage": put(src / "b" / "sub" / "garbage.jpg", b"<html>404 not found</html>"),
            "empty": put(src / "b" / "empty.png", b"")}


@pytest.mark.parametrize("encoded", [False, True])
def test_every_bad_image_is_listed_in_one_run_and_nothing_is_written(tmp_path: Path, encoded: bool) -> None:
    bad = messy(tmp_path / "src")
    with pytest.raises(StreamError) as err:
        convert(tmp_path / "src", tmp_path / "out", encoded=encoded, progress=False)
    message = str(err.value)
    assert message.startswith("3 image files cannot be converted:\n"), message
    assert f"  {bad['trunc']}: does not decode (image file is truncated" in message
    assert f"  {bad['garbage']}: not an image Pillow can read (26 bytes)" in message
    assert f"  {bad['empty']}: not an image Pillow can read (0 bytes)" in message
    assert message.endswith("fix or remove them, or pass --skip-bad to leave them out (counted in the summary and "
                            "the index)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("encoded", [False, True])
def test_skip_bad_leaves_them_out_and_counts_them(tmp_path: Path, encoded: bool) -> None:
    bad = messy(tmp_path / "src")
    summary = convert(tmp_path / "src", tmp_path / "out", encoded=encoded, skip_bad=True, progress=False)
    assert labels_by_file(tmp_path / "out" / "train") == [0] * 4 + [1] * 4
    text = summary.render()
    assert "note: skipped 3 bad image files (--skip-bad), recorded in each split's index.json" in text, text
    assert f"note: skipped bad image {bad['trunc']}: does not decode" in text
    record = json.loads((tmp_path / "out" / "train" / "index.json").read_text())["hvdtrain"]["skipped_bad"]
    assert record["count"] == 3
    assert [f["path"] for f in record["files"]] == ["a/trunc.jpg", "b/empty.png", "b/sub/garbage.jpg"]
    split = tmp_path / "split"  # paths relative to SRC, so the split is in them
    messy(split / "train")
    put(split / "val" / "a" / "0.jpg", jpeg_bytes(0))
    convert(split, tmp_path / "out2", encoded=encoded, skip_bad=True, progress=False)
    record = json.loads((tmp_path / "out2" / "val" / "index.json").read_text())["hvdtrain"]["skipped_bad"]
    assert [f["path"] for f in record["files"]] == ["train/a/trunc.jpg", "train/b/empty.png", "train/b/sub/garbage.jpg"]


def test_a_class_whose_every_image_is_bad_is_an_error_even_with_skip_bad(tmp_path: Path) -> None:
    src = tmp_path / "src"
    put(src / "a" / "0.jpg", jpeg_bytes(0))
    put(src / "b" / "0.jpg", b"\xff\xd8\xff")
    with pytest.raises(StreamError, match=rf"every image of class directory {src}/b is bad \(--skip-bad left them "
                                          r"all out\)"):
        convert(src, tmp_path / "out", skip_bad=True, progress=False)


def test_a_link_up_the_tree_is_not_followed_and_a_val_only_class_is_noted(tmp_path: Path) -> None:
    """`cat/up -> ..` would take every other class's images as cats (and loop); a link elsewhere is followed."""
    src = tmp_path / "src"
    for split in ("train", "val"):
        put(src / split / "cat" / "0.jpg", jpeg_bytes(0))
        put(src / split / "dog" / "0.jpg", jpeg_bytes(1))
    put(src / "val" / "owl" / "0.jpg", jpeg_bytes(2))
    put(tmp_path / "more" / "1.jpg", jpeg_bytes(3))
    (src / "train" / "cat" / "up").symlink_to("..")
    (src / "train" / "cat" / "more").symlink_to(tmp_path / "more")
    summary = convert(src, tmp_path / "out", progress=False)
    assert labels_by_file(tmp_path / "out" / "train") == [0, 0, 1]
    assert "note: class owl have images in val/ only: the model gets an output" in summary.render()


def test_the_cli_lists_every_bad_file_and_skip_bad_converts(tmp_path: Path) -> None:
    bad = messy(tmp_path / "src")
    hvdtrain = str(BIN / "hvdtrain")
    res = run_bounded([hvdtrain, "data", "convert", str(tmp_path / "src"), str(tmp_path / "out"), "--encoded"],
                      timeout=60)
    assert res.returncode == 2, res.describe()
    assert all(str(path) in res.output for path in bad.values()) and "Traceback" not in res.output, res.describe()
    res = run_bounded([hvdtrain, "data", "convert", str(tmp_path / "src"), str(tmp_path / "out"), "--encoded",
                       "--skip-bad"], timeout=60)
    assert res.returncode == 0 and "skipped 3 bad image files" in res.output, res.describe()


def test_verify_tells_a_bad_source_image_from_a_damaged_shard(tmp_path: Path) -> None:
    """A stored JPEG that matches its shard's checksum but does not decode was bad before it was stored (an older
    convert, or another writer): re-copying the shard cannot help."""
    root = tmp_path / "mds"
    for split in ("train", "val"):
        with MDSWriter(root / split, {"x": "jpeg", "y": "int64"}, meta={"num_classes": 2}) as w:
            for i in range(4):
                w.write({"x": jpeg_bytes(i)[:300] if (split, i) == ("train", 2) else jpeg_bytes(i), "y": i % 2})
    res = run_bounded([str(BIN / "hvdtrain"), "data", "verify", str(root)], timeout=60)
    assert res.returncode == 2, res.describe()
    assert (f"error: train: {root}/train/shard.00000.mds sample 2: column 'x' (jpeg): the stored bytes match the "
            "shard's checksum but do not decode as an image" in res.output), res.describe()
    assert "the source image was bad when it was converted" in res.output and "copy or upload" not in res.output
