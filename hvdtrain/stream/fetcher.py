"""Background fetching of the shards a reader will need next (threads inside the reading process).

Started by the first `wake()` (the loader's `plan_epoch`, then every move of the reading position), the threads
walk `NodeCache.to_fetch()` — the rest of the current shuffle block, the next block and `ahead` more shards — and
fetch each missing one into the node cache without waiting on a lock (`wait=False`): a shard another thread or
process is already fetching is skipped, so the readers and fetchers of every rank on the node together fetch
each shard once, several at a time. Errors are not raised here: the reader that needs the shard fetches it itself
and reports the error with the URL (StreamError). The threads are daemons (a process that exits mid-fetch leaves a
`.part` file that the next producer of that shard removes, NOTE [cache files]) and `stop()` ends them.

NOTE [current block first]
A batch draws its samples from every shard of the current shuffle block, so no batch of a block can be made
before the whole block is local. While any shard of the block the reader is in is missing, the threads fetch
only those (the ones already in flight elsewhere are skipped: the thread waits for the next wake), and nothing
beyond the block. Otherwise every fetch thread on the node (2 per producer: 8 for 2 ranks of 2 producers) would
start a shard of the next blocks too, and the block the readers wait for would share the link with them: a cold
start would wait for the next block's shards as well as its own (B6). When the reader is ahead of the link the same
rule keeps the bandwidth on what it waits for. The readers wake the threads whenever their position moves (once
the block is local they make batches, so the next blocks start at once), and every thread looks again each second.
A thread that fetched a shard does not wake the others: that brings the first batch no sooner and costs peak
memory (B6). Before any of that, while the node's first batches of a plan are read by range (ranged.py, NOTE
[first batches by range]), the threads wait (at most `HOLD_S`): those few MiB go first, the whole shards right after.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Protocol

from hvdtrain.data.errors import DataError
from hvdtrain.formats import cachedir

if TYPE_CHECKING:
    from hvdtrain.stream.nodecache import NodeCache


class FetchSource(Protocol):
    """What a Fetcher reads from its dataset (a StreamingDataset)."""

    fetch_threads: int
    node: NodeCache

    def on_node(self, s: int) -> bool: ...
    def wait_for_range_reads(self, stop: threading.Event | None = None) -> None: ...
    def fetch_raw(self, s: int) -> bytes | memoryview: ...
    def shard_name(self, s: int) -> str: ...


class Fetcher:
    def __init__(self, dataset: FetchSource) -> None:
        self.ds = dataset
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.fetched = 0  # shards this process fetched in the background (tests, stats)

    def wake(self) -> None:
        if self.ds.fetch_threads <= 0:
            return
        if not self._threads:
            for i in range(self.ds.fetch_threads):
                t = threading.Thread(target=self._loop, name=f"hvdtrain-fetch-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()
        self._stop.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            self._pass()

    def _pass(self) -> None:
        """Fetch what `NodeCache.to_fetch()` lists now, skipping shards in flight elsewhere."""
        self.ds.wait_for_range_reads(self._stop)  # a cold start's first batches are read by range: they have the link
        for s in self.ds.node.to_fetch(self.ds.on_node):
            if self._stop.is_set():
                return
            try:
                if not self.ds.node.admits(s):
                    return  # no room without evicting what a reader needs sooner (the later shards: even less)
                self.ds.node.ensure(s, functools.partial(self.ds.fetch_raw, s), wait=False,
                                    what=f"fetching {self.ds.shard_name(s)} ahead")
                self.fetched += 1
            except cachedir.Busy:
                continue  # another thread or process is fetching it (or no room is left for it after all)
            except (DataError, OSError):
                continue  # the reader fetches it again when it needs it, and reports the error
