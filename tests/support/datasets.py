"""Datasets the tests write: small, made here, never downloaded."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.stream import MDSWriter
from hvdtrain.train import recipe_data

COLUMNS = {"x": "ndarray:float32:1,8,8", "y": "int64"}


def write_digits(root: Path, *, bad_label_at: int | None = None) -> Path:
    """scikit-learn's digits as an MDS root: zstd shards of ~100 samples, the number of classes in the index."""
    splits = recipe_data.load("digits")
    for name, split in (("train", splits.train), ("val", splits.val)):
        with MDSWriter(root / name, COLUMNS, compression="zstd", size_limit=100 * 280,
                       meta={"num_classes": 10}) as w:
            for i in range(len(split)):
                label = 12 if (name == "train" and i == bad_label_at) else int(split.y[i])
                w.write({"x": split.x[i], "y": label})
    return root
