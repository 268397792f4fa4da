"""Producers forked from the trainer (the default on Linux): what NOTE [forked producers] in hvdtrain/data/forked.py
says does not carry over from the trainer, checked from inside real forked producers."""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import ShmLoader
from tests.support import harness
from tests.support import loaders as fx

pytestmark = pytest.mark.timeout(120)


def _socket_inode(fd: int) -> int:
    return os.fstat(fd).st_ino


def held_by_producer(names: list[str]) -> Iterator[np.ndarray]:
    """One batch per producer: [stdin is /dev/null, how many of `names` it maps or holds an fd of, the socket
    inodes it holds...]."""
    maps = Path("/proc/self/maps").read_text()
    links = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            links[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    sockets = [int(link[len("socket:["):-1]) for link in links.values() if link.startswith("socket:[")]
    held = sum(name in maps for name in names) + sum(name in link for name in names for link in links.values())
    yield np.array([links.get(0) == os.devnull, held, *sockets], np.int64)


def test_both_start_methods_give_the_same_batches() -> None:
    batches = {}
    for method in ("fork", "spawn"):
        with ShmLoader(fx.IndexDataset(10), rank=1, size=2, batch_size=2, num_workers=2, seed=3,
                       start_method=method) as ld:
            batches[ld.start_method] = []
            for epoch in range(2):
                ld.set_epoch(epoch)
                batches[ld.start_method].append([y.tolist() for _, y in ld])
    assert list(batches) == ["fork", "spawn"] and batches["fork"] == batches["spawn"], batches
    with ShmLoader(fx.IndexDataset(4), rank=0, size=1, batch_size=2, num_workers=1, import_main=True) as ld:
        assert ld.start_method == "spawn"  # the training script run in each producer needs a fresh interpreter


DEFAULT = r"""
import threading
import numpy as np
from hvdtrain.data import ShmLoader

def gen(w, n, e, s):
    yield np.zeros(1)

def default_method():
    with ShmLoader.from_generator(gen, rank=0, size=1, num_workers=1) as ld:
        assert len(list(ld)) == 1
        return ld.start_method

print("BEFORE", default_method())

def named(stop):  # a thread named as tokio's are (another Rust library's runtime)
    import ctypes
    ctypes.CDLL(None).prctl(15, b"tokio-rt-worker", 0, 0, 0)  # PR_SET_NAME
    ready.set()
    stop.wait(30)

ready, stop = threading.Event(), threading.Event()
worker = threading.Thread(target=named, args=(stop,))
worker.start()
ready.wait(30)
print("THREAD", default_method())
stop.set()
worker.join(30)
print("GONE", default_method())
import obstore
from obstore.store import MemoryStore
store = MemoryStore()  # obstore's tokio runtime starts with its first request
obstore.put(store, "k", b"v")
print("AFTER", default_method(), bytes(obstore.get(store, "k").bytes()))
"""


def test_the_default_forks_until_the_trainer_runs_tokio() -> None:
    """NOTE [forked producers] (d): a child forked after obstore's tokio runtime started hangs in obstore (what a
    streamed dataset reads with), so the default turns to spawn while a thread is named as tokio's, and once the
    trainer has imported obstore."""
    result = harness.run_bounded([sys.executable, "-c", DEFAULT], timeout=60, cwd=harness.REPO)
    assert result.returncode == 0, result.describe()
    assert "BEFORE fork" in result.output and "AFTER spawn b'v'" in result.output, result.describe()
    assert "THREAD spawn" in result.output and "GONE fork" in result.output, result.describe()


def test_a_forked_producer_holds_none_of_the_trainers_sockets_and_none_of_its_slots(tmp_path: Path) -> None:
    """(a): another loader's and its own loader's trainer ends (which would keep a channel open after the trainer
    died), another socket of the trainer's (a listening one, as Gloo's) and the trainer's slot segments (mapped or
    open) are not in the producer; stdin is /dev/null (stdin here is a pipe, whatever pytest's is)."""
    rd, wr = os.pipe()
    saved = os.dup(0)
    os.dup2(rd, 0)
    try:
        with socket.create_server(("127.0.0.1", 0)) as listening:
            rows, trainer_ends, names = _probe_producers()
            trainer_ends.add(os.fstat(listening.fileno()).st_ino)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, rd, wr):
            os.close(fd)
    assert len(rows) == 3 and len(names) == 6
    for devnull_stdin, held, *sockets in rows:
        assert devnull_stdin == 1 and held == 0, rows
        assert sockets and not trainer_ends & set(sockets), (rows, trainer_ends)  # its own channel end, no other


