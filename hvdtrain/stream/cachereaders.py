"""Who reads a node cache directory, and where each reader is in its epoch (NOTE [eviction by next use]).

A process reading a dataset with a plan (a loader's producer) publishes `seed epoch block_start order` in its own
file `.reader.PID.TOKEN` in the cache directory and holds a shared `flock` on it while it lives (`order` names the
shard order and dataset version: a reader of another one is not counted). The file is made under another name,
locked and written, then renamed into place, so no live reader's file is ever seen unlocked (a process killed in
that instant leaves a small `.reader-new.*` file behind, never read). The process making
room reads them all: a file whose lock it can take exclusively belongs to a process that died (the kernel dropped
its lock), and is removed; the others are live readers. Positions are rewritten in place (fixed width, one
`pwrite`) only when a reader enters another shuffle block, without a lock: a torn record is skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = ".reader."
MAKING = ".reader-new."  # before the rename into place
WIDTH = 96


@dataclass(frozen=True)
class Position:
    """A reader at position `start` (a shuffle block's first) of epoch `epoch`'s shard order under `seed`, of the
    order (and dataset version) named `order` (a token without spaces)."""

    seed: int
    epoch: int
    start: int
    order: str

    def record(self) -> bytes:
        return f"{self.seed} {self.epoch} {self.start} {self.order}\n".encode().ljust(WIDTH)

    @classmethod
    def parse(cls, data: bytes) -> Position | None:
        try:
            seed, epoch, start, order = data.split(b"\n", 1)[0].decode().split()
            at = cls(int(seed), int(epoch), int(start), order)
        except ValueError:
            return None  # torn by a concurrent write
        return at if min(at.seed, at.epoch, at.start) >= 0 else None


class Registration:
    """This process's reader file in `directory` (made by the first `publish`, removed by `close`)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.path: Path | None = None
        self._fd: int | None = None
        self._pid: int | None = None

    def publish(self, position: Position) -> None:
        if self._fd is None or self._pid != os.getpid() or os.fstat(self._fd).st_nlink == 0:
            self._open(position)  # first use, a forked or unpickled copy, or removed by mistake: a file of our own
        else:
            os.pwrite(self._fd, position.record(), 0)

    def _open(self, position: Position) -> None:
        self._forget()
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}.{secrets.token_hex(4)}"
        making = self.dir / f"{MAKING}{name}"
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.pwrite(fd, position.record(), 0)
        self.path = self.dir / f"{PREFIX}{name}"
        os.rename(making, self.path)  # seen only locked and written
        self._fd, self._pid = fd, os.getpid()

    def _forget(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # in a forked child, its copy (the parent's lock stays: the parent holds it too)
        self._fd = self._pid = None

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid() and self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._forget()

    def __getstate__(self) -> dict[str, Any]:
        return {"dir": self.dir, "path": None, "_fd": None, "_pid": None}


def live(directory: Path) -> dict[str, Position]:
    """The positions of the live readers of `directory`, by file name; removes the files of dead ones."""
    out: dict[str, Position] = {}
    names: list[str] = []
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as it:
        names = [e.name for e in it if e.name.startswith(PREFIX)]  # (never a MAKING one: it is not locked yet)
    for name in names:
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its reader holds it: alive
                position = Position.parse(os.pread(fd, WIDTH, 0))
                if position is not None:
                    out[name] = position
                continue
            with contextlib.suppress(FileNotFoundError):
                (directory / name).unlink()  # its reader died
        finally:
            os.close(fd)
    return out
