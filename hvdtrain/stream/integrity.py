"""Shards checked against the index's checksums once per node before first use, whatever the store.

NOTE [local shards verified]
Fetched and decompressed shards are checked when they arrive (`StreamingDataset.fetch_raw`). A raw shard on a
filesystem is read in place, memory-mapped, so nothing ever read it whole: flipped bytes in its samples would train
as data (a uint8 image shard) or surface later as a NaN. So before a process maps such a shard for the first time,
it checks that a marker for it exists in the node's cache (`<dataset cache>-verified/<name>`, named like the cache
file: the shard's index entry, size and mtime, so a rewritten shard is checked again); if not, it hashes the whole
file with the fastest of the index's hashes this machine can compute and writes the marker only when it matches, through
`cachedir.ensure` (NOTE [cache files]: one process per node hashes a shard, the others wait for the marker).
Corruption is a StreamError naming the shard (exit 2 in the recipes). A shard whose index entry has no computable
hash (Mosaic's MDSWriter writes none by default) cannot be checked: `unverifiable` says so once per dataset. Cost:
one read of each shard per node, hashed on one core (the rates: docs/streaming.md, "Checks").
"""

from __future__ import annotations

import mmap
from pathlib import Path

from hvdtrain.formats import cachedir
from hvdtrain.stream import mds
from hvdtrain.stream.errors import StreamError

FASTEST_FIRST = ("xxh3_64", "xxh64", "xxh128", "xxh32", "sha1", "sha256", "md5")  # one core's speed, fastest first


def computable(info: mds.FileInfo) -> list[str]:
    """The index's hash names for `info` that this machine can compute, fastest first."""
    algos = [algo for algo in info.hashes if mds.digest(algo, b"") is not None]
    return sorted(algos, key=lambda a: FASTEST_FIRST.index(a) if a in FASTEST_FIRST else len(FASTEST_FIRST))


def verify_once(path: Path, info: mds.FileInfo, marker: Path, where: str) -> bool:
    """Check the file `path` against `info` (size, computable hashes) unless `marker` says it was checked on this
    node; StreamError naming `where` when it differs. Returns whether this call hashed it."""
    if marker.exists() or not computable(info):
        return False

    one = fastest(info)
    _, produced = cachedir.ensure(marker, lambda _: _check(path, one, where), what=f"verifying {where}")
    return produced


def fastest(info: mds.FileInfo) -> mds.FileInfo:
    """`info` with only its fastest computable hash (one hash is enough to tell corruption; none when it has no
    computable hash: then only the size is checked)."""
    algos = computable(info)
    return mds.FileInfo(info.basename, info.bytes, {algos[0]: info.hashes[algos[0]]} if algos else {})


def check_file(path: Path, info: mds.FileInfo, where: str) -> None:
    """Check the file `path` against `info` (size and every hash in it, hashed in place through a read-only
    mapping); StreamError naming `where` when it differs or cannot be read (`hvdtrain data verify`)."""
    _check(path, info, where)


def _check(path: Path, info: mds.FileInfo, where: str) -> None:
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                mds.check_hashes(info, b"", where)
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                mds.check_hashes(info, data, where)  # the mapping, hashed in place
    except OSError as e:  # not a cache error: the shard itself is unreadable
        raise StreamError(f"{where}: cannot read it to verify it ({e.strerror or e})") from None


def unverifiable(infos: list[mds.FileInfo], where: str) -> str | None:
    """A note when some shards have no hash this machine can compute (they are read unchecked), else None."""
    missing = [i.basename for i in infos if not computable(i)]
    if not missing:
        return None
    algos = sorted({a for i in infos for a in i.hashes} - {a for i in infos for a in computable(i)})
    why = (f"their hashes ({', '.join(algos)}) need a package this machine lacks (pip install xxhash)" if algos
           else "the index records no checksums for them")
    return (f"{where}: {len(missing)} of {len(infos)} shards cannot be verified before use: {why}; corrupt bytes in "
            "them would be read as data (write the dataset with hashes, e.g. hvdtrain data convert, or "
            "MDSWriter(hashes=['sha1']))")
