"""One dataset's shards on this node: each fetched once per node, within a byte limit, evicted by next use.

NOTE [eviction by next use]
Every process reading a dataset on a node (each rank's producers) shares one cache directory (cachedir.py's NOTE
[cache files]: a shard is produced by one process under its flock, renamed into place complete). With a byte limit,
the process about to produce a shard first makes room under the directory's `.evict.lock`: it sums the sizes of the
files there and, while that plus the new shard exceeds the limit, deletes the file needed furthest in the future.
The future is known: each epoch's shard order is `BlockShuffle.shard_order(seed, epoch)` (the loader tells us
`(seed, epoch)` through `plan`), and every reader on the node publishes where it is: `(seed, epoch, block start)` in
its own file in the cache directory, rewritten when it enters another block (cachereaders.py; a dead reader's file is
removed by the next eviction). A file's distance is the soonest any live reader needs it: for one reader, a shard
later in its epoch is needed in (its position - the reader's) shards; one already passed next epoch, at (shards left
in this one + its position in the next epoch's order); a file of no shard of this dataset version (an old copy) is
never needed. This is Belady's rule: with a cache of a fraction of the dataset, the shards kept are the ones needed
soonest next epoch, where LRU would delete each just before it is needed again. Over serpentine epochs (NOTE
[serpentine epochs] in order.py) those are the shards read last, including the working set itself, so the whole
cache is read again next epoch.

Windows: each reader's previous, current and next shuffle block plus `ahead` shards (what it and the readers just
behind it read or fetch) are evicted only when nothing outside every reader's window can go (readers far apart),
then nearest needs last; the block a reader is in, never. A fetch ahead (fetcher.py) first asks `admits()`: it is
skipped when it would need to evict something some reader needs sooner than the shard fetched (the reader fetches
that shard itself when it gets there), so a reader running ahead of the others cannot push out what they read
next. Counting every reader matters: with a cache just the size of one window, a reader 1.5 blocks behind another
would have what it reads next evicted by the reader ahead, and refetch several times the dataset per epoch, if
each evicted by its own position alone (tests/stream/test_remote_store.py). The last epoch (`plan(last=True)`) fetches
nothing of the next one ahead.

A producer makes room, writes its shard and renames it into place under that one lock (partial files of dead
producers count too), so the files in the directory never exceed the limit (downloads in flight are in the
fetching processes' memory until then), unless the blocks the readers are in do not fit in it together (3 or more
readers in different blocks under the smallest limit allowed): then by the shard being written. A deleted shard
another process has memory-mapped stays readable there (Linux frees its blocks at unmap; readers unmap shards
outside their window as they move on); a process that finds a shard deleted between seeing and opening it fetches
it again. The limit must hold one reader's window: checked
when the cache is made (`CacheTooSmall`), never a hang.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.formats import cachedir
from hvdtrain.stream import cachereaders
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.order import BlockShuffle

EVICT_LOCK = ".evict.lock"
Reader = tuple[int, np.ndarray, np.ndarray, np.ndarray]  # another reader: block start, order, positions, next's


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
        self.seed = self.epoch = 0
        self.last = False  # the planned epoch is the job's last: upcoming() stops at its end
        self._me = cachereaders.Registration(self.dir)  # where this process reads, for the other readers' evictions
        self._published: cachereaders.Position | None = None
        # names this order and dataset version in the reader files: readers of another one are not counted
        self._tag = hashlib.sha256("|".join([order.fingerprint, *self.names]).encode()).hexdigest()[:16]
        self._orders: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # by (seed, epoch)
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

    def plan(self, seed: int, epoch: int, last: bool = False) -> None:
        """The coming reads follow epoch `epoch`'s shard order (seeded by `seed`); `last`: no epoch follows."""
        self.epoch_order, self._pos, self._next_pos = self._positions(seed, epoch)
        self.seed, self.epoch, self.cursor, self.last = seed, epoch, None, last
        self._publish()

    def note_read(self, shard: int) -> None:
        if self._pos is not None:
            self.cursor = int(self._pos[shard])
            self._publish()

    def _publish(self) -> None:
        """Tell the node's other readers where this one is, when it entered another block (see cachereaders.py)."""
        if self.limit is None:
            return  # nothing is evicted: nobody needs to know
        here = cachereaders.Position(self.seed, self.epoch, self._block_start(), self._tag)
        if here != self._published:
            self._me.publish(here)
            self._published = here

    def _positions(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Epoch `epoch`'s shard order, each shard's position in it, and in the next epoch's order."""
        if len(self._orders) > 8:
            self._orders.clear()
        known = self._orders.get((seed, epoch))
        if known is None:  # (another thread may clear the dict meanwhile: keep our own reference)
            order = self.order.shard_order(seed, epoch)
            known = (order, np.argsort(order), np.argsort(self.order.shard_order(seed, epoch + 1)))
            self._orders[seed, epoch] = known
        return known

    def close(self) -> None:
        """This reader is done (its reader file goes; a killed one's is removed by the next eviction)."""
        self._me.close()
        self._published = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_published"], state["_orders"] = None, {}  # a copy in another process publishes its own position
        return state

    def _block_start(self) -> int:
        return 0 if self.cursor is None else self.cursor - self.cursor % self.block

    def protected(self) -> set[int]:
        """This reader's window: the previous, current and next block around the cursor, plus `ahead` (kept mapped;
        evicted only when nothing outside every reader's window can go)."""
        if self.epoch_order is None:
            return set()
        start = self._block_start()
        lo, hi = max(0, start - self.block), start + 2 * self.block + self.ahead
        return {int(s) for s in self.epoch_order[lo:hi]}

    def upcoming(self) -> list[int]:
        """Shards to have local soon, in the order needed: the rest of the current block, the next block and
        `ahead` more (wrapping into the next epoch's order at the end of this one, unless it is the last)."""
        if self.epoch_order is None or self._next_pos is None:
            return []
        start = self._block_start()
        want = list(self.epoch_order[start: start + 2 * self.block + self.ahead])
        short = 2 * self.block + self.ahead - len(want)
        if short > 0 and not self.last:
            want += list(np.argsort(self._next_pos)[:short])
        return [int(s) for s in dict.fromkeys(want)]

    def to_fetch(self, present: Callable[[int], bool]) -> list[int]:
        """The shards a fetch-ahead thread should fetch now, in order: those of `upcoming()` not `present`, but
        only the current block's while one of them is missing (NOTE [current block first])."""
        missing = [s for s in self.upcoming() if not present(s)]
        if self.epoch_order is None:
            return missing
        start = self._block_start()
        current = {int(s) for s in self.epoch_order[start: start + self.block]}
        first = [s for s in missing if s in current]
        return first or missing

    def _others(self) -> list[Reader]:
        """(block start, order, positions this epoch, next epoch) of the node's other live readers (cachereaders.py)."""
        mine = self._me.path.name if self._me.path is not None else None
        out = []
        for name, at in cachereaders.live(self.dir).items():
            if name != mine and at.order == self._tag and at.start < len(self.sizes):
                out.append((at.start, *self._positions(at.seed, at.epoch)))
        return out

    def distance(self, name: str, mtime: float, others: Sequence[Reader] = ()) -> float:
        """How far in the future a file is needed by the nearest reader, this one or `others` (larger: evicted
        first)."""
        s = self.index.get(name)
        if s is None:
            return float("inf")  # an old version's copy, or another file: never needed
        ahead = [self._until(s, start, start, pos, nxt) for start, _, pos, nxt in others]
        if self._pos is not None and self._next_pos is not None:
            passed = int(self._pos[s]) < self._block_start()
            ahead.append(float("inf") if self.last and passed else  # the job's last epoch: never needed again
                         self._until(s, self.cursor or 0, self._block_start(), self._pos, self._next_pos))
        return min(ahead) if ahead else -mtime  # no plan anywhere: the least recently fetched first

    def _until(self, s: int, cursor: int, start: int, pos: np.ndarray, nxt: np.ndarray) -> float:
        """Shards read before shard `s` by a reader at `cursor` (in the block at `start`)."""
        if int(pos[s]) >= start:
            return float(int(pos[s]) - cursor)
        return float(len(self.sizes) - cursor + int(nxt[s]))

    def _kept(self, others: Sequence[Reader], *, windows: bool) -> set[str]:
        """Files not to evict: each reader's protected window (`windows`), else only the block each reader is in."""
        keep: set[int] = set(self.protected()) if windows else set()
        if not windows and self.epoch_order is not None:
            keep.update(int(s) for s in self.epoch_order[self._block_start(): self._block_start() + self.block])
        for start, order, _, _ in others:
            lo, hi = (max(0, start - self.block), start + 2 * self.block + self.ahead) if windows else (start, start
                                                                                                        + self.block)
            keep.update(int(s) for s in order[lo:hi])
        return {self.names[s] for s in keep}

    # ---- producing -------------------------------------------------------------------------------------------

    def path(self, s: int) -> Path:
        return self.dir / self.names[s]

    def ensure(self, s: int, fetch: Callable[[], bytes | memoryview], *, wait: bool = True, what: str) -> Path:
        """Shard `s`'s local file, produced by `fetch()` unless present (`wait=False`: `cachedir.Busy` when another
        process is producing it)."""
        room = self._room if self.limit is not None else None
        try:
            path, _ = cachedir.ensure(self.path(s), fetch=fetch, room=room, timeout=600.0 if wait else 0.0, what=what)
        except cachedir.CacheFull as e:
            raise self._full(e, what) from None
        return path

    def _full(self, e: cachedir.CacheFull, what: str) -> cachedir.CacheFull:
        """A full disk under the shards: how much room there is, and a --cache-limit that fits it."""
        held = sum(size for _, size, _ in self.usage())
        room = held + (e.free or 0)  # what the shards could use: the free bytes and their own
        need = self.working_set()
        now = "no limit" if self.limit is None else f"--cache-limit {human(self.limit).replace(' ', '')}"
        free = "unknown" if e.free is None else human(e.free)
        if e.free is not None and room * 0.9 >= need:
            fix = (f"pass --cache-limit below what the disk can give the shards (e.g. --cache-limit "
                   f"{human(room * 0.9).replace(' ', '')}; it must still hold {human(need)}, the shards the readers "
                   f"need at once), free space on that disk, or set {cachedir.ENV_DIR} to a directory on a bigger disk")
        else:  # no limit that fits the disk would hold the readers' shards
            fix = (f"the readers need {human(need)} at once: free space on that disk, or set {cachedir.ENV_DIR} to a "
                   "directory on a bigger disk")
        full = cachedir.CacheFull(
            f"the cache directory {self.dir} is full ({free} free on its disk, {human(held)} of shards in it) while "
            f"{what}, with {now}: {fix}")
        full.directory, full.free = self.dir, e.free
        return full

    @contextlib.contextmanager
    def _room(self, nbytes: int) -> Iterator[None]:
        """Held while a shard of `nbytes` is written and renamed into place: room made for it first, and no other
        writer counts the directory meanwhile (so the limit holds exactly). Room is made outside every reader's
        window first, then (readers far apart) from the windows too, nearest needs last, never from the block a
        reader is in (NOTE [eviction by next use]). A fetch ahead was admitted before its download (`admits()`):
        its bytes are kept the same way (dropping them would be a download for nothing)."""
        with self._evict_lock():
            others = self._others()
            if not self._make_room(nbytes, others, windows=True):
                self._make_room(nbytes, others, windows=False)
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
        return cachedir.file_lock(self.dir / EVICT_LOCK, 600.0, "making room in the data cache")

    def _victims(self, files: list[tuple[str, int, float]], others: Sequence[Reader], *,
                 windows: bool) -> list[tuple[float, str, int]]:
        """(distance, name, bytes) of the files that may go, the furthest needed first."""
        keep = self._kept(others, windows=windows)
        return sorted(((self.distance(name, mtime, others), name, size) for name, size, mtime in files
                       if name not in keep and not name.startswith(".")), reverse=True)

    def admits(self, s: int) -> bool:
        """Whether fetching shard `s` ahead is worth its room: it fits, or only files outside every reader's
        window and needed later than `s` (by every reader) would go for it. A fetch ahead that would evict a
        sooner need is skipped; the reader fetches `s` when it gets there."""
        if self.limit is None:
            return True
        with self._evict_lock():
            files = self.usage()
            room = self.limit - sum(size for _, size, _ in files) - self.sizes[s]
            if room >= 0:
                return True
            others = self._others()
            need = self.distance(self.names[s], 0.0, others)
            for d, _, size in self._victims(files, others, windows=True):  # the furthest first
                if room >= 0 or d <= need:
                    break
                room += size
            return room >= 0

    def _make_room(self, nbytes: int, others: Sequence[Reader], *, windows: bool) -> bool:
        """Delete files (outside every reader's window, else outside the block each is in), the furthest needed
        first, until `nbytes` more fit under the limit; whether they do."""
        if self.limit is None:  # never: room is made only under a limit (ensure)
            return True
        files = self.usage()
        over = sum(size for _, size, _ in files) + nbytes - self.limit
        for _, name, size in self._victims(files, others, windows=windows):
            if over <= 0:
                break
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()
            over -= size
        return over <= 0
