"""Horovod's Keras integration used directly (no hvdtrain code), as Horovod's own examples use it, on this build.

Keras 3 (tf.keras of TensorFlow >= 2.16, and `import keras`) on the TensorFlow backend averages as tf_keras
(TF_USE_LEGACY_KERAS=1) does: the plain pattern (w = 0.3), an MLP against one process on the combined batch (fit,
Horovod's tape, apply(), gradient accumulation, clipping, groups, mixed_float16's loss scale), Horovod's TF2 MNIST
example, every callback of its Keras examples, and Horovod's own v0.28.1 Keras tests ported to Keras 3 (Gloo and
MPI). Keras 3 on another backend is refused, naming it. Two real ranks each (horovodrun -np 2); the ranks write what
they saw, the checks are here.
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
KERAS = {"tf_keras": LEGACY, "keras3": KERAS3}
PACKAGE = {"tf_keras": "tf_keras", "keras3": "keras"}  # the package tf.keras's classes come from


def results(out_dir: Path, job: JobResult) -> dict[int, dict]:
    found = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out_dir.glob("result.*.json")}
    assert sorted(found) == [0, 1], f"expected a result file from each rank\n{job.describe()}"
    return found


@pytest.mark.parametrize("keras", ["tf_keras", "keras3"])
def test_an_mlp_trains_on_two_ranks_as_one_process_on_the_combined_batch(tmp_path, keras):
    job = expect_ok(horovodrun(SCRIPTS / "keras_combined_batch.py", str(tmp_path), controller="gloo",
                               env=KERAS[keras], timeout=240))
    r0, r1 = (results(tmp_path, job)[r] for r in (0, 1))
    assert r0["keras"] == PACKAGE[keras]
    expected = ["plain", "fit", "tape"] + (["apply", "accumulate", "clipnorm", "groups", "auto_xla", "mixed"]
                                           if keras == "keras3" else [])
    assert list(r0["runs"]) == expected, r0
    # The plain pattern: w = 0.3 on both ranks (the averaged step; each rank's own gradient would give 0.2 and 0.4).
    assert [r["runs"].pop("plain")["w"] for r in (r0, r1)] == [pytest.approx(0.3, abs=1e-6)] * 2, (r0, r1)
    expected.remove("plain")
    if keras == "keras3":  # Keras turns XLA on where a GPU is; not with Horovod's ops (no XLA kernels)
        assert r0["runs"].pop("auto_xla") == {"plain": True, "horovod": False}, r0
        expected.remove("auto_xla")
    for name in expected:
        assert r0["runs"][name]["digest"] == r1["runs"][name]["digest"], f"{name}: the ranks' weights differ"
        if name != "mixed":  # 3 epochs of 4 steps within 1e-5 of the reference, which moved the weights
            assert r0["runs"][name]["diff"] < 1e-5, (name, r0["runs"][name])
            assert r0["runs"][name]["moved"] > 0.01, (name, r0["runs"][name])
            # 3 epochs of 4 steps; accumulating: 12 micro-steps, an update every 2
            assert r0["runs"][name]["iterations"] == (6 if name == "accumulate" else 12), (name, r0["runs"][name])
    if keras == "keras3":
        # compile() wrapped the DistributedOptimizer in a LossScaleOptimizer; rank 1's half of every epoch's second
        # step overflowed float16: that step was skipped on both ranks (3 of 12) and the scale halved 3 times.
        mixed = r0["runs"]["mixed"]
        assert (mixed["optimizer"], mixed["inner"], mixed["iterations"], mixed["finite"]) == \
            ("LossScaleOptimizer", "SGD", 9, True), mixed
        assert mixed["scale"] == mixed["initial_scale"] / 8 == r1["runs"]["mixed"]["scale"], (mixed, r1)


def test_horovods_tf2_mnist_example_trains_under_keras_3(tmp_path):
    """Horovod's examples/tensorflow2/tensorflow2_mnist.py (hvd.DistributedGradientTape in a tf.function, the
    first step's broadcast of model and `opt.variables()`), data aside, as written for Keras 2."""
    job = expect_ok(horovodrun(SCRIPTS / "horovod_tf2_mnist.py", str(tmp_path), controller="gloo", env=KERAS3,
                               timeout=240))
    r0, r1 = (results(tmp_path, job)[r] for r in (0, 1))
    assert r0["keras"] == "keras"
    assert (r0["weights"], r0["optimizer_state"]) == (r1["weights"], r1["optimizer_state"]), (r0, r1)
    for r in (r0, r1):
        assert sum(r["losses"][-3:]) / 3 < 0.9 * r["losses"][0], r["losses"]
    assert (tmp_path / "checkpoint").is_file() and len(list(tmp_path.glob("checkpoints-1.*"))) == 2


def test_keras_3_on_another_backend_is_refused_naming_it():
    """KERAS_BACKEND=torch: each entry point of horovod.keras refuses before touching a Keras object."""
    job = run_bounded([str(BIN / "python"), str(SCRIPTS / "keras3_entry_points.py")], timeout=180,
                      env={**os.environ, **KERAS3, "KERAS_BACKEND": "torch"})
    assert job.returncode == 0, job.describe()
    lines = [line for line in job.output.splitlines() if line.startswith(("REFUSED ", "ACCEPTED "))]
    names = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
             "LearningRateScheduleCallback", "CommitStateCallback", "UpdateBatchStateCallback",
             "UpdateEpochStateCallback", "KerasState", "SyncBatchNormalization", "load_model", "DistributedOptimizer"]
    assert [line.split(":")[0] for line in lines] == [f"REFUSED {name}" for name in names], job.describe()
    assert lines[-1] == (
        "REFUSED DistributedOptimizer: DistributedOptimizer: Keras 3 runs on the 'torch' backend here (KERAS_BACKEND), "
        "but Horovod's Keras integration runs on Keras 3's TensorFlow backend only: its allreduce is a TensorFlow op, "
        "which cannot run in the torch backend's train step. Fix: set KERAS_BACKEND=tensorflow before keras is "
        "imported (or, for a torch model, use horovod.torch)."), lines[-1]


