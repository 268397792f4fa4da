"""JPEG/PNG bytes decoded and augmented where a batch is made (a ShmLoader's producers), to uint8 H×W×3 RGB.

Training: torchvision's RandomResizedCrop (area 8-100% of the image, aspect 3/4-4/3) to `size`×`size`, then a
horizontal flip half of the time. Validation: the centre crop of torchvision's Resize(size / crop_ratio) +
CenterCrop(size) (224 of 256). Batches leave the producer as uint8, 4x fewer bytes than float32 through shared
memory and PCIe; the trainer scales them on its device (`hvdtrain.train.precision.as_input`).

Decoder: OpenCV (libjpeg-turbo), measured against Pillow, simplejpeg, torchvision and nvJPEG on an H200 host's
16 cores (bench/jpeg_decode.py, docs/performance.md B7): 736 vs 311-615 images/s on one core. A JPEG whose crop
keeps at least 2x, 4x or 8x `size` pixels each way is decoded at 1/2, 1/4 or 1/8 scale (DCT-domain scaling),
which saves the inverse transforms and most of the resize (not the entropy decoding, which grows with the file).
The crop is resized with area averaging when it shrinks more than 2x and bilinearly otherwise: cheaper than
torchvision's antialiased bilinear at the mild shrinks of ImageNet-sized photos, with slightly more aliasing there.

NOTE [augmentation is a function of the sample]
Each sample's crop and flip come from a generator seeded by (seed, epoch, sample index) alone (`sample_rng`), not
from a producer's running state. So a batch is the same whichever producer makes it and however many there are,
a run resumed mid-epoch (or an elastic reset) sees exactly the images the interrupted one would have, and a
re-run with the same seed is bit-identical on the same OpenCV build.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.data.errors import DataError


class ImageDecodeError(DataError):
    """An image column's bytes are not an image OpenCV can decode; `index`: the sample's (`decode_batch`)."""

    index: int | None = None


@dataclass(frozen=True)
class ImageAugment:
    """How images become `size`×`size` uint8 RGB: `train` random-resized-crops (`scale`: the crop's share of the
    image area, `ratio`: its aspect range) and flips (`flip`); otherwise the centre `crop_ratio` of the shorter
    side is taken (torchvision's Resize(size / crop_ratio) + CenterCrop(size))."""

    size: int
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    crop_ratio: float = 0.875

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and 8 <= self.size <= 4096):
            raise ValueError(f"image size {self.size!r} must be a whole number of pixels from 8 to 4096")
        if not (0 < self.scale[0] <= self.scale[1] <= 1 and 0 < self.ratio[0] <= self.ratio[1]):
            raise ValueError(f"scale {self.scale} must be 0 < lo <= hi <= 1 and ratio {self.ratio} 0 < lo <= hi")
        if not 0 < self.crop_ratio <= 1:
            raise ValueError(f"crop_ratio {self.crop_ratio} must be in (0, 1]")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.size, self.size, 3)

    def box(self, width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """(left, top, width, height) of the region of a `width`×`height` image that becomes the output."""
        if not self.train:
            side = max(1, round(min(width, height) * self.crop_ratio))
            return (width - side) // 2, (height - side) // 2, side, side
        return random_resized_box(width, height, self.scale, self.ratio, rng)


def random_resized_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
                       rng: np.random.Generator) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: 10 tries at a random area and log-uniform aspect that fits, else
    the centre crop of the aspect clamped to `ratio`."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of sample `index`'s augmentation in `epoch` (NOTE [augmentation is a function of the sample])."""
    return np.random.Generator(np.random.Philox(key=(seed & (2**64 - 1)) * (1 << 64) + (epoch << 40) + index))


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header, or None (not a JPEG, or no frame header found)."""
    view = memoryview(data)
    if len(view) < 4 or view[0] != 0xFF or view[1] != 0xD8:
        return None
    pos = 2
    while pos + 9 < len(view):
        if view[pos] != 0xFF:
            return None
        marker = view[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _SOF:
            height, width = struct.unpack_from(">HH", view, pos + 5)
            return (width, height) if width and height else None
        pos += 2 + struct.unpack_from(">H", view, pos + 2)[0]
    return None


def _cv2() -> Any:
    import cv2  # opencv-python-headless; imported where images are decoded (the producers), not at hvdtrain import

    return cv2


_REDUCED = ((8, "IMREAD_REDUCED_COLOR_8"), (4, "IMREAD_REDUCED_COLOR_4"), (2, "IMREAD_REDUCED_COLOR_2"))


def decode_augment(data: bytes | memoryview, aug: ImageAugment, rng: np.random.Generator,
                   out: np.ndarray | None = None) -> np.ndarray:
    """One image's bytes as `aug.shape` uint8 RGB (written into `out` if given), or ImageDecodeError."""
    cv2 = _cv2()
    try:
        img, (left, top, w, h) = _decode_box(cv2, data, aug, rng)
        flip = aug.train and aug.flip and rng.random() < 0.5
        shrink = min(w, h) / aug.size  # antialiased (area) beyond 2x, bilinear below (NOTE in the module docstring)
        resized = cv2.resize(img[top:top + h, left:left + w], (aug.size, aug.size),
                             interpolation=cv2.INTER_AREA if shrink > 2 else cv2.INTER_LINEAR)
        if flip:
            resized = cv2.flip(resized, 1)
        target = out if out is not None else np.empty(aug.shape, np.uint8)
        cv2.cvtColor(resized, cv2.COLOR_BGR2RGB, dst=target)
    except cv2.error as e:  # an empty or odd buffer OpenCV refuses outright
        raise ImageDecodeError(f"{len(data)} bytes that OpenCV cannot decode as an image "
                               f"({str(e).strip().splitlines()[-1]})") from None
    return target


