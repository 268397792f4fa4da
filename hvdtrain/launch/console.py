"""What a job prints: horovodrun's merged output split into rank lines and launcher lines, echoed to the console
(rank-prefixed) and written to per-rank log files, with horovodrun's own Python tracebacks kept off the console.

NOTE [console]: the console shows the ranks' output, horovodrun's short status lines and hvdtrain's verdict; the
log files (logs.dir) get every line. What the console leaves out:
  - horovodrun's traceback when it reports the job ending the way hvdtrain's summary already says (a rank exited
    non-zero: `RuntimeError: Horovod detected that one or more processes exited ...`, MPI's `mpirun failed with
    exit code`, elastic's `Job has been shutdown`; its failed ssh check, `could not connect to some hosts via ssh`,
    after its lines naming each host and ssh's error: `launcher_account` says it), or when hvdtrain itself stopped
    the job (a KeyboardInterrupt
    after a forwarded SIGINT, and Python's `Exception ignored in ...` report then). Any other traceback is echoed
    whole: it is the only account of what went wrong. A SIGINT that lands while horovodrun spawns its per-rank
    middlemen interrupts each of them too, and their tracebacks reach the pipe interleaved mid-line (CI, 2026-12-02:
    a `Traceback` line indented, a line of only `^`, one traceback's frames after the other's KeyboardInterrupt):
    after a forwarded signal a traceback is held through such fragments, and the fragments that follow a hidden
    KeyboardInterrupt are hidden with it (`LauncherLines.feed`). A middleman interrupted while its interpreter
    starts may die before its exception line (local run, 2026-12-02: `Fatal Python error: init_import_site`, two
    tracebacks' frames interleaved, then `Process 1 exit with status code 1.`; CI, 2026-12-02: the other's
    `Traceback` line after `Fatal Python error: `, the rest, `init_import_site: ...`, on a line of its own, held as
    `FATAL_TAIL`): after a forwarded signal such a
    traceback, cut off by a rank's exit line or the end of the output, is hidden too. Such a traceback is held
    past the exit line (which is shown) until a line that is not a fragment, the end of the output, or CUT_WAIT_S
    without a stop (`OutputRouter.tick`, from the supervising loop) decides it: a Ctrl-C reaches the middlemen as
    it reaches hvdtrain, and their fragments can reach the reader thread before hvdtrain's handler has run (CI,
    2026-12-02, a reverse-order run: a fragment after `Process 0 exit with status code 1.` was shown). An
    interpreter's `Fatal Python error:` is held the same way, stop or no stop: only a signal makes a middleman die
    as it starts. Without a stop, such a traceback is shown within CUT_WAIT_S, and always before the verdict.
    Chained tracebacks after a hidden one are decided the same way, each on its own exception line.
  - the shell's `Terminated`/`Killed` line for a rank that was stopped because the job was ending.
  - a second copy of an argparse usage block: every rank of a script given a bad argument prints the same usage
    (85 lines for a recipe) then its `PROG: error: ...` line; the console shows the first rank's usage and every
    rank's error line (`UsageBlocks`), and the verdict quotes the failing rank's error line (failures.py).
What it words differently: horovodrun's `Terminating remaining workers after failure of Process N.` when process N
exited 75 (it stopped to be resumed, after its checkpoint: a stop request, not a failure; `LauncherLines._words`).
Lines from several writers can arrive as one. horovodrun's threads share its sys.stdout: `print()` writes its
text and the newline apart, while the threads forwarding the Gloo ranks write each rank's line whole, so a rank's
line, or another thread's exit line, can land between them
(`Process 1 exit with status code 137.[0]<stderr>:Traceback ...`). Such a line is split at the rank tag
(`EMBEDDED_RANK`) or the exit line (`EXIT_LINE`). mpirun (--tag-output) instead tags every chunk it reads from a
rank, whole lines or not; an unbuffered rank writes a line in several chunks (print(): text, then newline; a
traceback: `RuntimeError`, `: `, the message), and other ranks' chunks land between them:
`[1,1]<stderr>:text[1,0]<stderr>:rank 0's line` then `[1,1]<stderr>:` (rank 1's newline). A tagged segment that
a newline does not end is held per rank and stream (`OutputRouter.partial`) until its line's last chunk comes;
it is shown as it is when it holds a `\r` (a progress bar's update), reaches PARTIAL_LIMIT, or the output ends
(`end_of_output`, in the reader thread, before the launcher reads the failures for its verdict).
Without logs.dir the hidden traceback is kept nowhere, but its exception line is: when no rank failure explains
the job's end, hvdtrain prints it after its own verdict (`LauncherLines.hidden`).
"""

