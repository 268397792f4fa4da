"""Files replaced atomically: a reader (or a crash) sees the old file or the new one, never a partial one."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_MARK = ".tmp-"  # temp files are named .<name>.tmp-XXXX in the target's directory


def atomic_write(path: Path | str, write: Callable[[BinaryIO], object]) -> Path:
    """Write a file atomically: temp file in the same directory, fsync, os.replace, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _create_temp(path: Path) -> tuple[int, str]:
    """A new empty file next to `path`, made with mode 0666 so that the kernel applies the process's umask: the
    file gets the usual permissions (mkstemp makes 0600, and reading the umask means setting it, process-wide)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}{TMP_MARK}{secrets.token_hex(4)}")
        with contextlib.suppress(FileExistsError):
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
    raise FileExistsError(f"no free temporary name next to {path} after 100 tries")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
