"""Mosaic's MDS shard layout: read (memory-mapped, one sample or a whole batch at once) and write.

A dataset is a directory with `index.json` (`{"version": 2, "shards": [...]}`, one entry per shard: sample count,
column names/encodings/sizes, compression, and the raw and compressed file's basename, bytes and hashes) and the
shard files `shard.NNNNN.mds` (or `shard.NNNNN.mds.zstd` when compressed). A raw shard is:

    [num_samples: u32] [offsets: (num_samples + 1) × u32, from the file start] [config JSON] [samples]

and a sample is `[u32 size of each variable-size column] [column bytes in column order]`. Datasets written by
mosaicml/streaming's or LitData's MDSWriter read as they are; `MDSWriter` here writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.atomic import atomic_write
from hvdtrain.data.errors import DataError
from hvdtrain.stream import encodings
from hvdtrain.stream.encodings import Encoding, EncodingError
from hvdtrain.stream.errors import StreamError

INDEX = "index.json"
COMPRESSIONS = ("zstd",)


@dataclass(frozen=True)
class FileInfo:
    basename: str
    bytes: int
    hashes: Mapping[str, str]


@dataclass(frozen=True)
class ShardInfo:
    """One entry of index.json."""

    samples: int
    raw: FileInfo
    zip: FileInfo | None
    compression: str | None
    columns: tuple[tuple[str, Encoding], ...]

    @property
    def remote_file(self) -> FileInfo:
        """The file as stored (compressed if it is)."""
        return self.zip or self.raw

    @property
    def fixed_stride(self) -> int | None:
        """Bytes per sample when every column has a fixed size (then a batch is one fancy-indexing copy)."""
        sizes = [enc.size for _, enc in self.columns]
        fixed = [size for size in sizes if size is not None]
        return sum(fixed) if len(fixed) == len(sizes) else None


@dataclass(frozen=True)
class Index:
    """A parsed index.json: its shards and hvdtrain's own metadata (the `"hvdtrain"` key; other readers ignore it)."""

    shards: tuple[ShardInfo, ...]
    meta: Mapping[str, Any]


def parse_index(text: str, origin: str) -> Index:
    """The index.json in `text`; StreamError naming `origin` and the bad entry otherwise."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise StreamError(f"{origin}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("shards"), list):
        raise StreamError(f"{origin}: expected an MDS index, an object with a 'shards' list")
    if obj.get("version") != 2:
        raise StreamError(f"{origin}: index version {obj.get('version')!r}; this reader knows version 2")
    shards = [_shard_info(entry, f"{origin}: shards[{i}]") for i, entry in enumerate(obj["shards"])]
    if not shards:
        raise StreamError(f"{origin}: the index lists no shards")
    first = [name for name, _ in shards[0].columns]
    for i, shard in enumerate(shards):
        if [name for name, _ in shard.columns] != first:
            raise StreamError(f"{origin}: shards[{i}] has columns {[n for n, _ in shard.columns]}, shards[0] has "
                              f"{first}; every shard must hold the same columns")
    meta = obj.get("hvdtrain")
    return Index(tuple(shards), meta if isinstance(meta, dict) else {})


def _shard_info(entry: Any, where: str) -> ShardInfo:
    try:
        if entry.get("format") != "mds":
            raise StreamError(f"{where}: format {entry.get('format')!r} is not read (only 'mds'; convert the "
                              "dataset with `hvdtrain data convert`)")
        names, encs = entry["column_names"], entry["column_encodings"]
        if len(names) != len(encs):
            raise StreamError(f"{where}: {len(names)} column names but {len(encs)} encodings")
        columns = tuple((str(n), encodings.parse(str(e))) for n, e in zip(names, encs, strict=True))
        compression = entry.get("compression")
        if compression is not None and str(compression).partition(":")[0] not in COMPRESSIONS:
            raise StreamError(f"{where}: compression {compression!r} is not supported (only {COMPRESSIONS})")
        zip_data = entry.get("zip_data")
        samples = int(entry["samples"])
        if samples < 0:
            raise StreamError(f"{where}: samples {samples} < 0")
        return ShardInfo(samples, _file_info(entry["raw_data"]), None if zip_data is None else _file_info(zip_data),
                         compression, columns)
    except EncodingError as e:
        raise StreamError(f"{where}: {e}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise StreamError(f"{where}: malformed shard entry ({type(e).__name__}: {e})") from None


def _file_info(obj: Mapping[str, Any]) -> FileInfo:
    name = str(obj["basename"])
    parts = name.split("/")  # merged indexes (Mosaic's merge_index) name shards as SUBDIR/shard.NNNNN.mds
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"basename {name!r} must be a file name or a relative path inside the dataset "
                         "(no '..', not absolute)")
    return FileInfo(name, int(obj["bytes"]), dict(obj.get("hashes") or {}))


# ---- checksums ------------------------------------------------------------------------------------------------

def digest(algo: str, data: bytes | memoryview | mmap.mmap) -> str | None:
    """The hex digest of `data` with one of MDS's hash names (None when this machine cannot compute it)."""
    if algo.startswith("xxh"):
        try:
            import xxhash
        except ImportError:
            return None
        fn = getattr(xxhash, f"{algo}_hexdigest", None)
        return fn(data) if fn else None
    try:
        return hashlib.new(algo, data).hexdigest()
    except ValueError:
        return None


