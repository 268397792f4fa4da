"""One dataset's shards on this node: each fetched once per node, within a byte limit, evicted by next use.

NOTE [eviction by next use]
Every process reading a dataset on a node (each rank's producers) shares one cache directory (cache.py's NOTE
[cache files]: a shard is produced by one process under its flock, renamed into place complete). With a byte limit,
the process about to produce a shard first makes room under the directory's `.evict.lock`: it sums the sizes of the
complete files there and, while that plus the new shard exceeds the limit, deletes the file needed furthest in the
future. The future is known: the epoch's shard order is `BlockShuffle.shard_order(seed, epoch)` (the loader tells
us `(seed, epoch)` through `plan`), and the reading position is the position of the last shard this process read.
Distances: a shard later in this epoch is needed in (its position - ours) shards; one already passed is needed
next epoch, at (shards left in this one + its position in the next epoch's order); a file of no shard of this
dataset version (an old copy) is never needed. Never deleted: the previous, current and next shuffle block around
the position plus `ahead` shards (what this and the other ranks on the node, which read the same blocks at the same
time, are reading or fetching). This is Belady's rule: with a cache of a fraction of the dataset, the shards kept
are the ones needed soonest next epoch, where LRU would delete each just before it is needed again.
That window assumes the node's readers are within a block of each other: a loader's producers run at most
`prefetch + 1` batches ahead of its trainer, far less than a block of real shards. With blocks of only a few
batches (tiny shards), a producer further behind may find a shard deleted and fetch it again (a refetch, never
wrong data).

A producer makes room, writes its shard and renames it into place under that one lock (partial files of dead
producers count too), so the files in the directory never exceed the limit (downloads in flight are in the
fetching processes' memory until then). A deleted shard another process has memory-mapped stays readable there
(Linux frees its blocks at unmap; readers unmap shards outside the protected window as they move on); a process
that finds a shard deleted between seeing and opening it fetches it again. The limit must hold the protected
window: checked when the cache is made (`CacheTooSmall`), never a hang.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from hvdtrain.stream import cache
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.order import BlockShuffle

EVICT_LOCK = ".evict.lock"


class CacheTooSmall(StreamError):
    """The byte limit cannot hold the shards the readers need at once."""


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class NodeCache:
    """Shard `s` of a dataset as the file `directory/names[s]` (`sizes[s]` bytes once there).

    `limit`: bytes of complete shard files kept in `directory` (None: no limit); `ahead`: shards fetched ahead of
    the reading position (they count in the working set the limit must hold)."""

    def __init__(self, directory: Path, names: Sequence[str], sizes: Sequence[int], order: BlockShuffle, *,
                 limit: int | None = None, ahead: int = 0) -> None:
        self.dir = Path(directory)
        self.names, self.sizes = list(names), [int(n) for n in sizes]
        self.index = {name: s for s, name in enumerate(self.names)}
        self.order, self.limit, self.ahead = order, limit, ahead
        self.block = order.block_shards
        self.cursor: int | None = None  # position (in this epoch's shard order) of the last shard read here
        self._pos: np.ndarray | None = None  # shard -> position, this epoch
        self._next_pos: np.ndarray | None = None  # shard -> position, next epoch
        self.epoch_order: np.ndarray | None = None
        if limit is not None and limit < self.working_set():
            raise CacheTooSmall(
                f"the cache limit {human(limit)} is smaller than the working set {human(self.working_set())}: "
                f"{self.window_shards()} shards (the previous, current and next shuffle block of {self.block} "
                f"shards, and {ahead} fetched ahead) of up to {human(max(self.sizes, default=0))} each must be "
                "on the node at once; raise --cache-limit, or lower --shuffle-block, or write smaller shards "
                "(hvdtrain data convert --shard-size)")

    # ---- what is needed when ---------------------------------------------------------------------------------

    def window_shards(self) -> int:
        return min(len(self.sizes), 3 * self.block + self.ahead)

    def working_set(self) -> int:
        """Bytes of the largest shards that may be protected at once (see NOTE [eviction by next use])."""
        return int(sum(sorted(self.sizes, reverse=True)[: self.window_shards()]))

    def plan(self, seed: int, epoch: int) -> None:
        """The coming reads follow epoch `epoch`'s shard order (seeded by `seed`)."""
        self.epoch_order = self.order.shard_order(seed, epoch)
        self._pos = np.argsort(self.epoch_order)
        self._next_pos = np.argsort(self.order.shard_order(seed, epoch + 1))
        self.cursor = None

    def note_read(self, shard: int) -> None:
        if self._pos is not None:
            self.cursor = int(self._pos[shard])

    def _block_start(self) -> int:
        return 0 if self.cursor is None else self.cursor - self.cursor % self.block

    def protected(self) -> set[int]:
        """Shards never evicted now: the previous, current and next block around the cursor, plus `ahead`."""
        if self.epoch_order is None:
            return set()
        start = self._block_start()
        lo, hi = max(0, start - self.block), start + 2 * self.block + self.ahead
        return {int(s) for s in self.epoch_order[lo:hi]}

    def upcoming(self) -> list[int]:
        """Shards to have local soon, in the order needed: the rest of the current block, the next block and
        `ahead` more (wrapping into the next epoch's order at the end of this one)."""
        if self.epoch_order is None or self._next_pos is None:
            return []
        start = self._block_start()
        want = list(self.epoch_order[start: start + 2 * self.block + self.ahead])
        short = 2 * self.block + self.ahead - len(want)
        if short > 0:
            want += list(np.argsort(self._next_pos)[:short])
        return [int(s) for s in dict.fromkeys(want)]

    def distance(self, name: str, mtime: float) -> float:
        """How far in the future a file is needed (larger: evicted first)."""
        s = self.index.get(name)
        if s is None:
            return float("inf")  # an old version's copy, or another file: never needed
        if self._pos is None or self._next_pos is None:
            return -mtime  # no plan (a reader outside the loader): the least recently fetched first
        pos, cursor = int(self._pos[s]), self.cursor or 0
        if pos >= self._block_start():
            return float(pos - cursor)
        return float(len(self.sizes) - cursor + int(self._next_pos[s]))

    # ---- producing -------------------------------------------------------------------------------------------

    def path(self, s: int) -> Path:
        return self.dir / self.names[s]

    def ensure(self, s: int, fetch: Callable[[], bytes | memoryview], *, wait: bool = True, what: str) -> Path:
        """Shard `s`'s local file, produced by `fetch()` unless present (`wait=False`: `cache.Busy` when another
        process is producing it)."""

        room = self._room if self.limit is not None else None
        path, _ = cache.ensure(self.path(s), fetch=fetch, room=room, timeout=600.0 if wait else 0.0, what=what)
        return path

    @contextlib.contextmanager
    def _room(self, nbytes: int) -> Iterator[None]:
        """Held while a shard of `nbytes` is written and renamed into place: room made for it first, and no other
        writer counts the directory meanwhile (so the limit holds exactly)."""
        with self._evict_lock():
            self._make_room(nbytes)
            yield

    def usage(self) -> list[tuple[str, int, float]]:
        """(name, bytes, mtime) of the files in the directory: complete ones and partial ones being written."""
        out = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.dir) as it:
            for entry in it:
                if entry.name.startswith(".") and ".part." not in entry.name:
                    continue  # lock files
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    out.append((entry.name, st.st_size, st.st_mtime))
        return out

    def _evict_lock(self) -> contextlib.AbstractContextManager[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        return cache.file_lock(self.dir / EVICT_LOCK, 600.0, "making room in the data cache")

    def make_room(self, nbytes: int) -> list[str]:
        """Delete files needed furthest in the future until `nbytes` more fit under the limit; the names deleted."""
        if self.limit is None:
            return []
        with self._evict_lock():
            return self._make_room(nbytes)

    def _make_room(self, nbytes: int) -> list[str]:
        files = self.usage()
        used = sum(size for _, size, _ in files)
        keep = {self.names[s] for s in self.protected()}
        victims = sorted((f for f in files if f[0] not in keep and not f[0].startswith(".")),
                         key=lambda f: self.distance(f[0], f[2]), reverse=True)
        evicted = []
        for name, size, _ in victims:
            if used + nbytes <= self.limit:  # type: ignore[operator]
                break
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()
            used -= size
            evicted.append(name)
        return evicted
