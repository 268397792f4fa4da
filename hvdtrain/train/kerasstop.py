"""Stop requests in the Keras recipe (NOTE [stop requests] in hvdtrain/train/preempt.py): the ranks agree to stop
after the same step, rank 0 checkpoints there (mid-epoch: the loader's position and each rank's metric sums), fit
ends with `Preempted` and the recipe exits 75; the same command run again resumes at that step.

NOTE [Keras stops mid-epoch]
- An exception ends fit, not `model.stop_training`: told to stop, fit (either Keras) still validates and calls every
  `on_epoch_end` for the broken epoch (rank 0's epoch checkpoint would then claim the whole epoch, after a
  validation SIGTERM's grace may not cover). `StopAtBoundary.on_train_batch_end` writes the checkpoint (the
  recipe's `save`: collectives on every rank) and raises `Preempted`: nothing validates, and leaving the loader's
  `with` block stops its producers. It comes last in the callbacks, so the step's other checks (NaN/Inf) ran first.
- The vote is `preempt.StopVote`, its allreduce synchronous (horovod.tensorflow has no handles to wait on later):
  one small collective about every VOTE_EVERY_S. After each epoch's callbacks (rank 0's checkpoint among them) but
  the last epoch's, a blocking vote stops a request heard during validation at the epoch boundary (after the last
  one the run ends anyway, as in the PyTorch recipe).
- The loader's position is counted from the steps Keras trained, not read from the loader: tf.data's thread takes
  batches ahead (prefetch), by a count nobody knows, and may be iterating the loader while the main thread stops.
  `LoaderEpochs` records each epoch's state as it starts it (`starts`), and the stop's position is that state
  advanced by the steps this fit trained in the epoch (`advanced`, on a copy of the sampler, never the live one).
- Each rank's own state is its metric accumulators (the loss's and accuracy's total and count, float32), which
  MetricAverageCallback averages only at the epoch's end: put back as they were, they accumulate on as they would
  have, so the resumed epoch's metrics are the uninterrupted run's bit for bit. Both Kerases create them at the first
  train step; `restore_metrics` creates them (`build_metrics`) when the resumed epoch begins, after fit's
  `reset_metrics`, in `on_epoch_begin`. The model has no dropout: no RNG state to keep.
- Resume: the rest of the stopped epoch is one fit of its own (`steps_per_epoch` = the batches left; the LR, the
  NaN/Inf check and this callback offset by the steps done), the following epochs another. Each fit iterates
  its own `LoaderEpochs`; the first one's input must have ended (`finished`) before the second starts, so that
  one thread at a time iterates the loader.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain.data import ShardSampler, ShmLoader
from hvdtrain.train import checkpoint, preempt
from hvdtrain.train.checkpoint import CheckpointMismatch
from hvdtrain.train.keraskit import KERAS3, Callback, LoaderEpochs, tf
from hvdtrain.train.report import log


class Preempted(Exception):  # not an error: the ranks agreed to stop and checkpointed
    """The ranks stopped at a step boundary; `path` is the checkpoint to resume from."""

    def __init__(self, path: str) -> None:
        super().__init__(f"stopped at a step boundary; checkpoint {path}")
        self.path = path


@dataclass(frozen=True)
class Leg:
    """One `model.fit`: Keras epochs data.first..data.epochs-1 of `data` (keraskit.LoaderEpochs),
    `steps` per epoch; after a stop mid-epoch, the rest of that epoch is a leg of its own: `first_step` steps of it
    were trained before (`steps`: the batches left) and `metrics` are this rank's metric sums then (NOTE [Keras stops
    mid-epoch])."""

    data: Any
    steps: int
    first_step: int = 0
    metrics: list[float] | None = None


def legs(loader: ShmLoader, first: int, epochs: int, steps: int, position: dict[str, Any] | None,
         metrics: list[float] | None, ckpt_dir: Path) -> list[Leg]:
    """The fits from epoch `first` (from `position` if a stop mid-epoch left one: its rest, then the others)."""
    if position is None:
        return [Leg(LoaderEpochs(loader, first, epochs), steps)]
    checkpoint.resume_loader(loader, position["loader"], ckpt_dir)  # the next iteration: after the batches trained
    rest = Leg(LoaderEpochs(loader, first, first + 1), len(loader), position["step"], metrics)
    return [rest] + ([Leg(LoaderEpochs(loader, first + 1, epochs), steps)] if first + 1 < epochs else [])


def resumed_metrics(position: dict[str, Any] | None, rank: int, size: int) -> list[float] | None:
    """This rank's metric sums from a checkpoint written mid-epoch; None if there are none to match to it."""
    if position is None:
        return None
    ranks = position["ranks"]
    if len(ranks) != size:  # the loader re-shards; what was each rank's own cannot be matched to a rank
        log(rank, f"the checkpoint stopped mid-epoch with {len(ranks)} ranks, this run has {size}: each rank's "
                  "metric sums start afresh (the epoch's metrics cover only its rest)")
        return None
    return [float(v) for v in ranks[rank]]