def check_hashes(info: FileInfo, data: bytes | memoryview | mmap.mmap, where: str) -> None:
    """StreamError naming `where` when the data's size or any computable hash differs from the index."""
    if len(data) != info.bytes:
        raise StreamError(f"{where}: {len(data)} bytes, the index says {info.bytes} (truncated or replaced)")
    for algo, want in info.hashes.items():
        got = digest(algo, data)
        if got is not None and got != want:
            raise StreamError(f"{where}: {algo} checksum {got} differs from the index's {want} (corrupt shard)")


def decompress(compression: str, data: bytes | memoryview) -> bytes:
    import zstandard

    if compression.partition(":")[0] != "zstd":
        raise StreamError(f"compression {compression!r} is not supported (only {COMPRESSIONS})")
    return zstandard.ZstdDecompressor().decompress(data)


# ---- reading --------------------------------------------------------------------------------------------------

class ShardReader:
    """A raw (uncompressed) shard file, memory-mapped read-only: samples are decoded from the page cache.

    Every value returned is a copy (nothing handed out views the mapping), so `close()` can always unmap it."""

    path: Path | str  # named in errors only
    map: mmap.mmap | bytes | memoryview  # the shard's bytes: the mapped file (a subclass may hold them in memory)

    def __init__(self, path: Path, info: ShardInfo) -> None:
        self.path, self.info = path, info
        with open(path, "rb") as f:
            self._check_size(os.fstat(f.fileno()).st_size)
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._read_layout()
        except BaseException:
            self.map.close()
            raise

    def _check_size(self, size: int) -> None:
        if size != self.info.raw.bytes or size < 8:
            raise StreamError(f"{self.path}: {size} bytes, the index says {self.info.raw.bytes} (truncated or "
                              "replaced)")

    def _read_layout(self) -> None:
        """The sample offsets and the columns' layout, checked against the index, from `self.map`."""
        self.offsets = self._read_offsets(len(self.map))
        self.variable = [i for i, (_, enc) in enumerate(self.info.columns) if enc.size is None]
        self.stride = self.info.fixed_stride
        if self.stride is not None and np.any(np.diff(self.offsets) != self.stride):
            raise StreamError(f"{self.path}: samples are not {self.stride} bytes each as its fixed-size columns say "
                              "(corrupt shard)")

    def _read_offsets(self, size: int) -> np.ndarray:
        n = int(np.frombuffer(self.map, np.uint32, count=1)[0])
        if n != self.info.samples or 4 * (n + 2) > size:
            raise StreamError(f"{self.path}: holds {n} samples, the index says {self.info.samples} (corrupt shard)")
        offsets = np.frombuffer(self.map, np.uint32, count=n + 1, offset=4).astype(np.int64)
        if offsets[-1] != size or offsets[0] < 4 * (n + 2) or np.any(np.diff(offsets) < 0):
            raise StreamError(f"{self.path}: sample offsets are inconsistent with the file size {size} "
                              "(corrupt shard)")
        return offsets

    def sample(self, i: int, fields: Sequence[str] | None = None, raw: Collection[str] = ()) -> dict[str, Any]:
        """Sample `i`'s columns (only `fields`, if given) decoded and copied out of the mapping; those in `raw` as
        their stored bytes (an image column's encoded file, decoded by the caller)."""
        begin, end = int(self.offsets[i]), int(self.offsets[i + 1])
        sizes = self._column_sizes(i, end - begin)
        pos, out = begin + 4 * len(self.variable), {}
        for (name, enc), size in zip(self.info.columns, sizes, strict=True):
            if name in raw:
                out[name] = bytes(self.map[pos:pos + size])
            elif fields is None or name in fields:
                try:
                    value = encodings.decode(enc, self.map[pos:pos + size])
                except (EncodingError, ValueError, IndexError, ArithmeticError, OSError) as e:
                    raise StreamError(f"{self.path}: sample {i} column {name!r} ({enc.text}): cannot decode "
                                      f"({type(e).__name__}: {e}) (corrupt shard)") from None
                out[name] = value
            pos += size
        return out

    def _column_sizes(self, i: int, length: int) -> list[int]:
        """Each column's bytes in sample `i` (the sample's size table for variable ones), checked to add up."""
        nvar = len(self.variable)
        if 4 * nvar > length:
            raise StreamError(f"{self.path}: sample {i} is {length} bytes, too short for its size table (corrupt "
                              "shard)")
        begin = int(self.offsets[i])
        var = np.frombuffer(self.map, np.uint32, count=nvar, offset=begin).tolist() if nvar else []
        sizes, v = [], 0
        for _, enc in self.info.columns:
            if enc.size is None:
                sizes.append(int(var[v]))
                v += 1
            else:
                sizes.append(enc.size)
        if 4 * nvar + sum(sizes) != length:
            raise StreamError(f"{self.path}: sample {i}'s column sizes {sizes} do not add up to its {length} bytes "
                              "(corrupt shard)")
        return sizes

    def column_block(self, rows: np.ndarray, fields: Sequence[str]) -> dict[str, np.ndarray] | None:
        """`fields` of the samples `rows` as stacked arrays, one copy out of the mapping, when every column has a
        fixed size and the fields decode to arrays (else None: decode sample by sample)."""
        if self.stride is None or not stacks(self.info, fields):
            return None
        start, n = int(self.offsets[0]), self.info.samples
        table = np.frombuffer(self.map, np.uint8, count=n * self.stride, offset=start).reshape(n, self.stride)
        picked = table[rows]  # the one copy out of the mapping
        del table
        return split_columns(self.info, picked, fields)

    def row_bytes(self, row: int) -> bytes | memoryview:
        """Sample `row`'s bytes as stored (a copy)."""
        return self.map[int(self.offsets[row]):int(self.offsets[row + 1])]

    def close(self) -> None:
        """Unmap the file (nothing handed out views it)."""
        if isinstance(self.map, mmap.mmap):
            self.map.close()


