"""B6, mosaicml-streaming 0.13.0: `streaming.MDSWriter` + `streaming.StreamingDataset` + `StreamingDataLoader`.

Settings (the library's documented defaults except where the bench fixes a value):
- write: `MDSWriter(columns={"x": "ndarray:uint8:<record_bytes>", "y": "int64"}, size_limit=--shard-bytes,
  compression=None)`. x is a fixed-shape uint8 ndarray column so hvdtrain's MDS reader reads the same shards
  (`sys_hvdtrain.py write` calls this writer; `streaming` is imported lazily for that reason).
- read: `StreamingDataset(remote=s3://..., local=--cache-dir, shuffle=True, shuffle_seed=--seed,
  batch_size=--batch-size, cache_limit=--cache-limit if > 0)`, everything else default (shuffle_algo py1e,
  partition_algo relaxed, predownload 8*batch_size, num_canonical_nodes = physical nodes), read through
  `StreamingDataLoader(num_workers=--workers, batch_size=--batch-size)` (default collate, non-persistent workers).
  S3: streaming's boto3 client takes its endpoint from S3_ENDPOINT_URL, set here from AWS_ENDPOINT_URL.
- Epochs: StreamingDataset counts epochs itself (in shared memory, one per pass of the loader), so
  `batches(epoch)` is one full pass of the loader (`epoch` itself is not needed; a resumed loader takes its epoch
  from the state).
- Resume: `StreamingDataLoader.state_dict()` / `load_state_dict()` (mid-epoch, by samples seen on all ranks).

Limitations: a local source is read in place (`local=source, remote=None`): nothing is copied to --cache-dir and
no cache limit is applied (with no remote, streaming's eviction would delete the source shards). The cache limit
is node-wide (shared by the ranks) and must be at least 4x the largest shard or the dataset refuses to start
(ValueError), e.g. 50 MB with 16 MiB shards. A limit that passes that check is soft: space is only counted when a
download completes, so concurrent downloads (2 per loader worker) overshoot it, and with 2 ranks x 2 workers all 10
shards of the 164 MB set were fetched at once and never evicted (70 MB limit); where it does evict, the default
shuffle block (262144 samples, the whole set here) makes it thrash (1 rank: ~3k samples in 90 s).
Streaming keeps its coordination state in named shared memory: `clean_stale_shared_memory()` runs before each
dataset is built, and close drops the dataset. `import streaming` imports torchvision,
which is why bench/b6/setup.sh installs PyPI's CUDA build of torch (torchvision's operators need it).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import main, record


def _streaming() -> ModuleType:
    """`import streaming`, lazily: sys_hvdtrain.py imports this module's `write` from hvdtrain's venv."""
    import streaming
    import streaming.base.util

    return streaming


def write(args: argparse.Namespace) -> None:
    columns = {"x": f"ndarray:uint8:{args.record_bytes}", "y": "int64"}
    with _streaming().MDSWriter(out=args.out, columns=columns, size_limit=args.shard_bytes, compression=None) as out:
        for i in range(args.samples):
            out.write({"x": np.frombuffer(record(i, args.record_bytes), np.uint8), "y": i})


class Reader:
    def __init__(self, args: argparse.Namespace, state: dict[str, Any] | None) -> None:
        streaming = _streaming()
        if os.environ.get("AWS_ENDPOINT_URL"):
            os.environ.setdefault("S3_ENDPOINT_URL", os.environ["AWS_ENDPOINT_URL"])
        remote = args.source if "://" in args.source else None
        local = args.cache_dir if remote else args.source
        limit = args.cache_limit if remote and args.cache_limit > 0 else None
        streaming.base.util.clean_stale_shared_memory()  # leftovers of earlier runs (a barrier over the ranks)
        self.dataset = streaming.StreamingDataset(remote=remote, local=local, shuffle=True, shuffle_seed=args.seed,
                                                  batch_size=args.batch_size, cache_limit=limit)
        self.loader = streaming.StreamingDataLoader(self.dataset, batch_size=args.batch_size,
                                                    num_workers=args.workers)
        if state is not None:
            self.loader.load_state_dict(state)

    def batches(self, epoch: int) -> Iterator[tuple[np.ndarray, int]]:
        for batch in self.loader:
            x = batch["x"]
            yield batch["y"].numpy().astype(np.int64), x.numel() * x.element_size()

    def state_dict(self) -> dict[str, Any] | None:
        return self.loader.state_dict()

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()
        del self.loader, self.dataset
        gc.collect()


def build(args: argparse.Namespace, state: Any) -> Reader:
    return Reader(args, state)


if __name__ == "__main__":
    sys.exit(main(write, build))
