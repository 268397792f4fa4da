"""hvdtrain.stream.images from bytes: JPEG/PNG decoded to uint8 RGB squares, torchvision's RandomResizedCrop
bounds, DCT-domain scaling that lands on the same pixels as a full decode, augmentation keyed on (seed, epoch,
sample), and bad bytes named."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from hvdtrain.stream.images import (
    ImageAugment,
    ImageDecodeError,
    decode_augment,
    decode_batch,
    jpeg_size,
    random_resized_box,
    sample_rng,
)


def encode(array: np.ndarray, fmt: str = "JPEG", **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt, **kw)
    return buf.getvalue()


def halves(width: int, height: int) -> np.ndarray:
    """Red on the left half, blue on the right (RGB)."""
    img = np.zeros((height, width, 3), np.uint8)
    img[:, : width // 2, 0] = 250
    img[:, width // 2 :, 2] = 250
    return img


def smooth(width: int, height: int) -> np.ndarray:
    """A smooth colour field (no detail finer than scaling preserves)."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 127 + 100 * np.sin(xx / width * 2 * math.pi)
    g = 127 + 100 * np.cos(yy / height * 2 * math.pi)
    b = 127 + 60 * np.sin((xx + yy) / (width + height) * 4 * math.pi)
    return np.stack([r, g, b], -1).astype(np.uint8)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_centre_crop_is_rgb_in_the_right_place(fmt: str) -> None:
    out = decode_augment(encode(halves(200, 100), fmt, **({"quality": 95} if fmt == "JPEG" else {})),
                         ImageAugment(32, train=False), sample_rng(0, 0, 0))
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
    left, right = out[:, :12].reshape(-1, 3).mean(0), out[:, -12:].reshape(-1, 3).mean(0)
    assert left[0] > 200 and left[2] < 40, left  # red stays red (no BGR swap)
    assert right[2] > 200 and right[0] < 40, right


def test_grayscale_and_palette_images_come_out_with_three_channels() -> None:
    gray = encode(np.full((40, 60), 90, np.uint8))
    palette = Image.fromarray(halves(60, 40)).convert("P")
    buf = io.BytesIO()
    palette.save(buf, format="PNG")
    for data in (gray, buf.getvalue()):
        assert decode_augment(data, ImageAugment(16, train=False), sample_rng(0, 0, 0)).shape == (16, 16, 3)


