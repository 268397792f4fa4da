"""A cold start's first batches read by range, while their shards download whole.

NOTE [first batches by range]
A batch draws its samples from every shard of the current shuffle block (order.py), so a reader that starts on a
cold cache waits for the whole block (4 shards of 64 MiB: 5 s on a 400 Mbit/s link) before its first batch. A raw
shard whose columns all have a fixed size stores sample `r` at `first_row + r * stride` (mds.first_row: the
samples fill the file's end), so those rows can be read by range GETs without the shard's header. So, after each
`plan_epoch`, the first `takes` batches that touch a shard not yet local (not cached, not a file read in place)
of the process that makes the reader's first batch (`leads`: the loader's producer 0; the rank's second batch,
producer 1's, comes a step later and would only share the link with it) read that shard's rows by range
(store.get_ranges: every shard of the batch at once); the whole shards are still fetched (fetcher.py) and
everything after comes from them.

What waits: a leading process announces its range read at the plan, before it starts (a shared flock on `BUSY` in
the node's cache directory, dropped when its first batches are made, and by the kernel if it dies). From its plan,
for at most `HOLD_S`, every eligible process's whole-shard reads (fetch-ahead threads, and readers that do not lead)
wait while its own range read or another announced one on the node is in flight: the node's first batches (a few
MiB) have the link to themselves. (Producer 0 of every rank starts before the others, NOTE [first producer first] in
hvdtrain/data/boot.py, so a rank's other producers plan after its leader announced, unless it takes 1 s to start.)
Then the whole shards download while any range read still goes on, and each first batch takes whichever is complete
first: the range read, or every shard it touches being local (`race`, checked every `POLL_S`), so a server that
never answers ranges costs at most the hold and one whole-shard download (with fetch threads; without them the range
read is given up after `RACE_S`). The first `takes` batches after a plan are the only ones that may read by range,
whether or not they needed to: a warm cache's later batches never do. Only the leaders read by range, and their
reads hold every whole-shard read on the node, because the first batch comes soonest when nothing shares the link
with those few MiB (B6 times the variants: docs/performance.md). A server slow at ranges still slows the whole
shards it serves meanwhile (moto copies the whole object for every range GET): on a fast link to such a server range
reads cost more than they save, and HVDTRAIN_STREAM_RANGED=0 turns them off; a server that serves a range by
seeking (tests/scripts/http_store.py) does not have that cost.

The bytes read by range are downloaded twice (again inside the whole shard), so they are bounded: per node and per
planned (seed, epoch), at most `share` of the dataset's stored bytes, or 4 MiB if that is more (`claim`: a
ledger file in the node's cache directory, `.ranged`, under its flock; a batch that does not fit is read from its
whole shards as before). With the default share (1.5%), epoch 1 of a dataset of 267 MiB or more (4 MiB / 1.5%)
downloads at most 1.015x the dataset, plus the requests' overhead and the gaps of under 16 KiB that obstore reads
to merge neighbouring ranges into one request (not counted).

Rows read by range are not covered by the shard's checksum (the index has one per file). Their CRC-32 is kept
until this process maps the whole shard (checked against the index when it arrived: its size, and its hashes
where this machine computes them; xxh* needs the xxhash package): a row that differs there
(the object was replaced or corrupted between the two reads) is a StreamError naming the shard and the row. A
process that never maps the shard (it ends first) does not check its rows.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from hvdtrain.data.errors import DataError
from hvdtrain.formats import cachedir
from hvdtrain.stream import mds
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.store import env_number

if TYPE_CHECKING:
    from hvdtrain.stream.nodecache import NodeCache
    from hvdtrain.stream.store import Store


class RangedSource(Protocol):
    """What RangedReads reads from its dataset (a StreamingDataset)."""

    index: mds.Index
    node: NodeCache
    fields: tuple[str, ...]
    store: Store

    def shard_name(self, s: int) -> str: ...
    def mapped(self, s: int) -> contextlib.AbstractContextManager[mds.ShardReader | None]: ...


T = TypeVar("T")
LEDGER = ".ranged"  # starts with a dot: not a shard (NodeCache.usage skips it)
SHARE = 0.015
ENV_SHARE = "HVDTRAIN_STREAM_RANGED"
MIN_BYTES = 4 << 20  # a small dataset's budget: its first batches, whatever 1.5% of it is
TAKES = 1
HOLD_S = 1.0  # whole-shard reads wait at most this long after a plan for the first batches' range reads
BUSY = ".ranged.busy"  # a shared flock on it: a range read of a plan's first batch is in flight on the node
POLL_S = 0.005  # how often a range read in flight looks whether its whole shards arrived first
RACE_S = 60.0  # a range read not answered within this is given up for the whole shards


def default_share() -> float:
    """`$HVDTRAIN_STREAM_RANGED` (a share of the dataset, 0 turns range reads off), else `SHARE`."""
    return env_number(ENV_SHARE, SHARE, 0.0, 1.0, "the share of the dataset a node may read by range for a cold "
                      f"start's first batches, a number from 0 (off) to 1 (default {SHARE})")


class RangedReads:
    """One process's range reads of one dataset (see NOTE [first batches by range]): `share` of the dataset per
    node and planned epoch, the first `takes` batches of each plan in the process that makes the reader's first
    batches (`leads`)."""

    def __init__(self, share: float = SHARE, takes: int = TAKES) -> None:
        if not 0 <= share <= 1:
            raise ValueError(f"ranged share must be in [0, 1], got {share}")
        self.share, self.takes = share, takes
        self.left = 0  # batches this process may still read by range in the current plan
        self.eligible = False  # set by the dataset: remote, raw shards of fixed-size rows, share > 0
        self.holding = False  # whole-shard reads may still have to wait in this plan (`hold`)
        self.planned_at = 0.0
        self.dir: Path | None = None  # the node's cache directory (the ledger and the announcement live there)
        self._announced: int | None = None  # the fd holding this process's shared flock on BUSY
        self.unchecked: dict[int, dict[int, int]] = {}  # shard -> row -> CRC-32 of the bytes read by range
        self.lock = threading.Lock()
        self.bytes = 0  # read by range in this process (tests, stats)
        self.failed = 0  # batches whose range reads failed (then read from the whole shards)
        self.lost = 0  # batches whose whole shards were local before their range reads answered

    def planned(self, directory: Path, leads: bool = True) -> None:
        """A new plan: a leading process announces its coming range read at once (before any other process of
        the node may start whole shards); every eligible process's whole-shard reads may wait (`hold`)."""
        self.release()
        self.dir, self.planned_at = directory, time.monotonic()
        self.left = self.takes if self.eligible and leads else 0
        self.holding = self.eligible
        fd = announce(directory) if self.left > 0 else None  # (outside the lock: it may retry for up to 1 s)
        with self.lock:
            self._announced = fd

    def release(self) -> None:
        """This process's first batches are made: its announcement ends (closing the fd drops the flock)."""
        with self.lock:
            fd, self._announced = self._announced, None
        if fd is not None:
            os.close(fd)

    def hold(self) -> bool:
        """Whether whole-shard reads should wait now: at most `HOLD_S` after the plan, while this process's own
        first batch is not made or a range read announced by another process on the node is in flight."""
        if not self.holding:
            return False
        waited = time.monotonic() - self.planned_at
        if waited < HOLD_S and self.dir is not None and (self.left > 0 or busy(self.dir)):
            return True
        self.holding = False
        return False

    def wait(self, stop: threading.Event | None = None) -> None:
        """Wait while `hold()` (at most `HOLD_S` after the plan), or until `stop` is set."""
        while self.hold():
            if stop is None:
                time.sleep(POLL_S)
            elif stop.wait(POLL_S):
                return

    def budget(self, ds: RangedSource) -> int:
        """Bytes the node may read by range per planned epoch: `share` of the dataset, at least `MIN_BYTES`."""
        return max(int(self.share * sum(s.remote_file.bytes for s in ds.index.shards)), MIN_BYTES)

    def read(self, ds: RangedSource, wanted: dict[int, np.ndarray],
             local: Callable[[int], bool]) -> dict[int, dict[str, np.ndarray]]:
        """`{shard: rows}` of shards not `local` -> their rows' fields read by range, or {} when this batch is not
        read by range (not among the first `takes` of a plan, nothing missing, no budget left, the range read
        failed, or the whole shards were local first). Every call counts as one of the plan's `takes`."""
        with self.lock:
            if self.left <= 0 or ds.node.epoch_order is None:  # (`eligible`: remote, raw, fixed-size rows)
                return {}
            self.left -= 1
        try:
            return self._read(ds, wanted, local)
        finally:
            if self.left <= 0:
                self.release()

    def _read(self, ds: RangedSource, wanted: dict[int, np.ndarray],
              local: Callable[[int], bool]) -> dict[int, dict[str, np.ndarray]]:
        if not wanted:
            return {}
        infos = {s: ds.index.shards[s] for s in wanted}
        nbytes = sum(len(rows) * (infos[s].fixed_stride or 0) for s, rows in wanted.items())
        if not claim(ds.node.dir, f"{ds.node.seed} {ds.node.epoch}", nbytes, self.budget(ds)):
            with self.lock:
                self.left = 0  # the node's budget is spent
            return {}
        got = self._fetch(ds, wanted, local)
        if got is None:
            return {}
        out = {}
        for s, rows in wanted.items():
            info, parts = infos[s], got[infos[s].raw.basename]
            picked = np.empty((len(rows), info.fixed_stride or 0), np.uint8)
            for k, part in enumerate(parts):
                picked[k] = np.frombuffer(part, np.uint8)
            self._note(ds, s, {row: zlib.crc32(part) for row, part in zip(rows.tolist(), parts, strict=True)})
            out[s] = mds.split_columns(info, picked, ds.fields)
        with self.lock:
            self.bytes += nbytes
        return out

    def _fetch(self, ds: RangedSource, wanted: dict[int, np.ndarray],
               local: Callable[[int], bool]) -> dict[str, list[memoryview]] | None:
        """The rows' bytes by object name, each checked to be one row long; None (counted) when the whole shards
        were local first or the range read failed."""
        requests = {}
        for s, rows in wanted.items():
            info = ds.index.shards[s]
            stride = info.fixed_stride or 0
            requests[info.raw.basename] = ((mds.first_row(info) + rows * stride).tolist(), [stride] * len(rows))
        try:
            got = race(lambda: ds.store.get_ranges(requests),  # type: ignore[attr-defined]  # a RemoteStore
                       lambda: all(local(s) for s in wanted))
            for s, rows in wanted.items():
                info = ds.index.shards[s]
                parts = [] if got is None else got[info.raw.basename]
                if got is not None and (len(parts) != len(rows) or any(len(p) != info.fixed_stride for p in parts)):
                    raise StreamError(f"{ds.shard_name(s)}: a range read returned other parts than asked for")
        except (DataError, OSError, RuntimeError, ValueError):  # no ranges there, a fault, a timeout: whole shards
            with self.lock:
                self.left, self.failed = 0, self.failed + 1
            return None
        if got is None:  # the whole shards won: read from them
            with self.lock:
                self.left, self.lost = 0, self.lost + 1
        return got

    def _note(self, ds: RangedSource, s: int, sums: dict[int, int]) -> None:
        """Keep the CRCs of shard `s`'s rows read by range until it is mapped; if another thread mapped it
        meanwhile (its `_reader` found nothing to check), check them now."""
        with ds.mapped(s) as reader:
            with self.lock:
                self.unchecked.setdefault(s, {}).update(sums)
            if reader is not None:
                self.check(ds, s, reader)

    def check(self, ds: RangedSource, s: int, reader: mds.ShardReader) -> None:
        """Compare the rows of shard `s` read by range with the whole shard now mapped (StreamError if one
        differs; the rows stay unchecked, so every later opening of the shard fails the same way). Call with the
        dataset's lock held (the reader stays mapped)."""
        with self.lock:
            sums = self.unchecked.pop(s, None)
        for row, crc in (sums or {}).items():
            if zlib.crc32(reader.row_bytes(row)) != crc:
                with self.lock:
                    self.unchecked.setdefault(s, {}).update(sums or {})
                raise StreamError(f"{ds.shard_name(s)}: sample {row}, read by range before the whole shard arrived, "
                                  "differs from the shard's checked copy: the object changed or was corrupted "
                                  "between the two reads (a batch already used the range read); upload it again "
                                  "and restart")

    def __getstate__(self) -> dict[str, object]:
        return {"share": self.share, "takes": self.takes, "eligible": self.eligible}  # the rest is per process

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["share"], state["takes"])  # type: ignore[misc]  # __init__ again, with the pickled arguments
        self.eligible = bool(state["eligible"])


