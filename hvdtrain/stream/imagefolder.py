"""Image folders as `hvdtrain data convert` reads them: class directories, every image found and checked before
anything is written.

Layout (torchvision's ImageFolder): each directory directly under a split root is a class, numbered by sorted name
over every split; its images are found at any depth below it (`cat/2024/batch0/x.jpg` is a `cat`), links
followed, each directory entered once. Hidden files and directories (a leading dot: `.DS_Store`, macOS's `._x.jpg`
copies, `.cache/`) are not read; files that are not images by their suffix are counted in a note.

NOTE [every image checked first]
Each image is decoded in full once, in parallel (threads: Pillow and OpenCV decode outside the GIL), before
anything is written: a truncated or undecodable file is found here, not half-way through writing or, with
`--encoded`, when training reaches it. `--encoded` files are also decoded by OpenCV, the decoder the readers use
(hvdtrain/stream/images.py). Every bad file is listed in one error (path and reason), or with `skip_bad`
(`--skip-bad`) left out, counted in the summary and recorded in each split's index ("skipped_bad"). A class
directory left with no image is an error naming it, as ImageFolder's is: a class with no samples would still take
a label and an output of the model. Cost: a conversion without `--encoded` decodes each image twice (the check,
then the write), the check on every core.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hvdtrain.formats.npyfiles import IMAGE_SUFFIXES
from hvdtrain.stream.errors import StreamError

ENCODED_SUFFIXES = (".jpg", ".jpeg", ".png")  # kept as files by --encoded (a jpeg/png column; OpenCV decodes them)
CHECK_CHUNK = 4096  # images whose checks are queued at once
NOTED = 50  # bad files named in the summary's notes under --skip-bad (the index records SKIPPED_LISTED)
SKIPPED_LISTED = 1000  # bad files recorded by name in the index under --skip-bad (all are counted)
SKIP_HINT = "fix or remove them, or pass --skip-bad to leave them out (counted in the summary and the index)"

Item = tuple[Path, int]  # (image file, label)


class Folder:
    """What a scan of the class directories found: per split its (image, label) items in order, the classes, and
    files that are not images by suffix (counted per suffix)."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.classes = sorted({d.name for root in dirs.values() for d in root.iterdir()
                               if d.is_dir() and not d.name.startswith(".")})
        self.items: dict[str, list[Item]] = {}
        self.other: dict[str, int] = {}
        self.empty: list[Path] = []  # class directories (present in a split) with no image file
        for split, root in dirs.items():
            self.items[split] = []
            for label, name in enumerate(self.classes):
                if not (root / name).is_dir():
                    continue
                images = self._images(root / name)
                self.items[split] += [(path, label) for path in images]
                if not images:
                    self.empty.append(root / name)

    def _images(self, top: Path) -> list[Path]:
        found = []
        for path in class_files(top):
            suffix = path.suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                found.append(path)
            else:
                self.other[suffix or "(no suffix)"] = self.other.get(suffix or "(no suffix)", 0) + 1
        return found


def class_files(top: Path) -> Iterator[Path]:
    """The files under the class directory `top` at any depth, sorted by path, hidden ones (and hidden
    directories) left out, links followed, each real directory entered once; a link to `top` or above it is not
    followed (it would take other classes' images, or loop)."""
    seen: set[tuple[int, int]] = set()
    above = {top.resolve(), *top.resolve().parents}

    def walk(directory: Path) -> Iterator[Path]:
        try:
            st = directory.stat()
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:
            raise StreamError(f"{directory}: cannot list it ({e.strerror or e})") from None
        if (st.st_dev, st.st_ino) in seen:
            return
        seen.add((st.st_dev, st.st_ino))
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                if not (entry.is_symlink() and Path(entry.path).resolve() in above):
                    yield from walk(Path(entry.path))
            elif entry.is_file():
                yield Path(entry.path)

    yield from walk(top)


