"""B8, the GPU feed: the PyTorch recipe's own training loop fed three ways, side by side in one run.

    horovodrun -np 1 -H localhost:1 python bench/gpu_feed.py --json OUT.json          # on a GPU (gpu_check.sh)
    horovodrun -np 1 -H localhost:1 .venv/bin/python bench/gpu_feed.py --steps 20     # CPU: a smoke run only

Feeds (each trains with `recipes/pytorch_train.py::train_epoch`: LR schedule, --precision autocast, Horovod's
synchronize/step, on-device metric sums; the same model, optimizer and synthetic samples):
  resident    the rank's samples already on the GPU, each batch gathered there (the ceiling: no input pipeline)
  hvdtrain    ShmLoader (--num-workers producer processes, shared memory) + DevicePrefetcher, as the recipe: the
              copy reads the producers' page-locked slots directly (NOTE [registered slots]); the prefetcher's
              host-side phases on the trainer thread timed per batch (loader next, memcpy, the whole issue)
  before      the same through the recipe's loop as it was before issue 35: each step's finite check read at once
              (the host waits for the GPU every step), the next batch's copy started between steps (in next(),
              not during the backward pass: DevicePrefetcher.ahead), a stop vote at every step (it keeps issue 35's
              one-kernel check and in-place metric sums)
  memcpy      the same with register_slots=False: each batch memcpy'd into pinned staging buffers (hvdtrain before
              issue 33; 2.0 ms of the trainer thread's time per 3 MB batch on an H200)
  dataloader  torch.utils.data.DataLoader(pin_memory=True, the same --num-workers, persistent workers) over the
              same samples with a DistributedSampler, batches copied with .to(device, non_blocking=True): what a
              user would otherwise write
One window = one epoch of --steps steps; the feeds take turns window by window (the order rotating every round),
so all of them see the same machine. Per window: samples/s over the steps after the first (each feed's epoch
start-up left out alike), the GPU's idle share between steps (GpuIdleMeter: CUDA events) and the host's data-wait
share (StallMeter). Goals (issue 33): GPU idle <= 1% of the step; hvdtrain >= 0.98x resident and >= 1.0x
dataloader in samples/s. On a CPU the idle share is not measured and the goals are not judged.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))
import pytorch_train as recipe  # noqa: E402  (the recipe is a script beside its models, not a package)
from _common import goal_lines, recipe_run, write_json  # noqa: E402  (bench/, this script's folder, is on sys.path)

from hvdtrain.data import DevicePrefetcher, ShmLoader  # noqa: E402
from hvdtrain.formats import arrays  # noqa: E402
from hvdtrain.train import preempt  # noqa: E402
from hvdtrain.train.metrics import MetricSums  # noqa: E402
from hvdtrain.train.precision import Precision, prepare_model  # noqa: E402
from hvdtrain.train.recipe_data import load_splits  # noqa: E402
from hvdtrain.train.stepflags import LateReads  # noqa: E402
from hvdtrain.train.torchkit import Meters, check_device, lr_schedule, setup_process, sgd  # noqa: E402

FEEDS = ("resident", "hvdtrain", "before", "memcpy", "dataloader")
BEFORE = "before"  # the hvdtrain feed through the recipe's loop as it was before issue 35 (see `loop_before`)


class PhaseTimes:
    """Where the trainer thread's time in the prefetcher's next() goes (seconds, summed; `batches` counted)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {"loader_next": 0.0, "pin_memcpy": 0.0, "issue_total": 0.0}
        self.batches = 0

    def per_batch_ms(self) -> dict[str, float]:
        return {k: 1e3 * v / max(self.batches, 1) for k, v in self.t.items()}


class TimedLoader:
    """The loader, its next() timed into `phases` (the prefetcher calls it on the trainer thread)."""

    def __init__(self, loader: Any, phases: PhaseTimes) -> None:
        self.loader, self.phases = loader, phases

    def __iter__(self):
        it = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            self.phases.t["loader_next"] += time.perf_counter() - t0
            if batch is None:
                return
            self.phases.batches += 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        return self.loader.state_dict(unconsumed=unconsumed)

    def close(self) -> None:
        self.loader.close()


