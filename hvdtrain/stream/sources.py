"""The sources `hvdtrain data convert` reads (hvdtrain/stream/convert.py's module docstring): array shard
directories and image folders, checked whole before anything is written, then read sample by sample."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.data.errors import DataError
from hvdtrain.formats.npyfiles import IMAGE_SUFFIXES
from hvdtrain.stream import encodings, imagefolder
from hvdtrain.stream.errors import StreamError


@dataclass
class Source:
    """A checked source: per split its items in order (array shard files, or (image, label)) and sample count."""

    kind: str
    items: dict[str, list[Any]]
    counts: dict[str, int]
    x_encoding: str
    meta: dict[str, Any] = field(default_factory=dict)
    image_size: tuple[int, int] | None = None  # images: resize to (H, W)
    encoded: bool = False  # images: the files' bytes as they are (a jpeg/png column), not decoded pixels
    notes: list[str] = field(default_factory=list)


def samples(source: Source, items: list[Any], bar: Any) -> Iterator[tuple[np.ndarray | bytes, int]]:
    """(x, label) of each sample of one split's items, in order."""
    if source.kind == "images":
        for path, label in items:
            yield (_read_file(path) if source.encoded else _decode_image(path, source.image_size)), label
            bar.update(1)
        return
    for src in items:
        x, y = load_array(src, "x"), load_array(src, "y")
        x = x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))  # the encoder wants native byte order
        for i in range(len(y)):
            yield x[i], int(y[i])
        bar.update(len(y))


# ---- array shard directories ------------------------------------------------------------------------------

ShardSrc = Path | tuple[Path, Path]  # a .npz file or (NAME_x.npy, NAME_y.npy), from npyfiles.shard_files


def scan(dirs: dict[str, Path], image_size: tuple[int, int] | None, encoded: bool = False, skip_bad: bool = False,
         progress: bool = False) -> Source:
    if any(next(d.glob("*.np[yz]"), None) for d in dirs.values()):
        if image_size is not None or encoded:
            raise StreamError(f"{next(iter(dirs.values()))} holds array shards: "
                              f"{'--encoded' if encoded else '--image-size'} applies to image folders only")
        return _scan_arrays(dirs)
    if encoded and image_size is not None:
        raise StreamError("--encoded keeps each image file as it is, so --image-size (which resizes decoded pixels) "
                          "does not apply: give one of them (training picks the size: the recipes' --image-size)")
    return _scan_images(dirs, image_size, encoded, skip_bad, progress)


def _scan_arrays(dirs: dict[str, Path]) -> Source:
    """Every shard's x header and labels checked (x's data is not read); one x dtype and sample shape in all."""
    from hvdtrain.formats.npyfiles import shard_files

    items: dict[str, list[Any]] = {}
    counts: dict[str, int] = {}
    first: tuple[str, tuple[int, ...], np.dtype] | None = None
    top, distinct = -1, set[int]()
    for split, directory in dirs.items():
        items[split], counts[split] = [src for _, src in shard_files(directory)], 0
        for src in items[split]:
            shape, dtype = _x_header(src)
            y = load_array(src, "y")
            _check_labels(src, shape[0], y)
            first = first or (_where(src, "x")[1], shape[1:], dtype)
            if (shape[1:], dtype) != first[1:]:
                raise StreamError(f"{_where(src, 'x')[1]}: samples are {dtype} of shape {shape[1:]}, but {first[0]} "
                                  f"holds {first[2]} of shape {first[1]}; every shard must hold one dtype and shape")
            counts[split] += len(y)
            if len(y):
                top, distinct = max(top, int(y.max())), distinct | set(np.unique(y).tolist())
        if not counts[split]:
            raise StreamError(f"{directory}: its shards hold no samples")
    if first is None:  # unreachable: every split holds samples (checked above), so some shard set `first`
        raise StreamError(f"{', '.join(map(str, dirs.values()))}: no shard holds samples")
    x_encoding = encodings.ndarray_encoding(np.empty(first[1], first[2]))
    source = Source("arrays", items, counts, x_encoding, {"num_classes": top + 1, "x_shape": list(first[1])})
    if top + 1 > 2 * len(distinct):
        source.notes.append(f"num_classes is {top + 1} (the largest label + 1) but only {len(distinct)} distinct "
                            "labels occur: check for a stray label, or train with --num-classes N")
    return source


