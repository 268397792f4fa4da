"""Per-rank records of how each rank ended, written on the rank's host, read by the launcher.

`hvdtrain run` points every rank at a directory (`HVDTRAIN_RECORDS`, in the environment horovodrun forwards).
Each rank's supervisor (`hvdtrain.rank`) runs the script through `python -m hvdtrain.rank_main SCRIPT ARGS`, which
notes an exception that ends the script (type, message, traceback) in `exception.<host>.<local rank>.<pid>.json`
and writes a provisional record; when the rank has ended the supervisor writes the final
`rank.<host>.<local rank>.<pid>.json` with its identity, its exit code or signal, and that exception. The launcher
names the failing rank from these records (`hvdtrain.launch.failures`), and falls back to horovodrun's and
mpirun's report lines for a rank that left none (its supervisor was SIGKILLed before the rank noted anything,
its host was lost, or its records directory is not shared with the launcher's machine).

With `logs.dir` the directory is `<logs.dir>/records`, without a temporary one; the launcher creates it, and a
rank writes its records only where that directory exists (this machine, or a filesystem shared with it): nothing
is created on other hosts. Only the standard library is imported here: this runs in every rank.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

ENV = "HVDTRAIN_RECORDS"
LAUNCHED_ENV = "HVDTRAIN_LAUNCHED_AT"  # when `hvdtrain run` started (seconds since the epoch): the ranks' startup clock
STOP_FILE = "stop-requested"  # `hvdtrain run` creates it on SIGUSR1 or a stop signal: the recipes checkpoint and exit
STOP_USR1 = "SIGUSR1 to hvdtrain run"  # the stop file's reason when hvdtrain run was given SIGUSR1
TRACEBACK_CHARS = 8000  # the end of a long traceback is the part that names the error
_writes = itertools.count()  # request_stop's temporary files


@dataclass(frozen=True)
class RankRecord:
    """How one rank ended. `code` is its exit code, or None when `signum` killed it; `exception` is the type of the
    exception that ended the script (None: it exited on its own, e.g. sys.exit(2), or was killed)."""

    rank: int | None
    local_rank: int | None
    host: str
    pid: int
    code: int | None = None
    signum: int | None = None
    exception: str | None = None
    message: str | None = None
    traceback: str | None = None
    time: float = 0.0

    @property
    def failed(self) -> bool:
        return self.signum is not None or self.code not in (0, None)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "")
        if value.lstrip("-").isdigit():
            return int(value)
    return None


def identity(env: Mapping[str, str] = os.environ) -> tuple[int | None, int | None, str]:
    """(rank, local rank, host) as horovodrun (Gloo), mpirun (Open MPI) or srun told this process."""
    rank = _env_int(env, "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
    local = _env_int(env, "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
    return rank, local, env.get("HOROVOD_HOSTNAME") or socket.gethostname()


def directory(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where this rank writes its records, or None (not started by `hvdtrain run`, or the directory is not here)."""
    path = env.get(ENV)
    return Path(path) if path and os.path.isdir(path) else None


