"""Read the text files a user hands hvdtrain (job specs, hostfiles): UTF-8 or a clear error, never a traceback.

`NotText` is an `OSError`, so every place that already reports "cannot read FILE: why" reports an encoding
problem the same way; it carries the line and the fix (`fix`).
"""

from __future__ import annotations

import codecs
import errno
import shlex
from pathlib import Path

_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def _fix(encoding: str, name: str) -> str:
    return f"save it as UTF-8, e.g. iconv -f {encoding} -t UTF-8 {shlex.quote(name)} > {shlex.quote(name + '.utf8')}"


class NotText(OSError):
    """A file that is not UTF-8 text: another encoding (Latin-1, UTF-16) or binary. `line` is 1-based (0: unknown)."""

    def __init__(self, reason: str, line: int, fix: str) -> None:
        super().__init__(errno.EILSEQ, f"not UTF-8 text: {reason}")
        self.line, self.fix = line, fix


def _line_col(data: bytes, offset: int) -> tuple[int, int]:
    line_start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - line_start + 1


def fix_for(exc: OSError, otherwise: str) -> str:
    """What to do about a file that could not be read: NotText's fix, else `otherwise`."""
    return exc.fix if isinstance(exc, NotText) else otherwise


def decode(data: bytes, name: str = "FILE") -> str:
    """UTF-8 bytes -> text (a leading UTF-8 byte-order mark dropped); anything else raises NotText. `name`: the
    file, for the fix. Lines and columns count bytes."""
    for bom, encoding in _WIDE_BOMS:
        if data.startswith(bom):
            raise NotText(f"it is {encoding} text (it starts with a {encoding} byte-order mark)", 1,
                          _fix(encoding, name))
    nul = data.find(b"\0")
    if nul >= 0:
        line, col = _line_col(data, nul)
        raise NotText(f"a NUL byte at line {line}, column {col} (a binary file, or UTF-16 without a byte-order "
                      "mark?)", line, "use a text file; " + _fix("UTF-16LE", name) + " if it is UTF-16")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line, col = _line_col(data, exc.start)
        raise NotText(f"byte 0x{data[exc.start]:02X} at line {line}, column {col} is not UTF-8 (Latin-1 or "
                      "another encoding, or a binary file?)", line,
                      _fix("LATIN1", name) + " if it is Latin-1") from None


def read_text(path: str | Path) -> str:
    """The UTF-8 text of a file; OSError when it cannot be read, NotText (an OSError) when it is not UTF-8."""
    return decode(Path(path).read_bytes(), str(path))
