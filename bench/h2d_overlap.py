"""Host -> GPU copy overlap: the training step with DevicePrefetcher vs a blocking copy vs batches already on the GPU.

    .venv/bin/python bench/h2d_overlap.py                                  # both workloads, 3 rounds x 100 steps
                                                                           # per mode: about 2-3 minutes on an H100
    .venv/bin/python bench/h2d_overlap.py --workload large --rounds 1      # one workload, one round
    .venv/bin/python bench/h2d_overlap.py --json bench/out/h2d.json --strict  # exit 1 if a goal is missed
    .venv/bin/python bench/h2d_overlap.py --device cpu --small --steps 5 --rounds 1 --warmup 2  # smoke run, no GPU
    options: [--steps 100] [--rounds 3] [--warmup 10] [--workload large|imagenet|all] [--workers 4]
             [--imagenet-dtype float32|uint8] [--amp] [--channels-last] [--sync-each-step] [--small]
             [--json PATH] [--device cuda] [--strict]

Modes, side by side in one run (the same producers, the same batches, the same model and optimizer):
- prefetch: ShmLoader (producer processes, shared memory) -> DevicePrefetcher (host memcpy into a two-slot pinned
  ring, non-blocking copy on a side stream, one batch ahead; hvdtrain/data/prefetch.py);
- sync: the same ShmLoader batches copied with a plain blocking `.to(device)` in the loop (pageable memory, the
  current stream). A copy from pageable memory first waits for the compute already queued; the bench synchronizes
  just before asking for the batch, so that its data wait counts the fetch and the copy, not that drain (the
  timeline, and so the step time, is the same either way);
- resident: two batches of the same loader copied to the GPU once, before the rounds, and reused (no input
  pipeline at all: the floor the other two are held to).
Every round runs each mode once, `--warmup` untimed steps then `--steps` timed ones, the modes' order rotated from
round to round so that drift (clocks, temperature) spreads over all of them. Reported per mode: mean step time
(wall time of the timed steps, the device synchronized at both ends of the window, over all rounds), data wait per
step (host-side time in `next()` of the batch iterator: what the trainer spent blocked waiting for its next batch,
on the device) and as % of step time, the part of it spent inside the ShmLoader itself ("loader wait"; for prefetch
the rest is the prefetcher's own host work: the memcpy into the staging buffers and enqueueing the copy), and the step
time ratio vs resident. The train step does not read the loss (no per-step sync: the host may run ahead of the GPU,
as in a loop that logs every N steps) unless `--sync-each-step`.

Workloads:
- large: x float32[48, 3, 288, 288] (47.8 MB, bench B1's batch size) + y int64[48], a ResNet-34-like net (BasicBlocks
  [3, 4, 6, 3], width 64, 1000 classes): compute well above the copy;
- imagenet: x [256, 3, 224, 224] (float32, 154 MB; `--imagenet-dtype uint8`: 38.5 MB, scaled to [0, 1] on the GPU as
  a JPEG pipeline's output would be) + y int64[256], a ResNet-18-like net ([2, 2, 2, 2], width 64, 1000 classes).
  Both nets are written here with torch.nn (no torchvision).
`--small` (implied by `--device cpu`): tiny shapes and nets, for checking that the script runs end to end.

Goals, per workload, printed as PASS/FAIL: prefetch data wait <= 1% of its step time; prefetch step time <= 1.02 x
resident's. Results: printed, and written to bench/out/h2d_overlap.json (`--json` elsewhere) with every round's
numbers, the copy calibration (one batch: pinned and pageable H2D copy time, host memcpy into pinned memory) and the
goals. Exit status: 0 (1 with `--strict` when a goal is missed, or when producers or shared-memory segments are
left behind), 2 when no CUDA device is there (unless `--device cpu`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _common, also when imported from elsewhere
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import OUT, check_clean, shm_segments, write_json

from hvdtrain.data import DevicePrefetcher, ShmLoader

MODES = ("prefetch", "sync", "resident")
WAIT_GOAL = 0.01  # prefetch data wait <= 1% of step time
RATIO_GOAL = 1.02  # prefetch step time <= 1.02 x resident


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    shape: tuple[int, int, int]  # C, H, W of one image
    dtype: str  # numpy dtype of x
    layers: tuple[int, ...]  # BasicBlocks per stage
    width: int
    classes: int

    @property
    def nbytes(self) -> int:
        return self.batch * int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def workloads(small: bool, imagenet_dtype: str) -> dict[str, Workload]:
    if small:
        return {"large": Workload("large", 4, (3, 32, 32), "float32", (1, 1), 8, 10),
                "imagenet": Workload("imagenet", 8, (3, 32, 32), imagenet_dtype, (1, 1), 8, 10)}
    return {"large": Workload("large", 48, (3, 288, 288), "float32", (3, 4, 6, 3), 64, 1000),
            "imagenet": Workload("imagenet", 256, (3, 224, 224), imagenet_dtype, (2, 2, 2, 2), 64, 1000)}


# ---- producers (pickled by value into the producer processes: numpy only, no torch) ----------------------------

class ImageBatches:
    """generator(worker_id, num_workers, epoch, seed): endless (x, y) batches of a workload's shape. Each worker draws
    its images once (kept across epochs: the workers are persistent) and hands them out with a changing first
    element and fresh labels, so that the producers cost one copy into shared memory per batch."""

    def __init__(self, batch: int, shape: tuple[int, ...], dtype: str, classes: int) -> None:
        self.batch, self.shape, self.dtype, self.classes = batch, shape, dtype, classes
        self.x: np.ndarray | None = None

    def __call__(self, worker_id: int, num_workers: int, epoch: int, seed: int) -> Iterator[tuple[np.ndarray, ...]]:
        rng = np.random.default_rng(seed)
        if self.x is None:
            shape = (self.batch, *self.shape)
            if self.dtype == "uint8":
                self.x = rng.integers(0, 256, shape, dtype=np.uint8)
            else:
                self.x = rng.random(shape, dtype=np.float32)
        for j in itertools.count():
            self.x.flat[0] = j % 200
            yield self.x, rng.integers(0, self.classes, self.batch, dtype=np.int64)


# ---- the model ---------------------------------------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(out)) + self.short(x), inplace=True)


class ResNet(nn.Module):
    """ResNet with BasicBlocks (He et al. 2016): [2, 2, 2, 2] is ResNet-18, [3, 4, 6, 3] ResNet-34."""

    def __init__(self, layers: tuple[int, ...], width: int, classes: int, in_ch: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_ch, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        blocks: list[nn.Module] = []
        cin = width
        for i, n in enumerate(layers):
            cout = width * 2 ** i
            for j in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if j == 0 and i > 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class Trainer:
    """One SGD step on a batch already on the device (uint8 images are scaled to [0, 1] there)."""

    def __init__(self, wl: Workload, device: torch.device, amp: bool, channels_last: bool,
                 sync_each_step: bool) -> None:
        torch.manual_seed(0)
        self.device, self.amp, self.sync_each_step = device, amp, sync_each_step
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model = ResNet(wl.layers, wl.width, wl.classes, wl.shape[0]).to(device, memory_format=self.memory_format)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        x = x.contiguous(memory_format=self.memory_format)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.sync_each_step:
            loss.item()
        return loss


# ---- the three modes ---------------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedLoader:
    """Iterates `loader`, adding the time spent inside the loader's own `next()` to `spent`."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.spent = loader, 0.0

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        clock = time.perf_counter
        while True:
            started = clock()
            batch = next(it, None)
            self.spent += clock() - started
            if batch is None:
                return
            yield batch
            batch = None  # the slot goes back to its worker as soon as the consumer drops its views


