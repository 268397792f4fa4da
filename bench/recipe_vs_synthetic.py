"""The PyTorch recipe on synthetic data vs Horovod's own synthetic benchmark, side by side (img/s per worker).

    .venv/bin/python bench/recipe_vs_synthetic.py            # np=2, Gloo, ~1-2 minutes on 2 CPU cores
    python bench/recipe_vs_synthetic.py --np 1 --batch-size 256 --width 64 --num-workers 4 \
        --num-batches-per-iter 50 --num-warmup-batches 50   # one GPU (scripts/gpu_check.sh, step feed)

Reference: Horovod's `examples/pytorch/pytorch_synthetic_benchmark.py` (horovod/horovod, v0.28.1). Its method,
reimplemented here (the example is not installed with Horovod): one fixed random batch; `hvd.DistributedOptimizer`
over SGD(lr=0.01 × size); broadcast parameters and optimizer state; `timeit` over `--num-warmup-batches` steps
(not counted), then `--num-iters` timings of `--num-batches-per-iter` steps each; img/s per worker = batch ×
batches per iter / time, reported as mean ± 1.96 × std over the iterations. Deliberate differences: the model is
the recipe's ResNet (torchvision is not installed) with plain BatchNorm instead of `hvd.SyncBatchNorm` (the
recipe uses plain BatchNorm too), and threads per rank are cores // local ranks, as the recipe sets them.

The recipe side is the recipe's own pieces, built as its main() builds them: its Config, model
(`pytorch_models.make_model`), LR schedule, SGD + DistributedOptimizer after the broadcasts, ShmLoader +
DevicePrefetcher + StallMeter on `--dataset synthetic`, and its training loop `pytorch_train.train_epoch()` (LR
schedule and metrics), timed exactly as the recipe times an epoch. An epoch is
`--num-batches-per-iter` steps per rank, so one epoch is one timed iteration; epoch 0 is the warmup.

Both run in the same horovodrun job, iteration by iteration, alternating which goes first: on a shared machine
the load changes by the minute, and two separate jobs measured minutes apart differ by 2x from that alone.
Ratio = recipe / synthetic; >= 1.0 means the recipe's data pipeline and bookkeeping cost nothing measurable.
Results: printed, and written to bench/out/recipe_vs_synthetic.json. bench/recipe_shards_vs_synthetic.py (B3)
reuses this file's parser, recipe side, interleaving and job runner.
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
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from _common import check_clean, kill_tree, recipe_run, shm_segments

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
OUT = REPO / "bench" / "out"
RESULT = re.compile(r"BENCH_RESULT (\{.*\})")


def build_parser(description: str) -> argparse.ArgumentParser:
    """The options both recipe benches share (recipe_shards_vs_synthetic.py adds its own)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    args.shape = tuple(int(v) for v in args.shape.split(","))
    if args.num_warmup_batches != args.num_batches_per_iter:
        p.error("the recipe's warmup is one epoch of --num-batches-per-iter steps: set --num-warmup-batches "
                f"equal to it (got {args.num_warmup_batches} and {args.num_batches_per_iter})")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__.split("\n\n")[0])
    return check_args(p, p.parse_args(argv))


# ---- inside horovodrun: the recipe side, and alternating two sides ----------------------------------------------

def recipe_side(args: argparse.Namespace, dataset: str, run_dir: Path) -> tuple[Any, Callable[[int], float]]:
    """The recipe's own pieces on `dataset` (call after hvd.init()): its Config, model, LR schedule, SGD wrapped in
    DistributedOptimizer (after the same broadcasts), ShmLoader + DevicePrefetcher + StallMeter; and a function
    that trains epoch e with the recipe's `train_epoch()`, timed as the recipe times an epoch, returning img/s per
    worker. An epoch is `--num-batches-per-iter` steps per rank. Returns (namespace with cfg, train_loader, meter, rank,
    the function)."""
    import horovod.torch as hvd
    import torch

    from hvdtrain.data import DevicePrefetcher, ShmLoader
    from hvdtrain.formats import arrays
    from hvdtrain.train import preempt
    from hvdtrain.train.metrics import MetricSums
    from hvdtrain.train.precision import Precision
    from hvdtrain.train.recipe_data import load_splits
    from hvdtrain.train.torchkit import Meters, epoch_seed, lr_schedule, model_name, setup_process, sgd

    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    import pytorch_train as recipe

    size, rank = hvd.size(), hvd.rank()
    cfg = recipe.Config(
        dataset=dataset, model="resnet", model_width=args.width, synthetic_shape=args.shape,
        synthetic_samples=args.batch_size * args.num_batches_per_iter * size, num_classes=args.num_classes,
        batch_size=args.batch_size, epochs=1 + args.num_iters, warmup_epochs=0.0, num_workers=args.num_workers,
        resume=False, progress=False, tensorboard=False, run_dir=str(run_dir))
    if torch.cuda.is_available():  # as the recipe's main() does: the local rank's GPU, hvdtrain's set-up
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    setup_process(cfg.threads, hvd.local_size())
    splits = load_splits(cfg)
    torch.manual_seed(cfg.seed)
    model = recipe.make_model(model_name(cfg, splits), splits.sample_shape, splits.num_classes,
                              cfg.model_width).to(device)
    schedule = lr_schedule(cfg, cfg.base_lr * size * cfg.backward_passes_per_step)  # the recipe's LR
    optimizer = hvd.DistributedOptimizer(
        sgd(cfg, model, schedule.lr_at(0)), named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=cfg.backward_passes_per_step)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    loader = DevicePrefetcher(ShmLoader(splits.train, rank=rank, size=size, batch_size=cfg.batch_size,
                                        num_workers=cfg.num_workers, seed=cfg.seed, fetch=arrays.take,
                                        order=splits.train.order), device)
    side = SimpleNamespace(cfg=cfg, train_loader=loader, meter=Meters.on(device), rank=rank)
    precision = Precision(cfg.precision, device)

    vote = recipe.stop_vote(preempt.StopRequest(None))  # the recipe's per-step stop vote (nobody asks here)

    def iteration(epoch: int) -> float:
        torch.manual_seed(epoch_seed(cfg.seed, epoch, rank))
        loader.set_epoch(epoch)
        start, sums = time.perf_counter(), MetricSums()
        run = recipe_run(recipe, meters=side.meter, vote=vote, cfg=cfg, epochs=cfg.epochs, loader=loader, net=model,
                         optimizer=optimizer, precision=precision, schedule=schedule)
        recipe.train_epoch(run, epoch, sums, 0)
        train = sums.reduce(recipe.allreduce_sum)  # as the recipe does after an epoch's steps
        return train["samples"] / (time.perf_counter() - start) / size

    return side, iteration


