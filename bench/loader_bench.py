"""Input-pipeline stall, side by side: in-process generator vs multiprocessing.Queue producers vs hvdtrain ShmLoader.

B1 (the source articles' workload): every batch is (float32[4, 1_000_000, 3], float32[4, 1]) = 48 MB, produced
   after a 0.5 s sleep (simulated I/O) and a small CPU loop; the trainer "trains" `--step-s` (0.1 s) per batch.
   The same generator function, the same number of producers and the same number of steps for every method.
B2 (per-step overhead): digits-size batches (64 x 8x8 float32 + int64 labels, fancy-indexed from an in-memory
   array) and no training at all: the wait is the whole cost of getting one batch.
B3 (--startup): time to the first batch for 'spawn' (workers do not re-import the main module), 'spawn' with
   import_main=True (they do, as plain multiprocessing would) and 'forkserver', with and without torch imported by
   the main module, each in a fresh interpreter.

    .venv/bin/python bench/loader_bench.py [--steps 30] [--producers 8] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvdtrain.data import ShmLoader, StallMeter

Gen = Callable[[int, int, int, int], Iterator[Any]]


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


# ---- the three methods ---------------------------------------------------------------------------------------

def consume(meter: StallMeter, batches: Iterator[Any], steps: int, step_s: float) -> None:
    for x, _ in meter.wrap(itertools.islice(batches, steps)):
        float(x.flat[0])  # touch the batch
        if step_s:
            time.sleep(step_s)


def run_in_process(gen: Gen, producers: int, steps: int, step_s: float) -> StallMeter:
    meter = StallMeter(warmup_steps=1)
    consume(meter, gen(0, 1, 0, 0), steps, step_s)
    return meter


def _queue_producer(q: Any, gen: Gen, worker_id: int, num_workers: int) -> None:
    for batch in gen(worker_id, num_workers, 0, 0):
        q.put(batch)  # pickled by the queue's feeder thread, unpickled by the consumer


def run_queue(gen: Gen, producers: int, steps: int, step_s: float) -> StallMeter:
    """The articles' method: producer processes put whole batches on a multiprocessing.Queue (2 per producer)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=2 * producers)
    procs = [ctx.Process(target=_queue_producer, args=(q, gen, w, producers), daemon=True) for w in range(producers)]
    meter = StallMeter(warmup_steps=1)
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


def run_shm(gen: Gen, producers: int, steps: int, step_s: float) -> StallMeter:
    meter = StallMeter(warmup_steps=1)
    with ShmLoader(generator=gen, rank=0, size=1, num_workers=producers, prefetch=2, batches_per_epoch=steps,
                   timeout=120) as loader:
        consume(meter, iter(loader), steps, step_s)
    return meter


METHODS: dict[str, Callable[[Gen, int, int, float], StallMeter]] = {
    "in-process generator": run_in_process,
    "multiprocessing.Queue": run_queue,
    "hvdtrain ShmLoader": run_shm,
}


# ---- reporting -----------------------------------------------------------------------------------------------

def measure(name: str, gen: Gen, producers: int, steps: int, step_s: float) -> dict[str, Any]:
    results = {}
    for method, run in METHODS.items():
        t0 = time.perf_counter()
        meter = run(gen, producers, steps, step_s)
        wall = time.perf_counter() - t0
        results[method] = {**meter.summary(), "wall_s": wall, "waits": meter.waits, "steps_s": meter.steps,
                           "batches_per_s": (len(meter.steps) - 1) / sum(meter.steps[1:]) if len(meter.steps) > 1
                           else None}
        print(f"  {name}: {method}: done in {wall:.1f} s", file=sys.stderr, flush=True)
    return results


