"""`hvdtrain doctor` against the real build in this venv."""

from __future__ import annotations

import json

import pytest

from tests.support.harness import BIN, run_bounded

HVDTRAIN = str(BIN / "hvdtrain")


@pytest.mark.slow
def test_doctor_passes_and_lists_torch_ops_and_both_controllers():
    result = run_bounded([HVDTRAIN, "doctor"], timeout=180)
    assert result.returncode == 0, result.describe()
    lines = {line.split("]", 1)[1].strip().split("  ")[0]: line for line in result.output.splitlines()
             if line.startswith("[")}
    for name in ("Horovod", "PyTorch ops", "Gloo controller", "MPI controller", "MPI runtime", "torch"):
        assert lines[name].startswith("[ok  ]"), result.output
    assert "0.28.1" in lines["Horovod"]
    assert "Open MPI" in lines["MPI runtime"]
    assert "doctor: all required checks passed" in result.output


@pytest.mark.slow
def test_doctor_json_matches_and_requiring_nccl_fails_with_a_fix_on_a_cpu_build():
    result = run_bounded([HVDTRAIN, "doctor", "--json", "--require", "nccl,mpi"], timeout=180)
    checks = {c["name"]: c for c in json.loads(result.output)}
    assert checks["NCCL ops"]["required"] is True
    assert checks["NCCL ops"]["ok"] is False  # this machine has no CUDA: the CPU build has no NCCL ops
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in checks["NCCL ops"]["fix"]
    assert checks["MPI controller"]["ok"] is True
    assert result.returncode == 1


def test_doctor_rejects_an_unknown_requirement_with_exit_2():
    result = run_bounded([HVDTRAIN, "doctor", "--require", "nccl,cuda"], timeout=60)
    assert result.returncode == 2
    assert "unknown requirement(s) cuda; allowed: mpi, nccl, tensorflow" in result.output
