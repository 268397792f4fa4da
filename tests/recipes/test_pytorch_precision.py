"""Mixed precision, channels-last and torch.compile in the PyTorch recipes (hvdtrain/train/precision.py): the
fp16 scaler's decisions in one process, then real 2-rank recipe runs (bf16 + channels-last + compile; fp16 stopped
and resumed with its loss scale)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

from hvdtrain.settings.parse import parse_config
from hvdtrain.train import checkpoint, divergence, torchkit
from hvdtrain.train.metrics import MetricSums
from hvdtrain.train.precision import MIN_SCALE, Precision, as_input, prepare_model
from hvdtrain.train.stepflags import LateReads
from hvdtrain.train.torchkit import forward_backward, step_vector
from tests.support import recipes
from tests.support.harness import REPO
from tests.support.recipes import checkpoint_state, file_digest

DIGITS = ("--epochs", "3", "--warmup-epochs", "1", "--no-tensorboard")


def overflowing_step(precision: Precision, model: nn.Linear, optimizer: torch.optim.Optimizer) -> bool:
    """One step whose gradients are Inf (an fp16 overflow); returns what `diverged` said."""
    optimizer.zero_grad()
    precision.backward(model(torch.ones(1, 2)).sum())
    model.weight.grad.fill_(float("inf"))
    diverged = precision.diverged(model, optimizer)
    precision.step(optimizer)
    return diverged


def test_fp16_skips_an_overflowing_step_and_diverges_only_once_the_scale_is_spent():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision("fp16", "cpu")
    before = model.weight.detach().clone()
    assert overflowing_step(precision, model, optimizer) is False  # an overflow: skipped, not a divergence
    assert torch.equal(model.weight, before), "the overflowing gradients were applied"
    assert precision.scaler.get_scale() == 2.0 ** 15  # halved from 2**16
    verdicts = [overflowing_step(precision, model, optimizer) for _ in range(30)]
    first = verdicts.index(True)
    assert first == 23 and not any(verdicts[:first])  # 2**16 / 2**24 = 2**-8 = MIN_SCALE
    assert precision.scaler.get_scale() <= MIN_SCALE
    assert precision.state_dict()["scale"] == precision.scaler.get_scale()


def test_fp16_applies_finite_gradients_unscaled():
    torch.manual_seed(0)
    model, reference = nn.Linear(2, 1), nn.Linear(2, 1)
    reference.load_state_dict(model.state_dict())
    for m, precision in ((model, Precision("fp16", "cpu")), (reference, Precision("fp32", "cpu"))):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        precision.backward(m(torch.ones(1, 2)).sum())
        assert not precision.diverged(m, optimizer)
        precision.step(optimizer)
    torch.testing.assert_close(model.weight, reference.weight)


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_forward_runs_in_the_precision_asked_for(name, dtype):
    seen = []
    model = nn.Sequential(nn.Linear(4, 3))
    model.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    sums = MetricSums()
    losses = forward_backward(model, torch.randn(8, 4), torch.randint(0, 3, (8,)), 2, sums, Precision(name, "cpu"))
    assert seen == [dtype, dtype] and len(losses) == 2 and all(isinstance(v, torch.Tensor) for v in losses)
    assert model[0].weight.grad.dtype == torch.float32  # weights and gradients stay fp32
    assert sums.count == 8 and 0 <= float(sums.correct) <= 8


def test_fp32_and_bf16_call_any_nonfinite_average_a_divergence():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for name in ("fp32", "bf16"):
        model.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        assert not Precision(name, "cpu").diverged(model, optimizer)
        model.bias.grad.fill_(float("nan"))
        assert Precision(name, "cpu").diverged(model, optimizer)


def test_step_values_are_read_one_step_late_in_order_and_all_of_them_by_drain():
    """NOTE [flags read a step late]: push(k) gives back step k-1's values; drain gives the rest; the ring of host
    buffers is never overwritten before it is read (the values come back exactly as pushed)."""
    late = LateReads("cpu", width=3)
    pushed = [torch.tensor([float(k % 2), 0.5 * k, -k]) for k in range(5)]
    got = [late.push(k, v) for k, v in enumerate(pushed)]
    assert [[(k, row.tolist()) for k, row in rows] for rows in got] == \
        [[]] + [[(k, pushed[k].tolist())] for k in range(4)]
    assert [(k, row.tolist()) for k, row in late.drain()] == [(4, pushed[4].tolist())]
    assert late.drain() == []
    now = LateReads("cpu", width=1, lag=0)  # lag 0: read at once
    assert [(k, row.tolist()) for k, row in now.push(7, torch.tensor(True))] == [(7, [1.0])]
    with pytest.raises(ValueError, match="expected 1 values, got a tensor of shape \\(2,\\)"):
        now.push(8, torch.zeros(2))


def test_a_short_last_batch_with_fewer_backward_passes_keeps_the_step_vector_width():
    """backward_passes_per_step 4, a last batch of 3 samples: 3 passes; the vector repeats the last loss, so it keeps
    its width for LateReads and `divergence.worst` reads the same loss as from the 3."""
    losses = [torch.tensor(0.5), torch.tensor(float("nan")), torch.tensor(0.7)]
    v = step_vector(torch.tensor(True), losses, width=5)
    assert v.dtype == torch.float32 and v.shape == (5,) and v[0] == 1.0
    assert math.isnan(divergence.worst(v[1:].tolist())) and v[1:].tolist()[-1] == pytest.approx(0.7)
    assert step_vector(torch.tensor(False), [torch.tensor(0.25)], width=2).tolist() == [0.0, 0.25]


def test_nonfinite_is_a_tensor_where_the_gradients_are_and_diverged_reads_it():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    flag = Precision("bf16", "cpu").nonfinite(model, optimizer)
    assert isinstance(flag, torch.Tensor) and flag.shape == () and not bool(flag)
    model.weight.grad[0, 1] = float("inf")
    assert bool(Precision("fp32", "cpu").nonfinite(model, optimizer))


def test_channels_last_lays_out_weights_and_images_and_compile_wraps_the_same_parameters():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    net = prepare_model(model, channels_last=True, compile_model=True)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert net is not model and set(map(id, net.parameters())) == set(map(id, model.parameters()))
    x = torch.randn(2, 3, 8, 8)
    assert as_input(x, True).is_contiguous(memory_format=torch.channels_last)
    flat = torch.randn(2, 5)
    assert as_input(flat, True) is flat and as_input(x, False) is x
    assert prepare_model(model, channels_last=False, compile_model=False) is model


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_channels_last_without_a_gpu_is_refused_saying_why(capsys):
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        import pytorch_train
    finally:
        sys.path.remove(str(REPO / "recipes"))
    with pytest.raises(SystemExit) as exc:
        parse_config(pytorch_train.Config, ["--channels-last"], check=torchkit.check_device)  # as the recipe does
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--channels-last needs a CUDA GPU" in err and "leave --channels-last out" in err


def test_unknown_precision_and_fp16_in_the_elastic_recipe_are_refused(capsys):
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16; got 'fp8'"):
        Precision("fp8", "cpu")
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        import pytorch_elastic
        import pytorch_train
    finally:
        sys.path.remove(str(REPO / "recipes"))
    with pytest.raises(SystemExit):
        parse_config(pytorch_train.Config, ["--precision", "fp8"])
    assert "--precision: invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(pytorch_elastic.Config, ["--precision", "fp16"])
    assert "use --precision bf16" in capsys.readouterr().err


# ---- real 2-rank runs -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bf16_compiled_training_learns_and_ranks_agree(tmp_path):
    """torch.compile trains through the same parameters DistributedOptimizer hooks, forward and validation run in
    bf16, and the ranks end identical. (--channels-last needs a GPU: scripts/gpu_check.sh runs the recipe with it;
    Horovod's side of it, channels-last allreduce and broadcast, is in tests/scripts/conformance_torch.py.) Over 30 s:
    torch.compile's first compilation (inductor's C++ on CPU) in each rank is most of it."""
    run = recipes.run_recipe(recipes.PYTORCH, tmp_path, tmp_path / "run", *DIGITS, "--precision", "bf16", "--compile")
    summary = run.summary()
    assert "bf16  compiled" in run.output
    digests = summary["weights_sha256_by_rank"]
    assert digests[0] == digests[1] == file_digest(checkpoint_state(run, 3)["model"])
    assert summary["val_accuracy"] > 0.85, summary
    assert summary["gpu_idle_share"] is None  # no GPU here: nothing measured, and the summary says so
    assert summary["stall"]["by_rank"][0]["gpu_idle"]["measured"] is False


@pytest.mark.slow
def test_fp16_resumes_with_rank_0s_loss_scale_on_every_rank(tmp_path):
    """The loss scale is checkpointed and broadcast on resume: a rank that kept its own scale would unscale the
    averaged gradients differently and the ranks' weights would part (NOTE [fp16 with Horovod])."""
    run_dir = tmp_path / "run"
    first = recipes.run_recipe(recipes.PYTORCH, tmp_path, run_dir, *DIGITS, "--precision", "fp16",
                               "--stop-after-epoch", "1")
    state = checkpoint_state(first, 1)
    scale = state["precision"]["scale"]  # 2^16 at first, halved at each overflow (BatchNorm's first steps)
    assert 2.0 ** 10 <= scale <= 2.0 ** 16 and math.log2(scale).is_integer(), scale
    state["precision"]["scale"] = 2.0 ** 9  # a scale only the checkpoint knows
    path = run_dir / "checkpoints" / "ckpt-epoch0001.pt"
    path.unlink()
    checkpoint.save(run_dir / "checkpoints", 1, state, torch.save, keep=3)
    second = recipes.run_recipe(recipes.PYTORCH, tmp_path, run_dir, *DIGITS, "--precision", "fp16",
                                "--stop-after-epoch", "2")
    assert "resuming from" in second.output
    assert checkpoint_state(second, 2)["precision"]["scale"] == 2.0 ** 9
    digests = second.summary()["weights_sha256_by_rank"]
    assert digests[0] == digests[1], "the ranks' weights parted after resuming fp16 training"
