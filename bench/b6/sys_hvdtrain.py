"""B6, hvdtrain's side: `hvdtrain.stream.StreamingDataset` + `ShmLoader`, as the recipes use them.

hvdtrain's native format is Mosaic's MDS, so it reads the very shards `sys_mosaic.py write` made (a dataset written
by mosaicml-streaming works as it is); `write` here is that writer. Settings: the recipes' (shuffle blocks of 4
shards, `block_shards=4`; the node cache in `--cache-dir` bounded by `--cache-limit`; 2 producer processes, batches
handed over in shared memory). The transport is obstore, pointed at the server by AWS_ENDPOINT_URL. Run with
hvdtrain's venv (`.venv/bin/python`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _harness import main

from hvdtrain.data import ShmLoader
from hvdtrain.formats import arrays
from hvdtrain.stream import StreamingDataset


class Reader:
    def __init__(self, args: argparse.Namespace, state: dict[str, Any] | None) -> None:
        self.data = StreamingDataset(args.source, fields=("x", "y"), cache_dir=args.cache_dir,
                                     cache_limit=args.cache_limit or None)
        self.loader = ShmLoader(self.data, rank=args.rank, size=args.world, batch_size=args.batch_size,
                                num_workers=args.workers, seed=args.seed, fetch=arrays.take, order=self.data.order,
                                timeout=600, epochs=args.epochs)
        self.resumed = state is not None
        if state is not None:
            self.loader.load_state_dict(state)

    def batches(self, epoch: int) -> Iterator[tuple[np.ndarray, int]]:
        if not self.resumed:
            self.loader.set_epoch(epoch)
        self.resumed = False
        for batch in self.loader:
            yield batch["y"], batch["x"].nbytes

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def close(self) -> None:
        self.loader.close()
        self.data.close()


def write(args: argparse.Namespace) -> None:
    from sys_mosaic import write as mosaic_write  # MDS: the same writer (needs mosaicml-streaming)

    mosaic_write(args)


if __name__ == "__main__":
    sys.exit(main(write, lambda args, state: Reader(args, state)))
