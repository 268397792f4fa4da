"""B11: the Keras recipe's steady training speed on Keras 3 (its default) vs tf_keras (TF_USE_LEGACY_KERAS=1), the
same job otherwise (not a test).

Each side is the recipe itself under `horovodrun -np N -H localhost:N --gloo` (`--np`, 2 by default) (`--dataset
synthetic`: 4096 random 3x32x32 samples, the recipe's CNN at width 32; fp32 unless `--precision`), `--epochs`
epochs; its summary.json records each epoch's training samples/s (over all ranks, the training part of the epoch,
validation excluded). Epoch 1 traces the step and fills the producers: left out. A side's speed is the median of its
other epochs. Runs alternate (Keras 3 first, then tf_keras first, ...) so that machine load hits both alike; the
ratio is taken per pair (Keras 3 / tf_keras) and its median printed, with each side's median. Goal (issue 56 item
7): >= 0.95x.

    .venv/bin/python bench/keras3_vs_tf_keras.py [--pairs 3] [--epochs 4] [--precision fp32|bf16|fp16]

"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import OUT, REPO, watch_run, write_json

SIDES = {"keras3": "0", "tf_keras": "1"}  # TF_USE_LEGACY_KERAS


def run_side(keras: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One recipe run under `keras`; its per-epoch samples/s and the Keras it ran on (from summary.json)."""
    argv = ["env", f"TF_USE_LEGACY_KERAS={SIDES[keras]}", "TF_CPP_MIN_LOG_LEVEL=2",
            str(Path(sys.executable).parent / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
            "--gloo", sys.executable, str(REPO / "recipes" / "keras_train.py"), "--run-dir", str(run_dir),
            "--epochs", str(args.epochs), "--warmup-epochs", "1", "--verbose", "0", "--no-resume",
            "--precision", args.precision, "--dataset", args.dataset, "--synthetic-samples", str(args.samples)]
    code, lines = watch_run(argv, lambda line, at: None, timeout_s=args.timeout)
    if code != 0:
        raise SystemExit(f"{keras} run failed (exit {code}):\n" + "\n".join(lines[-30:]))
    summary = json.loads((run_dir / "summary.json").read_text())
    speeds = [float(row["samples_per_sec"]) for row in summary["history"]][1:]
    return {"keras": summary["keras"], "samples_per_sec": speeds, "median": statistics.median(speeds)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="runs of each side, alternating which goes first")
    p.add_argument("--epochs", type=int, default=4, help="per run (the first is left out)")
    p.add_argument("--np", type=int, default=2, help="ranks (all on localhost)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--dataset", default="synthetic", help="as the recipe's --dataset (digits: epochs too short "
                   "to time on 2 cores, ~0.4 s)")
    p.add_argument("--samples", type=int, default=4096, help="training samples of --dataset synthetic")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = p.parse_args()
    if args.epochs < 2 or args.pairs < 1:
        p.error("--epochs must be >= 2 (the first is left out) and --pairs >= 1")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="b11-") as tmp:
        for i in range(args.pairs):
            order = list(SIDES) if i % 2 == 0 else list(reversed(SIDES))
            for side in order:
                runs[side].append(run_side(side, args, Path(tmp) / f"{side}-{i}"))
                print(f"pair {i + 1} {side}: {runs[side][-1]['median']:.0f} samples/s ({runs[side][-1]['keras']})",
                      flush=True)
            ratios.append(float(runs["keras3"][-1]["median"]) / float(runs["tf_keras"][-1]["median"]))
    medians = {side: statistics.median(float(r["median"]) for r in rs) for side, rs in runs.items()}
    ratio = statistics.median(ratios)
    print(f"Keras 3 {medians['keras3']:.0f} vs tf_keras {medians['tf_keras']:.0f} samples/s ({args.np} ranks, "
          f"{args.precision}, {args.dataset}): {ratio:.3f}x median of paired ratios "
          f"({', '.join(f'{r:.3f}' for r in ratios)}); goal >= 0.95x: {'met' if ratio >= 0.95 else 'NOT met'}")
    path = write_json(OUT / "keras3_vs_tf_keras.json", {"args": vars(args), "runs": runs, "ratios": ratios,
                                                         "medians": medians, "ratio": ratio})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
