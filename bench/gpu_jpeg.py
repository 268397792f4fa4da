"""B9, JPEGs on the GPU: a ResNet-50 trained on 224 px JPEGs (bf16 + channels-last on a GPU), fed three ways side by
side in one run (issue 33 item 5b). Single process, plain torch optimizer: no Horovod needed.

    python bench/gpu_jpeg.py --json OUT.json                                                  # on a GPU (gpu_check.sh)
    .venv/bin/python bench/gpu_jpeg.py --batch-size 8 --steps 3 --rounds 1 --workers 2 --images 64   # CPU smoke run

--images distinct JPEGs (bench/jpeg_decode.py's sample_jpegs: real photographs, ~500x375, quality 95) are written
to a temporary MDS dataset (x: jpeg, y: int64) whose training split cycles through them (sample i is JPEG i % n,
label (i % n) % 10) for one window's epoch. Feeds, all trained by the same `train_step`:
  hvdtrain    ShmLoader over the StreamSplit of `load_splits(root, image_size=224, augment=True)` as the recipe
              builds it (shard_loader): the producers decode + augment (OpenCV: RandomResizedCrop + flip) into uint8
              N×H×W×3 batches in shared memory; DevicePrefetcher copies them to the GPU
  resident    images // batch distinct uint8 batches decoded once up front (hvdtrain's decoder) and kept on the
              GPU, cycled: the ceiling, no input pipeline
  dataloader  torch.utils.data.DataLoader(pin_memory=True, the same --workers, persistent_workers=True,
              prefetch_factor=2, shuffle) over a map-style dataset of the same JPEG bytes: torchvision.io.decode_jpeg
              + transforms.v2 RandomResizedCrop(224, antialias=True) + RandomHorizontalFlip if torchvision imports,
              else Pillow (open, RGB, resize of the RandomResizedCrop box with BILINEAR, flip); each image is
              permuted to H×W×3 in the worker, so its batches are uint8 N×H×W×3 like hvdtrain's; then
              `.to(device, non_blocking=True)`
Every batch is normalised on the device by `hvdtrain.train.precision.as_input` (uint8 N×H×W×3 -> float in [0, 1],
an N×C×H×W channels-last view). Model: torchvision's resnet50(num_classes=10), else the recipe's ResNet (CPU smoke
runs); SGD with momentum, cross entropy, --precision autocast (bf16 on a GPU, fp32 on CPU); channels-last on a GPU
only (refused on CPU, see the recipe's --channels-last).

NOTE [a window is an epoch]
A window trains one whole epoch of max(--skip + --steps, images // batch) steps, the first --skip not counted
(default on a GPU workers x 2 + 2: the batches a feed's buffers filled while the other feeds ran, or the start-up of
a feed that starts epochs only when asked, like the DataLoader). Whole epochs, as loaders are built to run them: an
epoch of the 2048 images alone would be 8 batches, fewer than the workers, with a boundary every 8 steps; and an
epoch left unfinished makes the next one drain the old batches. The feeds take turns, the order rotating each
round. Per window: samples/s and step ms (on a GPU from CUDA events: the GPU's own time for the counted steps, which
the host's clock misses while kernels are queued), the host's wait in next() (StallMeter), the GPU's idle share
between steps (GpuIdleMeter). Then one more epoch of each loader feed without training: the rate it can deliver.
Goals (GPU only, medians): hvdtrain's GPU idle <= 1% of the step, samples/s >= 0.98x resident and >= 1.0x dataloader.
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench"), str(REPO / "recipes")]
from _common import goal_lines, write_json  # noqa: E402
from jpeg_decode import crop_box, sample_jpegs  # noqa: E402  (bench/ and recipes/ are scripts, not packages)

from hvdtrain.data.idle import GpuIdleMeter  # noqa: E402
from hvdtrain.data.stall import StallMeter  # noqa: E402
from hvdtrain.train.precision import Precision, as_input, prepare_model  # noqa: E402

try:
    import torchvision
    from torchvision.io import decode_jpeg
    from torchvision.transforms import v2
except ImportError:
    torchvision = None

FEEDS = ("hvdtrain", "resident", "dataloader")
SIZE = 224
Batch = tuple[torch.Tensor, torch.Tensor]


def write_dataset(root: Path, n: int, length: int, seed: int) -> list[bytes]:
    """n distinct JPEGs (made on threads, 64 per seed); root/train holds `length` samples cycling through them (sample
    i: JPEG i % n, label (i % n) % 10), root/val the first 64. No shard hashes: nothing to verify in fresh files."""
    from hvdtrain.stream.mds import MDSWriter

    chunks = [(min(64, n - s), seed * 100003 + s) for s in range(0, n, 64)]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        jpegs = [j for part in pool.map(lambda c: sample_jpegs(*c), chunks) for j in part]
    for split, rows in (("train", range(length)), ("val", range(min(n, 64)))):
        with MDSWriter(root / split, {"x": "jpeg", "y": "int64"}, hashes=(), meta={"num_classes": 10}) as out:
            for i in rows:
                out.write({"x": jpegs[i % n], "y": (i % n) % 10})
    return jpegs


class JpegDataset(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """The JPEG bytes as a map-style dataset: (uint8 H×W×3 augmented image, label), as a DataLoader user writes it."""

    def __init__(self, jpegs: list[bytes], length: int) -> None:
        self.jpegs, self.length = jpegs, length
        self.rng: random.Random | None = None  # Pillow path: per worker, seeded from the worker's torch seed
        self.aug = (v2.Compose([v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip()])
                    if torchvision is not None else None)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        i %= len(self.jpegs)  # as the MDS train split: sample i is JPEG i % n
        data = self.jpegs[i]
        if self.aug is not None:
            img = self.aug(decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)))
            return img.permute(1, 2, 0), i % 10  # C×H×W -> H×W×C (collate stacks it contiguous)
        from PIL import Image

        if self.rng is None:
            self.rng = random.Random(torch.initial_seed())
        img = Image.open(io.BytesIO(data)).convert("RGB")
        left, top, cw, ch = crop_box(*img.size, self.rng)
        img = img.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(left, top, left + cw, top + ch))
        if self.rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(img)), i % 10


Epoch = Callable[[int], Iterator[Batch]]  # a feed: epoch number -> that epoch's batches on the device


def hvdtrain_feed(root: Path, args: argparse.Namespace, device: torch.device) -> tuple[Epoch, Any]:
    """The recipe's loader (recipes/pytorch_train.py shard_loader) over the decoding StreamSplit; (feed, loader)."""
    from hvdtrain.data import DevicePrefetcher, ShmLoader
    from hvdtrain.formats import arrays
    from hvdtrain.train.streamed import load_splits

    with warnings.catch_warnings():  # "shards cannot be verified": written without hashes, on purpose
        warnings.filterwarnings("ignore", message=".*cannot be verified before use")
        splits = load_splits(root, num_classes=10, image_size=SIZE, augment=True)
    loader = DevicePrefetcher(ShmLoader(splits.train, rank=0, size=1, batch_size=args.batch_size,
                                        num_workers=args.workers, seed=args.seed, fetch=arrays.take,
                                        order=splits.train.order, epochs=args.rounds + 2), device)

    def epoch(e: int) -> Iterator[Batch]:
        loader.set_epoch(e)
        return iter(loader)
    return epoch, loader


