"""Datasets and generators for the loader tests. Torch-free on purpose: producer processes import this module
(cloudpickle sends module-level functions by reference), and importing torch there would cost seconds per worker."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hvdtrain.data import worker_info


class IndexDataset:
    """Sample i is (float32[3] filled with i, int64 i): a batch says exactly which indices it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        return np.full(3, i, np.float32), np.int64(i)


class RandomDataset:
    """Sample i is (i, numpy draw, python draw, worker pid): shows how each worker's RNGs were seeded."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, np.random.random(), random.random(), os.getpid()])


class FailingDataset(IndexDataset):
    def __getitem__(self, i: int) -> tuple[np.ndarray, np.int64]:
        if i == 7:
            raise KeyError(f"sample {i} is corrupt (raised inside the producer)")
        return super().__getitem__(i)


def tagged_batches(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """Three batches per worker, each naming its producer, epoch, seed and position."""
    info = worker_info()
    for j in range(3):
        yield {"tag": np.array([worker_id, num_workers, epoch, seed, j], np.int64),
               "local": np.array([info.local_id if info else -1], np.int64),
               "draw": np.random.random(2)}


def growing_batches(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    """Batches that get bigger and smaller again: slots must grow and the data must stay right."""
    for n in (0, 10, 1000, 300_000, 50, 600_000, 3):
        yield np.arange(n, dtype=np.float64) + worker_id


def endless(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """An infinite stream (the source article's data_generator shape), cut by batches_per_epoch."""
    j = 0
    while True:
        yield np.full((2, 4), worker_id, np.float32), np.array([epoch, j])
        j += 1


def counted(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    """Fast producer that records how many batches it has produced in $HVDTRAIN_TEST_COUNT_FILE."""
    path = Path(os.environ["HVDTRAIN_TEST_COUNT_FILE"])
    for j in range(50):
        path.write_text(str(j + 1))
        yield np.full(1000, j, np.int32)


def slow(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    time.sleep(30)
    yield np.zeros(1)


def bad_type(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[object]:
    yield {"x": np.zeros(2), "meta": {"nested": "dicts are not arrays"}}


def logged_fetch(ds: IndexDataset, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A batch of IndexDataset, appending "epoch first-index" to $HVDTRAIN_TEST_LOG for every batch produced."""
    info = worker_info()
    line = f"{info.epoch if info else -1} {int(indices[0])}\n".encode()
    fd = os.open(os.environ["HVDTRAIN_TEST_LOG"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return np.repeat(indices.astype(np.float32)[:, None], 3, axis=1), indices.astype(np.int64)


def many_shapes(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """More distinct batch layouts than a worker numbers (protocol.MAX_LAYOUTS), then early ones again, each batch
    saying where it came from: (float32[n, 2] filled with n, int64 [worker, j])."""
    for j, n in enumerate([*range(1, 81), 3, 1, 80, 40]):
        yield np.full((n, 2), n, np.float32), np.array([worker_id, j], np.int64)


def no_doorbell(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    """Slow batches from a producer whose doorbell never rings (NOTE [ring] (d)'s lost wake-up, every time): the
    trainer waits on its socket in vain and must find them in the ring by itself."""
    from hvdtrain.data.channel import Channel

    Channel.doorbell = lambda self: None  # type: ignore[method-assign]  # in this producer process only
    for j in range(5):
        time.sleep(0.05)
        yield np.full(4, j, np.int64)


def math_threads(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    """One batch: the producer's OPENBLAS_NUM_THREADS and OMP_NUM_THREADS (0 when unset)."""
    yield np.array([int(os.environ.get(name, "0")) for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")])


def timed_start(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    """[worker, when its generator started, when this batch was made] x 2; producer 0's first batch takes
    $HVDTRAIN_TEST_FIRST_S seconds to make (NOTE [first producer first] in hvdtrain/data/boot.py)."""
    started = time.time()
    for j in range(2):
        if worker_id == 0 and j == 0:
            time.sleep(float(os.environ.get("HVDTRAIN_TEST_FIRST_S", "0")))
        yield np.array([worker_id, started, time.time()])