from __future__ import annotations

import re
import shlex
import threading
import time
from pathlib import Path
from typing import IO

from hvdtrain import exitcodes
from hvdtrain.job.model import Logs
from hvdtrain.launch.failures import ARG_ERROR, USAGE, FailureTracker, usage_part

# Gloo: `[0]<stdout>:text`; MPI (--tag-output): `[1,0]<stdout>:text`. Both become `[0]<stdout>:text`.
RANK_LINE = re.compile(r"^\[(?:\d+,)?(\d+)\]<(stdout|stderr|stddiag)>:(.*)$", re.DOTALL)
# srun --label: `0: text`, the rank right-aligned to the width of the largest (` 3: ` among 12 tasks)
SRUN_LINE = re.compile(r"^ *(\d+): (.*)$", re.DOTALL)
# mpirun --tag-output tags every chunk it reads (see NOTE [console]): `[jobid,rank]<stream>:chunk`
MPI_TAG = re.compile(r"\[\d+,(\d+)\]<(stdout|stderr|stddiag)>:")
EMBEDDED_RANK = re.compile(r"\[(?:\d+,)?\d+\]<(?:stdout|stderr)>:")  # a rank's line after a launcher's text
PARTIAL_LIMIT = 1 << 16  # characters of a rank's unfinished MPI line held before it is shown as it is
EXIT_LINE = re.compile(r"Process \d+ exit with status code ")  # horovodrun (Gloo): one per rank, from its threads
EXIT_CODE = re.compile(r"Process (\d+) exit with status code (-?\d+)\.")
TERMINATING = re.compile(r"Terminating remaining workers after failure of Process (\d+)\.$")  # after a non-zero exit
TRACEBACK = "Traceback (most recent call last):"
JOB_ENDED = ("RuntimeError: Horovod detected that one or more processes exited with non-zero status",
             "RuntimeError: mpirun failed with exit code", "RuntimeError: Job has been shutdown")
SSH_CHECK = "RuntimeError: could not connect to some hosts via ssh"  # horovodrun's check of every host, before a rank
EXPLAINED = (*JOB_ENDED, SSH_CHECK)  # tracebacks hvdtrain's verdict accounts for
STOPPED = ("KeyboardInterrupt", "SystemExit")
MESSAGE_TAIL = re.compile(r"^\s*(?:Process name:.*|Exit code:.*)?$")  # the rest of JOB_ENDED's message
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
IGNORED = "Exception ignored in"  # Python's report of an exception at interpreter exit (a KeyboardInterrupt)
FATAL = ("Fatal Python error:", "Python runtime state:")  # an interpreter interrupted as it started
# the rest of `Fatal Python error: init_import_site: ...` when another writer's text split it off (NOTE [console])
FATAL_TAIL = re.compile(r"^_?[A-Za-z0-9]+(?:_[A-Za-z0-9]+)+: ")
SHELL_NOTICES = ("Terminated", "Killed")
CUT_WAIT_S = 1.0  # how long a traceback cut off by an exit line waits for a stop before it is shown (NOTE [console])


def _interrupted_part(line: str) -> bool:
    """After a forwarded signal: a line of an interpreter stopped as it started, or a frame another writer's text
    came before (NOTE [console])."""
    return TRACEBACK in line or line.startswith(FATAL) or '  File "' in line


