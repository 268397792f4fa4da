"""`hvdtrain data convert SRC DST`: an array shard directory or an image folder, written as an MDS dataset.

Sources (a split layout when SRC has both `train/` and `val/`; else SRC is the one, training split):
- arrays: `*.npz` files holding `x` (samples, N × ...) and `y` (integer labels, N), and/or `NAME_x.npy` +
  `NAME_y.npy` pairs (hvdtrain/train/npyshards.py's shard directory). `x` keeps its dtype; one file is in memory at a
  time.
- images: `<class>/*.jpg|jpeg|png` (class directories directly under SRC or under each split). Classes are numbered
  by their sorted directory names (over every split); images are decoded to RGB, resized to `image_size` (H, W)
  when given (else all must have one size), and stored channels first (uint8 3 × H × W).

DST gets `train/` and `val/` (Mosaic's layout; `val/` only if SRC has one or `val_fraction` > 0, which holds out
evenly spaced samples of an unsplit SRC: sample i is val when floor((i+1)·f) > floor(i·f)). Columns: `x`
(`ndarray:DTYPE:SHAPE`) and `y` (`int64`); hvdtrain's metadata (num_classes, x_shape, source, classes) goes in each
index's "hvdtrain" key. The whole source is checked before anything is written; the output is deterministic (same
input, same bytes; nothing is shuffled), and a failed conversion removes what it wrote.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.stream import encodings
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.mds import INDEX, MDSWriter

DEFAULT_SHARD_BYTES = 64 << 20
MAX_SHARD_BYTES = (1 << 32) - 1  # MDS's offsets are 32-bit
SPLITS = ("train", "val")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
         "gib": 1 << 30, "tib": 1 << 40}


@dataclass(frozen=True)
class SplitSummary:
    name: str
    samples: int
    shards: int
    stored_bytes: int


@dataclass(frozen=True)
class Summary:
    """What `convert` wrote: per split its samples, shards and bytes on disk; `notes` for the user."""

    dst: Path
    kind: str  # "arrays" or "images"
    splits: tuple[SplitSummary, ...]
    num_classes: int
    x_encoding: str
    compression: str | None
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        from hvdtrain.stream.inspect import human_bytes

        lines = [f"wrote {self.dst}: {self.kind}, {self.num_classes} classes, x {self.x_encoding}, y int64, "
                 f"compression {self.compression or 'none'}"]
        lines += [f"  {s.name}: {s.samples} samples in {s.shards} shard{'s' * (s.shards != 1)}, "
                  f"{human_bytes(s.stored_bytes)}" for s in self.splits]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


@dataclass
class Source:
    """A checked source: per split its items in order (array shard files, or (image, label)) and sample count."""

    kind: str
    items: dict[str, list[Any]]
    counts: dict[str, int]
    x_encoding: str
    meta: dict[str, Any] = field(default_factory=dict)
    image_size: tuple[int, int] | None = None  # images: resize to (H, W)
    notes: list[str] = field(default_factory=list)


# ---- option parsing (shared with the CLI) -------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    """Bytes from '1000000', '64MiB', '1GB', '512 KiB', '2TiB' (KB/MB/GB/TB are powers of 1000, KiB/... of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in UNITS:
        raise ValueError(f"{text!r} is not a size: give bytes (1000000) or a number with a unit "
                         "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 64MiB)")
    return int(float(m.group(1)) * UNITS[unit])


def parse_size(text: str) -> int:
    """A shard size: `parse_bytes`, 1 byte .. 4 GiB - 1."""
    size = parse_bytes(text)
    if not 1 <= size <= MAX_SHARD_BYTES:
        raise ValueError(f"{text!r} is {size} bytes; a shard size must be 1 byte .. 4GiB - 1 (MDS's 32-bit offsets)")
    return size


def parse_image_size(text: str) -> tuple[int, int]:
    """(H, W) from 'HxW' (e.g. 224x224)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or min(int(m.group(1)), int(m.group(2))) < 1:
        raise ValueError(f"{text!r} is not an image size: give HEIGHTxWIDTH in pixels, e.g. 224x224")
    return int(m.group(1)), int(m.group(2))


def parse_compression(text: str) -> str:
    """'zstd' or 'zstd:LEVEL' (1..22), else ValueError."""
    name, colon, level = text.partition(":")
    if name != "zstd" or (colon and not (level.isdigit() and 1 <= int(level) <= 22)):
        raise ValueError(f"compression {text!r} is not supported: use zstd or zstd:LEVEL (LEVEL 1..22)")
    return text


# ---- conversion -------------------------------------------------------------------------------------------

def convert(src: Path, dst: Path, *, shard_bytes: int = DEFAULT_SHARD_BYTES, compression: str | None = None,
            image_size: tuple[int, int] | None = None, val_fraction: float = 0.0, progress: bool = True) -> Summary:
    """Write `src` (see the module docstring) as an MDS dataset root in `dst`, which must not exist or be empty.
    StreamError naming the file and what is wrong for bad input, raised before anything is written where possible."""
    src, dst = Path(src), Path(dst)
    try:
        if compression is not None:
            parse_compression(compression)
    except ValueError as e:
        raise StreamError(str(e)) from None
    if not 1 <= shard_bytes <= MAX_SHARD_BYTES or not 0 <= val_fraction < 1:
        raise StreamError(f"shard size {shard_bytes} must be 1 .. {MAX_SHARD_BYTES} bytes and the val fraction "
                          f"{val_fraction} in [0, 1)")
    dirs = _split_dirs(src)
    if val_fraction and len(dirs) > 1:
        raise StreamError(f"{src} has train/ and val/ splits: --val-fraction applies only to a source without them")
    _check_dst(src, dst)
    source = _scan(dirs, image_size)
    source.meta["source"] = str(src.resolve())
    outputs = ["train", "val"] if val_fraction else list(dirs)
    if val_fraction:
        n = source.counts["train"]
        if int(n * val_fraction) < 1:
            raise StreamError(f"{src}: {n} samples are too few to hold out {val_fraction:g} for validation")
    created = not dst.exists()
    try:
        splits = _write(source, dst, outputs, val_fraction, progress,
                        dict(compression=compression, size_limit=shard_bytes))
    except BaseException:
        _remove_output(dst, outputs, created)
        raise
    if "val" not in outputs:
        source.notes.append(f"{src} has no val/ split, so {dst} has none: training needs one; convert again with "
                            "--val-fraction F to hold out samples")
    return Summary(dst, source.kind, splits, source.meta["num_classes"], source.x_encoding, compression,
                   tuple(source.notes))


def _split_dirs(src: Path) -> dict[str, Path]:
    if not src.is_dir():
        raise StreamError(f"{src}: not a directory; the source must be a directory of array shards or images")
    present = [name for name in SPLITS if (src / name).is_dir()]
    if len(present) == 1:
        missing = ({*SPLITS} - {*present}).pop()
        raise StreamError(f"{src} has {present[0]}/ but no {missing}/: a split source needs both (or rename "
                          f"{present[0]}/ and convert it as one split)")
    return {name: src / name for name in SPLITS} if present else {"train": src}


def _check_dst(src: Path, dst: Path) -> None:
    if dst.exists() and not dst.is_dir():
        raise StreamError(f"{dst}: exists and is not a directory; give a new or empty directory")
    if dst.is_dir() and any(dst.iterdir()):
        what = "an MDS dataset" if any(dst.glob(f"*{INDEX}")) or any(dst.glob(f"*/{INDEX}")) else "files"
        raise StreamError(f"{dst}: exists and holds {what}; convert never overwrites: give a new or empty directory")
    if dst.resolve().is_relative_to(src.resolve()):
        raise StreamError(f"{dst} is inside the source {src}: write the dataset elsewhere")


def _remove_output(dst: Path, outputs: list[str], created: bool) -> None:
    """Remove what a failed conversion wrote (dst was absent or empty: the split directories are ours)."""
    for name in outputs:
        shutil.rmtree(dst / name, ignore_errors=True)
    if created:
        shutil.rmtree(dst, ignore_errors=True)


def _write(source: Source, dst: Path, outputs: list[str], val_fraction: float, progress: bool,
           options: dict[str, Any]) -> tuple[SplitSummary, ...]:
    """Every sample into its split's writer (held-out ones into val), then each index.json last."""
    from tqdm import tqdm

    columns = {"x": source.x_encoding, "y": "int64"}
    writers = {name: MDSWriter(dst / name, columns, meta=source.meta, **options) for name in outputs}
    counts = dict.fromkeys(outputs, 0)
    with tqdm(total=sum(source.counts.values()), desc=f"writing {dst}", unit="sample", file=sys.stderr,
              disable=None if progress else True) as bar:  # None: only on a terminal
        for split, items in source.items.items():
            for i, (x, y) in enumerate(_samples(source, items, bar)):
                held = bool(val_fraction) and int((i + 1) * val_fraction) > int(i * val_fraction)
                name = "val" if held else split
                writers[name].write({"x": x, "y": y})
                counts[name] += 1
    for writer in writers.values():
        writer.finish()
    return tuple(SplitSummary(name, counts[name], len(w.shards),
                              sum((s["zip_data"] or s["raw_data"])["bytes"] for s in w.shards))
                 for name, w in writers.items())


def _samples(source: Source, items: list[Any], bar: Any) -> Iterator[tuple[np.ndarray, int]]:
    """(x, label) of each sample of one split's items, in order."""
    if source.kind == "images":
        for path, label in items:
            yield _decode_image(path, source.image_size), label
            bar.update(1)
        return
    for src in items:
        x, y = _load_array(src, "x"), _load_array(src, "y")
        x = x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))  # the encoder wants native byte order
        for i in range(len(y)):
            yield x[i], int(y[i])
        bar.update(len(y))


