"""Metrics averaged across ranks, and the run's summary.json.

Averages are weighted by sample count: every rank accumulates local sums (loss × n, correct, n), one
allreduce with op=Sum adds them up, and the means are computed from the totals — correct even when the ranks
saw different numbers of samples (the last, partial batch; uneven validation shards). The allreduce is passed
in as a function (`sum_across_ranks`), so this module never imports Horovod and is testable in one process.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.atomic import atomic_write

SumFn = Callable[[np.ndarray], np.ndarray]
SUMMARY_NAME = "summary.json"


@dataclass
class MetricSums:
    """Local running sums for loss and accuracy over a pass; `reduce` averages them over all ranks.

    `add` takes plain numbers or 0-d tensors; tensors are summed where they are (on the GPU: no wait for the GPU
    per batch) and read once, by `values`/`reduce`."""

    loss_sum: Any = 0.0
    correct: Any = 0
    count: int = 0

    def add(self, mean_loss: Any, correct: Any, count: int) -> None:
        """Record one batch: its mean loss, how many predictions were right, and its size."""
        if hasattr(mean_loss, "detach") and hasattr(self.loss_sum, "add_"):  # one kernel, on the tensor's device
            self.loss_sum.add_(mean_loss.detach(), alpha=count)  # float64 += float32 × count, as below
        elif hasattr(mean_loss, "detach"):  # the first tensor: a float64 sum of our own on its device
            self.loss_sum = self.loss_sum + mean_loss.detach().double() * count
        else:
            self.loss_sum += float(mean_loss) * count
        if hasattr(correct, "detach") and hasattr(self.correct, "add_"):
            self.correct.add_(correct)
        else:
            self.correct = self.correct + (correct if hasattr(correct, "detach") else int(correct))
        self.count += int(count)

    def values(self) -> np.ndarray:
        """[loss sum, correct, count] as float64 (reads tensors back from their device)."""
        return np.array([float(self.loss_sum), float(self.correct), float(self.count)], dtype=np.float64)

    def reduce(self, sum_across_ranks: SumFn) -> dict[str, float]:
        """{'loss', 'accuracy', 'samples'} over all ranks (one collective: every rank must call it)."""
        total = np.asarray(sum_across_ranks(self.values()), dtype=np.float64)
        if total.shape != (3,):
            raise ValueError(f"sum_across_ranks returned shape {total.shape}, expected (3,)")
        loss_sum, correct, count = (float(v) for v in total)
        if count == 0:
            return {"loss": math.nan, "accuracy": math.nan, "samples": 0.0}
        return {"loss": loss_sum / count, "accuracy": correct / count, "samples": count}


@dataclass
class History:
    """Per-epoch averaged metrics, kept on every rank (identical, since they come from an allreduce)."""

    epochs: list[dict[str, float]] = field(default_factory=list)

    def record(self, epoch: int, **values: float) -> dict[str, float]:
        row = {"epoch": epoch, **{k: float(v) for k, v in values.items()}}
        self.epochs.append(row)
        return row


def build_summary(
    *,
    epochs_completed: int,
    epochs_total: int,
    history: History,
    samples_per_sec: float,
    stall: Mapping[str, Any] | None,
    config: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary.json content. `stall`: StallMeter-style statistics with mean_wait_s, mean_step_s and
    wait_share (the share of step time spent waiting for data), or None when not measured. `config`: what the run
    was (hvdtrain.train.report.run_config), after the results and before the per-rank and per-epoch detail."""
    last = history.epochs[-1] if history.epochs else {}
    stall = stall or {}
    return {
        "epochs_completed": epochs_completed,
        "epochs_total": epochs_total,
        "final_train_loss": last.get("train_loss"),
        "final_train_accuracy": last.get("train_accuracy"),
        "val_loss": last.get("val_loss"),
        "val_accuracy": last.get("val_accuracy"),
        "samples_per_sec": samples_per_sec,
        "mean_data_wait_s": stall.get("mean_wait_s"),
        "mean_step_s": stall.get("mean_step_s"),
        "data_wait_share": stall.get("wait_share"),
        "gpu_idle_share": stall.get("gpu_idle_share"),
        **({"config": dict(config)} if config is not None else {}),
        "stall": dict(stall),
        "history": history.epochs,
        **(extra or {}),
    }


def combine_stall(per_rank: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean over ranks of StallMeter summaries (mean_wait_s, mean_step_s, wait_share), plus each rank's; and of
    the GPU's idle share where the summaries carry a measured one (GpuIdleMeter's, under "gpu_idle"), else None."""
    usable = [s for s in per_rank if s.get("mean_wait_s") is not None]
    mean = {k: float(np.mean([s[k] for s in usable])) if usable else None
            for k in ("mean_wait_s", "mean_step_s", "wait_share")}
    idle = [s["gpu_idle"]["idle_share"] for s in per_rank if (s.get("gpu_idle") or {}).get("measured")]
    return {**mean, "gpu_idle_share": float(np.mean(idle)) if idle else None, "by_rank": list(per_rank)}


def write_summary(run_dir: Path | str, summary: Mapping[str, Any]) -> Path:
    """Atomically write `summary` as <run_dir>/summary.json (call on rank 0 only); NaN is written as null."""
    text = json.dumps(_json_safe(summary), indent=2, sort_keys=False) + "\n"
    return atomic_write(Path(run_dir) / SUMMARY_NAME, lambda f: f.write(text.encode()))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return _json_safe(value.item())
    return value
