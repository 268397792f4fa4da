"""B6 system `wds`: webdataset 1.0.2 (tar shards, `WebDataset` pipeline, `WebLoader`).

Settings (the documented pipeline; see `_harness.py` for the contract):
- write: `ShardWriter("shard-%06d.tar", maxsize=args.shard_bytes, maxcount=10**9)`, samples
  {"__key__": "%09d", "x.bin": record(i), "y.cls": i}; plus `shards.txt` (one shard name a line), since
  WebDataset has no index of its own and the reader must be given the shard list. ShardWriter's maxsize counts
  payload bytes only, so the tar files are larger (512-byte headers, 512-byte padding of y.cls): 8 KiB records give
  24.1 MB shards (+44%), 100 KiB records 17.4 MB (+4%).
- read: `WebDataset(urls, nodesplitter=split_by_node, shardshuffle=100, detshuffle=True, seed=args.seed,
  cache_dir=args.cache_dir)` (workersplitter is the default `split_by_worker`), then a 1000-sample shuffle buffer
  (`detshuffle(1000)`, the seeded, epoch-aware form of `.shuffle(1000)`), `.decode()` (x.bin stays raw bytes,
  y.cls becomes int), `.to_tuple("x.bin", "y.cls")`, `.batched(args.batch_size)`, and
  `WebLoader(ds, batch_size=None, num_workers=args.workers)`.
- epochs: the library reseeds its `detshuffle` stages with seed + epoch; the loader's workers are not persistent,
  so each epoch gets a fresh copy of the pipeline, and we set the stages' epoch before every epoch so that each
  epoch's order differs and is reproducible.
- sources: a local directory is read as plain file paths (FileCache passes local files through, nothing cached);
  `s3://bucket/prefix` becomes webdataset's `pipe:curl -s -L --fail --aws-sigv4 aws:amz:<region>:s3 --user
  "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" <AWS_ENDPOINT_URL>/<bucket>/<prefix>/<shard>` (path-style URL;
  signed because moto answers anonymous GETs with 403 unless the object is public-read, which objects written by a
  plain PutObject are not; `shards.txt` is fetched once with the same curl). With `cache_dir`, FileCache downloads
  each whole shard to the cache before reading it; later epochs read the cached file, no GET. (FileCache names
  cached files by the URL-quoted tail of the pipe command: WebDataset's url_to_name is not passed on to it.)

Limitations:
- No mid-epoch resume: `state_dict()` returns None.
- Sharding is by whole shards, after `split_by_node` and `split_by_worker` (shard shuffle comes after the split):
  each rank always reads the same shards, every sample is seen once per epoch, but ranks get unequal sample
  counts when the shard count or the last shard's size does not divide evenly.
- Cache bound: WebDataset's `cache_size` (default -1, unbounded) is its only limit; we pass args.cache_limit when
  > 0. It is an LRU sweep (`LRUCleanup`) run only before a download and at most every 30 s per worker process, so
  the cache can overshoot the limit in between; eviction may force re-downloads in later epochs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds
from webdataset.filters import detshuffle

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import main, record


def write(args: argparse.Namespace) -> None:
    out = Path(args.out)
    names: list[str] = []
    with wds.ShardWriter(pattern=f"{out}/shard-%06d.tar", maxsize=args.shard_bytes, maxcount=10**9, verbose=0,
                         post=lambda fname: names.append(Path(fname).name)) as sink:
        for i in range(args.samples):
            sink.write({"__key__": f"{i:09d}", "x.bin": record(i, args.record_bytes), "y.cls": i})
    (out / "shards.txt").write_text("".join(f"{n}\n" for n in names))


def shard_urls(source: str) -> list[str]:
    """The shard URLs: plain paths for a local directory, `pipe:curl ...` of the path-style HTTP URL for s3://."""
    if not source.startswith("s3://"):
        root = Path(source)
        return [str(root / n) for n in (root / "shards.txt").read_text().split()]
    bucket, _, prefix = source[len("s3://"):].partition("/")
    base = f"{os.environ['AWS_ENDPOINT_URL'].rstrip('/')}/{bucket}/{prefix.strip('/')}".rstrip("/")
    # SigV4-signed GETs (curl's --aws-sigv4): moto refuses anonymous GETs of objects with the default private ACL.
    # The shell of webdataset's pipe: expands the credentials from the environment, so they stay out of the URLs.
    curl = (f"curl -s -L --fail --aws-sigv4 aws:amz:{os.environ.get('AWS_DEFAULT_REGION', 'us-east-1')}:s3"
            ' --user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY"')
    names = subprocess.run(f"{curl} {base}/shards.txt", shell=True, check=True, capture_output=True).stdout.split()
    return [f"pipe:{curl} {base}/{n.decode()}" for n in names]


class WdsReader:
    def __init__(self, args: argparse.Namespace) -> None:
        os.makedirs(args.cache_dir, exist_ok=True)  # WebDataset refuses a cache_dir that does not exist
        ds = wds.WebDataset(shard_urls(args.source), nodesplitter=wds.split_by_node, shardshuffle=100,
                            detshuffle=True, seed=args.seed, cache_dir=args.cache_dir,
                            cache_size=args.cache_limit if args.cache_limit > 0 else -1)
        ds = ds.compose(detshuffle(1000, seed=args.seed)).decode().to_tuple("x.bin", "y.cls")
        self.ds = ds.batched(args.batch_size)
        self.loader = wds.WebLoader(self.ds, batch_size=None, num_workers=args.workers)

    def batches(self, epoch: int) -> Iterator[tuple[np.ndarray, int]]:
        for stage in self.ds.pipeline:
            if isinstance(stage, detshuffle):
                stage.epoch = epoch - 1  # run() increments it, then seeds with seed + epoch
        for xs, ys in self.loader:
            yield np.asarray(ys, dtype=np.int64), sum(len(x) for x in xs)

    def state_dict(self) -> Any | None:
        return None  # WebDataset has no mid-epoch resume

    def close(self) -> None:
        pass  # non-persistent workers end with each epoch; no shared state left behind


def build(args: argparse.Namespace, state: Any) -> WdsReader:
    return WdsReader(args)


if __name__ == "__main__":
    sys.exit(main(write, build))