class TimedPrefetcher(DevicePrefetcher):
    """DevicePrefetcher with its host-side phases timed: the memcpy into the staging buffers, the whole issue."""

    def __init__(self, loader: ShmLoader, device: torch.device, register_slots: bool) -> None:
        self.phases = PhaseTimes()
        super().__init__(TimedLoader(loader, self.phases), device, register_slots=register_slots)

    def _pin(self, slot: int, host: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return super()._pin(slot, host)
        finally:
            self.phases.t["pin_memcpy"] += time.perf_counter() - t0

    def _issue(self, host: Any, slot: int) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        try:
            return self._copy(host, slot)
        finally:
            self.phases.t["issue_total"] += time.perf_counter() - t0

    def _copy(self, host: Any, slot: int) -> tuple[Any, Any]:
        return super()._issue(host, slot)


class Resident:
    """The rank's shard on the device; each epoch a permutation drawn on the device, batches gathered there."""

    def __init__(self, ds: arrays.ArrayDataset, rank: int, size: int, batch: int, device: torch.device) -> None:
        mine = np.arange(rank, len(ds), size)
        self.x = torch.from_numpy(ds.x[mine]).to(device)
        self.y = torch.from_numpy(ds.y[mine]).to(device)
        self.batch, self.device, self.epoch = batch, device, 0

    def __len__(self) -> int:
        return len(self.y) // self.batch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator(device=self.device).manual_seed(self.epoch)
        order = torch.randperm(len(self.y), device=self.device, generator=g)
        for i in range(len(self)):
            idx = order[i * self.batch:(i + 1) * self.batch]
            yield self.x[idx], self.y[idx]


class TorchDataLoaderFeed:
    """torch's DataLoader as users write it for Horovod: DistributedSampler, pinned batches, non-blocking copy."""

    def __init__(self, ds: arrays.ArrayDataset, rank: int, size: int, batch: int, workers: int,
                 device: torch.device) -> None:
        samples = torch.utils.data.TensorDataset(torch.from_numpy(ds.x), torch.from_numpy(ds.y))
        self.sampler = torch.utils.data.distributed.DistributedSampler(samples, num_replicas=size, rank=rank,
                                                                       shuffle=True, seed=0, drop_last=True)
        self.loader = torch.utils.data.DataLoader(
            samples, batch_size=batch, sampler=self.sampler, num_workers=workers, drop_last=True,
            pin_memory=device.type == "cuda", persistent_workers=workers > 0,
            prefetch_factor=4 if workers > 0 else None)
        self.device = device

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        for x, y in self.loader:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def make_feeds(cfg: recipe.Config, splits: arrays.Splits, device: torch.device) -> dict[str, Any]:
    rank, size, batch = hvd.rank(), hvd.size(), cfg.batch_size
    return {
        "resident": Resident(splits.train, rank, size, batch, device),
        **{name: TimedPrefetcher(ShmLoader(splits.train, rank=rank, size=size, batch_size=batch,
                                           num_workers=cfg.num_workers, seed=cfg.seed, fetch=arrays.take,
                                           order=splits.train.order), device, register_slots=name != "memcpy")
           for name in ("hvdtrain", BEFORE, "memcpy")},
        "dataloader": TorchDataLoaderFeed(splits.train, rank, size, batch, cfg.num_workers, device),
    }


class NoAhead:
    """A feed without `ahead()`: every copy is started in `next()`, between steps."""

    def __init__(self, feed: Any) -> None:
        self.feed = feed

    def __iter__(self):
        return iter(self.feed)

    def __len__(self) -> int:
        return len(self.feed)


@contextlib.contextmanager
def loop_before(active: bool) -> Iterator[None]:
    """The recipe's loop as it was before issue 35, when `active`: the step's checks read at once (lag 0: the host
    waits for the GPU every step); with the feed wrapped in NoAhead and a vote at every step (`votes`)."""
    if not active:
        yield
        return
    original = recipe.LateReads
    recipe.LateReads = functools.partial(LateReads, lag=0)  # type: ignore[misc]
    try:
        yield
    finally:
        recipe.LateReads = original  # type: ignore[misc]


def votes() -> dict[bool, preempt.StopVote]:
    """The recipe's stop vote (nobody asks to stop here): as now, and at every step (before issue 35)."""
    return {before: recipe.stop_vote(preempt.StopRequest(None), every_s=0.0 if before else None)
            for before in (False, True)}


def window(cfg: recipe.Config, epoch: int, name: str, feed: Any, net: torch.nn.Module, optimizer: Any,
           schedule: Any, meters: Meters, precision: Precision, vote: dict[bool, preempt.StopVote]
           ) -> dict[str, float]:
    """One epoch of `feed` through the recipe's train_epoch; figures over its steps after the first."""
    feed.set_epoch(epoch)
    mark = meters.mark()
    phases = getattr(feed, "phases", None)
    if phases is not None:
        phases.__init__()  # this window's phases only
    sums, before = MetricSums(), name == BEFORE
    with loop_before(before):
        run = recipe_run(recipe, meters=meters, vote=vote[before], cfg=cfg, epochs=cfg.epochs,
                         loader=NoAhead(feed) if before else feed, net=net, optimizer=optimizer, precision=precision,
                         schedule=schedule)
        recipe.train_epoch(run, epoch, sums, 0)
    train = sums.reduce(recipe.allreduce_sum)
    steps = meters.stall.steps[mark[0] + 1:]
    waits = meters.stall.waits[mark[0] + 1:]
    idle, busy = meters.idle.idle_ms[mark[1] + 1:], meters.idle.busy_ms[mark[1] + 1:]
    return {"samples_per_s": cfg.batch_size * hvd.size() * len(steps) / sum(steps),
            "step_ms": 1e3 * sum(steps) / len(steps), "data_wait_share": sum(waits) / sum(steps),
            "gpu_idle_share": sum(idle) / (sum(idle) + sum(busy)) if meters.idle.measured else None,
            "gpu_idle_ms": statistics.mean(idle) if meters.idle.measured else None,
            "train_loss": train["loss"],
            **({f"{k}_ms": v for k, v in phases.per_batch_ms().items()} if phases is not None else {})}


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals on the medians over rounds (not judged on a CPU: no GPU idle to measure)."""
    med = {f: {k: statistics.median(w[k] for w in ws) if ws[0][k] is not None else None for k in ws[0]}
           for f, ws in result["windows"].items()}
    out: dict[str, Any] = {"median": med}
    if not result["gpu"]:
        return {**out, "goals": "not judged: no GPU"}
    out["slots_registered"] = result.get("slots_registered")
    ours = med["hvdtrain"]
    goals = {
        "gpu_idle_share <= 0.01": (ours["gpu_idle_share"], ours["gpu_idle_share"] <= 0.01),
        "samples/s >= 0.98 x resident": (ours["samples_per_s"] / med["resident"]["samples_per_s"],
                                         ours["samples_per_s"] >= 0.98 * med["resident"]["samples_per_s"]),
        "samples/s >= 1.0 x dataloader": (ours["samples_per_s"] / med["dataloader"]["samples_per_s"],
                                          ours["samples_per_s"] >= med["dataloader"]["samples_per_s"]),
    }
    return {**out, "goals": {k: {"value": v, "met": ok} for k, (v, ok) in goals.items()}}


def table(result: dict[str, Any]) -> str:
    lines = [f"B8 GPU feed on {result['device']}: {result['config']}",
             f"{'feed':<11} {'samples/s':>10} {'step ms':>8} {'GPU idle':>9} {'idle ms':>8} {'host wait':>9}"]
    for f, m in result["median"].items():
        idle = "n/a" if m["gpu_idle_share"] is None else f"{m['gpu_idle_share']:.2%}"
        idle_ms = "n/a" if m["gpu_idle_ms"] is None else f"{m['gpu_idle_ms']:.3f}"
        phases = "  ".join(f"{k[:-3]} {v:.3f} ms" for k, v in m.items() if k.endswith("_ms") and k not in
                           ("step_ms", "gpu_idle_ms"))
        lines.append(f"{f:<11} {m['samples_per_s']:>10.0f} {m['step_ms']:>8.3f} {idle:>9} {idle_ms:>8} "
                     f"{m['data_wait_share']:>9.2%}  {phases}".rstrip())
    return "\n".join(lines + goal_lines(result["goals"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="steps per window (an epoch)")
    p.add_argument("--rounds", type=int, default=3, help="windows per feed (medians reported)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--shape", default="3,32,32")
    p.add_argument("--width", type=int, default=64, help="the recipe ResNet's base width")
    p.add_argument("--num-workers", type=int, default=4, help="producers (hvdtrain) = DataLoader workers")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available(),
                   help="default: on a GPU (refused on CPU, see the recipe's --channels-last)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        p.error("--steps must be >= 3 and --rounds >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    shape = tuple(int(v) for v in args.shape.split(","))
    cfg = recipe.Config(dataset="synthetic", model="resnet", model_width=args.width, synthetic_shape=shape,
                        synthetic_samples=args.batch_size * args.steps * hvd.size() * 8 // 7 + 8,
                        batch_size=args.batch_size, epochs=1 + args.rounds * len(FEEDS), warmup_epochs=0.0,
                        num_workers=args.num_workers, precision=args.precision, channels_last=args.channels_last,
                        compile=args.compile, resume=False, progress=False, tensorboard=False,
                        run_dir=str(REPO / "bench" / "out" / "gpu_feed"))
    check_device(cfg)  # --channels-last needs a GPU, as the recipe checks
    if torch.cuda.is_available():  # as the recipe's main() does: the local rank's GPU, hvdtrain's set-up
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    setup_process(cfg.threads, hvd.local_size())
    splits = load_splits(cfg)
    torch.manual_seed(cfg.seed)
    model = recipe.make_model("resnet", splits.sample_shape, splits.num_classes, cfg.model_width).to(device)
    net, precision = prepare_model(model, cfg.channels_last, cfg.compile), Precision(cfg.precision, device)
    schedule = lr_schedule(cfg, cfg.base_lr * hvd.size() * cfg.backward_passes_per_step)  # the recipe's LR
    optimizer = hvd.DistributedOptimizer(sgd(cfg, model, schedule.lr_at(0)), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    feeds = make_feeds(cfg, splits, device)
    meters, vote = Meters.on(device), votes()
    names = list(FEEDS)
    windows: dict[str, list[dict[str, float]]] = {f: [] for f in names}
    try:
        for f in names:  # warm-up: each feed's workers started, cuDNN autotuned, compiled (not reported)
            window(cfg, 0, f, feeds[f], net, optimizer, schedule, meters, precision, vote)
        for r in range(args.rounds):
            for f in names[r % len(names):] + names[:r % len(names)]:
                windows[f].append(window(cfg, 1 + r, f, feeds[f], net, optimizer, schedule, meters, precision,
                                         vote))
    finally:
        for f in ("hvdtrain", BEFORE, "memcpy"):
            feeds[f].close()
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "gpu": device.type == "cuda", "torch": torch.__version__, "args": {k: str(v) for k, v in
                                                                               vars(args).items()},
              "config": f"ResNet width {args.width} on {args.shape} px, batch {args.batch_size}, {args.precision}"
                        f"{', channels-last' if args.channels_last else ''}{', compiled' if args.compile else ''}, "
                        f"{args.num_workers} workers, {hvd.size()} rank(s)",
              "windows": windows, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "slots_registered": feeds["hvdtrain"].slots_registered, "slots_failed": feeds["hvdtrain"].slots_failed}
    result.update(judge(result))
    if hvd.rank() == 0:
        print(table(result), flush=True)
        if args.json:
            write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
