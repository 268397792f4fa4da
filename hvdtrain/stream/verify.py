"""`hvdtrain data verify DATASET`: every shard of every split against the index's checksum, every sample decoded,
labels checked and their spread reported; and the shard opening `hvdtrain data inspect` shares with it.

A raw shard on a filesystem is hashed and read in place (memory-mapped); any other shard (compressed, or in an
object store) is fetched into memory, checked, decompressed and read from there: nothing is written anywhere, so
there is nothing to clean up, whatever stops the command. Each shard is checked with the fastest hash its index
entry lists that this machine computes (`integrity.fastest`, as training does: NOTE [local shards verified]); a shard
that fails it is not decoded (its values would be garbage). Problems are collected, not raised, so one run names
every bad shard.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hvdtrain.data.errors import DataError
from hvdtrain.stream import encodings, integrity, labels, mds, store
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.splits import find_splits, human_bytes

REFETCH = "copy or upload it again from a good copy (`hvdtrain data upload`), or re-convert the source " \
          "(`hvdtrain data convert`)"
BAD_SOURCE = ("fix or remove that image in the source and re-convert it (`hvdtrain data convert` decodes every "
              "image first and lists the bad ones; --skip-bad leaves them out)")
RELABEL = "fix the labels at the source and re-convert it (`hvdtrain data convert`)"
SHOWN = 20  # problems listed per split; the rest are counted


class BufferReader(mds.ShardReader):
    """A raw shard held in memory (fetched from a store, or decompressed), read as `mds.ShardReader` reads a mapped
    file; `where` (its URL or path) names it in errors."""

    def __init__(self, data: bytes | memoryview, info: mds.ShardInfo, where: str) -> None:  # no file to map
        self.path, self.info = where, info
        self._check_size(len(data))
        self.map = data  # sliced and read with np.frombuffer, as the mapping is
        self._read_layout()

    def close(self) -> None:
        self.map = b""


class ShardProblem(StreamError):
    """What is wrong is this shard (missing, damaged, unparsable): the other shards are still worth checking. Any
    other StreamError (the store down, access denied, no bucket) would fail every shard alike, each after the
    store's retry window, so it stops the command."""


def open_shard(source: store.Store, info: mds.ShardInfo, check: bool) -> tuple[mds.ShardReader, int]:
    """Shard `info` of `source` opened for reading, and the bytes read from the store to open it (0 for a raw shard
    read in place). `check`: first compare it with the fastest hash of its index entry (and its size); ShardProblem
    naming the shard when it differs, is missing or does not parse; StreamError when the store fails."""
    try:
        return _open_shard(source, info, check)
    except (ShardProblem, StoreFailed):
        raise
    except DataError as e:  # the shard's bytes: size, checksum, decompression, layout
        raise ShardProblem(str(e)) from None


class StoreFailed(StreamError):
    """The store did not give a shard for a reason that is not the shard's (see ShardProblem)."""


def _get(source: store.Store, name: str) -> bytes | memoryview:
    try:
        return source.get(name)
    except DataError as e:
        if store.NOT_FOUND in str(e):
            raise ShardProblem(str(e)) from None
        raise StoreFailed(str(e)) from None


def _open_shard(source: store.Store, info: mds.ShardInfo, check: bool) -> tuple[mds.ShardReader, int]:
    remote = info.remote_file
    where = source.url(remote.basename)
    local = source.local_dir
    if local is not None and not (local / remote.basename).is_file():
        raise StreamError(f"{where}: listed in {source.url(mds.INDEX)} but missing")
    if local is not None and info.zip is None:
        if check:
            integrity.check_file(local / remote.basename, integrity.fastest(remote), where)
        return mds.ShardReader(local / remote.basename, info), 0
    data = _get(source, remote.basename)
    if check:
        mds.check_hashes(integrity.fastest(remote), data, where)
    if info.zip is None:
        return BufferReader(data, info, where), len(data)
    try:
        raw = mds.decompress(info.compression or "zstd", data)
    except Exception as e:  # zstandard raises its own ZstdError
        raise StreamError(f"{where}: cannot decompress ({e}) (corrupt shard)") from None
    if check:
        mds.check_hashes(integrity.fastest(info.raw), raw, f"{where} (decompressed)")
    return BufferReader(raw, info, where), len(data)


@dataclass
class Problem:
    split: str
    shard: str  # its URL or path
    sample: int | None  # the row in the shard, when one is to blame
    what: str
    fix: str

    def render(self) -> str:
        at = f" sample {self.sample}" if self.sample is not None else ""
        what = self.what.removeprefix(f"{self.shard}: ")
        return f"{self.split}: {self.shard}{at}: {what}; fix: {self.fix}"


