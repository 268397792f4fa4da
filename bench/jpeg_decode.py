"""Which JPEG decoder should the producers use? Decoded + augmented 224 px training images per second, per core and
on all cores, for each decoder this machine has, side by side in one run; with a GPU, also nvJPEG and the rate a
ResNet-50 at bf16 + channels-last consumes (the rate the feed has to reach).

    python bench/jpeg_decode.py --json out.json              (any machine; decoders that are missing are skipped)

The images are real photographs (scikit-learn's two sample JPEGs), cropped, scaled to ImageNet's typical size
(about 500 x 375) and re-encoded at quality 95, so the decoders see camera statistics, not synthetic noise.
The augmentation is the standard one: RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3)) + horizontal flip,
uint8 HWC out. Every decoder gets the same crop boxes (seeded), so the work is the same.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

OUT = 224


def sample_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """n JPEGs about 500 x 375 cut from scikit-learn's two sample photographs."""
    import sklearn.datasets as skd

    folder = Path(skd.__file__).parent / "images"
    photos = [Image.open(folder / name).convert("RGB") for name in ("china.jpg", "flower.jpg")]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        img = photos[i % 2]
        w, h = img.size
        cw, ch = rng.randint(w // 2, w), rng.randint(h // 2, h)
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        size = (500, 375) if rng.random() < 0.7 else (375, 500)
        part = img.crop((x, y, x + cw, y + ch)).resize(size, Image.BILINEAR)
        buf = io.BytesIO()
        part.save(buf, format="JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def crop_box(w: int, h: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (scale 0.08-1, ratio 3/4-4/3): (left, top, width, height)."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch
    side = min(w, h)
    return (w - side) // 2, (h - side) // 2, side, side


def pillow(data: bytes, rng: random.Random, draft: bool = True) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    left, top, cw, ch = crop_box(*img.size, rng)
    flip = rng.random() < 0.5
    if draft:  # DCT-domain scaling: decode at 1/2, 1/4 or 1/8 while the crop stays >= 224 px
        full = img.size
        img.draft("RGB", (max(1, full[0] * OUT // cw), max(1, full[1] * OUT // ch)))
        sx, sy = img.size[0] / full[0], img.size[1] / full[1]
        left, top, cw, ch = int(left * sx), int(top * sy), max(1, int(cw * sx)), max(1, int(ch * sy))
    img = img.convert("RGB").resize((OUT, OUT), Image.BILINEAR, box=(left, top, left + cw, top + ch))
    if flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(img)


def pillow_full(data: bytes, rng: random.Random) -> np.ndarray:
    return pillow(data, rng, draft=False)


def opencv(data: bytes, rng: random.Random) -> np.ndarray:
    import cv2

    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    h, w = img.shape[:2]
    left, top, cw, ch = crop_box(w, h, rng)
    img = cv2.resize(img[top:top + ch, left:left + cw], (OUT, OUT), interpolation=cv2.INTER_LINEAR)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    return cv2.cvtColor(np.ascontiguousarray(img), cv2.COLOR_BGR2RGB)


def simplejpeg_(data: bytes, rng: random.Random) -> np.ndarray:
    import cv2
    import simplejpeg

    w, h = simplejpeg.decode_jpeg_header(data)[:2][::-1]  # (height, width, ...) -> (w, h)
    left, top, cw, ch = crop_box(w, h, rng)
    flip = rng.random() < 0.5
    img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=w * OUT // cw, min_height=h * OUT // ch)
    sy, sx = img.shape[0] / h, img.shape[1] / w
    left, top, cw, ch = int(left * sx), int(top * sy), max(1, int(cw * sx)), max(1, int(ch * sy))
    img = cv2.resize(img[top:top + ch, left:left + cw], (OUT, OUT), interpolation=cv2.INTER_LINEAR)
    return np.ascontiguousarray(img[:, ::-1]) if flip else img


def torchvision_cpu(data: bytes, rng: random.Random) -> np.ndarray:
    import torch
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import functional as F

    img = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    left, top, cw, ch = crop_box(img.shape[2], img.shape[1], rng)
    img = F.resized_crop(img, top, left, ch, cw, [OUT, OUT], antialias=True)
    if rng.random() < 0.5:
        img = img.flip(-1)
    return img.permute(1, 2, 0).numpy()


DECODERS: dict[str, Callable[[bytes, random.Random], np.ndarray]] = {
    "pillow_draft": pillow, "pillow_full": pillow_full, "opencv": opencv, "simplejpeg": simplejpeg_,
    "torchvision_cpu": torchvision_cpu,
}


def one_core_rate(name: str, jpegs: list[bytes], seconds: float) -> float:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:
        pass
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    fn, rng = DECODERS[name], random.Random(1)
    for data in jpegs[:4]:
        fn(data, rng)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(jpegs[done % len(jpegs)], rng)
        done += 1
    return done / (time.perf_counter() - t0)


def _worker(args: tuple[str, list[bytes], float]) -> float:
    return one_core_rate(*args)


def all_cores_rate(name: str, jpegs: list[bytes], seconds: float, cores: int) -> float:
    with mp.get_context("spawn").Pool(cores) as pool:
        return float(sum(pool.map(_worker, [(name, jpegs, seconds)] * cores)))


def available(name: str) -> str | None:
    try:
        DECODERS[name](sample_jpegs(1)[0], random.Random(0))
    except ImportError as exc:
        return f"not installed ({exc.name})"
    return None


def nvjpeg_rate(jpegs: list[bytes], batch: int, seconds: float) -> float:
    """torchvision.io.decode_jpeg(device='cuda') on batches, then the crop + resize + flip on the GPU."""
    import torch
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import functional as F

    datas = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in jpegs]
    rng = random.Random(1)

    def one_batch(start: int) -> None:
        chunk = [datas[(start + i) % len(datas)] for i in range(batch)]
        out = []
        for img in decode_jpeg(chunk, device="cuda"):
            left, top, cw, ch = crop_box(img.shape[2], img.shape[1], rng)
            img = F.resized_crop(img, top, left, ch, cw, [OUT, OUT], antialias=True)
            out.append(img.flip(-1) if rng.random() < 0.5 else img)
        torch.stack(out)

    one_batch(0)
    torch.cuda.synchronize()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        one_batch(done)
        done += batch
    torch.cuda.synchronize()
    return done / (time.perf_counter() - t0)


def resnet50_rate(batch: int, steps: int) -> float:
    """Images/s a torchvision ResNet-50 trains at (bf16 autocast, channels-last, SGD), data already on the GPU."""
    import torch
    import torchvision

    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, OUT, OUT, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0, help="per decoder and mode")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    jpegs = sample_jpegs(args.images)
    res: dict[str, object] = {"images": len(jpegs), "mean_kib": round(sum(map(len, jpegs)) / len(jpegs) / 1024, 1),
                              "cores": args.cores, "decoders": {}}
    print(f"{len(jpegs)} JPEGs, mean {res['mean_kib']} KiB; RandomResizedCrop 224 + flip; {args.cores} cores")
    print(f"{'decoder':18} {'1 core/s':>9} {'all cores/s':>12}")
    for name in DECODERS:
        why = available(name)
        if why:
            res["decoders"][name] = {"skipped": why}  # type: ignore[index]
            print(f"{name:18} skipped: {why}")
            continue
        one = one_core_rate(name, jpegs, args.seconds)
        every = all_cores_rate(name, jpegs, args.seconds, args.cores)
        res["decoders"][name] = {"one_core": round(one, 1), "all_cores": round(every, 1)}  # type: ignore[index]
        print(f"{name:18} {one:9.0f} {every:12.0f}")
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu:
        res["device"] = torch.cuda.get_device_name()
        res["nvjpeg_batch_64"] = round(nvjpeg_rate(jpegs, 64, args.seconds), 1)
        res["resnet50_bf16_cl_batch_256"] = round(resnet50_rate(256, 30), 1)
        print(f"nvjpeg (GPU, batches of 64): {res['nvjpeg_batch_64']:.0f}/s; "
              f"ResNet-50 bf16 channels-last trains at {res['resnet50_bf16_cl_batch_256']:.0f} images/s")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
