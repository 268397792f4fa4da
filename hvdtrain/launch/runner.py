"""Run a LaunchPlan: start horovodrun (argv list, new session), stream rank-prefixed output, per-rank log files,
forward SIGINT/SIGTERM/SIGHUP, turn SIGUSR1 into a request that the ranks checkpoint and stop (exit 75), leave no
process behind (also when hvdtrain itself is killed), and exit with the job's exit code. What this machine must
have before a job starts (Horovod, horovodrun, a free run directory) is checked first, by preflight.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from hvdtrain import exitcodes, records
from hvdtrain.job.model import Logs, Ssh
from hvdtrain.job.plan import LaunchPlan
from hvdtrain.launch.console import OutputRouter, pump
from hvdtrain.launch.failures import FailureTracker
from hvdtrain.launch.lifeline import DONE, die_with_parent, group_alive
from hvdtrain.launch.preflight import LaunchError
from hvdtrain.launch.stops import STOP_REASONS, StopRequests
from hvdtrain.launch.verdict import doctor_argv, exit_code, find_lost_hosts

GRACE_S = 20.0  # horovodrun gives ranks 5 s after SIGTERM, a rank's shell 5 s more to end, then 5 s before SIGKILL
POLL_S = 0.5
GUARD_MODULE = "hvdtrain.launch.lifeline"  # `python -m hvdtrain.launch.lifeline PGID`: see NOTE [no orphans]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each stops the whole job; exit 128 + N
RECORDS_TMP = "hvdtrain-records-"  # the ranks' records without logs.dir: a temporary directory
SWEEP_POLL_S = 0.05  # how often the sweep looks whether horovodrun's group has stopped
SRUN_ABORT_S = 10.0  # after SIGTERM, how long srun may take to kill its step through Slurm before SIGKILL
SNAPSHOT_S = 2.0  # a process-tree walk costs CPU that the ranks need: not every poll


# NOTE [job shutdown]: how a job ends without orphans.
#  - horovodrun runs in a new session, so its process group is ours to signal. Its rank launchers do not stay in
#    that group: Horovod's safe_shell_exec middlemen call setsid(), and mpirun runs under one of them. We therefore
#    (a) snapshot every descendant of horovodrun every SNAPSHOT_S, so that we know them even after they re-parent,
#    and (b) rely first on horovodrun's own teardown: on SIGINT/SIGTERM it tells each middleman to terminate its
#    children (5 s grace, then SIGKILL); if horovodrun dies, each middleman sees its pipe close and does the same.
#  - If hvdtrain itself dies (SIGKILL included), the job ends too: see NOTE [no orphans] in hvdtrain/rank.py
#    (horovodrun's PR_SET_PDEATHSIG, the guard process of hvdtrain.launch.lifeline, the ranks' supervisors).
#  - The signal handlers are installed before horovodrun starts: a signal that comes first means nothing is started.
#    A handler only records the signal, forwards it to horovodrun's group and then writes why for the ranks (the
#    stop file, below); the main loop does the rest (and
#    prints what is happening: NOTE [console] in hvdtrain/launch/console.py). SIGHUP (the terminal closed) is
#    forwarded as SIGTERM (horovodrun has no SIGHUP handler) and exits 129.
#  - SIGUSR1 (Slurm's warning before the time limit: `#SBATCH --signal=B:USR1@N` from `hvdtrain render slurm`) is
#    not forwarded and does not stop the job: `stops.StopRequests` (installed first thing by `hvdtrain run`, so that
#    SIGUSR1 never kills it, and again with the handlers above) creates records.STOP_FILE in the job's records
#    directory; the ranks see it, agree, checkpoint at their next step boundary and exit 75 (hvdtrain/train), and
#    `verdict.exit_code` calls that ending "preempted" (FailureTracker.preempted) and exits 75 (--requeue then requeues
#    the Slurm job: cmd_run.requeue_slurm_job). Repeating it changes nothing; a rank that ignores it just goes on.
#    With `--launcher srun` the same: Slurm's `B:` signal reaches the batch shell (hvdtrain) only, not the step.
#    The file is removed when the next run prepares the same records directory. A stop signal writes it too, once,
#    with why (`StopRequests.stopping`), right after it was forwarded: under horovodrun the ranks' stop line (printed
#    after their checkpoint) then names it, not the SIGTERM horovodrun hands them.
#  - After a forwarded signal we wait GRACE_S; a second signal, or the grace running out, SIGKILLs the group and
#    every descendant in the snapshot (psutil checks create times, so a recycled pid is never hit).
#  - However horovodrun ends, `_Job.sweep` terminates snapshot members still alive, and the output reader thread is
#    joined with a timeout (a straggler holding the pipe is killed by the sweep first). After a forwarded signal the
#    sweep first lets the rest of the grace run: mpirun takes a second signal as "exit at once, clean nothing up".
# NOTE [srun signals]: with `--launcher srun` the ranks are slurmstepd's children on every node, not srun's: they
# are in no process group or snapshot of ours, and only Slurm reaches them. srun (started with --disable-status)
# forwards SIGINT to the step, and slurmstepd signals every process of it, each rank included (its supervisor
# passes nothing on: HVDTRAIN_SLURM_SIGNALS, hvdtrain/rank.py): a stop signal of any kind is forwarded to srun as
# SIGINT, so the ranks stop as they would under horovodrun. srun takes SIGTERM
# as "kill the step" (a SIGKILL of every task, through slurmctld): that is the escalation when the grace runs out,
# and what the guard does if hvdtrain dies. Only if srun itself outlives SRUN_ABORT_S after that is it SIGKILLed;
# Slurm then ends the step when the job ends (scancel, or the batch script's exit).
class _Job:
    def __init__(self, router: OutputRouter, stops: StopRequests) -> None:
        self.router = router
        self.stops = stops
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.signals: list[int] = []  # every stop signal received, in order
        self.told = 0  # how many of them the console has been told about
        self.kill_at: float | None = None
        self.next_snapshot = time.monotonic() + POLL_S
        self.guard: subprocess.Popen[bytes] | None = None
        self.launcher = "horovodrun"
        self.srun_aborted = False  # SIGTERM sent to srun: it SIGKILLs the step's tasks through Slurm

    @property
    def signum(self) -> int | None:
        return self.signals[-1] if self.signals else None

    @property
    def pid(self) -> int:
        """horovodrun's pid, also its process group's id (only asked for once start() has set self.proc)."""
        if self.proc is None:
            raise RuntimeError("hvdtrain: the job's process is asked for before it was started")
        return self.proc.pid

    def start(self, plan: LaunchPlan, records_env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.launcher = plan.launcher
        try:
            proc = subprocess.Popen(plan.argv, env={**os.environ, **plan.env, **records_env}, cwd=plan.cwd,
                                    stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=die_with_parent(signal.SIGTERM))
        except OSError as exc:
            raise LaunchError(f"cannot start {plan.argv[0]}: {exc.strerror or exc}") from None
        # A handler that ran before `self.proc` was set could not forward its signal: do it here, with the signals
        # blocked so that a handler cannot forward the same signal twice (no other thread exists yet to take them:
        # the output reader starts after this).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.proc = proc
            if self.signals:
                self._forward(self.signals[-1])
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        self._start_guard()
        return proc

    def _start_guard(self) -> None:
        """The watcher that stops horovodrun's group if this process dies (hvdtrain.launch.lifeline.guard)."""
        try:
            self.guard = subprocess.Popen([sys.executable, "-m", GUARD_MODULE, str(self.pid)],
                                          stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            self.kill_all()
            raise LaunchError(f"cannot start the job's guard process: {exc.strerror or exc}") from None

    def release_guard(self) -> None:
        """The job ended under our supervision: tell the guard to stand down."""
        if self.guard is None:
            return
        assert self.guard.stdin is not None  # started with stdin=PIPE
        with contextlib.suppress(OSError):
            self.guard.stdin.write(DONE)
            self.guard.stdin.close()
        try:
            self.guard.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.guard.kill()
            self.guard.wait(timeout=5)

    def maybe_snapshot(self) -> None:
        if time.monotonic() >= self.next_snapshot:
            self.next_snapshot = time.monotonic() + SNAPSHOT_S
            self.snapshot()

    def snapshot(self) -> None:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)

    def on_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)
        self.router.launcher.stopping = True
        if self.proc is not None:
            self._forward(signum)
        self.stops.stopping(STOP_REASONS.get(signal.Signals(signum), signal.Signals(signum).name))  # after: it is I/O
        self.kill_at = time.monotonic() + GRACE_S if len(self.signals) == 1 else time.monotonic()

    def _forward(self, signum: int) -> None:
        if self.launcher == "srun":  # NOTE [srun signals]
            signum = signal.SIGINT
        elif signum == signal.SIGHUP:  # horovodrun has no SIGHUP handler
            signum = signal.SIGTERM
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def tell(self, timed_out: bool, timeout_s: float | None, upto: int | None = None) -> None:
        """Say on the console what the signals received so far (the first `upto`) do, once each."""
        for signum in self.signals[self.told:upto]:
            self.told += 1
            name = signal.Signals(signum).name
            if self.told > 1:
                self.router.note(f"hvdtrain: {name} again: killing every rank now")
            elif timed_out:
                self.router.note(f"hvdtrain: --timeout {timeout_s:g} s reached: stopping every rank")
            else:
                again = " (Ctrl-C again to kill them at once)" if signum == signal.SIGINT else ""
                self.router.note(f"hvdtrain: {name} received: stopping every rank{again}")

    def kill_all(self) -> None:
        if self.launcher == "srun" and not self.srun_aborted:  # NOTE [srun signals]: srun kills the step itself
            self.srun_aborted, self.kill_at = True, time.monotonic() + SRUN_ABORT_S
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGTERM)
            return
        self.snapshot()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()

    def sweep(self) -> None:
        alive = [p for p in self.seen.values() if _alive(p)]
        # After a forwarded stop signal, what is left in horovodrun's group is already stopping (MPI: the leader
        # `sh -c mpirun` dies at once while mpirun stops its ranks): it keeps the rest of the grace. A signal now
        # would cut mpirun's teardown short: a second SIGTERM within 5 s of the first makes it exit at once, as
        # SIGKILL does, and its PMIx server then never runs the cleanup each rank registered (the unlink of the
        # rank's /dev/shm/vader_segment.* file). Members outside the group are not waited for; a signal received
        # meanwhile ends the wait, and a second one (NOTE [console]: "killing every rank now") kills at once.
        deadline, settled = self.kill_at, len(self.signals)
        while (deadline is not None and len(self.signals) == settled and time.monotonic() < deadline
               and group_alive(self.pid)):
            time.sleep(SWEEP_POLL_S)
        if len(self.signals) > settled:
            self.kill_all()
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, still = psutil.wait_procs(alive, timeout=5)
        for p in still:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(still, timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # anything left in horovodrun's own group


def _alive(p: psutil.Process) -> bool:
    """Running and not a zombie (an exited orphan that init has not reaped yet is gone for our purposes)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_plan(plan: LaunchPlan, logs: Logs, *, timeout_s: float | None = None, ssh: Ssh | None = None,
             stops: StopRequests | None = None) -> int:
    """Run the plan to completion (see NOTE [job shutdown]); returns the exit code hvdtrain should exit with.

    `ssh`: how to reach the hosts, to find which one was lost when a rank timed out waiting for a peer. `stops`:
    the SIGUSR1 handler `hvdtrain run` installed first thing (default: a new one, installed here).
    """
    if threading.current_thread() is not threading.main_thread():
        # Signal handlers can only be installed there, and PR_SET_PDEATHSIG fires when the starting thread ends.
        raise LaunchError("run_plan must be called from the main thread")
    if logs.dir:
        try:
            Path(logs.dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LaunchError(f"cannot create logs.dir {logs.dir}: {exc.strerror or exc}") from None
    with _records_dir(logs.dir) as where:
        router = OutputRouter(logs, sys.stdout, sys.stderr, FailureTracker(plan.rank_hosts, elastic=plan.elastic),
                              srun_labels=plan.launcher == "srun")
        job = _Job(router, stops or StopRequests())
        old = {s: signal.signal(s, job.on_signal) for s in STOP_SIGNALS}
        old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, job.stops.on_signal)
        job.stops.attach(where)
        try:
            return _supervise(plan, job, timeout_s, ssh or Ssh(), where)
        finally:
            job.stops.attach(None)
            router.close()
            for s, handler in old.items():
                signal.signal(s, handler)


@contextlib.contextmanager
def _records_dir(logs_dir: str | None) -> Iterator[Path]:
    """Where the ranks write their records (hvdtrain.records): `<logs.dir>/records`, emptied of an earlier run's,
    or a temporary directory, flock()ed while the job runs and removed when it has ended; one a SIGKILLed launcher
    left (no lock held on it, whatever pid namespace its launcher ran in) is removed by the next launcher."""
    if logs_dir:
        where = Path(logs_dir) / "records"
        try:
            where.mkdir(exist_ok=True)
            for old in [*where.glob("rank.*.json"), *where.glob("exception.*.json"), where / records.STOP_FILE]:
                old.unlink(missing_ok=True)
        except OSError as exc:
            raise LaunchError(f"cannot prepare {where} for the ranks' records: {exc.strerror or exc}") from None
        yield where
        return
    for old in Path(tempfile.gettempdir()).glob(f"{RECORDS_TMP}*"):
        with contextlib.suppress(OSError), open(old / ".lock", "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: a live launcher holds it
            shutil.rmtree(old, ignore_errors=True)
    where = Path(tempfile.mkdtemp(prefix=RECORDS_TMP))
    try:
        with open(where / ".lock", "wb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _supervise(plan: LaunchPlan, job: _Job, timeout_s: float | None, ssh: Ssh, where: Path) -> int:
    router = job.router
    if job.signum is not None:
        router.note(f"hvdtrain: {signal.Signals(job.signum).name} received before the job started; nothing was "
                    "started")
        return exitcodes.SIGNALLED + job.signum
    router.line(f"hvdtrain: starting {shlex.join(plan.argv)}")
    # The ranks' time to their first step counts from this hvdtrain's start (hvdtrain.train.startup).
    launched = {records.LAUNCHED_ENV: f"{records.launcher_started():.3f}"}
    proc = job.start(plan, {records.ENV: str(where), **launched})
    reader = threading.Thread(target=pump, args=(proc.stdout, router), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s if timeout_s else None
    timed_out = False
    try:
        while proc.poll() is None:
            job.maybe_snapshot()
            if deadline and time.monotonic() > deadline and job.signum is None:
                timed_out = True
                job.stops.reason = job.stops.reason or f"hvdtrain run's --timeout {timeout_s:g} s"
                job.on_signal(signal.SIGTERM, None)
            job.tell(timed_out, timeout_s)
            job.stops.tell(router)
            router.tick()
            if job.kill_at is not None and time.monotonic() >= job.kill_at:
                job.kill_all()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=POLL_S)
    finally:
        # The job has ended: a signal from now on (during the cleanup below) neither changes its verdict nor is
        # announced as stopping it.
        stopped_by, settled, asked = job.signum, len(job.signals), job.stops.received
        job.sweep()
        job.release_guard()
        reader.join(timeout=10)
        router.failures.records = records.read_records(where)
    job.tell(timed_out, timeout_s, upto=settled)
    job.stops.tell(router, upto=asked)
    if proc.returncode != 0 and router.failures.peer_timed_out and stopped_by is None:
        find_lost_hosts(router.failures, plan, ssh)
    return exit_code(proc.returncode, router, stopped_by, timed_out, doctor_argv(plan, ssh))
