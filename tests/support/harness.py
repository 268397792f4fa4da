"""Run real Horovod jobs from tests: bounded in time, output shown on failure, nothing left behind.

Every job is started in its own session (process group) so that a timeout or a failing test can kill the whole
tree — horovodrun, mpirun/orted and the ranks — with one `killpg`, never by matching command lines. What escapes
the group (Horovod setsid()s ranks and orteds into sessions of their own) still cannot escape the test: the pytest
process is a child subreaper (OrphanReaper), so every orphan re-parents to it, and tests/conftest.py checks after
each test that every process the test started is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import io
import os
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hvdtrain.data.shm import creator_pid

if TYPE_CHECKING:
    import psutil

BIN = Path(sys.executable).parent
HOROVODRUN = BIN / "horovodrun"  # plain horovodrun, as users call it on the recipes
# horovodrun's own code without its build probe (hvdtrain/launch/hvdrun.py), which imports TensorFlow: 3-5 s of
# every job on 2 cores. Jobs whose launcher is not the point run under it; the ones that show the recipes under
# plain horovodrun say `plain=True`.
HVDRUN = BIN / "hvdtrain-horovodrun"
REPO = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "hvdtrain_"  # hvdtrain names every segment hvdtrain_<creator pid>_<token>

# Session ids of every job started here; conftest checks that none has a live process at the end.
STARTED_SESSIONS: set[int] = set()
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
# How long a test's processes may take to end after its teardown before they count as leaked (the leak guard's own
# test shortens it: it runs a test session that leaks on purpose).
LEAK_GRACE_S = float(os.environ.get("HVDTRAIN_TEST_LEAK_GRACE_S", "10"))


@dataclass(frozen=True)
class JobResult:
    argv: list[str]
    returncode: int
    output: str

    def describe(self) -> str:
        return f"$ {' '.join(self.argv)}\nexit code {self.returncode}\n--- output ---\n{self.output}"


# Source for a rank's test wrapper (tests/support/recipes.py): `signal_at(rank)`
# before the recipe runs makes a stop request land at a known step.
SIGNAL_AT = r'''
def signal_at(rank):
    """HVDTRAIN_TEST_SIGNAL=RANK:STEP:SIGNAME: that rank sends itself that signal after its STEP-th optimizer step
    (counted over epochs), a stop request landing at a known point of the epoch (NOTE [stop requests])."""
    target, step, name = os.environ.get("HVDTRAIN_TEST_SIGNAL", "-1:0:SIGUSR1").split(":")
    from hvdtrain.train import preempt
    if int(target) < 0:
        return
    preempt.VOTE_EVERY_S = 0.0  # every rank votes at every step: the stop lands at a known step
    if int(target) != rank:
        return
    import signal
    original, count = preempt.StopVote.after_step, [0]

    def after_step(self):
        count[0] += 1
        if count[0] == int(step):
            os.kill(os.getpid(), getattr(signal, name))
        return original(self)
    preempt.StopVote.after_step = after_step
'''

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
    plain: bool = False,
) -> JobResult:
    """`horovodrun -np N -H localhost:N --gloo|--mpi python script args...` with a time limit: hvdtrain-horovodrun
    (HVDRUN), or plain horovodrun (`plain`)."""
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    argv = [str(HOROVODRUN if plain else HVDRUN), "-np", str(np), "-H", f"localhost:{np}", f"--{controller}",
            sys.executable, str(script), *args]
    return run_bounded(argv, timeout=timeout, env=env)


def expect_ok(result: JobResult) -> JobResult:
    """Fail the test, showing every rank's output, unless the job exited 0."""
    if result.returncode != 0:
        pytest.fail(f"job failed\n{result.describe()}", pytrace=False)
    return result


