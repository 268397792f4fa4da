"""Horovod's Keras integration used directly (no hvdtrain code), as Horovod's own examples use it, on this build.

Under Keras 3 the patched Horovod refuses (UnsupportedKerasError, before any step) instead of training without
averaging; under tf_keras (TF_USE_LEGACY_KERAS=1) the plain pattern averages and every callback of Horovod's Keras
examples works. Two real ranks each (horovodrun -np 2); the ranks write what they saw, the checks are here.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.support.harness import BIN, REPO, JobResult, expect_ok, horovodrun, run_bounded

SCRIPTS = REPO / "tests" / "scripts"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")]
LEGACY = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1"}
KERAS3 = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "0"}


def results(out_dir: Path, job: JobResult) -> dict[int, dict]:
    found = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out_dir.glob("result.*.json")}
    assert sorted(found) == [0, 1], f"expected a result file from each rank\n{job.describe()}"
    return found


def test_plain_horovod_keras_pattern_averages_under_tf_keras(tmp_path):
    """One controller: Keras's optimizer reaches the same allreduce under both (tests/horovod/test_conformance.py
    runs TensorFlow's collectives under Gloo and MPI)."""
    job = expect_ok(horovodrun(SCRIPTS / "keras_plain.py", str(tmp_path), controller="gloo", env=LEGACY))
    found = results(tmp_path, job)
    assert {r["keras"] for r in found.values()} == {"tf_keras"}
    # Rank r fits y = r + 1 from w = 0 with SGD(0.1): the averaged gradient gives 0.3; rank 0's own 0.2, rank 1's 0.4.
    assert [found[r]["w"] for r in (0, 1)] == [pytest.approx(0.3, abs=1e-6)] * 2, found


def test_plain_horovod_keras_pattern_is_refused_under_keras_3(tmp_path):
    job = horovodrun(SCRIPTS / "keras_plain.py", str(tmp_path), controller="gloo", env=KERAS3)
    assert job.returncode != 0, job.describe()
    assert not list(tmp_path.glob("result.*.json")), "a rank trained under Keras 3"
    for rank in (0, 1):
        refusal = (tmp_path / f"refused.{rank}.txt").read_text()
        assert refusal.startswith("horovod.common.keras_version.UnsupportedKerasError: DistributedOptimizer got a "
                                  "Keras 3."), refusal
        assert "bypasses Horovod's allreduce" in refusal
        assert 'pip install "tf-keras==2.21.*" and set TF_USE_LEGACY_KERAS=1 before tensorflow is imported' in refusal
    assert "UnsupportedKerasError: DistributedOptimizer got a Keras 3." in job.output, job.describe()


def test_every_keras_entry_point_refuses_keras_3():
    """Callbacks, elastic state and callbacks, load_model: each refuses before touching a Keras 3 object."""
    job = run_bounded([str(BIN / "python"), str(SCRIPTS / "keras3_entry_points.py")], timeout=180, env=KERAS3)
    assert job.returncode == 0, job.describe()
    lines = [line for line in job.output.splitlines() if line.startswith(("REFUSED ", "ACCEPTED "))]
    names = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
             "LearningRateScheduleCallback", "CommitStateCallback", "UpdateBatchStateCallback",
             "UpdateEpochStateCallback", "KerasState", "load_model", "DistributedOptimizer"]
    assert lines == [f"REFUSED {name}" for name in names], job.describe()


def test_a_keras_3_optimizer_is_refused_even_when_tf_keras_is_keras_2(tmp_path):
    """`import keras` is Keras 3 whatever TF_USE_LEGACY_KERAS says: an optimizer made from it never trains."""
    job = run_bounded([str(BIN / "python"), str(SCRIPTS / "keras_plain.py"), str(tmp_path), "keras3-optimizer"],
                      timeout=180, env=LEGACY)  # one process, no horovodrun: hvd.init() alone is a job of one
    assert job.returncode == 1, job.describe()
    assert "UnsupportedKerasError: DistributedOptimizer got a Keras 3." in job.output, job.describe()
    assert "(keras.src.optimizers.sgd.SGD)" in job.output and not list(tmp_path.glob("result.*.json"))