def _where(src: ShardSrc, key: str) -> tuple[Path, str]:
    """The file holding array `key` ('x' or 'y') of a shard, and its name for errors."""
    if isinstance(src, tuple):
        return (src[0] if key == "x" else src[1]), str(src[0] if key == "x" else src[1])
    return src, f"{src}['{key}']"


def _x_header(src: ShardSrc) -> tuple[tuple[int, ...], np.dtype]:
    """x's shape and dtype from its .npy header (its data is not read); StreamError when MDS cannot store it."""
    from hvdtrain.formats.npyfiles import UNREADABLE, unreadable

    path, name = _where(src, "x")
    try:
        if isinstance(src, tuple):
            with open(path, "rb") as f:
                shape, dtype = _npy_header(f)
        else:
            with _npz(path, "x") as npz, npz.zip.open("x.npy") as f:
                shape, dtype = _npy_header(f)
    except UNREADABLE as e:
        if isinstance(e, DataError):
            raise
        raise unreadable(name, e) from None
    if len(shape) < 2 or 0 in shape[1:]:
        raise StreamError(f"{name}: samples must be an array of shape (N, ...) with non-empty samples, got shape "
                          f"{shape}")
    if dtype.name not in encodings.DTYPE_CODES:
        raise StreamError(f"{name}: dtype {dtype} cannot be stored in MDS; allowed: "
                          f"{', '.join(encodings.DTYPE_CODES)} (cast it, e.g. x.astype(np.float32))")
    return shape, dtype


def _npy_header(f: Any) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f".npy format version {version} is not read; save with numpy's default format")
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    return tuple(shape), dtype


def _check_labels(src: ShardSrc, samples: int, y: np.ndarray) -> None:
    name = _where(src, "y")[1]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise StreamError(f"{name}: labels must be a 1-D integer array of class ids, got dtype {y.dtype} shape "
                          f"{y.shape} (save them with y.astype(np.int64))")
    if len(y) != samples:
        raise StreamError(f"{_where(src, 'x')[1]} has {samples} samples but {name} has {len(y)} labels")
    if len(y) and (int(y.min()) < 0 or y.max() > np.iinfo(np.int64).max):
        bad = int(np.argmin(y)) if int(y.min()) < 0 else int(np.argmax(y))
        raise StreamError(f"{name}[{bad}]: label {y[bad]} is not a class id 0..K-1 (int64)")


def _npz(path: Path, key: str) -> Any:
    """The open .npz archive `path`, which holds `key`; StreamError otherwise."""
    from hvdtrain.formats.npyfiles import np_load

    data = np_load(path)
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise StreamError(f"{path}: a single array, not a .npz archive holding 'x' and 'y'")
    if key not in data.files:
        data.close()
        raise StreamError(f"{path}: no array {key!r} (found {sorted(data.files)}); a .npz shard must hold 'x' "
                          "(samples) and 'y' (integer labels)")
    return data


def load_array(src: ShardSrc, key: str) -> np.ndarray:
    from hvdtrain.formats.npyfiles import UNREADABLE, np_load, unreadable

    path, name = _where(src, key)
    if isinstance(src, tuple):
        data = np_load(path)
        if not isinstance(data, np.ndarray):
            data.close()
            raise StreamError(f"{path}: a .npz archive, not a .npy array")
        return data
    with _npz(path, key) as npz:
        try:
            return npz[key]
        except UNREADABLE as e:
            raise unreadable(name, e) from None


# ---- image folders ----------------------------------------------------------------------------------------

