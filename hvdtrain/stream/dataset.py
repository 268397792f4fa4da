"""StreamingDataset: an MDS dataset read lazily, shard by shard, in whichever process indexes it.

Constructing one reads only `index.json`. Shards are memory-mapped when a sample of theirs is first asked for, in
the process asking: a ShmLoader's producer processes (the dataset pickles without its open shards), so the trainer
never reads shard files and memory per process is the page cache's business, not the dataset size's. Compressed
shards are decompressed once per node into the cache directory (NOTE [cache files] in cachedir.py), never next to
the source, which may be read-only or shared.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.data.errors import DataError
from hvdtrain.formats import cachedir
from hvdtrain.formats.openfiles import MAX_OPEN
from hvdtrain.stream import encodings, integrity, mds, store
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.fetcher import Fetcher
from hvdtrain.stream.nodecache import NodeCache
from hvdtrain.stream.order import BlockShuffle, auto_block_shards
from hvdtrain.stream.ranged import RangedReads, default_share


class StreamingDataset:
    """The MDS dataset in directory `source` (its `index.json` and shard files).

    `fields`: the columns `take()` returns (default: every column that decodes to an array); `block_shards`: shards
    per shuffle block (`order`; None: `order.auto_block_shards`, NOTE [automatic blocks] in order.py); `cache_dir`:
    the node's cache root (default `cachedir.default_root()`); `max_open`: shards kept memory-mapped per process (the
    least recently used is unmapped beyond it: each mapping holds a file descriptor; default two blocks, at most
    `openfiles.MAX_OPEN`); `ranged`: the share of the dataset's bytes a node may read by range for a cold
    start's first batches (NOTE [first batches by range] in ranged.py; 0: never; default
    `$HVDTRAIN_STREAM_RANGED`, else 1.5%); `raw_images`: `take()` returns the `fields` that hold image files (jpeg,
    png: `raw_fields`) undecoded, as an object array of each sample's bytes (decoded and augmented by the caller:
    hvdtrain.stream.images). Safe to read from several threads (tf.data's)."""

    def __init__(self, source: str | Path, *, fields: tuple[str, ...] | None = None, block_shards: int | None = None,
                 cache_dir: str | Path | None = None, max_open: int | None = None, cache_limit: int | None = None,
                 ahead: int | None = None, fetch_threads: int = 2, ranged: float | None = None,
                 raw_images: bool = False) -> None:
        self.source = store.normalise(source)
        self.store = store.open_store(self.source)
        text = self._index_text()
        self.index = mds.parse_index(text, self.store.url(mds.INDEX))
        self.columns = dict(self.index.shards[0].columns)
        arrays = tuple(n for n, enc in self.columns.items() if enc.array_like)
        self.fields = tuple(fields) if fields is not None else arrays
        for name in self.fields:
            if name not in self.columns:
                raise StreamError(f"{self.source}: no column {name!r}; columns: {sorted(self.columns)}")
            if not self.columns[name].array_like:
                raise StreamError(f"{self.source}: column {name!r} is {self.columns[name].text!r}, which does not "
                                  f"decode to an array; batchable columns: {list(arrays)}")
        self.raw_fields = tuple(n for n in self.fields if raw_images and self.columns[n].text in encodings.IMAGE_FILES)
        sizes = np.asarray([s.samples for s in self.index.shards], dtype=np.int64)
        self.ends = np.cumsum(sizes)
        self.starts = self.ends - sizes
        if block_shards is None:
            block_shards = auto_block_shards(sizes.tolist(), [s.raw.bytes for s in self.index.shards], cache_limit)
        self.order = BlockShuffle.of(sizes.tolist(), block_shards)
        self._index_digest = hashlib.sha256(text.encode()).hexdigest()
        self.node = NodeCache(
            cachedir.dataset_dir(Path(cache_dir) if cache_dir else cachedir.default_root(), self.source),
            [self._cache_name(s) for s in range(self.num_shards)], [s.raw.bytes for s in self.index.shards],
            self.order, limit=cache_limit, ahead=block_shards if ahead is None else ahead)
        self.cache_dir = self.node.dir
        self.max_open = max_open or min(max(8, 2 * block_shards + 2), MAX_OPEN)
        self.fetch_threads = fetch_threads
        self._readers: OrderedDict[int, mds.ShardReader] = OrderedDict()
        self._lock = threading.Lock()
        self._fetcher = Fetcher(self)
        self._ranged = RangedReads(default_share() if ranged is None else ranged)
        in_place = [s.raw for i, s in enumerate(self.index.shards) if self._in_place(i)]
        if note := integrity.unverifiable(in_place, str(self.source)):
            warnings.warn(note, stacklevel=2)
        self._ranged.eligible = self._ranged.share > 0 and self.store.local_dir is None and all(
            info.zip is None and mds.stacks(info, self.fields) for info in self.index.shards)

    def _index_text(self) -> str:
        try:
            data = self.store.get(mds.INDEX)
        except DataError as e:
            if self.store.local_dir is not None and not (self.store.local_dir / mds.INDEX).exists():
                raise StreamError(f"{self.store.url(mds.INDEX)} does not exist: not an MDS dataset (write one with "
                                  "`hvdtrain data convert SRC DST`)") from None
            raise StreamError(f"cannot read the dataset's index: {e}") from None
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise StreamError(f"{self.store.url(mds.INDEX)}: cannot read ({e})") from None

    # ---- size and layout -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.ends[-1])

    @property
    def num_shards(self) -> int:
        return len(self.index.shards)

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.index.meta)

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of each global sample index; IndexError for one out of range."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = idx[(idx < 0) | (idx >= len(self))][0]
            raise IndexError(f"sample {bad} is out of range for {self.source} ({len(self)} samples)")
        shard = np.searchsorted(self.ends, idx, side="right")
        return shard, idx - self.starts[shard]

    # ---- reading -------------------------------------------------------------------------------------------

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Every column of sample `i`, decoded (copied out of the shard)."""
        shard, row = self.locate(np.asarray([i]))
        with self._lock:
            sample = self._reader(int(shard[0])).sample(int(row[0]))
        return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in sample.items()}  # writable

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The `fields` of the samples `indices`, stacked into arrays in that order (one copy per shard touched
        when every column has a fixed size; else decoded sample by sample)."""
        shard, rows = self.locate(indices)
        out: dict[str, np.ndarray] = {}
        touched = np.unique(shard)
        by_range: dict[int, dict[str, np.ndarray]] = {}
        if self._ranged.left > 0:
            by_range = self._by_range(shard, rows, touched)
        elif self._ranged.holding and not all(self._local(int(s)) for s in touched):
            self._ranged.wait()  # another process's first batch is read by range (NOTE [first batches by range])
        for s in touched:
            where = np.flatnonzero(shard == s)
            part = by_range[int(s)] if int(s) in by_range else self._read_rows(int(s), rows[where])
            for name in self.fields:
                if name not in out:
                    out[name] = np.empty((len(shard), *part[name].shape[1:]), part[name].dtype)
                elif out[name].shape[1:] != part[name].shape[1:] or out[name].dtype != part[name].dtype:
                    raise StreamError(f"{self.source}: column {name!r} is {part[name].dtype}{part[name].shape[1:]} "
                                      f"in {self.shard_name(int(s))} but {out[name].dtype}{out[name].shape[1:]} in "
                                      "another shard; a batch needs one shape")
                out[name][where] = part[name]
        self._noted(touched)
        return out

    def _by_range(self, shard: np.ndarray, rows: np.ndarray, touched: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
        """The rows of the shards of this batch that are not local, read by range if this is one of a cold start's
        first batches (NOTE [first batches by range] in ranged.py); else {}."""
        missing = {int(s): rows[shard == s] for s in touched if not self._local(int(s))}
        return self._ranged.read(self, missing, self._local)  # (nothing missing still counts as a first take)

    def _local(self, s: int) -> bool:
        return s in self._readers or self.on_node(s)

    # ---- what the fetcher and the range reads use (fetcher.FetchSource, ranged.RangedSource) --------------------

    def on_node(self, s: int) -> bool:
        """Shard `s` can be read on this node without a fetch: in place, or in the node cache."""
        return self._in_place(s) or self.node.path(s).exists()

    def wait_for_range_reads(self, stop: threading.Event | None = None) -> None:
        """While a cold start's first batches are read by range (NOTE [first batches by range] in ranged.py), wait
        for them (at most ranged.HOLD_S), or until `stop` is set."""
        self._ranged.wait(stop)

    @contextlib.contextmanager
    def mapped(self, s: int) -> Iterator[mds.ShardReader | None]:
        """Shard `s`'s reader if it is mapped in this process now (else None), kept mapped for the `with` block."""
        with self._lock:
            yield self._readers.get(s)

    def _read_rows(self, s: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        with self._lock:  # a reader may be unmapped by another thread's _reader() otherwise
            reader = self._reader(s)
            block = reader.column_block(rows, self.fields)
            if block is not None:
                return block
            samples = [reader.sample(int(r), self.fields, self.raw_fields) for r in rows]
        out = {}
        for name in self.fields:
            if name in self.raw_fields:  # encoded bytes, one object per sample
                out[name] = np.empty(len(samples), object)
                out[name][:] = [sample[name] for sample in samples]
                continue
            values = [np.asarray(sample[name]) for sample in samples]
            shapes = {v.shape for v in values}
            if len(shapes) > 1:
                raise StreamError(f"{self.shard_name(s)}: column {name!r} has samples of shapes {sorted(shapes)}; "
                                  "a batch needs one shape (resize when converting)")
            out[name] = np.stack(values)
        return out

    def shard_name(self, s: int) -> str:
        return self.store.url(self.index.shards[s].remote_file.basename)

    def _reader(self, s: int) -> mds.ShardReader:
        """Shard `s` memory-mapped (fetched or decompressed into the node cache first unless it is a raw shard on
        a filesystem); call with the lock held. Beyond `max_open` mapped shards the least recently used one is
        unmapped."""
        cached = self._readers.get(s)
        if cached is not None:
            self._readers.move_to_end(s)
            return cached
        if self._in_place(s):  # NOTE [local shards verified] in integrity.py
            marker = self.node.dir.with_name(f"{self.node.dir.name}-verified") / self._cache_name(s)
            integrity.verify_once(self.local_file(s), self.index.shards[s].raw, marker, self.shard_name(s))
        for attempt in range(3):
            try:
                reader = mds.ShardReader(self.local_file(s), self.index.shards[s])
                break
            except FileNotFoundError:  # evicted by another process between ensure() and open: fetch it again
                if attempt == 2:
                    raise StreamError(f"{self.shard_name(s)}: its cached copy in {self.cache_dir} keeps "
                                      "disappearing (is the cache limit far too small?)") from None
        try:
            self._ranged.check(self, s, reader)  # rows read by range before the shard was here
        except BaseException:
            reader.close()
            raise
        self._readers[s] = reader
        while len(self._readers) > self.max_open:
            self._readers.popitem(last=False)[1].close()
        return reader

    def _in_place(self, s: int) -> bool:
        return self.store.local_dir is not None and self.index.shards[s].zip is None

    def local_file(self, s: int) -> Path:
        """Shard `s`'s raw file on this node: read in place (a raw shard on a filesystem) or in the node cache."""
        local = self.store.local_dir
        if local is not None and self._in_place(s):
            return local / self.index.shards[s].raw.basename
        return self.node.ensure(s, lambda: self.fetch_raw(s), what=f"fetching {self.shard_name(s)}")

    def fetch_raw(self, s: int) -> bytes | memoryview:
        """Shard `s`'s raw bytes from the store, checked against the index (size, hashes) and decompressed."""
        info = self.index.shards[s]
        remote, url = info.remote_file, self.shard_name(s)
        try:
            data = self.store.get(remote.basename)
        except DataError:
            if self.store.local_dir is not None and not (self.store.local_dir / remote.basename).exists():
                raise StreamError(f"{url}: listed in {self.store.url(mds.INDEX)} but missing") from None
            raise
        if len(data) != remote.bytes:
            raise StreamError(f"{url}: {len(data)} bytes, but the index says {remote.bytes} (a truncated or "
                              "replaced shard: corrupt; upload it again)")
        mds.check_hashes(remote, data, url)
        if info.zip is None:
            return data
        try:
            raw = mds.decompress(info.compression or "zstd", data)
        except Exception as e:  # zstandard raises its own ZstdError
            raise StreamError(f"{url}: cannot decompress ({e}) (corrupt shard)") from None
        mds.check_hashes(info.raw, raw, f"{url} (decompressed)")
        return raw

    def _cache_name(self, s: int) -> str:
        """The cached raw file's name: the shard's name plus a digest of what identifies this version of it (its
        index entry; for a local compressed shard also its size and mtime; for a remote one the whole index), so a
        rewritten dataset never reads an old copy."""
        info = self.index.shards[s]
        remote = info.remote_file
        if self.store.local_dir is not None:
            try:
                st = os.stat(self.store.local_dir / remote.basename)
                stamp = f"{st.st_size}:{st.st_mtime_ns}"
            except FileNotFoundError:
                stamp = "missing"  # fetch_raw() names the missing file
        else:
            stamp = self._index_digest
        key = f"{remote.basename}|{remote.bytes}|{sorted(remote.hashes.items())}|{info.raw.bytes}|{stamp}"
        return f"{info.raw.basename.replace('/', '_')}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    # ---- the loader's plan: fetch ahead, evict by next use ------------------------------------------------------

    def plan_epoch(self, seed: int, epoch: int, last: bool = False, leads: bool = True) -> None:
        """The coming reads follow `BlockShuffle(seed, epoch)` (the loader's producers call this): shards are
        fetched ahead of that order in the background and evicted by next use (NOTE [eviction by next use]);
        `last`: no epoch follows (nothing of the next one is fetched ahead); `leads`: this process makes the
        reader's first batch of the plan (only that one may be read by range, NOTE [first batches by range])."""
        self.node.plan(seed, epoch, last)
        self._ranged.planned(self.node.dir, leads)
        self._fetcher.wake()

    def _noted(self, shards: np.ndarray) -> None:
        """After reading `shards`: move the cursor, wake the fetcher, unmap shards outside the protected window
        (so the disk blocks of evicted ones are freed)."""
        if self.node.epoch_order is None:
            return
        before = self.node.cursor
        for s in shards:
            self.node.note_read(int(s))
        if self.node.cursor != before:
            self._fetcher.wake()
            keep = self.node.protected()
            with self._lock:
                for s in [s for s in self._readers if s not in keep]:
                    self._readers.pop(s).close()

    def close(self) -> None:
        self._ranged.release()
        self._fetcher.stop()
        self.node.close()
        with self._lock:
            while self._readers:
                self._readers.popitem()[1].close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()  # open mappings stay in their process
        del state["_lock"], state["_fetcher"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._fetcher = Fetcher(self)

    def __repr__(self) -> str:
        return f"StreamingDataset({self.source!r}, samples={len(self)}, shards={self.num_shards})"
