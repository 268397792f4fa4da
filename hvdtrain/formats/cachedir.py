"""The per-node cache directory: a file is produced once per node however many processes ask for it.

NOTE [cache files]
A cached file appears only complete: its producer writes `.NAME.part.PID.TID` next to it, fsyncs, and renames it to NAME
(a rename within one directory is atomic), so a reader never sees a half-written file. Producers are serialised
per file by an `flock` on `.NAME.lock`: the first process to take the lock produces the file, the others wait on the
lock (with a timeout, never forever) and then find it there. The kernel drops an flock when its holder dies, so a
producer killed mid-write (SIGKILL) blocks nobody: the next process takes the lock, removes the dead producer's
`.part` file and produces the file again. Lock files are never removed (removing one while another process waits on
it would let two producers in); they are empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from hvdtrain.data.errors import DataError

ENV_DIR = "HVDTRAIN_DATA_CACHE"


def default_root() -> Path:
    """`$HVDTRAIN_DATA_CACHE`, else `<tmp>/hvdtrain-data-<uid>` (local to the node)."""
    env = os.environ.get(ENV_DIR)
    return Path(env) if env else Path(tempfile.gettempdir()) / f"hvdtrain-data-{os.getuid()}"


def dataset_dir(root: Path, source: str) -> Path:
    """The cache subdirectory of one dataset source (a path or URL), named after it and a digest of it."""
    tail = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.rstrip("/").rsplit("/", 1)[-1])[:40]
    return root / f"{tail or 'dataset'}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"


class CacheError(DataError):
    """The cache directory cannot be used (not writable, not a directory, full, busy); the message names it and
    says how to fix it (HVDTRAIN_DATA_CACHE)."""


class CacheFull(CacheError):
    """The disk of the cache directory is full (ENOSPC, EDQUOT): `directory`, and the bytes still `free` there."""

    directory: Path
    free: int | None


class Busy(CacheError):
    """Another process holds the lock (and `file_lock` was told not to wait, or waited its whole timeout)."""


@contextlib.contextmanager
def file_lock(path: Path, timeout: float, what: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created), waiting at most `timeout` s (`Busy` naming `what`; with
    `timeout` 0: one try)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    if timeout <= 0:
                        raise Busy(f"{what}: another process holds {path}") from None
                    raise Busy(f"waited {timeout:.0f} s for another process to finish {what} "
                                      f"(lock {path}); is a process stuck?") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def ensure(path: Path, produce: Callable[[BinaryIO], None] | None = None, *, timeout: float = 600.0,
           what: str = "a cache file", fetch: Callable[[], bytes | memoryview] | None = None,
           room: Callable[[int], contextlib.AbstractContextManager[None]] | None = None) -> tuple[Path, bool]:
    """`path`, produced unless it exists (see NOTE [cache files]); returns (path, produced). Either
    `produce(file)` writes it, or `fetch()` returns its bytes; then `room(nbytes)`, if given, is held around
    writing and renaming them into place (NodeCache's byte limit)."""
    if path.exists():
        return path, False
    part = path.with_name(f".{path.name}.part.{os.getpid()}.{threading.get_native_id()}")  # per thread too
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_name(f".{path.name}.lock"), timeout, what):
            if path.exists():  # another process produced it while we waited
                return path, False
            _remove_parts(path)
            data = fetch() if fetch is not None else None
            with room(len(data)) if room is not None and data is not None else contextlib.nullcontext():
                with open(part, "wb") as f:
                    if data is not None:
                        f.write(data)
                    elif produce is not None:
                        produce(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(part, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            part.unlink()
        if isinstance(e, OSError) and not isinstance(e, DataError):
            raise _cache_error(e, path, what) from None
        raise
    return path, True


def _cache_error(e: OSError, path: Path, what: str) -> CacheError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path.parent)
        left = "" if free is None else f"; {free:,} bytes free"
        full = CacheFull(f"the cache directory {path.parent} is full ({e.strerror}{left}) while {what}: free space "
                         f"there, or set {ENV_DIR} to a directory on a bigger disk")
        full.directory, full.free = path.parent, free
        return full
    return CacheError(f"cannot use the cache directory {path.parent} while {what}: {e.strerror or e} "
                      f"({e.filename or path}); set {ENV_DIR} to a writable local directory")


def free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged process may still write on `directory`'s filesystem (None: cannot tell)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _remove_parts(path: Path) -> None:
    """Partial files of `path` left by producers that died (we hold the lock: no live producer writes one)."""
    for stale in path.parent.glob(f".{path.name}.part.*"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