@dataclass(frozen=True)
class Killed:
    """What kill_launcher_when saw: the launcher's exit status and output, whether `ready` ever held, and every
    descendant of the launcher just before the signal (psutil handles: a recycled pid is never mistaken)."""

    returncode: int | None
    output: str
    ready: bool
    processes: list
    signalled_at: float  # time.monotonic() when the signal was sent
    cmdlines: list[str]  # of `processes`, taken with them


def _drain(fd: int, sink: list[bytes], stop: threading.Event) -> None:
    while not stop.is_set():
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's other side is gone
                return
            if not chunk:
                return
            sink.append(chunk)


def _as_from_a_terminal(controlling: bool) -> Callable[[], None]:
    """The launcher's start, as a user's shell gives it: SIGINT and SIGQUIT at their defaults (a test run started in
    the background by a shell without job control ignores both, and exec keeps an ignored signal: the launcher
    would never see the test's Ctrl-C), and with `controlling` the pseudo-terminal on stdin as its terminal."""
    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        if controlling:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    return setup


def kill_launcher_when(argv: Sequence[str], ready, signum: int, *, timeout: float, cwd: Path | None = None,
                       via_terminal: bool = False) -> Killed:
    """Start argv (`hvdtrain run ...`) in a new session; once `ready()` holds, snapshot its descendants and signal the
    launcher alone. `via_terminal`: the launcher runs on a pseudo-terminal as its controlling terminal, and SIGHUP
    comes from closing that terminal (as closing a terminal window does), not from kill()."""
    import psutil

    master, slave = os.openpty() if via_terminal else os.pipe()
    stdin = slave if via_terminal else subprocess.DEVNULL
    proc = subprocess.Popen(list(argv), stdin=stdin, stdout=slave, stderr=slave, cwd=cwd, start_new_session=True,
                            preexec_fn=_as_from_a_terminal(via_terminal))
    STARTED_SESSIONS.add(proc.pid)
    os.close(slave)
    sink: list[bytes] = []
    stop = threading.Event()
    reader = threading.Thread(target=_drain, args=(master, sink, stop), daemon=True)
    reader.start()
    deadline, is_ready = time.monotonic() + timeout, False
    while proc.poll() is None and time.monotonic() < deadline and not (is_ready := ready()):
        time.sleep(0.2)
    processes, cmdlines = [], []
    with contextlib.suppress(psutil.Error):
        processes = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in processes:
        with contextlib.suppress(psutil.Error):
            cmdlines.append(" ".join(p.cmdline()))
    signalled_at = time.monotonic()
    if via_terminal and signum == signal.SIGHUP:
        stop.set()
        reader.join(timeout=5)
        os.close(master)  # the terminal goes away: the kernel sends SIGHUP to the launcher
    else:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)
    try:
        code: int | None = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    if not stop.is_set():
        stop.set()
        reader.join(timeout=5)
        os.close(master)
    return Killed(code, b"".join(sink).decode(errors="replace"), is_ready, processes, signalled_at, cmdlines)


