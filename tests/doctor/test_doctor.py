"""`hvdtrain doctor` against the real build in this venv."""

from __future__ import annotations

import json

import pytest

from tests.support.harness import BIN, run_bounded

HVDTRAIN = str(BIN / "hvdtrain")


@pytest.mark.slow
def test_doctor_lists_torch_ops_and_both_controllers_and_requiring_nccl_fails_with_a_fix_on_a_cpu_build():
    """One doctor run (13-16 s: it starts a job per controller): its JSON, whose text rendering the Keras guard's
    doctor test reads (tests/horovod/test_tfkeras_guard.py)."""
    result = run_bounded([HVDTRAIN, "doctor", "--json", "--require", "nccl,mpi"], timeout=180)
    checks = {c["name"]: c for c in json.loads(result.output)}
    for name in ("Horovod", "PyTorch ops", "Gloo controller", "MPI controller", "MPI runtime", "torch"):
        assert checks[name]["ok"] is True, checks[name]
    assert "0.28.1" in checks["Horovod"]["detail"] and "Open MPI" in checks["MPI runtime"]["detail"], checks
    assert checks["NCCL ops"]["required"] is True
    assert checks["NCCL ops"]["ok"] is False  # this machine has no CUDA: the CPU build has no NCCL ops
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in checks["NCCL ops"]["fix"]
    assert result.returncode == 1


def test_doctor_rejects_an_unknown_requirement_with_exit_2():
    result = run_bounded([HVDTRAIN, "doctor", "--require", "nccl,cuda"], timeout=60)
    assert result.returncode == 2
    assert "unknown requirement(s) cuda; allowed: mpi, nccl, tensorflow" in result.output
