"""One writer per run directory (hvdtrain/rundir.py): the lock, its messages, and real jobs against it.

- in-process and with a second process: a held directory is refused naming the holder (host, pid, start time),
  `hvdtrain run` sees the holder without touching anything (/proc/locks), and a SIGKILLed holder leaves no lock.
- real jobs: while a PyTorch recipe job trains into a directory, a second `hvdtrain run` of it exits 2 before
  starting any process, and a second job started with horovodrun directly is refused by its rank 0 on every rank;
  neither writes there. After the first job's launcher is SIGKILLed, the same spec resumes from its checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hvdtrain import rundir
from hvdtrain.train import checkpoint
from tests.support.harness import BIN, HVDRUN, REPO, STARTED_SESSIONS, expect_ok, kill_tree, run_bounded

PY = sys.executable
HVDTRAIN = str(BIN / "hvdtrain")
RECIPE = str(REPO / "recipes" / "pytorch_train.py")
HOLD = ("import sys, time\nfrom hvdtrain import rundir\nlock = rundir.lock(sys.argv[1])\n"
        "print('locked', flush=True)\ntime.sleep(120)\n")


def hold_in_another_process(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([PY, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    STARTED_SESSIONS.add(proc.pid)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_held_run_directory_is_refused_naming_the_holder_and_freed_when_the_holder_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    holder = hold_in_another_process(run_dir)
    with pytest.raises(rundir.RunDirBusy) as refused:
        rundir.lock(run_dir)
    message = str(refused.value)
    assert f"run directory {run_dir} is in use by another job: its writer is pid {holder.pid} on host " in message
    assert "(started 20" in message and f"UTC: -c {run_dir})" in message
    assert "another run directory (--run-dir)" in message
    assert rundir.held_here(run_dir) == message.split("its writer is ", 1)[1].split(". Two jobs", 1)[0]
    holder.kill()  # a crash: nobody releases the lock by hand
    holder.wait(timeout=10)
    assert rundir.held_here(run_dir) is None
    with rundir.lock(run_dir) as mine:
        assert json.loads(mine.path.read_text())["pid"] == os.getpid()
        assert rundir.held_here(run_dir) is not None
    assert rundir.held_here(run_dir) is None


def test_held_here_touches_nothing_and_knows_no_lock_in_a_missing_directory(tmp_path):
    assert rundir.held_here(tmp_path / "nope") is None
    assert not (tmp_path / "nope").exists()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / rundir.LOCK_NAME).write_text("{}")  # a lock file nobody holds
    assert rundir.held_here(tmp_path / "plain") is None


def test_describe_holder_from_the_lock_files_text():
    text = json.dumps({"host": "node7", "pid": 42, "started": 0, "command": "train.py --epochs 3"})
    assert rundir.describe_holder(text) == "pid 42 on host node7 (started 1970-01-01 00:00:00 UTC: train.py --epochs 3)"
    assert rundir.describe_holder("") == "a process that has not written its name yet"
    assert rundir.describe_holder('{"pid": "x"}') == "a process that has not written its name yet"


def test_claim_tells_every_rank_and_hands_the_lock_over_after_an_elastic_reset(tmp_path):
    run_dir = tmp_path / "run"
    held = rundir.claim(run_dir, 0, lambda refused: refused)  # rank 0 of a 1-rank world
    assert held is not None
    with pytest.raises(rundir.RunDirBusy, match="in use by another job"):
        rundir.claim(run_dir, 0, lambda refused: refused)  # a second job's rank 0
    with pytest.raises(rundir.RunDirBusy, match="held elsewhere"):
        rundir.claim(run_dir, 1, lambda _mine: "held elsewhere")  # rank 1 learns rank 0's refusal
    assert rundir.claim(run_dir, 1, lambda _mine: None) is None  # rank 1 of a job whose rank 0 got it
    # Elastic: the old rank 0 is now rank 1 and lets go; the new rank 0 waits for that, then takes it.
    threading.Timer(0.5, lambda: rundir.claim(run_dir, 1, lambda v: v, held=held)).start()
    start = time.monotonic()
    new = rundir.claim(run_dir, 0, lambda refused: refused, wait_s=10)
    assert new is not None and 0.3 < time.monotonic() - start < 5
    assert rundir.claim(run_dir, 0, lambda refused: refused, held=new) is new  # the holder keeps it
    new.release()


# ---- real jobs ----------------------------------------------------------------------------------------------

def write_spec(tmp_path: Path, run_dir: Path, epochs: int, name: str) -> Path:
    spec = tmp_path / name
    spec.write_text(f"script: {RECIPE}\nnp: 2\nenv: {{TF_CPP_MIN_LOG_LEVEL: '2'}}\n"
                    f"args: [--dataset, digits, --epochs, '{epochs}', --no-progress, --no-tensorboard, "
                    f"--run-dir, {run_dir}]\n")
    return spec


def wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the first job ended early (exit {proc.returncode})"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_second_job_on_a_busy_run_directory_is_refused_and_a_killed_job_leaves_it_usable(tmp_path):
    """Over 30 s: a job held busy past its first checkpoint, a second one refused, the first killed, a third run on the
    same directory."""
    run_dir = tmp_path / "run"
    first = subprocess.Popen([HVDTRAIN, "run", str(write_spec(tmp_path, run_dir, 1000, "first.yaml"))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    STARTED_SESSIONS.add(first.pid)
    try:
        wait_for(run_dir / "checkpoints" / "ckpt-epoch0001.pt", first, 180)
        owner = json.loads((run_dir / rundir.LOCK_NAME).read_text())
        # `hvdtrain run` of the same spec: refused before any process starts.
        res = run_bounded([HVDTRAIN, "run", str(tmp_path / "first.yaml")], timeout=60)
        assert res.returncode == 2, res.describe()
        assert f"is in use by another job: its writer is pid {owner['pid']} on host {owner['host']}" in res.output
        assert "hvdtrain: starting" not in res.output and "Traceback" not in res.output  # nothing was launched
        # The same job through horovodrun's code directly (HVDRUN): rank 0 finds the lock taken, and every rank
        # stops with it.
        res = run_bounded([str(HVDRUN), "-np", "2", "-H", "localhost:2", "--gloo", PY, RECIPE, "--dataset",
                           "digits", "--epochs", "1000", "--no-progress", "--run-dir", str(run_dir)], timeout=180)
        assert res.returncode != 0, res.describe()
        for rank in (0, 1):
            assert f"[{rank}]<stderr>:pytorch_train.py: error: run directory {run_dir} is in use" in res.output
        assert "resuming from" not in res.output and " train loss " not in res.output, res.describe()
        assert json.loads((run_dir / rundir.LOCK_NAME).read_text()) == owner  # still the first job's
        assert not (run_dir / "summary.json").exists() and not (run_dir / "tensorboard").exists()
        # A crash of the first job: its launcher SIGKILLed. The job ends with it, and its lock with its rank 0.
        first.kill()
        first.wait(timeout=30)
        deadline = time.monotonic() + 30
        while rundir.held_here(run_dir) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rundir.held_here(run_dir) is None, "the lock outlived the SIGKILLed job"
    finally:
        kill_tree(first)
        first.wait(timeout=30)
    # The newest checkpoint: an epoch's, or one mid-epoch (the guard's SIGTERM reached the ranks as a stop request
    # they had time to act on: NOTE [stop requests] in hvdtrain/train/preempt.py).
    done, _ = max(at for p in (run_dir / "checkpoints").iterdir() if (at := checkpoint.parse_name(p.name)))
    res = expect_ok(run_bounded([HVDTRAIN, "run", str(write_spec(tmp_path, run_dir, done + 1, "again.yaml"))],
                                timeout=300))
    assert f"(epoch {done} done" in res.output, res.describe()
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from_epoch"] == done


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_elastic_job_on_a_busy_run_directory_stops_on_every_rank_having_written_nothing(tmp_path):
    run_dir = tmp_path / "run"
    holder = hold_in_another_process(run_dir)
    try:
        res = run_bounded([str(HVDRUN), "-np", "2", "--gloo", "--network-interfaces", "lo",
                           "--host-discovery-script", str(REPO / "jobs" / "discover_hosts.sh"), "--min-np", "1",
                           "--max-np", "2", PY, str(REPO / "recipes" / "pytorch_elastic.py"), "--dataset", "digits",
                           "--epochs", "2", "--threads", "1", "--no-progress", "--run-dir", str(run_dir)],
                          timeout=240)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert res.returncode != 0, res.describe()
    for rank in (0, 1):
        assert f"[{rank}]<stderr>:pytorch_elastic.py: error: run directory {run_dir} is in use by another job: " \
               f"its writer is pid {holder.pid}" in res.output, res.describe()
    assert sorted(p.name for p in run_dir.iterdir()) == [rundir.LOCK_NAME], res.describe()


def test_a_run_directory_that_cannot_be_made_is_refused_with_the_fix(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(rundir.RunDirBusy, match=r"cannot use run directory .*/file/run: .*give another one"):
        rundir.lock(tmp_path / "file" / "run")