def _fatal_tail(held: list[str], line: str) -> bool:
    """The message of a held `Fatal Python error:` that another writer's text split off its header (NOTE
    [console]): a C function's name, then the message."""
    return bool(FATAL_TAIL.match(line)) and any(part.startswith(FATAL[0]) for part in held)


def _frame_part(line: str) -> bool:
    """A traceback's line after its header, before its exception line: a frame or its source (indented), the empty
    line Python 3.11 prints after a frame stopped at a `def`, or a line of `^` markers cut off by another writer."""
    return not line or line.startswith((" ", "\t")) or not line.strip("^~ ")


class UsageBlocks:
    """A rank's argparse usage block is held until its error line: shown whole the first time, only the error line
    when another rank printed the same usage (NOTE [console]); anything else releases the held lines as they are."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], list[str]] = {}
        self.shown: set[tuple[str, ...]] = set()

    def feed(self, key: tuple[int, str], body: str, echoed: bool = True) -> list[str]:
        """The rank's lines to echo now (`echoed`: the rank's lines reach the console, so its usage counts as
        shown)."""
        held = self.held.get(key)
        if held is None:
            if body.startswith(USAGE):
                self.held[key] = [body]
                return []
            return [body]
        if usage_part(body):
            held.append(body)
            return []
        del self.held[key]
        if ARG_ERROR.match(body):
            block = tuple(held)
            if block in self.shown:
                return [body]
            if echoed:
                self.shown.add(block)
            return [*held, body]
        return [*held, *self.feed(key, body, echoed)]

    def flush(self) -> list[tuple[tuple[int, str], list[str]]]:
        """Usage blocks no error line followed, per rank and stream (the output ended)."""
        held, self.held = self.held, {}
        return list(held.items())


class LauncherLines:
    """Which of horovodrun's own lines reach the console (see NOTE [console]); `feed` returns the lines to echo now.

    A traceback's frames are held until its exception line says whether the whole traceback is shown. A frame
    whose function was interrupted at its `def` line (Python 3.11 stops there on entry) is followed by an empty
    line: that is held too.
    """

    def __init__(self) -> None:
        self.held: list[str] = []
        self.hiding = False  # after a hidden exception line: the rest of its message is hidden too
        self.hidden: list[str] = []  # hidden exception lines and their messages (horovodrun's own account)
        self.stopping = False  # hvdtrain forwarded a stop signal: an interrupted horovodrun is expected
        self.cut_at = 0.0  # when a process's exit line came while a traceback was held (0: none came)
        self.exits: dict[str, int] = {}  # horovodrun's process index -> the exit code it reported

    def _words(self, line: str) -> str:
        """horovodrun calls any non-zero exit a failure: a rank that exited 75 (the recipes' "stopped to be resumed",
        after their checkpoint) is told as that (NOTE [console])."""
        exited = EXIT_CODE.match(line)
        if exited:
            self.exits[exited[1]] = int(exited[2])
        ended = TERMINATING.match(line)
        if ended and self.exits.get(ended[1]) == exitcodes.PREEMPTED:
            return f"Terminating remaining workers after Process {ended[1]} stopped to be resumed (exit 75)."
        return line

    def feed(self, line: str) -> list[str]:
        line = self._words(line)
        if self.held:
            if _frame_part(line) or _interrupted_part(line) or _fatal_tail(self.held, line):
                self.held.append(line)
                return []
            if EXIT_LINE.match(line):  # cut off by its process's end: decided by what follows (NOTE [console])
                self.cut_at = self.cut_at or time.monotonic()
                return [line]
            if self.cut_at and not (line.startswith(EXPLAINED) or (self.stopping and line.startswith(STOPPED))):
                held, self.held, self.cut_at = self.held, [], 0.0  # no exception line will end it
                return [*([] if self.stopping else held), *self.feed(line)]
            held, self.held, self.cut_at = [*self.held, line], [], 0.0
            self.hiding = line.startswith(EXPLAINED) or (self.stopping and line.startswith(STOPPED))
            if self.hiding:
                self.hidden.append(line)
            return [] if self.hiding else held
        if self.hiding and (MESSAGE_TAIL.match(line) or line.startswith(CHAINED)):
            if line.strip():
                self.hidden.append(line)
            return []
        if self.stopping and (line.startswith((IGNORED, *STOPPED)) or (self.hiding and _frame_part(line))):
            self.hiding = not line.startswith(IGNORED)  # an interrupted process's rest (NOTE [console])
            return []
        self.hiding = False
        if line == TRACEBACK or line.startswith(FATAL) or (self.stopping and TRACEBACK in line):
            self.held = [line]
            return []
        return [line]

    def flush(self) -> list[str]:
        """At the end of the output: a traceback cut off before its exception line is shown as it is, unless hvdtrain
        had stopped the job (an interrupted process's rest: NOTE [console])."""
        held, self.held, self.cut_at = self.held, [], 0.0
        return [] if self.stopping else held

    def due(self) -> list[str]:
        """A traceback cut off by an exit line CUT_WAIT_S ago with no stop since: shown (NOTE [console])."""
        if self.cut_at and not self.stopping and time.monotonic() - self.cut_at >= CUT_WAIT_S:
            return self.flush()
        return []


def launcher_account(launcher: str, returncode: int, said: list[str], check_hosts: list[str]) -> list[str]:
    """hvdtrain's verdict when no rank failure explains the launcher's end: horovodrun's failed ssh check in words
    (`check_hosts`: the `hvdtrain doctor` command that checks the job's hosts), else the exit code and horovodrun's
    own hidden account."""
    if any(line.startswith(SSH_CHECK) for line in said):
        return ["hvdtrain: horovodrun could not reach every host over ssh (`ssh not successful for host ...` above "
                f"names each, with ssh's error), so no rank started. Check the hosts with `{shlex.join(check_hosts)}`: "
                "horovodrun needs passwordless ssh from here to each host, by the name given; inside a Slurm "
                "allocation, `--launcher srun` starts the ranks without ssh"]
    return [f"hvdtrain: {launcher} exited with code {returncode} and no rank reported a failure", *said]


class OutputRouter:
    """Splits horovodrun's merged output into rank lines and launcher lines; echoes and writes per-rank logs.

    `logs.dir` must exist (the launcher creates it).
    """

    def __init__(self, logs: Logs, stdout: IO[str], stderr: IO[str], failures: FailureTracker | None = None, *,
                 srun_labels: bool = False) -> None:
        self.logs, self.stdout, self.stderr = logs, stdout, stderr
        self.srun_labels = srun_labels  # srun --label: `N: text` is rank N's line (stdout and stderr alike)
        self.files: dict[str, IO[str]] = {}
        self.failures = failures or FailureTracker()  # the first failing rank, from the launcher's lines
        self.launcher = LauncherLines()
        self.usage = UsageBlocks()  # one copy of the ranks' argparse usage on the console (NOTE [console])
        self.console_ok = True  # False once the console is gone (e.g. `| head`): keep draining, stop echoing
        self.partial: dict[tuple[int, str], str] = {}  # MPI: a rank's line so far, before its last chunk came
        self._lock = threading.RLock()  # the reader thread's lines, the main thread's notes and close()
        self.closed = False

    def _file(self, name: str) -> IO[str] | None:
        if not self.logs.dir or self.closed:  # closed: a line from a reader that outlived the job, console only
            return None
        if name not in self.files:
            self.files[name] = open(Path(self.logs.dir) / name, "w", buffering=1)  # noqa: SIM115 (closed in close())
        return self.files[name]

    def _stamp(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S ") if self.logs.timestamp else ""

    def line(self, text: str) -> None:
        with self._lock:
            self._line(text)

    def _line(self, text: str) -> None:
        if self.srun_labels and (label := SRUN_LINE.match(text)):
            self._rank_line(int(label.group(1)), "stdout", label.group(2))
            return
        m = RANK_LINE.match(text)
        if m is None and (cut := EMBEDDED_RANK.search(text, 1) or EXIT_LINE.search(text, 1)):  # NOTE [console]
            self._line(text[:cut.start()])
            self._line(text[cut.start():])
            return
        if m is None:
            self.failures.feed(text)
            self._emit(None, self._file("launcher.log"), "", self._stamp() + text)
            for shown in self.launcher.feed(text):
                self._emit(self.stdout, None, self._stamp() + shown, "")
            return
        key, start = (int(m.group(1)), m.group(2)), m.start(3)
        for tag in MPI_TAG.finditer(text, start):  # see NOTE [console]: each chunk a tag, lines in several chunks
            self._hold(key, text[start:tag.start()])
            key, start = (int(tag.group(1)), tag.group(2)), tag.end()  # stddiag: a channel of its own
        self._rank_line(*key, self.partial.pop(key, "") + text[start:])

    def _hold(self, key: tuple[int, str], chunk: str) -> None:
        """A chunk that no newline ended: kept until its line's last chunk comes, unless it is a progress bar's
        update or the line grew too long."""
        so_far = self.partial.pop(key, "") + chunk
        if "\r" in chunk or len(so_far) >= PARTIAL_LIMIT:
            self._rank_line(*key, so_far)
        else:
            self.partial[key] = so_far

    def end_of_output(self) -> None:
        """horovodrun's output ended: a rank's unfinished MPI line is shown as it is, and a usage block no error line
        followed (NOTE [console])."""
        with self._lock:
            for (rank, stream), body in list(self.partial.items()):
                self._rank_line(rank, stream, body)
            self.partial.clear()
            for key, lines in self.usage.flush():
                for body in lines:
                    self._echo(*key, body)
            for shown in self.launcher.flush():  # before the verdict, which the launcher prints once this returns
                self._emit(self.stdout, None, self._stamp() + shown, "")

    def tick(self) -> None:
        """From the supervising loop: a cut-off traceback whose wait for a stop is over (NOTE [console])."""
        with self._lock:
            for shown in self.launcher.due():
                self._emit(self.stdout, None, self._stamp() + shown, "")

    def _rank_line(self, rank: int, stream: str, body: str) -> None:
        stream = "stdout" if stream == "stdout" else "stderr"
        self.failures.rank_line(rank, body)
        self._emit(None, self._file(f"rank.{rank}.log"), "", self._stamp() + body)
        for shown in self.usage.feed((rank, stream), body, self._echoed(rank)):
            self._echo(rank, stream, shown)

    def _echoed(self, rank: int) -> bool:
        return self.logs.console_ranks is None or rank in self.logs.console_ranks

    def _echo(self, rank: int, stream: str, body: str) -> None:
        echo = self._echoed(rank)
        ending = self.launcher.stopping or self.failures.first is not None
        if ending and body.strip() in SHELL_NOTICES:
            echo = False
        console = (self.stderr if stream == "stderr" else self.stdout) if echo else None
        self._emit(console, None, f"{self._stamp()}[{rank}]<{stream}>:{body}", "")

    def _emit(self, console: IO[str] | None, file: IO[str] | None, console_text: str, file_text: str) -> None:
        if console is not None and self.console_ok:
            try:
                console.write(console_text + "\n")
                console.flush()
            except (OSError, ValueError):  # EPIPE (`| head`), EIO (the terminal closed), ValueError: stream closed
                self.console_ok = False
        if file is not None:
            file.write(file_text + "\n")

    def note(self, text: str) -> None:
        """hvdtrain's own verdict: to stderr and to launcher.log."""
        with self._lock:
            self._emit(self.stderr, self._file("launcher.log"), text, text)

    def close(self) -> None:
        with self._lock:
            self.end_of_output()  # when the reader thread did not get to it
            for shown in self.launcher.flush():
                self._emit(self.stdout, None, self._stamp() + shown, "")
            for f in self.files.values():
                f.close()
            self.closed = True


def pump(stream: IO[bytes], router: OutputRouter) -> None:
    """The output reader thread: every line of horovodrun's merged stdout/stderr, to the router."""
    for raw in stream:
        router.line(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
    router.end_of_output()
