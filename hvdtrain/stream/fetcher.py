"""Background fetching of the shards a reader will need next (threads inside the reading process).

Started by the first `wake()` (the loader's `plan_epoch`, then every move of the reading position), the threads
walk `NodeCache.upcoming()` — the rest of the current shuffle block, the next block and `ahead` more shards — and
fetch each missing one into the node cache without waiting on a lock (`wait=False`): a shard another thread or
process is already fetching is skipped, so the readers and fetchers of every rank on the node together fetch
each shard once, several at a time. Errors are not raised here: the reader that needs the shard fetches it itself
and reports the error with the URL (StreamError). The threads are daemons (a process that exits mid-fetch leaves a
`.part` file that the next producer of that shard removes, NOTE [cache files]) and `stop()` ends them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from hvdtrain.stream import cache
from hvdtrain.stream.errors import StreamError

if TYPE_CHECKING:
    from hvdtrain.stream.dataset import StreamingDataset


class Fetcher:
    def __init__(self, dataset: StreamingDataset) -> None:
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
            for s in self.ds.node.upcoming():
                if self._stop.is_set():
                    return
                if self.ds._in_place(s) or self.ds.node.path(s).exists():
                    continue
                try:
                    if not self.ds.node.admits(s):
                        break  # no room without evicting what a reader needs sooner (the later shards: even less)
                    self.ds.node.ensure(s, lambda s=s: self.ds.fetch_raw(s), wait=False,
                                        what=f"fetching {self.ds.shard_name(s)} ahead")
                    self.fetched += 1
                except cache.Busy:
                    continue  # another thread or process is fetching it (or no room is left for it after all)
                except (StreamError, OSError):
                    continue  # the reader fetches it again when it needs it, and reports the error
