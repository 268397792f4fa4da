"""`hvdtrain run` and Slurm's time limit: SIGUSR1 asks the ranks to checkpoint and stop (NOTE [job shutdown] in
hvdtrain/launch/runner.py), a job whose ranks stopped that way exits 75 ("preempted", not a failure), and `--requeue`
requeues the Slurm job then, and only then.

End to end with real processes: `hvdtrain run` of a 2-rank Gloo job on localhost (horovodrun, the ranks'
supervisors) whose ranks answer the stop request as a recipe does (tests/scripts/stop_on_request.py), SIGUSR1 sent
to hvdtrain alone, and a stand-in `scontrol` first on PATH that writes down how it was called. The verdict's rules
and the records directory's clean-up in-process.
"""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hvdtrain import exitcodes, records
from hvdtrain.cli import main
from hvdtrain.job.model import Logs
from hvdtrain.launch.console import OutputRouter
from hvdtrain.launch.failures import FailureTracker
from hvdtrain.launch.runner import _records_dir
from hvdtrain.launch.stops import STOP_ASKED, STOP_ASKED_AGAIN, STOP_REASONS, StopRequests
from hvdtrain.launch.verdict import PREEMPTED, exit_code
from hvdtrain.records import RankRecord
from tests.support.harness import BIN, REPO, STARTED_SESSIONS, kill_tree, wait_gone

HVDTRAIN = str(BIN / "hvdtrain")
STOP_ON_REQUEST = REPO / "tests" / "scripts" / "stop_on_request.py"
JOB_ID = "4242"
BOUND_S = 20  # hvdtrain exited -> every process of the job gone