def blocking_copies(loader: TimedLoader, device: torch.device) -> Iterator[Any]:
    """sync mode: each batch copied with a plain blocking `.to(device)` from the shared-memory views."""
    for x, y in loader:
        yield torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


@dataclass
class Window:
    """One mode's timed steps in one round."""

    steps: int
    total_s: float
    waits_s: list[float]
    loader_s: float

    def summary(self) -> dict[str, Any]:
        waits = np.asarray(self.waits_s)
        return {"steps": self.steps, "total_s": self.total_s, "step_ms": 1e3 * self.total_s / self.steps,
                "wait_ms": 1e3 * float(waits.mean()), "p50_wait_ms": 1e3 * float(np.percentile(waits, 50)),
                "p99_wait_ms": 1e3 * float(np.percentile(waits, 99)), "max_wait_ms": 1e3 * float(waits.max()),
                "wait_share": float(waits.sum() / self.total_s), "loader_wait_ms": 1e3 * self.loader_s / self.steps}


def run_window(batches: Iterator[Any], trainer: Trainer, warmup: int, steps: int, timed: TimedLoader | None,
               before_next: Callable[[], None] | None) -> Window:
    """`warmup` untimed steps, then `steps` timed ones: wall time between two device synchronizations, and the
    host-side time in each `next()`."""
    clock = time.perf_counter
    for _ in range(warmup):
        if before_next is not None:
            before_next()
        trainer.step(next(batches))
    synchronize(trainer.device)
    if timed is not None:
        timed.spent = 0.0
    waits = []
    started = clock()
    for _ in range(steps):
        if before_next is not None:
            before_next()
        asked = clock()
        batch = next(batches)
        waits.append(clock() - asked)
        trainer.step(batch)
        del batch
    synchronize(trainer.device)
    total = clock() - started
    return Window(steps, total, waits, timed.spent if timed is not None else 0.0)


