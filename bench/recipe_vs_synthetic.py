"""The PyTorch recipe on synthetic data vs Horovod's own synthetic benchmark, side by side (img/s per worker).

    .venv/bin/python bench/recipe_vs_synthetic.py            # np=2, Gloo, ~1-2 minutes on 2 CPU cores

Reference: Horovod's `examples/pytorch/pytorch_synthetic_benchmark.py` (horovod/horovod, v0.28.1). Its method,
reimplemented here (the example is not installed with Horovod): one fixed random batch; `hvd.DistributedOptimizer`
over SGD(lr=0.01 × size); broadcast parameters and optimizer state; `timeit` over `--num-warmup-batches` steps
(not counted), then `--num-iters` timings of `--num-batches-per-iter` steps each; img/s per worker = batch ×
batches per iter / time, reported as mean ± 1.96 × std over the iterations. Deliberate differences: the model is
the recipe's ResNet (torchvision is not installed) with plain BatchNorm instead of `hvd.SyncBatchNorm` (the
recipe uses plain BatchNorm too), and threads per rank are cores // local ranks, as the recipe sets them.

The recipe side is the recipe's own code: `pytorch_train.setup()` (its model, SGD + DistributedOptimizer,
broadcasts, ShmLoader + DevicePrefetcher + StallMeter on `--dataset synthetic`) and `pytorch_train.train_epoch()`
(its training loop with LR schedule and metrics), timed exactly as the recipe times an epoch. An epoch is
`--num-batches-per-iter` steps per rank, so one epoch is one timed iteration; epoch 0 is the warmup.

Both run in the same horovodrun job, iteration by iteration, alternating which goes first: on a shared machine
the load changes by the minute, and two separate jobs measured minutes apart differ by 2x from that alone.
Ratio = recipe / synthetic; >= 1.0 means the recipe's data pipeline and bookkeeping cost nothing measurable.
Results: printed, and written to bench/out/recipe_vs_synthetic.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
OUT = REPO / "bench" / "out"
RESULT = re.compile(r"BENCH_RESULT (\{.*\})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks (all on localhost)")
    p.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--shape", default="3,32,32", help="sample shape C,H,W")
    p.add_argument("--width", type=int, default=16, help="ResNet base width")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--num-workers", type=int, default=1, help="recipe: data producer processes per rank")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the horovodrun job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # inside horovodrun
    args = p.parse_args(argv)
    args.shape = tuple(int(v) for v in args.shape.split(","))
    if args.num_warmup_batches != args.num_batches_per_iter:
        p.error("the recipe's warmup is one epoch of --num-batches-per-iter steps: set --num-warmup-batches "
                f"equal to it (got {args.num_warmup_batches} and {args.num_batches_per_iter})")
    return args


# ---- inside horovodrun: both methods, interleaved --------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import timeit

    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    from hvdtrain.train.metrics import combine_stall

    sys.path.insert(0, str(RECIPES))
    import pytorch_train as recipe
    from pytorch_models import make_model

    hvd.init()
    size = hvd.size()
    cfg = recipe.Config(
        dataset="synthetic", model="resnet", model_width=args.width, synthetic_shape=args.shape,
        synthetic_samples=args.batch_size * args.num_batches_per_iter * size, num_classes=args.num_classes,
        batch_size=args.batch_size, epochs=1 + args.num_iters, warmup_epochs=0.0, num_workers=args.num_workers,
        resume=False, progress=False, tensorboard=False, run_dir=str(OUT / "recipe-run"))
    t, _ = recipe.setup(cfg)  # also sets torch threads per rank: the synthetic method runs with the same

    # Horovod's synthetic benchmark method (see the module docstring).
    torch.manual_seed(0)
    model = make_model("resnet", args.shape, args.num_classes, args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none, op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(args.batch_size, *args.shape)
    target = torch.LongTensor(args.batch_size).random_() % args.num_classes

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def synthetic_iteration() -> float:
        return args.batch_size * args.num_batches_per_iter / timeit.timeit(benchmark_step,
                                                                          number=args.num_batches_per_iter)

    def recipe_iteration(epoch: int) -> float:  # as recipe.run_epochs times an epoch
        torch.manual_seed(recipe.epoch_seed(cfg.seed, epoch, t.rank))
        t.train_loader.set_epoch(epoch)
        start = time.perf_counter()
        train = recipe.train_epoch(t, epoch)
        return train["samples"] / (time.perf_counter() - start) / size

    try:
        timeit.timeit(benchmark_step, number=args.num_warmup_batches)
        recipe_iteration(0)
        synthetic, recipe_img = [], []
        for i in range(args.num_iters):
            if i % 2 == 0:
                synthetic.append(synthetic_iteration())
                recipe_img.append(recipe_iteration(1 + i))
            else:
                recipe_img.append(recipe_iteration(1 + i))
                synthetic.append(synthetic_iteration())
    finally:
        t.train_loader.close()
    stall = combine_stall(hvd.allgather_object(t.meter.summary(), name="bench.stall"))
    if hvd.rank() == 0:
        print("BENCH_RESULT " + json.dumps({"synthetic": synthetic, "recipe": recipe_img, "stall": stall}),
              flush=True)


# ---- driver ---------------------------------------------------------------------------------------------------

def run_job(argv: list[str], timeout: float) -> str:
    """Run a horovodrun job in its own session; kill the whole group on timeout or interrupt."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # ranks that outlived horovodrun
    if proc.returncode != 0:
        raise SystemExit(f"job failed (exit {proc.returncode}): {' '.join(argv)}\n{out}")
    return out