def wait_gone(processes: list, bound_s: float) -> list[str]:
    """Wait up to bound_s for every process to end; return those still alive (then SIGKILL them: no leak)."""
    import psutil

    deadline = time.monotonic() + bound_s

    def alive() -> list:
        left = []
        for p in processes:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
        return left

    while (left := alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = []
    for p in left:
        with contextlib.suppress(psutil.Error):
            described.append(f"{p.pid}: {' '.join(p.cmdline())}")
            p.kill()
    return described


def become_subreaper() -> None:
    """Make this process a child subreaper (Linux): a descendant whose parent dies re-parents to it, not to init.

    Horovod's middlemen setsid() the ranks and mpirun's orted: without this, a rank whose launcher died would be
    nobody's descendant here, out of reach of a session or process-tree check."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(errno)}")


def descendants() -> list[psutil.Process]:
    """Every descendant of this process (psutil handles: a recycled pid is never mistaken), zombies included."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def own_helpers() -> set[int]:
    """Pids of multiprocessing's resource tracker and forkserver of this process: started on first use (a test's
    in-process loader), they live until this process exits, in the tests as in any program."""
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    return {pid for pid in (getattr(tracker, "_pid", None), getattr(server, "_forkserver_pid", None)) if pid}


def reap(pid: int) -> None:
    """Collect the exit status of `pid`, a zombie child of this process (no-op if someone else already did)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def describe(p: psutil.Process) -> str:
    """`pid N (name), parent P: command line` of a psutil process, or what is left of it."""
    import psutil

    try:
        with p.oneshot():
            return f"pid {p.pid} ({p.name()}), parent {p.ppid()}: {' '.join(p.cmdline())}"
    except psutil.Error:
        return f"pid {p.pid} (gone)"


class OrphanReaper:
    """This process as a child subreaper, and a thread that reaps the orphans it adopts, as init would.

    Without the reaping, an adopted orphan that exits would stay a zombie here until the test ends, and a launcher
    waiting for it to be gone (psutil.wait_procs polls for the pid) would wait longer than it does outside the
    tests. Only processes once seen with another parent are reaped: a child this process started itself belongs
    to a Popen object, whose wait() must get the real exit status.
    """

    POLL_S = 0.2

    def __init__(self) -> None:
        self.me = os.getpid()
        self.adopted: set[tuple[int, float]] = set()  # (pid, create time) of descendants seen with another parent
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="orphan-reaper", daemon=True)

    def start(self) -> None:
        become_subreaper()
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopping.wait(self.POLL_S):
            self.reap_adopted()

    def reap_adopted(self) -> None:
        """One round: note who has another parent; reap those of them that died as children of this process."""
        import psutil

        with self.lock:
            present = set()
            for p in descendants():
                try:
                    with p.oneshot():
                        key, ppid, status = (p.pid, p.create_time()), p.ppid(), p.status()
                except psutil.Error:
                    continue
                present.add(key)
                if ppid != self.me:
                    self.adopted.add(key)
                elif status == psutil.STATUS_ZOMBIE and key in self.adopted:
                    reap(p.pid)
            self.adopted &= present  # a descendant never leaves the tree but by being reaped

    def outliving(self, before: set[psutil.Process]) -> list[psutil.Process]:
        """Descendants not in `before` and still running (not zombies, not this process's multiprocessing helpers).
        Zombies among them that are this process's children are reaped: the test that started them is over."""
        import psutil

        self.reap_adopted()
        helpers, left = own_helpers(), []
        for p in descendants():
            if p in before or p.pid in helpers:
                continue
            try:
                zombie, ppid = p.status() == psutil.STATUS_ZOMBIE, p.ppid()
            except psutil.Error:
                continue
            if not zombie:
                left.append(p)
            elif ppid == self.me:
                reap(p.pid)
        return left

    def leaked_since(self, before: set[psutil.Process], grace_s: float = LEAK_GRACE_S) -> list[str]:
        """Wait up to grace_s for every descendant not in `before` to end; describe those still running, and
        SIGKILL them (each by pid and create time, so a recycled pid is never hit) so nothing later inherits them."""
        import psutil

        deadline = time.monotonic() + grace_s
        while (left := self.outliving(before)) and time.monotonic() < deadline:
            time.sleep(0.1)
        described = [describe(p) for p in left]
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        deadline = time.monotonic() + 10
        while self.outliving(before) and time.monotonic() < deadline:
            time.sleep(0.1)
        return described


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


def route(lines: Sequence[str], logs, *, stopping: bool = False):
    """Feed lines to an OutputRouter as horovodrun's output would; (router, console stdout, console stderr)."""
    from hvdtrain.launch.console import OutputRouter

    out, err = io.StringIO(), io.StringIO()
    router = OutputRouter(logs, out, err)
    router.launcher.stopping = stopping
    for line in lines:
        router.line(line)
    router.close()
    return router, out.getvalue(), err.getvalue()
