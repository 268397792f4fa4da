"""Input-pipeline stall, side by side: hvdtrain's ShmLoader vs the ways the source articles and users feed a trainer.

    .venv/bin/python bench/loader_bench.py              # B1 + B4, about 1.5-2 minutes on 2 cores
    .venv/bin/python bench/loader_bench.py --startup    # also B5 (about 1 more minute)
    .venv/bin/python bench/loader_bench.py --steps 16 --b4-steps 200  # a quick check that it all runs
    options: [--steps 30] [--producers 8 ...] [--step-s 0.1] [--b4-steps 2000] [--json PATH] [--plot PATH]

Methods (the same generator function and number of steps for every method, `--producers` producer processes for
the process-based ones; the consumer touches each batch the same way: reads its first element):
- in-process generator: the trainer calls the generator itself (no prefetch at all);
- thread prefetch: one background thread runs the generator into a bounded queue of 2, as tf.data's
  `from_generator(...).prefetch(2)` does (the generator runs in one Python thread under the GIL);
- multiprocessing.Queue: the articles' producer processes put whole batches on a Queue (pickled);
- torch DataLoader: an IterableDataset over the same generator, each worker running its own share
  (`batch_size=None, num_workers=N, persistent_workers=True, prefetch_factor=2`), batches arrive as tensors;
- hvdtrain ShmLoader: N producer processes, batches handed over in shared memory.
Ray's `ray.util.iter.from_iterators(...).gather_async()` (the articles' fastest) is left out: see RAY_NOTE.

B1 (the source articles' workload): every batch is (float32[4, 1_000_000, 3], float32[4, 1]) = 48 MB, produced
   after a 0.5 s sleep (simulated I/O) and a small CPU loop; the trainer "trains" `--step-s` (0.1 s) per batch,
   with `--producers` (8) producers. Reported per method: mean/p50/p99 wait for the next batch and wait share of
   step time over the steps after the first round (one batch per producer: process start-up, reported apart as
   "start-up wait"; B5 measures it properly), and mean wait / ShmLoader's. Goal: ShmLoader's mean wait at or below
   the best other method's in the same run, and <= 1% of step time.
B4 (per-step overhead): digits-size batches (64 x 8x8 float32 + int64 labels, fancy-indexed from an in-memory
   array), 2 producers and no training at all: the wait is the whole cost of getting one batch.
B5 (--startup): time to the first batch with forked producers (the default on Linux), fresh interpreters
   (`start_method="spawn"`, which do not re-run the main module) and fresh interpreters with import_main=True (they
   do, as plain multiprocessing would), with and without torch imported by the main module, each in a fresh
   trainer process. bench/first_batch.py does the same over a torch Dataset, beside torch's DataLoader.
(B2, hand-off bandwidth, is bench/handoff_bandwidth.py; B3, the recipe on shards, bench/recipe_shards_vs_synthetic.py.)

Results: printed, and written to bench/out/loader_bench.json (`--json` elsewhere). After the run the bench checks
that no producer process and no hvdtrain_* shared-memory segment is left behind.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import OUT, check_clean, shm_segments, write_json

from hvdtrain.data import ShmLoader, StallMeter

Gen = Callable[[int, int, int, int], Iterator[Any]]
SHM = "hvdtrain ShmLoader"
RAY_NOTE = ("Ray's ray.util.iter.from_iterators(...).gather_async(): left out: ray.util.iter (ParallelIterator) is "
            "deprecated since Ray 2.0 and not part of current Ray, and Ray is not installed here (the articles "
            "reported a 0.02 s mean wait with it)")


# ---- workloads (module level: the Queue producers are spawned and import them by name) ------------------------

def article_batches(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[tuple[np.ndarray, ...]]:
    """The articles' data_generator: 0.5 s of simulated I/O, a small CPU loop, then a 48 MB batch."""
    rng = np.random.default_rng(seed + worker_id)
    while True:
        time.sleep(0.5)
        acc = 0
        for i in range(20_000):
            acc += i * i
        # Filled, not drawn at random: 12 M random floats cost ~0.1 s of CPU per batch, which on 2 cores measures
        # the producers' arithmetic rather than the hand-off. The 48 MB are still written (and read) in full.
        x = np.full((4, 1_000_000, 3), acc % 255, dtype=np.float32)
        x[0, 0, 0] = worker_id  # lets the consumer check where a batch came from
        yield x, rng.random((4, 1), dtype=np.float32)