@dataclass
class SplitCheck:
    """What verifying one split found."""

    name: str
    path: str
    shards: int = 0
    samples: int = 0
    bytes_verified: int = 0
    hashes: list[str] = field(default_factory=list)  # the algorithms used
    unverifiable: str | None = None
    label_note: str | None = None
    classes: int = 0  # distinct labels seen
    label_range: tuple[int, int] | None = None
    spread: dict[str, Any] | None = None
    warning: str | None = None
    problems: list[Problem] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items() if k != "problems"},
                "problems": [p.__dict__ for p in self.problems]}

    def render(self) -> str:

        hashed = (f"{human_bytes(self.bytes_verified)} verified ({', '.join(self.hashes)})" if self.hashes
                  else "not verified (no checksums)")
        classes = (f"{self.classes} classes (labels {self.label_range[0]}..{self.label_range[1]})"
                   if self.label_range else "labels not checked")
        verdict = "OK" if not self.problems else f"FAILED ({len(self.problems)} problem(s))"
        return f"{self.name}: {self.shards} shards, {self.samples:,} samples, {classes}, {hashed}: {verdict}"


class _Columns:
    """Every array column's dtype and shape as first seen in the split: a batch needs one (images of other sizes
    decode but do not stack), except in the columns `free` (image files: the readers decode and crop them to one
    size per batch, hvdtrain/stream/images.py)."""

    def __init__(self, free: Collection[str] = ()) -> None:
        self.seen: dict[str, tuple[str, tuple[int, ...], str, int]] = {}
        self.free = frozenset(free)

    def problem(self, name: str, value: Any, shard: str, row: int) -> str | None:
        if not isinstance(value, np.ndarray | np.generic) or name in self.free:
            return None
        kind = (value.dtype.str, value.shape)
        first = self.seen.setdefault(name, (*kind, shard, row))
        if first[:2] == kind:
            return None
        return (f"column {name!r} is {value.dtype} of shape {value.shape}, but {np.dtype(first[0])} of shape "
                f"{first[1]} in {first[2]} sample {first[3]}; a batch needs one shape and dtype")


def verify_split(name: str, where: str, index: mds.Index, field_name: str,
                 advance: Callable[[int], None]) -> SplitCheck:
    """Check every shard of the split `name` at `where` (a directory or URL) as the module says; `advance(n)`
    after each shard (n: its samples)."""
    result = SplitCheck(name, where)
    source = store.open_store(where)
    result.unverifiable = integrity.unverifiable([s.remote_file for s in index.shards], where)
    result.hashes = sorted({integrity.computable(s.remote_file)[0] for s in index.shards
                            if integrity.computable(s.remote_file)})
    columns = dict(index.shards[0].columns)
    result.label_note = labels.unusable(columns, field_name)
    if result.label_note is None and (what := labels.float_column(columns[field_name], field_name)):
        result.problems.append(Problem(name, source.url(mds.INDEX), None, what, RELABEL))
    num_classes = index.meta.get("num_classes")
    num_classes = num_classes if isinstance(num_classes, int) and num_classes > 0 else None
    shapes = _Columns([n for n, enc in columns.items() if enc.text in encodings.IMAGE_FILES])
    per_shard = [np.empty(0, np.int64) for _ in index.shards]  # each shard's labels (none: not read)
    for s, info in enumerate(index.shards):
        shard = source.url(info.remote_file.basename)
        result.shards += 1
        result.samples += info.samples
        try:
            reader, _ = open_shard(source, info, check=True)
        except ShardProblem as e:
            result.problems.append(Problem(name, shard, None, str(e), REFETCH))
            advance(info.samples)
            continue
        try:
            result.bytes_verified += info.remote_file.bytes if integrity.computable(info.remote_file) else 0
            values = _decode(reader, shard, field_name, result, shapes)
        finally:
            reader.close()
        if values is not None and result.label_note is None:
            for row, what in labels.problems(values, field_name, num_classes):
                result.problems.append(Problem(name, shard, row, what, RELABEL))
            ints = labels.integer_labels(values)
            per_shard[s] = ints if ints is not None else per_shard[s]
        advance(info.samples)
    _finish_labels(result, per_shard, index, field_name)
    return result


def _decode(reader: mds.ShardReader, shard: str, field_name: str, result: SplitCheck,
            shapes: _Columns) -> np.ndarray | None:
    """Decode every sample of the shard (problems into `result`, the first per shard); its labels, or None when a
    sample does not decode. Fixed-size numeric columns decode whatever their bytes once the shard's offsets check
    (ShardReader), so only the labels column is taken from such a shard."""
    if reader.stride is not None and mds.stacks(reader.info, [n for n, _ in reader.info.columns]):
        return labels.fast_column(reader, field_name) if result.label_note is None else None
    images = {name: enc for name, enc in reader.info.columns if enc.text in encodings.IMAGE_FILES}
    checked = bool(integrity.computable(reader.info.remote_file))  # its bytes matched the checksum (open_shard)
    values = []
    for i in range(reader.info.samples):
        try:
            sample = reader.sample(i, raw=images)
        except DataError as e:
            result.problems.append(Problem(result.name, shard, i, str(e), REFETCH))
            return None
        if images and (bad := _bad_image(images, sample, result, shard, i, checked)) is not None:
            result.problems.append(bad)
            return None
        for column, value in sample.items():
            if column != field_name and (what := shapes.problem(column, value, shard, i)):
                result.problems.append(Problem(result.name, shard, i, what, "re-convert it with one shape per "
                                               "column (`hvdtrain data convert --image-size HxW` for images)"))
                return None
        values.append(sample.get(field_name))
    return labels.as_array(values) if result.label_note is None else None


