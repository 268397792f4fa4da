"""Run real Horovod jobs from tests: bounded in time, output shown on failure, nothing left behind.

Every job is started in its own session (process group) so that a timeout or a failing test can kill the whole
tree — horovodrun, mpirun/orted and the ranks — with one `killpg`, never by matching command lines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from hvdtrain.data.shm import creator_pid

BIN = Path(sys.executable).parent
HOROVODRUN = BIN / "horovodrun"
REPO = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "hvdtrain_"  # hvdtrain names every segment hvdtrain_<creator pid>_<token>

# Session ids of every job started here; conftest checks that none has a live process at the end.
STARTED_SESSIONS: set[int] = set()


@dataclass(frozen=True)
class JobResult:
    argv: list[str]
    returncode: int
    output: str

    def describe(self) -> str:
        return f"$ {' '.join(self.argv)}\nexit code {self.returncode}\n--- output ---\n{self.output}"


def run_bounded(
    argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> JobResult:
    """Run argv in a new session; on timeout kill the whole process group and fail the test with its output."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,
    )
    STARTED_SESSIONS.add(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"timed out after {timeout:.0f} s: {' '.join(argv)}\n--- output ---\n{out}")
    finally:
        # A rank or orted can outlive horovodrun if the launcher dies first: sweep the group every time.
        kill_group(proc)
    return JobResult(list(argv), proc.returncode, out)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the job's group and every descendant: horovodrun's middlemen setsid() the ranks into sessions of
    their own, so the group alone misses them (the tree is walked before anything dies and is re-parented)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    kill_group(proc)
    for p in descendants:
        with contextlib.suppress(psutil.Error):
            p.kill()


def horovodrun(
    script: Path,
    *args: str,
    np: int = 2,
    controller: str = "gloo",
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> JobResult:
    """`horovodrun -np N -H localhost:N --gloo|--mpi python script args...` with a time limit."""
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    argv = [str(HOROVODRUN), "-np", str(np), "-H", f"localhost:{np}", f"--{controller}",
            sys.executable, str(script), *args]
    return run_bounded(argv, timeout=timeout, env=env)


def expect_ok(result: JobResult) -> JobResult:
    """Fail the test, showing every rank's output, unless the job exited 0."""
    if result.returncode != 0:
        pytest.fail(f"job failed\n{result.describe()}", pytrace=False)
    return result


def live_job_processes() -> list[str]:
    """Processes still alive in any session a test started (the whole tree, reparented or not)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.info["pid"]) in STARTED_SESSIONS:
                found.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'] or [])}")
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def leaked_segments(owner_pids: set[int]) -> list[str]:
    """hvdtrain shared-memory segments whose creator is dead, or is one of owner_pids (the test process)."""
    import psutil

    leaked = []
    for entry in SHM_DIR.glob(SHM_PREFIX + "*"):
        pid = creator_pid(entry.name)
        if pid is None:
            continue
        if pid in owner_pids or not psutil.pid_exists(pid):
            leaked.append(entry.name)
    return leaked
