"""The files of a `.npy`/`.npz` shard directory and the errors for unreadable ones (hvdtrain/formats/npyshards.py reads
them, hvdtrain/stream/convert.py converts them)."""

from __future__ import annotations

import mmap
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from hvdtrain.formats.arrays import DatasetError

# What numpy and zipfile raise for a file that is not (intact) numpy data: a truncated or corrupt .npy header,
# a bad zip, a bad CRC-32, a corrupt deflate stream, object arrays (which would need pickle).
UNREADABLE = (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError)

ShardSrc = Path | tuple[Path, Path]  # a .npz file or (NAME_x.npy, NAME_y.npy)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")  # Pillow decodes them


def shard_files(directory: Path) -> list[tuple[str, ShardSrc]]:
    """[(name for errors, .npz path or (x.npy, y.npy))], sorted by name; errors for unpaired .npy files."""
    found: list[tuple[str, ShardSrc]] = []
    for p in sorted(directory.glob("*.npz")):
        found.append((str(p), p))
    for p in sorted(directory.glob("*.npy")):
        if p.name.endswith("_y.npy"):
            if not p.with_name(p.name[: -len("_y.npy")] + "_x.npy").exists():
                raise DatasetError(f"{p}: labels file without its samples file "
                                   f"{p.name[: -len('_y.npy')]}_x.npy")
            continue
        if not p.name.endswith("_x.npy"):
            raise DatasetError(f"{p}: .npy shards must be named NAME_x.npy (samples) with NAME_y.npy "
                               f"(labels); or use .npz files with arrays 'x' and 'y'")
        y_path = p.with_name(p.name[: -len("_x.npy")] + "_y.npy")
        if not y_path.exists():
            raise DatasetError(f"{p}: missing its labels file {y_path.name}")
        found.append((str(p), (p, y_path)))
    if not found:
        hint = _image_folder_hint(directory)
        raise DatasetError(f"{directory}: no .npz or NAME_x.npy/NAME_y.npy shards found{hint}")
    return sorted(found, key=lambda item: item[0])


def _image_folder_hint(directory: Path) -> str:
    """What to do when `directory` looks like an image folder (an image in a class directory, or one level below;
    the recipes read MDS datasets and shards, not image files): '' otherwise."""
    split = directory.name in ("train", "val")
    root = directory.parent if split else directory
    for pattern in ("*/*", "*/*/*"):
        for p in directory.glob(pattern):
            if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."):
                return (f"; it is an image folder ({p.relative_to(directory)}): convert it to a dataset first, e.g. "
                        f"`hvdtrain data convert {root} {root}-mds{'' if split else ' --val-fraction 0.1'}` "
                        "(--encoded keeps the JPEGs; "
                        f"docs/streaming.md), then train with --dataset {root}-mds")
    return ""


def unreadable(name: str, e: BaseException) -> DatasetError:
    """The error for array data numpy or zipfile cannot read (`e`, one of UNREADABLE), naming it and the reason."""
    reason = str(e) or type(e).__name__
    if isinstance(e, zipfile.BadZipFile | zlib.error):
        reason = f"corrupt or truncated .npz archive ({reason})"
    elif "Object arrays cannot be loaded" in reason:
        reason = "it holds Python objects (dtype=object), which would need pickle; save numeric arrays"
    elif "pickled" in reason or "magic string is not correct" in reason:  # no .npy/.npz magic
        reason = "not a .npy/.npz file (no numpy header: another format, a damaged start, or a pickle)"
    return DatasetError(f"{name}: cannot read as numpy data: {reason}")


def np_load(path: Path) -> np.ndarray | np.lib.npyio.NpzFile:
    """`np.load(path)` (a .npz: only its directory is read), DatasetError naming the file if it cannot."""
    try:
        return np.load(path, allow_pickle=False)
    except UNREADABLE as e:
        raise unreadable(str(path), e) from None


def read_npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, Fortran order, dtype, header length in bytes) of the .npy data starting at `f`'s position; ValueError
    for what numpy would not load without pickle."""
    start = f.tell()
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not read; save with numpy's default "
                         "format (np.save)")
    if dtype.hasobject:
        raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
    return tuple(int(d) for d in shape), bool(fortran), dtype, f.tell() - start


def check_length(name: str, shape: tuple[int, ...], dtype: np.dtype, available: int) -> None:
    """DatasetError unless `available` bytes hold the data an .npy header of `shape` and `dtype` promises."""
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if available < need:
        raise DatasetError(f"{name}: cannot read as numpy data: truncated: its header says {dtype} of shape {shape} "
                           f"({need} bytes of data), but only {max(available, 0)} bytes follow")


# ---- memory maps ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArrayRef:
    """Where one array lies on this node: an .npy header at byte `header_at` of `path` (a .npy file: 0; a member
    stored in a .npz: inside the archive), its data at `offset`. Picklable; `open()` maps it in the process that
    reads it."""

    path: str
    header_at: int
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    name: str  # for errors: "/data/a.npz['x']" or "/data/a_x.npy"

    def open(self) -> MappedArray:
        """The array memory-mapped read-only, after checking that its header still says what it said at load."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.header_at)
                shape, fortran, dtype, length = read_npy_header(f)
                if (shape, fortran, dtype, self.header_at + length) != (self.shape, self.fortran, self.dtype,
                                                                          self.offset):
                    raise DatasetError(f"{self.name}: changed since the dataset was loaded (now {dtype} of shape "
                                       f"{shape}, was {self.dtype} of shape {self.shape}); do not rewrite shards "
                                       "while training")
                return MappedArray(self, f.fileno())
        except DatasetError:
            raise
        except UNREADABLE as e:
            raise unreadable(self.name, e) from None


class MappedArray:
    """An ArrayRef's data mapped read-only with the kernel told to expect random access (MADV_RANDOM: no readahead
    around each fault, which on a disk with a large read_ahead_kb reads megabytes per sample); `gather(rows)`
    announces the rows it copies (MADV_WILLNEED: each row's pages are read at once) and copies them."""

    def __init__(self, ref: ArrayRef, fd: int) -> None:
        self.row_bytes = int(np.prod(ref.shape[1:], dtype=np.int64)) * ref.dtype.itemsize
        nbytes = ref.shape[0] * self.row_bytes
        self.mm: mmap.mmap | None = None
        if nbytes == 0:  # mmap refuses an empty range
            self.array = np.empty(ref.shape, ref.dtype)
            return
        self.start = ref.offset % mmap.ALLOCATIONGRANULARITY  # the data's offset inside the mapping
        self.mm = mmap.mmap(fd, self.start + nbytes, access=mmap.ACCESS_READ, offset=ref.offset - self.start)
        self.contiguous_rows = not ref.fortran or len(ref.shape) == 1
        if hasattr(mmap, "MADV_RANDOM"):
            self.mm.madvise(mmap.MADV_RANDOM)
        self.array = np.ndarray(ref.shape, ref.dtype, buffer=self.mm, offset=self.start,
                                order="F" if ref.fortran else "C")

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """A copy of rows `rows` (sorted: the file is read forward)."""
        if self.mm is not None and self.contiguous_rows and self.row_bytes >= mmap.PAGESIZE and \
                hasattr(mmap, "MADV_WILLNEED"):
            for row in rows:
                lo = self.start + int(row) * self.row_bytes
                page = lo - lo % mmap.PAGESIZE
                self.mm.madvise(mmap.MADV_WILLNEED, page, lo + self.row_bytes - page)
        return self.array[rows]
