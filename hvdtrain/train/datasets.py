"""Datasets for the recipes, as in-memory numpy arrays: nothing is ever downloaded.

- `digits`: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), a fixed train/val split.
- `synthetic`: random float32 samples of a chosen shape with random labels: the throughput ceiling.
- a directory of shards: `*.npz` files holding arrays `x` (samples) and `y` (integer labels), and/or pairs of
  `NAME_x.npy` + `NAME_y.npy`. With `train/` and `val/` subdirectories those are the split; otherwise the
  shards are concatenated and split like digits. Every shard is checked; a bad one is named in the error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np

DIGITS = "digits"
SYNTHETIC = "synthetic"


class DatasetError(ValueError):
    """A dataset argument or file is not usable; the message names the file and what was expected."""


def exit_with(main: Callable[[], int], script: str) -> NoReturn:
    """A recipe's entry point: exit with main()'s code; a bad --dataset, or a run directory another job holds,
    exits 2 with its message, no traceback (every rank fails the same way, before any training)."""
    from hvdtrain.train.rundir import RunDirBusy

    try:
        code = main()
    except (DatasetError, RunDirBusy) as e:
        print(f"{Path(script).name}: error: {e}", file=sys.stderr, flush=True)
        code = 2
    sys.exit(code)


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


@dataclass(frozen=True)
class Splits:
    train: ArrayDataset
    val: ArrayDataset
    num_classes: int
    name: str

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])


def load(
    source: str, *, val_fraction: float = 0.2, split_seed: int = 0,
    synthetic_shape: tuple[int, ...] = (3, 32, 32), synthetic_samples: int = 1024,
    num_classes: int = 10, seed: int = 0,
) -> Splits:
    """`source` is "digits", "synthetic" or a directory of .npy/.npz shards."""
    if source == DIGITS:
        return digits(val_fraction=val_fraction, split_seed=split_seed)
    if source == SYNTHETIC:
        return synthetic(synthetic_shape, synthetic_samples, num_classes=num_classes, seed=seed)
    path = Path(source)
    if not path.is_dir():
        raise DatasetError(f"dataset must be {DIGITS!r}, {SYNTHETIC!r} or a directory of .npy/.npz shards; "
                           f"got {source!r}, which is not a directory")
    return shard_dir(path, val_fraction=val_fraction, split_seed=split_seed)


def digits(*, val_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]  # N × 1 × 8 × 8 in [0, 1]
    y = bunch.target.astype(np.int64)
    train, val = _split(x, y, val_fraction, split_seed)
    return Splits(train=train, val=val, num_classes=10, name=DIGITS)


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


def shard_dir(path: Path, *, val_fraction: float = 0.2, split_seed: int = 0) -> Splits:
    train_dir, val_dir = path / "train", path / "val"
    if train_dir.is_dir() and val_dir.is_dir():
        train, val = _read_shards(train_dir), _read_shards(val_dir)
        if train.x.shape[1:] != val.x.shape[1:]:
            raise DatasetError(f"{val_dir}: samples have shape {val.x.shape[1:]}, but {train_dir} has "
                               f"{train.x.shape[1:]}")
    else:
        whole = _read_shards(path)
        train, val = _split(whole.x, whole.y, val_fraction, split_seed)
    num_classes = int(max(train.y.max(initial=0), val.y.max(initial=0))) + 1
    return Splits(train=train, val=val, num_classes=max(num_classes, 2), name=str(path))


def _read_shards(directory: Path) -> ArrayDataset:
    pairs = _shard_files(directory)
    xs, ys = [], []
    for label, (x, y) in ((name, _load_pair(src)) for name, src in pairs):
        if xs and x.shape[1:] != xs[0].shape[1:]:
            raise DatasetError(f"{label}: samples have shape {x.shape[1:]}, but {pairs[0][0]} has "
                               f"{xs[0].shape[1:]}; every shard must hold samples of one shape")
        xs.append(x)
        ys.append(y)
    return ArrayDataset(np.concatenate(xs).astype(np.float32, copy=False), np.concatenate(ys))


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


def _load_pair(src: Path | tuple[Path, Path]) -> tuple[np.ndarray, np.ndarray]:
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
        return _check_arrays(npz["x"], npz["y"], f"{src}['x']", f"{src}['y']")


def _np_load(path: Path) -> np.ndarray | np.lib.npyio.NpzFile:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DatasetError(f"{path}: cannot read as numpy data: {e}") from None


def _check_arrays(x: object, y: object, x_name: str, y_name: str) -> tuple[np.ndarray, np.ndarray]:
    for arr, name in ((x, x_name), (y, y_name)):
        if not isinstance(arr, np.ndarray):
            raise DatasetError(f"{name}: expected a single numpy array, got {type(arr).__name__}")
    assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
    if x.ndim < 2 or not np.issubdtype(x.dtype, np.number):
        raise DatasetError(f"{x_name}: samples must be a numeric array of shape (N, ...), "
                           f"got dtype {x.dtype} shape {x.shape}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"{y_name}: labels must be a 1-D integer array, "
                           f"got dtype {y.dtype} shape {y.shape}")
    if len(x) != len(y):
        raise DatasetError(f"{x_name} has {len(x)} samples but {y_name} has {len(y)} labels")
    if len(y) and y.min() < 0:
        raise DatasetError(f"{y_name}: labels must be >= 0, found {int(y.min())}")
    return x, y.astype(np.int64, copy=False)


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