def launched_at(env: Mapping[str, str] = os.environ) -> float | None:
    """When the `hvdtrain run` that started this rank started (time.time()), or None (started some other way)."""
    try:
        value = float(env.get(LAUNCHED_ENV, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


EXEC_GAP_S = 2.0  # hvdtrain imported this long after its process started: the process ran something else first


def launcher_started() -> float:
    """When this `hvdtrain` began, for the ranks' first-step line: its process's start, unless hvdtrain was imported
    more than EXEC_GAP_S later, when a script ran in the process first and exec'd hvdtrain (scripts/quickstart.sh
    sets up for minutes, then `exec hvdtrain run`): then the import (Python's own start, tens of ms, not counted;
    an interpreter that takes over EXEC_GAP_S to import hvdtrain, e.g. from a cold network filesystem, has that
    time left out of the launcher's part too)."""
    import hvdtrain

    started = process_started()
    if started is None or hvdtrain.IMPORTED_AT - started > EXEC_GAP_S:
        return hvdtrain.IMPORTED_AT
    return started


def process_started(pid: int | None = None) -> float | None:
    """When process `pid` (default: this one) started, on time.time()'s clock: its start tick in /proc against
    CLOCK_BOOTTIME, exact to a clock tick (psutil's create_time() can be up to a second off: it adds whole-second
    boot time); None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ')'; field 3 comes next
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks since boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, IndexError, ValueError, AttributeError):  # no /proc, or no CLOCK_BOOTTIME (not Linux)
        return None


def request_stop(where: Path, reason: str = STOP_USR1) -> None:
    """Ask every rank that reads this records directory to checkpoint at its next step boundary and exit
    (exitcodes.PREEMPTED): what `hvdtrain run` does on SIGUSR1 (hvdtrain.train.preempt reads it), and on a stop
    signal, whose SIGTERM the ranks then get from horovodrun. `reason` (what asked, for the ranks' stop line) is
    the file's text, written whole (a rename) so that a rank never reads half of it."""
    temp = where / f".{STOP_FILE}.{os.getpid()}.{next(_writes)}"  # a nested signal handler writes its own
    try:
        temp.write_text(reason)
        os.replace(temp, where / STOP_FILE)
    finally:
        temp.unlink(missing_ok=True)


def stop_reason(where: Path | None) -> str | None:
    """What asked the ranks to stop (`request_stop`'s reason), or None when nothing did (or no records directory)."""
    if where is None:
        return None
    path = where / STOP_FILE
    try:
        return path.read_text() or "hvdtrain run"
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError):  # a passing error of a shared directory is no request: only the file is
        return "hvdtrain run" if os.path.lexists(path) else None


def stop_requested(where: Path | None) -> bool:
    """True once `request_stop(where)` was called (False without a records directory)."""
    return stop_reason(where) is not None


def _name(kind: str, pid: int, env: Mapping[str, str] = os.environ) -> str:
    """`<kind>.<host>.<local rank>.<pid>.json`: unique on a directory several hosts share (pids are per host)."""
    _, local, host = identity(env)
    return f"{kind}.{host}.{local}.{pid}.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (a reader never sees half a record); a record that cannot be written is not an error."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


def note_exception(exc: BaseException, where: Path | None, *, replace: bool = True) -> None:
    """In the rank's process: the exception that is ending the script, for the supervisor's record.
    `replace=False` keeps an exception noted earlier (the error a recipe reported before its sys.exit(2))."""
    if where is None:
        return
    path = where / _name("exception", os.getpid())
    if not replace and path.exists():
        return
    text = "".join(traceback.format_exception(exc))[-TRACEBACK_CHARS:]
    _write_json(path, {"exception": type(exc).__name__, "message": str(exc), "traceback": text})


def write_record(where: Path | None, pid: int, returncode: int, env: Mapping[str, str] = os.environ, *,
                 final: bool = True) -> None:
    """The record of the rank (process `pid`) that ended with `returncode` (-N: killed by signal N), with the
    exception it noted. The supervisor writes it once the rank has ended (`final`); the rank itself writes a
    provisional one as its script ends, which the supervisor's replaces: if the job's teardown SIGKILLs the rank
    and its supervisor while the rank is still shutting down, the provisional record is what is left. A rank
    killed by a signal after its provisional record named a non-zero exit code (the teardown of a job it brought
    down reached it while it was shutting down) keeps that code: it is the cause, not a victim of the teardown."""
    if where is None:
        return
    rank, local, host = identity(env)
    noted = where / _name("exception", pid, env)
    try:
        exc = json.loads(noted.read_text())
        if final:
            noted.unlink()
    except (OSError, ValueError):
        exc = {}
    path = where / _name("rank", pid, env)
    if final and returncode < 0 and (code := _provisional_code(path)):
        returncode = code  # it was already exiting with `code` when the job's teardown killed it
    record = RankRecord(rank, local, host, pid, code=returncode if returncode >= 0 else None,
                        signum=-returncode if returncode < 0 else None, exception=exc.get("exception"),
                        message=exc.get("message"), traceback=exc.get("traceback"), time=time.time())
    _write_json(path, asdict(record))


def _provisional_code(path: Path) -> int | None:
    """The non-zero exit code in the rank's own provisional record at `path`, if it wrote one."""
    try:
        code = json.loads(path.read_text()).get("code")
    except (OSError, ValueError, AttributeError):
        return None
    return code if isinstance(code, int) and code > 0 else None


def read_records(where: Path | str) -> list[RankRecord]:
    """Every rank record in `where`, oldest first; unreadable files are skipped."""
    records = []
    for path in Path(where).glob("rank.*.json"):
        try:
            records.append(RankRecord.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(records, key=lambda r: r.time)
