"""B7 (issue 33 item 5): decoded + augmented 224 px training images per second, and per producer core, from the same
JPEGs through hvdtrain's ShmLoader, a torch DataLoader and a DALI CPU pipeline, side by side in one run.

    python3 -m venv .venv-dali && .venv-dali/bin/pip install nvidia-dali-cuda120==2.4.0 numpy   # once: DALI (424 MB)
    .venv/bin/python bench/b7_jpeg.py --dali-python .venv-dali/bin/python \
        --json bench/results/cpu-b7-2026-11-27/b7.json | tee bench/results/cpu-b7-2026-11-27/summary.txt

DALI's pip package runs its CPU pipelines without a GPU or libcuda (device_id=None); it lives in its own venv
because it is large and nothing else needs it. torchvision cannot be installed beside this venv's CPU torch (PyPI's
torchvision 0.28.0 wheel is a CUDA build that needs libtorch_cuda; the CPU wheel is only on download.pytorch.org),
so the DataLoader side replicates torchvision's PIL path; on the GPU machine B9 (bench/gpu_jpeg.py) uses
torchvision itself.

  hvdtrain    ShmLoader over `load_splits(...).train` (a StreamSplit of an MDS root, jpeg column): the producers
              decode (OpenCV, DCT-scaled) + RandomResizedCrop + flip, uint8 N×224×224×3 (hvdtrain.stream.images)
  dataloader  torch DataLoader (same W and batch, persistent workers, default fork) over a map-style dataset of the
              same JPEG bytes: PIL open -> RGB -> RandomResizedCrop(224) -> flip -> PILToTensor (uint8 3×224×224);
              torchvision.transforms.v2 if importable, else an exact replica of its PIL path (recorded)
  dali        NVIDIA DALI CPU pipeline (device_id=None, num_threads=W) in a subprocess run by --dali-python:
              external_source -> decoders.image(cpu, RGB) -> random_resized_crop(224) -> flip(coin_flip)

Per W: each feed warms up one epoch, then --rounds rounds of --epochs-per-round epochs, the feeds taking turns
(order rotating); after each round the whole process tree is left to go idle (epoch-ahead work included) so no
feed runs on another's time. Rate = images after the first --skip batches (default 4W: up to prefetch + 2 per
ShmLoader worker are made ahead, NOTE [epoch ahead]) / their time: steady state; the median over rounds is reported.
Images per CPU-s: a round's images / the CPU seconds of every process of the run (consumer + producers) over the
round and its settling. Others' load: cores busy outside this run meanwhile (should be ~0); stolen: cores' time the
hypervisor gave to other guests (a VM's noisy neighbours: W = all cores suffers from it). Samples:
bench/jpeg_decode.py's real photographs, about 500x375, quality 95, labels i % 10.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
SIZE = 224
FEEDS = ("hvdtrain", "dataloader", "dali")
Stamps = list[tuple[float, int]]  # (seconds since the round began, images) per batch


def dali_serve(data: str, workers: int, batch: int, seed: int) -> None:
    """The DALI side (numpy + nvidia.dali only): build, say ready, then run N batches per stdin line."""
    try:
        import nvidia.dali as dali
        import nvidia.dali.fn as fn
        import nvidia.dali.types as types

        jpegs = [np.frombuffer(j, np.uint8) for j in pickle.loads(Path(data).read_bytes())]

        def source() -> Any:  # shuffled epochs, back to back
            rng = np.random.default_rng(seed)
            while True:
                order = rng.permutation(len(jpegs))
                for s in range(0, len(order) - batch + 1, batch):
                    yield [jpegs[i] for i in order[s : s + batch]]

        pipe = dali.Pipeline(batch_size=batch, num_threads=workers, device_id=None, seed=seed)
        with pipe:
            raw = fn.external_source(source=source(), batch=True, dtype=types.UINT8)
            img = fn.decoders.image(raw, device="cpu", output_type=types.RGB)
            img = fn.random_resized_crop(img, size=SIZE, random_area=(0.08, 1.0), random_aspect_ratio=(3 / 4, 4 / 3))
            pipe.set_outputs(fn.flip(img, horizontal=fn.random.coin_flip()))
        pipe.build()
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(json.dumps({"ready": True, "version": dali.__version__}), flush=True)
    for line in sys.stdin:
        stamps, t0 = [], time.perf_counter()
        for _ in range(int(line)):
            x = pipe.run()[0].as_array()  # the batch as one dense array, as the other feeds hand theirs over
            stamps.append((time.perf_counter() - t0, len(x)))
        print(json.dumps({"stamps": stamps, "batch_shape": list(x.shape), "dtype": str(x.dtype)}), flush=True)


class DaliFeed:
    """dali_serve in a subprocess under `python`; a round is `batches` × epochs batches."""

    def __init__(self, python: str, data: Path, workers: int, batch: int, seed: int, batches: int) -> None:
        self.batches, self.info = batches, {}
        self.err = tempfile.TemporaryFile()  # noqa: SIM115  (the subprocess's stderr until close())
        cmd = [python, __file__, "--serve-dali", str(data), "--workers", str(workers), "--batch", str(batch)]
        self.proc = subprocess.Popen([*cmd, "--seed", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True)
        try:
            self.info["version"] = self._reply()["version"]
        except BaseException:
            self.close()
            raise

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.proc.wait(timeout=30)
            self.err.seek(0)
            tail = self.err.read().decode(errors="replace").strip()[-1500:]
            raise RuntimeError(f"DALI subprocess exited {self.proc.returncode}: {tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def round(self, epochs: int) -> Stamps:
        self.proc.stdin.write(f"{self.batches * epochs}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        reply = self._reply()
        self.info.update(batch_shape=reply["batch_shape"], dtype=reply["dtype"])
        return [(t, n) for t, n in reply["stamps"]]

    def close(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.proc.stdin.close()  # type: ignore[union-attr]  # EOF ends the server's loop
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


class LoaderFeed:
    """A loader iterated epoch by epoch (set_epoch where it has one); every batch stamped as it arrives."""

    def __init__(self, loader: Any, info: dict[str, Any]) -> None:
        self.loader, self.info, self.epoch = loader, info, 0

    def round(self, epochs: int) -> Stamps:
        stamps: Stamps = []
        t0 = time.perf_counter()
        for _ in range(epochs):
            if hasattr(self.loader, "set_epoch"):
                self.loader.set_epoch(self.epoch)
            self.epoch += 1
            for x, _y in self.loader:
                stamps.append((time.perf_counter() - t0, len(x)))
                self.info.update(batch_shape=list(x.shape), dtype=str(x.dtype))
                del x, _y  # give the batch (a shared-memory slot) back before waiting for the next
        return stamps

    def close(self) -> None:
        if hasattr(self.loader, "close"):
            self.loader.close()
        self.loader = None  # a DataLoader's persistent workers end with their iterator


def hvdtrain_feed(root: Path, workers: int, batch: int, seed: int, epochs: int) -> LoaderFeed:
    from hvdtrain.data import ShmLoader
    from hvdtrain.formats import arrays
    from hvdtrain.train.streamed import load_splits

    train = load_splits(root, num_classes=None, image_size=SIZE, augment=True).train
    loader = ShmLoader(train, rank=0, size=1, batch_size=batch, num_workers=workers, seed=seed, fetch=arrays.take,
                       order=train.order, epochs=epochs)
    return LoaderFeed(loader, {"decode": "hvdtrain.stream.images (OpenCV)", "augment": repr(train.augment)})


def rrc_box(width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params on torch's generator (seeded per DataLoader worker)."""
    import torch

    area, lo, hi = width * height, math.log(3 / 4), math.log(4 / 3)
    for _ in range(10):
        target = area * torch.empty(1).uniform_(0.08, 1.0).item()
        aspect = math.exp(torch.empty(1).uniform_(lo, hi).item())
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,)).item())
            return int(torch.randint(0, width - w + 1, size=(1,)).item()), top, w, h
    r = width / height  # fallback: the centre crop, its aspect clamped to 3/4..4/3
    if r < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif r > 4 / 3:
        w, h = round(height * (4 / 3)), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def replica_transform(img: Any) -> Any:
    """torchvision's PIL path: RandomResizedCrop (resize with box, bilinear) -> RandomHorizontalFlip -> PILToTensor."""
    import torch
    from PIL import Image

    left, top, w, h = rrc_box(*img.size)
    img = img.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if torch.rand(1) < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1)


