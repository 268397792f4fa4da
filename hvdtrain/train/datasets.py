"""Datasets for the recipes, as in-memory numpy arrays: nothing is ever downloaded.

- `digits`: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), a fixed train/val split.
- `synthetic`: random float32 samples of a chosen shape with random labels: the throughput ceiling.
- an MDS dataset root (`train/` and `val/`, each with index.json and shards, as `hvdtrain data convert` or
  mosaicml-streaming write them): streamed, never loaded whole (hvdtrain/train/streamed.py).
- a directory of shards: `*.npz` files holding arrays `x` (samples) and `y` (integer labels), and/or pairs of
  `NAME_x.npy` + `NAME_y.npy`. With `train/` and `val/` subdirectories those are the split; otherwise the
  shards are concatenated and split like digits. Every shard is checked; a bad one is named in the error.
"""

from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hvdtrain.stream.errors import StreamError

DIGITS = "digits"
SYNTHETIC = "synthetic"


class DatasetError(StreamError):
    """A dataset argument or file is not usable; the message names the file and what was expected."""


@dataclass(frozen=True)
class ArrayDataset:
    """Samples `x` (float32, N × sample_shape) and labels `y` (int64, N); indexable like a torch Dataset."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[index], self.y[index]

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A whole batch at once (fancy indexing: one copy, no per-sample Python loop)."""
        return self.x[indices], self.y[indices]

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def order(self) -> None:
        """The sampler's uniform shuffle (a streamed split has shuffle blocks instead)."""
        return None


