"""Stop requests: a rank asked to stop checkpoints at the next step boundary and exits with exitcodes.PREEMPTED (75),
so that the same command run again (a requeued Slurm job, a rescheduled pod) resumes from that step.

Framework-neutral and Horovod-free: the recipes pass in the collective (`StopVote(request, start, finish)`), write
the checkpoint and exit; this module decides *when*.

NOTE [stop requests]
- Where a request comes from: SIGUSR1 to a rank (`kill -USR1 PID`; with `--launcher srun`, `scancel
  --signal=USR1 JOB` or a `--signal=USR1@T` without `B:` reach every process of the step: the loader's producers
  ignore SIGUSR1); SIGTERM to a rank alone (`kill PID`; Kubernetes signals a container's main process); or
  `hvdtrain run` given SIGUSR1 (the `#SBATCH --signal=B:USR1@T` that `hvdtrain render slurm` writes: the batch
  shell is `hvdtrain run`), which creates `records.STOP_FILE` in the job's records directory; each rank looks for
  that file at most once per POLL_S. A SIGTERM to every process of a job (`scancel`, a time limit reached) stops
  it as before: the producers die with it. A stop signal to `hvdtrain run` (Ctrl-C, SIGTERM, its --timeout) writes
  the same file, saying why, right after it passed the signal on: under horovodrun the ranks get its SIGTERM, and
  rank 0's stop line, printed after the checkpoint, names what asked (`stop_line`), not the SIGTERM it was handed.
- One rank hearing it is enough, and every rank stops after the same step: at a vote every rank starts an
  asynchronous allreduce (max) of its 0/1 flag and reads the previous vote's result, which is the same on every
  rank. So all of them leave the loop at the same boundary, at the vote after the one that carried the first
  rank's flag; the allreduce rides along with the steps in between and reading it waits for nothing else.
- How often: a vote is one more collective, so the ranks vote about every VOTE_EVERY_S (0.25 s), not every step.
  Each vote also carries each rank's proposed interval (the steps that fit in 0.25 s at its pace since its last
  vote, at most MAX_VOTE_INTERVAL); the maximum, read at the following vote, is the interval from then on: every
  rank gets the same one, so every rank votes, and stops, at the same step. Every step when steps take longer than
  0.25 s. A stop comes within about two intervals and a step at a steady pace (~0.5 s); a step pace that slows
  after the interval was agreed stretches that to at most 2 x MAX_VOTE_INTERVAL steps. An epoch's first step
  always votes.
- After an epoch's validation and checkpoint one more (blocking) vote stops a request heard during validation right
  there.
- The Python handlers only set a flag; what a stop writes and prints happens in the training loop, at the
  boundary. A Python handler runs only when the main thread comes back to the interpreter, not while it waits in
  a Horovod collective (C++), so SIGTERM's deadline is kept by a watcher thread that reads the signal numbers
  Python's C-level handler writes to `signal.set_wakeup_fd`: it runs whatever the main thread is blocked in.
- SIGTERM comes with a deadline: after `sigterm_grace_s` (--sigterm-grace) the rank dies by SIGTERM, as it would
  have with no handler, and a second SIGTERM kills it at once; once the stop's checkpoint is written the deadline
  is off (`disarm`). That keeps a job's teardown what it was: when a rank fails, horovodrun (and mpirun) SIGTERM
  the others; they meet the lost rank in their next collective (HorovodInternalError) and `entry.exit_with` ends
  them by SIGTERM too (`died_of_sigterm`), so the launcher still names the failed rank as the cause and these as
  its victims. The default grace (4 s) is below horovodrun's 5 s
  before SIGKILL; on Kubernetes raise it for long steps, under `kubernetes.termination_grace_s` less 10 s (the
  pod's terminationGracePeriodSeconds, less the entrypoint's margin; `hvdtrain render k8s` checks it).
- What the checkpoint must hold for the resumed run to end with the same weights as an uninterrupted one: the
  loader's position (its batches consumed, the prefetcher's look-ahead given back), and each rank's own state that
  no collective has made equal yet (its RNG, its BatchNorm running statistics, its local metric sums): see
  hvdtrain/train/torchkit.py `rank_state`. The Keras recipe: NOTE [Keras stops mid-epoch] in kerasstop.py.
- The elastic recipe votes at its commits instead (the commit's allreduce of the metric sums carries each rank's
  flag), and once more after each epoch's checkpoint (one small allreduce an epoch), so it stops within
  --commit-every steps, with what a commit holds; it handles SIGUSR1 only (`signals`): SIGTERM to an elastic rank
  keeps its meaning, that rank goes and the others carry on.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from hvdtrain import exitcodes, records

POLL_S = 0.5  # how often a rank looks for the launcher's stop file
SIGTERM_GRACE_S = 4.0  # the default --sigterm-grace: under horovodrun's 5 s between its SIGTERM and SIGKILL
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
VOTE_EVERY_S = 0.25  # the ranks vote on a stop about this often (every step when a step takes longer)
MAX_VOTE_INTERVAL = 50  # steps: a slowdown after the interval was agreed delays a stop by at most 2 x 50 steps

_active: StopRequest | None = None  # the installed request, for entry.exit_with (died_of_sigterm)


def die_by(signum: int) -> None:
    """End this process by `signum`'s default action (its exit status says so, as if no handler had been set)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # the watcher thread (SIGTERM's deadline): Python's signal.signal() is main-thread only, libc's is not
        ctypes.CDLL(None).signal(signum, ctypes.c_void_p(0))  # 0: SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(5)  # the signal is delivered at once; this only keeps a thread from going on meanwhile
    os._exit(128 + signum)


