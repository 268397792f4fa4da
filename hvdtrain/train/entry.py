"""A recipe's entry point: `exit_with(main, __file__)` as the last line of the script."""

from __future__ import annotations

import io
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from hvdtrain import exitcodes, records
from hvdtrain.data.errors import DataError, LoaderError, WorkerError
from hvdtrain.rundir import RunDirBusy
from hvdtrain.stream.errors import StreamError
from hvdtrain.train import preempt
from hvdtrain.train.checkpoint import CheckpointMismatch
from hvdtrain.train.divergence import TrainingDiverged


def exit_with(main: Callable[[], int], script: str) -> NoReturn:
    """Exit with main()'s code. Errors every rank meets alike exit with one message and no traceback: bad data or a
    run directory another job holds (before any training): 2; training that diverged (NaN/Inf): 3. Bad data found
    by a loader's producer process (a streamed shard: unreadable, a label out of range, NaN/Inf) is bad data too; so
    is a checkpoint that does not fit the model (2). A rank that stops only because another one failed
    (HorovodInternalError) says so in one line and exits 1. A rank asked to stop that checkpointed exits 75
    (exitcodes.PREEMPTED); one that heard SIGTERM and then failed dies by SIGTERM (NOTE [stop requests],
    hvdtrain/train/preempt.py)."""
    whole_lines()
    try:
        code = _run(main, script)
    except BaseException as exc:
        if preempt.died_of_sigterm():  # a stop by SIGTERM that could not finish: a victim of the job's teardown
            # An error of its own is shown and recorded; a peer gone (HorovodInternalError) or its producers killed
            # by the same SIGTERM (a LoaderError: scancel signals every process of the job) are the teardown's.
            if isinstance(exc, Exception) and not isinstance(exc, LoaderError) \
                    and type(exc).__name__ != "HorovodInternalError":
                traceback.print_exc()
                records.note_exception(exc, records.directory())
            preempt.die_by(signal.SIGTERM)
        raise
    if code not in (0, exitcodes.PREEMPTED) and preempt.died_of_sigterm():
        preempt.die_by(signal.SIGTERM)
    sys.exit(code)


def _run(main: Callable[[], int], script: str) -> int:
    try:
        code = main()
    except WorkerError as e:
        if not e.bad_data:
            raise
        error_line(script, e.message)
        records.note_exception(StreamError(e.message), records.directory())  # the data's fault, not a traceback
        code = exitcodes.INVALID_INPUT
    except (DataError, RunDirBusy, TrainingDiverged, CheckpointMismatch) as e:
        error_line(script, str(e))
        records.note_exception(e, records.directory())  # the rank's record names this error, not SystemExit
        code = exitcodes.DIVERGED if isinstance(e, TrainingDiverged) else exitcodes.INVALID_INPUT
    except Exception as e:
        if type(e).__name__ != "HorovodInternalError":  # horovod.common.exceptions, not imported here
            raise
        # Another rank failed and Horovod shut down under this one: a victim (hvdtrain/launch/failures.py), whose
        # traceback would bury the cause; one line, and the record still names HorovodInternalError.
        error_line(script, f"stopped: Horovod shut down under this rank (HorovodInternalError), because another rank "
                           f"failed or left; its error is the cause ({str(e).split('. ')[0]})")
        records.note_exception(e, records.directory())
        code = 1
    return code


def whole_lines() -> None:
    """Each line of stdout and stderr in one write, as horovodrun's Gloo ranks get PYTHONUNBUFFERED=1: unbuffered,
    print() writes the text and the newline apart, and mpirun (or a terminal shared by the ranks) then shows another
    rank's chunk inside the line (`...step time[1,0]<stdout>:`). Line buffering without write-through keeps a line
    until its newline; progress bars flush themselves."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and (stream.write_through or not stream.line_buffering):
            stream.reconfigure(line_buffering=True, write_through=False)


def error_line(script: str, message: str) -> None:
    """`script: error: message` in one write. Unbuffered (PYTHONUNBUFFERED=1), print() writes the text and the
    newline apart, and mpirun tags each chunk it reads: another rank's line could land between the two."""
    sys.stderr.write(f"{Path(script).name}: error: {message}\n")
    sys.stderr.flush()
