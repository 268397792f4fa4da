"""`hvdtrain data convert SRC DST`: an array shard directory or an image folder, written as an MDS dataset.

Sources (a split layout when SRC has both `train/` and `val/`; else SRC is the one, training split):
- arrays: `*.npz` files holding `x` (samples, N × ...) and `y` (integer labels, N), and/or `NAME_x.npy` +
  `NAME_y.npy` pairs (hvdtrain/formats/npyshards.py's shard directory). `x` keeps its dtype; one file is in memory at a
  time.
- images: `<class>/**/*.jpg|jpeg|png|...` (class directories directly under SRC or under each split, images at any
  depth below them, as torchvision's ImageFolder finds them; hvdtrain/stream/imagefolder.py). Every image is
  decoded once before anything is written; every bad one is listed (or left out and counted: `skip_bad`). Classes
  are numbered by their sorted directory names (over every split); images are decoded to RGB, resized to
  `image_size` (H, W)
  when given (else all must have one size), and stored channels first (uint8 3 × H × W); with `encoded`
  (`--encoded`) the JPEG/PNG files are stored as they are (a `jpeg` column, `png` if all are PNG), of any sizes,
  decoded and augmented per batch by the readers (hvdtrain/stream/images.py).

DST gets `train/` and `val/` (Mosaic's layout; `val/` only if SRC has one or `val_fraction` > 0, which holds out
evenly spaced samples of an unsplit SRC: sample i is val when floor((i+1)·f) > floor(i·f)). Columns: `x`
(`ndarray:DTYPE:SHAPE`) and `y` (`int64`); hvdtrain's metadata (num_classes, x_shape, source, classes) goes in each
index's "hvdtrain" key. The whole source is checked before anything is written; the output is deterministic (same
input and seed, same bytes), and a failed conversion removes what it wrote.

Order: each split's samples are written in a seeded uniform shuffle (`shuffle`, `seed`), because sources usually
arrive sorted by class (image folders, per-class files) and a reader mixes samples only within its shuffle window
(hvdtrain/stream/order.py): a class-sorted dataset trains at chance. Which samples are held out for val/ is decided
in the source's order first (evenly spaced: every class is represented). Images are shuffled as a list of files;
array samples, which may not fit in memory, go through temporary buckets in DST (each sample to a random bucket of
at most `SHUFFLE_BUCKET_BYTES`, then each bucket permuted in memory: a uniform permutation, one bucket in memory at
a time). `shuffle=False` (`--keep-order`) writes the source's order.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.settings.parse import parse_bytes
from hvdtrain.stream import sources
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.mds import INDEX, MDSWriter

DEFAULT_SHARD_BYTES = 64 << 20
MAX_SHARD_BYTES = (1 << 32) - 1  # MDS's offsets are 32-bit
SPLITS = ("train", "val")
SHUFFLE_BUCKET_BYTES = 256 << 20  # array samples held in memory at once while shuffling
SHUFFLE_DIR = ".convert-shuffle"  # the buckets' directory inside DST, removed when the conversion ends


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
        from hvdtrain.stream.splits import human_bytes

        lines = [f"wrote {self.dst}: {self.kind}, {self.num_classes} classes, x {self.x_encoding}, y int64, "
                 f"compression {self.compression or 'none'}"]
        lines += [f"  {s.name}: {s.samples} samples in {s.shards} shard{'s' * (s.shards != 1)}, "
                  f"{human_bytes(s.stored_bytes)}" for s in self.splits]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


# ---- option parsing (shared with the CLI) -------------------------------------------------------------------

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
            image_size: tuple[int, int] | None = None, val_fraction: float = 0.0, progress: bool = True,
            shuffle: bool = True, seed: int = 0, encoded: bool = False, skip_bad: bool = False) -> Summary:
    """Write `src` (see the module docstring) as an MDS dataset root in `dst`, which must not exist or be empty;
    each split in a uniform shuffle drawn from `seed` unless `shuffle` is False; `skip_bad`: images that do not
    decode are left out and counted (else every one is listed in the error). A DataError (StreamError,
    DatasetError) naming the file and what is wrong for bad input, raised before anything is written where possible."""
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
    source = sources.scan(dirs, image_size, encoded, skip_bad, progress)
    source.meta["source"] = str(src.resolve())
    source.meta["order"] = f"shuffled (seed {seed})" if shuffle else "source order"
    outputs = ["train", "val"] if val_fraction else list(dirs)
    if val_fraction:
        n = source.counts["train"]
        if int(n * val_fraction) < 1:
            raise StreamError(f"{src}: {n} samples are too few to hold out {val_fraction:g} for validation")
    created = not dst.exists()
    try:
        splits = _write(source, dst, outputs, val_fraction, progress,
                        dict(compression=compression, size_limit=shard_bytes), seed if shuffle else None)
    except BaseException:
        _remove_output(dst, [*outputs, SHUFFLE_DIR], created)
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


def _write(source: sources.Source, dst: Path, outputs: list[str], val_fraction: float, progress: bool,
           options: dict[str, Any], seed: int | None) -> tuple[SplitSummary, ...]:
    """Every sample into its split's writer (held-out ones into val), in a shuffle drawn from `seed` (None: the
    source's order), then each index.json last."""
    from tqdm import tqdm

    columns = {"x": source.x_encoding, "y": "int64"}
    writers = {name: MDSWriter(dst / name, columns, meta=source.meta, **options) for name in outputs}
    counts = dict.fromkeys(outputs, 0)
    passes = 2 if seed is not None and source.kind == "arrays" else 1  # arrays are read once into the buckets
    with tqdm(total=passes * sum(source.counts.values()), desc=f"writing {dst}", unit="sample", file=sys.stderr,
              disable=None if progress else True) as bar:  # None: only on a terminal
        if seed is None:
            samples = _in_order(source, val_fraction, bar)
        elif source.kind == "images":
            samples = _shuffled_images(source, outputs, val_fraction, seed, bar)
        else:
            samples = _shuffled_arrays(source, outputs, val_fraction, seed, dst / SHUFFLE_DIR, bar)
        for name, x, y in samples:
            writers[name].write({"x": x, "y": y})
            counts[name] += 1
    for writer in writers.values():
        writer.finish()
    return tuple(SplitSummary(name, counts[name], len(w.shards),
                              sum((s["zip_data"] or s["raw_data"])["bytes"] for s in w.shards))
                 for name, w in writers.items())


