"""A tqdm progress bar that also reads well in logs (horovodrun prefixes and pipes every rank's output)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")


class LogLines:
    """tqdm's output when stderr is a log, not a terminal: each refresh as one plain line, not a \\r-redraw."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.strip("\r\n\x1b[A ")
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(items: Iterable[T], total: int, desc: str, *, enabled: bool, log_every_s: float = 10.0) -> tqdm[T]:
    """On a terminal: a live bar. Otherwise: a plain line at most every `log_every_s` seconds, and nothing for a
    loop shorter than that. `enabled=False` (e.g. on every rank but 0) shows nothing."""
    if sys.stderr.isatty():
        return tqdm(items, total=total, desc=desc, unit="step", leave=False, disable=not enabled)
    return tqdm(items, total=total, desc=desc, unit="step", leave=False, disable=not enabled,
                file=LogLines(sys.stderr), mininterval=log_every_s, delay=log_every_s, ascii=True)
