"""The epoch's global sample order over a sharded dataset: shuffle blocks of several shards.

A full permutation of a sharded dataset touches every shard in every stretch of the epoch, so every rank would need
the whole dataset local at once. `BlockShuffle` instead permutes the shards (seeded by `(seed, epoch)`), groups
consecutive shards of that permutation into blocks of `block_shards`, and permutes the samples inside each block. The
order mixes samples of `block_shards` shards and walks the blocks one after another, so while a block is read the
working set is that block's shards (plus what is fetched ahead). The order depends only on `(seed, epoch)` and the
shard sizes, not on the number of ranks: `ShardSampler` splits it among ranks (strided), and after a change of world
size the same global order continues (elastic).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


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
        return f"blocks of {self.block_shards} over {len(self.shard_sizes)} shards ({digest})"

    @property
    def num_samples(self) -> int:
        return int(sum(self.shard_sizes))

    def _rng(self, seed: int, epoch: int) -> np.random.Generator:
        return np.random.default_rng([seed, epoch, 0x5B10C])

    def shard_order(self, seed: int, epoch: int) -> np.ndarray:
        return self._rng(seed, epoch).permutation(len(self.shard_sizes))

    def __call__(self, seed: int, epoch: int) -> np.ndarray:
        rng = self._rng(seed, epoch)
        perm = rng.permutation(len(self.shard_sizes))
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
