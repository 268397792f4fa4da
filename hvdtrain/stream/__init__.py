"""Sharded datasets read lazily from disk: Mosaic's MDS format, shuffle blocks over shards, a per-node cache.

`StreamingDataset(path)` reads `index.json` only; shards are memory-mapped in the process that reads them (a
ShmLoader's producers). `hvdtrain data convert` writes MDS from arrays or image folders; `hvdtrain data inspect`
describes a dataset. Nothing here imports horovod, torch or TensorFlow.
"""

from __future__ import annotations

from hvdtrain.stream.dataset import StreamingDataset
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.mds import MDSWriter
from hvdtrain.stream.order import BlockShuffle

__all__ = ["BlockShuffle", "MDSWriter", "StreamError", "StreamingDataset"]
