"""LR warmup and step schedule (hvdtrain.train.lr) from plain values: the recipes scale the LR themselves
(`lr = base_lr * hvd.size()`) and hand the schedule the scaled LR and the single-worker LR its warmup starts from."""

from __future__ import annotations

import itertools

import pytest

from hvdtrain.train.lr import LRSchedule, scaled_epochs


def horovod_imagenet_lr(base_lr: float, size: int, bpps: int, warmup: float, epoch: float) -> float:
    """Horovod's examples/pytorch/pytorch_imagenet_resnet50.py adjust_learning_rate, without the decay."""
    lr_adj = 1.0 / size * (epoch * (size - 1) / warmup + 1) if epoch < warmup else 1.0
    return base_lr * size * bpps * lr_adj


def schedule(base_lr: float, size: int, bpps: int = 1, **kwargs) -> LRSchedule:
    """As the PyTorch recipes build it: the LR scaled by world size × backward passes, warmed up from the
    single-worker LR (× backward passes)."""
    return LRSchedule(peak_lr=base_lr * size * bpps, start_lr=base_lr * bpps, **kwargs)


def test_without_warmup_the_lr_is_the_peak_lr_until_a_milestone():
    assert LRSchedule(peak_lr=0.4).lr_at(0.0) == 0.4
    assert LRSchedule(peak_lr=0.4).lr_at(3.0) == 0.4
    assert LRSchedule(peak_lr=0.4, start_lr=0.1).lr_at(0.0) == 0.4  # no warmup: start_lr unused


def test_the_recipes_numbers_are_those_of_the_former_size_aware_schedule():
    """The schedule once scaled base_lr itself (× size × backward passes; warmup from base_lr × backward passes):
    the recipes' inline scaling gives bit-identical LRs."""
    for base, size, bpps, warmup in [(0.05, 2, 1, 2.0), (0.0125, 8, 2, 3.0), (0.1, 3, 3, 1.0), (0.05, 1, 1, 0.0)]:
        s = schedule(base, size, bpps, warmup_epochs=warmup)
        peak, start = base * size * bpps, base * bpps
        for e in [0.0, 0.1, 0.5, 1.0, 2.5, 3.0, 4.0]:
            want = start + (peak - start) * e / warmup if e < warmup else peak
            assert s.lr_at(e) == want, (base, size, bpps, warmup, e)


def test_the_recipes_numbers_equal_values_the_former_schedule_computed():
    """Values printed by the former `LRSchedule(0.0125, size=8, backward_passes_per_step=2, warmup_epochs=3.0,
    milestones=(5, 8))` (hvdtrain 0.8.0), compared exactly."""
    s = schedule(0.0125, 8, 2, warmup_epochs=3.0, milestones=(5, 8))
    assert [s.lr_at(e) for e in (0.0, 0.1, 2.5, 3.0, 5.0, 9.0)] == [
        0.025, 0.030833333333333334, 0.17083333333333334, 0.2, 0.020000000000000004, 0.0020000000000000005]
    assert [s.lr_for_step(e, st, 7) for e, st in ((0, 0), (1, 3), (2, 6), (4, 0), (6, 2))] == [
        0.03333333333333333, 0.11666666666666667, 0.2, 0.2, 0.020000000000000004]


def test_warmup_ramps_linearly_from_start_lr_to_peak_lr():
    s = LRSchedule(peak_lr=0.4, start_lr=0.1, warmup_epochs=5)
    assert s.lr_at(0.0) == pytest.approx(0.1)
    assert s.lr_at(2.5) == pytest.approx(0.25)
    assert s.lr_at(5.0) == pytest.approx(0.4)
    assert s.lr_at(7.0) == pytest.approx(0.4)
    lrs = [s.lr_at(e / 10) for e in range(51)]
    assert all(b > a for a, b in itertools.pairwise(lrs)), "warmup must increase monotonically"


