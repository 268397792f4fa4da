"""A directory of `.npy`/`.npz` shards (`--dataset DIR`), memory-mapped and read per batch, never loaded whole.

Shards: `*.npz` files holding `x` (samples, N × ...) and `y` (integer labels, N), and/or `NAME_x.npy` +
`NAME_y.npy` pairs. With `train/` and `val/` subdirectories those are the split; otherwise the shards are
concatenated and split by a fixed permutation (`arrays.split_indices`: index arrays, not copies).

At load only headers and labels are read: each array's .npy header (shape, dtype, where its data starts, whether the
file holds all of it), and every label, streamed shard by shard through a map (class ids, the number of classes). An
`.npz` archive is read through once per node, into the node cache (NOTE [cache files] in hvdtrain/formats/cachedir.py,
under a name that includes the archive's path, size and mtime, so a rewritten archive is read again): a member
stored uncompressed (`np.savez`) is CRC-32-checked and then mapped in place, at its offset inside the archive; a
deflated one (`np.savez_compressed`) is decompressed into a `.npy` file there, which is mapped.

`NpyShardSplit.take` is what a loader's producer process runs per batch: it maps the shards it touches (at most
`MAX_OPEN` arrays per process, least recently used unmapped; a split pickles without its maps; the mappings are
advised for random access, see npyfiles.MappedArray), copies the rows out with one fancy index per shard (rows
sorted), casts x to float32 and checks it for NaN/Inf there, naming the shard file and the sample's index in it (a
DatasetError: the recipes exit 2 with it).
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from hvdtrain.formats import cachedir
from hvdtrain.formats.arrays import DatasetError, LabelStats, Splits, check_labels, check_samples, split_indices
from hvdtrain.formats.npyfiles import (
    UNREADABLE,
    ArrayRef,
    MappedArray,
    ShardSrc,
    check_length,
    np_load,
    read_npy_header,
    shard_files,
    unreadable,
)
from hvdtrain.formats.openfiles import MAX_OPEN

READ_CHUNK = 1 << 20  # bytes per read when an archive member is read through
VERIFY_TIMEOUT_S = 3600.0  # how long a rank waits for another process of its node to read an archive through


# ---- where each array lies -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardRef:
    """One shard: its samples and its labels."""

    x: ArrayRef
    y: ArrayRef


def _npy_ref(path: Path) -> ArrayRef:
    try:
        with open(path, "rb") as f:
            shape, fortran, dtype, header = read_npy_header(f)
            size = os.fstat(f.fileno()).st_size
    except UNREADABLE as e:
        raise unreadable(str(path), e) from None
    check_length(str(path), shape, dtype, size - header)
    return ArrayRef(str(path), 0, header, shape, dtype, fortran, str(path))


def _npz_refs(path: Path, cache_dir: Path) -> tuple[ArrayRef, ArrayRef]:
    npz = np_load(path)
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise DatasetError(f"{path}: not a .npz archive (it holds a single array); a .npz shard must hold "
                           f"'x' (samples) and 'y' (integer labels)")
    with npz:
        missing = [k for k in ("x", "y") if k not in npz.files]
        if missing:
            raise DatasetError(f"{path}: missing array(s) {', '.join(missing)}; found {sorted(npz.files)}; "
                               f"a .npz shard must hold 'x' (samples) and 'y' (integer labels)")
        zf = npz.zip
        if zf is None:  # never: numpy sets it to None on close, and the archive is open inside `with npz`
            raise DatasetError(f"{path}: the archive was closed while it was read")
        names = set(zf.namelist())
        x, y = (_member_ref(path, zf, zf.getinfo(f"{k}.npy" if f"{k}.npy" in names else k), k, cache_dir)
                for k in ("x", "y"))
        return x, y


def _member_ref(path: Path, zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str, cache_dir: Path) -> ArrayRef:
    """Member `info` of archive `path`: stored, mapped in place (CRC-32 checked once per node); compressed,
    decompressed once per node into `cache_dir` and mapped there."""
    name = f"{path}['{key}']"
    if info.flag_bits & 0x1:
        raise DatasetError(f"{name}: cannot read as numpy data: the member is encrypted; save with np.savez")
    try:
        with zf.open(info) as member:
            shape, fortran, dtype, header = read_npy_header(member)  # a deflated member: only its start inflated
    except UNREADABLE as e:
        raise unreadable(name, e) from None
    check_length(name, shape, dtype, info.file_size - header)
    st = path.stat()
    key_text = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{info.filename}|{info.header_offset}|{info.CRC}"
    base = f"{path.name}.{key}.{hashlib.sha256(key_text.encode()).hexdigest()[:16]}"
    if info.compress_type == zipfile.ZIP_STORED:
        cachedir.ensure(cache_dir / f"{base}.crc-ok", lambda f: _read_through(path, info.filename, name, None),
                     timeout=VERIFY_TIMEOUT_S, what=f"checking {name}")
        start = _data_offset(path, info, name)
        return ArrayRef(str(path), start, start + header, shape, dtype, fortran, name)
    copy, _ = cachedir.ensure(cache_dir / f"{base}.npy", lambda f: _read_through(path, info.filename, name, f),
                           timeout=VERIFY_TIMEOUT_S, what=f"decompressing {name}")
    return ArrayRef(str(copy), 0, header, shape, dtype, fortran, name)


def _read_through(path: Path, member: str, name: str, out: BinaryIO | None) -> None:
    """Read archive member `member` to its end (zipfile checks its CRC-32 there), writing it to `out` if given.
    Reading errors are DatasetErrors naming it; writing errors stay OSErrors (cachedir.ensure names the cache)."""
    try:
        zf = zipfile.ZipFile(path)
    except UNREADABLE as e:
        raise unreadable(name, e) from None
    with zf:
        try:
            member_file = zf.open(member)
        except UNREADABLE as e:
            raise unreadable(name, e) from None
        with member_file:
            while True:
                try:
                    chunk = member_file.read(READ_CHUNK)
                except UNREADABLE as e:
                    raise unreadable(name, e) from None
                if not chunk:
                    return
                if out is not None:
                    out.write(chunk)


def _data_offset(path: Path, info: zipfile.ZipInfo, name: str) -> int:
    """Where member `info`'s data starts in the archive: after its local file header (30 bytes, the file name and
    an extra field whose lengths are at bytes 26..29 of that header)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise DatasetError(f"{name}: cannot read as numpy data: corrupt or truncated .npz archive (no local file "
                           f"header at byte {info.header_offset})")
    name_length, extra_length = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_length + extra_length