# ---- array shard directories ------------------------------------------------------------------------------

ShardSrc = Path | tuple[Path, Path]  # a .npz file or (NAME_x.npy, NAME_y.npy), from npyfiles.shard_files


def _scan(dirs: dict[str, Path], image_size: tuple[int, int] | None) -> Source:
    if any(next(d.glob("*.np[yz]"), None) for d in dirs.values()):
        if image_size is not None:
            raise StreamError(f"{next(iter(dirs.values()))} holds array shards: --image-size applies to image "
                              "folders only")
        return _scan_arrays(dirs)
    return _scan_images(dirs, image_size)


def _scan_arrays(dirs: dict[str, Path]) -> Source:
    """Every shard's x header and labels checked (x's data is not read); one x dtype and sample shape in all."""
    from hvdtrain.train.npyfiles import shard_files

    items: dict[str, list[Any]] = {}
    counts: dict[str, int] = {}
    first: tuple[str, tuple[int, ...], np.dtype] | None = None
    top, distinct = -1, set[int]()
    for split, directory in dirs.items():
        items[split], counts[split] = [src for _, src in shard_files(directory)], 0
        for src in items[split]:
            shape, dtype = _x_header(src)
            y = _load_array(src, "y")
            _check_labels(src, shape[0], y)
            first = first or (_where(src, "x")[1], shape[1:], dtype)
            if (shape[1:], dtype) != first[1:]:
                raise StreamError(f"{_where(src, 'x')[1]}: samples are {dtype} of shape {shape[1:]}, but {first[0]} "
                                  f"holds {first[2]} of shape {first[1]}; every shard must hold one dtype and shape")
            counts[split] += len(y)
            if len(y):
                top, distinct = max(top, int(y.max())), distinct | set(np.unique(y).tolist())
        if not counts[split]:
            raise StreamError(f"{directory}: its shards hold no samples")
    if first is None:  # unreachable: every split holds samples (checked above), so some shard set `first`
        raise StreamError(f"{', '.join(map(str, dirs.values()))}: no shard holds samples")
    x_encoding = encodings.ndarray_encoding(np.empty(first[1], first[2]))
    source = Source("arrays", items, counts, x_encoding, {"num_classes": top + 1, "x_shape": list(first[1])})
    if top + 1 > 2 * len(distinct):
        source.notes.append(f"num_classes is {top + 1} (the largest label + 1) but only {len(distinct)} distinct "
                            "labels occur: check for a stray label, or train with --num-classes N")
    return source


