"""Real 2-rank Horovod jobs (horovodrun -np 2 -H localhost:2): DistributedOptimizer's step, and a failing rank.

The ranks only write what they computed (one JSON file per rank); the arithmetic is checked here, so an un-averaged
gradient fails. The collectives themselves (allreduce, allgather, broadcast, ... for every dtype, Gloo and MPI) are
tests/horovod/test_conformance.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.harness import REPO, expect_ok, horovodrun

SCRIPTS = REPO / "tests" / "scripts"

pytestmark = pytest.mark.slow


def run_and_collect(script: str, controller: str, out_dir: Path, size: int = 2) -> dict[int, dict]:
    """Run SCRIPTS/script OUT_DIR on `size` ranks; return each rank's result.<rank>.json (the job must succeed)."""
    job = expect_ok(horovodrun(SCRIPTS / script, str(out_dir), np=size, controller=controller))
    found = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out_dir.glob("result.*.json")}
    assert sorted(found) == list(range(size)), f"expected a result file from each rank\n{job.describe()}"
    assert all(found[r]["rank"] == r for r in found)
    return found


def test_distributed_optimizer_step_equals_step_on_averaged_gradient(tmp_path):
    """One controller: the step is the optimizer's; that allreduce averages under both controllers, for every dtype,
    is tests/horovod/test_conformance.py's."""
    res = run_and_collect("optimizer_step.py", "gloo", tmp_path)
    r0, r1 = res[0], res[1]
    assert r0["w0"] == r1["w0"], "broadcast_parameters did not make the initial weights identical"
    assert r0["local_grad"] != r1["local_grad"], "ranks saw the same data: the test would prove nothing"
    assert r0["w1"] == r1["w1"], "weights differ across ranks after one step"
    lr = r0["lr"]
    for w0, g0, g1, w1 in zip(r0["w0"], r0["local_grad"], r1["local_grad"], r0["w1"], strict=True):
        expected = [w - lr * (a + b) / 2 for w, a, b in zip(w0, g0, g1, strict=True)]
        assert w1 == pytest.approx(expected, rel=1e-12, abs=1e-12)
        local_only = [w - lr * a for w, a in zip(w0, g0, strict=True)]
        assert w1 != pytest.approx(local_only, rel=1e-9, abs=1e-9), "gradients were not averaged"


def test_a_failing_rank_fails_the_job_and_its_output_is_shown():
    """The harness's side (horovodrun's exit code, the ranks' output in the failure); how hvdtrain names a failed
    rank under each controller is tests/launch/test_records.py's and tests/launch/test_reliability.py's."""
    result = horovodrun(SCRIPTS / "fail_rank.py", controller="gloo", timeout=120)
    assert result.returncode != 0
    with pytest.raises(pytest.fail.Exception) as failure:
        expect_ok(result)
    assert "rank 1 is failing on purpose" in str(failure.value)
