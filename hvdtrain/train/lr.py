"""Learning-rate scaling, gradual warmup and step schedule for data-parallel training, from plain values.

Goyal et al., "Accurate, Large Minibatch SGD" (2017): with `size` workers the effective batch is `size` times
larger, so scale the LR by `size` (and by `backward_passes_per_step`, which grows the batch the same way), and
ramp up to that LR linearly during the first epochs. Same formula as Horovod's
`examples/pytorch/pytorch_imagenet_resnet50.py` (`adjust_learning_rate`): the warmup starts at the unscaled
LR and reaches the scaled one after `warmup_epochs`; then the LR is multiplied by `gamma` at each milestone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """LR as a function of the (fractional) epoch. `base_lr` is the single-worker LR."""

    base_lr: float
    size: int = 1
    backward_passes_per_step: int = 1
    warmup_epochs: float = 0.0
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _check(self.base_lr > 0 and math.isfinite(self.base_lr), "base_lr", self.base_lr,
               "a finite number > 0")
        _check(isinstance(self.size, int) and self.size >= 1, "size", self.size, "an int >= 1")
        _check(isinstance(self.backward_passes_per_step, int) and self.backward_passes_per_step >= 1,
               "backward_passes_per_step", self.backward_passes_per_step, "an int >= 1")
        _check(self.warmup_epochs >= 0 and math.isfinite(self.warmup_epochs),
               "warmup_epochs", self.warmup_epochs, "a finite number >= 0")
        ms = self.milestones
        _check(all(isinstance(m, int) and m >= 1 for m in ms) and list(ms) == sorted(set(ms)),
               "milestones", ms, "strictly increasing ints >= 1 (epochs)")
        _check(0 < self.gamma <= 1, "gamma", self.gamma, "a number in (0, 1]")

    @property
    def peak_lr(self) -> float:
        """base_lr × size × backward_passes_per_step: the LR after warmup, before any milestone."""
        return self.base_lr * self.size * self.backward_passes_per_step

    def lr_at(self, epoch: float) -> float:
        """LR at fractional epoch `epoch` (0-based; 1.5 = halfway through the second epoch)."""
        if epoch < 0 or not math.isfinite(epoch):
            raise ValueError(f"epoch must be a finite number >= 0, got {epoch!r}")
        if epoch < self.warmup_epochs:
            start = self.base_lr * self.backward_passes_per_step
            return start + (self.peak_lr - start) * epoch / self.warmup_epochs
        decays = sum(1 for m in self.milestones if epoch >= m)
        return self.peak_lr * self.gamma**decays

    def lr_for_step(self, epoch: int, step: int, steps_per_epoch: int) -> float:
        """LR for optimizer step `step` (0-based) of epoch `epoch` (0-based): the warmup evaluated at the step's end
        (its last step trains at the peak LR); a milestone m applies from the first step of epoch m (0-based, as
        torch's MultiStepLR): every step of an epoch after the warmup has one LR."""
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch!r}")
        if not 0 <= step < steps_per_epoch:
            raise ValueError(f"step must be in [0, {steps_per_epoch}), got {step!r}")
        end = epoch + (step + 1) / steps_per_epoch
        if end < self.warmup_epochs:
            return self.lr_at(end)
        return self.peak_lr * self.gamma ** sum(1 for m in self.milestones if epoch >= m)


def scaled_epochs(epochs: int, size: int, scale_by_size: bool) -> int:
    """Total epochs to run: `epochs`, or `ceil(epochs / size)` as in Horovod's Keras MNIST example."""
    _check(isinstance(epochs, int) and epochs >= 1, "epochs", epochs, "an int >= 1")
    _check(isinstance(size, int) and size >= 1, "size", size, "an int >= 1")
    return math.ceil(epochs / size) if scale_by_size else epochs


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
