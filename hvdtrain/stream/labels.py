"""A split's labels: read from a shard (the labels column only where its layout allows), checked, and their spread
over the shards (`hvdtrain data inspect` and `hvdtrain data verify`).

NOTE [label spread]
A batch mixes only the samples of one shuffle block (NOTE [automatic blocks] in order.py), so a split whose shards
each hold one or two classes (written class by class: an image folder, per-class archives, Mosaic's MDSWriter fed
in that order) trains poorly when a block is a few shards. Two measures, each averaged over the shards read and
compared with the same measure for the same labels dealt at random into shards of the same sizes (one seeded
shuffle: what `hvdtrain data convert` writes): the distinct labels a shard holds, and its top-class share (the
fraction of its samples with its most common label). A split is called class-sorted when its shards hold fewer than
half the distinct labels shuffled shards would, or are more than halfway from the shuffled top-class share to
holding one class each (`share > shuffled + (1 - shuffled) / 2`). Each alone misses a case: with 2 classes every
shard holds one or both, so only the share tells; with 1000 classes of 20 samples in shards of 500, a sorted shard
is 4% one class against a shuffled one's ~1% (far from halfway to 100%), but holds 25 classes against ~390. Against
a shuffled baseline neither depends on the number of classes or their balance, and shuffled data sits at the
baseline, far from either threshold. One shard, or shards of one sample, never warn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hvdtrain.stream import mds
from hvdtrain.stream.encodings import Encoding
from hvdtrain.stream.order import AUTO_BLOCK_SAMPLES, auto_block_shards

DEFAULT_FIELD = "y"  # the recipes' --y-field default
SORTED_SHARE = 0.5  # NOTE [label spread]: half the shuffled classes; halfway from shuffled to one class


def unusable(columns: dict[str, Any], field: str) -> str | None:
    """Why the column `field` cannot hold labels (absent, or not numeric), else None."""
    if field not in columns:
        return (f"no column {field!r} (columns: {', '.join(columns)}); labels not read (--y-field NAME names the "
                "labels column)")
    if columns[field].kind not in ("scalar", "ndarray"):
        return f"column {field!r} is {columns[field].text!r}; labels must be one integer per sample"
    return None


def fast_column(reader: mds.ShardReader, field: str) -> np.ndarray | None:
    """Column `field` of every sample of a shard of fixed-size samples, copying only that column out of the
    mapping (the pages holding it are read); None when the samples are not fixed-size (decode them one by one)."""
    info = reader.info
    if reader.stride is None or not mds.stacks(info, [field]):
        return None
    n = info.samples
    table = np.frombuffer(reader.map, np.uint8, count=n * reader.stride,
                          offset=int(reader.offsets[0])).reshape(n, reader.stride)
    try:
        return mds.split_columns(info, table, [field])[field]
    finally:
        del table  # a view of the mapping: it must go before the reader is closed


def shard_labels(reader: mds.ShardReader, field: str) -> np.ndarray:
    """Column `field` of every sample of the shard (StreamError naming the sample that does not decode)."""
    column = fast_column(reader, field)
    if column is not None:
        return column
    return as_array([reader.sample(i, [field])[field] for i in range(reader.info.samples)])


def as_array(values: Sequence[Any]) -> np.ndarray:
    """Decoded label values as one array (an object array when their shapes differ)."""
    try:
        return np.asarray(values)
    except ValueError:  # ragged
        out = np.empty(len(values), dtype=object)
        out[:] = list(values)
        return out


def problems(values: np.ndarray, field: str, num_classes: int | None) -> list[tuple[int, str]]:
    """(row, what is wrong) for the first bad label of each kind in one shard's `values` of column `field`: not one
    integer per sample, negative, at or above the index's `num_classes`."""
    n = len(values)
    if values.dtype.kind not in "iuf" or values.shape[1:] not in ((), (1,)):
        shape = values.shape[1:] if values.dtype != object else "varying"
        return [(0, f"column {field!r} holds {values.dtype} of shape {shape} per sample; labels must be one integer "
                    "(a class id 0..K-1) per sample")]
    flat = values.reshape(n)
    if flat.dtype.kind == "f":  # (`float_column` names the column's type once per split)
        bad = np.flatnonzero(~np.isfinite(flat) | (flat != np.round(flat)))
        return [(int(bad[0]), f"label {flat[bad[0]].item()} is not an integer ({bad.size} such sample(s) in this "
                              f"shard; column {field!r} must hold integer class ids 0..K-1)")] if bad.size else []
    out = []
    negative = np.flatnonzero(flat < 0)
    if negative.size:
        row = int(negative[0])
        out.append((row, f"label {int(flat[row])} is negative ({negative.size} such sample(s) in this shard; labels "
                         "are class ids 0..K-1)"))
    if num_classes is not None:
        high = np.flatnonzero(flat >= num_classes)
        if high.size:
            row = int(high[0])
            out.append((row, f"label {int(flat[row])} is out of range for the index's num_classes {num_classes} "
                             f"(labels must be 0..{num_classes - 1}; {high.size} such sample(s) in this shard)"))
    return out