def _decode_box(cv2: Any, data: bytes | memoryview, aug: ImageAugment,
                rng: np.random.Generator) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """The decoded BGR image (at 1/2, 1/4 or 1/8 scale where the crop allows) and the crop box on it."""
    if len(data) == 0:
        raise ImageDecodeError("an empty value (0 bytes) where an image file should be")
    buf = np.frombuffer(data, np.uint8)
    size = jpeg_size(data)
    # EXIF orientation is not applied (as Pillow's and torchvision's decoders do not): the pixels keep the header's
    # width and height, which the crop box was drawn for.
    flags, factor = cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION, 1
    if size is not None:
        left, top, w, h = aug.box(*size, rng)
        for f, name in _REDUCED:  # DCT-domain scaling while the crop keeps at least aug.size pixels each way
            if min(w, h) >= aug.size * f:
                flags, factor = getattr(cv2, name) | cv2.IMREAD_IGNORE_ORIENTATION, f
                break
    img = cv2.imdecode(buf, flags)
    if img is None:
        raise ImageDecodeError(f"{len(buf)} bytes that OpenCV cannot decode as an image")
    if size is None:  # PNG and others: the size is known once decoded
        left, top, w, h = aug.box(img.shape[1], img.shape[0], rng)
    elif factor > 1:  # the box on the decoded scale (libjpeg rounds the scaled size up)
        sx, sy = img.shape[1] / size[0], img.shape[0] / size[1]
        left, top = min(round(left * sx), img.shape[1] - 1), min(round(top * sy), img.shape[0] - 1)
        w = max(1, min(img.shape[1] - left, round(w * sx)))
        h = max(1, min(img.shape[0] - top, round(h * sy)))
    return img, (left, top, w, h)


def decode_batch(datas: list[bytes | memoryview], aug: ImageAugment, seed: int, epoch: int,
                 indices: np.ndarray) -> np.ndarray:
    """Samples `indices` (their bytes `datas`) as an N×size×size×3 uint8 batch, each augmented by its own
    generator (NOTE [augmentation is a function of the sample]). ImageDecodeError carries the sample index."""
    batch = np.empty((len(datas), *aug.shape), np.uint8)
    for i, (data, index) in enumerate(zip(datas, indices, strict=True)):
        try:
            decode_augment(data, aug, sample_rng(seed, epoch, int(index)), batch[i])
        except ImageDecodeError as e:
            e.index = int(index)
            raise
    return batch
