"""Shared-memory segments and the batch layout written into them.

A segment is named `hvdtrain_<creator pid>_<token>` and lives in /dev/shm. The trainer creates every segment; a
worker attaches by name and then unlinks the name at once (the memory stays mapped in both processes). See
NOTE [loader shutdown] in resources.py for why and for who cleans up what.

A batch is a numpy array, a tuple/list of arrays or a dict of str -> array. Its layout (`BatchLayout`: structure,
and per array an offset, shape and dtype) is small metadata that crosses a socket; the bytes are copied once, by
the worker, into the segment, and the trainer builds numpy views on the segment from the layout: no unpickling.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from hvdtrain.data.errors import SharedMemoryFullError

PREFIX = "hvdtrain_"
ALIGN = 64  # byte alignment of every array in a slot (cache line; what SIMD loads and torch like)
PAGE = 4096


class Segment(shared_memory.SharedMemory):
    """SharedMemory whose `close()` never unmaps memory that a lent batch still views (NOTE [batch lifetime] in
    lending.py): with a live export it drops its own reference and the last view unmaps."""

    _address: int | None = None
    # SharedMemory's own state (CPython's multiprocessing/shared_memory.py), which its stub does not declare.
    _buf: memoryview | None
    _mmap: mmap.mmap | None
    _fd: int

    @property
    def buf(self) -> memoryview:
        """The mapped bytes (SharedMemory's `buf`, which is None once closed: using a closed segment is a bug)."""
        if self._buf is None:
            raise ValueError(f"shared memory segment {self.name} is closed")
        return self._buf

    @property
    def fd(self) -> int:
        """The segment's file descriptor in this process (-1 once closed)."""
        return self._fd

    @property
    def address(self) -> int:
        """Where this process maps the segment (read once, from a view dropped at once)."""
        if self._address is None:
            view = np.frombuffer(self.buf, np.uint8)
            self._address = int(view.ctypes.data)
            del view
        return self._address

    def close(self) -> None:
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):  # exported to a lent batch: unmapped when its last view dies
                self._mmap.close()
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(OSError, BufferError):  # BufferError: `buf` itself still exported (a raw user view)
            self.close()


def segment_name(pid: int | None = None) -> str:
    return f"{PREFIX}{os.getpid() if pid is None else pid}_{secrets.token_hex(6)}"


# NOTE [shm reservation]
# A segment is a file on /dev/shm (a tmpfs), and ftruncate makes it sparse: its pages are taken only when first
# written. On a full tmpfs (Docker's default /dev/shm is 64 MiB) that first write, by a producer copying a batch in,
# is a SIGBUS that kills the producer with no word of why. So every page is reserved (posix_fallocate) before any
# batch is written into it: a full /dev/shm is an ENOSPC, which the loader turns into a SharedMemoryFullError naming
# /dev/shm's size, its need and the fixes. The slots' first segments and the rings are reserved by the trainer as
# it makes them (`create_segment`), before the producers start. A grown slot's segment (a batch's size) is made
# sparse by the trainer and reserved by its producer as it attaches it (`reserve_segment`, workers.py `map`): the
# reservation zero-fills every page (11-26 ms for B1's 48 MB on 2 cores), which in the trainer was a wait of its
# step per grown slot, and in the producer runs beside the step; a producer that cannot reserve sends the slot
# back (GrowSlot with `full`) and the trainer raises the SharedMemoryFullError. The pages the reservation
# zero-fills are the ones the producer writes anyway. (A filesystem that cannot reserve, EOPNOTSUPP, gets the
# segment unreserved: glibc emulates posix_fallocate where the kernel lacks it.)


