"""Datasets for the recipes: nothing is ever downloaded.

- `digits`: scikit-learn's bundled handwritten digits (1797 8x8 images, 10 classes), a fixed train/val split.
- `synthetic`: random float32 samples of a chosen shape with random labels: the throughput ceiling.
- an MDS dataset root (`train/` and `val/`, each with index.json and shards, as `hvdtrain data convert` or
  mosaicml-streaming write them): streamed, never loaded whole (hvdtrain/train/streamed.py).
- a directory of shards: `*.npz` files holding arrays `x` (samples) and `y` (integer labels), and/or pairs of
  `NAME_x.npy` + `NAME_y.npy`. With `train/` and `val/` subdirectories those are the split; otherwise the
  shards are concatenated and split like digits. Memory-mapped and read per batch, never loaded whole
  (hvdtrain/formats/npyshards.py); a bad shard is named in the error.
"""

from __future__ import annotations

import functools
from pathlib import Path

from hvdtrain.data.errors import DataError
from hvdtrain.formats import npyshards
from hvdtrain.formats.arrays import DIGITS, SYNTHETIC, DatasetError, Splits, digits, synthetic
from hvdtrain.settings.recipes import RecipeConfig


def load_splits(cfg: RecipeConfig) -> Splits:
    """A recipe's --dataset as train/val splits, read with its data flags (`load`, checked)."""
    return load(cfg.dataset, val_fraction=cfg.val_fraction, split_seed=0, synthetic_shape=cfg.synthetic_shape,
                synthetic_samples=cfg.synthetic_samples, num_classes=cfg.num_classes, seed=cfg.seed,
                check_finite=cfg.check_finite, x_field=cfg.x_field, y_field=cfg.y_field,
                shuffle_block=cfg.shuffle_block_shards, cache_limit=cfg.cache_limit_bytes,
                image_size=cfg.image_size, augment=cfg.augment)


def load(
    source: str, *, val_fraction: float = 0.2, split_seed: int = 0,
    synthetic_shape: tuple[int, ...] = (3, 32, 32), synthetic_samples: int = 1024,
    num_classes: int | None = None, seed: int = 0, check_finite: bool = True,
    x_field: str = "x", y_field: str = "y", shuffle_block: int | None = None, cache_limit: int | None = None,
    image_size: int | None = None, augment: bool = True,
) -> Splits:
    """`source` is "digits", "synthetic" or a directory of .npy/.npz shards.

    `num_classes` declares the number of classes (labels must be below it); None: 10 for digits and synthetic,
    inferred from the labels of a shard directory (see `LabelStats.num_classes`). `check_finite`: samples holding
    NaN/Inf are an error naming the shard and the sample, raised where their batch is read (`take`). `image_size`,
    `augment`: MDS datasets of image files (streamed.load_splits).
    """
    if num_classes is not None and num_classes < 2:
        raise DatasetError(f"--num-classes must be >= 2, got {num_classes!r}")
    if source == DIGITS:
        return digits(val_fraction=val_fraction, split_seed=split_seed, num_classes=num_classes)
    if source == SYNTHETIC:
        return synthetic(synthetic_shape, synthetic_samples, num_classes=num_classes or 10, seed=seed)
    from hvdtrain.stream import store
    from hvdtrain.train import streamed

    load_streamed = functools.partial(streamed.load_splits, num_classes=num_classes, x_field=x_field, y_field=y_field,
                                      check_finite=check_finite, block_shards=shuffle_block, cache_limit=cache_limit,
                                      image_size=image_size, augment=augment)
    try:
        remote = store.is_url(source)
    except DataError as e:
        raise DatasetError(str(e)) from None
    if remote:
        return load_streamed(source)
    path = Path(source)
    if not path.is_dir():
        where = "" if path.is_absolute() else (f" (looked for {path.absolute()}: a relative path is relative to the "
                                               "working directory, which a job spec sets with `workdir:`)")
        raise DatasetError(f"dataset must be {DIGITS!r}, {SYNTHETIC!r}, an MDS dataset root (a directory or an "
                           f"s3://, gs://, http(s):// URL) or a directory of .npy/.npz shards; got {source!r}, which "
                           f"is not a directory{where}")
    if streamed.is_mds_root(path):
        return load_streamed(path)
    return shard_dir(path, val_fraction=val_fraction, split_seed=split_seed, num_classes=num_classes,
                     check_finite=check_finite)


def shard_dir(path: Path, *, val_fraction: float = 0.2, split_seed: int = 0, num_classes: int | None = None,
              check_finite: bool = True) -> Splits:
    """A directory of .npy/.npz shards, memory-mapped and read per batch (hvdtrain/formats/npyshards.py)."""
    return npyshards.load_dir(path, val_fraction=val_fraction, split_seed=split_seed, num_classes=num_classes,
                              check_finite=check_finite)