class StopRequest:
    """Whether this rank was asked to stop: a signal it received, or the launcher's stop file (NOTE [stop requests])."""

    def __init__(self, records_dir: Path | None = None, *, sigterm_grace_s: float = SIGTERM_GRACE_S,
                 poll_s: float = POLL_S, signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        if not sigterm_grace_s >= 0:
            raise ValueError(f"sigterm_grace_s must be >= 0, got {sigterm_grace_s!r}")
        if not set(signals) <= set(SIGNALS):
            raise ValueError(f"signals must be among {[s.name for s in SIGNALS]}, got {signals!r}")
        self.records_dir, self.signals = records_dir, signals
        self.sigterm_grace_s, self.poll_s = sigterm_grace_s, poll_s
        self.reason: str | None = None  # what asked: "SIGUSR1", "SIGTERM" or the stop file's reason
        self.sigterm = False
        self.armed = True  # the SIGTERM deadline may end the process (off once the stop's checkpoint is written)
        self._next_poll = 0.0
        self._previous: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1

    def install(self) -> StopRequest:
        """Handle `signals` (SIGUSR1 and SIGTERM) from now on (main thread only; elsewhere only the stop file is
        seen)."""
        global _active
        if threading.current_thread() is not threading.main_thread():
            return self
        self._pipe = os.pipe()
        os.set_blocking(self._pipe[1], False)  # the C handler's write must never block
        self._previous = {s: signal.signal(s, self._on_signal) for s in self.signals}
        self._previous_fd = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(self._pipe[0],), name="hvdtrain-stop-watch", daemon=True).start()
        _active = self
        return self

    def disarm(self) -> None:
        """The stop's checkpoint is written: SIGTERM's deadline no longer ends the process (a second SIGTERM does)."""
        self.armed = False

    def uninstall(self) -> None:
        """Restore the previous handlers and wakeup fd; the watcher ends."""
        global _active
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._pipe[1])  # the watcher reads EOF and ends; it closes its end
            self._pipe = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        self.armed = False
        if _active is self:
            _active = None

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.reason is None:
            self.reason = signal.Signals(signum).name

    def _watch(self, fd: int) -> None:
        """The watcher thread: every signal's number arrives here; SIGTERM starts the deadline, a second one ends the
        process now."""
        deadline: float | None = None
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not select.select([fd], [], [], wait)[0]:  # the deadline passed
                    if self.armed:
                        die_by(signal.SIGTERM)
                    deadline = None
                    continue
                data = os.read(fd, 64)
                if not data:
                    return  # uninstalled
                for signum in data:
                    if signum == signal.SIGTERM:
                        if self.sigterm:
                            die_by(signal.SIGTERM)
                        self.sigterm = True
                        self.reason = self.reason or "SIGTERM"
                        deadline = time.monotonic() + self.sigterm_grace_s
        finally:
            os.close(fd)

    def heard(self) -> bool:
        """Asked to stop: by a signal, or by the stop file (looked for at most every `poll_s`)."""
        if self.reason is None and self.records_dir is not None and time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + self.poll_s
            self.reason = records.stop_reason(self.records_dir)
        return self.reason is not None


