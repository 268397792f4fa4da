"""The epoch's global sample order over a sharded dataset: shuffle blocks of several shards, serpentine epochs.

A full permutation of a sharded dataset touches every shard in every stretch of the epoch, so every rank would need
the whole dataset local at once. `BlockShuffle` instead orders the shards, groups consecutive shards of that order
into blocks of `block_shards`, and permutes the samples inside each block (seeded by `(seed, epoch)`). The order
mixes samples of `block_shards` shards and walks the blocks one after another, so while a block is read the working
set is that block's shards (plus what is fetched ahead). The order depends only on `(seed, epoch)` and the shard
sizes, not on the number of ranks: `ShardSampler` splits it among ranks (strided), and after a change of world size
the same global order continues (elastic).

NOTE [serpentine epochs]
Epoch 0's shard order is a permutation drawn from the seed. Each later epoch walks the previous epoch's shard order
backwards, shuffled within windows of `2 * block_shards` consecutive shards (window boundaries at a random offset, so
every shard moves by less than two blocks and blocks change members every epoch); samples are reshuffled inside the
blocks every epoch. Why: a node cache holding a fraction `f` of the dataset ends an epoch with the shards read last,
which this order reads first in the next epoch, so `f` of the next epoch is read locally whatever the working set
(NOTE [eviction by next use] in nodecache.py). With independent permutations per epoch the shards kept are at
random positions of the next epoch, and at most `f` minus the working set is served locally (with a 25% cache and
the default blocks of 4 over 64 shards, nothing: the working set is the whole cache). The price: the sequence of
shards is anti-correlated between consecutive epochs (it drifts apart slowly); which shards share a block, and the
order of samples, change every epoch.

NOTE [automatic blocks]
A batch mixes only the samples of one block, and many datasets are sorted by class (an image folder written class
by class, Mosaic's MDSWriter keeps the order it is given): with blocks of a few shards, a batch then holds one or
two classes and training stays at chance. Unless told otherwise, a block therefore spans `AUTO_BLOCK_SAMPLES`
samples (Mosaic streaming's default shuffle block, 262,144; every shard of a smaller dataset, which is then one
uniform shuffle), and under a cache limit as many shards as keep the working set (the previous, current and next
block, and one block fetched ahead) within half the limit, so that the other half still serves the next epoch
(above). `hvdtrain data convert` writes shuffled datasets, whose blocks need no mixing across classes.
"""
from __future__ import annotations

import itertools
import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# (shards, block, seed) -> {epoch: shard order} for the last few epochs computed in this process
_computed: dict[tuple[int, int, int], dict[int, np.ndarray]] = {}
_computed_lock = threading.Lock()
AUTO_BLOCK_SAMPLES = 1 << 18  # NOTE [automatic blocks]


def auto_block_shards(shard_samples: Sequence[int], shard_bytes: Sequence[int], limit: int | None = None) -> int:
    """Shards per shuffle block when none is asked for (NOTE [automatic blocks]): enough for `AUTO_BLOCK_SAMPLES`
    samples at the dataset's mean shard size, fewer when `limit` (a node cache's bytes) needs it; at least 1."""
    n = len(shard_samples)
    if n == 0:
        return 1
    mean = max(sum(shard_samples) / n, 1.0)
    block = min(n, max(1, int(np.ceil(AUTO_BLOCK_SAMPLES / mean))))
    if limit is not None:
        largest = np.cumsum(sorted(shard_bytes, reverse=True))  # the working set of k shards is at most largest[k-1]
        fits = int(np.searchsorted(largest, limit // 2, side="right"))  # shards whose bytes fit half the limit
        block = max(1, min(block, fits // 4))
    return block


@dataclass(frozen=True)
class BlockShuffle:
    """`order(seed, epoch)` -> a permutation of `range(sum(shard_sizes))` (a sample's index is its shard's start
    plus its row); `shard_order(seed, epoch)` -> the shards in the order the epoch first needs them."""

    shard_sizes: tuple[int, ...]
    block_shards: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.block_shards, int) or self.block_shards < 1:
            raise ValueError(f"block_shards must be an integer >= 1, got {self.block_shards!r}")
        if any(s < 0 for s in self.shard_sizes):
            raise ValueError(f"shard sizes must be >= 0, got {list(self.shard_sizes)}")

    @classmethod
    def of(cls, shard_sizes: Sequence[int], block_shards: int = 4) -> BlockShuffle:
        return cls(tuple(int(s) for s in shard_sizes), block_shards)

    @property
    def fingerprint(self) -> str:
        """Identifies the order (block size and shard sizes): a resume state saved under another order is refused."""
        import hashlib

        digest = hashlib.sha256(",".join(map(str, self.shard_sizes)).encode()).hexdigest()[:12]
        return f"serpentine blocks of {self.block_shards} over {len(self.shard_sizes)} shards ({digest})"

    @property
    def num_samples(self) -> int:
        return int(sum(self.shard_sizes))

    def _rng(self, seed: int, epoch: int) -> np.random.Generator:
        return np.random.default_rng([seed, epoch, 0x5B10C])

    def shard_order(self, seed: int, epoch: int) -> np.ndarray:
        """The shards in the order epoch `epoch` reads them (NOTE [serpentine epochs]): each epoch's from the one
        before, continued from the latest epoch up to `epoch` already computed in this process)."""
        if not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        n, key, epoch = len(self.shard_sizes), (len(self.shard_sizes), self.block_shards, seed), int(epoch)
        with _computed_lock:
            known = _computed.setdefault(key, {})
            done = max((e for e in known if e <= epoch), default=-1)
            order = known[done] if done >= 0 else self._rng(seed, 0).permutation(n)
        window = 2 * self.block_shards
        for e in range(max(done, 0) + 1, epoch + 1):
            rng = self._rng(seed, e)
            windows = (np.arange(n) + rng.integers(window)) // window
            order = order[::-1][np.lexsort((rng.random(n), windows))]
        with _computed_lock:
            known[epoch] = order
            for old in sorted(known)[:-4]:
                del known[old]
        return order.copy()

    def __call__(self, seed: int, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([seed, epoch, 0x5B10C, 1])  # the samples' shuffle; the shards' is shard_order's
        perm = self.shard_order(seed, epoch)
        sizes = np.asarray(self.shard_sizes, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(sizes) else sizes
        psizes, pstarts = sizes[perm], starts[perm]
        # Concatenate arange(start, start + size) for each shard in permuted order, without a Python loop.
        total = int(psizes.sum())
        order = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(psizes) - psizes - pstarts, psizes)
        bounds = np.concatenate([[0], np.cumsum(psizes)])[:: self.block_shards]
        bounds = np.append(bounds, total) if bounds[-1] != total else bounds
        for lo, hi in itertools.pairwise(bounds):
            rng.shuffle(order[lo:hi])
        return order
