"""`python -m hvdtrain.rank SCRIPT [ARGS...]`: how `hvdtrain run` starts each rank, so that no rank outlives its job.

It runs the script as its child, through `python -m hvdtrain.rank_main SCRIPT ARGS...` (the script sees what
`python SCRIPT ARGS...` would give it: same interpreter, argv, environment, stdio), stays beside it as a supervisor
(see NOTE [no orphans]), and when it ends writes the rank's record (hvdtrain.records: exit code or signal, and the
exception that ended the script) for the launcher.

NOTE [no orphans]
How every process of a job ends when the launcher ends, however it ends:
- `hvdtrain run` starts horovodrun in a process group of its own with PR_SET_PDEATHSIG=SIGTERM
  (lifeline.die_with_parent), then a guard (`python -m hvdtrain.launch.lifeline PGID`, in a session of its own so that
  the terminal's signals and a kill of the launcher's group miss it) holding a pipe from the launcher. When the
  launcher dies, however, the pipe closes and the guard SIGTERMs horovodrun's group, then SIGKILLs it after
  lifeline.GUARD_GRACE_S. That reaches what PDEATHSIG alone cannot: with MPI, horovodrun exec()s
  `sh -c mpirun ...`, and only the shell would get the death signal, not mpirun. On SIGTERM horovodrun runs its
  own teardown (Gloo: each middleman terminates its rank); mpirun stops its ranks and, as its ssh connections
  close, every remote orted stops its own. SIGHUP (the terminal closed) is handled by the launcher like SIGTERM.
- What that chain cannot reach: a Gloo rank on another host. horovodrun starts it as `ssh host '... python ...'`;
  when the ssh client dies, sshd closes the command's stdout/stderr pipes but sends no signal (there is no
  terminal), and a rank that prints nothing would train on, unsupervised, to the end. So this supervisor polls its
  stdout/stderr every WATCH_S: once their reader is gone (lifeline.output_gone: locally that is horovodrun, remotely
  sshd), it SIGTERMs the rank, and SIGKILLs it after GRACE_S.
- The rank has PR_SET_PDEATHSIG=SIGKILL: if the supervisor itself is SIGKILLed (mpirun's or Horovod's escalation),
  the rank dies with it. The rank's own children (e.g. ShmLoader's producers) end when the rank ends.
- Signals sent to the supervisor (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) are forwarded to the rank;
  the supervisor exits as the rank did (the same code, or the same signal), so horovodrun and mpirun report
  the rank's own exit status. Under srun (`hvdtrain run --launcher srun` sets HVDTRAIN_SLURM_SIGNALS=1) they are not:
  slurmstepd signals every process of the step itself, and a forwarded copy would reach the rank twice (a second
  KeyboardInterrupt inside the first one's handling).
Only the standard library (and hvdtrain's stdlib-only modules) is imported here: this runs before every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import NoReturn

from hvdtrain import records
from hvdtrain.launch.lifeline import die_with_parent, output_gone, watchable

WATCH_S = 0.5  # how often the supervisor looks at the rank and at its own stdout/stderr
GRACE_S = 5.0  # after SIGTERM, how long a rank of a lost job may take before SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
USAGE = "usage: python -m hvdtrain.rank SCRIPT [ARGS...]  (runs `python SCRIPT ARGS...` as one supervised rank)"
SLURM_SIGNALS_ENV = "HVDTRAIN_SLURM_SIGNALS"  # "1": Slurm signals the rank itself; see NOTE [no orphans]
MAIN_MODULE = "hvdtrain.rank_main"  # runs SCRIPT as `python SCRIPT` would and notes the exception that ends it


def supervise(child: subprocess.Popen[bytes], watched: tuple[int, ...]) -> int | None:
    """Wait for the rank; returns its returncode, or None when the job's output reader went away first."""
    while True:
        try:
            return child.wait(timeout=WATCH_S)
        except subprocess.TimeoutExpired:
            pass
        if output_gone(watched):
            return None


def end_orphan(child: subprocess.Popen[bytes]) -> int:
    """The job is gone: SIGTERM the rank, SIGKILL it after GRACE_S; its returncode."""
    child.terminate()
    try:
        return child.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait(timeout=GRACE_S)


def exit_like(returncode: int) -> NoReturn:
    """Exit with the rank's status: its code, or death by the same signal."""
    if returncode < 0:
        signum = -returncode
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught: no handler to reset
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(1)  # a signal whose default action is not to terminate: fall through to 128 + N
        sys.exit(128 + signum)
    sys.exit(returncode)


def main(argv: list[str]) -> NoReturn:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        sys.exit(2 if not argv else 0)
    watched = watchable()
    # Ignore forwarded signals until the handler knows the child: one arriving during the start is re-sent below.
    pending: list[int] = []
    for signum in FORWARDED:
        signal.signal(signum, lambda s, _f: pending.append(s))
    try:
        env = {k: v for k, v in os.environ.items() if k != SLURM_SIGNALS_ENV}  # for this supervisor only
        child = subprocess.Popen([sys.executable, "-m", MAIN_MODULE, *argv], env=env,
                                 preexec_fn=die_with_parent(signal.SIGKILL))
    except OSError as exc:
        print(f"hvdtrain.rank: cannot start {sys.executable} {argv[0]}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(127)

    slurm_signals = os.environ.get(SLURM_SIGNALS_ENV) == "1"

    def forward(signum: int, _frame: object) -> None:
        if child.returncode is None and not slurm_signals:
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    for early in pending:
        forward(early, None)
    returncode = supervise(child, watched)
    if returncode is None:
        returncode = end_orphan(child)
    records.write_record(records.directory(), child.pid, returncode)
    exit_like(returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
