"""The private Slurm cluster of tests/support/slurm.py, with real daemons: a batch job's exit code and output come back,
a failing job's exit code is Slurm's ExitCode, and scancel leaves no job process behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.slurm import SlurmCluster

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 60  # a job here starts ~1 s after sbatch and these end at once
GONE_S = 5  # KillWait=5 is the bound for a task that ignores SIGTERM; `sleep` does not


def batch_script(cluster: SlurmCluster, name: str, body: str) -> Path:
    path = cluster.root / "jobs" / f"{name}.sh"
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_batch_job_runs_and_its_output_comes_back(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.sbatch(batch_script(slurm_cluster, "hello", "hostname\nenv"), "--ntasks=2")
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    assert (result.state, result.exit_code, result.signal) == ("COMPLETED", 0, 0), result
    lines = result.output_text.splitlines()
    assert lines[0] == slurm_cluster.node
    assert f"SLURM_JOB_ID={job}" in lines and "SLURM_NTASKS=2" in lines, result.output_text
    assert f"SLURM_CONF={slurm_cluster.conf}" in lines


def test_a_failing_job_shows_its_exit_code(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.sbatch(batch_script(slurm_cluster, "exit3", "echo before\nexit 3"))
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    assert (result.state, result.exit_code, result.signal) == ("FAILED", 3, 0), result
    assert result.output_text == "before\n"


def test_scancel_leaves_no_job_process(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.sbatch(batch_script(slurm_cluster, "sleeper", "sleep 300"))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not any(cmd == "sleep 300" for cmd in slurm_cluster.processes(job).values()):
        assert time.monotonic() < deadline, f"job {job} never ran its sleep: {slurm_cluster.job_fields(job)}"
        time.sleep(0.1)
    slurm_cluster.scancel(job)
    cancelled_at = time.monotonic()
    while left := slurm_cluster.processes(job):
        assert time.monotonic() - cancelled_at < GONE_S, f"still running after scancel: {left}"
        time.sleep(0.1)
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    assert result.state == "CANCELLED", result


def test_srun_in_an_allocation_runs_every_task(slurm_cluster: SlurmCluster) -> None:
    result = slurm_cluster.run(["salloc", "-n2", "srun", "--label", "-n2", "printenv", "SLURM_PROCID"], 60)
    assert result.returncode == 0, result.describe()
    assert sorted(line for line in result.output.splitlines() if not line.startswith("salloc:")) == \
        ["0: 0", "1: 1"], result.describe()