def _scan_images(dirs: dict[str, Path], image_size: tuple[int, int] | None, encoded: bool = False,
                 skip_bad: bool = False, progress: bool = False) -> Source:
    """Every class directory's images found (at any depth) and decoded once (NOTE [every image checked first] in
    hvdtrain/stream/imagefolder.py); StreamError listing every bad file, unless `skip_bad`."""
    folder = imagefolder.Folder(dirs)
    for split, root in dirs.items():
        if not folder.items[split]:
            raise StreamError(f"{root}: no .npz/.npy shards and no images found; expected array shards or class "
                              f"directories of {'/'.join(IMAGE_SUFFIXES)} files ({root}/CLASS/*.png, any depth)")
    if folder.empty:
        raise imagefolder.empty_classes_error(folder.empty)
    every = [path for split in folder.items.values() for path, _ in split]
    sizes, bad = imagefolder.check_images(every, encoded, progress)
    if bad and not skip_bad:
        raise imagefolder.bad_files_error(bad)
    items = {split: [(p, label) for p, label in found if p not in bad] for split, found in folder.items.items()}
    emptied = [dirs[split] / folder.classes[label] for split in dirs  # every image of the class was bad
               for label in sorted({label for _, label in folder.items[split]} - {label for _, label in items[split]})]
    if emptied:
        raise imagefolder.empty_classes_error(emptied, skipped=True)
    first = next((p, sizes[p]) for split in items.values() for p, _ in split)
    if image_size is None and not encoded:
        for path, size in ((p, sizes[p]) for split in items.values() for p, _ in split):
            if size != first[1]:
                raise StreamError(f"{path}: image is {size[0]}x{size[1]} (HxW) but {first[0]} is "
                                  f"{first[1][0]}x{first[1][1]}; pass --image-size HxW to resize every image")
    source = _image_source(items, folder.classes, image_size or first[1], image_size, encoded)
    if folder.other:
        kinds = ", ".join(f"{suffix}: {n}" for suffix, n in sorted(folder.other.items()))
        source.notes.append(f"skipped {sum(folder.other.values())} files of the class directories that are not "
                            f"images ({kinds}); images are {'/'.join(IMAGE_SUFFIXES)} files")
    if (note := imagefolder.val_only(items, folder.classes)) is not None:
        source.notes.append(note)
    if bad:
        src = next(iter(dirs.values())) if len(dirs) == 1 else next(iter(dirs.values())).parent
        source.meta["skipped_bad"] = imagefolder.skipped_record(bad, src)
        source.notes += [f"skipped bad image {path}: {why}"
                         for path, why in sorted(bad.items())[:imagefolder.NOTED]]
        more = f" ({len(bad) - imagefolder.NOTED} more not named here)" if len(bad) > imagefolder.NOTED else ""
        source.notes.append(f"skipped {len(bad)} bad image file{'s' * (len(bad) != 1)} (--skip-bad){more}, "
                            "recorded in each split's index.json (hvdtrain.skipped_bad)")
    return source


def _image_source(items: dict[str, list[Any]], classes: list[str], hw: tuple[int, int],
                  image_size: tuple[int, int] | None, encoded: bool) -> Source:
    counts = {k: len(v) for k, v in items.items()}
    if encoded:  # decoded (and augmented) per batch by the readers: hvdtrain.stream.images
        jpeg = any(p.suffix.lower() != ".png" for split in items.values() for p, _ in split)
        meta = {"num_classes": len(classes), "classes": classes}
        return Source("images", items, counts, "jpeg" if jpeg else "png", meta, None, encoded=True)
    # x_scale: readers train on x * x_scale (pixels 0..255 -> 0..1); array datasets are trained on as stored.
    meta = {"num_classes": len(classes), "x_shape": [3, *hw], "classes": classes, "x_scale": 1 / 255}
    return Source("images", items, counts, f"ndarray:uint8:3,{hw[0]},{hw[1]}", meta, image_size)


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise StreamError(f"{path}: cannot read ({e.strerror})") from None


def _decode_image(path: Path, size: tuple[int, int] | None) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise StreamError(f"{path}: cannot decode the image ({e})") from None
    if size is not None and (rgb.height, rgb.width) != size:
        rgb = rgb.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return np.asarray(rgb).transpose(2, 0, 1)  # H×W×3 -> 3×H×W