def write_job(tmp_path: Path, mode: str) -> Path:
    """A 2-rank Gloo job on localhost (hosts set: SLURM_JOB_ID alone must not make it plan on an allocation)."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"script": str(STOP_ON_REQUEST), "args": [str(tmp_path), mode], "np": 2,
                                   "hosts": "localhost:2", "controller": "gloo"}))
    return job


def fake_scontrol(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a Slurm batch job whose `scontrol` appends its arguments to a file; (env, that file)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{calls}'\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": JOB_ID}, calls


def run_and_signal(tmp_path: Path, mode: str, signals: int) -> tuple[int, str, Path]:
    """`hvdtrain run --requeue` of the job in a Slurm-like environment; once both ranks run, `signals` SIGUSR1s
    (0.2 s apart) to hvdtrain alone. Checks that every process of the job is gone once it has exited; (exit code,
    output, the scontrol calls file)."""
    env, calls = fake_scontrol(tmp_path)
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen([HVDTRAIN, "run", str(write_job(tmp_path, mode)), "--requeue"], stdout=sink,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **env},
                                start_new_session=True)
    STARTED_SESSIONS.add(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready.{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, f"the ranks never ran:\n{out.read_text()}"
            time.sleep(0.05)
        processes = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for i in range(signals):
            time.sleep(0.2 if i else 0)
            proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=60)
    finally:
        kill_tree(proc)
    assert wait_gone(processes, BOUND_S) == [], f"processes outlived hvdtrain:\n{out.read_text()}"
    return code, out.read_text(), calls


@pytest.mark.slow
def test_sigusr1_stops_the_ranks_exits_75_and_requeues_once(tmp_path):
    code, out, calls = run_and_signal(tmp_path, "stop", signals=2)
    assert code == exitcodes.PREEMPTED, out
    lines = out.splitlines()
    assert lines.count(STOP_ASKED) == 1 and lines.count(STOP_ASKED_AGAIN) == 1, out  # a repeat is harmless
    assert {"[0]<stdout>:rank 0: asked to stop (stop)", "[1]<stdout>:rank 1: asked to stop (stop)"} <= set(lines), out
    assert PREEMPTED in lines, out
    assert "the first rank to fail" not in out and "exited with code 75" not in out, out  # no failure report
    assert f"hvdtrain: requeued Slurm job {JOB_ID}: it runs again and resumes from the checkpoint" in lines, out
    assert calls.read_text() == f"requeue {JOB_ID}\n", out  # exactly once, with the job's id


@pytest.mark.slow
def test_a_rank_that_ignores_sigusr1_finishes_normally_and_nothing_is_requeued(tmp_path):
    code, out, calls = run_and_signal(tmp_path, "finish", signals=1)
    assert code == 0, out
    assert STOP_ASKED in out.splitlines() and "rank 1: asked to stop (finish)" in out, out
    assert PREEMPTED not in out and "requeue" not in out, out
    assert not calls.exists(), out


def test_requeue_outside_slurm_exits_2_before_starting_anything(tmp_path, capsys):
    marker = tmp_path / "ready.0"
    assert main(["run", str(write_job(tmp_path, "stop")), "--requeue"]) == exitcodes.INVALID_INPUT
    err = capsys.readouterr().err
    assert err.startswith("hvdtrain: error: --requeue puts this Slurm job back in the queue when it stops to be "
                          "resumed (exit 75), but SLURM_JOB_ID is not set"), err
    assert "Use --requeue in an sbatch script (`hvdtrain render slurm JOB.yaml` adds it)" in err, err
    assert "starting" not in err and not marker.exists()


def record(rank: int, code: int | None = None, signum: int | None = None, exception: str | None = None) -> RankRecord:
    return RankRecord(rank, rank, "localhost", 100 + rank, code=code, signum=signum, exception=exception)


@pytest.mark.parametrize(("ranks", "first", "preempted"), [
    ([record(0, 75), record(1, 75)], 75, True),
    ([record(0, 75), record(1, signum=signal.SIGTERM)], 75, True),  # horovodrun stopped the other
    ([record(0, 75), record(1, 0)], 75, True),
    ([record(0, 75), record(1, 1, exception="HorovodInternalError")], 75, False),  # a rank failed
    ([record(0, 75), record(1, signum=signal.SIGKILL)], 75, False),
    ([record(0, 75), record(1, 75)], 1, False),  # horovodrun names a rank that left no record: it failed
    ([record(0, 0), record(1, 3)], 3, False),
    ([], 75, False),
])
def test_the_verdict_is_preempted_only_when_no_rank_failed(ranks, first, preempted):
    router = OutputRouter(Logs(), io.StringIO(), err := io.StringIO(), FailureTracker(("localhost",) * 2))
    router.line(f"Process 0 exit with status code {first}.")
    router.failures.records = ranks
    code = exit_code(1, router, None, False, [])
    said = err.getvalue()
    assert (code == exitcodes.PREEMPTED) == preempted, said  # 75 only for a stop to be resumed: --requeue keys on it
    assert (PREEMPTED in said) == preempted and ("hvdtrain: rank " in said) != preempted, said


def test_an_elastic_job_that_recovered_from_a_failure_and_then_stopped_is_preempted():
    """Elastic: a worker that failed was replaced, training went on, then the final world's ranks stopped (75). A
    failure counts unless the job outlived it: a later process on its host and slot left a record, or it ended 30 s
    before the first rank stopped (hosts' clocks differ: one during the stop, or just before it, still counts)."""
    def at(r: RankRecord, t: float, host: str = "localhost") -> RankRecord:
        return dataclasses.replace(r, time=t, host=host)

    killed = record(2, signum=signal.SIGKILL)
    cases = [
        ([at(killed, 90.0), at(record(0, 75), 100.0), at(record(1, 75), 100.2)], True),  # replaced: host 2 came back
        ([at(killed, 60.0, "gone"), at(record(0, 75), 100.0)], True),  # its host never came back, 40 s before
        ([at(killed, 99.5, "gone"), at(record(0, 75), 100.0)], False),  # just before the stop: it counts
        ([at(record(0, 75), 100.0), at(record(1, signum=signal.SIGKILL), 100.2)], False),  # during the stop
    ]
    cases[0][0].append(at(dataclasses.replace(record(2, 75), pid=999), 100.1))
    for ended, preempted in cases:
        tracker = FailureTracker(("localhost",) * 3, elastic=True)
        tracker.records = ended
        assert tracker.preempted() == preempted, ended
    static = FailureTracker(("localhost",) * 2)  # a job that is not elastic: every record counts
    static.records = [at(killed, 40.0), at(record(0, 75), 100.0)]
    assert not static.preempted()


def test_a_stop_request_never_outlives_its_run(tmp_path):
    """A requeued job runs with the same logs.dir: the last run's stop request must not stop it at once."""
    with _records_dir(str(tmp_path)) as where:
        records.request_stop(where)
    with _records_dir(str(tmp_path)) as where:
        assert not records.stop_requested(where)


def test_a_stop_signal_writes_why_once_and_an_earlier_sigusr1_stays_the_reason(tmp_path):
    ctrl_c, usr1 = tmp_path / "ctrl-c", tmp_path / "usr1"
    for where in (ctrl_c, usr1):
        where.mkdir()
    stops = StopRequests()
    stops.attach(ctrl_c)
    stops.stopping(STOP_REASONS[signal.SIGINT])
    stops.stopping(STOP_REASONS[signal.SIGTERM])  # a second signal (or a nested handler): written once
    assert records.stop_reason(ctrl_c) == "SIGINT (Ctrl-C) to hvdtrain run"
    stops = StopRequests()
    stops.attach(usr1)
    stops.on_signal(signal.SIGUSR1, None)
    stops.stopping(STOP_REASONS[signal.SIGINT])
    assert records.stop_reason(usr1) == records.STOP_USR1 and stops.failed is None
    assert sorted(p.name for p in usr1.iterdir()) == [records.STOP_FILE]  # no temporary file left
    # Only the file says "stop": a directory that cannot be read is no request; a file that cannot be read is one.
    assert records.stop_reason(tmp_path / "missing") is None and records.stop_reason(usr1 / records.STOP_FILE) is None
    (tmp_path / "odd" / records.STOP_FILE).mkdir(parents=True)  # read_text: IsADirectoryError, yet it is there
    assert records.stop_reason(tmp_path / "odd") == "hvdtrain run"
