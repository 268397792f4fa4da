"""Writes a small image folder to try `hvdtrain data convert` on: 4 classes of shapes, as most image datasets
arrive (one folder per class, sorted by class, nothing downloaded).

    .venv/bin/python scripts/make_shapes.py /tmp/shapes [--per-class 250] [--size 32] [--seed 0] [--messy]

DST/{circle,cross,square,triangle}/NNNN.png: one shape per image, in a random colour, size and place, on a noisy
background of another random colour, so the class is the shape and not the colour. The same seed gives the same
files. Refuses a DST that exists and is not empty.

--messy: a folder as they arrive: a third of each class's images in CLASS/2024/batch0/ and a third as JPEGs in
CLASS/2024/batch1/, plus a truncated JPEG (circle/2024/broken.jpg), a web page saved as square/thumb.jpg, a
stray triangle/notes.txt and a .DS_Store.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("circle", "cross", "square", "triangle")


def draw(kind: str, size: int, rng: np.random.Generator) -> Image.Image:
    """One image of `kind`: a shape of random colour, size and place on a noisy background."""
    background = rng.integers(0, 256, 3)
    pixels = np.clip(background + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    colour = tuple(int(c) for c in (background + rng.integers(80, 176, 3)) % 256)  # never close to the background
    side = int(rng.integers(size * 2 // 5, size * 4 // 5))
    x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, 2))
    x1, y1 = x0 + side - 1, y0 + side - 1
    pen = ImageDraw.Draw(image)
    if kind == "circle":
        pen.ellipse((x0, y0, x1, y1), fill=colour)
    elif kind == "square":
        pen.rectangle((x0, y0, x1, y1), fill=colour)
    elif kind == "triangle":
        pen.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=colour)
    else:
        bar = max(2, side // 4)
        mid_x, mid_y = (x0 + x1) // 2, (y0 + y1) // 2
        pen.rectangle((mid_x - bar // 2, y0, mid_x + bar // 2, y1), fill=colour)
        pen.rectangle((x0, mid_y - bar // 2, x1, mid_y + bar // 2), fill=colour)
    return image


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("dst", type=Path, help="folder to create (must not exist, or be empty)")
    parser.add_argument("--per-class", type=int, default=250, help="images per class")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--messy", action="store_true", help="sub-folders, JPEGs, two bad files and a stray one")
    args = parser.parse_args()
    if args.per_class < 1 or args.size < 8:
        parser.error(f"--per-class {args.per_class} --size {args.size}: use --per-class >= 1 and --size >= 8")
    if args.dst.exists() and (not args.dst.is_dir() or any(args.dst.iterdir())):
        parser.error(f"{args.dst} exists and is not an empty folder: give a new folder")
    rng = np.random.default_rng(args.seed)
    for kind in CLASSES:
        folder = args.dst / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(args.per_class):
            image = draw(kind, args.size, rng)
            if not args.messy or i % 3 == 2:
                image.save(folder / f"{i:04d}.png")
            else:
                (folder / "2024" / f"batch{i % 3}").mkdir(parents=True, exist_ok=True)
                image.save(folder / "2024" / f"batch{i % 3}" / f"{i:04d}.{'png' if i % 3 == 0 else 'jpg'}")
    if args.messy:
        mess(args.dst, args.size, rng)
    print(f"{args.dst}: {len(CLASSES)} classes x {args.per_class} images, {args.size}x{args.size} "
          f"{'PNG and JPEG in sub-folders, 2 bad files, 2 stray ones' if args.messy else 'PNG'}")
    return 0


def mess(dst: Path, size: int, rng: np.random.Generator) -> None:
    """The bad and stray files of --messy (the module docstring)."""
    (dst / "circle" / "2024").mkdir(parents=True, exist_ok=True)
    draw("circle", size * 4, rng).save(dst / "circle" / "2024" / "broken.jpg")
    whole = (dst / "circle" / "2024" / "broken.jpg").read_bytes()
    (dst / "circle" / "2024" / "broken.jpg").write_bytes(whole[:len(whole) // 2])  # a copy cut off half-way
    (dst / "square" / "thumb.jpg").write_text("<html><body>404 Not Found</body></html>\n")
    (dst / "triangle" / "notes.txt").write_text("labelled by hand, 2024\n")
    (dst / "cross" / ".DS_Store").write_bytes(bytes(64))


if __name__ == "__main__":
    sys.exit(main())