def float_column(enc: Encoding, field: str) -> str | None:
    """What is wrong with a labels column whose declared dtype is a float (the recipes need integers), else None."""
    if enc.dtype is None or enc.dtype.kind != "f":
        return None
    return (f"column {field!r} is {enc.text!r}: labels must be an integer column (int64) of class ids 0..K-1, "
            "which the recipes require")


def integer_labels(values: np.ndarray) -> np.ndarray | None:
    """One shard's labels as a 1-D int64 array, or None when they are not integers (`problems` says why)."""
    if values.dtype.kind not in "iu" or values.shape[1:] not in ((), (1,)):
        return None
    return values.reshape(len(values)).astype(np.int64, copy=False)


def _mix(shards: Sequence[np.ndarray]) -> tuple[float, float]:
    """(mean distinct labels per shard, mean top-class share per shard) over non-empty shards."""
    distinct, share = [], []
    for labels in shards:
        if len(labels):
            _, counts = np.unique(labels, return_counts=True)
            distinct.append(len(counts))
            share.append(counts.max() / len(labels))
    return float(np.mean(distinct)), float(np.mean(share))


def spread(shards: Sequence[np.ndarray]) -> dict[str, Any] | None:
    """How the labels of `shards` (each a 1-D int array) spread over them, against the same labels shuffled into
    shards of the same sizes (NOTE [label spread]); None when no shard has a label."""
    shards = [s for s in shards if len(s)]
    if not shards:
        return None
    every = np.concatenate(shards)
    dealt = np.split(np.random.default_rng(0).permutation(every), np.cumsum([len(s) for s in shards])[:-1])
    distinct, share = _mix(shards)
    shuffled_distinct, shuffled_share = _mix(dealt)
    return {"shards_read": len(shards), "classes": len(np.unique(every)),
            "mean_shard_classes": round(distinct, 2), "mean_top_share": round(share, 4),
            "shuffled_shard_classes": round(shuffled_distinct, 2), "shuffled_top_share": round(shuffled_share, 4),
            "sorted": bool(distinct < SORTED_SHARE * shuffled_distinct
                           or share > shuffled_share + SORTED_SHARE * (1 - shuffled_share))}


def render(spread: dict[str, Any]) -> str:
    """One line: the average shard's classes and top-class share, and a shuffled split's."""
    return (f"the average shard holds {spread['mean_shard_classes']:g} of the {spread['classes']} classes seen and "
            f"is {spread['mean_top_share']:.0%} one class (shuffled: {spread['shuffled_shard_classes']:g} classes, "
            f"{spread['shuffled_top_share']:.0%})")


def sorted_warning(split: str, spread: dict[str, Any], index: mds.Index) -> str | None:
    """What a class-sorted split means for training and how to fix it (None when it does not look sorted, and for
    val/: validation reads every sample whatever their order)."""
    if not spread["sorted"] or split == "val":
        return None
    sizes = [s.samples for s in index.shards]
    block = auto_block_shards(sizes, [s.raw.bytes for s in index.shards])
    if block >= len(sizes):
        blocks = (f"here all {len(sizes)} shards: one uniform shuffle), so it trains well as it is, but a "
                  "--cache-limit or --shuffle-block that makes blocks smaller leaves each batch with few classes "
                  "and training may stay near chance")
    else:
        blocks = (f"here {block} of its {len(sizes)} shards), so each batch holds few classes and training may stay "
                  "near chance, more so under a small --cache-limit (smaller blocks)")
    return (f"{split} looks sorted by class: {render(spread)}. hvdtrain's loader mixes samples only within a "
            f"shuffle block (--shuffle-block auto: {AUTO_BLOCK_SAMPLES:,} samples' worth of shards, {blocks}. Fix: "
            "re-convert it (`hvdtrain data convert` writes a shuffled copy by default), or raise --shuffle-block "
            "to span the classes")