def forwarded(args: argparse.Namespace) -> list[str]:
    return ["--batch-size", str(args.batch_size), "--shape", ",".join(map(str, args.shape)),
            "--width", str(args.width), "--num-classes", str(args.num_classes),
            "--num-warmup-batches", str(args.num_warmup_batches),
            "--num-batches-per-iter", str(args.num_batches_per_iter), "--num-iters", str(args.num_iters),
            "--num-workers", str(args.num_workers)]


def stats(img_secs: list[float]) -> dict[str, float]:
    """Horovod's figures (mean, ± 1.96 × population std) plus the median."""
    return {"mean": statistics.fmean(img_secs), "conf95": 1.96 * statistics.pstdev(img_secs),
            "median": statistics.median(img_secs), "n": len(img_secs)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cmd = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
           f"--{args.controller}", sys.executable, str(Path(__file__).resolve()), "--worker", *forwarded(args)]
    m = RESULT.search(run_job(cmd, args.timeout))
    if not m:
        raise SystemExit("the benchmark job printed no result")
    raw = json.loads(m.group(1))
    s, r = stats(raw["synthetic"]), stats(raw["recipe"])
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "worker"},
        "synthetic_img_per_sec_per_worker": s, "recipe_img_per_sec_per_worker": r,
        "ratio_recipe_over_synthetic": r["mean"] / s["mean"], "ratio_of_medians": r["median"] / s["median"],
        # each recipe iteration ran right next to a synthetic one: the median of their ratios resists load drift
        "paired_ratio_median": statistics.median(b / a for a, b in zip(raw["synthetic"], raw["recipe"], strict=True)),
        "per_iteration": {"synthetic": raw["synthetic"], "recipe": raw["recipe"]},
        "recipe_data_wait_share": raw["stall"]["wait_share"], "recipe_mean_data_wait_s": raw["stall"]["mean_wait_s"],
        "wall_s": time.perf_counter() - start,
    }
    (OUT / "recipe_vs_synthetic.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"model ResNet(width {args.width}) on {args.shape}, batch {args.batch_size}/rank, np={args.np} "
          f"({args.controller}); {args.num_iters}×{args.num_batches_per_iter} timed steps each after "
          f"{args.num_warmup_batches} warmup, interleaved")
    for name, x in (("Horovod synthetic method", s), ("recipe (synthetic data) ", r)):
        print(f"  {name} : {x['mean']:8.1f} ± {x['conf95']:.1f} img/s per worker (median {x['median']:.1f})")
    share = result["recipe_data_wait_share"]
    print(f"  ratio recipe/synthetic   : {result['ratio_recipe_over_synthetic']:.3f}x of means, "
          f"{result['ratio_of_medians']:.3f}x of medians, {result['paired_ratio_median']:.3f}x median of paired ratios"
          + (f"\n  recipe data wait         : {share:.1%} of step time" if share is not None else ""))
    print(f"  wall {result['wall_s']:.0f} s; written to {OUT / 'recipe_vs_synthetic.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
