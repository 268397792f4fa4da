"""LR scaling, warmup and step schedule (hvdtrain.train.lr) from plain values."""

from __future__ import annotations

import itertools

import pytest

from hvdtrain.train.lr import LRSchedule, scaled_epochs


def horovod_imagenet_lr(base_lr: float, size: int, bpps: int, warmup: float, epoch: float) -> float:
    """Horovod's examples/pytorch/pytorch_imagenet_resnet50.py adjust_learning_rate, without the decay."""
    lr_adj = 1.0 / size * (epoch * (size - 1) / warmup + 1) if epoch < warmup else 1.0
    return base_lr * size * bpps * lr_adj


def test_lr_is_scaled_by_world_size_and_backward_passes():
    assert LRSchedule(base_lr=0.1, size=4).lr_at(0.0) == pytest.approx(0.4)
    assert LRSchedule(base_lr=0.1, size=4, backward_passes_per_step=2).peak_lr == pytest.approx(0.8)
    assert LRSchedule(base_lr=0.1, size=1).lr_at(3.0) == pytest.approx(0.1)


def test_warmup_ramps_linearly_from_unscaled_to_scaled_lr():
    s = LRSchedule(base_lr=0.1, size=4, warmup_epochs=5)
    assert s.lr_at(0.0) == pytest.approx(0.1)
    assert s.lr_at(2.5) == pytest.approx(0.25)
    assert s.lr_at(5.0) == pytest.approx(0.4)
    assert s.lr_at(7.0) == pytest.approx(0.4)
    lrs = [s.lr_at(e / 10) for e in range(51)]
    assert all(b > a for a, b in itertools.pairwise(lrs)), "warmup must increase monotonically"


@pytest.mark.parametrize("size,bpps,warmup", [(2, 1, 1.0), (4, 1, 5.0), (8, 2, 3.0)])
def test_warmup_matches_horovod_imagenet_example(size, bpps, warmup):
    s = LRSchedule(base_lr=0.0125, size=size, backward_passes_per_step=bpps, warmup_epochs=warmup)
    for e in [0.0, 0.1, 0.5, 1.0, 2.0, 2.9, 3.0, 4.99, 5.0, 6.0]:
        assert s.lr_at(e) == pytest.approx(horovod_imagenet_lr(0.0125, size, bpps, warmup, e)), e


def test_per_step_lr_is_evaluated_at_the_end_of_the_step():
    s = LRSchedule(base_lr=0.1, size=2, warmup_epochs=2)
    assert s.lr_for_step(0, 0, 10) == pytest.approx(s.lr_at(0.1))
    assert s.lr_for_step(0, 9, 10) == pytest.approx(s.lr_at(1.0)) == pytest.approx(0.15)
    assert s.lr_for_step(1, 9, 10) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="step must be in"):
        s.lr_for_step(0, 10, 10)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        s.lr_for_step(0, 0, 0)


def test_step_schedule_multiplies_by_gamma_at_each_milestone():
    s = LRSchedule(base_lr=0.1, size=2, warmup_epochs=1, milestones=(3, 6), gamma=0.5)
    assert s.lr_at(2.99) == pytest.approx(0.2)
    assert s.lr_at(3.0) == pytest.approx(0.1)
    assert s.lr_at(5.5) == pytest.approx(0.1)
    assert s.lr_at(6.0) == pytest.approx(0.05)
    assert s.lr_at(100.0) == pytest.approx(0.05)


def test_a_milestone_applies_from_the_first_step_of_its_epoch_to_the_last():
    """Milestone 3 (0-based epoch 3, the 4th): epoch 2's last step still trains at the peak LR, every step of
    epoch 3 at the decayed one (the per-step LR is what both recipes use, Keras through Horovod's callback)."""
    s = LRSchedule(base_lr=0.1, size=2, warmup_epochs=1, milestones=(3,), gamma=0.1)
    assert [s.lr_for_step(2, k, 10) for k in (0, 9)] == pytest.approx([0.2, 0.2])
    assert [s.lr_for_step(3, k, 10) for k in (0, 9)] == pytest.approx([0.02, 0.02])
    assert s.lr_for_step(0, 9, 10) == pytest.approx(0.2)  # the warmup's last step reaches the peak


def test_epochs_scaled_by_world_size_like_horovods_keras_example():
    assert scaled_epochs(10, 4, True) == 3
    assert scaled_epochs(12, 4, True) == 3
    assert scaled_epochs(1, 8, True) == 1
    assert scaled_epochs(10, 4, False) == 10


@pytest.mark.parametrize("kwargs,name", [
    ({"base_lr": 0.0}, "base_lr"),
    ({"base_lr": float("nan")}, "base_lr"),
    ({"base_lr": 0.1, "size": 0}, "size"),
    ({"base_lr": 0.1, "backward_passes_per_step": 0}, "backward_passes_per_step"),
    ({"base_lr": 0.1, "warmup_epochs": -1}, "warmup_epochs"),
    ({"base_lr": 0.1, "milestones": (5, 3)}, "milestones"),
    ({"base_lr": 0.1, "milestones": (0,)}, "milestones"),
    ({"base_lr": 0.1, "gamma": 0.0}, "gamma"),
    ({"base_lr": 0.1, "gamma": 1.5}, "gamma"),
])
def test_bad_values_are_rejected_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be .*got"):
        LRSchedule(**kwargs)


def test_bad_epoch_arguments_are_rejected():
    with pytest.raises(ValueError, match="epoch must be"):
        LRSchedule(base_lr=0.1).lr_at(-0.5)
    with pytest.raises(ValueError, match="epochs must be"):
        scaled_epochs(0, 2, True)
    with pytest.raises(ValueError, match="size must be"):
        scaled_epochs(5, 0, True)