DIGITS_X = np.random.default_rng(0).random((1797, 8, 8), dtype=np.float32)
DIGITS_Y = np.random.default_rng(1).integers(0, 10, 1797)


def digits_batches(worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(seed + worker_id)
    while True:
        idx = rng.integers(0, len(DIGITS_Y), 64)
        yield DIGITS_X[idx], DIGITS_Y[idx]


# ---- the methods ---------------------------------------------------------------------------------------------

def consume(meter: StallMeter, batches: Iterator[Any], steps: int, step_s: float) -> None:
    """The trainer: `steps` batches, each touched the same way whatever it is (numpy array or torch tensor)."""
    for x, _ in meter.wrap(itertools.islice(batches, steps)):
        float(x.reshape(-1)[0])  # touch the batch: read its first element
        if step_s:
            time.sleep(step_s)


def run_in_process(gen: Gen, producers: int, steps: int, step_s: float) -> StallMeter:
    meter = StallMeter(warmup_steps=producers)
    consume(meter, gen(0, 1, 0, 0), steps, step_s)
    return meter


def _fill(buf: queue.Queue[Any], stop: threading.Event, gen: Gen) -> None:
    for batch in gen(0, 1, 0, 0):
        while not stop.is_set():
            try:
                buf.put(batch, timeout=0.2)
                break
            except queue.Full:
                continue
        if stop.is_set():
            return


def run_thread_prefetch(gen: Gen, producers: int, steps: int, step_s: float) -> StallMeter:
    """tf.data's `from_generator(gen).prefetch(2)`: one background thread runs the generator into a queue of 2."""
    buf: queue.Queue[Any] = queue.Queue(maxsize=2)
    stop = threading.Event()
    filler = threading.Thread(target=_fill, args=(buf, stop, gen), daemon=True, name="bench-prefetch")
    meter = StallMeter(warmup_steps=producers)
    filler.start()
    try:
        consume(meter, iter(lambda: buf.get(timeout=120), None), steps, step_s)
    finally:
        stop.set()
        filler.join(timeout=10)
    return meter


def _queue_producer(q: Any, gen: Gen, worker_id: int, num_workers: int) -> None:
    for batch in gen(worker_id, num_workers, 0, 0):
        q.put(batch)  # pickled by the queue's feeder thread, unpickled by the consumer


def run_queue(gen: Gen, producers: int, steps: int, step_s: float) -> StallMeter:
    """The articles' method: producer processes put whole batches on a multiprocessing.Queue (2 per producer)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=2 * producers)
    procs = [ctx.Process(target=_queue_producer, args=(q, gen, w, producers), daemon=True) for w in range(producers)]
    meter = StallMeter(warmup_steps=producers)
    try:
        for p in procs:
            p.start()
        consume(meter, iter(lambda: q.get(timeout=120), None), steps, step_s)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=10)
        q.cancel_join_thread()
        q.close()
    return meter


def run_dataloader(gen: Gen, producers: int, steps: int, step_s: float) -> StallMeter:
    """torch DataLoader over an IterableDataset whose worker k of n runs gen(k, n, 0, 0); batch_size=None passes
    the generator's batches through (numpy -> tensors by the default collate); the default start method (fork on
    Linux), as DataLoader users get it. torch is imported here only: spawned producers of the other methods
    re-import this module and should not pay for it."""
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    class Batches(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[Any]:
            info = get_worker_info()
            return gen(info.id, info.num_workers, 0, 0) if info is not None else gen(0, 1, 0, 0)

    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)  # > cores
    loader = DataLoader(Batches(), batch_size=None, num_workers=producers, persistent_workers=True,
                        prefetch_factor=2, timeout=120)
    meter = StallMeter(warmup_steps=producers)
    batches = iter(loader)
    try:
        consume(meter, batches, steps, step_s)
    finally:
        batches._shutdown_workers()  # type: ignore[attr-defined]  # persistent workers live as long as the loader
    return meter


def run_shm(gen: Gen, producers: int, steps: int, step_s: float) -> StallMeter:
    meter = StallMeter(warmup_steps=producers)
    with ShmLoader.from_generator(gen, rank=0, size=1, num_workers=producers, prefetch=2, batches_per_epoch=steps,
                                  timeout=120) as loader:
        consume(meter, iter(loader), steps, step_s)
    return meter


METHODS: dict[str, Callable[[Gen, int, int, float], StallMeter]] = {
    "in-process generator": run_in_process,
    "thread prefetch (tf.data)": run_thread_prefetch,
    "multiprocessing.Queue": run_queue,
    "torch DataLoader": run_dataloader,
    SHM: run_shm,
}


# ---- reporting -----------------------------------------------------------------------------------------------

def measure(name: str, gen: Gen, producers: int, steps: int, step_s: float) -> dict[str, Any]:
    results = {}
    for method, run in METHODS.items():
        t0 = time.perf_counter()
        meter = run(gen, producers, steps, step_s)
        wall = time.perf_counter() - t0
        timed = meter.steps[meter.warmup_steps:]
        results[method] = {**meter.summary(), "wall_s": wall, "waits": meter.waits, "steps_s": meter.steps,
                           "batches_per_s": len(timed) / sum(timed) if timed else None}
        print(f"  {name}: {method}: done in {wall:.1f} s", file=sys.stderr, flush=True)
    return results


def table(title: str, results: dict[str, Any], unit: float, unit_name: str) -> str:
    """Statistics over the steps after the first round (one batch per producer: start-up, reported apart)."""
    shm = results[SHM]["mean_wait_s"]
    rows = [title, f"{'method':<27}{'mean wait':>11}{'p50':>9}{'p99':>9}{'wait share':>12}{'batches/s':>11}"
            f"{'start-up':>12}{'mean wait / ShmLoader':>23}",
            f"{'':<27}{'(' + unit_name + ')':>11}{'':>9}{'':>9}{'':>12}{'':>11}{'wait (s)':>12}"]
    for method, r in results.items():
        ratio = f"{r['mean_wait_s'] / shm:.1f}x" if shm else "inf"
        rows.append(f"{method:<27}{r['mean_wait_s'] / unit:>11.2f}{r['p50_wait_s'] / unit:>9.2f}"
                    f"{r['p99_wait_s'] / unit:>9.2f}{r['wait_share']:>12.1%}{r['batches_per_s']:>11.1f}"
                    f"{r['warmup_wait_s']:>12.2f}{ratio:>23}")
    return "\n".join(rows)


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """B1's goal: ShmLoader's mean wait <= the best other method's in this run, and <= 1% of step time."""
    others = {m: r["mean_wait_s"] for m, r in results.items() if m != SHM}
    best = min(others, key=others.__getitem__)
    shm = results[SHM]
    out = {"best_other": best, "best_other_mean_wait_s": others[best], "shm_mean_wait_s": shm["mean_wait_s"],
           "shm_over_best": shm["mean_wait_s"] / others[best] if others[best] else float("inf"),
           "shm_wait_share": shm["wait_share"], "at_or_below_best": shm["mean_wait_s"] <= others[best],
           "wait_share_at_most_1pct": shm["wait_share"] <= 0.01}
    print(f"goal: ShmLoader mean wait {shm['mean_wait_s'] * 1e3:.2f} ms vs best other ({best}) "
          f"{others[best] * 1e3:.2f} ms = {out['shm_over_best']:.2f}x (goal <= 1: "
          f"{'met' if out['at_or_below_best'] else 'NOT met'}); wait share {shm['wait_share']:.2%} of step time "
          f"(goal <= 1%: {'met' if out['wait_share_at_most_1pct'] else 'NOT met'})")
    return out


