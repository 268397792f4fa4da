"""P4's breakdown: where the PyTorch recipe's step time goes, next to Horovod's synthetic-benchmark step.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python bench/step_overhead.py              # 2 CPU ranks
    horovodrun -np 1 -H localhost:1 --gloo python bench/step_overhead.py --batch-size 256 --width 64 \\
        --num-workers 4                                                                           # one GPU

Loops, each adding one piece of the recipe's step to the one before it (the same model, optimizer and batch size;
the loops take turns block by block, the order rotating every round, so all of them see the same machine):
  synthetic  Horovod's `pytorch_synthetic_benchmark.py` step on one fixed batch: zero_grad, forward, loss,
             backward, optimizer.step() (which waits for the gradients' allreduce)
  +metrics   the recipe's LR per step, `forward_backward` (on-device loss and accuracy sums) and the
             synchronize() / skip_synchronize() split of the step
  +check     the finite check of the averaged gradients, read a step late (NOTE [flags read a step late])
  +vote      the stop vote (NOTE [stop requests]: about every 0.25 s)
  +meters    StallMeter and GpuIdleMeter around the batches
  +loader    the batches from ShmLoader producers (synthetic samples) through DevicePrefetcher, the next copy
             started during the backward pass (`ahead`)
  recipe     `recipes/pytorch_train.py::train_epoch` itself: all of the above as the recipe runs it
A block is one epoch of --steps steps, timed from its start to its last kernel (a device sync at the end);
reported: ms per step (median over --rounds) and each loop's ratio of samples/s to `synthetic` (the median of the
per-round ratios). Results: printed and written to --json.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))
import pytorch_train as recipe  # noqa: E402  (the recipe is a script beside its models, not a package)
from _common import recipe_run, write_json  # noqa: E402  (bench/, this script's folder, is on sys.path)

from hvdtrain.data import DevicePrefetcher, ShmLoader  # noqa: E402
from hvdtrain.formats import arrays  # noqa: E402
from hvdtrain.train import preempt  # noqa: E402
from hvdtrain.train.metrics import MetricSums  # noqa: E402
from hvdtrain.train.precision import Precision  # noqa: E402
from hvdtrain.train.recipe_data import load_splits  # noqa: E402
from hvdtrain.train.stepflags import LateReads  # noqa: E402
from hvdtrain.train.torchkit import Meters, forward_backward, lr_schedule, setup_process, sgd  # noqa: E402

LOOPS = ("synthetic", "+metrics", "+check", "+vote", "+meters", "+loader", "recipe")


class Bench:
    """Everything the loops share: the recipe's config, model, optimizer, schedule, loader, meters and vote."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.cfg = recipe.Config(
            dataset="synthetic", model="resnet", model_width=args.width, synthetic_shape=args.shape,
            synthetic_samples=args.batch_size * args.steps * hvd.size(), batch_size=args.batch_size,
            epochs=10**6, warmup_epochs=0.0, num_workers=args.num_workers, precision=args.precision,
            resume=False, progress=False, tensorboard=False, run_dir=str(REPO / "bench" / "out" / "step_overhead"))
        if torch.cuda.is_available():
            torch.cuda.set_device(hvd.local_rank())
        self.device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
        setup_process(self.cfg.threads, hvd.local_size())
        splits = load_splits(self.cfg)
        torch.manual_seed(self.cfg.seed)
        self.model = recipe.make_model("resnet", splits.sample_shape, splits.num_classes, args.width).to(self.device)
        self.precision = Precision(self.cfg.precision, self.device)
        self.schedule = lr_schedule(self.cfg, self.cfg.base_lr * hvd.size())
        self.optimizer = hvd.DistributedOptimizer(sgd(self.cfg, self.model, self.schedule.lr_at(0)),
                                                  named_parameters=self.model.named_parameters())
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        self.loader = DevicePrefetcher(ShmLoader(
            splits.train, rank=hvd.rank(), size=hvd.size(), batch_size=args.batch_size,
            num_workers=args.num_workers, seed=self.cfg.seed, fetch=arrays.take, order=splits.train.order),
            self.device)
        x, y = arrays.take(splits.train, list(range(args.batch_size)))
        self.batch = (torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device))
        self.meters = Meters.on(self.device)
        self.vote = recipe.stop_vote(preempt.StopRequest(None))
        self.steps, self.epoch = args.steps, 0

    def synthetic(self) -> None:
        x, y = self.batch
        for _ in range(self.steps):
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(x), y).backward()
            self.optimizer.step()

    def partial(self, level: int) -> None:
        """The recipe's step up to LOOPS[level] (1: +metrics ... 5: +loader)."""
        cfg, optimizer, steps = self.cfg, self.optimizer, self.steps
        source: Any = itertools.repeat(self.batch, steps)
        if level >= 5:
            self.loader.set_epoch(self.epoch)
            source = self.loader
        batches = self.meters.wrap(source) if level >= 4 else source
        late, sums = LateReads(self.device, 2), MetricSums()
        for step, (x, y) in enumerate(batches):
            for group in optimizer.param_groups:
                group["lr"] = self.schedule.lr_for_step(self.epoch, step, steps)
            optimizer.zero_grad()
            losses = forward_backward(self.model, x, y, 1, sums, self.precision)
            if level >= 5:
                self.meters.ahead(self.loader)
            optimizer.synchronize()
            values = recipe.step_values(cfg, self.model, optimizer, self.precision, losses) if level >= 2 else None
            with optimizer.skip_synchronize():
                self.precision.step(optimizer)
            if values is not None:
                late.push(step, values)
            if level >= 3:
                self.vote.after_step()
        late.drain()
        if level >= 3:
            self.vote.drain()

    def recipe(self) -> None:
        self.loader.set_epoch(self.epoch)
        run = recipe_run(recipe, meters=self.meters, vote=self.vote, cfg=self.cfg, epochs=self.cfg.epochs,
                         loader=self.loader, net=self.model, optimizer=self.optimizer, precision=self.precision,
                         schedule=self.schedule)
        recipe.train_epoch(run, self.epoch, MetricSums(), 0)

    def block(self, name: str) -> float:
        """One block of `name`'s loop: seconds from its start to its last kernel."""
        self.epoch += 1
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        if name == "synthetic":
            self.synthetic()
        elif name == "recipe":
            self.recipe()
        else:
            self.partial(LOOPS.index(name))
        sync()
        return time.perf_counter() - t0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="steps per block (an epoch)")
    p.add_argument("--rounds", type=int, default=8, help="blocks per loop (medians reported)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--shape", default="3,32,32")
    p.add_argument("--width", type=int, default=16, help="the recipe ResNet's base width")
    p.add_argument("--num-workers", type=int, default=1, help="the loader's producers per rank")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--json", type=Path, default=REPO / "bench" / "out" / "step_overhead.json")
    args = p.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        p.error("--steps must be >= 2 and --rounds >= 1")
    args.shape = tuple(int(v) for v in args.shape.split(","))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    bench = Bench(args)
    seconds: dict[str, list[float]] = {name: [] for name in LOOPS}
    try:
        for name in LOOPS:  # warm-up: the producers started, kernels loaded (not reported)
            bench.block(name)
        for r in range(args.rounds):
            for name in LOOPS[r % len(LOOPS):] + LOOPS[:r % len(LOOPS)]:
                seconds[name].append(bench.block(name))
    finally:
        bench.loader.close()
    ms = {name: 1e3 * statistics.median(s) / args.steps for name, s in seconds.items()}
    ratio = {name: statistics.median(b / s for b, s in zip(seconds["synthetic"], v, strict=True))
             for name, v in seconds.items()}
    result = {"device": torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu",
              "ranks": hvd.size(), "args": {k: str(v) for k, v in vars(args).items()},
              "ms_per_step": ms, "ratio_vs_synthetic": ratio, "seconds": seconds,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if hvd.rank() == 0:
        print(f"step overhead on {result['device']}, {hvd.size()} rank(s): ResNet width {args.width} on "
              f"{args.shape}, batch {args.batch_size}, {args.precision}, {args.steps} steps x {args.rounds} rounds")
        for name in LOOPS:
            print(f"  {name:<10} {ms[name]:8.3f} ms/step   {ratio[name]:.3f}x synthetic", flush=True)
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