def test_horovod_tensorflow_imports_under_a_keras_backend_tf_keras_refuses():
    """KERAS_BACKEND=numpy (jax alike): TensorFlow cannot import its tf.keras; plain TensorFlow code with Horovod
    still works (0.28.1's `import horovod.tensorflow` imported tf.keras and failed), and the one Keras layer in
    horovod.tensorflow says why it cannot be had."""
    code = ("import horovod.tensorflow as hvd, tensorflow as tf\n"
            "hvd.init()\n"
            "print('SUM', hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum).numpy().tolist())\n"
            "try:\n"
            "    hvd.SyncBatchNormalization\n"
            "except Exception as exc:\n"
            "    print('REFUSED', type(exc).__name__, exc)\n")
    job = run_bounded([str(BIN / "python"), "-c", code], timeout=120,
                      env={**os.environ, **KERAS3, "KERAS_BACKEND": "numpy"})
    assert job.returncode == 0 and "SUM [1.0, 2.0]" in job.output, job.describe()
    assert ("REFUSED UnsupportedKerasError hvd.SyncBatchNormalization is a tf.keras layer, and tf.keras cannot be "
            "imported with KERAS_BACKEND=numpy") in job.output and "Fix: set KERAS_BACKEND=tensorflow" in job.output, \
        job.describe()


@pytest.mark.parametrize("keras", ["tf_keras", "keras3"])
def test_every_keras_callback_of_horovods_examples_works(tmp_path, keras):
    job = expect_ok(horovodrun(SCRIPTS / "keras_callbacks.py", str(tmp_path), controller="gloo", env=KERAS[keras],
                               timeout=240))
    r0, r1 = (results(tmp_path, job)[r] for r in (0, 1))
    assert r0["keras"] == PACKAGE[keras]
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
    assert [e["momentum"] for e in r0["epochs"]] == pytest.approx([0.9] * 6)
    if keras == "tf_keras":  # momentum correction: momentum * new_lr / old_lr for the batch the lr changes in
        previous = [lr, *lrs[:-1]]
        assert r0["batch_momentum"] == pytest.approx([0.9 * new / old for new, old in zip(lrs, previous, strict=True)])
        assert min(r0["batch_momentum"]) == pytest.approx(0.09), "the x0.1 step did not correct the momentum"
    else:  # Keras 3's optimizers all keep momentum as a Python number (below): never corrected
        assert r0["batch_momentum"] == [0.9] * len(lrs)
    # Keras 2.11+'s SGD keeps momentum as a float its compiled step already read: the lr still warms up, the
    # correction is skipped with one warning (0.28.1 crashed: 'float' object has no attribute 'dtype').
    new = r0["new_optimizer"]
    assert new["batch_lr"] == pytest.approx(lrs[:steps], rel=1e-6) and new["batch_momentum"] == [0.9] * steps
    advice = {"tf_keras": "Use tf.keras.optimizers.legacy.SGD for momentum correction, or pass momentum_correction",
              "keras3": "Keras 3's optimizers all do (none has momentum as a variable): pass momentum_correction"}
    assert len(new["warnings"]) == 1 and "momentum correction skipped: SGD keeps momentum as a Python number" \
        in new["warnings"][0] and advice[keras] in new["warnings"][0], new
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


# Horovod's own v0.28.1 Keras tests, ported to Keras 3 (tests/scripts/keras3_upstream.py; each port listed in
# docs/recipes.md), the plain pattern with `import keras` (w = 0.3 on both ranks), and what upstream tested only on
# Keras 2: the op, compression and SyncBatchNormalization.
UPSTREAM = {"tf2keras.train_model_lr_schedule", "tf2keras.sparse_as_dense", "keras.sparse_as_dense",
            "tf2keras.sparse_as_dense_with_grad_aggregation", "tf2keras.grad_aggregation_with_inf_grad",
            "tf2keras.from_config", "tf2keras.elastic_state", "keras.from_config", "keras.elastic_state",
            *(f"tf2keras.gradient_aggregation{local}[average={average}]"
              for local in ("", "_with_local_vars") for average in (True, False)),
            "tf2keras.partial_distributed_optimizer", "tf2keras.broadcast_global_variables_callback_with_local_vars",
            "process_sets.process_set_optimizer", "keras.load_model", "keras.load_model_custom_optimizers",
            "keras.load_model_custom_objects", "keras.load_model_broadcast", "keras.plain_pattern",
            "keras3.load_model_adamw_loss_scale_and_plain", "keras3.op_sum_and_fp16_compression",
            "keras3.two_optimizers_in_one_step", "keras3.sync_batch_normalization"}


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovods_own_keras_tests_pass_on_keras_3(tmp_path, controller):
    job = expect_ok(horovodrun(SCRIPTS / "keras3_upstream.py", str(tmp_path), controller=controller, env=KERAS3,
                               timeout=240))
    for rank, result in results(tmp_path, job).items():
        assert result["keras"] == "keras", result
        assert set(result["cases"]) == UPSTREAM, sorted(set(result["cases"]) ^ UPSTREAM)
        failed = {name: outcome for name, outcome in result["cases"].items() if outcome != "ok"}
        assert not failed, f"rank {rank}: {json.dumps(failed, indent=1)}"