def check_images(items: list[Path], encoded: bool, progress: bool) -> tuple[dict[Path, tuple[int, int]],
                                                                            dict[Path, str]]:
    """Every image decoded in full, in parallel (NOTE [every image checked first]): each good one's (H, W) and
    each bad one's reason."""
    from tqdm import tqdm

    sizes: dict[Path, tuple[int, int]] = {}
    bad: dict[Path, str] = {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(32, cores + 2)  # + 2: file reads overlap the decodes
    with ThreadPoolExecutor(workers, thread_name_prefix="check-image") as pool, \
            tqdm(total=len(items), desc="checking images", unit="image", disable=None if progress else True) as bar:
        for start in range(0, len(items), CHECK_CHUNK):  # a chunk of futures at a time, not one per image at once
            chunk = items[start:start + CHECK_CHUNK]
            for path, (size, reason) in zip(chunk, pool.map(lambda p: image_problem(p, encoded), chunk),
                                            strict=True):
                if reason is None and size is not None:
                    sizes[path] = size
                else:
                    bad[path] = reason or "no size"
                bar.update(1)
    return sizes, bad


def image_problem(path: Path, encoded: bool) -> tuple[tuple[int, int] | None, str | None]:
    """((H, W), None) for an image that decodes in full; (None, why not) otherwise."""
    from PIL import Image, UnidentifiedImageError

    if encoded and path.suffix.lower() not in ENCODED_SUFFIXES:
        return None, (f"--encoded keeps JPEG and PNG files only ({'/'.join(ENCODED_SUFFIXES)}); convert this "
                      "folder without --encoded, or convert the file to JPEG")
    try:
        data = path.read_bytes()
    except OSError as e:
        return None, f"cannot read it ({e.strerror or e})"
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # the whole file: a truncated one fails here, not only its header
            size = (image.height, image.width)
    except UnidentifiedImageError:
        return None, f"not an image Pillow can read ({len(data)} bytes)"
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        return None, f"does not decode ({e})"
    if encoded:
        why = _opencv_problem(data)
        if why is not None:
            return None, why
    return size, None


def _opencv_problem(data: bytes) -> str | None:
    """Why OpenCV (the readers' decoder) does not decode `data`, or None."""
    import cv2
    import numpy as np

    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    except cv2.error as e:
        return f"OpenCV, which decodes it for training, cannot ({str(e).strip().splitlines()[-1]})"
    return None if img is not None else "OpenCV, which decodes it for training, cannot decode it"


def bad_files_error(bad: dict[Path, str]) -> StreamError:
    lines = [f"  {path}: {why}" for path, why in sorted(bad.items())]
    return StreamError(f"{len(bad)} image file{'s' * (len(bad) != 1)} cannot be converted:\n" + "\n".join(lines)
                       + f"\n{SKIP_HINT}")


def empty_classes_error(empty: list[Path], skipped: bool = False) -> StreamError:
    names = ", ".join(str(p) for p in sorted(empty))
    if skipped:
        return StreamError(f"every image of class director{'ies' if len(empty) > 1 else 'y'} {names} is bad "
                           "(--skip-bad left them all out); every class needs images (a class directory's name is "
                           "its label): fix its images, or remove the directory")
    return StreamError(f"class director{'ies' if len(empty) > 1 else 'y'} with no image: {names}; every class "
                       "needs images (a class directory's name is its label): put its images in it (any depth) "
                       "or remove it")


def skipped_record(bad: dict[Path, str], src: Path) -> dict[str, Any]:
    """What the index records of the files --skip-bad left out: their count and (the first SKIPPED_LISTED) paths
    relative to the source `src`, with why."""
    files = [{"path": str(p.relative_to(src)) if p.is_relative_to(src) else str(p), "reason": why}
             for p, why in sorted(bad.items())[:SKIPPED_LISTED]]
    return {"count": len(bad), "files": files}


def val_only(items: dict[str, list[Item]], classes: list[str]) -> str | None:
    """A note when some classes have images in val/ only: they take a label no training sample has."""
    if "val" not in items:
        return None
    trained = {label for _, label in items["train"]}
    missing = sorted({classes[label] for _, label in items["val"] if label not in trained})
    if not missing:
        return None
    return (f"class{'es' * (len(missing) > 1)} {', '.join(missing)} have images in val/ only: the model gets an "
            "output for each that no training sample teaches; add training images or remove them from val/")
