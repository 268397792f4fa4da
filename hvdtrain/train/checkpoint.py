"""Atomic, self-verifying checkpoints; keep the last K; find the newest one that is intact.

Framework-neutral: the caller passes how to serialize (`write(state, fileobj)`, e.g. `torch.save`) and how
to read back (`read(fileobj)`, e.g. `torch.load`). Nothing here calls Horovod: the recipe decides that only
rank 0 saves and looks for a checkpoint, and broadcasts what rank 0 found.

Layout: `<directory>/ckpt-epoch0003.pt` holds the state after epoch 3 (1-based: epochs completed);
`ckpt-epoch0003-step000150.pt` the state 150 steps into the next epoch (a recipe stopped mid-epoch to be resumed:
hvdtrain/train/preempt.py), newer than the first and older than `ckpt-epoch0004.pt`. A write
goes to a temporary file in the same directory, is flushed and fsync'ed, then `os.replace`d over the final
name and the directory is fsync'ed — a crash leaves either the old set of checkpoints or the new one, never a
partial file under a checkpoint name.

File format: a 48-byte header (magic `HVDCKPT1`, payload length, SHA-256 of the payload) then the payload
that `write` produced. Damage done some other way (a truncated copy, a full disk on another tool's copy, bit
rot) is detected from the header before any deserializer runs, so `find_latest` skips such a file with a
warning instead of depending on what exception a given deserializer raises for garbage. To read one by hand:
`checkpoint.load(path, torch.load)`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import struct
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hvdtrain.atomic import TMP_MARK, atomic_write

PREFIX = "ckpt-epoch"
_NAME = re.compile(rf"^{PREFIX}(\d{{4,}})(?:-step(\d{{6,}}))?\.pt$")
MAGIC = b"HVDCKPT1"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256(payload)


class CheckpointInvalid(ValueError):
    """A checkpoint file loaded but its content is not a checkpoint of the expected shape."""


class CheckpointMismatch(Exception):
    """An intact checkpoint that does not fit the model or optimizer being trained (another --model, --model-width,
    or an earlier version of the model): the recipes stop with exit 2 (hvdtrain/train/entry.py)."""


@dataclass(frozen=True)
class Found:
    """The newest checkpoint that loaded: its path, the epochs it completed, its state, and the steps it trained
    into the next epoch (0: an epoch's end)."""

    path: Path
    epoch: int
    state: dict[str, Any]
    step: int = 0


def resume_loader(loader: Any, state: Mapping[str, Any], directory: Path | str) -> None:
    """Put a mid-epoch checkpoint's loader position back (`loader.load_state_dict`); a position of other data (another
    --dataset, --seed or order: the sampler's SamplerMismatch) is a CheckpointMismatch, so exit 2 with the way out."""
    from hvdtrain.data.errors import SamplerMismatch

    try:
        loader.load_state_dict(state)
    except SamplerMismatch as e:
        raise CheckpointMismatch(
            f"the newest checkpoint in {directory} was written mid-epoch on other data ({e}): resume with the "
            "--dataset and --seed it was written with, train in a new --run-dir, or pass --no-resume to start from "
            "scratch") from None


def checkpoint_path(directory: Path | str, epoch: int, step: int = 0) -> Path:
    """`ckpt-epochEEEE.pt`, or with `step` > 0 (steps into epoch `epoch` + 1) `ckpt-epochEEEE-stepSSSSSS.pt`."""
    if not isinstance(epoch, int) or epoch < 0 or (epoch == 0 and not step):
        raise ValueError(f"epoch must be an int >= 1 (epochs completed; 0 only with a step), got {epoch!r}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0 (steps into the next epoch), got {step!r}")
    return Path(directory) / (f"{PREFIX}{epoch:04d}-step{step:06d}.pt" if step else f"{PREFIX}{epoch:04d}.pt")


def parse_name(name: str) -> tuple[int, int] | None:
    """(epochs completed, steps into the next one) from a checkpoint's file name; None for any other name."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def list_checkpoints(directory: Path | str) -> list[tuple[int, Path]]:
    """(epoch, path) of every file named like a checkpoint, oldest first (by epoch, then step). Temp files are not
    listed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        at = parse_name(entry.name)
        if at is not None and entry.is_file():
            found.append((at, entry))
    return [(at[0], path) for at, path in sorted(found)]


def save(
    directory: Path | str,
    epoch: int,
    state: Mapping[str, Any],
    write: Callable[[Mapping[str, Any], BinaryIO], None],
    *,
    keep: int,
    step: int = 0,
) -> Path:
    """Atomically write `state` (plus "epoch" and "step" keys) as the checkpoint for `epoch` (and `step` into the
    next epoch); keep the newest `keep`.

    Call on one process only (rank 0). Leftover temp files from a crashed write are removed.
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (checkpoints to keep), got {keep!r}")
    path = write_file(checkpoint_path(directory, epoch, step), {**state, "epoch": epoch, "step": step}, write)
    prune(directory, keep=keep)
    return path


def write_file(path: Path | str, obj: Any, write: Callable[[Any, BinaryIO], None]) -> Path:
    """Atomically write `obj` serialized by `write` to `path`, in the checkpoint file format."""
    return atomic_write(path, lambda f: _write_enveloped(f, lambda g: write(obj, g)))


class _HashingWriter(io.RawIOBase):
    """Passes writes through to `f`, hashing and counting them (what the serializer sees as its file)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f, self.sha, self.length = f, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.sha.update(view)
        self.length += len(view)
        self._f.write(view)
        return len(view)


def _write_enveloped(f: BinaryIO, write_payload: Callable[[BinaryIO], None]) -> None:
    f.write(b"\0" * _HEADER.size)
    hashing = _HashingWriter(f)
    write_payload(hashing)  # type: ignore[arg-type]  # a file the payload writers only write() to
    f.seek(0)
    f.write(_HEADER.pack(MAGIC, hashing.length, hashing.sha.digest()))
    f.seek(0, os.SEEK_END)


def verified_payload(path: Path | str) -> bytes:
    """A checkpoint file's payload after checking header, length and SHA-256 (else CheckpointInvalid)."""
    data = Path(path).read_bytes()
    if len(data) < _HEADER.size:
        raise CheckpointInvalid(f"{len(data)} bytes, shorter than the {_HEADER.size}-byte header (truncated)")
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointInvalid(f"not an hvdtrain checkpoint (magic {magic!r}, expected {MAGIC!r})")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise CheckpointInvalid(f"payload is {len(payload)} bytes, header says {length} "
                                "(truncated or padded)")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointInvalid("SHA-256 of the payload does not match the header (corrupted)")
    return payload


def load(path: Path | str, read: Callable[[BinaryIO], Any]) -> Any:
    """Verify a checkpoint file and deserialize its payload with `read` (e.g. `torch.load`)."""
    return read(io.BytesIO(verified_payload(path)))


def prune(directory: Path | str, *, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints and any stale temp files; return what was deleted."""
    directory = Path(directory)
    removed = [p for _, p in list_checkpoints(directory)[:-keep]]
    removed += [p for p in directory.glob(f".{PREFIX}*{TMP_MARK}*") if p.is_file()]
    for p in removed:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return removed


def find_latest(
    directory: Path | str,
    read: Callable[[BinaryIO], Any],
    *,
    required_keys: tuple[str, ...] = (),
    warn: Callable[[str], None] | None = None,
) -> Found | None:
    """Newest intact checkpoint in `directory` with `required_keys`; None if there is none.

    A file that is truncated or corrupted (header/length/SHA-256 check), cannot be opened, is not a dict,
    lacks a required key or whose stored epoch disagrees with its name is skipped with a warning (via `warn`,
    default `warnings.warn`) and the next older one is tried. An intact file that `read` fails on raises:
    that is a code or version mismatch, not damage, and silently restarting from scratch would hide it.
    """
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=3))
    for _, path in reversed(list_checkpoints(directory)):
        epoch, step = parse_name(path.name) or (0, 0)
        try:
            state = load(path, read)
            _validate(state, epoch, step, required_keys)
        except (OSError, CheckpointInvalid) as e:
            warn(f"skipping checkpoint {path}: {e}")
            continue
        return Found(path=path, epoch=epoch, state=state, step=step)
    return None


def _validate(state: Any, epoch: int, step: int, required_keys: tuple[str, ...]) -> None:
    if not isinstance(state, dict):
        raise CheckpointInvalid(f"expected a dict, got {type(state).__name__}")
    missing = [k for k in (*required_keys, "epoch") if k not in state]
    if missing:
        raise CheckpointInvalid(f"missing key(s) {', '.join(missing)}")
    if state["epoch"] != epoch:
        raise CheckpointInvalid(f"file name says epoch {epoch}, content says {state['epoch']!r}")
    if state.get("step", 0) != step:  # checkpoints written before steps existed have no "step": an epoch's end
        raise CheckpointInvalid(f"file name says step {step}, content says {state.get('step')!r}")
