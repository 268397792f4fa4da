"""`python -m hvdtrain.rank_main SCRIPT [ARGS...]`: run SCRIPT as `python SCRIPT ARGS...` would, and note the
exception that ends it for the rank's record (hvdtrain.records). The supervisor (hvdtrain.rank) starts it.

The script gets what `python SCRIPT` gives it: `sys.argv` is [SCRIPT, *ARGS], `sys.path[0]` is the script's folder,
and it runs as the module `__main__` (absolute `__file__`, no `__spec__`), which stays `sys.modules["__main__"]` to
the end, for atexit handlers, threads and multiprocessing's spawn children alike. A script that cannot be opened
exits 2 with Python's message; an uncaught exception prints its traceback through `sys.excepthook` (without this
module's frame) and exits 1; KeyboardInterrupt and SystemExit keep Python's own handling (a rank stopped by SIGINT
still dies by SIGINT). Only the standard library is imported.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import signal
import sys
import types
from pathlib import Path

from hvdtrain import records

USAGE = "usage: python -m hvdtrain.rank_main SCRIPT [ARGS...]"


def _load(path: str) -> types.CodeType:
    """The script compiled as `python` compiles it (its encoding declaration honoured); exit 2 if unreadable."""
    try:
        with io.open_code(path) as f:
            source = f.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        sys.exit(2)
    return compile(source, path, "exec", dont_inherit=True)


def _user_frames(exc: BaseException, script: str) -> types.TracebackType | None:
    """The traceback from the script's first frame on (this module's frame dropped)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    return tb or exc.__traceback__


def main(argv: list[str]) -> None:
    if not argv:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    script = os.path.abspath(argv[0])
    code = _load(script)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(script)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=script, __builtins__=builtins, __spec__=None, __cached__=None,
                           __loader__=importlib.machinery.SourceFileLoader("__main__", script))
    sys.modules["__main__"] = module  # for good: the script's objects live in it until the process ends
    where, pid = records.directory(), os.getpid()
    try:
        exec(code, module.__dict__)
    except SystemExit as exc:
        if exc.code not in (0, None) and os.getpid() == pid:
            _note(exc, where, exc.code if isinstance(exc.code, int) else 1, replace=False)
        raise
    except KeyboardInterrupt as exc:
        if os.getpid() == pid:
            _note(exc, where, -signal.SIGINT)
        raise
    except BaseException as exc:  # the script's own exception (GeneratorExit too), reported as Python would
        if os.getpid() == pid:  # not in a child the script fork()ed: its supervisor records only this process
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