def advanced(sampler: ShardSampler, start: dict[str, Any], batches: int) -> dict[str, Any]:
    """The resume state `batches` batches after `start` (a `state_dict()` of `sampler` at an epoch's start or a
    resumed position), computed on a copy: the live sampler may be ahead (NOTE [Keras stops mid-epoch])."""
    probe = copy.copy(sampler)
    probe.load_state_dict(start)
    probe.advance(batches)
    return probe.state_dict()


def build_metrics(model: Any) -> None:
    """Create the compiled loss's and metrics' accumulators now (both Kerases make them at the first train step),
    the same on every rank, so that a resumed epoch can put back each rank's."""
    y_true = tf.zeros((1,), tf.int64)
    if KERAS3:  # what Keras 3's fit does before its first step when it has the data: shapes only, no step
        model._symbolic_build(data_batch=(tf.zeros((1, *model.input_shape[1:]), tf.float32), y_true))
        return
    y_pred = tf.zeros((1, *model.output_shape[1:]), tf.float32)
    model.compiled_loss.build(y_pred)
    model.compiled_metrics.build(y_pred, y_true)


def metrics_built(model: Any) -> bool:
    """Whether every metric's accumulators exist (tf_keras: no metrics yet; Keras 3: the loss's tracker exists from
    compile(), the compiled metrics are not built)."""
    return bool(model.metrics) and all(getattr(metric, "built", True) for metric in model.metrics)


def metric_state(model: Any) -> list[float]:
    """This rank's metric accumulators in order (float32 values: exact as Python floats)."""
    return [float(v.numpy()) for metric in model.metrics for v in metric.variables]


def restore_metrics(model: Any, values: list[float]) -> None:
    """Put back what `metric_state` returned (the metrics built first if fit has not yet)."""
    if not metrics_built(model):
        build_metrics(model)
    variables = [v for metric in model.metrics for v in metric.variables]
    if len(variables) != len(values):
        raise CheckpointMismatch(f"the checkpoint holds {len(values)} metric values, this model has {len(variables)} "
                                 "metric variables: it was written with other metrics; pass --no-resume or a new "
                                 "--run-dir")
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


class StopAtBoundary(Callback):
    """Every rank, last in fit's callbacks: a vote after each step and after each epoch (NOTE [Keras stops
    mid-epoch]). When the ranks agree, `save(epoch, step, trained)` (every rank: rank 0 writes; `step` = steps done
    in the epoch, `trained` = of them in this fit) returns the checkpoint's path and fit ends with Preempted; at an
    epoch's end the epoch's own checkpoint (`epoch_path(epochs done)`) is the one to resume from.
    `first_step`: steps of the first epoch done before this fit (a resumed stop); `metrics`: this rank's metric
    accumulators then, put back when that epoch begins."""

    def __init__(self, vote: preempt.StopVote, save: Callable[[int, int, int], str],
                 epoch_path: Callable[[int], str], epochs: int, *, first_step: int = 0,
                 metrics: list[float] | None = None) -> None:
        super().__init__()
        self.vote, self.save, self.epoch_path, self.epochs = vote, save, epoch_path, epochs
        self.first_step, self.metrics, self.epoch = first_step, metrics, 0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch = epoch
        if self.metrics is not None:  # after fit's reset_metrics: the resumed epoch's sums so far
            restore_metrics(self.model, self.metrics)
            self.metrics = None

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step, steps = self.first_step + batch + 1, self.first_step + self.params["steps"]  # of the whole epoch
        # A stop agreed at the epoch's last step waits for its end (the epoch's checkpoint, then `now` below).
        if self.vote.after_step() and step < steps:
            path = self.save(self.epoch, step, batch + 1)
            self.vote.request.disarm()  # checkpointed: SIGTERM's deadline may no longer end this rank
            raise Preempted(path)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.first_step = 0
        if epoch + 1 < self.epochs and self.vote.now():  # heard during the last steps or validation
            self.vote.request.disarm()
            raise Preempted(self.epoch_path(epoch + 1))
        self.vote.drain()
