"""The recipes' view of an MDS dataset root (`train/` and `val/` splits): batches of (x, int64 y) — x float32, or
uint8 images — read and checked in the loader's producer processes, never loaded whole.

`load_splits` reads only the two index.json files (and, without an image size, the first training image).
`StreamSplit.take` is what a producer runs per batch: it reads the samples from memory-mapped shards and
- for a jpeg/png column (encoded image files): decodes and augments them there (hvdtrain.stream.images: the
  training split random-resized-crops and flips, the validation split centre-crops, each sample by its own
  (seed, epoch, index) generator) into a uint8 N×H×W×C batch, which the trainer scales on its device
  (`hvdtrain.train.precision.as_input`);
- otherwise casts x to float32 — times the index's `x_scale` (`hvdtrain data convert` writes 1/255 for image
  folders) or 1/255 for `pil` image columns (decoded as H×W×C and moved to C×H×W); arrays are otherwise trained on
  as stored, as the in-memory shard reader does;
and checks labels (and float NaN/Inf) as the in-memory path does at load, naming the shard file and the row, as a
DatasetError that ends the job with exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hvdtrain.data.errors import DataError
from hvdtrain.formats import arrays
from hvdtrain.stream import StreamingDataset, store
from hvdtrain.stream.images import ImageAugment, ImageDecodeError, decode_batch, jpeg_size
from hvdtrain.stream.order import BlockShuffle


def is_mds_root(path: Path) -> bool:
    return (path / "train" / "index.json").is_file() or (path / "index.json").is_file()


@dataclass
class StreamSplit:
    """One split: `take(indices) -> (x, y int64)`, `len()`, `order` (shuffle blocks of shards). x is float32
    N×C×H×W (or as stored), or with `augment` (a jpeg/png column read as raw bytes) uint8 N×H×W×C images."""

    data: StreamingDataset
    x_field: str = "x"
    y_field: str = "y"
    num_classes: int = 10
    check_finite: bool = True
    augment: ImageAugment | None = None
    size_given: bool = False  # augment's size came from --image-size (else the default: `_image_size`)
    epoch_key: tuple[int, int] = field(default=(0, 0), compare=False)  # (seed, epoch) of `begin_epoch`

    def __len__(self) -> int:
        return len(self.data)

    @property
    def x_scale(self) -> float:
        scale = self.data.meta.get("x_scale")
        if isinstance(scale, int | float) and not isinstance(scale, bool):
            return float(scale)
        return 1 / 255 if self.data.columns[self.x_field].kind == "image" else 1.0

    @property
    def order(self) -> BlockShuffle:
        return self.data.order

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """From the column's static shape when the index has one (nothing read), else from sample 0."""
        enc = self.data.columns[self.x_field]
        if self.augment is not None:
            return (3, self.augment.size, self.augment.size)
        if enc.kind == "ndarray" and enc.shape is not None:
            return tuple(enc.shape)
        return tuple(self.take(np.array([0]))[0].shape[1:])

    def plan_epoch(self, seed: int, epoch: int, last: bool = False, leads: bool = True) -> None:
        """Called by the loader's producers: fetch ahead of this epoch's order (StreamingDataset.plan_epoch)."""
        self.data.plan_epoch(seed, epoch, last, leads)

    def begin_epoch(self, seed: int, epoch: int) -> None:
        """Called by the loader's producers at the start of every epoch: the augmentation's (seed, epoch) (NOTE
        [augmentation is a function of the sample] in hvdtrain/stream/images.py)."""
        self.epoch_key = (seed, epoch)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.take(np.array([i]))
        return x[0], y[0]

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64)
        batch = self.data.take(idx)
        x, y = batch[self.x_field], batch[self.y_field]
        if self.augment is not None:
            try:
                x = decode_batch(list(x), self.augment, *self.epoch_key, idx)
            except ImageDecodeError as e:
                where = self._where(int(idx[0]) if e.index is None else e.index)
                raise arrays.DatasetError(f"{where} field {self.x_field!r}: {e} (a corrupt or non-image file: fix "
                                          "or drop it and convert again)") from None
            self._check(idx, None, y)
            return x, y.astype(np.int64, copy=False).reshape(len(idx))
        if self.data.columns[self.x_field].kind == "image" and x.ndim == 4:
            x = np.moveaxis(x, -1, 1)  # decoded images are N×H×W×C
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.x_scale != 1.0:
            x *= np.float32(self.x_scale)
        self._check(idx, x, y)
        return x, y.astype(np.int64, copy=False).reshape(len(idx))

    def _check(self, idx: np.ndarray, x: np.ndarray | None, y: np.ndarray) -> None:
        if y.dtype.kind not in "iu" or y.shape[1:] not in ((), (1,)):
            raise arrays.DatasetError(f"{self.data.source}: field {self.y_field!r} holds {y.dtype} of shape "
                                        f"{y.shape[1:]} per sample; labels must be one integer per sample")
        labels = y.reshape(len(idx))
        bad = np.flatnonzero((labels < 0) | (labels >= self.num_classes))
        if bad.size:
            where = self._where(int(idx[bad[0]]))
            raise arrays.DatasetError(f"{where} field {self.y_field!r}: label {labels[bad[0]]} is out of range for "
                                        f"--num-classes {self.num_classes} (labels must be 0..{self.num_classes - 1})")
        if self.check_finite and x is not None:
            flat = x.reshape(len(idx), -1)
            finite = np.isfinite(flat).all(axis=1)
            if not finite.all():
                row = int(np.flatnonzero(~finite)[0])
                pos = int(np.flatnonzero(~np.isfinite(flat[row]))[0])
                raise arrays.DatasetError(f"{self._where(int(idx[row]))} field {self.x_field!r}: value "
                                            f"{flat[row, pos]} at position {pos} (NaN/Inf samples cannot be trained "
                                            "on; fix the data or pass --no-check-finite)")

    def _where(self, index: int) -> str:
        shard, row = self.data.locate(np.array([index]))
        return f"{self.data.shard_name(int(shard[0]))} sample {int(row[0])} (index {index})"


