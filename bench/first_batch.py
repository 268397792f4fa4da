"""Time to the first batch over an ordinary torch Dataset: ShmLoader (forked producers, the default on Linux, and
fresh interpreters, `start_method="spawn"`) vs torch's DataLoader, side by side, 1 and 2 workers.

    .venv/bin/python bench/first_batch.py                 # 5 rounds, about 1.5 minutes on 2 cores
    options: [--rounds 5] [--workers 1 2] [--samples 4096] [--json PATH]

Each trial is a fresh trainer process that has imported torch (as a training script has) and the dataset's module
(`user_data.py`, written by the bench: `class Images(torch.utils.data.Dataset)`, 3x32x32 float32 images + int64
labels, computed per index). The trial times, from its own clock:
- first batch: from constructing the loader (ShmLoader(...) / DataLoader(...)) to holding its first batch;
- epoch 1: samples/s over the whole first epoch (`--samples`, batches of 32), the first batch included.
Methods run in rotated order within each round; medians over the rounds. Goal (issue 59.5): ShmLoader's default
to its first batch <= 1 s or <= 1.5x DataLoader's, whichever is larger, for the same dataset and worker count.
JSON: bench/out/first_batch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from _common import OUT, REPO, check_clean, shm_segments, write_json

USER_DATA = r'''
import numpy as np
import torch


class Images(torch.utils.data.Dataset):
    """A user's dataset: 3x32x32 float32 images and int64 labels, made from the index."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return rng.standard_normal((3, 32, 32), dtype=np.float32), np.int64(i % 10)
'''

TRIAL = r'''
import json, sys, time
import torch
from user_data import Images
from hvdtrain.data import ShmLoader  # a training script imports at its top, as torch's DataLoader came with torch

method, workers, samples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dataset = Images(samples)
t0 = time.perf_counter()
if method == "DataLoader":
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=workers,
                                         persistent_workers=True)
else:
    loader = ShmLoader(dataset, rank=0, size=1, batch_size=32, num_workers=workers, start_method=method, epochs=1)
it = iter(loader)
first = next(it)
t1 = time.perf_counter()
n = len(first[1]) + sum(len(y) for _, y in it)
t2 = time.perf_counter()
close = getattr(loader, "close", None)
if close is not None:
    close()
print(json.dumps({"first_s": t1 - t0, "epoch_samples_per_s": n / (t2 - t0), "samples": n}))
'''

METHODS = ("DataLoader", "fork", "spawn")
LABEL = {"DataLoader": "torch DataLoader", "fork": "ShmLoader (fork, default)", "spawn": "ShmLoader (spawn)"}


def trial(folder: Path, method: str, workers: int, samples: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)])}
    out = subprocess.run([sys.executable, str(folder / "trial.py"), method, str(workers), str(samples)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=folder)
    if out.returncode != 0:
        raise SystemExit(f"{method} with {workers} workers failed:\n{out.stderr[-3000:]}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    if result["samples"] != samples:
        raise SystemExit(f"{method} with {workers} workers gave {result['samples']} samples, not {samples}")
    return result


def run(rounds: int, workers: list[int], samples: int) -> dict[str, dict[str, dict[str, float]]]:
    """{workers: {method: {first_s, epoch_samples_per_s: medians, first_s_all: [...]}}}"""
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "user_data.py").write_text(USER_DATA)
        (folder / "trial.py").write_text(TRIAL)
        for r in range(rounds):
            for w in workers:
                order = METHODS[r % 3:] + METHODS[:r % 3]  # rotated: no method always runs first
                for method in order:
                    got = trial(folder, method, w, samples)
                    cell = results.setdefault(str(w), {}).setdefault(method, {})
                    for key, value in got.items():
                        cell.setdefault(key, []).append(value)
    return {w: {m: {"first_s": float(np.median(c["first_s"])), "first_s_all": c["first_s"],
                    "epoch_samples_per_s": float(np.median(c["epoch_samples_per_s"]))} for m, c in by.items()}
            for w, by in results.items()}


def report(results: dict[str, dict[str, dict[str, float]]], rounds: int) -> tuple[str, dict[str, bool]]:
    rows = [f"seconds from constructing the loader to its first batch, and epoch 1's samples/s (medians of {rounds})",
            f"{'workers':<8}{'method':<28}{'first batch s':>14}{'/ DataLoader':>14}{'epoch 1 samples/s':>19}"]
    goals = {}
    for w, by in results.items():
        base = by["DataLoader"]["first_s"]
        for method in METHODS:
            r = by[method]
            rows.append(f"{w:<8}{LABEL[method]:<28}{r['first_s']:>14.3f}{r['first_s'] / base:>13.2f}x"
                        f"{r['epoch_samples_per_s']:>19.0f}")
        goals[f"{w} workers"] = by["fork"]["first_s"] <= max(1.0, 1.5 * base)
    rows += [f"goal ({w}): ShmLoader's default <= max(1 s, 1.5x DataLoader): {'met' if ok else 'NOT met'}"
             for w, ok in goals.items()]
    return "\n".join(rows), goals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=OUT / "first_batch.json")
    args = ap.parse_args()
    before = shm_segments()
    results = run(args.rounds, args.workers, args.samples)
    text, goals = report(results, args.rounds)
    print(text)
    write_json(args.json, {"results": results, "goals": goals, "rounds": args.rounds, "samples": args.samples})
    return 1 if check_clean(before) else 0


if __name__ == "__main__":
    sys.exit(main())