def take(ds: ArrayDataset, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ds.take(indices)`: a ShmLoader's `fetch` for an in-memory or a streamed split."""
    return ds.take(indices)


@dataclass(frozen=True)
class Splits:
    train: ArrayDataset
    val: ArrayDataset
    num_classes: int
    name: str

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.train.sample_shape


def load(
    source: str, *, val_fraction: float = 0.2, split_seed: int = 0,
    synthetic_shape: tuple[int, ...] = (3, 32, 32), synthetic_samples: int = 1024,
    num_classes: int | None = None, seed: int = 0, check_finite: bool = True,
    x_field: str = "x", y_field: str = "y", shuffle_block: int = 4, cache_limit: int | None = None,
) -> Splits:
    """`source` is "digits", "synthetic" or a directory of .npy/.npz shards.

    `num_classes` declares the number of classes (labels must be below it); None: 10 for digits and synthetic,
    inferred from the labels of a shard directory (see `infer_num_classes`). `check_finite`: samples holding
    NaN/Inf are an error naming the shard and the sample.
    """
    if num_classes is not None and num_classes < 2:
        raise DatasetError(f"--num-classes must be >= 2, got {num_classes!r}")
    if source == DIGITS:
        return digits(val_fraction=val_fraction, split_seed=split_seed, num_classes=num_classes)
    if source == SYNTHETIC:
        return synthetic(synthetic_shape, synthetic_samples, num_classes=num_classes or 10, seed=seed)
    from hvdtrain.stream import StreamError, store
    from hvdtrain.train import streamed

    stream_args = dict(num_classes=num_classes, x_field=x_field, y_field=y_field, check_finite=check_finite,
                       block_shards=shuffle_block, cache_limit=cache_limit)
    try:
        remote = store.is_url(source)
    except StreamError as e:
        raise DatasetError(str(e)) from None
    if remote:
        return streamed.load_splits(source, **stream_args)  # type: ignore[arg-type]
    path = Path(source)
    if not path.is_dir():
        raise DatasetError(f"dataset must be {DIGITS!r}, {SYNTHETIC!r}, an MDS dataset root (a directory or an "
                           f"s3://, gs://, http(s):// URL) or a directory of .npy/.npz shards; got {source!r}, which "
                           "is not a directory")
    if streamed.is_mds_root(path):
        return streamed.load_splits(path, **stream_args)  # type: ignore[arg-type]
    return shard_dir(path, val_fraction=val_fraction, split_seed=split_seed, num_classes=num_classes,
                     check_finite=check_finite)


def digits(*, val_fraction: float = 0.2, split_seed: int = 0, num_classes: int | None = None) -> Splits:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]  # N × 1 × 8 × 8 in [0, 1]
    y = bunch.target.astype(np.int64)
    if num_classes is not None:
        check_labels(y, "digits labels", num_classes)
    train, val = _split(x, y, val_fraction, split_seed)
    return Splits(train=train, val=val, num_classes=num_classes or 10, name=DIGITS)


def synthetic(shape: tuple[int, ...], num_samples: int, *, num_classes: int = 10, seed: int = 0) -> Splits:
    if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
        raise DatasetError(f"synthetic_shape must be positive ints, e.g. 3,32,32; got {shape!r}")
    if num_samples < 1:
        raise DatasetError(f"synthetic_samples must be >= 1, got {num_samples!r}")
    if num_classes < 2:
        raise DatasetError(f"num_classes must be >= 2, got {num_classes!r}")
    rng = np.random.default_rng(seed)
    n_val = max(1, num_samples // 8)

    def make(n: int) -> ArrayDataset:
        return ArrayDataset(rng.standard_normal((n, *shape), dtype=np.float32),
                            rng.integers(0, num_classes, size=n, dtype=np.int64))

    return Splits(train=make(num_samples), val=make(n_val), num_classes=num_classes, name=SYNTHETIC)


# ---- shard directories ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    """One file's (or .npy pair's) samples (as float32) and labels, with the names its errors use."""

    x: np.ndarray
    y: np.ndarray
    x_name: str  # e.g. "/data/a.npz['x']" or "/data/a_x.npy"
    y_name: str
    x_dtype: np.dtype  # the dtype in the file (x is float32)


def shard_dir(path: Path, *, val_fraction: float = 0.2, split_seed: int = 0, num_classes: int | None = None,
              check_finite: bool = True) -> Splits:
    train_dir, val_dir = path / "train", path / "val"
    split_dirs = train_dir.is_dir() and val_dir.is_dir()
    merged: list[ArrayDataset] = []
    labels: list[tuple[np.ndarray, str]] = []  # every shard's labels, for the inference across all of them
    for directory in (train_dir, val_dir) if split_dirs else (path,):
        shards = _read_shards(directory)
        for shard in shards:  # once, at load: vectorised passes over each shard
            check_labels(shard.y, shard.y_name, num_classes)
            if check_finite:
                check_samples(shard.x, shard.x_name, shard.x_dtype)
        labels += [(shard.y, shard.y_name) for shard in shards]
        merged.append(_concat(shards))  # the shards' samples are freed here: peak 2x the split's samples
        del shards
    classes = num_classes if num_classes is not None else infer_num_classes(labels, str(path))
    if split_dirs:
        train, val = merged
        if train.x.shape[1:] != val.x.shape[1:]:
            raise DatasetError(f"{val_dir}: samples have shape {val.x.shape[1:]}, but {train_dir} has "
                               f"{train.x.shape[1:]}")
    else:
        whole = merged.pop()
        train, val = _split(whole.x, whole.y, val_fraction, split_seed)
    return Splits(train=train, val=val, num_classes=classes, name=str(path))


def check_labels(y: np.ndarray, name: str, num_classes: int | None) -> None:
    """Labels are class ids 0..num_classes-1 (only >= 0 when num_classes is None); the first bad one is named."""
    if not len(y):
        return
    lo = int(np.argmin(y))
    if y[lo] < 0:
        raise DatasetError(f"{name}[{lo}]: label {int(y[lo])} is negative; labels are class ids 0..K-1")
    hi = int(np.argmax(y))
    if num_classes is not None and y[hi] >= num_classes:
        raise DatasetError(f"{name}[{hi}]: label {int(y[hi])} is out of range for --num-classes {num_classes} "
                           f"(labels must be 0..{num_classes - 1}); fix the label or declare more classes")


def infer_num_classes(labels: list[tuple[np.ndarray, str]], dataset: str) -> int:
    """The largest label + 1 (at least 2), unless most class ids below it never occur: then a stray label (one
    1 000 000 among 0..9) would silently build a 1 000 001-class model, so it is an error naming that label. A
    stray label close to the real ones (20 among 0..9) passes: only a declared --num-classes checks every label.
    `labels`: (labels, name for errors) of every shard."""
    tops = [(int(y.max()), y, name) for y, name in labels if len(y)]
    if not tops:
        raise DatasetError(f"{dataset}: no labels in any shard")
    top, y, name = max(tops, key=lambda item: item[0])
    distinct = len(np.unique(np.concatenate([y for y, _ in labels])))
    if top + 1 > 2 * distinct:
        raise DatasetError(
            f"{name}[{int(np.argmax(y))}]: label {top} would make a {top + 1}-class model, but only {distinct} "
            f"distinct labels occur in {dataset}; fix the label, or if the classes are right declare their number "
            f"with --num-classes N (every label must be < N)")
    return max(top + 1, 2)


FINITE_BLOCK_VALUES = 1 << 24  # values per block of the NaN/Inf scan: 16 MiB of booleans at most


def check_samples(x: np.ndarray, name: str, file_dtype: np.dtype | None = None) -> None:
    """No NaN/Inf in floating-point samples (x as trained on: float32, where a float64 1e39 is inf); scans blocks of
    FINITE_BLOCK_VALUES values (little extra memory). `file_dtype`: the dtype x had in the file, if different."""
    if not np.issubdtype(x.dtype, np.inexact) or not len(x):
        return
    block = max(1, FINITE_BLOCK_VALUES // max(1, int(np.prod(x.shape[1:], dtype=np.int64))))
    for start in range(0, len(x), block):
        finite = np.isfinite(x[start:start + block])
        if finite.all():
            continue
        where = np.argwhere(~finite)[0]
        index, inner = start + int(where[0]), tuple(int(i) for i in where[1:])
        value = x[index][inner]
        cast = ""
        if file_dtype is not None and file_dtype != x.dtype and np.isinf(value):
            cast = f" (as float32; the file holds {file_dtype}: a value beyond float32's range is inf)"
        raise DatasetError(f"{name}[{index}]: sample holds {value} at position {inner}{cast}; fix the data, or "
                           f"pass --no-check-finite to train on it anyway")


def _concat(shards: list[Shard]) -> ArrayDataset:
    return ArrayDataset(np.concatenate([s.x for s in shards]), np.concatenate([s.y for s in shards]))


def _read_shards(directory: Path) -> list[Shard]:
    pairs = _shard_files(directory)
    shards: list[Shard] = []
    for label, src in pairs:
        shard = _load_shard(src)
        if shards and shard.x.shape[1:] != shards[0].x.shape[1:]:
            raise DatasetError(f"{label}: samples have shape {shard.x.shape[1:]}, but {pairs[0][0]} has "
                               f"{shards[0].x.shape[1:]}; every shard must hold samples of one shape")
        shards.append(shard)
    return shards


def _shard_files(directory: Path) -> list[tuple[str, Path | tuple[Path, Path]]]:
    """[(name for errors, .npz path or (x.npy, y.npy))], sorted by name; errors for unpaired .npy files."""
    found: list[tuple[str, Path | tuple[Path, Path]]] = []
    for p in sorted(directory.glob("*.npz")):
        found.append((str(p), p))
    for p in sorted(directory.glob("*.npy")):
        if p.name.endswith("_y.npy"):
            if not p.with_name(p.name[: -len("_y.npy")] + "_x.npy").exists():
                raise DatasetError(f"{p}: labels file without its samples file "
                                   f"{p.name[: -len('_y.npy')]}_x.npy")
            continue
        if not p.name.endswith("_x.npy"):
            raise DatasetError(f"{p}: .npy shards must be named NAME_x.npy (samples) with NAME_y.npy "
                               f"(labels); or use .npz files with arrays 'x' and 'y'")
        y_path = p.with_name(p.name[: -len("_x.npy")] + "_y.npy")
        if not y_path.exists():
            raise DatasetError(f"{p}: missing its labels file {y_path.name}")
        found.append((str(p), (p, y_path)))
    if not found:
        raise DatasetError(f"{directory}: no .npz or NAME_x.npy/NAME_y.npy shards found")
    return sorted(found, key=lambda item: item[0])


# What numpy and zipfile raise for a file that is not (intact) numpy data: a truncated or corrupt .npy header,
# a bad zip, a bad CRC-32, a corrupt deflate stream, object arrays (which would need pickle).
UNREADABLE = (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError)


def _unreadable(name: str, e: BaseException) -> DatasetError:
    reason = str(e) or type(e).__name__
    if isinstance(e, zipfile.BadZipFile | zlib.error):
        reason = f"corrupt or truncated .npz archive ({reason})"
    elif "Object arrays cannot be loaded" in reason:
        reason = "it holds Python objects (dtype=object), which would need pickle; save numeric arrays"
    elif "pickled" in reason:  # numpy found no .npy/.npz magic and took the file for a pickle
        reason = "not a .npy/.npz file (no numpy header: another format, a damaged start, or a pickle)"
    return DatasetError(f"{name}: cannot read as numpy data: {reason}")


def _load_shard(src: Path | tuple[Path, Path]) -> Shard:
    if isinstance(src, tuple):
        x, y = _np_load(src[0]), _np_load(src[1])
        return _check_arrays(x, y, str(src[0]), str(src[1]))
    npz = _np_load(src)
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DatasetError(f"{src}: not a .npz archive (it holds a single array); a .npz shard must hold "
                           f"'x' (samples) and 'y' (integer labels)")
    with npz:
        missing = [k for k in ("x", "y") if k not in npz.files]
        if missing:
            raise DatasetError(f"{src}: missing array(s) {', '.join(missing)}; found {sorted(npz.files)}; "
                               f"a .npz shard must hold 'x' (samples) and 'y' (integer labels)")
        arrays = {}
        for key in ("x", "y"):  # members are read (decompressed, CRC-checked) only here
            try:
                arrays[key] = npz[key]
            except UNREADABLE as e:
                raise _unreadable(f"{src}['{key}']", e) from None
        return _check_arrays(arrays["x"], arrays["y"], f"{src}['x']", f"{src}['y']")


def _np_load(path: Path) -> np.ndarray | np.lib.npyio.NpzFile:
    try:
        return np.load(path, allow_pickle=False)
    except UNREADABLE as e:
        raise _unreadable(str(path), e) from None


def _check_arrays(x: object, y: object, x_name: str, y_name: str) -> Shard:
    if not isinstance(x, np.ndarray):
        raise DatasetError(f"{x_name}: expected a single numpy array, got {type(x).__name__}")
    if not isinstance(y, np.ndarray):
        raise DatasetError(f"{y_name}: expected a single numpy array, got {type(y).__name__}")
    if x.ndim < 2 or not np.issubdtype(x.dtype, np.number):
        raise DatasetError(f"{x_name}: samples must be a numeric array of shape (N, ...), "
                           f"got dtype {x.dtype} shape {x.shape}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        hint = ""
        if y.ndim == 1 and np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) \
                and np.array_equal(y, np.round(y)):
            hint = " (these floats are whole numbers: save them with y.astype(np.int64))"
        raise DatasetError(f"{y_name}: labels must be a 1-D integer array of class ids, "
                           f"got dtype {y.dtype} shape {y.shape}{hint}")
    if len(x) != len(y):
        raise DatasetError(f"{x_name} has {len(x)} samples but {y_name} has {len(y)} labels")
    if y.dtype == np.uint64 and len(y) and y.max() > np.uint64(np.iinfo(np.int64).max):
        raise DatasetError(f"{y_name}[{int(np.argmax(y))}]: label {int(y.max())} does not fit in int64")
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf: check_samples names it
        x32 = x.astype(np.float32, copy=False)
    return Shard(x32, y.astype(np.int64, copy=False), x_name, y_name, x.dtype)


def _split(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    """Fixed split: a permutation from `seed` (not the training seed); the last `val_fraction` is val."""
    if not 0 < val_fraction < 1:
        raise DatasetError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_val = max(1, round(len(y) * val_fraction))
    if n_val >= len(y):
        raise DatasetError(f"only {len(y)} samples: too few to hold out {val_fraction:.0%} for validation")
    order = np.random.default_rng(seed).permutation(len(y))
    tr, va = np.sort(order[:-n_val]), np.sort(order[-n_val:])
    return ArrayDataset(np.ascontiguousarray(x[tr], dtype=np.float32), y[tr]), \
        ArrayDataset(np.ascontiguousarray(x[va], dtype=np.float32), y[va])
