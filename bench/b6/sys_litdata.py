"""B6 system: litdata 0.2.76 (Lightning AI), `optimize` writer + `StreamingDataset` / `StreamingDataLoader`.

Write: `litdata.optimize(fn=_sample, inputs=list(range(N)), output_dir=..., chunk_bytes=args.shard_bytes,
num_workers=1)`, the documented writer; each sample is `{"x": bytes, "y": int}`, no compression (the default).
One worker keeps the chunks in index order (the records are synthetic, so more workers only add spawn time).

Read: `StreamingDataset(input_dir, cache_dir=args.cache_dir, shuffle=True, seed=args.seed,
max_cache_size=args.cache_limit or None, storage_options=...)` and `StreamingDataLoader(ds, batch_size, num_workers)`;
all other settings are litdata's defaults (max_pre_download=2, drop_last=True under distributed, which litdata detects
from torch.distributed). The loader counts epochs itself and calls `set_epoch` on the dataset; `batches(epoch)` pins
its counter so epoch e is litdata's epoch e + 1 (what it would be anyway when the epochs are read in order).
Resume: `StreamingDataLoader.state_dict()` / `load_state_dict()`.

Sources: a local directory is read in place (litdata's default "POSIX-fast" path mmaps the chunks, nothing goes
into the cache). `s3://` goes through litdata's S3 client (boto3 for index.json, obstore range GETs for chunks, since
obstore is installed): AWS_ENDPOINT_URL is passed as `storage_options={"endpoint_url": ...}`; for a plain-http
endpoint `allow_http` is added to litdata's obstore client options (obstore refuses http otherwise, BadScheme).
Neither s5cmd nor Lightning cloud is used (strace: only the endpoint is connected; the PyPI version check is off).

Two departures from the bare defaults, both needed to run at all:
- `collate_fn=_collate`: iteration returns `bytes` fields as memoryviews, which default_collate explodes into
  record_bytes tensors per batch (each a shared-memory fd through the worker queue: "Too many open files").
- the obstore `allow_http` above (an http test endpoint only).

Limitation: a bounded cache (`max_cache_size` < dataset) is honoured on disk (it stays at the budget) but deadlocks
as soon as more than one process reads through it (2 ranks, or 2 workers): a process waits for a disk slot held by
chunks that another has not released, and after 120 s litdata raises ChunkWaitTimeoutError. Seen here at 50, 70 and
140 MB of a 164 MB dataset; one process with <= 1 worker works. drop_last=True (litdata's distributed default) drops
N mod (world * batch_size) samples per epoch; shuffling is per chunk plus a 256-item window inside the chunk.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import main, record


def _sample(i: int, nbytes: int) -> dict[str, Any]:
    return {"x": record(i, nbytes), "y": i}


def _collate(items: list[dict[str, Any]]) -> Any:
    """litdata's collate after turning `x` into bytes: iteration hands `bytes` fields out as memoryviews of the
    chunk, which torch's default_collate treats as sequences (8192 tensors of shape [batch] per batch, one shared-memory
    fd each: "Too many open files" within the first batches), and which cannot be pickled out of a worker anyway."""
    from litdata.streaming.collate import litdata_collate

    return litdata_collate([{**it, "x": bytes(it["x"])} for it in items])


def write(args: argparse.Namespace) -> None:
    import litdata

    litdata.optimize(fn=functools.partial(_sample, nbytes=args.record_bytes), inputs=list(range(args.samples)),
                     output_dir=str(Path(args.out).resolve()), chunk_bytes=args.shard_bytes, num_workers=1,
                     mode="overwrite", verbose=False)


class LitReader:
    def __init__(self, args: argparse.Namespace, state: Any) -> None:
        from litdata import StreamingDataLoader, StreamingDataset

        storage: dict[str, Any] | None = None
        source = args.source
        if source.startswith("s3://"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                storage = {"endpoint_url": endpoint}
                if endpoint.startswith("http://"):  # obstore (chunk GETs) refuses plain http unless told
                    from litdata.streaming import downloader

                    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
        else:
            source = str(Path(source).resolve())
        Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
        self.ds = StreamingDataset(input_dir=source, cache_dir=args.cache_dir, shuffle=True, seed=args.seed,
                                   max_cache_size=args.cache_limit if args.cache_limit > 0 else None,
                                   storage_options=storage)
        self.loader = StreamingDataLoader(self.ds, batch_size=args.batch_size, num_workers=args.workers,
                                          collate_fn=_collate)
        if state is not None:
            self.loader.load_state_dict(state)

    def batches(self, epoch: int) -> Iterator[tuple[np.ndarray, int]]:
        if not self.loader.restore:  # a resumed loader keeps the checkpoint's epoch
            self.loader.current_epoch = epoch  # __iter__ adds 1 and calls dataset.set_epoch
        for batch in self.loader:
            idx = batch["y"].numpy().astype(np.int64)
            yield idx, sum(len(x) for x in batch["x"])

    def state_dict(self) -> Any | None:
        return self.loader.state_dict()

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        del self.loader, self.ds


def build(args: argparse.Namespace, state: Any) -> LitReader:
    return LitReader(args, state)


if __name__ == "__main__":
    sys.exit(main(write, build))
