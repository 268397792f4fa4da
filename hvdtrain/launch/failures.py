"""Which rank failed, on which host, and how: from the ranks' records, else from horovodrun's and mpirun's lines.

Each rank started by `hvdtrain run` leaves a record (hvdtrain.records: exit code or signal, the exception that
ended it). `FailureTracker.records` holds them once the job has ended; the report names the rank that caused the
failure from them: the first failed rank whose exception is not a victim's (ranks that only saw the job shut down
under them raise HorovodInternalError, or time out waiting for a peer that is gone).

For a rank that left no record (its supervisor was SIGKILLed, its host was lost), the report falls back to the
launcher's own lines: horovodrun (Gloo) prints `Process 1 exit with status code 3.` for each rank that exits
non-zero (the first one first: it then terminates the others) and, at the end, `Exit code: 3`; mpirun prints
`Process name: [[j,1],1]` followed by `Exit code: 3`, or `mpirun noticed that process rank 1 with PID 42 on node h1
exited on signal 9`. `FailureTracker.feed` takes every launcher line (not the ranks' own output) and keeps the
first failure; the ranks' own lines only give their last lines (and, without records, the exception they raised).
"""

from __future__ import annotations

import re
import signal
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from hvdtrain import exitcodes
from hvdtrain.records import RankRecord

GLOO_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.?\s*$")
MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
MPI_NAME = re.compile(r"^\s*Process name:\s*(?:\[\[\d+,\d+\],)?(\d+)\]?\s*$")  # MPI `[[j,1],1]`, Gloo `1`
EXIT_CODE = re.compile(r"^\s*Exit code:\s*(-?\d+)\s*$")
ELASTIC_NAME = re.compile(r"^\s*Process name:\s*(\S+\[\d+\])\s*$")  # elastic: `host[local rank]`, not a rank
# The last line of a Python traceback: `RuntimeError: message` (unindented). Ranks that only saw the job being
# shut down under them raise HorovodInternalError: they are victims, not the cause.
EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)(?::.*)?$")
# mpirun, when a host's orted stops answering: `Remote daemon: [[21958,0],2] on node 10.213.86.12`.
MPI_LOST_DAEMON = re.compile(r"^\s*Remote daemon:\s*\S+ on node (\S+)\s*$")
# Gloo, when a peer stops answering (a lost host or link); it does not say which peer. The rank that timed out
# is a victim too: the cause is the peer it waited for. Gloo's message names its source line and the wait
# (`[.../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation to complete`), in
# Horovod's log line and in the exception alike: a rank's own line that merely says "Timed out waiting" is not one.
GLOO_TIMEOUT = "Timed out waiting"
GLOO_TIMEOUT_MESSAGE = re.compile(r"\.cc:\d+\] Timed out waiting \d+ms for \w+ operation")
VICTIM = ("HorovodInternalError", "HostsUpdatedInterrupt", "Horovod has been shut down", GLOO_TIMEOUT)
TAIL_LINES = 15
# argparse's exit on a bad command line (exit 2): `usage: PROG ...` (wrapped lines indented), then `PROG: error: ...`.
USAGE = "usage: "
ARG_ERROR = re.compile(r"^[^:\s][^:]*: error: \S")  # PROG may hold spaces: a subcommand's `prog sub: error:`


def usage_part(line: str) -> bool:
    """A wrapped line of an argparse usage block (indented, not its error line)."""
    return line.startswith((" ", "\t")) and bool(line.strip())
TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # how horovodrun and mpirun stop the other ranks


@dataclass(frozen=True)
class RankFailure:
    """The first rank that failed: its exit code, or the signal that killed it, and its host when known."""

    rank: int | None
    code: int | None = None
    signum: int | None = None
    host: str | None = None

    def how(self) -> str:
        if self.signum is not None:
            try:
                name = signal.Signals(self.signum).name
            except ValueError:
                name = f"signal {self.signum}"
            return f"was killed by {name}"
        return f"exited with code {self.code}"


def _victim(record: RankRecord) -> bool:
    """A rank that failed only because the job was coming down: Horovod shut down under it, its collective timed
    out waiting for a peer that was gone, or horovodrun/mpirun stopped it (SIGTERM, SIGINT, SIGHUP)."""
    said = f"{record.exception} {record.message}"
    return record.signum in TEARDOWN_SIGNALS or (record.exception is not None and any(v in said for v in VICTIM))


def _from_code(rank: int | None, code: int) -> RankFailure:
    """Shells report a rank killed by signal N as 128+N, Python's subprocess as -N."""
    if code < 0:
        return RankFailure(rank, signum=-code)
    if 128 < code < 128 + 65:
        return RankFailure(rank, code=code, signum=code - 128)
    return RankFailure(rank, code=code)


RECOVERED_S = 30.0  # elastic: a failure this long before the first rank stopped was recovered from