def stacks(info: ShardInfo, fields: Sequence[str]) -> bool:
    """Whether samples of `info` are one fixed-size record each and `fields` decode to arrays (then a batch is
    a table of rows: `split_columns`)."""
    columns = dict(info.columns)
    return info.fixed_stride is not None and all(columns[f].kind in ("scalar", "ndarray") for f in fields)


def first_row(info: ShardInfo) -> int:
    """Where a fixed-stride raw shard's first sample starts: its samples fill the file's end."""
    return info.raw.bytes - info.samples * (info.fixed_stride or 0)


def split_columns(info: ShardInfo, picked: np.ndarray, fields: Sequence[str]) -> dict[str, np.ndarray]:
    """`fields` of a (rows, stride) uint8 table of fixed-size samples, as stacked arrays (copies)."""
    out, pos = {}, 0
    for name, enc in info.columns:
        size = enc.size or 0
        if name in fields:
            shape = () if enc.kind == "scalar" else enc.shape
            if enc.dtype is None or shape is None:  # never: a fixed-stride shard's columns all have a fixed size
                raise StreamError(f"column {name!r} ({enc.text}) has no fixed dtype and shape")
            out[name] = picked[:, pos:pos + size].copy().view(enc.dtype).reshape(len(picked), *shape)
        pos += size
    return out


# ---- writing --------------------------------------------------------------------------------------------------