def interleave(a: Callable[[int], float], b: Callable[[int], float], num_iters: int) -> tuple[list[float], ...]:
    """Timed iterations 0..num_iters-1 of `a` and `b` (each given epoch 1 + i), alternating which goes first:
    on a shared machine the load changes by the minute, and so both sides see it alike."""
    ra: list[float] = []
    rb: list[float] = []
    for i in range(num_iters):
        if i % 2 == 0:
            ra.append(a(1 + i))
            rb.append(b(1 + i))
        else:
            rb.append(b(1 + i))
            ra.append(a(1 + i))
    return ra, rb


def worker(args: argparse.Namespace) -> None:
    import timeit

    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    from hvdtrain.train.metrics import combine_stall

    sys.path.insert(0, str(RECIPES))
    from pytorch_models import make_model

    hvd.init()
    size = hvd.size()
    t, recipe_iteration = recipe_side(args, "synthetic", OUT / "recipe-run")  # sets threads: both sides use them

    # Horovod's synthetic benchmark method (see the module docstring), on the recipe's device (the local rank's GPU
    # where there is one, as the example's `model.cuda()`).
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = make_model("resnet", args.shape, args.num_classes, args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none, op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(args.batch_size, *args.shape).to(device)
    target = (torch.LongTensor(args.batch_size).random_() % args.num_classes).to(device)

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def synthetic_iteration(_epoch: int) -> float:
        return args.batch_size * args.num_batches_per_iter / timeit.timeit(benchmark_step,
                                                                          number=args.num_batches_per_iter)

    try:
        timeit.timeit(benchmark_step, number=args.num_warmup_batches)
        recipe_iteration(0)
        synthetic, recipe_img = interleave(synthetic_iteration, recipe_iteration, args.num_iters)
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
        kill_tree(proc)
        proc.communicate(timeout=30)
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything left in horovodrun's own group
    if proc.returncode != 0:
        raise SystemExit(f"job failed (exit {proc.returncode}): {' '.join(argv)}\n{out}")
    return out


def run_bench_job(args: argparse.Namespace, script: Path, worker_args: list[str]) -> dict[str, Any]:
    """`horovodrun -np N script --worker worker_args` on localhost; the JSON its rank 0 printed after BENCH_RESULT."""
    cmd = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
           f"--{args.controller}", sys.executable, str(script.resolve()), "--worker", *worker_args]
    m = RESULT.search(run_job(cmd, args.timeout))
    if not m:
        raise SystemExit("the benchmark job printed no result")
    return json.loads(m.group(1))


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


def compare(base: list[float], other: list[float]) -> dict[str, float]:
    """other / base as the ratio of means, of medians, and the median of the per-iteration ratios (each `other`
    iteration ran right next to a `base` one: the median of their ratios resists load drift)."""
    return {"ratio_of_means": statistics.fmean(other) / statistics.fmean(base),
            "ratio_of_medians": statistics.median(other) / statistics.median(base),
            "paired_ratio_median": statistics.median(o / b for b, o in zip(base, other, strict=True))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    start, before = time.perf_counter(), shm_segments()
    raw = run_bench_job(args, Path(__file__), forwarded(args))
    s, r, ratios = stats(raw["synthetic"]), stats(raw["recipe"]), compare(raw["synthetic"], raw["recipe"])
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "worker"},
        "synthetic_img_per_sec_per_worker": s, "recipe_img_per_sec_per_worker": r,
        "ratio_recipe_over_synthetic": ratios["ratio_of_means"], "ratio_of_medians": ratios["ratio_of_medians"],
        "paired_ratio_median": ratios["paired_ratio_median"],
        "per_iteration": {"synthetic": raw["synthetic"], "recipe": raw["recipe"]},
        "recipe_data_wait_share": raw["stall"]["wait_share"], "recipe_mean_data_wait_s": raw["stall"]["mean_wait_s"],
        "wall_s": time.perf_counter() - start, "leaks": check_clean(before),
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