@pytest.mark.parametrize("size,bpps,warmup", [(2, 1, 1.0), (4, 1, 5.0), (8, 2, 3.0)])
def test_warmup_matches_horovod_imagenet_example(size, bpps, warmup):
    s = schedule(0.0125, size, bpps, warmup_epochs=warmup)
    for e in [0.0, 0.1, 0.5, 1.0, 2.0, 2.9, 3.0, 4.99, 5.0, 6.0]:
        assert s.lr_at(e) == pytest.approx(horovod_imagenet_lr(0.0125, size, bpps, warmup, e)), e


def test_per_step_lr_is_evaluated_at_the_end_of_the_step():
    s = schedule(0.1, 2, warmup_epochs=2)
    assert s.lr_for_step(0, 0, 10) == pytest.approx(s.lr_at(0.1))
    assert s.lr_for_step(0, 9, 10) == pytest.approx(s.lr_at(1.0)) == pytest.approx(0.15)
    assert s.lr_for_step(1, 9, 10) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="step must be in"):
        s.lr_for_step(0, 10, 10)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        s.lr_for_step(0, 0, 0)


def test_step_schedule_multiplies_by_gamma_at_each_milestone():
    s = schedule(0.1, 2, warmup_epochs=1, milestones=(3, 6), gamma=0.5)
    assert s.lr_at(2.99) == pytest.approx(0.2)
    assert s.lr_at(3.0) == pytest.approx(0.1)
    assert s.lr_at(5.5) == pytest.approx(0.1)
    assert s.lr_at(6.0) == pytest.approx(0.05)
    assert s.lr_at(100.0) == pytest.approx(0.05)


def test_a_milestone_applies_from_the_first_step_of_its_epoch_to_the_last():
    """Milestone 3 (0-based epoch 3, the 4th): epoch 2's last step still trains at the peak LR, every step of
    epoch 3 at the decayed one (the per-step LR is what both recipes use, Keras through Horovod's callback)."""
    s = schedule(0.1, 2, warmup_epochs=1, milestones=(3,), gamma=0.1)
    assert [s.lr_for_step(2, k, 10) for k in (0, 9)] == pytest.approx([0.2, 0.2])
    assert [s.lr_for_step(3, k, 10) for k in (0, 9)] == pytest.approx([0.02, 0.02])
    assert s.lr_for_step(0, 9, 10) == pytest.approx(0.2)  # the warmup's last step reaches the peak


def test_epochs_scaled_by_world_size_like_horovods_keras_example():
    assert scaled_epochs(10, 4, True) == 3
    assert scaled_epochs(12, 4, True) == 3
    assert scaled_epochs(1, 8, True) == 1
    assert scaled_epochs(10, 4, False) == 10


@pytest.mark.parametrize("kwargs,name", [
    ({"peak_lr": 0.0}, "peak_lr"),
    ({"peak_lr": float("nan")}, "peak_lr"),
    ({"peak_lr": 0.1, "warmup_epochs": 2}, "start_lr"),
    ({"peak_lr": 0.1, "start_lr": 0.0, "warmup_epochs": 2}, "start_lr"),
    ({"peak_lr": 0.1, "start_lr": float("inf")}, "start_lr"),
    ({"peak_lr": 0.1, "warmup_epochs": -1}, "warmup_epochs"),
    ({"peak_lr": 0.1, "milestones": (5, 3)}, "milestones"),
    ({"peak_lr": 0.1, "milestones": (0,)}, "milestones"),
    ({"peak_lr": 0.1, "gamma": 0.0}, "gamma"),
    ({"peak_lr": 0.1, "gamma": 1.5}, "gamma"),
])
def test_bad_values_are_rejected_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be .*got"):
        LRSchedule(**kwargs)


def test_bad_epoch_arguments_are_rejected():
    with pytest.raises(ValueError, match="epoch must be"):
        LRSchedule(peak_lr=0.1).lr_at(-0.5)
    with pytest.raises(ValueError, match="epochs must be"):
        scaled_epochs(0, 2, True)
    with pytest.raises(ValueError, match="size must be"):
        scaled_epochs(5, 0, True)