def _where(src: ShardSrc, key: str) -> tuple[Path, str]:
    """The file holding array `key` ('x' or 'y') of a shard, and its name for errors."""
    if isinstance(src, tuple):
        return (src[0] if key == "x" else src[1]), str(src[0] if key == "x" else src[1])
    return src, f"{src}['{key}']"


def _x_header(src: ShardSrc) -> tuple[tuple[int, ...], np.dtype]:
    """x's shape and dtype from its .npy header (its data is not read); StreamError when MDS cannot store it."""
    from hvdtrain.train.npyfiles import UNREADABLE, unreadable

    path, name = _where(src, "x")
    try:
        if isinstance(src, tuple):
            with open(path, "rb") as f:
                shape, dtype = _npy_header(f)
        else:
            with _npz(path, "x") as npz, npz.zip.open("x.npy") as f:
                shape, dtype = _npy_header(f)
    except UNREADABLE as e:
        if isinstance(e, StreamError):
            raise
        raise unreadable(name, e) from None
    if len(shape) < 2 or 0 in shape[1:]:
        raise StreamError(f"{name}: samples must be an array of shape (N, ...) with non-empty samples, got shape "
                          f"{shape}")
    if dtype.name not in encodings.DTYPE_CODES:
        raise StreamError(f"{name}: dtype {dtype} cannot be stored in MDS; allowed: "
                          f"{', '.join(encodings.DTYPE_CODES)} (cast it, e.g. x.astype(np.float32))")
    return shape, dtype