def test_every_keras_callback_of_horovods_examples_works_under_tf_keras(tmp_path):
    job = expect_ok(horovodrun(SCRIPTS / "keras_callbacks.py", str(tmp_path), controller="gloo", env=LEGACY,
                               timeout=240))
    r0, r1 = (results(tmp_path, job)[r] for r in (0, 1))
    assert r0["keras"] == "tf_keras"
    assert r0["initial"] != r1["initial"], "the ranks started equal: the broadcast would prove nothing"
    assert r0["final"] == r1["final"], "BroadcastGlobalVariablesCallback + DistributedOptimizer: weights differ"
    lr, steps, size = r0["lr"], r0["steps"], r0["size"]
    for e0, e1 in zip(r0["epochs"], r1["epochs"], strict=True):
        assert e0["loss"] == e1["loss"], f"MetricAverageCallback did not average epoch {e0['epoch']}'s loss"
    # Warmup (Goyal et al., as Horovod writes it), per batch: lr / size * (1 + t (size - 1) / warmup) after t epochs
    # (the batch about to run counted done); then x1 for epochs 2-3 and x0.1 from 4, set at each epoch's first batch.
    lrs = [lr / size * (1 + (e + (b + 1) / steps) * (size - 1) / 2) for e in range(2) for b in range(steps)]
    lrs += [lr] * (2 * steps) + [lr * 0.1] * (2 * steps)
    assert r0["batch_lr"] == pytest.approx(lrs, rel=1e-6)
    assert [e["lr"] for e in r0["epochs"]] == pytest.approx([lr * 0.75, lr, lr, lr, lr * 0.1, lr * 0.1], rel=1e-6)
    # Momentum correction: momentum * new_lr / old_lr for the batch the lr changes in, restored after it.
    previous = [lr, *lrs[:-1]]
    assert r0["batch_momentum"] == pytest.approx([0.9 * new / old for new, old in zip(lrs, previous, strict=True)])
    assert min(r0["batch_momentum"]) == pytest.approx(0.09), "the x0.1 step did not correct the momentum"
    assert [e["momentum"] for e in r0["epochs"]] == pytest.approx([0.9] * 6)
    # Keras 2.11+'s SGD keeps momentum as a float its compiled step already read: the lr still warms up, the
    # correction is skipped with one warning (0.28.1 crashed: 'float' object has no attribute 'dtype').
    new = r0["new_optimizer"]
    assert new["batch_lr"] == pytest.approx(lrs[:steps], rel=1e-6) and new["batch_momentum"] == [0.9] * steps
    assert len(new["warnings"]) == 1 and "momentum correction skipped: SGD keeps momentum as a Python number" \
        in new["warnings"][0] and "tf.keras.optimizers.legacy.SGD" in new["warnings"][0], new
    # Elastic callbacks: epochs counted, batch reset at each epoch's end, a commit every 2 batches and per epoch.
    assert [(e["state_epoch"], e["state_batch"]) for e in r0["epochs"]] == [(e + 1, 0) for e in range(6)]
    assert r0["commits"] == 6 * (steps // 2 + 1)


def test_tf_keras_backend_is_bound_in_horovods_keras_modules():
    """Horovod bound `from keras import backend as K` (Keras 3's, no get_value): the patch binds tf.keras's."""
    code = ("import horovod.tensorflow.keras as hvd, horovod.tensorflow.keras.callbacks as cb, tensorflow as tf; "
            "assert hvd.K is tf.keras.backend and cb.K is tf.keras.backend, (hvd.K, cb.K); "
            "print('OK', hvd.K.__name__, hasattr(hvd.K, 'get_value'))")
    job = run_bounded([str(BIN / "python"), "-c", code], timeout=120, env={**os.environ, **LEGACY})
    assert job.returncode == 0 and "OK tf_keras" in job.output and job.output.rstrip().endswith("True"), \
        job.describe()
