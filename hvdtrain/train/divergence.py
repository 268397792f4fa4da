"""Training that went NaN/Inf stops, on every rank at the same step, with a message naming the epoch and step.

NOTE [divergence checks]
A rank that stopped alone would leave the others blocked in their next allreduce, so every check here looks at a
value that is identical on every rank, and needs no collective of its own:
- each step, the *averaged* gradients (after Horovod's allreduce, before the optimizer applies them): a NaN or
  Inf gradient on any rank makes the average non-finite everywhere. The PyTorch recipe computes that flag on the
  device and reads it one step later (NOTE [flags read a step late] in stepflags.py), so the host never waits for
  the GPU; the error still names the step that went bad, and nothing is written after it;
- each epoch, the allreduced metrics (train and validation loss), before the checkpoint is written: this catches
  a rank whose loss alone went bad while its gradients stayed finite.
Keras applies the averaged gradients inside `fit`; there the check reads the weights after each step (identical
on every rank once BroadcastGlobalVariablesCallback ran), which a non-finite average has turned non-finite.
The recipes' `--no-check-finite` turns the checks off (and the load-time check of the samples).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

OPT_OUT = "--no-check-finite"
ADVICE = (f"no checkpoint was written for this epoch. Lower the LR (--base-lr, --warmup-epochs), check the data, or "
          f"pass {OPT_OUT} to train on regardless")


class TrainingDiverged(RuntimeError):
    """The averaged gradients, the weights or the epoch's loss became NaN/Inf: raised on every rank alike."""


def at_step(epoch: int, step: int, steps: int | None, what: str, local_loss: float,
            loss_label: str = "this rank's loss at that step") -> TrainingDiverged:
    """The error for a non-finite step (`epoch`, `step` 0-based; `steps` per epoch if known); `local_loss` is this
    rank's loss there (see `worst`)."""
    where = f"step {step + 1}/{steps}" if steps is not None else f"step {step + 1}"
    return TrainingDiverged(
        f"training diverged at epoch {epoch + 1}, {where}: {what} ({loss_label}: {local_loss:.4g}); {ADVICE}")


def worst(losses: list[float]) -> float:
    """The loss to report for a step of several backward passes: the first NaN/Inf one, else the last."""
    return next((v for v in losses if not math.isfinite(v)), losses[-1] if losses else math.nan)


def check_epoch(epoch: int, metrics: Mapping[str, float]) -> None:
    """Raise TrainingDiverged if an (allreduced) loss of epoch `epoch` (0-based) is NaN/Inf."""
    bad = {k: v for k, v in metrics.items() if k.endswith("loss") and not math.isfinite(v)}
    if bad:
        shown = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in bad.items())
        raise TrainingDiverged(
            f"training diverged in epoch {epoch + 1}: {shown} (averaged over all ranks); {ADVICE}")