def _probe_producers() -> tuple[list[list[int]], set[int], list[str]]:
    with ShmLoader.from_generator(fx.growing_batches, rank=0, size=1, num_workers=2, start_method="fork") as first:
        next(iter(first))
        names = [seg.name.lstrip("/") for seg in first._res.segments.values()]

        def probe(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
            return held_by_producer(names)

        with ShmLoader.from_generator(probe, rank=0, size=1, num_workers=3, start_method="fork") as second:
            rows = [b.tolist() for b in second]
            trainer_ends = {_socket_inode(c.fileno()) for ld in (first, second) for c in ld._res.conns}
    return rows, trainer_ends, names


def test_a_forked_producer_does_not_hold_the_run_directorys_lock(tmp_path: Path) -> None:
    """A producer forked while the trainer holds its run directory's lock (the elastic recipe's rank 0 after a
    reset) must not keep it after the trainer released it: another claimant gets it at once."""
    from hvdtrain import rundir

    held = rundir.lock(tmp_path)
    with ShmLoader.from_generator(fx.endless, rank=0, size=1, num_workers=1, start_method="fork") as ld:
        next(iter(ld))
        held.release()
        rundir.lock(tmp_path).release()  # RunDirBusy if the producer still shared the locked file


class PerProcessState:
    """A dataset that defines how it is pickled, to make its per-process state again (an open file, a client):
    a forked producer gets its own copy, as a spawned one would."""

    def __init__(self) -> None:
        self.opened_in = os.getpid()

    def __getstate__(self) -> dict[str, int]:
        return {}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.opened_in = os.getpid()

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([self.opened_in == os.getpid()])


def test_a_dataset_with_per_process_state_is_made_again_in_a_forked_producer() -> None:
    with ShmLoader(PerProcessState(), rank=0, size=1, batch_size=2, num_workers=1, start_method="fork") as ld:
        assert [b.ravel().tolist() for b in ld] == [[1, 1]]


def trainer_state_in_producer(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    """[SIGTERM default, SIGINT ignored, SIGUSR2 default, torch threads, most threads of a BLAS/OpenMP pool]."""
    import threadpoolctl
    import torch

    pools = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] in ("blas", "openmp")]
    yield np.array([signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                    signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
                    signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL, torch.get_num_threads(), max(pools)])


def test_the_trainers_signal_handlers_and_thread_pools_do_not_reach_a_forked_producer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """(b), (c): a trainer with Python handlers for SIGTERM and SIGUSR2 and two threads per math pool
    (OMP_NUM_THREADS=2); its forked producer runs the default handlers (a SIGTERM ends it) and one thread per
    pool."""
    import threadpoolctl
    import torch

    for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # set by the user, and still one thread: more is what a fork breaks
    threads = torch.get_num_threads()
    handlers = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        torch.set_num_threads(2)
        with threadpoolctl.threadpool_limits(2), ShmLoader.from_generator(trainer_state_in_producer, rank=0, size=1,
                                                                           num_workers=1, start_method="fork") as ld:
            assert [b.tolist() for b in ld] == [[1, 1, 1, 1, 1]]
            assert torch.get_num_threads() == 2  # the trainer's own are left as they were
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class _Finalized:
    """Part of a reference cycle; its finalizer records which process ran it."""

    def __init__(self, record: Path) -> None:
        self.record, self.me = record, self

    def __del__(self) -> None:
        with open(self.record, "a") as f:
            f.write(f"{os.getpid()}\n")


def collect_in_producer(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    yield np.array([gc.collect()])


def test_the_trainers_garbage_is_not_finalized_in_a_forked_producer(tmp_path: Path) -> None:
    """(b): an unreachable trainer object whose finalizer has not run yet (a loader's would stop its producers and
    unlink its segments) is left alone by the producer's garbage collection; the trainer's finalizes it."""
    record = tmp_path / "finalized"
    gc.disable()
    try:
        _Finalized(record)
        with ShmLoader.from_generator(collect_in_producer, rank=0, size=1, num_workers=2, start_method="fork") as ld:
            assert len(list(ld)) == 2
    finally:
        gc.enable()
    gc.collect()
    assert record.read_text().split() == [str(os.getpid())]


BUFFERED = r"""
import os, sys
import numpy as np
from hvdtrain.data import ShmLoader

def gen(w, n, e, s):
    yield np.zeros(1)

sys.stdout = os.fdopen(1, "w", buffering=1 << 16, closefd=False)  # block-buffered whatever PYTHONUNBUFFERED says
print("BUFFERED-LINE")  # still in the buffer at the fork
with ShmLoader.from_generator(gen, rank=0, size=1, num_workers=2) as ld:
    print("BATCHES", len(list(ld)))
"""


def test_a_segment_its_producer_cannot_reserve_is_a_shared_memory_full_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [shm reservation]: a grown slot is reserved by its producer; when /dev/shm cannot hold it (here: the
    reservation of anything over 1 MiB fails, in the forked producer too), the trainer raises the same
    SharedMemoryFullError as for its own segments, and nothing is left running."""
    from hvdtrain.data import SharedMemoryFullError, shm

    real = shm.reserve_segment

    def small_only(seg: shm.Segment, what: str = "batch") -> None:
        if seg.size > 1 << 20:
            raise SharedMemoryFullError(f"/dev/shm cannot hold a {shm.size_text(seg.size)} {what} segment (test)")
        real(seg, what)

    monkeypatch.setattr(shm, "reserve_segment", small_only)
    full = r"rank 0's data loader: /dev/shm cannot hold a [\d.]+ MiB batch segment \(test\)\. It needs about"
    ld = ShmLoader.from_generator(fx.growing_batches, rank=0, size=1, num_workers=1, start_method="fork")
    pids = ld.worker_pids
    with pytest.raises(SharedMemoryFullError, match=full) as err, ld:
        list(ld)
    assert "--shm-size" in str(err.value)
    import psutil

    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_what_the_trainer_had_buffered_is_printed_once() -> None:
    result = harness.run_bounded([sys.executable, "-c", BUFFERED], timeout=60, cwd=harness.REPO)
    assert result.returncode == 0 and "BATCHES 2" in result.output, result.describe()
    assert result.output.count("BUFFERED-LINE") == 1, result.describe()
