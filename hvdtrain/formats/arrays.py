"""In-memory datasets and train/val splits, the bundled ones, and the checks every format shares.

- `digits`: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), a fixed train/val split.
- `synthetic`: random float32 samples of a chosen shape with random labels: the throughput ceiling.
- `check_labels`, `LabelStats`, `check_samples`, `split_indices`: used by every format (npy shards, MDS).
Nothing is ever downloaded.
"""


from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from hvdtrain.data.errors import DataError

DIGITS = "digits"
SYNTHETIC = "synthetic"


class DatasetError(DataError):
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


class Split(Protocol):
    """What a train or val split is used for, whatever its format: ArrayDataset (in memory), NpyShardSplit
    (memory-mapped npy shards), StreamSplit (a streamed MDS dataset)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]: ...

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A whole batch of samples and labels."""
        ...

    @property
    def sample_shape(self) -> tuple[int, ...]: ...

    @property
    def order(self) -> Callable[[int, int], np.ndarray] | None:
        """`order(seed, epoch) -> permutation` for the sampler, or None for its uniform shuffle."""
        ...


def take(ds: Split, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ds.take(indices)`: a ShmLoader's `fetch` for an in-memory or a streamed split."""
    return ds.take(indices)


@dataclass(frozen=True)
class Splits:
    train: Split
    val: Split
    num_classes: int
    name: str

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.train.sample_shape


def digits(*, val_fraction: float = 0.2, split_seed: int = 0, num_classes: int | None = None) -> Splits:
    images, target = _digits_file()
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]  # N × 1 × 8 × 8 in [0, 1]
    y = target.astype(np.int64)
    if num_classes is not None:
        check_labels(y, "digits labels", num_classes)
    train, val = _split(x, y, val_fraction, split_seed)
    return Splits(train=train, val=val, num_classes=num_classes or 10, name=DIGITS)


def _digits_file() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (images N × 8 × 8, targets N), read from its file as `load_digits` reads it,
    without importing scikit-learn (~2 s of a quickstart rank's start); `load_digits()` itself where the file is
    not where scikit-learn keeps it."""
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((p for p in (Path(r) / "datasets" / "data" / "digits.csv.gz" for r in roots) if p.is_file()), None)
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


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


class LabelStats:
    """Labels seen one shard at a time, for `num_classes`: the largest label (the first shard holding it, its index
    there) and the distinct labels."""

    def __init__(self) -> None:
        self.top: tuple[int, int, str] | None = None  # (label, index in its shard, the shard's name)
        self.distinct = np.empty(0, np.int64)

    def add(self, y: np.ndarray, name: str) -> None:
        if not len(y):
            return
        at = int(np.argmax(y))
        if self.top is None or int(y[at]) > self.top[0]:
            self.top = (int(y[at]), at, name)
        self.distinct = np.union1d(self.distinct, np.unique(y).astype(np.int64))

    def num_classes(self, dataset: str) -> int:
        """The largest label + 1 (at least 2), unless most class ids below it never occur: then a stray label (one
        1 000 000 among 0..9) would silently build a 1 000 001-class model, so it is an error naming that label. A
        stray label close to the real ones (20 among 0..9) passes: only a declared --num-classes checks every
        label."""
        if self.top is None:
            raise DatasetError(f"{dataset}: no labels in any shard")
        top, at, name = self.top
        distinct = len(self.distinct)
        if top + 1 > 2 * distinct:
            raise DatasetError(
                f"{name}[{at}]: label {top} would make a {top + 1}-class model, but only {distinct} distinct labels "
                f"occur in {dataset}; fix the label, or if the classes are right declare their number with "
                f"--num-classes N (every label must be < N)")
        return max(top + 1, 2)


FINITE_BLOCK_VALUES = 1 << 24  # values per block of the NaN/Inf scan: 16 MiB of booleans at most


def check_samples(x: np.ndarray, name: str, file_dtype: np.dtype | None = None,
                  rows: np.ndarray | None = None) -> None:
    """No NaN/Inf in floating-point samples (x as trained on: float32, where a float64 1e39 is inf); scans blocks of
    FINITE_BLOCK_VALUES values (little extra memory). `file_dtype`: the dtype x had in the file, if different;
    `rows`: each sample's index in `name` (x is a batch read from it), for the error."""
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
        shown = index if rows is None else int(rows[index])
        raise DatasetError(f"{name}[{shown}]: sample holds {value} at position {inner}{cast}; fix the data, or "
                           f"pass --no-check-finite to train on it anyway")


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed split of n samples: a permutation from `seed` (not the training seed); the last `val_fraction` is val.
    Returns the (sorted) train and val indices."""
    if not 0 < val_fraction < 1:
        raise DatasetError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise DatasetError(f"only {n} samples: too few to hold out {val_fraction:.0%} for validation")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[:-n_val]), np.sort(order[-n_val:])


def _split(x: np.ndarray, y: np.ndarray, val_fraction: float, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    tr, va = split_indices(len(y), val_fraction, seed)
    return ArrayDataset(np.ascontiguousarray(x[tr], dtype=np.float32), y[tr]), \
        ArrayDataset(np.ascontiguousarray(x[va], dtype=np.float32), y[va])
