"""The Keras recipe's --precision bf16/fp16 averages gradients over the ranks (the trap: an optimizer Horovod does not
wrap trains each rank alone, silently), and fp16's loss scale skips an overflowing step on every rank alike: on
Keras 3 (the recipe's default) and on tf_keras (TF_USE_LEGACY_KERAS=1), whose loss scaling decides otherwise
(NOTE [Keras loss scaling with Horovod] in hvdtrain/train/keraskit.py).

Two real ranks (horovodrun -np 2 --gloo) run tests/scripts/keras_precision_step.py: one SGD step of the recipe's model
and optimizer (hvdtrain.train.keraskit: set_precision, build_model, loss_scaled around hvd.DistributedOptimizer) with
DIFFERENT data on each rank, next to a one-process reference step on the union of both ranks' data (its gradient is
the average of theirs) and a control step on the rank's own data without Horovod. Errors are measured relative to
the size of the reference update.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.support.harness import REPO, expect_ok, horovodrun

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow not installed")]
SCRIPT = REPO / "tests" / "scripts" / "keras_precision_step.py"
KERASES = {"keras3": "0", "tf_keras": "1"}  # TF_USE_LEGACY_KERAS: the recipe's default, and Keras 2 behind the switch
LOSS_SCALER = {"keras3": "LossScaleOptimizer", "tf_keras": "LossScaleOptimizerV3"}
# |horovod - reference| / |reference - w0|, from the arithmetic: the two steps differ only by rounding (one batch of 32
# against two batches of 16, averaged), and each gradient element goes through about 8 roundings to the 16-bit type
# (forward and backward through the model's layers, the loss), each off by at most the unit roundoff u (2^-8 for
# bfloat16's 8 significant bits, 2^-11 for float16's 11) relative to the magnitudes summed. Twice that, 16 u, bounds
# it: 6.25% (bf16), 0.78% (fp16). Measured 0.4-2.2% (bf16; the larger on a busy machine, whose thread pools split
# the sums otherwise) and 0.15% (fp16). Without averaging the ranks part by 129-155% of the update.
ROUNDINGS = 16
TOLERANCE = {"bf16": ROUNDINGS * 2.0**-8, "fp16": ROUNDINGS * 2.0**-11}


@pytest.fixture(scope="module")
def step_results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], list[dict[str, Any]]]:
    """Each rank's result for a Keras and a precision (the job runs once per pair in this module)."""
    done: dict[tuple[str, str], list[dict[str, Any]]] = {}

    def run(keras: str, precision: str) -> list[dict[str, Any]]:
        if (keras, precision) not in done:
            out = tmp_path_factory.mktemp(f"{keras}-{precision}")
            env = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": KERASES[keras]}
            job = expect_ok(horovodrun(SCRIPT, str(out), precision, controller="gloo", env=env, timeout=180))
            found = sorted(out.glob("result.*.json"))
            assert [p.name for p in found] == ["result.0.json", "result.1.json"], job.describe()
            done[keras, precision] = [{k: np.array(v) if isinstance(v, list) and k != "variable_dtypes" else v
                                for k, v in json.loads(p.read_text()).items()} for p in found]
        return done[keras, precision]
    return run


@pytest.mark.parametrize("keras,precision", [("keras3", "bf16"), ("keras3", "fp16"), ("tf_keras", "fp16")])
def test_one_step_applies_the_averaged_gradient_on_every_rank(step_results: Any, keras: str, precision: str) -> None:
    r0, r1 = step_results(keras, precision)
    # the mixed policy: 16-bit layers, float32 weights and output (the loss in float32); fp16 scales the loss
    assert (r0["compute_dtype"], r0["output_dtype"]) == ({"bf16": "bfloat16", "fp16": "float16"}[precision], "float32")
    assert r0["variable_dtypes"] == ["float32"]
    assert r0["optimizer"] == (LOSS_SCALER[keras] if precision == "fp16" else "SGD")
    assert r0["w0"].tobytes() == r1["w0"].tobytes(), "the ranks started from different weights"
    update = np.abs(r0["reference"] - r0["w0"]).max()
    assert update > 1e-3, "the reference step moved nothing: the comparison would prove nothing"
    # identical weights on both ranks after the step, bit for bit
    assert r0["horovod"].tobytes() == r1["horovod"].tobytes(), "the ranks' weights differ after one step"
    # ... and they are the averaged gradient's step: the reference's, on the union of both ranks' data
    error = np.abs(r0["horovod"] - r0["reference"]).max() / update
    assert error < TOLERANCE[precision], f"{precision}: {error:.2%} of the update away from the averaged step"
    # the control: each rank's own gradient alone would have parted the ranks by far more than the tolerance
    apart = np.abs(r0["alone"] - r1["alone"]).max() / update
    assert apart > 0.3, f"the ranks' own steps differ by {apart:.2%} only: their data is too alike to prove anything"
    # (a rank alone is half the ranks' distance from the average: 65-78% of the update, 10x bf16's bound)
    assert np.abs(r0["alone"] - r0["reference"]).max() / update > 5 * TOLERANCE[precision]
    if precision == "fp16":
        assert r0["scale_before"] == r0["scale_after"] == r1["scale_after"] == 2.0 ** 15


@pytest.mark.parametrize("keras", ["keras3", "tf_keras"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(step_results: Any, keras: str) -> None:
    """Rank 1's batch overflows float16, rank 0's does not: the averaged gradient is non-finite on both, so both skip
    the step and halve the scale (NOTE [Keras loss scaling with Horovod]); alone, rank 0 would step and keep its
    scale while rank 1 skips: the weights and scales would part."""
    r0, r1 = step_results(keras, "fp16")
    for r in (r0, r1):
        assert r["horovod_overflow"].tobytes() == r["horovod"].tobytes(), f"rank {r['rank']} stepped on an overflow"
        assert r["scale_after_overflow"] == 2.0 ** 14
    assert np.abs(r0["alone_overflow"] - r0["alone"]).max() > 1e-3, "the control: rank 0 alone must step"
    assert r1["alone_overflow"].tobytes() == r1["alone"].tobytes()
    assert (r0["alone_scale_after_overflow"], r1["alone_scale_after_overflow"]) == (2.0 ** 15, 2.0 ** 14)