def load_splits(root: str | Path, *, num_classes: int | None, x_field: str = "x", y_field: str = "y",
                check_finite: bool = True, block_shards: int | None = None, cache_limit: int | None = None,
                image_size: int | None = None, augment: bool = True) -> arrays.Splits:
    """The train/ and val/ splits under `root` (a directory or a URL; Mosaic's layout), or DatasetError saying what
    is missing. A jpeg/png x column is decoded per batch to `image_size` squares (None: the first training image's
    shorter side, at most DEFAULT_IMAGE_SIZE), the training split augmented (`augment`; else centre-cropped like the
    validation split)."""
    if not store.is_url(root) and (Path(root) / "index.json").is_file() and not (Path(root) / "train").is_dir():
        raise arrays.DatasetError(f"{root} is one MDS split; a dataset root holds train/ and val/ splits (each with "
                                    "its index.json), as `hvdtrain data convert SRC DST --val-fraction 0.1` writes "
                                    "them (holding out 10% of the samples for val/)")
    root = store.normalise(root)
    splits = {}
    for name in ("train", "val"):
        try:
            splits[name] = StreamingDataset(store.join(root, name), fields=(x_field, y_field),
                                            block_shards=block_shards, cache_limit=cache_limit, raw_images=True)
        except DataError as e:
            raise arrays.DatasetError(_split_error(root, name, e)) from None
    classes = num_classes or splits["train"].meta.get("num_classes")
    if classes is None:
        raise arrays.DatasetError(f"{root}: the number of classes is not in its index (the 'hvdtrain' metadata "
                                    "`hvdtrain data convert` writes): pass --num-classes N")
    if not isinstance(classes, int) or classes < 2:
        raise arrays.DatasetError(f"{root}: its index says num_classes={classes!r}; training needs 2 or more "
                                    "classes (labels 0..N-1): fix the labels, or pass --num-classes N")
    train, val = (StreamSplit(splits[n], x_field, y_field, classes, check_finite) for n in ("train", "val"))
    size = _image_size(train, image_size)
    if size is not None:
        train.augment, val.augment = ImageAugment(size, train=augment), ImageAugment(size, train=False)
        train.size_given = val.size_given = image_size is not None
    return arrays.Splits(train=train, val=val, num_classes=classes, name=root)


DEFAULT_IMAGE_SIZE = 224  # the largest size picked for a dataset of image files when --image-size is not given
CPU_IMAGE_SIZE = 64  # the size the start-up line suggests on a CPU when the default picked a larger one


def _image_size(train: StreamSplit, image_size: int | None) -> int | None:
    """The output size of a split whose x column holds image files (None for other columns): `image_size`, else the
    first training image's shorter side, at most DEFAULT_IMAGE_SIZE (a folder of phone photos would otherwise
    make 4000 px squares)."""
    if train.x_field not in train.data.raw_fields:
        return None
    if image_size is None:
        first = train.data.take(np.array([0]))[train.x_field][0]
        try:
            image_size = min(_stored_size(first), DEFAULT_IMAGE_SIZE)
        except ImageDecodeError as e:
            raise arrays.DatasetError(f"{train._where(0)} field {train.x_field!r}: {e}; the image size comes from "
                                      "this first training image unless --image-size is given") from None
    try:
        return ImageAugment(image_size).size
    except ValueError as e:
        raise arrays.DatasetError(f"--image-size: {e}") from None


def _stored_size(data: bytes) -> int:
    """An image file's shorter side, at least 8 (the JPEG header; else a decode), or ImageDecodeError."""
    size = jpeg_size(data)
    if size is None:
        import cv2

        try:
            img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED | cv2.IMREAD_IGNORE_ORIENTATION)
        except cv2.error:  # an empty buffer
            img = None
        if img is None:
            raise ImageDecodeError(f"{len(data)} bytes that OpenCV cannot decode as an image")
        size = (img.shape[1], img.shape[0])
    return max(8, min(size))


def _split_error(root: str, name: str, e: DataError) -> str:
    """The message for a split that cannot be opened: a missing split says which and how to get one (a missing val/:
    `hvdtrain data convert ... --val-fraction`); any other error (a missing bucket, a bad index) as it is."""
    index = store.join(store.join(root, name), "index.json")
    missing = (store.NOT_FOUND in str(e) if store.is_url(root) else not Path(index).is_file())
    if not missing:
        return str(e)
    if name == "val":
        return (f"{root} has no val/ split ({index} does not exist), and training validates on it: convert the "
                "source again holding out samples for validation, e.g. `hvdtrain data convert SRC DST "
                "--val-fraction 0.1` (10% of the samples go to val/), and train on DST")
    return (f"{root} has no train/ split ({index} does not exist): give the root of a dataset written by "
            "`hvdtrain data convert SRC DST` (add --val-fraction 0.1 to hold out a val/ split)"
            + (f", or upload one there (`hvdtrain data upload DST {root}`)" if store.is_url(root) else ""))