def _recovered(record: RankRecord, records: list[RankRecord], stopped: float) -> bool:
    """An elastic worker's failure the job outlived: a later process on its host and slot left a record (one host's
    clock), or it ended RECOVERED_S before the first rank stopped (hosts' clocks differ; a failure during the stop
    itself must still count)."""
    if not record.failed:
        return False
    later = any((r.host, r.local_rank) == (record.host, record.local_rank) and r.time > record.time
                and r.pid != record.pid for r in records)
    return later or record.time < stopped - RECOVERED_S


class FailureTracker:
    """Feeds on launcher lines; `first` is the first rank failure reported, with its host from `rank_hosts`."""

    def __init__(self, rank_hosts: tuple[str, ...] = (), elastic: bool = False) -> None:
        self.rank_hosts = rank_hosts
        self.elastic = elastic  # ranks that fail are replaced: their `Process N exit` lines do not end the job
        self.first: RankFailure | None = None
        self._mpi_rank: int | None = None  # from `Process name:`, waiting for its `Exit code:` line
        self.process: str | None = None  # elastic: the failed worker's `host[local rank]` (ranks change on resets)
        self.tails: dict[int, deque[str]] = {}
        self.cause: tuple[int, str] | None = None  # the first rank to raise something other than a victim's error
        self.lost_host: str | None = None  # a host mpirun lost contact with
        self.unreachable: dict[str, str] = {}  # filled by the launcher after a timeout: host -> why
        self.records: list[RankRecord] = []  # the ranks' records, oldest first, once the job has ended
        self.peer_timed_out = False  # a rank's Gloo operation timed out waiting for a peer (its log or exception)
        self.arg_errors: dict[int, str] = {}  # a rank's argparse error line (it exited parsing its command line)
        self._in_usage: set[int] = set()  # ranks whose last lines are an argparse usage block

    def rank_line(self, rank: int, text: str) -> None:
        """Remember the last lines each rank printed, and the first real exception any rank raised."""
        self.tails.setdefault(rank, deque(maxlen=TAIL_LINES)).append(text)
        if rank in self._in_usage and ARG_ERROR.match(text):
            self.arg_errors.setdefault(rank, text.strip())
        if text.startswith(USAGE) or (rank in self._in_usage and usage_part(text)):
            self._in_usage.add(rank)
        else:
            self._in_usage.discard(rank)
        self.peer_timed_out = self.peer_timed_out or bool(GLOO_TIMEOUT_MESSAGE.search(text))
        if self.cause is None and EXCEPTION.match(text) and not any(v in text for v in VICTIM):
            self.cause = (rank, text.strip())

    def feed(self, line: str) -> None:
        if self.lost_host is None and (m := MPI_LOST_DAEMON.match(line)):
            self.lost_host = m.group(1)
        if self.first is not None:
            return
        if m := GLOO_EXIT.match(line):
            if not self.elastic:
                self._set(_from_code(int(m.group(1)), int(m.group(2))))
        elif m := MPI_SIGNAL.search(line):
            self._set(RankFailure(int(m.group(1)), signum=int(m.group(3)), host=m.group(2)))
        elif m := MPI_NAME.match(line):
            self._mpi_rank = int(m.group(1))
        elif m := ELASTIC_NAME.match(line):
            self.process = m.group(1)
        elif m := EXIT_CODE.match(line):
            self._set(_from_code(self._mpi_rank, int(m.group(1))))

    @property
    def failed_records(self) -> list[RankRecord]:
        return [r for r in self.records if r.failed]

    def cause_record(self) -> RankRecord | None:
        """The failed rank that brought the job down, from the records: the first whose failure is not a victim's
        (elastic: the last, as earlier failures were recovered from; the worker horovodrun named, if it left one).
        None when only victims left records: the launcher's lines tell more then (a rank killed with its
        supervisor, a lost host)."""
        causes = [r for r in self.failed_records if not _victim(r)]
        if not causes:
            return None
        if not self.elastic:
            return causes[0]
        named = [r for r in causes if self.process == f"{r.host}[{r.local_rank}]"]
        return (named or causes)[-1]

    def exit_failure(self) -> RankFailure | None:
        """The failure whose exit status the job exits with: the cause's from the records (3 for a rank that
        diverged, though a victim exited 1 first), else the first reported by horovodrun/mpirun."""
        if (r := self.cause_record()) is None:
            return self.first
        return RankFailure(r.rank, code=r.code, signum=r.signum, host=r.host)

    def preempted(self) -> bool:
        """The ranks stopped to be resumed, not failed: at least one rank's record says exit 75 (it checkpointed at a
        step boundary: exitcodes.PREEMPTED), every other record says 0, 75 or a teardown signal (horovodrun stops
        the rest once the first exits non-zero), and horovodrun's or mpirun's first report, if any, agrees (a rank
        that left no record, on a host that does not share the records directory, is named there). Elastic: a
        worker that failed and was recovered from does not count (`_recovered`)."""
        stopped = [r.time for r in self.records if r.code == exitcodes.PREEMPTED]
        if not stopped:
            return False
        records = [r for r in self.records if not (self.elastic and _recovered(r, self.records, min(stopped)))]
        if not all(r.code in (0, exitcodes.PREEMPTED) or r.signum in TEARDOWN_SIGNALS for r in records):
            return False
        f = self.first
        return f is None or f.code == exitcodes.PREEMPTED or f.signum in TEARDOWN_SIGNALS

    def _set(self, failure: RankFailure) -> None:
        r = failure.rank
        if failure.host is None and r is not None and 0 <= r < len(self.rank_hosts):
            failure = replace(failure, host=self.rank_hosts[r])
        self.first = failure

    def _host_name(self, rank: int) -> str | None:
        """The host as the job names it (hosts/hostfile), or as mpirun reported it."""
        host = self.first.host if self.first and self.first.rank == rank else None
        return host or (self.rank_hosts[rank] if 0 <= rank < len(self.rank_hosts) else None)

    def _host(self, rank: int) -> str:
        host = self._host_name(rank)
        return f" on host {host}" if host else ""

    def report(self, log_dir: str | None) -> list[str]:
        """What hvdtrain prints about the failure: who, where, how, and where to read its output.

        The launcher names the first rank to *exit*; when another rank raised the exception that brought the job
        down (the others then fail inside Horovod), that rank is named as the cause.
        """
        lost = self._lost_hosts()
        if (cause := self.cause_record()) is not None:
            return [*lost, *self._record_report(cause, log_dir)]
        f = self.first
        if f is None:
            return lost
        if f.rank is None:
            which = f" (worker {self.process}: host[local rank])" if self.process else ""
            return [*lost, f"hvdtrain: a rank{which} {f.how()}"]
        lines = [f"hvdtrain: rank {f.rank}{self._host(f.rank)} {f.how()} (the first rank to fail)"]
        rank = f.rank
        if self.cause is not None and self.cause[0] != f.rank and f.signum is None:  # a killed rank is the cause
            rank = self.cause[0]
            lines = [f"hvdtrain: rank {rank}{self._host(rank)} raised {self.cause[1]} (the cause); "
                     f"rank {f.rank} {f.how()} first, after Horovod shut down"]
        return [*lost, *lines, *self._output(rank, log_dir)]

    def _record_report(self, cause: RankRecord, log_dir: str | None) -> list[str]:
        """The report from the ranks' records: the cause, with its exception when one ended it."""
        who = (f"worker {cause.host}[{cause.local_rank}]" if self.elastic or cause.rank is None
               else f"rank {cause.rank} on host {self._host_name(cause.rank) or cause.host}")
        how = RankFailure(cause.rank, code=cause.code, signum=cause.signum).how()
        raised = cause.exception and cause.exception != "SystemExit"
        if raised:
            how = f"raised {cause.exception}{f': {cause.message}' if cause.message else ''} and {how}"
        first = self.first if self.first is not None and self.first.rank not in (None, cause.rank) else None
        if first is None:
            line = f"hvdtrain: {who} {how} (the first rank to fail)"
        else:
            line = f"hvdtrain: {who} {how} (the cause); rank {first.rank} {first.how()} first, after Horovod shut down"
        return [line, *([] if cause.rank is None else self._output(cause.rank, log_dir))]

    def _output(self, rank: int, log_dir: str | None) -> list[str]:
        if rank in self.arg_errors:  # its usage was shown once on the console (console.UsageBlocks): the error says it
            where = f"; its output: {Path(log_dir) / f'rank.{rank}.log'}" if log_dir else ""
            return [f"hvdtrain: its error, parsing its command line (the script's usage is above{where}): "
                    f"{self.arg_errors[rank]}"]
        if log_dir:  # the rank's log file is made at its first line
            printed = bool(self.tails.get(rank))
            return [f"hvdtrain: its output: {Path(log_dir) / f'rank.{rank}.log'}" if printed else
                    "hvdtrain: it printed nothing"]
        tail = self.tails.get(rank)
        if not tail:
            return []
        return [f"hvdtrain: its last {len(tail)} line(s) (set logs.dir in the spec to keep every rank's output "
                "and the launcher's):", *(f"  | {t}" for t in tail)]

    def _lost_hosts(self) -> list[str]:
        """A lost host is the cause whatever rank exited first: say so first."""
        if self.lost_host:
            return [f"hvdtrain: lost contact with host {self.lost_host} (mpirun: its daemon stopped answering); "
                    "check that host and the network to it (hvdtrain doctor --hosts ...)"]
        return [f"hvdtrain: host {host} is unreachable now ({why}); it is the likely cause (a rank timed out "
                "waiting for a peer)" for host, why in sorted(self.unreachable.items())]
