"""Horovod's public API on this build (the patched 0.28.1 that scripts/setup.sh makes), as users call it directly:
torch and TensorFlow, Gloo and MPI, 2 real ranks each (tests/scripts/conformance_*.py), and Gloo's re-init.

A future patch, framework bump or build-flag change that breaks a dtype, an op, process sets, compression,
SyncBatchNorm or an optimizer's state broadcast fails here by name, not in a user's job.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.support.harness import BIN, REPO, expect_ok, horovodrun, run_bounded

SCRIPTS = REPO / "tests" / "scripts"
HAS_TF = importlib.util.find_spec("tensorflow") is not None
pytestmark = pytest.mark.slow
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}


# What Horovod refuses by design on a CPU build, and the words its error must use (anything else must be "ok").
TORCH_REFUSED = {
    **{f"{op}_{dt}": f"Tensor type torch.{kind}Tensor is not supported"
       for op in ("allreduce_sum", "reducescatter_sum")
       for dt, kind in (("uint8", "Byte"), ("int8", "Char"), ("int16", "Short"))},
    "sync_batch_norm": "SyncBatchNorm expected input tensor to be on GPU",
}
ADASUM_NEEDS_MPI = {"adasum": "No Adasum operation enabled"}


def refused(controller: str, by_design: dict[str, str]) -> dict[str, str]:
    return {**by_design, **(ADASUM_NEEDS_MPI if controller == "gloo" else {})}


def torch_cases() -> set[str]:
    dtypes = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"]
    cases = {f"{op}_{dt}" for dt in dtypes
             for op in ("allreduce_sum", "allgather", "broadcast", "alltoall", "reducescatter_sum")}
    cases |= {f"allreduce_average_{dt}" for dt in ("float16", "float32", "float64")}
    optimizers = [name for name in dir(torch.optim) if isinstance(getattr(torch.optim, name), type)
                  and issubclass(getattr(torch.optim, name), torch.optim.Optimizer) and name != "Optimizer"]
    assert {"SGD", "Adam", "AdamW", "LBFGS", "SparseAdam"} <= set(optimizers)
    cases |= {f"broadcast_optimizer_state_{name}" for name in optimizers}
    return cases | {"allreduce_bfloat16_is_refused", "allreduce_min_max_product_and_scaling",
                    "inplace_async_and_grouped", "alltoall_uneven_splits", "objects_join_barrier", "process_sets",
                    "compression_fp16", "sync_batch_norm", "adasum", "channels_last"}


def tf_cases() -> set[str]:
    reduce = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
    move = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64", "bool"]
    scatter = ["int32", "int64", "float16", "float32", "float64"]
    cases = {f"allreduce_sum_{dt}" for dt in reduce}
    cases |= {f"allreduce_average_{dt}" for dt in ("float16", "float32", "float64")}
    cases |= {f"{op}_{dt}" for dt in move for op in ("allgather", "broadcast", "alltoall")}
    cases |= {f"reducescatter_sum_{dt}" for dt in scatter}
    return cases | {"grouped_and_in_tf_function", "objects_variables_and_process_sets", "compression_fp16",
                    "distributed_gradient_tape_averages", "sync_batch_normalization", "adasum"}


def run_cases(script: str, controller: str, out_dir: Path) -> dict[int, dict]:
    job = expect_ok(horovodrun(SCRIPTS / script, str(out_dir), controller=controller, timeout=300, env=QUIET))
    found = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out_dir.glob("result.*.json")}
    assert sorted(found) == [0, 1], f"expected a result file from each rank\n{job.describe()}"
    assert {found[r]["controller"] for r in found} == {controller}
    return found


def check(found: dict[int, dict], expected: set[str], refusals: dict[str, str]) -> None:
    """Every expected case ran on every rank: "ok", or (for refusals) an error with the given words."""
    for rank, result in found.items():
        cases = result["cases"]
        assert set(cases) == expected, (f"rank {rank}: cases missing {sorted(expected - set(cases))}, "
                                        f"unexpected {sorted(set(cases) - expected)}")
        wrong = {name: outcome for name, outcome in cases.items()
                 if (refusals[name] not in outcome or outcome == "ok" if name in refusals else outcome != "ok")}
        assert not wrong, f"rank {rank}: " + "\n".join(
            f"{k}: {v}" + (f" (expected a refusal: {refusals[k]!r})" if k in refusals else "")
            for k, v in sorted(wrong.items()))


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_torch_api_conformance(controller, tmp_path):
    check(run_cases("conformance_torch.py", controller, tmp_path), torch_cases(), refused(controller, TORCH_REFUSED))


@pytest.mark.skipif(not HAS_TF, reason="TensorFlow is not installed in this venv")
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_tensorflow_api_conformance(controller, tmp_path):
    check(run_cases("conformance_tf.py", controller, tmp_path), tf_cases(), refused(controller, {}))


def test_gloo_reinit_survives_a_rank_that_is_slow_in_the_local_rendezvous(tmp_path):
    """hvd.init() after hvd.shutdown(), 12 times, while one rank is slow in the local rendezvous
    (tests/scripts/horovodrun_slow_rank.py: its address and its "done" reach horovodrun's server 0.3 s late).
    On Horovod 0.28.1's server every run aborted both ranks in the second cycle (gloo "connect [127.0.0.1]:port:
    Connection refused", exit 134): the server forgot that the other rank had finished the local scope, kept the
    scope's addresses, and the next rendezvous handed out the slow rank's closed port from the cycle before."""
    cycles = 12
    argv = [str(BIN / "python"), str(SCRIPTS / "horovodrun_slow_rank.py"), "-np", "2", "-H", "localhost:2",
            "--gloo", "--gloo-timeout-seconds", "10", str(BIN / "python"), str(SCRIPTS / "gloo_reinit.py"),
            str(tmp_path), str(cycles)]
    job = expect_ok(run_bounded(argv, timeout=240, env=QUIET))
    found = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in tmp_path.glob("result.*.json")}
    assert sorted(found) == [0, 1], job.describe()
    for result in found.values():
        assert result["sums"] == [3.0] * cycles, result
        assert result["max_cycle_s"] < 8, f"a cycle waited on a timeout: {result}"
