"""`python -m hvdtrain.rank_main SCRIPT [ARGS...]`: run SCRIPT as `python SCRIPT ARGS...` would, and note the
exception that ends it for the rank's record (hvdtrain.records). The supervisor (hvdtrain.rank) starts it.

The script sees what `python SCRIPT` gives it: `sys.argv` is [SCRIPT, *ARGS], `sys.path[0]` is the script's
folder, it runs as `__main__` with its `__file__` (runpy.run_path, the machinery `python SCRIPT` uses), and an
uncaught exception prints its traceback through `sys.excepthook` and exits 1. KeyboardInterrupt and SystemExit
keep Python's own handling (a rank stopped by SIGINT still dies by SIGINT). Only the standard library is imported.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from hvdtrain import records

USAGE = "usage: python -m hvdtrain.rank_main SCRIPT [ARGS...]"


def _user_frames(exc: BaseException, script: str):
    """The traceback from the script's first frame on (runpy's and this module's frames dropped)."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    return tb or exc.__traceback__


def main(argv: list[str]) -> None:
    if not argv:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    where = records.directory()
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            _note(exc, where, exc.code if isinstance(exc.code, int) else 1, replace=False)
        raise
    except KeyboardInterrupt as exc:
        _note(exc, where, -signal.SIGINT)
        raise
    except BaseException as exc:  # the script's own exception (GeneratorExit too), reported as Python would
        _note(exc, where, 1)
        exc.__traceback__ = _user_frames(exc, script)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)


def _note(exc: BaseException, where: Path | None, code: int, *, replace: bool = True) -> None:
    """The exception for the supervisor's record, and a provisional record with the exit status it is ending with
    (what is left if the job's teardown kills this process and its supervisor while it shuts down)."""
    records.note_exception(exc, where, replace=replace)
    records.write_record(where, os.getpid(), code, final=False)


if __name__ == "__main__":
    main(sys.argv[1:])