def _output(split: str, i: int, val_fraction: float) -> str:
    """The split sample `i` of source split `split` goes to: val when held out (evenly spaced), else `split`."""
    held = bool(val_fraction) and int((i + 1) * val_fraction) > int(i * val_fraction)
    return "val" if held else split


def _rng(seed: int, output: str) -> np.random.Generator:
    return np.random.default_rng([seed, 0xC0417, SPLITS.index(output)])


def _in_order(source: sources.Source, val_fraction: float, bar: Any) -> Iterator[tuple[str, np.ndarray | bytes, int]]:
    for split, items in source.items.items():
        for i, (x, y) in enumerate(sources.samples(source, items, bar)):
            yield _output(split, i, val_fraction), x, y


def _shuffled_images(source: sources.Source, outputs: list[str], val_fraction: float, seed: int,
                     bar: Any) -> Iterator[tuple[str, np.ndarray | bytes, int]]:
    """Each output split's images in a uniform shuffle (a list of files: nothing decoded is held)."""
    files: dict[str, list[Any]] = {name: [] for name in outputs}
    for split, items in source.items.items():
        for i, item in enumerate(items):
            files[_output(split, i, val_fraction)].append(item)
    for name in outputs:
        perm = _rng(seed, name).permutation(len(files[name]))
        for x, y in sources.samples(source, [files[name][j] for j in perm], bar):
            yield name, x, y


def _shuffled_arrays(source: sources.Source, outputs: list[str], val_fraction: float, seed: int, tmp: Path,
                     bar: Any) -> Iterator[tuple[str, np.ndarray | bytes, int]]:
    """Each output split's array samples in a uniform shuffle, one source file and one bucket in memory at a time:
    every sample goes to a random bucket file in `tmp`, then each bucket is read back and permuted (the module
    docstring). `tmp` is removed when done (and by `convert` on failure)."""
    shape = tuple(source.meta["x_shape"])
    totals = dict.fromkeys(outputs, 0)
    for split in source.items:
        for i in range(source.counts[split]):
            totals[_output(split, i, val_fraction)] += 1
    rngs = {name: _rng(seed, name) for name in outputs}
    tmp.mkdir()
    try:
        dtype = _bucket(tmp, source, outputs, totals, rngs, val_fraction, bar)
        for name in outputs:
            for b in range(_buckets(totals[name], shape, dtype)):
                x = np.fromfile(tmp / f"{name}-{b}.x", dtype=dtype).reshape(-1, *shape)
                y = np.fromfile(tmp / f"{name}-{b}.y", dtype=np.int64)
                for j in rngs[name].permutation(len(y)):
                    yield name, x[j], int(y[j])
                    bar.update(1)
                (tmp / f"{name}-{b}.x").unlink()
                (tmp / f"{name}-{b}.y").unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _buckets(samples: int, shape: tuple[int, ...], dtype: np.dtype) -> int:
    return max(1, -(-samples * int(np.prod(shape)) * dtype.itemsize // SHUFFLE_BUCKET_BYTES))


def _bucket(tmp: Path, source: sources.Source, outputs: list[str], totals: dict[str, int],
            rngs: dict[str, np.random.Generator], val_fraction: float, bar: Any) -> np.dtype:
    """Append every source sample to a random bucket of its output split; returns x's dtype."""
    shape = tuple(source.meta["x_shape"])
    dtype: np.dtype | None = None
    for split, items in source.items.items():
        first = 0
        for src in items:
            x, y = sources.load_array(src, "x"), sources.load_array(src, "y").astype(np.int64)
            x = x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))
            dtype = x.dtype
            i = np.arange(first, first + len(y), dtype=np.float64)
            held = (np.floor((i + 1) * val_fraction) > np.floor(i * val_fraction)) if val_fraction else i < 0
            where = np.where(held, "val", split)
            first += len(y)
            for name in outputs:
                rows = np.flatnonzero(where == name)
                buckets = rngs[name].integers(_buckets(totals[name], shape, x.dtype), size=len(rows))
                for b in np.unique(buckets):
                    pick = rows[buckets == b]
                    with open(tmp / f"{name}-{b}.x", "ab") as fx, open(tmp / f"{name}-{b}.y", "ab") as fy:
                        np.ascontiguousarray(x[pick]).tofile(fx)
                        y[pick].tofile(fy)
            bar.update(len(y))
    if dtype is None:  # unreachable: _scan_arrays refuses a split without samples
        raise StreamError("no array samples to convert")
    return dtype
