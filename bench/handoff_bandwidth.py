"""B2: bandwidth of handing one large array from a producer process to the trainer: ShmLoader vs np.copyto vs Queue.

    .venv/bin/python bench/handoff_bandwidth.py                 # 32 and 256 MiB, about 1.5-2 minutes on 2 cores
    .venv/bin/python bench/handoff_bandwidth.py --batches 4     # a quick check that it runs
    options: [--sizes-mb 32 256] [--batches 10] [--queue-batches 4] [--json PATH]

For each size, one producer process yields pre-filled float32 arrays (a ring of 4, made once) over and over; only
their first and last elements change: a sequence number the trainer checks, so every batch is known to be a new
one, whole. The producer puts each into the hand-off:
- hvdtrain ShmLoader (1 worker, prefetch 2): the worker copies the array into a shared-memory slot, the trainer
  gets numpy views on the slot;
- multiprocessing.Queue (maxsize 2), for reference: pickled by the producer, sent through a pipe, unpickled.
Two figures per method, as size / mean seconds per batch over `--batches` batches, after 4 warm-up batches
(start-up, first touch of the slots, and what the producer buffered meanwhile); for the Queue, which takes
seconds per 256 MiB batch, `--queue-batches` (4) after 2:
- receive: the trainer sleeps long enough between batches (1.5x the end-to-end time per batch + 20 ms) that the
  producer is always ahead, and only the wait for the next batch is timed: the cost of the hand-off itself;
- end-to-end: the trainer takes batches back to back and reads one float per 4 KiB page of each (every page of
  the batch is touched): the rate at which batches can flow from a producer into the trainer, copy included.
Baseline, in the same run: a single-thread `np.copyto` of an array of the same size into another (pre-touched),
`--batches` times before and as many after the hand-offs of that size (mean of both).
Ratio = hvdtrain rate / copyto rate; goal: end-to-end >= 0.5x (receive is reported as well). MiB = 2^20 bytes,
GB/s = 10^9 bytes/s. Printed, and written to bench/out/handoff_bandwidth.json (`--json` elsewhere); the run
checks that no process or hvdtrain_* segment is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import OUT, check_clean, shm_segments, write_json

from hvdtrain.data import ShmLoader

WARMUP = 4
QUEUE_WARMUP = 2  # 256 MiB take the Queue seconds per batch; it is there for reference
RING = 4
PAGE_FLOATS = 4096 // 4


def filled_batches(nbytes: int, worker_id: int = 0, num_workers: int = 1, epoch: int = 0,
                   seed: int = 0) -> Iterator[np.ndarray]:
    """Pre-filled float32 arrays of `nbytes`, yielded forever; first and last element = the batch's number.

    A ring of RING arrays, not one: `Queue.put` keeps a reference and pickles later, in its feeder thread, so an
    array changed after put() would arrive changed (up to maxsize 2 batches are in flight, plus the one written).
    """
    ring = [np.full(nbytes // 4, 1.0, dtype=np.float32) for _ in range(RING)]
    for seq in itertools.count():
        x = ring[seq % RING]
        x[0] = x[-1] = seq
        yield x


# ---- the hand-offs: context managers that give an iterator of batches ---------------------------------------

@contextlib.contextmanager
def shm_source(nbytes: int) -> Iterator[Iterator[np.ndarray]]:
    with ShmLoader.from_generator(functools.partial(filled_batches, nbytes), rank=0, size=1, num_workers=1,
                                  prefetch=2, timeout=120) as loader:
        yield iter(loader)


def _queue_producer(q: Any, nbytes: int) -> None:
    for batch in filled_batches(nbytes):
        q.put(batch)  # pickled by the queue's feeder thread, unpickled by the consumer


@contextlib.contextmanager
def queue_source(nbytes: int) -> Iterator[Iterator[np.ndarray]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=2)
    proc = ctx.Process(target=_queue_producer, args=(q, nbytes), daemon=True)
    try:
        proc.start()
        yield (q.get(timeout=120) for _ in itertools.count())
    finally:
        proc.terminate()
        proc.join(timeout=10)
        q.cancel_join_thread()
        q.close()


SHM = "hvdtrain ShmLoader"
SOURCES = {SHM: shm_source, "multiprocessing.Queue": queue_source}


# ---- measuring -----------------------------------------------------------------------------------------------

def check(x: np.ndarray, seq: int) -> None:
    if not x[0] == x[-1] == seq:
        raise SystemExit(f"batch {seq}: expected first and last element {seq}, got {x[0]} and {x[-1]}")


def end_to_end(batches: Iterator[np.ndarray], n: int, seq: int) -> tuple[list[float], int]:
    """Seconds per batch, back to back, every page of each batch read; returns (times, next sequence number)."""
    times = []
    last = time.perf_counter()
    for _ in range(n):
        x = next(batches)
        float(x[::PAGE_FLOATS].sum())  # one float per 4 KiB page
        check(x, seq)
        seq += 1
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times, seq


def receive(batches: Iterator[np.ndarray], n: int, seq: int, lead_s: float) -> tuple[list[float], int]:
    """Seconds waited for each batch when the producer had `lead_s` to get ahead; (times, next sequence number)."""
    times = []
    for _ in range(n):
        time.sleep(lead_s)
        start = time.perf_counter()
        x = next(batches)
        times.append(time.perf_counter() - start)
        check(x, seq)
        seq += 1
    return times, seq


def measure_source(name: str, nbytes: int, n: int, warmup: int) -> dict[str, Any]:
    with SOURCES[name](nbytes) as batches:
        _, seq = end_to_end(batches, warmup, 0)  # start-up, first touch of the slots, what was buffered meanwhile
        e2e, seq = end_to_end(batches, n, seq)
        lead = 1.5 * statistics.fmean(e2e) + 0.02  # a batch takes the producer at most the end-to-end time
        recv, _ = receive(batches, n, seq, lead)
    e2e_s, recv_s = statistics.fmean(e2e), statistics.fmean(recv)
    return {"end_to_end_s": e2e, "receive_s": recv, "lead_s": lead, "end_to_end_ms": e2e_s * 1e3,
            "receive_ms": recv_s * 1e3, "receive_p50_ms": statistics.median(recv) * 1e3,
            "end_to_end_gb_s": nbytes / e2e_s / 1e9, "receive_gb_s": nbytes / recv_s / 1e9}


def copyto_times(nbytes: int, n: int) -> list[float]:
    src = np.full(nbytes // 4, 1.0, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch of dst, not counted
    times = []
    for _ in range(n):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times


# ---- reporting -----------------------------------------------------------------------------------------------

def measure_size(mib: int, n: int, queue_n: int) -> dict[str, Any]:
    nbytes = mib * 2**20
    row: dict[str, Any] = {}
    copies = copyto_times(nbytes, n)  # before and after the hand-offs: load drifts on a shared machine
    for name in SOURCES:
        row[name] = measure_source(name, nbytes, *((n, WARMUP) if name == SHM else (queue_n, QUEUE_WARMUP)))
        print(f"  {mib} MiB: {name}: done", file=sys.stderr, flush=True)
    copies += copyto_times(nbytes, n)
    mean = statistics.fmean(copies)
    row["copyto"] = {"copy_s": copies, "copy_ms": mean * 1e3, "gb_s": nbytes / mean / 1e9}
    base = row["copyto"]["gb_s"]
    row["ratios"] = {name: {"end_to_end_over_copyto": row[name]["end_to_end_gb_s"] / base,
                            "receive_over_copyto": row[name]["receive_gb_s"] / base} for name in SOURCES}
    row["goal_met"] = row["ratios"][SHM]["end_to_end_over_copyto"] >= 0.5
    return row


def table(results: dict[str, Any], n: int, queue_n: int) -> str:
    rows = [f"B2: one float32 array from a producer process to the trainer; {n} batches after {WARMUP} warm-up "
            f"(Queue: {queue_n} after {QUEUE_WARMUP}); GB/s = 1e9 B/s",
            f"{'size':<9}{'method':<24}{'receive':>10}{'receive':>10}{'end-to-end':>12}{'e2e':>9}{'e2e /':>9}"
            f"{'receive /':>11}",
            f"{'':<9}{'':<24}{'(ms)':>10}{'(GB/s)':>10}{'(ms)':>12}{'(GB/s)':>9}{'copyto':>9}{'copyto':>11}"]
    for size, row in results.items():
        c = row["copyto"]
        rows.append(f"{size:<9}{'np.copyto (1 thread)':<24}{'':>10}{'':>10}{c['copy_ms']:>12.2f}{c['gb_s']:>9.2f}"
                    f"{'1.00x':>9}{'':>11}")
        for name in SOURCES:
            r, q = row[name], row["ratios"][name]
            rows.append(f"{size:<9}{name:<24}{r['receive_ms']:>10.3f}{r['receive_gb_s']:>10.1f}"
                        f"{r['end_to_end_ms']:>12.2f}{r['end_to_end_gb_s']:>9.2f}"
                        f"{q['end_to_end_over_copyto']:>8.2f}x{q['receive_over_copyto']:>10.1f}x")
    goals = ", ".join(f"{size} {row['ratios']['hvdtrain ShmLoader']['end_to_end_over_copyto']:.2f}x "
                      f"{'met' if row['goal_met'] else 'NOT met'}" for size, row in results.items())
    rows.append(f"goal: hvdtrain end-to-end >= 0.5x copyto: {goals}")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[32, 256], help="array sizes in MiB")
    ap.add_argument("--batches", type=int, default=10, help=f"timed batches per figure (after {WARMUP} warm-up)")
    ap.add_argument("--queue-batches", type=int, default=4, help=f"the same for the Queue (after {QUEUE_WARMUP})")
    ap.add_argument("--json", type=Path, default=OUT / "handoff_bandwidth.json")
    args = ap.parse_args()
    if min(args.batches, args.queue_batches, *args.sizes_mb) < 1:
        ap.error("--batches, --queue-batches and --sizes-mb must be >= 1")
    before = shm_segments()
    print(f"cpu_count={os.cpu_count()}, python {sys.version.split()[0]}, numpy {np.__version__}", flush=True)
    results = {f"{mib} MiB": measure_size(mib, args.batches, args.queue_batches) for mib in args.sizes_mb}
    print(table(results, args.batches, args.queue_batches), flush=True)
    leaks = check_clean(before)
    config = {**vars(args), "json": str(args.json), "warmup": WARMUP, "queue_warmup": QUEUE_WARMUP}
    path = write_json(args.json, {"config": config, "results": results, "leaks": leaks})
    print(f"written to {path}" + (f"; LEAKS: {leaks}" if leaks else ""), flush=True)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