def plot(path: Path, runs: dict[str, dict[str, Any]]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.2 * len(runs)))
    FigureCanvasAgg(fig)
    for i, (name, results) in enumerate(runs.items()):
        ax = fig.add_subplot(len(runs), 1, i + 1)
        for method, r in results.items():
            first = r["warmup_steps"]
            ax.plot(np.arange(first + 1, len(r["waits"]) + 1), np.asarray(r["waits"][first:]) * 1e3, marker=".",
                    label=method)
        short = f"{name.split(' (')[0]}, {name.split(', ')[-2]}"  # "B1, 8 producers"
        ax.set(title=f"{short}: wait per step (start-up round left out)", xlabel="step", ylabel="ms", yscale="symlog")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


STARTUP = r"""
import sys, time
if sys.argv[2] == "torch":
    import torch  # noqa
from hvdtrain.data import ShmLoader
def gen(w, n, e, s):
    import numpy as np
    yield np.zeros(4)
if __name__ == "__main__":
    t0 = time.perf_counter()
    method, import_main = sys.argv[1].split("+") if "+" in sys.argv[1] else (sys.argv[1], "")
    with ShmLoader.from_generator(gen, rank=0, size=1, num_workers=int(sys.argv[3]), start_method=method,
                                  import_main=bool(import_main), timeout=120) as ld:
        next(iter(ld))
        print(time.perf_counter() - t0)
"""