class MDSWriter:
    """Write samples (dicts of column values) as an MDS dataset in `out`; `finish()` (or the context manager)
    writes the index last, so a reader never sees a partial dataset. Shards are written to a temporary name and
    renamed. `compression`: None or 'zstd[:LEVEL]'; `size_limit`: bytes per raw shard."""

    def __init__(self, out: Path, columns: Mapping[str, str], *, compression: str | None = None,
                 size_limit: int = 1 << 26, hashes: Sequence[str] = ("sha1",),
                 meta: Mapping[str, Any] | None = None) -> None:
        self.out = Path(out)
        if (self.out / INDEX).exists():
            raise StreamError(f"{self.out / INDEX} exists: write to an empty directory")
        name, _, level = (compression or "").partition(":")
        if compression is not None and (name not in COMPRESSIONS or (level and not _zstd_level_ok(level))):
            raise StreamError(f"compression {compression!r} is not supported: use one of {COMPRESSIONS}, "
                              "optionally with a level 1..22 (zstd:7)")
        self.names = sorted(columns)  # MDS orders columns by name
        self.encs = [encodings.parse(columns[n]) for n in self.names]
        self.compression, self.size_limit, self.hashes = compression, size_limit, list(hashes)
        config = {"version": 2, "format": "mds", "compression": compression, "hashes": self.hashes,
                  "size_limit": size_limit, "column_names": self.names,
                  "column_encodings": [e.text for e in self.encs], "column_sizes": [e.size for e in self.encs]}
        self.config = config
        self.config_bytes = json.dumps(config, sort_keys=True).encode("utf-8")
        self.meta = dict(meta or {})
        self.shards: list[dict[str, Any]] = []
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.out.mkdir(parents=True, exist_ok=True)

    def write(self, sample: Mapping[str, Any]) -> None:
        missing = set(self.names) - set(sample)
        if missing:
            raise StreamError(f"sample lacks columns {sorted(missing)} (columns: {self.names})")
        sizes, parts = [], []
        for name, enc in zip(self.names, self.encs, strict=True):
            datum = encodings.encode(enc, sample[name])
            if enc.size is None:
                sizes.append(len(datum))
            elif len(datum) != enc.size:
                raise StreamError(f"column {name!r}: {len(datum)} bytes, {enc.text} holds {enc.size}")
            parts.append(datum)
        record = np.asarray(sizes, np.uint32).tobytes() + b"".join(parts)
        if self.pending and self.pending_bytes + len(record) + 4 + 8 + len(self.config_bytes) > self.size_limit:
            self.flush()
        self.pending.append(record)
        self.pending_bytes += len(record) + 4

    def flush(self) -> None:
        if not self.pending:
            return
        n = len(self.pending)
        offsets = np.cumsum([0, *map(len, self.pending)], dtype=np.int64) + 4 + 4 * (n + 1) + len(self.config_bytes)
        if offsets[-1] >= 1 << 32:
            raise StreamError(f"a shard of {offsets[-1]} bytes exceeds MDS's 4 GiB offsets: lower the shard size")
        raw = (np.uint32(n).tobytes() + offsets.astype(np.uint32).tobytes() + self.config_bytes
               + b"".join(self.pending))
        base = f"shard.{len(self.shards):05}.mds"
        raw_info = self._info(raw, base)
        zip_info = None
        if self.compression:
            import zstandard

            level = int(self.compression.partition(":")[2] or 3)
            raw = zstandard.ZstdCompressor(level=level).compress(raw)
            zip_info = self._info(raw, base + ".zstd")
        atomic_write(self.out / (zip_info or raw_info)["basename"], lambda f: f.write(raw))
        self.shards.append({"samples": n, "raw_data": raw_info, "zip_data": zip_info, **self.config})
        self.pending, self.pending_bytes = [], 0

    def _info(self, data: bytes, basename: str) -> dict[str, Any]:
        return {"basename": basename, "bytes": len(data), "hashes": {a: digest(a, data) for a in self.hashes}}

    def finish(self) -> None:
        if not self.shards and not self.pending:
            raise StreamError(f"no samples were written to {self.out}: an MDS dataset needs at least one")
        self.flush()
        index: dict[str, Any] = {"version": 2, "shards": self.shards}
        if self.meta:
            index["hvdtrain"] = self.meta
        text = json.dumps(index, sort_keys=True)
        atomic_write(self.out / INDEX, lambda f: f.write(text.encode("utf-8")))

    def __enter__(self) -> MDSWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.finish()


def _zstd_level_ok(level: str) -> bool:
    return level.isdigit() and 1 <= int(level) <= 22