def race(fetch: Callable[[], T], whole_local: Callable[[], bool]) -> T | None:
    """`fetch()` (run on a daemon thread), or None as soon as `whole_local()`; its error is raised here, and a
    StreamError after `RACE_S`. A lost fetch finishes on its own and is dropped."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["got"] = fetch()
        except BaseException as e:  # handed to the waiting reader
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="hvdtrain-ranged", daemon=True).start()
    deadline = time.monotonic() + RACE_S
    while not done.wait(POLL_S):
        if whole_local():
            return None
        if time.monotonic() > deadline:
            raise StreamError(f"a range read did not answer in {RACE_S:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["got"]


def claim(directory: Path, plan: str, nbytes: int, budget: int) -> bool:
    """Add `nbytes` to the node's range reads for `plan` in `directory`'s ledger if they stay within `budget`
    (a ledger of another plan starts again at 0); whether they did. A busy or unwritable ledger: False."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with cachedir.file_lock(directory / f"{LEDGER}.lock", 5.0, "counting range reads"):
            path = directory / LEDGER
            spent = 0
            with contextlib.suppress(FileNotFoundError, ValueError):
                text_plan, _, text_spent = path.read_text().rpartition(" ")
                spent = int(text_spent) if text_plan == plan else 0
            if spent + nbytes > budget:
                return False
            part = path.with_name(f"{LEDGER}.{os.getpid()}")
            part.write_text(f"{plan} {spent + nbytes}")
            os.replace(part, path)
            return True
    except (OSError, cachedir.Busy):
        return False


def announce(directory: Path) -> int | None:
    """Take a shared flock on `directory`'s BUSY file: the node sees a range read in flight until the returned fd
    is closed (or this process dies). None if it cannot be taken (then nobody waits for this one)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / BUSY, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    deadline = time.monotonic() + 1.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:  # a `busy` check holds it exclusively for a moment
            if time.monotonic() < deadline:
                time.sleep(0.001)
                continue
        except OSError:  # a filesystem without flock
            pass
        os.close(fd)
        return None


def busy(directory: Path, tries: int = 3) -> bool:
    """Whether a process on the node announced a range read (holds a shared flock on BUSY) and is not done. The
    check takes the lock exclusively for a moment, so another check can be what holds it: `tries` times, 1 ms
    apart, before it answers yes. An error (no flock there): no."""
    try:
        fd = os.open(directory / BUSY, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return False
    try:
        for k in range(tries):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                if k + 1 < tries:
                    time.sleep(0.001)
            except OSError:
                return False
        return True
    finally:
        os.close(fd)  # (drops the exclusive lock if taken)
