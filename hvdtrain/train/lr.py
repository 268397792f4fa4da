"""Gradual warmup and step schedule for data-parallel training, from plain values.

Goyal et al., "Accurate, Large Minibatch SGD" (2017): with `size` workers the effective batch is `size` times
larger, so the LR is scaled by `size` (and by `backward_passes_per_step`, which grows the batch the same way), and
reached linearly during the first epochs. The scaling is the recipe's own, inline, as in Horovod's examples
(`lr = base_lr * hvd.size()`): an `LRSchedule` takes the scaled LR (`peak_lr`) and the LR its warmup starts from
(`start_lr`: the single-worker LR, `peak_lr / size`, as Horovod's `LearningRateWarmupCallback` and
`examples/pytorch/pytorch_imagenet_resnet50.py`'s `adjust_learning_rate` do) and knows nothing of the world size.
After the warmup the LR is multiplied by `gamma` at each milestone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvdtrain.settings.recipes import check_schedule


@dataclass(frozen=True)
class LRSchedule:
    """LR as a function of the (fractional) epoch: from `start_lr` up to `peak_lr` (linearly, over the first
    `warmup_epochs`), then `peak_lr` × `gamma` per milestone passed. `start_lr` is needed only with a warmup."""

    peak_lr: float
    start_lr: float | None = None
    warmup_epochs: float = 0.0
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1

    def __post_init__(self) -> None:
        _check(self.peak_lr > 0 and math.isfinite(self.peak_lr), "peak_lr", self.peak_lr, "a finite number > 0")
        check_schedule(self.warmup_epochs, self.milestones, self.gamma)  # the rules the recipes' flags follow
        if self.warmup_epochs > 0 or self.start_lr is not None:
            _check(self.start_lr is not None and self.start_lr > 0 and math.isfinite(self.start_lr), "start_lr",
                   self.start_lr, "a finite number > 0 with a warmup (the LR it starts from: peak_lr / world size)")

    def lr_at(self, epoch: float) -> float:
        """LR at fractional epoch `epoch` (0-based; 1.5 = halfway through the second epoch)."""
        if epoch < 0 or not math.isfinite(epoch):
            raise ValueError(f"epoch must be a finite number >= 0, got {epoch!r}")
        if epoch < self.warmup_epochs:
            start = self.start_lr if self.start_lr is not None else self.peak_lr  # set with a warmup (checked)
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