def _shard_ref(src: ShardSrc, cache_dir: Path) -> ShardRef:
    """The shard's arrays located and checked against each other (from their headers; labels read if not ints)."""
    x, y = (_npy_ref(src[0]), _npy_ref(src[1])) if isinstance(src, tuple) else _npz_refs(src, cache_dir)
    if len(x.shape) < 2 or not np.issubdtype(x.dtype, np.number):
        raise DatasetError(f"{x.name}: samples must be a numeric array of shape (N, ...), "
                           f"got dtype {x.dtype} shape {x.shape}")
    if len(y.shape) != 1 or not np.issubdtype(y.dtype, np.integer):
        hint = ""
        if len(y.shape) == 1 and np.issubdtype(y.dtype, np.floating):
            values = np.asarray(y.open().array)
            if np.all(np.isfinite(values)) and np.array_equal(values, np.round(values)):
                hint = " (these floats are whole numbers: save them with y.astype(np.int64))"
        raise DatasetError(f"{y.name}: labels must be a 1-D integer array of class ids, "
                           f"got dtype {y.dtype} shape {y.shape}{hint}")
    if x.shape[0] != y.shape[0]:
        raise DatasetError(f"{x.name} has {x.shape[0]} samples but {y.name} has {y.shape[0]} labels")
    return ShardRef(x, y)


def scan(directory: Path, cache_dir: Path) -> list[ShardRef]:
    """Every shard of `directory`, located and checked; one sample shape in all."""
    pairs = shard_files(directory)
    shards: list[ShardRef] = []
    for label, src in pairs:
        shard = _shard_ref(src, cache_dir)
        if shards and shard.x.shape[1:] != shards[0].x.shape[1:]:
            raise DatasetError(f"{label}: samples have shape {shard.x.shape[1:]}, but {pairs[0][0]} has "
                               f"{shards[0].x.shape[1:]}; every shard must hold samples of one shape")
        shards.append(shard)
    return shards


def check_shard_labels(shard: ShardRef, num_classes: int | None, stats: LabelStats) -> None:
    """The shard's labels, read through a map: class ids (below `num_classes` if given), counted into `stats`."""
    y = shard.y.open().array
    if y.dtype == np.uint64 and len(y) and y.max() > np.uint64(np.iinfo(np.int64).max):
        raise DatasetError(f"{shard.y.name}[{int(np.argmax(y))}]: label {int(y.max())} does not fit in int64")
    check_labels(y, shard.y.name, num_classes)
    stats.add(y, shard.y.name)


# ---- reading -----------------------------------------------------------------------------------------------