def stop_line(request: StopRequest, path: str) -> str:
    """Rank 0's last words after a stop: what asked, the checkpoint, how to resume. A SIGTERM that horovodrun sent
    because `hvdtrain run` was stopped (Ctrl-C) is told as that: the launcher's stop file says why."""
    launcher = records.stop_reason(request.records_dir)
    if launcher and request.reason in (None, "SIGTERM", launcher):
        heard = f"asked to stop ({launcher})"
    else:
        heard = f"asked to stop ({request.reason} here)" if request.reason else "asked to stop (on another rank)"
    return (f"{heard}: checkpoint {path}; run the same command again to resume from it "
            f"(exit {exitcodes.PREEMPTED})")


def died_of_sigterm() -> bool:
    """True when the installed request heard SIGTERM: a rank failing after it should die by SIGTERM (exit_with)."""
    return _active is not None and _active.sigterm


class StopVote:
    """The ranks' agreement on where to stop (NOTE [stop requests]). `start(values)` starts an allreduce (max) of a
    list of ints on every rank and returns its handle; `finish(handle)` waits for it and returns the maxima. A vote
    carries [this rank heard a request, the steps this rank proposes until the next vote]; `clock` times the steps."""

    def __init__(self, request: StopRequest, start: Callable[[list[int]], Any], finish: Callable[[Any], list[int]],
                 *, every_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        every_s = VOTE_EVERY_S if every_s is None else every_s  # read now: a test may set the module's value
        if not every_s >= 0:
            raise ValueError(f"every_s must be >= 0, got {every_s!r}")
        self.request, self._start, self._finish, self.every_s, self._clock = request, start, finish, every_s, clock
        self._pending: Any = None
        self.interval = 1  # steps from one vote to the next, as the last vote agreed (the same on every rank)
        self._countdown = 1  # steps until the next vote
        self._since: float | None = None  # the clock at the last vote (None: at the epoch's first)

    def after_step(self) -> bool:
        """Every rank, after every optimizer step: True when the ranks agreed to stop at this boundary."""
        self._countdown -= 1
        if self._countdown > 0:
            return False
        now, proposal = self._clock(), self.interval
        if self._since is not None and now > self._since:  # as many steps as fit in every_s at this pace
            proposal = max(1, min(MAX_VOTE_INTERVAL, int(self.every_s * self.interval / (now - self._since))))
        self._since = now
        if self._pending is not None:
            heard, agreed = self._finish(self._pending)
            self._pending = None
            if heard > 0:
                return True
            self.interval = max(1, min(MAX_VOTE_INTERVAL, agreed))
        self._pending = self._start([int(self.request.heard()), proposal])
        self._countdown = self.interval
        return False

    def drain(self) -> None:
        """At the end of an epoch's steps: finish the vote in flight (a request it carried is still heard, and
        `now` after the epoch's checkpoint acts on it); the next epoch votes at its first step."""
        if self._pending is not None:
            self._finish(self._pending)
            self._pending = None
        self._countdown, self._since = 1, None

    def now(self) -> bool:
        """A blocking vote (every rank, at the same point): True when any rank heard a request."""
        self.drain()
        return self._finish(self._start([int(self.request.heard()), self.interval]))[0] > 0