def startup(producers: int, repeats: int) -> tuple[str, dict[str, dict[str, float]]]:
    """B5: (table, {main module: {start method: median seconds}})."""
    rows = [f"B5: seconds from ShmLoader() to the first batch, {producers} workers, median of {repeats} (fresh "
            "trainer each)", f"{'main module':<22}{'fork (default)':>16}{'spawn':>10}{'spawn, import_main':>20}"]
    medians: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "startup_probe.py"
        script.write_text(STARTUP)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        for main in ("numpy only", "imports torch"):
            medians[main] = {}
            for method in ("fork", "spawn", "spawn+import_main"):
                argv = [sys.executable, str(script), method, main.split()[-1], str(producers)]
                times = [float(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300,
                                              env=env).stdout) for _ in range(repeats)]
                medians[main][method] = float(np.median(times))
            cells = [f"{v:.2f}" for v in medians[main].values()]
            rows.append(f"{main:<22}{cells[0]:>16}{cells[1]:>10}{cells[2]:>20}")
    return "\n".join(rows), medians


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="B1 steps per method")
    ap.add_argument("--producers", type=int, nargs="+", default=[8], help="B1 producer counts to run")
    ap.add_argument("--step-s", type=float, default=0.1, help="B1 training time per step")
    ap.add_argument("--b4-steps", type=int, default=2000, help="B4 steps per method")
    ap.add_argument("--startup", action="store_true", help="also run B5 (start methods)")
    ap.add_argument("--json", type=Path, default=OUT / "loader_bench.json")
    ap.add_argument("--plot", type=Path, help="PNG of B1's wait per step")
    args = ap.parse_args()
    if args.steps <= max(args.producers) or args.b4_steps <= 2:
        ap.error(f"--steps must be more than the largest --producers ({max(args.producers)}; the first round of "
                 "one batch per producer is start-up and not counted) and --b4-steps more than 2")
    return args


def main() -> int:
    args = parse_args()
    before = shm_segments()
    print(f"cpu_count={os.cpu_count()}, python {sys.version.split()[0]}, numpy {np.__version__}", flush=True)
    print(RAY_NOTE + "\n", flush=True)
    runs: dict[str, Any] = {}
    report: dict[str, Any] = {"ray": RAY_NOTE, "goals": {}}
    for n in args.producers:
        name = f"B1 (48 MB batches, 0.5 s I/O, {args.step_s} s step, {n} producers, {args.steps} steps)"
        runs[name] = measure(name, article_batches, n, args.steps, args.step_s)
        print(table(name, runs[name], 1e-3, "ms"), flush=True)
        report["goals"][name] = verdict(runs[name])
        print(flush=True)
    name = f"B4 (digits-size 64x8x8 batches, no training, 2 producers, {args.b4_steps} steps)"
    runs[name] = measure(name, digits_batches, 2, args.b4_steps, 0.0)
    print(table(name, runs[name], 1e-6, "us"), "\n", flush=True)
    if args.startup:
        text, report["B5_startup_s"] = startup(4, 3)
        print(text, flush=True)
    report["leaks"] = check_clean(before)
    path = write_json(args.json, {**report, "runs": runs})
    print(f"written to {path}" + ("" if not report["leaks"] else f"; LEAKS: {report['leaks']}"), flush=True)
    if args.plot:
        plot(args.plot, {k: v for k, v in runs.items() if k.startswith("B1")})
    return 1 if report["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