def create_segment(nbytes: int, what: str = "batch", *, reserve: bool = True) -> Segment:
    """A new segment of at least `nbytes` (rounded up to whole pages), named after this process, its memory
    reserved unless `reserve=False` (NOTE [shm reservation]). A full /dev/shm raises SharedMemoryFullError; nothing
    is left behind."""
    size = max(PAGE, -(-nbytes // PAGE) * PAGE)
    seg = Segment(name=segment_name(), create=True, size=size)
    try:
        if seg._mmap is not None and hasattr(mmap, "MADV_DONTFORK"):  # NOTE [forked producers] (a) in forked.py
            seg._mmap.madvise(mmap.MADV_DONTFORK)
        if reserve:
            reserve_segment(seg, what)
    except BaseException:
        release_segment(seg, unlink=True)
        raise
    return seg


def reserve_segment(seg: Segment, what: str = "batch") -> None:
    """Take every page of `seg` now (NOTE [shm reservation]): SharedMemoryFullError when /dev/shm cannot."""
    try:
        os.posix_fallocate(seg._fd, 0, seg.size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem that cannot reserve: used unreserved
            return
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        why = "a memory limit (cgroup) or " if exc.errno == errno.ENOMEM else ""
        raise SharedMemoryFullError(f"/dev/shm cannot hold a {size_text(seg.size)} {what} segment "
                                    f"({why}{shm_space()})") from None


def size_text(nbytes: int | float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def shm_space() -> str:
    """How big /dev/shm is and how much of it is free, as words."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return "/dev/shm is missing"
    return f"{size_text(st.f_bavail * st.f_frsize)} free of {size_text(st.f_blocks * st.f_frsize)}"


def full_message(error: SharedMemoryFullError, *, rank: int, batch_bytes: int, workers: int, slots_per_worker: int,
                 first: bool = False) -> str:
    """The loader's SharedMemoryFullError text: what it needs, and the fixes. first: the slots' first segments
    (batch_bytes each), made before any batch: the need is at least that."""
    total = batch_bytes * workers * slots_per_worker
    need = (f"at least {size_text(total)} of shared memory before its first batch: {workers} worker(s) x "
            f"{slots_per_worker} slots (prefetch + 1) x {size_text(batch_bytes)}, and each slot grows to the size "
            f"of a batch" if first else
            f"about {size_text(total)} of shared memory: {workers} worker(s) x {slots_per_worker} slots (prefetch + "
            f"1) x {size_text(batch_bytes)} per batch")
    return (f"rank {rank}'s data loader: {error}. It needs {need}, for each rank on this machine. Fix: give "
            f"/dev/shm more room (docker run --shm-size=8g, or --ipc=host; Kubernetes: an emptyDir with medium: "
            f"Memory mounted at /dev/shm, `hvdtrain render k8s --shm-size`), or use fewer workers, a smaller "
            f"prefetch or a smaller batch size")


def attach_segment(name: str) -> Segment:
    """Map an existing segment and unlink its name right away (eager unlink: nothing is left in /dev/shm)."""
    seg = Segment(name=name)
    with contextlib.suppress(FileNotFoundError):
        seg.unlink()  # also unregisters it from multiprocessing's resource tracker
    return seg


def release_segment(seg: Segment, *, unlink: bool) -> None:
    """Unmap (if no numpy view is alive; otherwise the mapping goes with the last view) and optionally unlink."""
    if unlink:
        with contextlib.suppress(FileNotFoundError):
            seg.unlink()
    with contextlib.suppress(BufferError):
        seg.close()


def creator_pid(name: str) -> int | None:
    """The pid in a segment name `hvdtrain_<pid>_<token>`, or None for another name."""
    parts = name.split("_")
    if not name.startswith(PREFIX) or len(parts) < 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


STALE_AFTER_S = 60.0


def sweep_stale_segments() -> list[str]:
    """Remove the /dev/shm segments that crashed hvdtrain processes left behind; returns the names removed.

    It unlinks only files named `hvdtrain_<pid>_<token>` whose creator pid is not alive (as seen from this PID
    namespace) *and* that were last modified at least `STALE_AFTER_S` seconds ago; anything else in /dev/shm (a
    live job's segments, other programs' files, files this user may not remove) is left alone. A trainer SIGKILLed
    together with its resource tracker can leave such a name behind, holding its memory (NOTE [loader shutdown] in
    resources.py), and nothing removes it implicitly: constructing an `ShmLoader` does not. Call this explicitly,
    once at process start, before creating any loader (the PyTorch recipes do, right after `hvd.init()`);
    between runs, `scripts/fresh_state.sh` removes such segments too.
    """
    return sweep_stale()


def sweep_stale(min_age_s: float = STALE_AFTER_S) -> list[str]:
    """Unlink hvdtrain segments left by a crash: creator pid dead *and* older than `min_age_s`; returns their names
    (the implementation of `sweep_stale_segments`).

    The age matters: a name lives only until the worker attaches (milliseconds), and a creator in another PID
    namespace sharing /dev/shm (containers with --ipc=host) looks dead from here; a live job's name is never old.
    """
    removed = []
    now = time.time()
    for entry in os.scandir("/dev/shm") if os.path.isdir("/dev/shm") else ():
        pid = creator_pid(entry.name)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):  # gone meanwhile, or another user's file
            if now - entry.stat().st_mtime >= min_age_s:
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


# ---- batch layout --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArraySpec:
    offset: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class BatchLayout:
    kind: str  # "array", "tuple", "list" or "dict"
    keys: tuple[str, ...]  # dict keys, in order; empty otherwise
    arrays: tuple[ArraySpec, ...]
    nbytes: int


def _as_array(value: Any, where: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.hasobject:
        raise TypeError(f"batch {where} has dtype object ({type(value).__name__}); a batch must hold numeric "
                        "or bool arrays (or tuples/lists/dicts of them)")
    return arr


def flatten(batch: Any) -> tuple[str, tuple[str, ...], list[np.ndarray]]:
    """(kind, dict keys, arrays) of a batch; TypeError naming what is not supported."""
    if isinstance(batch, Mapping):
        keys = tuple(batch)
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise TypeError(f"dict batches need str keys, got {bad[0]!r}")
        return "dict", keys, [_as_array(batch[k], f"[{k!r}]") for k in keys]
    if isinstance(batch, tuple | list):
        kind = "tuple" if isinstance(batch, tuple) else "list"
        return kind, (), [_as_array(v, f"[{i}]") for i, v in enumerate(batch)]
    if isinstance(batch, str | bytes) or batch is None:
        raise TypeError(f"a batch must be an array, a tuple/list or a dict of arrays, got {type(batch).__name__}")
    return "array", (), [_as_array(batch, "")]


def plan_layout(batch: Any) -> tuple[BatchLayout, list[np.ndarray]]:
    kind, keys, arrays = flatten(batch)
    specs, offset = [], 0
    for arr in arrays:
        offset = -(-offset // ALIGN) * ALIGN
        specs.append(ArraySpec(offset, tuple(arr.shape), arr.dtype.str))
        offset += arr.nbytes
    return BatchLayout(kind, keys, tuple(specs), offset), arrays


def write_batch(buf: memoryview, layout: BatchLayout, arrays: Sequence[np.ndarray]) -> None:
    """Copy the arrays into `buf` at the layout's offsets (the one copy on the producer side)."""
    for spec, arr in zip(layout.arrays, arrays, strict=True):
        dst = np.ndarray(spec.shape, dtype=np.dtype(spec.dtype), buffer=buf, offset=spec.offset)
        np.copyto(dst, arr, casting="no")


class CompiledLayout:
    """A layout made ready to read batches with, once per slot and layout (the trainer reads one per batch)."""

    __slots__ = ("keys", "kind", "specs")

    def __init__(self, layout: BatchLayout) -> None:
        self.kind, self.keys = layout.kind, layout.keys
        self.specs = [(s.shape, np.dtype(s.dtype), s.offset) for s in layout.arrays]

    def read(self, buf: memoryview | np.ndarray) -> Any:
        """Numpy views on `buf` with the batch's structure (no copy)."""
        views = [np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset) for shape, dtype, offset in self.specs]
        if self.kind == "tuple":
            return tuple(views)
        return _rebuild(self.kind, self.keys, views)


def map_batch(fn: Callable[[np.ndarray], np.ndarray], batch: Any) -> Any:
    """The batch with `fn` applied to each array, same structure."""
    kind, keys, arrays = flatten(batch)
    return _rebuild(kind, keys, [fn(a) for a in arrays])


def _rebuild(kind: str, keys: tuple[str, ...], arrays: list[np.ndarray]) -> Any:
    if kind == "array":
        return arrays[0]
    if kind == "dict":
        return dict(zip(keys, arrays, strict=True))
    return tuple(arrays) if kind == "tuple" else list(arrays)