def _npy_header(f: Any) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f".npy format version {version} is not read; save with numpy's default format")
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    return tuple(shape), dtype


def _check_labels(src: ShardSrc, samples: int, y: np.ndarray) -> None:
    name = _where(src, "y")[1]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise StreamError(f"{name}: labels must be a 1-D integer array of class ids, got dtype {y.dtype} shape "
                          f"{y.shape} (save them with y.astype(np.int64))")
    if len(y) != samples:
        raise StreamError(f"{_where(src, 'x')[1]} has {samples} samples but {name} has {len(y)} labels")
    if len(y) and (int(y.min()) < 0 or y.max() > np.iinfo(np.int64).max):
        bad = int(np.argmin(y)) if int(y.min()) < 0 else int(np.argmax(y))
        raise StreamError(f"{name}[{bad}]: label {y[bad]} is not a class id 0..K-1 (int64)")


def _npz(path: Path, key: str) -> Any:
    """The open .npz archive `path`, which holds `key`; StreamError otherwise."""
    from hvdtrain.train.npyfiles import np_load

    data = np_load(path)
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise StreamError(f"{path}: a single array, not a .npz archive holding 'x' and 'y'")
    if key not in data.files:
        data.close()
        raise StreamError(f"{path}: no array {key!r} (found {sorted(data.files)}); a .npz shard must hold 'x' "
                          "(samples) and 'y' (integer labels)")
    return data


def _load_array(src: ShardSrc, key: str) -> np.ndarray:
    from hvdtrain.train.npyfiles import UNREADABLE, np_load, unreadable

    path, name = _where(src, key)
    if isinstance(src, tuple):
        data = np_load(path)
        if not isinstance(data, np.ndarray):
            data.close()
            raise StreamError(f"{path}: a .npz archive, not a .npy array")
        return data
    with _npz(path, key) as npz:
        try:
            return npz[key]
        except UNREADABLE as e:
            raise unreadable(name, e) from None


# ---- image folders ----------------------------------------------------------------------------------------

def _scan_images(dirs: dict[str, Path], image_size: tuple[int, int] | None) -> Source:
    classes = sorted({d.name for root in dirs.values() for d in root.iterdir()
                      if d.is_dir() and not d.name.startswith(".")})
    items: dict[str, list[Any]] = {}
    first: tuple[Path, tuple[int, int]] | None = None
    for split, root in dirs.items():
        items[split] = []
        for label, name in enumerate(classes):
            files = sorted(p for p in (root / name).glob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            for path in files:
                size = _image_size(path)
                first = first or (path, size)
                if image_size is None and size != first[1]:
                    raise StreamError(f"{path}: image is {size[0]}x{size[1]} (HxW) but {first[0]} is "
                                      f"{first[1][0]}x{first[1][1]}; pass --image-size HxW to resize every image")
                items[split].append((path, label))
        if not items[split]:
            raise StreamError(f"{root}: no .npz/.npy shards and no images found; expected array shards or "
                              f"class directories of {'/'.join(IMAGE_SUFFIXES)} files ({root}/CLASS/*.png)")
    height, width = image_size or first[1]  # type: ignore[index]
    # x_scale: readers train on x * x_scale (pixels 0..255 -> 0..1); array datasets are trained on as stored.
    meta = {"num_classes": len(classes), "x_shape": [3, height, width], "classes": classes, "x_scale": 1 / 255}
    return Source("images", items, {k: len(v) for k, v in items.items()}, f"ndarray:uint8:3,{height},{width}", meta,
                  image_size)


def _image_size(path: Path) -> tuple[int, int]:
    """(H, W) from the image's header (its pixels are decoded only when written)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.height, image.width
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise StreamError(f"{path}: cannot read as an image ({e})") from None


def _decode_image(path: Path, size: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise StreamError(f"{path}: cannot decode the image ({e})") from None
    if size is not None and (rgb.height, rgb.width) != size:
        rgb = rgb.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return np.asarray(rgb).transpose(2, 0, 1)  # H×W×3 -> 3×H×W