def table(title: str, results: dict[str, Any], unit: float, unit_name: str) -> str:
    shm = results["hvdtrain ShmLoader"]["mean_wait_s"]
    rows = [title, f"{'method':<24}{'mean wait':>12}{'p50':>10}{'p99':>10}{'wait share':>12}{'batches/s':>11}"
            f"{'first wait':>12}{'mean wait / ShmLoader':>24}",
            f"{'':<24}{'(' + unit_name + ')':>12}{'':>10}{'':>10}{'':>12}{'':>11}{'(s)':>12}"]
    for method, r in results.items():
        ratio = r["mean_wait_s"] / shm if shm else float("inf")
        rows.append(f"{method:<24}{r['mean_wait_s'] / unit:>12.2f}{r['p50_wait_s'] / unit:>10.2f}"
                    f"{r['p99_wait_s'] / unit:>10.2f}{r['wait_share']:>12.1%}{r['batches_per_s']:>11.1f}"
                    f"{r['warmup_wait_s']:>12.2f}{ratio:>23.1f}x")
    return "\n".join(rows)


def plot(path: Path, runs: dict[str, dict[str, Any]]) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.2 * len(runs)))
    FigureCanvasAgg(fig)
    for i, (name, results) in enumerate(runs.items()):
        ax = fig.add_subplot(len(runs), 1, i + 1)
        for method, r in results.items():
            ax.plot(np.arange(2, len(r["waits"]) + 1), np.asarray(r["waits"][1:]) * 1e3, marker=".", label=method)
        short = f"{name.split(' (')[0]}, {name.split(', ')[-2]}"  # "B1, 8 producers"
        ax.set(title=f"{short}: wait per step (first step left out)", xlabel="step", ylabel="ms", yscale="symlog")
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
    with ShmLoader(generator=gen, rank=0, size=1, num_workers=int(sys.argv[3]), start_method=method,
                   import_main=bool(import_main)) as ld:
        next(iter(ld))
        print(time.perf_counter() - t0)
"""


def startup(producers: int, repeats: int) -> str:
    repo = Path(__file__).resolve().parent.parent
    rows = [f"B3: seconds from ShmLoader() to the first batch, {producers} workers, median of {repeats} (fresh "
            "interpreter each)", f"{'main module':<22}{'spawn':>10}{'spawn, import_main=True':>26}{'forkserver':>12}"]
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "startup_probe.py"
        script.write_text(STARTUP)
        env = {**os.environ, "PYTHONPATH": str(repo)}
        for main in ("numpy only", "imports torch"):
            cells = []
            for method in ("spawn", "spawn+import_main", "forkserver"):
                argv = [sys.executable, str(script), method, main.split()[-1], str(producers)]
                times = [float(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=300,
                                              env=env).stdout) for _ in range(repeats)]
                cells.append(f"{np.median(times):.2f}")
            rows.append(f"{main:<22}{cells[0]:>10}{cells[1]:>26}{cells[2]:>12}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="B1 steps per method")
    ap.add_argument("--producers", type=int, nargs="+", default=[8], help="B1 producer counts to run")
    ap.add_argument("--step-s", type=float, default=0.1, help="B1 training time per step")
    ap.add_argument("--b2-steps", type=int, default=2000)
    ap.add_argument("--startup", action="store_true", help="also run B3 (start methods)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    print(f"cpu_count={os.cpu_count()}, python {sys.version.split()[0]}, numpy {np.__version__}", flush=True)
    runs, out = {}, []
    for n in args.producers:
        name = f"B1 (48 MB batches, 0.5 s I/O, {args.step_s} s step, {n} producers, {args.steps} steps)"
        runs[name] = measure(name, article_batches, n, args.steps, args.step_s)
        out.append(table(name, runs[name], 1e-3, "ms"))
        print(out[-1], "\n", flush=True)
    name = f"B2 (digits-size 64x8x8 batches, no training, 2 producers, {args.b2_steps} steps)"
    runs[name] = measure(name, digits_batches, 2, args.b2_steps, 0.0)
    out.append(table(name, runs[name], 1e-6, "us"))
    print(out[-1], "\n", flush=True)
    if args.startup:
        print(startup(4, 3), flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    if args.plot:
        plot(args.plot, {k: v for k, v in runs.items() if k.startswith("B1")})


if __name__ == "__main__":
    main()