class JpegDataset:
    """Map-style dataset of JPEG bytes: (uint8 3×224×224 tensor, label)."""

    def __init__(self, jpegs: list[bytes], transform: Any) -> None:
        self.jpegs, self.transform = jpegs, transform

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        return self.transform(Image.open(io.BytesIO(self.jpegs[i])).convert("RGB")), i % 10


def dataloader_feed(jpegs: list[bytes], workers: int, batch: int, seed: int) -> LoaderFeed:
    import torch

    try:
        import torchvision
        from torchvision.transforms import v2

        steps = [v2.RandomResizedCrop(SIZE, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()]
        transform, name = v2.Compose(steps), f"torchvision {torchvision.__version__} transforms.v2"
    except Exception as e:  # a CUDA wheel without libtorch_cuda fails with OSError, not ImportError
        transform, name = replica_transform, f"replica of torchvision's PIL path (torchvision not importable: {e})"
    loader = torch.utils.data.DataLoader(JpegDataset(jpegs, transform), batch_size=batch, shuffle=True,
                                         num_workers=workers, persistent_workers=True,
                                         generator=torch.Generator().manual_seed(seed))
    return LoaderFeed(loader, {"decode": "PIL", "transform": name})


def cpu_now() -> tuple[float, float, float]:
    """CPU seconds: (this process and its live descendants, the whole machine busy, stolen by the hypervisor)."""
    import psutil

    me, ours = psutil.Process(), 0.0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            ours += sum(p.cpu_times()[:2])
    t = psutil.cpu_times()
    return ours, t.user + t.nice + t.system + t.irq + t.softirq, getattr(t, "steal", 0.0)


def settle(max_s: float = 15.0, window: float = 0.25, busy: float = 0.08) -> float:
    """Wait until the process tree uses under `busy` of a core over `window`; the seconds waited."""
    t0, last = time.perf_counter(), cpu_now()[0]
    while time.perf_counter() - t0 < max_s:
        time.sleep(window)
        now = cpu_now()[0]
        if now - last < busy * window:
            break
        last = now
    return time.perf_counter() - t0


def measure(feed: Any, epochs: int, skip: int) -> dict[str, Any]:
    """One round of `feed` and its settling: the steady rate after `skip` batches, CPU per image, others' load."""
    (ours0, busy0, steal0), t0 = cpu_now(), time.perf_counter()
    stamps = feed.round(epochs)
    settled = settle()
    (ours1, busy1, steal1), window = cpu_now(), time.perf_counter() - t0
    skip = min(skip, len(stamps) - 2)
    start = stamps[skip - 1][0] if skip > 0 else 0.0
    steady, images, cpu = sum(n for _, n in stamps[skip:]), sum(n for _, n in stamps), ours1 - ours0
    return {"images": images, "batches": len(stamps), "wall_s": stamps[-1][0], "steady_images": steady,
            "images_per_s": steady / (stamps[-1][0] - start), "cpu_s": cpu, "images_per_cpu_s": images / cpu,
            "settle_s": settled, "other_cores_busy": max(0.0, busy1 - busy0 - cpu) / window,
            "steal_cores": (steal1 - steal0) / window,
            "first_stamps": stamps[: skip + 2]}


def open_feeds(args: argparse.Namespace, root: Path, data: Path, jpegs: list[bytes], w: int) -> dict[str, Any]:
    """Every feed, warmed up (a DataLoader first: its workers fork before any ShmLoader exists); errors as text."""
    total = 2 + args.rounds * args.epochs_per_round  # + 1: the last round also does its epoch-ahead work
    makers = {"dataloader": lambda: dataloader_feed(jpegs, w, args.batch, args.seed),
              "hvdtrain": lambda: hvdtrain_feed(root, w, args.batch, args.seed, total),
              "dali": lambda: DaliFeed(args.dali_python, data, w, args.batch, args.seed, -(-len(jpegs) // args.batch))}
    feeds: dict[str, Any] = {}
    for name in (n for n in makers if n in args.feeds):
        try:
            feeds[name] = makers[name]()
            feeds[name].info["warmup"] = measure(feeds[name], 1, args.skip or 4 * w)
        except Exception as e:
            if name in feeds:
                feeds[name].close()
            feeds[name] = f"{type(e).__name__}: {e}"
            print(f"W={w} {name}: FAILED {feeds[name]}", file=sys.stderr, flush=True)
    return feeds


def run_w(args: argparse.Namespace, root: Path, data: Path, jpegs: list[bytes], w: int) -> dict[str, Any]:
    """The feeds at W producers: warm-ups, then rounds taking turns (order rotating); medians and every round."""
    feeds = open_feeds(args, root, data, jpegs, w)
    try:
        live = [name for name in args.feeds if not isinstance(feeds.get(name), str)]
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in live}
        for r in range(args.rounds):
            for name in live[r % len(live) :] + live[: r % len(live)]:
                rounds[name].append(measure(feeds[name], args.epochs_per_round, args.skip or 4 * w))
                print(f"W={w} round {r} {name}: {rounds[name][-1]['images_per_s']:.0f} img/s", file=sys.stderr)
        out: dict[str, Any] = {name: {"error": feeds.get(name, "not run")} for name in args.feeds if name not in live}
        for name in live:
            med = {k: statistics.median(m[k] for m in rounds[name])
                   for k in ("images_per_s", "images_per_cpu_s", "other_cores_busy", "steal_cores")}
            out[name] = {**med, "images_per_s_per_core": med["images_per_s"] / w, "info": feeds[name].info,
                         "rounds": rounds[name]}
        return {name: out[name] for name in args.feeds}
    finally:
        for feed in feeds.values():
            if not isinstance(feed, str):
                feed.close()


def versions() -> dict[str, str]:
    import cv2
    import PIL
    import torch

    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "?")
    return {"python": platform.python_version(), "cpu": cpu, "cores": str(os.cpu_count()), "PIL": PIL.__version__,
            "cv2": cv2.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "platform": platform.platform()}


def table(results: dict[str, Any], ver: dict[str, str]) -> str:
    lines = [f"# B7 on {ver['cpu']}, {ver['cores']} cores, no GPU; Python {ver['python']}, PIL {ver['PIL']}, "
             f"OpenCV {ver['cv2']}, torch {ver['torch']}, numpy {ver['numpy']}, DALI {ver['dali']}",
             "| W | feed | images/s | images/s per producer core | images per CPU-s (all its processes) | "
             "others' load (cores) | stolen (cores) |", "|---|---|---|---|---|---|---|"]
    for w, feeds in results.items():
        for name, r in feeds.items():
            if "error" in r:
                lines.append(f"| {w} | {name} | not run: {r['error'][:300]} | | | | |")
            else:
                lines.append(f"| {w} | {name} | {r['images_per_s']:.0f} | {r['images_per_s_per_core']:.0f} | "
                             f"{r['images_per_cpu_s']:.0f} | {r['other_cores_busy']:.2f} | {r['steal_cores']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", default="1,2", help="producer processes / DALI threads (W), comma-separated")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--n", type=int, default=1024, help="distinct JPEGs in the training split")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs-per-round", type=int, default=3)
    p.add_argument("--skip", type=int, default=0, help="batches left out of each round's rate (0: 4 x W)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feeds", default=",".join(FEEDS))
    p.add_argument("--dali-python", default=".venv-dali/bin/python", help="interpreter with nvidia-dali")
    p.add_argument("--json", type=Path, help="write every result here")
    p.add_argument("--serve-dali", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_dali:
        return dali_serve(args.serve_dali, int(args.workers), args.batch, args.seed)
    args.feeds = [f for f in args.feeds.split(",") if f]
    run(args)


def run(args: argparse.Namespace) -> None:
    sys.path[:0] = [str(BENCH), str(BENCH.parent)]
    from _common import check_clean, shm_segments
    from jpeg_decode import sample_jpegs

    from hvdtrain.stream.mds import MDSWriter

    before, ver = shm_segments(), versions()
    jpegs = sample_jpegs(args.n + 128, args.seed)  # train: the first n; val: 128 more (the recipes' layout)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="b7_") as tmp:
        for split, part, first in (("train", jpegs[: args.n], 0), ("val", jpegs[args.n :], args.n)):
            with MDSWriter(Path(tmp) / split, {"x": "jpeg", "y": "int64"}, meta={"num_classes": 10}) as writer:
                for i, jpeg in enumerate(part, first):
                    writer.write({"x": jpeg, "y": i % 10})
        pickled = Path(tmp) / "jpegs.pkl"  # the DALI subprocess's copy of the same bytes
        pickled.write_bytes(pickle.dumps(jpegs[: args.n]))
        for w in (int(s) for s in args.workers.split(",")):
            results[str(w)] = run_w(args, Path(tmp), pickled, jpegs[: args.n], w)
    ver["dali"] = next((r["dali"]["info"]["version"] for r in results.values() if "info" in r.get("dali", {})),
                       "not run")
    print(table(results, ver))
    config = {k: v for k, v in vars(args).items() if k not in ("json", "serve_dali")}
    config["mean_jpeg_kib"] = sum(map(len, jpegs[: args.n])) / args.n / 1024
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"config": config, "versions": ver, "results": results, "leaks": check_clean(before)}
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
