"""What every recipe prints and checks at its end, framework-neutral: rank 0's log lines, the per-epoch data-wait
share, "nothing to train", and the verdict on the ranks' weight digests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdtrain.train.metrics import SUMMARY_NAME


def log(rank: int, *args: Any) -> None:
    """Print on rank 0 only (every rank's copy would interleave in the job's output)."""
    if rank == 0:
        print(*args, flush=True)


def wait_share(waits: list[float], steps: list[float]) -> float:
    """The share of step time spent waiting for data (StallMeter's waits and steps of an epoch)."""
    return sum(waits) / max(sum(steps), 1e-12)


def nothing_to_train(epochs: int, ckpt_dir: Path, run_dir: Path) -> str:
    return (f"nothing to train: all {epochs} epochs are done in {ckpt_dir} (--no-resume or another --run-dir "
            f"trains again)\nsummary:    {run_dir / SUMMARY_NAME}")


def same_weights(digests: list[str], size: int) -> str:
    """The line saying every rank holds the same weights; RuntimeError naming the ranks when they differ."""
    if len(set(digests)) != 1:
        raise RuntimeError("weights differ across ranks after training: "
                           + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests)))
    return f"weights identical on all {size} ranks (sha256 {digests[0][:16]})"