class Bench:
    """One workload: its producers, model, prefetcher and resident batches, and a window of any mode."""

    def __init__(self, wl: Workload, args: argparse.Namespace, device: torch.device) -> None:
        self.wl, self.args, self.device = wl, args, device
        self.loader = ShmLoader.from_generator(ImageBatches(wl.batch, wl.shape, wl.dtype, wl.classes), rank=0,
                                               size=1, num_workers=args.workers, prefetch=2,
                                               batches_per_epoch=args.warmup + args.steps, timeout=300)
        self.epoch = 0
        self.timed = TimedLoader(self.loader)
        self.prefetcher = DevicePrefetcher(self.timed, device)  # one for the run: its staging buffers are reused
        self.trainer = Trainer(wl, device, args.amp, args.channels_last, args.sync_each_step)
        first = list(itertools.islice(self.next_epoch(), 2))
        self.host = tuple(torch.from_numpy(a.copy()) for a in first[0])  # for the copy calibration
        self.resident = [tuple(torch.from_numpy(a).to(device, copy=True) for a in b) for b in first]
        del first
        for _ in range(max(args.warmup, 3)):  # model warm-up: cuDNN autotuning, allocator, optimizer state
            self.trainer.step(self.resident[0])
        synchronize(device)

    def next_epoch(self) -> Iterator[Any]:
        self.epoch += 1
        self.loader.set_epoch(self.epoch)
        return iter(self.loader)

    def window(self, mode: str) -> Window:
        args, device = self.args, self.device
        if mode == "resident":
            return run_window(itertools.cycle(self.resident), self.trainer, args.warmup, args.steps, None, None)
        self.epoch += 1
        self.loader.set_epoch(self.epoch)
        if mode == "prefetch":
            batches = iter(self.prefetcher)
            before = None
        else:
            batches = blocking_copies(self.timed, device)
            before = (lambda: synchronize(device)) if device.type == "cuda" else None
        result = run_window(batches, self.trainer, args.warmup, args.steps, self.timed, before)
        next(batches, None)  # the epoch ends here (untimed): the producers are told and start on the next
        return result

    def calibrate(self) -> dict[str, float]:
        """One batch's copy costs (median of 5): pinned -> device on a stream, pageable -> device (blocking), and
        the host memcpy into pinned memory that the prefetcher does in `next()`."""
        if self.device.type != "cuda":
            return {}
        host = self.host
        pinned = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in host)
        pin_ms, pinned_ms, pageable_ms = [], [], []
        for _ in range(5):
            started = time.perf_counter()
            for dst, src in zip(pinned, host, strict=True):
                dst.copy_(src)
            pin_ms.append(1e3 * (time.perf_counter() - started))
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            on_device = [t.to(self.device, non_blocking=True) for t in pinned]
            end.record()
            end.synchronize()
            pinned_ms.append(begin.elapsed_time(end))
            del on_device
            synchronize(self.device)
            started = time.perf_counter()
            on_device = [t.to(self.device) for t in host]
            synchronize(self.device)
            pageable_ms.append(1e3 * (time.perf_counter() - started))
            del on_device
        return {"host_memcpy_into_pinned_ms": float(np.median(pin_ms)), "h2d_pinned_ms": float(np.median(pinned_ms)),
                "h2d_pageable_ms": float(np.median(pageable_ms))}

    def close(self) -> None:
        self.loader.close()