def resident_feed(jpegs: list[bytes], args: argparse.Namespace, device: torch.device) -> Epoch:
    """images // batch distinct batches decoded once (hvdtrain's decoder, epoch 0's crops) on the device, cycled."""
    from hvdtrain.stream.images import ImageAugment, decode_batch

    aug, b = ImageAugment(SIZE), args.batch_size

    def one(k: int) -> Batch:
        idx = np.arange(k * b, (k + 1) * b)
        x = decode_batch([jpegs[i] for i in idx], aug, args.seed, 0, idx)
        return torch.from_numpy(x).to(device), torch.from_numpy(idx % 10).to(device)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # OpenCV releases the GIL
        held = list(pool.map(one, range(len(jpegs) // b)))
    return lambda e: (held[k % len(held)] for k in range(args.epoch_batches))


def dataloader_feed(jpegs: list[bytes], args: argparse.Namespace, device: torch.device) -> Epoch:
    loader = torch.utils.data.DataLoader(
        JpegDataset(jpegs, args.epoch_batches * args.batch_size), batch_size=args.batch_size, shuffle=True,
        drop_last=True, num_workers=args.workers, pin_memory=device.type == "cuda", persistent_workers=True,
        prefetch_factor=2)
    return lambda e: ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)


def make_model(device: torch.device, args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(args.seed)
    if torchvision is not None:
        return torchvision.models.resnet50(num_classes=10).to(device), "torchvision ResNet-50"
    from pytorch_models import make_model as recipe_model

    return recipe_model("resnet", (3, SIZE, SIZE), 10).to(device), "the recipe's ResNet (no torchvision)"


def train_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: Precision, channels_last: bool,
               batch: Batch) -> torch.Tensor:
    """One step, the same for every feed: normalise on the device, forward + loss under autocast, SGD step."""
    x, y = batch
    with precision.autocast():
        loss = F.cross_entropy(net(as_input(x, channels_last)), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def window(batches: Iterator[Batch], step: Callable[[Batch], torch.Tensor], skip: int,
           device: torch.device) -> dict[str, Any]:
    """One whole epoch of training; figures over its steps after the first `skip` (GPU time from CUDA events)."""
    stall, idle = StallMeter(warmup_steps=0), GpuIdleMeter(device, warmup_steps=0)
    losses, samples = [], 0
    for k, batch in enumerate(idle.wrap(stall.wrap(batches))):
        losses.append(step(batch))
        samples += len(batch[1]) if k >= skip else 0
    host, waits = sum(stall.steps[skip:]), sum(stall.waits[skip:])
    gpu = sum(idle.idle_ms[skip:]) + sum(idle.busy_ms[skip:])
    seconds, steps = (gpu / 1e3 if idle.measured else host), len(losses) - skip
    return {"samples_per_s": samples / seconds, "step_ms": 1e3 * seconds / steps, "steps": steps,
            "host_step_ms": 1e3 * host / steps, "data_wait_share": waits / host,
            "gpu_idle_share": sum(idle.idle_ms[skip:]) / gpu if idle.measured else None,
            "gpu_idle_ms": statistics.mean(idle.idle_ms[skip:]) if idle.measured else None,
            "train_loss": float(torch.stack(losses[skip:]).float().mean())}


def feed_only(batches: Iterator[Batch], skip: int, device: torch.device) -> float:
    """Samples/s one epoch of the feed delivers to the device with no training, after its first `skip` batches."""
    n, t0 = 0, 0.0
    for k, (_, y) in enumerate(batches):
        if k == skip:
            synchronize(device)
            t0 = time.perf_counter()
        n += len(y) if k >= skip else 0
    synchronize(device)
    return n / (time.perf_counter() - t0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def judge(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals on the medians over rounds (not judged on a CPU: no GPU idle to measure)."""
    med: dict[str, dict[str, Any]] = {
        f: {k: statistics.median(w[k] for w in ws) if ws[0][k] is not None else None for k in ws[0]}
        for f, ws in result["windows"].items()}
    out: dict[str, Any] = {"median": med}
    if not result["gpu"]:
        return {**out, "goals": "not judged: no GPU"}
    ours, res, dl = med["hvdtrain"], med["resident"]["samples_per_s"], med["dataloader"]["samples_per_s"]
    goals = {
        "gpu_idle_share <= 0.01": (ours["gpu_idle_share"], ours["gpu_idle_share"] <= 0.01),
        "samples/s >= 0.98 x resident": (ours["samples_per_s"] / res, ours["samples_per_s"] >= 0.98 * res),
        "samples/s >= 1.0 x dataloader": (ours["samples_per_s"] / dl, ours["samples_per_s"] >= dl),
    }
    return {**out, "goals": {k: {"value": v, "met": ok} for k, (v, ok) in goals.items()}}


def table(result: dict[str, Any]) -> str:
    lines = [f"B9 JPEG feed on {result['device']}: {result['config']}",
             f"{'feed':<11} {'samples/s':>10} {'step ms':>8} {'GPU idle':>9} {'idle ms':>8} {'host wait':>9} "
             f"{'feed only/s':>11}"]
    for f, m in result["median"].items():
        idle = "n/a" if m["gpu_idle_share"] is None else f"{m['gpu_idle_share']:.2%}"
        idle_ms = "n/a" if m["gpu_idle_ms"] is None else f"{m['gpu_idle_ms']:.3f}"
        alone = result["feed_only_samples_per_s"].get(f)
        lines.append(f"{f:<11} {m['samples_per_s']:>10.0f} {m['step_ms']:>8.2f} {idle:>9} {idle_ms:>8} "
                     f"{m['data_wait_share']:>9.2%} {'-' if alone is None else f'{alone:.0f}':>11}")
    return "\n".join(lines + goal_lines(result["goals"]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="counted steps per window (more if --images needs more)")
    p.add_argument("--rounds", type=int, default=3, help="windows per feed (medians reported)")
    p.add_argument("--skip", type=int, help="uncounted steps at each window's start (default: workers x 4 + 4 on "
                                            "a GPU, the batches the feeds' buffers hold; 1 on CPU)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=max(1, cores - 2), help="hvdtrain producers = DataLoader workers")
    p.add_argument("--images", type=int, default=2048, help="distinct JPEGs (a multiple of --batch-size)")
    p.add_argument("--precision", default="bf16" if gpu else "fp32", choices=("fp32", "bf16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    # a ShmLoader producer holds prefetch + 1 slots and a batch waiting for one (NOTE [epoch ahead]); 2026-11-27's
    # runs skipped workers x 2 + 2 (bench/results/gpu-h200-2026-11-27/summary.txt says what that means)
    args.skip = (args.workers * 4 + 4 if gpu else 1) if args.skip is None else args.skip
    if min(args.steps, args.rounds, args.skip, args.workers) < 1:
        p.error("--steps, --rounds, --skip and --workers must be >= 1 (a window's first step has no idle gap)")
    if args.images < args.batch_size or args.images % args.batch_size:
        p.error(f"--images {args.images} must be a multiple of --batch-size {args.batch_size}")
    # NOTE [a window is an epoch]: --skip + --steps batches, or every distinct image once.
    args.epoch_batches = max(args.skip + args.steps, args.images // args.batch_size)
    return args


def rounds(feeds: dict[str, Epoch], step: Callable[[Batch], torch.Tensor], args: argparse.Namespace,
           device: torch.device) -> tuple[dict[str, list[dict[str, Any]]], dict[str, float]]:
    """--rounds windows per feed, taking turns (the order rotating), then each loader feed's rate alone."""
    names, epochs = list(FEEDS), dict.fromkeys(FEEDS, 0)

    def next_epoch(f: str) -> Iterator[Batch]:
        epochs[f] += 1
        return feeds[f](epochs[f] - 1)
    windows: dict[str, list[dict[str, Any]]] = {f: [] for f in names}
    for r in range(args.rounds):
        for f in names[r % len(names):] + names[:r % len(names)]:
            windows[f].append(window(next_epoch(f), step, args.skip, device))
    def two_epochs(f: str) -> Iterator[Batch]:  # back to back: enough batches past what the buffers held
        yield from next_epoch(f)
        yield from next_epoch(f)
    # Uncounted: every batch a feed can have made ahead (per ShmLoader producer its prefetch + 1 slots and the batch
    # it holds waiting for one: NOTE [epoch ahead] in hvdtrain/data/loader.py; the DataLoader's prefetch_factor per
    # worker) and the prefetcher's, so the rate is the producers', not the buffers'.
    buffered = args.workers * 4 + 4
    alone = {f: feed_only(two_epochs(f), buffered, device) for f in ("hvdtrain", "dataloader")}
    return windows, alone


def run(args: argparse.Namespace, root: Path, device: torch.device) -> dict[str, Any]:
    jpegs = write_dataset(root, args.images, args.epoch_batches * args.batch_size, args.seed)
    channels_last = device.type == "cuda"
    model, model_name = make_model(device, args)
    net, precision = prepare_model(model, channels_last, False), Precision(args.precision, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-5)

    def step(b: Batch) -> torch.Tensor:
        return train_step(net, optimizer, precision, channels_last, b)
    hvd_feed, loader = hvdtrain_feed(root, args, device)
    try:
        feeds = {"hvdtrain": hvd_feed, "resident": resident_feed(jpegs, args, device),
                 "dataloader": dataloader_feed(jpegs, args, device)}
        for batch in itertools.islice(feeds["resident"](0), 3):  # warm-up: cuDNN autotuned, memory allocated
            step(batch)
        windows, alone = rounds(feeds, step, args, device)
    finally:
        loader.close()
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "gpu": device.type == "cuda", "torch": torch.__version__,
            "torchvision": getattr(torchvision, "__version__", None),
            "args": {k: str(v) for k, v in vars(args).items()},
            "config": f"{model_name}, {args.images} distinct JPEGs at {SIZE} px, batch {args.batch_size}, "
                      f"{args.precision}{', channels-last' if channels_last else ''}, {args.workers} workers, "
                      f"{args.rounds} rounds of {args.epoch_batches}-step epochs ({args.skip} uncounted); "
                      f"DataLoader decodes with {'torchvision' if torchvision is not None else 'Pillow'}",
            "mean_jpeg_kib": round(sum(map(len, jpegs)) / len(jpegs) / 1024, 1),
            "windows": windows, "feed_only_samples_per_s": alone, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "slots_registered": loader.slots_registered, "slots_failed": loader.slots_failed}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.backends.cudnn.benchmark = True  # fixed shapes: the fastest convolutions, found in the warm-up
    tmp = Path(tempfile.mkdtemp(prefix="hvdtrain-gpu-jpeg-"))
    os.environ["HVDTRAIN_DATA_CACHE"] = str(tmp / "cache")  # the temporary dataset's node cache goes with it
    t0 = time.perf_counter()
    try:
        result = run(args, tmp / "data", device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.update(judge(result), seconds=round(time.perf_counter() - t0, 1))
    print(table(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
