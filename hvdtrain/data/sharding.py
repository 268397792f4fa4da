"""Per-rank shards of an index space: disjoint, deterministic, even, resumable and re-shardable.

The epoch's global order is a permutation of `range(num_samples)` drawn from `(seed, epoch)` (or `arange` without
shuffling). Rank `r` of `size` takes every `size`-th element of that order starting at `r` (strided sharding). Strided
sharding has one property the rest of this module relies on: after every rank has consumed `c` samples, the samples
consumed across all ranks are exactly the first `c * size` elements of the global order. So "how far the epoch has
got" is one number (global samples consumed), and a job that changes its world size (elastic) re-shards the
*remaining* suffix of the same order among the new ranks: no sample is repeated or skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from hvdtrain.data.errors import SamplerMismatch


def check_rank(rank: int, size: int) -> None:
    """ValueError unless `size >= 1` and `0 <= rank < size` (shared by every loader)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size must be an integer >= 1 (the number of ranks), got {size!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise ValueError(f"rank must be an integer in [0, size={size}), got {rank!r}")


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_unconsumed(unconsumed: int, consumed: int) -> int:
    """`unconsumed` if it is an integer in [0, consumed] (batches to take back from a resume state), else ValueError."""
    if not isinstance(unconsumed, int) or isinstance(unconsumed, bool) or not 0 <= unconsumed <= consumed:
        raise ValueError(f"unconsumed must be an integer in [0, batches_consumed={consumed}], got {unconsumed!r}")
    return unconsumed


def expected_batches(num_samples: int, size: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches per rank in a full epoch of a dataset ShmLoader / ShardSampler (the same on every rank)."""
    per_rank = num_samples // size if drop_last else math.ceil(num_samples / size)
    return math.ceil(per_rank / batch_size)


class ShardSampler:
    """This rank's indices of `range(num_samples)` for one epoch.

    - Every rank gets the same number of indices, so every rank runs the same number of steps (uneven shards hang
      collectives). With `drop_last=False` (default) the shard is **padded**: the global order is extended with
      a repeat of its own last elements up to a multiple of `size` (the samples just read: for a sharded dataset,
      in shards still local, where the first ones would need a shard fetched again), so up to `size - 1` samples
      are seen twice
      per epoch. With `drop_last=True` the last `(remaining % size)` samples of the order are **dropped** for the
      epoch (a different few each epoch when shuffling).
    - `even=False` (evaluation only) neither pads nor drops: rank `r` gets exactly `order[r::size]`, so shards
      differ by at most one sample and batch counts may differ by one — fine for a loop without per-step
      collectives (sum metrics, then allreduce once), never for training.
    - `shuffle=True` draws the order from `(seed, epoch)`: call `set_epoch(e)` every epoch, or every epoch repeats
      epoch 0's order. `order(seed, epoch) -> permutation` replaces the uniform permutation (a sharded dataset's
      `BlockShuffle`, which keeps each stretch of the epoch inside a few shards); it must not depend on the rank
      or world size.
    - `batch_size` only gives resume state its unit: `state_dict()` records the epoch and the number of *consumed*
      batches (count them with `advance()` when a batch has been trained on, not when it was fetched; or, having
      counted fetched batches, subtract the `k` not trained on yet with `state_dict(unconsumed=k)`);
      `load_state_dict()` resumes after them. A state saved with another world size or batch size is re-sharded:
      the samples consumed globally are skipped and the remainder is split among the new ranks.
    - `__iter__` / `indices()` give the indices not yet consumed in the current epoch; `__len__` counts them.
    """

    def __init__(self, num_samples: int, rank: int, size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, batch_size: int = 1, even: bool = True,
                 order: Callable[[int, int], np.ndarray] | None = None) -> None:
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 0:
            raise ValueError(f"num_samples must be an integer >= 0, got {num_samples!r}")
        check_rank(rank, size)
        check_positive("batch_size", batch_size)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.num_samples, self.rank, self.size = num_samples, rank, size
        self.seed, self.shuffle, self.drop_last, self.batch_size = seed, shuffle, drop_last, batch_size
        self.even, self.order = even, order
        self.epoch = 0
        self.offset = 0  # global samples of this epoch consumed before this sampler's shard began (re-sharding)
        self.batches_consumed = 0

    # ---- epoch and position --------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch than the current one starts at its beginning."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.rewind()

    def rewind(self) -> None:
        """Back to the beginning of the current epoch (forgets resume state)."""
        self.offset, self.batches_consumed = 0, 0

    def advance(self, batches: int = 1) -> None:
        """Record `batches` more batches as consumed (trained on) in this epoch."""
        if not isinstance(batches, int) or batches < 0:
            raise ValueError(f"batches must be an integer >= 0, got {batches!r}")
        self.batches_consumed = min(self.batches_consumed + batches, self.shard_batches)

    # ---- the shard -----------------------------------------------------------------------------------------

    @property
    def shard_size(self) -> int:
        """Indices this rank gets in the current epoch, counted from `offset` (consumed or not)."""
        remaining = self.num_samples - self.offset
        if not self.even:
            return len(range(self.rank, remaining, self.size))
        return remaining // self.size if self.drop_last else math.ceil(remaining / self.size)

    @property
    def shard_batches(self) -> int:
        return math.ceil(self.shard_size / self.batch_size)

    @property
    def num_batches(self) -> int:
        """Batches of `batch_size` not yet consumed in this epoch (the last may be partial; same on every rank)."""
        return self.shard_batches - self.batches_consumed

    def global_order(self) -> np.ndarray:
        """The epoch's order of all samples (identical on every rank)."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        if self.order is not None:
            order = np.asarray(self.order(self.seed, self.epoch), dtype=np.int64)
            if order.shape != (self.num_samples,):
                raise ValueError(f"order({self.seed}, {self.epoch}) returned an array of shape {order.shape} for "
                                 f"{self.num_samples} samples; it must be a permutation of range({self.num_samples})")
            return order
        rng = np.random.default_rng([self.seed, self.epoch])
        return rng.permutation(self.num_samples).astype(np.int64, copy=False)

    def shard(self) -> np.ndarray:
        """This rank's whole shard of the current epoch (from `offset`), consumed part included."""
        rest = self.global_order()[self.offset:]
        if not self.even:
            return rest[self.rank::self.size]
        total = self.shard_size * self.size
        if len(rest) == 0 or total == 0:
            return np.empty(0, dtype=np.int64)
        if total <= len(rest):
            return rest[:total][self.rank::self.size]  # an exact fit, or drop_last: the tail dropped
        pad = np.resize(rest[::-1], total - len(rest))[::-1]  # the last elements again (cyclically if too few)
        return np.concatenate([rest, pad])[self.rank::self.size]

    def indices(self) -> np.ndarray:
        """This rank's indices not yet consumed in the current epoch."""
        return self.shard()[self.batches_consumed * self.batch_size:]

    def batches(self) -> list[np.ndarray]:
        """`indices()` cut into batches of `batch_size` (the last may be partial)."""
        idx = self.indices()
        return [idx[i:i + self.batch_size] for i in range(0, len(idx), self.batch_size)]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return max(0, self.shard_size - self.batches_consumed * self.batch_size)

    # ---- resume --------------------------------------------------------------------------------------------

    @property
    def samples_consumed(self) -> int:
        """Samples of this epoch's global order consumed by all ranks together (a prefix of the order: the
        padding repeats are not counted, so a finished padded epoch reports `num_samples`)."""
        return self._samples_after(self.batches_consumed)

    def _samples_after(self, batches: int) -> int:
        """`samples_consumed` once every rank has consumed `batches` batches of its shard."""
        cap = self.num_samples if not self.even else min(self.offset + self.shard_size * self.size, self.num_samples)
        return min(self.offset + batches * self.batch_size * self.size, cap)

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        """The resume state: epoch, batches consumed, and what re-sharding needs (`load_state_dict`).

        `unconsumed=k`: the state as it was `k` batches ago, for a caller that has taken `k` batches past the last
        one trained on (a device prefetcher's look-ahead); ValueError unless 0 <= k <= batches consumed."""
        batches = self.batches_consumed - check_unconsumed(unconsumed, self.batches_consumed)
        return {"epoch": self.epoch, "batches_consumed": batches, "batch_size": self.batch_size,
                "size": self.size, "offset": self.offset, "samples_consumed": self._samples_after(batches),
                "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "order": self.order_name}

    @property
    def order_name(self) -> str:
        """What orders the epoch: 'uniform' (a permutation), 'none' (no shuffle), or `order.fingerprint`."""
        if not self.shuffle:
            return "none"
        return "uniform" if self.order is None else str(getattr(self.order, "fingerprint", repr(self.order)))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at `state`. Same world size and batch size: exactly where it stopped. Otherwise the samples
        consumed globally (`samples_consumed`) are skipped and the rest of the epoch is re-sharded."""
        missing = {"epoch", "batches_consumed", "batch_size", "size", "offset"} - set(state)
        if missing:
            raise ValueError(f"sampler state is missing {sorted(missing)}; got keys {sorted(state)}")
        for key in ("num_samples", "seed", "shuffle", "order_name"):
            saved = "order" if key == "order_name" else key  # states of older versions lack "order": accepted
            if saved in state and state[saved] != getattr(self, key):
                raise SamplerMismatch(f"sampler state has {saved}={state[saved]!r} but this sampler has "
                                      f"{saved}={getattr(self, key)!r}: it belongs to another data set or order")
        self.epoch = int(state["epoch"])
        if state["size"] == self.size and state["batch_size"] == self.batch_size:
            self.offset, self.batches_consumed = int(state["offset"]), 0
            self.advance(int(state["batches_consumed"]))
        else:
            consumed = int(state["offset"]) + int(state["batches_consumed"]) * int(state["batch_size"]) * int(
                state["size"])
            self.offset, self.batches_consumed = min(consumed, self.num_samples), 0

    def __repr__(self) -> str:
        return (f"ShardSampler(num_samples={self.num_samples}, rank={self.rank}, size={self.size}, "
                f"epoch={self.epoch}, batches_consumed={self.batches_consumed})")
