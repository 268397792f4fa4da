"""`hvdtrain run`'s SIGUSR1: a request that the ranks checkpoint at their next step boundary and stop (exit 75),
written as records.STOP_FILE into the job's records directory (NOTE [job shutdown] in runner.py; the ranks' side:
NOTE [stop requests] in hvdtrain/train/preempt.py). A stop signal (Ctrl-C) writes the same file, once, after it
was forwarded: the ranks, stopped by horovodrun's SIGTERM, read it for their stop line."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING

from hvdtrain import exitcodes, records

if TYPE_CHECKING:
    from hvdtrain.launch.console import OutputRouter

STOP_ASKED = ("hvdtrain: SIGUSR1: asking the ranks to checkpoint at their next step boundary and stop (exit "
              f"{exitcodes.PREEMPTED})")
STOP_ASKED_AGAIN = "hvdtrain: SIGUSR1 again: the ranks were already asked to stop; nothing more to do"
# What the stop file says when the whole job is stopped (the ranks get horovodrun's SIGTERM): their stop line
STOP_REASONS = {signal.SIGINT: "SIGINT (Ctrl-C) to hvdtrain run", signal.SIGTERM: "SIGTERM to hvdtrain run",
                signal.SIGHUP: "SIGHUP to hvdtrain run (its terminal closed)"}


class StopRequests:
    """SIGUSR1: ask the ranks to checkpoint at their next step boundary and exit 75 (NOTE [job shutdown]). One that
    comes before the job's records directory exists is passed on when it does (`attach`); the console is told in
    the main loop (`tell`), never in the handler."""

    def __init__(self) -> None:
        self.received = 0
        self.told = 0
        self.where: Path | None = None
        self.failed: str | None = None  # why the request could not be written
        self.reason: str | None = None  # what asked first (the stop file's text)
        self.stop_written = False  # a stop signal's reason is written once (a nested handler skips it)

    def install(self) -> StopRequests:
        signal.signal(signal.SIGUSR1, self.on_signal)
        return self

    def on_signal(self, _signum: int, _frame: object) -> None:
        self.received += 1
        self.reason = self.reason or records.STOP_USR1
        self._request()

    def stopping(self, reason: str) -> None:
        """The whole job is being stopped (a stop signal to hvdtrain run, its --timeout), the signal forwarded: the
        ranks get horovodrun's SIGTERM; the stop file tells them why, so that their stop line says it. Once."""
        if self.stop_written:
            return
        self.stop_written = True
        self.reason = self.reason or reason
        self._request()

    def attach(self, where: Path | None) -> None:
        """The job's records directory from now on (None: the job has ended)."""
        self.where = where
        if self.received:
            self._request()

    def _request(self) -> None:
        if self.where is None:
            return
        try:
            records.request_stop(self.where, self.reason or records.STOP_USR1)
        except OSError as exc:
            self.failed = f"cannot create {self.where / records.STOP_FILE}: {exc.strerror or exc}"

    def tell(self, router: OutputRouter, upto: int | None = None) -> None:
        """Say on the console what the SIGUSR1s received so far (the first `upto`) did, once each."""
        for _ in range(self.told, self.received if upto is None else upto):
            self.told += 1
            router.note(STOP_ASKED if self.told == 1 else STOP_ASKED_AGAIN)
            if self.failed:
                router.note(f"hvdtrain: SIGUSR1: the ranks cannot be asked to stop: {self.failed}")