def _bad_image(images: dict[str, encodings.Encoding], sample: dict[str, Any], result: SplitCheck, shard: str,
               row: int, checked: bool) -> Problem | None:
    """A Problem when an image file column of `sample` (its stored bytes) does not decode. When `checked`, the
    shard's checksum matched (else it was not decoded), so the bytes are those the writer stored: the source image
    was bad, and copying the shard again cannot help; without a checksum either may be to blame."""
    from PIL import Image

    for name, enc in images.items():
        try:
            encodings.decode(enc, sample[name])
        except (encodings.EncodingError, ValueError, OSError, SyntaxError, IndexError, ArithmeticError,
                Image.DecompressionBombError) as e:
            if checked:
                return Problem(result.name, shard, row, f"column {name!r} ({enc.text}): the stored bytes match the "
                               f"shard's checksum but do not decode as an image ({type(e).__name__}: {e}): the "
                               "source image was bad when it was converted", BAD_SOURCE)
            return Problem(result.name, shard, row, f"column {name!r} ({enc.text}): does not decode as an image "
                           f"({type(e).__name__}: {e}); the index has no checksum to tell a damaged shard from a "
                           "bad source image", f"{BAD_SOURCE}; or {REFETCH}")
    return None


def _finish_labels(result: SplitCheck, per_shard: list[np.ndarray], index: mds.Index, field_name: str) -> None:
    """The split's classes and label spread; a stray label (the largest far above the number of distinct ones, as
    the recipes' `LabelStats` refuses) when the index does not give num_classes."""
    nonempty = [s for s in per_shard if len(s)]
    if not nonempty:
        return
    distinct = np.unique(np.concatenate(nonempty))
    result.classes, result.label_range = len(distinct), (int(distinct[0]), int(distinct[-1]))
    top = int(distinct[-1])
    if "num_classes" not in index.meta and top + 1 > 2 * len(distinct):
        s = next(i for i, v in enumerate(per_shard) if len(v) and v.max() == top)
        shard = store.join(result.path, index.shards[s].remote_file.basename)
        result.problems.append(Problem(
            result.name, shard, int(np.argmax(per_shard[s])),
            f"label {top} would make a {top + 1}-class model, but only {len(distinct)} distinct labels occur in "
            f"the split (a stray label?)", f"{RELABEL}, or record the classes in the index (num_classes)"))
    result.spread = labels.spread(per_shard)
    if result.spread is not None:
        result.warning = labels.sorted_warning(result.name, result.spread, index)


def progress(total: int, desc: str) -> Any:
    """A tqdm bar on stderr when it is a terminal (else a silent one)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, disable=not sys.stderr.isatty(),
                leave=False)


def verify_dataset(path: str, only: list[str] | None, field_name: str) -> Iterator[SplitCheck]:
    """Each split of the dataset at `path` (a directory or URL, as `splits.find_splits` reads it; `only`: these
    splits, in this order) verified, one at a time; StreamError when there is no such dataset or split."""
    shown, _, splits = find_splits(path)
    unknown = [name for name in only or [] if name not in splits]
    if unknown:
        raise StreamError(f"{shown}: no split {', '.join(map(repr, unknown))}; its splits are "
                          f"{', '.join(splits)} (--split NAME, repeated for several)")
    for name in only or list(splits):
        where, index, _ = splits[name]
        with progress(sum(s.samples for s in index.shards), f"verifying {name}") as bar:
            yield verify_split(name, where, index, field_name, bar.update)


def messages(result: SplitCheck) -> list[str]:
    """What to tell the user on stderr about one verified split: notes, the sorted warning, each problem (the first
    `SHOWN`)."""
    out = [f"note: {note}" for note in (result.unverifiable, result.label_note) if note]
    out += [f"warning: {result.warning}"] if result.warning else []
    out += [f"error: {p.render()}" for p in result.problems[:SHOWN]]
    if len(result.problems) > SHOWN:
        out.append(f"error: {result.name}: {len(result.problems) - SHOWN} more problem(s) not shown (--json lists "
                   "them all)")
    return out


def verdict(path: str, results: list[SplitCheck]) -> tuple[bool, str]:
    """(whether every split passed, the closing line)."""
    shards, samples = sum(r.shards for r in results), sum(r.samples for r in results)
    bad = [p for r in results for p in r.problems]
    if not bad:
        return True, f"OK: {path}: {len(results)} split(s), {shards} shards, {samples:,} samples"
    named = len({p.shard for p in bad if not p.shard.endswith(mds.INDEX)})
    return False, (f"FAILED: {path}: {len(bad)} problem(s), in {named} of {shards} shards (each named above with "
                   "its fix); run `hvdtrain data verify` again once they are fixed")
