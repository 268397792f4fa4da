"""Faults injected into real jobs launched by `hvdtrain run`: a rank that raises or is SIGKILLed mid-epoch, and
SIGKILLs of the whole job at random moments and while rank 0 writes a checkpoint.

What must hold: the job ends within seconds, hvdtrain names the failing rank, its host and its log; no process of
the job and no shared-memory segment survives; a re-run resumes from the last complete checkpoint, never loads a
damaged one, and ends with exactly the weights of an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml

from hvdtrain.train import checkpoint
from tests.support.harness import BIN, REPO, SHM_DIR, STARTED_SESSIONS, JobResult, expect_ok, kill_group, run_bounded

pytestmark = pytest.mark.slow
HVDTRAIN = str(BIN / "hvdtrain")
FAULT_SCRIPT = REPO / "tests" / "scripts" / "fault_rank.py"
RECIPE = REPO / "recipes" / "pytorch_train.py"
EPOCHS = 8
DETECT_LIMIT_S = 30.0  # the goal is seconds; generous for a loaded 2-core CI machine
TRAINING = re.compile(r"epochs (\d+)\.\.\d+")  # the recipe prints it once resumed, before training


class Job:
    """`hvdtrain run JOB` in its own session, in the background; stop() SIGKILLs its whole process tree."""

    def __init__(self, job: Path, cwd: Path) -> None:
        self.log = (cwd / f"hvdtrain.{time.monotonic_ns()}.out").open("w+")
        self.proc = subprocess.Popen([HVDTRAIN, "run", str(job)], cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        STARTED_SESSIONS.add(self.proc.pid)

    def tree(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        return []

    def kill_everything(self, procs: list[psutil.Process] | None = None) -> None:
        """A crash of the whole job: every process (launcher, ranks, producers) SIGKILLed at the same instant.
        `procs`: a snapshot of the tree taken earlier, to kill without walking it first (then the rest).

        multiprocessing's resource trackers are spared, as the kernel's OOM killer or a `kill -9` of the job
        would spare them: once the processes they serve are gone they unlink what those left registered (the
        named semaphores of horovodrun's safe_shell_exec), which a whole-machine crash would wipe with /dev/shm.
        """
        procs = [p for p in (procs or []) + self.tree() if not _resource_tracker(p)]
        trackers = [p for p in self.tree() if _resource_tracker(p)]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=30)
        psutil.wait_procs(trackers, timeout=30)

    def wait(self, timeout: float) -> JobResult:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_everything()
            pytest.fail(f"hvdtrain run did not end within {timeout:.0f} s\n{self.output()}")
        finally:
            kill_group(self.proc)
        return JobResult(list(map(str, self.proc.args)), code, self.output())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()


def _resource_tracker(p: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def wait_for(condition, timeout: float, what: str, job: Job, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := condition()) or job.proc.poll() is not None:
            return value
        time.sleep(poll)
    job.kill_everything()
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{job.output()}")


def segments_of(pids: list[int]) -> list[str]:
    return sorted(e.name for pid in pids for e in SHM_DIR.glob(f"hvdtrain_{pid}_*"))


def alive(pids: list[int]) -> list[int]:
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return [p for p in pids if running(p)]


# ---------------------------------------------------------------- a rank fails

@pytest.mark.parametrize("controller", ["gloo", "mpi"])
@pytest.mark.parametrize("fault", ["raise", "sigkill"])
def test_a_failing_rank_ends_the_job_within_seconds_naming_rank_host_and_log(controller, fault, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"script": str(FAULT_SCRIPT), "np": 2, "controller": controller,
                                   "args": [str(tmp_path), "raise" if fault == "raise" else "wait"],
                                   "logs": {"dir": str(tmp_path / "logs")}}))
    run = Job(job, tmp_path)
    pid_files = [tmp_path / f"pid.{r}" for r in (0, 1)]
    wait_for(lambda: all(p.exists() for p in pid_files), 120, "both ranks to start training", run)
    pids = [int(p.read_text()) for p in pid_files]
    producers = [c.pid for pid in pids for c in psutil.Process(pid).children(recursive=True)]
    t0 = time.monotonic()
    if fault == "sigkill":
        os.kill(pids[1], signal.SIGKILL)
    else:
        (tmp_path / "go").touch()  # rank 1 raises at its next step
    res = run.wait(timeout=120)
    took = time.monotonic() - t0
    print(f"{controller} {fault}: hvdtrain exited {took:.2f} s after the fault")

    assert res.returncode == (137 if fault == "sigkill" else 1), res.describe()
    assert took < DETECT_LIMIT_S, f"the job took {took:.1f} s to end after the fault\n{res.output}"
    # Which rank *exits* first is a race (the healthy rank fails fast inside Horovod once the job shuts down);
    # hvdtrain names the rank that caused it either way, with its exception: from its record, or (when the teardown
    # killed rank 1 while its `with ShmLoader` block was still closing, before the exception left the script) from
    # its traceback's last line.
    named = (r"rank 1 on host \S+ was killed by SIGKILL \(the first rank to fail\)" if fault == "sigkill" else
             r"rank 1 on host \S+ raised RuntimeError: rank 1 is failing on purpose mid-epoch"
             r"( and exited with code 1)? \((the first rank to fail|the cause)\)")
    assert re.search("hvdtrain: " + named, res.output), res.output
    log = tmp_path / "logs" / "rank.1.log"  # made at the rank's first line: a rank SIGKILLed early may have none
    assert (f"hvdtrain: its output: {log}" if log.exists() else "hvdtrain: it printed nothing") in res.output
    if fault == "raise":
        assert "rank 1 is failing on purpose mid-epoch" in (tmp_path / "logs" / "rank.1.log").read_text()
    procs = [psutil.Process(p) for p in pids + producers if alive([p])]
    psutil.wait_procs(procs, timeout=10)  # producers notice their trainer is gone within their poll interval
    assert alive(pids + producers) == [], "a rank or producer process outlived the job"
    assert segments_of(pids) == [], "a shared-memory segment outlived the job"


# ---------------------------------------------------------------- the whole job is killed

def recipe_job(tmp_path: Path, run_dir: Path) -> Path:
    job = tmp_path / f"job.{run_dir.name}.yaml"
    # A wide MLP: a ~5 MB checkpoint takes long enough to write that a kill can land inside the write.
    job.write_text(yaml.safe_dump({"script": str(RECIPE), "np": 2, "args": [
        "--dataset", "digits", "--model", "mlp", "--model-width", "8192", "--epochs", str(EPOCHS),
        "--warmup-epochs", "1", "--keep-checkpoints", "2", "--no-progress", "--no-tensorboard",
        "--run-dir", str(run_dir)]}))
    return job


def intact_epochs(ckpt_dir: Path) -> list[int]:
    """Epochs of the checkpoints under final names; each must verify (a damaged one fails the test)."""
    epochs = []
    for epoch, path in checkpoint.list_checkpoints(ckpt_dir):
        checkpoint.verified_payload(path)  # raises CheckpointInvalid on a partial or damaged file
        epochs.append(epoch)
    return epochs


def temp_files(ckpt_dir: Path) -> set[str]:
    with contextlib.suppress(FileNotFoundError):
        return {e.name for e in os.scandir(ckpt_dir) if ".tmp-" in e.name}
    return set()


def new_temp_file(ckpt_dir: Path):
    """True once a checkpoint write has begun (a temp file that a crashed earlier write did not leave)."""
    old = temp_files(ckpt_dir)
    return lambda: bool(temp_files(ckpt_dir) - old)


@pytest.mark.timeout(1500)  # up to 8 jobs, each bounded below
def test_sigkill_at_random_moments_and_mid_checkpoint_never_loses_a_checkpoint(tmp_path):
    """Over 30 s: a reference run, up to 6 killed runs and the final one, each a 2-rank job; fewer kills would leave the
    mid-write case to chance."""
    expect_ok(run_bounded([HVDTRAIN, "run", str(recipe_job(tmp_path, tmp_path / "reference"))], timeout=300,
                          cwd=tmp_path))
    want = json.loads((tmp_path / "reference" / "summary.json").read_text())["weights_sha256_by_rank"]

    semaphores = set(SHM_DIR.glob("sem.mp-*"))  # multiprocessing's named semaphores (horovodrun makes some)
    run_dir, rng, trials = tmp_path / "killed", random.Random(7), []
    ckpt_dir, job = run_dir / "checkpoints", recipe_job(tmp_path, tmp_path / "killed")
    for trial in range(6):
        before = intact_epochs(ckpt_dir)
        if before[-1:] == [EPOCHS]:
            break
        run = Job(job, tmp_path)
        old_temps = temp_files(ckpt_dir)
        wait_for(lambda job=run: TRAINING.search(job.output()), 180, "training to start", run, poll=0.1)
        # While rank 0 writes a checkpoint (the temp file exists, the rename has not happened): every other trial,
        # and every trial until one kill has landed inside a write (a small model's write can finish first).
        if trial % 2 == 0 or not any(t["killed_mid_write"] for t in trials):
            tree = run.tree()  # taken now, so that the kill follows the temp file within a millisecond
            wait_for(new_temp_file(ckpt_dir), 180, "a checkpoint write", run, poll=0.0005)
            run.kill_everything(tree)
        else:  # at a random moment of training
            time.sleep(rng.uniform(0.0, 4.0))
            run.kill_everything()
        hit = bool(temp_files(ckpt_dir) - old_temps)  # a temp file outlived the kill: it landed inside a write
        res = run.wait(timeout=30)
        after = intact_epochs(ckpt_dir)  # no damaged file under a checkpoint name, whenever the kill landed
        started = TRAINING.search(res.output)
        trials.append({"trial": trial, "killed_mid_write": hit, "before": before,
                       "after": after, "started_at_epoch": int(started.group(1)) if started else None})
        if started:  # the run resumed from the newest intact checkpoint it found
            assert int(started.group(1)) == (before[-1] if before else 0) + 1, res.output
    assert any(t["killed_mid_write"] for t in trials), f"no kill landed inside a checkpoint write: {trials}"

    last = intact_epochs(ckpt_dir)
    if last[-1:] == [EPOCHS] and not (run_dir / "summary.json").exists():
        # A kill landed after the last checkpoint but before summary.json: a re-run has nothing to train and keeps
        # no summary of its own. Retrain the last epoch from the one before (resumes are bit-identical).
        checkpoint.list_checkpoints(ckpt_dir)[-1][1].unlink()
        last = intact_epochs(ckpt_dir)
    final = expect_ok(run_bounded([HVDTRAIN, "run", str(job)], timeout=300, cwd=tmp_path))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["weights_sha256_by_rank"] == want, "the killed-and-resumed run's weights differ from the reference"
    if last[-1:] != [EPOCHS]:  # the final run trained: it resumed from the newest intact checkpoint
        assert f"epochs {(last[-1] if last else 0) + 1}..{EPOCHS}" in final.output, final.output
        assert not any(".tmp-" in p.name for p in ckpt_dir.iterdir()), "a crashed write's temp file survived"
    print("TRIALS " + json.dumps(trials))
    assert set(SHM_DIR.glob("sem.mp-*")) - semaphores == set(), "the kills left named semaphores in /dev/shm"