@pytest.mark.parametrize("size", [24, 40])  # a full decode, and one at 1/2 scale (the crop keeps >= 2x 40 px)
def test_an_exif_orientation_is_not_applied_so_the_crop_fits_the_pixels(size: int) -> None:
    """The box is drawn for the header's width and height: a decoder that rotated the pixels (OpenCV does by
    default) would crop outside them. Pillow and torchvision do not rotate either."""
    image = Image.fromarray(halves(300, 100))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95, exif=exif)
    for i in range(50):
        out = decode_augment(buf.getvalue(), ImageAugment(size), sample_rng(0, 0, i))
        assert out.shape == (size, size, 3)
    centre = decode_augment(buf.getvalue(), ImageAugment(size, train=False), sample_rng(0, 0, 0))
    assert centre[:, : size // 4, 0].mean() > 200  # still red on the left: not rotated


def test_jpeg_size_reads_the_frame_header_and_nothing_else() -> None:
    for w, h in ((640, 480), (17, 1023), (3000, 2)):
        assert jpeg_size(encode(smooth(w, h))) == (w, h)
    progressive = encode(smooth(320, 200), progressive=True)
    assert jpeg_size(progressive) == (320, 200)
    assert jpeg_size(encode(smooth(32, 32), "PNG")) is None
    assert jpeg_size(b"\xff\xd8\xff") is None and jpeg_size(b"") is None and jpeg_size(b"\xff\xd8" + b"\0" * 20) is None


def test_random_resized_boxes_stay_inside_and_within_the_area_and_aspect_ranges() -> None:
    rng = np.random.default_rng(3)
    for _ in range(2000):
        w, h = int(rng.integers(1, 900)), int(rng.integers(1, 900))
        left, top, cw, ch = random_resized_box(w, h, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        assert left >= 0 and top >= 0 and cw > 0 and ch > 0 and left + cw <= w and top + ch <= h
    # a roomy image: every box is one of the 10 tries (area and aspect in range, up to rounding)
    for _ in range(500):
        left, top, cw, ch = random_resized_box(500, 400, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        if (cw, ch) != (500, 400):
            assert 0.075 <= cw * ch / (500 * 400) <= 1.0 and 0.73 <= cw / ch <= 1.37


def test_dct_scaling_lands_on_the_pixels_a_full_decode_gives() -> None:
    """A large JPEG whose centre crop stays >= 8x the output is decoded at 1/8 scale: the box must map onto the
    smaller image exactly enough that the result matches the same crop decoded at full size and resized."""
    big = smooth(2400, 1800)
    data = encode(big, quality=95)
    aug = ImageAugment(64, train=False)
    fast = decode_augment(data, aug, sample_rng(0, 0, 0)).astype(np.float32)
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    side = round(1800 * aug.crop_ratio)
    left, top = (2400 - side) // 2, (1800 - side) // 2
    ref = np.asarray(Image.fromarray(full[top:top + side, left:left + side]).resize((64, 64), Image.BOX))
    assert np.abs(fast - ref.astype(np.float32)).mean() < 3.0


def test_augmentation_is_a_function_of_seed_epoch_and_sample() -> None:
    data = [encode(smooth(300 + 7 * i, 200 + 5 * i)) for i in range(4)]
    aug = ImageAugment(48)
    idx = np.array([5, 9, 2, 7])
    a = decode_batch(data, aug, 1, 3, idx)
    assert np.array_equal(a, decode_batch(data, aug, 1, 3, idx))
    # the same sample gives the same image in any position of any batch
    single = decode_batch([data[2]], aug, 1, 3, np.array([2]))
    assert np.array_equal(a[2], single[0])
    assert not np.array_equal(a, decode_batch(data, aug, 1, 4, idx))  # another epoch: other crops
    assert not np.array_equal(a, decode_batch(data, aug, 2, 3, idx))  # another seed
    val = ImageAugment(48, train=False)
    assert np.array_equal(decode_batch(data, val, 1, 3, idx), decode_batch(data, val, 9, 8, idx))


def test_flips_happen_about_half_the_time() -> None:
    data = encode(halves(64, 64), "PNG")
    aug = ImageAugment(32, scale=(1.0, 1.0), ratio=(1.0, 1.0))  # the whole image: only the flip varies
    flipped = sum(decode_augment(data, aug, sample_rng(0, 0, i))[:, :8, 2].mean() > 200 for i in range(400))
    assert 150 < flipped < 250


def test_bytes_that_are_not_an_image_are_named_with_their_sample() -> None:
    good = encode(smooth(50, 40))
    with pytest.raises(ImageDecodeError) as err:
        decode_batch([good, b"not an image at all"], ImageAugment(16), 0, 0, np.array([11, 12]))
    assert err.value.index == 12 and "cannot decode" in str(err.value)
    with pytest.raises(ImageDecodeError):
        decode_augment(good[: len(good) // 3][:40], ImageAugment(16), sample_rng(0, 0, 0))
    for nothing in (b"", b"\x00"):  # OpenCV raises its own error on an empty buffer: still an ImageDecodeError
        with pytest.raises(ImageDecodeError):
            decode_augment(nothing, ImageAugment(16), sample_rng(0, 0, 0))


@pytest.mark.parametrize("kwargs, message", [
    ({"size": 4}, "from 8 to 4096"),
    ({"size": 32, "scale": (0.5, 0.2)}, "scale"),
    ({"size": 32, "crop_ratio": 0.0}, "crop_ratio"),
])
def test_bad_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ImageAugment(**kwargs)  # type: ignore[arg-type]