class ShardSet:
    """The shards of one directory, concatenated in file order; arrays are mapped lazily in the process that reads
    (at most `max_open` per process, the least recently used unmapped), and a ShardSet pickles without them."""

    def __init__(self, shards: list[ShardRef], max_open: int = MAX_OPEN) -> None:
        self.shards = tuple(shards)
        sizes = np.asarray([s.x.shape[0] for s in self.shards], dtype=np.int64)
        self.ends = np.cumsum(sizes)
        self.starts = self.ends - sizes
        self.max_open = max_open
        self._maps: OrderedDict[tuple[int, str], MappedArray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.shards[0].x.shape[1:]

    def _map(self, s: int, key: str) -> MappedArray:
        with self._lock:
            arr = self._maps.get((s, key))
            if arr is not None:
                self._maps.move_to_end((s, key))
                return arr
        arr = getattr(self.shards[s], key).open()  # a reader holding an unmapped array keeps it valid
        with self._lock:
            self._maps[(s, key)] = arr
            while len(self._maps) > self.max_open:
                self._maps.popitem(last=False)
        return arr

    def read(self, rows: np.ndarray, check_finite: bool) -> tuple[np.ndarray, np.ndarray]:
        """Samples `rows` (indices into the concatenation) as (x float32, y int64), in that order: one fancy-indexing
        copy per shard touched, rows sorted; x checked for NaN/Inf when `check_finite`."""
        x = np.empty((len(rows), *self.sample_shape), np.float32)
        y = np.empty(len(rows), np.int64)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        shard_of = np.searchsorted(self.ends, ordered, side="right")
        touched = np.unique(shard_of)
        for s, lo, hi in zip(touched, np.searchsorted(shard_of, touched, "left"),
                             np.searchsorted(shard_of, touched, "right"), strict=True):
            ref, local = self.shards[s], ordered[lo:hi] - self.starts[s]
            with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf: check_samples names it
                part = np.asarray(self._map(int(s), "x").gather(local), dtype=np.float32)
            if check_finite and not np.issubdtype(ref.x.dtype, np.integer):  # integers cast to float32 stay finite
                check_samples(part, ref.x.name, ref.x.dtype, rows=local)
            x[order[lo:hi]] = part
            y[order[lo:hi]] = self._map(int(s), "y").gather(local)
        return x, y

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = OrderedDict()  # mappings stay in their process
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class NpyShardSplit:
    """One split of a shard directory: `take(indices) -> (x float32, y int64)`, `len()`, `sample_shape`, `order`
    (None: the sampler's uniform shuffle). `part` "train"/"val": that side of `arrays.split_indices` over the
    whole ShardSet (computed again, not pickled, in each process that reads); None: every sample."""

    def __init__(self, shards: ShardSet, *, part: str | None = None, val_fraction: float = 0.2, split_seed: int = 0,
                 check_finite: bool = True) -> None:
        self.shards, self.part, self.val_fraction, self.split_seed = shards, part, val_fraction, split_seed
        self.check_finite = check_finite
        self._rows: np.ndarray | None = None

    def rows(self) -> np.ndarray | None:
        """This split's indices into the ShardSet (None: all of it, in order)."""
        if self.part is not None and self._rows is None:
            train, val = split_indices(len(self.shards), self.val_fraction, self.split_seed)
            self._rows = train if self.part == "train" else val
        return self._rows

    def __len__(self) -> int:
        rows = self.rows()
        return len(self.shards) if rows is None else len(rows)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.shards.sample_shape

    @property
    def order(self) -> None:
        """The sampler's uniform shuffle: random access to local memory-mapped files is the page cache's."""
        return None

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = idx[(idx < 0) | (idx >= len(self))][0]
            raise IndexError(f"sample {bad} is out of range for a split of {len(self)} samples")
        rows = self.rows()
        return self.shards.read(idx if rows is None else rows[idx], self.check_finite)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.take(np.array([i]))
        return x[0], y[0]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rows": None}  # an index array per split: recomputed where it is read

    def __repr__(self) -> str:
        return f"NpyShardSplit({len(self.shards.shards)} shards, part={self.part!r}, samples={len(self)})"


def load_dir(path: Path, *, val_fraction: float = 0.2, split_seed: int = 0, num_classes: int | None = None,
             check_finite: bool = True) -> Splits:
    """The splits of shard directory `path` (see the module docstring); DatasetError naming a bad file."""
    train_dir, val_dir = path / "train", path / "val"
    split_dirs = train_dir.is_dir() and val_dir.is_dir()
    cache_dir = cachedir.dataset_dir(cachedir.default_root(), str(path.resolve()))
    stats = LabelStats()  # every shard's labels, for the inference across all of them
    sets = []
    for directory in (train_dir, val_dir) if split_dirs else (path,):
        shards = scan(directory, cache_dir)
        for shard in shards:
            check_shard_labels(shard, num_classes, stats)
        sets.append(ShardSet(shards))
    classes = num_classes if num_classes is not None else stats.num_classes(str(path))
    if split_dirs:
        if sets[0].sample_shape != sets[1].sample_shape:
            raise DatasetError(f"{val_dir}: samples have shape {sets[1].sample_shape}, but {train_dir} has "
                               f"{sets[0].sample_shape}")
        train, val = (NpyShardSplit(s, check_finite=check_finite) for s in sets)
    else:
        train, val = (NpyShardSplit(sets[0], part=p, val_fraction=val_fraction, split_seed=split_seed,
                                    check_finite=check_finite) for p in ("train", "val"))
        train.rows()  # checks val_fraction against the sample count now, not in a producer
    return Splits(train=train, val=val, num_classes=classes, name=str(path))