# ---- the run -----------------------------------------------------------------------------------------------------

def aggregate(windows: list[Window]) -> dict[str, Any]:
    steps = sum(w.steps for w in windows)
    total = sum(w.total_s for w in windows)
    waits = np.concatenate([np.asarray(w.waits_s) for w in windows])
    return {"steps": steps, "step_ms": 1e3 * total / steps, "wait_ms": 1e3 * float(waits.mean()),
            "p99_wait_ms": 1e3 * float(np.percentile(waits, 99)), "wait_share": float(waits.sum() / total),
            "loader_wait_ms": 1e3 * sum(w.loader_s for w in windows) / steps,
            "rounds": [w.summary() for w in windows]}


def measure(bench: Bench, rounds: int) -> dict[str, Any]:
    windows: dict[str, list[Window]] = {m: [] for m in MODES}
    for r in range(rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]  # rotated: drift spreads over every mode
        for mode in order:
            t0 = time.perf_counter()
            windows[mode].append(bench.window(mode))
            print(f"  {bench.wl.name}: round {r + 1}/{rounds} {mode}: {windows[mode][-1].summary()['step_ms']:.2f} "
                  f"ms/step ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    modes = {m: aggregate(ws) for m, ws in windows.items()}
    base = modes["resident"]["step_ms"]
    for m, r in modes.items():
        r["ratio_vs_resident"] = r["step_ms"] / base
        r["round_ratios_vs_resident"] = [w.total_s / w.steps / (res.total_s / res.steps)
                                         for w, res in zip(windows[m], windows["resident"], strict=True)]
    return modes


def goals(modes: dict[str, Any]) -> dict[str, Any]:
    pf = modes["prefetch"]
    return {"prefetch_wait_share": pf["wait_share"], "prefetch_wait_share_goal": WAIT_GOAL,
            "prefetch_wait_met": pf["wait_share"] <= WAIT_GOAL,
            "prefetch_ratio_vs_resident": pf["ratio_vs_resident"], "prefetch_ratio_goal": RATIO_GOAL,
            "prefetch_ratio_met": pf["ratio_vs_resident"] <= RATIO_GOAL}


def table(wl: Workload, bench: Bench, modes: dict[str, Any], calib: dict[str, float], args: argparse.Namespace) -> str:
    x = f"x {wl.dtype}[{wl.batch}, {', '.join(map(str, wl.shape))}] ({wl.nbytes / 1e6:.1f} MB) + y int64[{wl.batch}]"
    rows = [f"workload {wl.name}: {x}, ResNet{list(wl.layers)} width {wl.width} "
            f"({bench.trainer.params / 1e6:.1f} M params), {args.workers} producers, {args.rounds} rounds x "
            f"{args.steps} steps per mode (+{args.warmup} warm-up)"]
    if calib:
        rows.append(f"  one batch: H2D from pinned {calib['h2d_pinned_ms']:.2f} ms, from pageable (blocking) "
                    f"{calib['h2d_pageable_ms']:.2f} ms, host memcpy into pinned "
                    f"{calib['host_memcpy_into_pinned_ms']:.2f} ms; resident step "
                    f"{modes['resident']['step_ms']:.2f} ms")
    rows.append(f"  {'mode':<10}{'step ms':>10}{'wait ms':>10}{'wait %':>9}{'p99 wait':>10}{'loader ms':>11}"
                f"{'vs resident':>13}   step ms per round")
    for m, r in modes.items():
        per_round = " ".join(f"{w['step_ms']:.2f}" for w in r["rounds"])
        rows.append(f"  {m:<10}{r['step_ms']:>10.2f}{r['wait_ms']:>10.3f}{r['wait_share']:>9.2%}"
                    f"{r['p99_wait_ms']:>10.3f}{r['loader_wait_ms']:>11.3f}{r['ratio_vs_resident']:>12.3f}x   "
                    f"{per_round}")
    return "\n".join(rows)


def verdict_lines(name: str, g: dict[str, Any]) -> list[str]:
    def word(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    return [f"  {word(g['prefetch_wait_met'])} {name}: prefetch data wait {g['prefetch_wait_share']:.2%} of step "
            f"time (goal <= {WAIT_GOAL:.0%})",
            f"  {word(g['prefetch_ratio_met'])} {name}: prefetch step time {g['prefetch_ratio_vs_resident']:.3f} x "
            f"resident (goal <= {RATIO_GOAL})"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, help="timed steps per mode per round (default 100; 5 with --small)")
    ap.add_argument("--rounds", type=int, help="rounds, each running every mode once (default 3; 1 with --small)")
    ap.add_argument("--warmup", type=int, help="untimed steps before each timed window (default 10; 2 with --small)")
    ap.add_argument("--workload", choices=["large", "imagenet", "all"], default="all")
    ap.add_argument("--workers", type=int, help="ShmLoader producer processes (default 4; 2 with --small)")
    ap.add_argument("--imagenet-dtype", choices=["float32", "uint8"], default="float32",
                    help="dtype of the imagenet images as the loader hands them over (uint8: scaled on the GPU)")
    ap.add_argument("--amp", action="store_true", help="bfloat16 autocast in the forward pass")
    ap.add_argument("--channels-last", action="store_true", help="model and input in channels_last")
    ap.add_argument("--sync-each-step", action="store_true",
                    help="read the loss every step (loss.item()): the host waits for the GPU every step")
    ap.add_argument("--small", action="store_true", help="tiny shapes and nets (implied by --device cpu)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (a smoke run)")
    ap.add_argument("--json", type=Path, default=OUT / "h2d_overlap.json")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = ap.parse_args(argv)
    args.small = args.small or torch.device(args.device).type == "cpu"
    for name, default, small in (("steps", 100, 5), ("rounds", 3, 1), ("warmup", 10, 2), ("workers", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else default)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0 or args.workers < 1:
        ap.error("need --steps >= 1, --rounds >= 1, --warmup >= 0 and --workers >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("h2d_overlap: a CUDA device is needed (torch.cuda.is_available() is False); "
              "--device cpu runs a small smoke version", file=sys.stderr)
        return 2
    if device.type not in ("cuda", "cpu"):
        print(f"h2d_overlap: --device must be cuda[:N] or cpu, got {args.device!r}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu"
    before = shm_segments()
    print(f"device {name}, torch {torch.__version__}, python {sys.version.split()[0]}, cpu_count={os.cpu_count()}"
          f"{', small shapes (smoke run)' if args.small else ''}", flush=True)
    wls = workloads(args.small, args.imagenet_dtype)
    chosen = list(wls) if args.workload == "all" else [args.workload]
    report: dict[str, Any] = {"device": name, "torch": torch.__version__,
                              "args": {**vars(args), "json": str(args.json)}, "workloads": {}}
    for key in chosen:
        wl = wls[key]
        started = time.perf_counter()
        bench = Bench(wl, args, device)
        try:
            calib = bench.calibrate()
            modes = measure(bench, args.rounds)
        finally:
            bench.close()
        g = goals(modes)
        report["workloads"][key] = {"workload": asdict(wl), "x_bytes": wl.nbytes, "params": bench.trainer.params,
                                    "calibration": calib, "modes": modes, "goals": g,
                                    "wall_s": time.perf_counter() - started}
        print(table(wl, bench, modes, calib, args), flush=True)
        print("\n".join(verdict_lines(key, g)) + "\n", flush=True)
        del bench
    met = all(w["goals"]["prefetch_wait_met"] and w["goals"]["prefetch_ratio_met"]
              for w in report["workloads"].values())
    report["all_goals_met"] = met
    report["leaks"] = check_clean(before)
    path = write_json(args.json, report)
    print(f"goals {'all met' if met else 'NOT all met'}; written to {path}"
          + ("" if not report["leaks"] else f"; LEAKS: {report['leaks']}"), flush=True)
    if report["leaks"]:
        return 1
    return 1 if args.strict and not met else 0


if __name__ == "__main__":
    sys.exit(main())
