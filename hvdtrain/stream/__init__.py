"""Sharded datasets read lazily from disk or an object store: Mosaic's MDS format, shuffle blocks over shards, a
per-node cache.

- `dataset`: `StreamingDataset(path)` reads `index.json` only; shards are memory-mapped in the process that reads
  them (a ShmLoader's producers). `mds`: the shard layout, read and written (`MDSWriter`); `encodings`: its column
  encodings; `images`: JPEG/PNG decoded and augmented in the producers.
- `store`: where the files come from (a directory or an object store URL); `nodecache`: each shard fetched once per
  node within a byte limit; `cachereaders`: who reads a node cache; `fetcher`: background fetches of the next
  shards; `ranged`: a cold start's first batches read by range; `integrity`: a shard checked against its index's
  hash once per node before first use.
- `order`: `BlockShuffle`, the epoch's order over shards.
- The `hvdtrain data` commands, one module each: `convert` (with `sources` and `imagefolder`, what it reads),
  `upload`, `inspect`, `verify`; what they share: `labels` (a split's labels and their spread), `splits` (where a
  dataset's splits are).
- `errors`: `StreamError`.

Nothing here imports horovod, torch or TensorFlow.
"""

from __future__ import annotations

from hvdtrain.stream.dataset import StreamingDataset
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.mds import MDSWriter
from hvdtrain.stream.order import BlockShuffle

__all__ = ["BlockShuffle", "MDSWriter", "StreamError", "StreamingDataset"]
