"""What every recipe prints and records, framework-neutral: rank 0's log lines, an epoch's LR, the per-epoch
data-wait share, "nothing to train", the verdict on the ranks' weight digests, summary.json's "config", and the
start-up line's words on image files."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hvdtrain.train.metrics import SUMMARY_NAME


def log(rank: int, *args: Any) -> None:
    """Print on rank 0 only (every rank's copy would interleave in the job's output)."""
    if rank == 0:
        print(*args, flush=True)


def lr_text(first: float, last: float) -> str:
    """An epoch's LR for its line: `lr 0.0125→0.1` when it changed within the epoch (its first step's, its last
    step's: the warmup), `lr 0.1` when it did not."""
    first_text, last_text = f"{first:.4g}", f"{last:.4g}"
    return f"lr {last_text}" if first_text == last_text else f"lr {first_text}→{last_text}"


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


def run_config(cfg: Any, splits: Any, *, model: Mapping[str, Any], epochs: int, peak_lr: float,
               world: Mapping[str, int], versions: Mapping[str, str]) -> dict[str, Any]:
    """summary.json's "config": what tells runs apart (the dataset, model, batch, epochs, LR schedule, precision,
    seed, world, versions), then every flag as parsed. `cfg` is a recipe's Config; a field a recipe does not have
    is the value it trains with (Keras: one backward pass per step, fp32, no weight decay). `epochs`: after
    --scale-epochs-by-size; `world`: size, local_size (rank 0's host), hosts."""
    passes = getattr(cfg, "backward_passes_per_step", 1)
    return {
        "dataset": dataset_info(cfg.dataset, splits),
        "model": dict(model),
        "batch_size": {"per_rank": cfg.batch_size, "backward_passes_per_step": passes,
                       "global": cfg.batch_size * passes * world["size"]},
        "epochs": epochs,
        "lr": {"base": cfg.base_lr, "peak": peak_lr, "warmup_epochs": cfg.warmup_epochs,
               "milestones": list(cfg.lr_milestones), "gamma": cfg.lr_gamma, "momentum": cfg.momentum,
               "weight_decay": getattr(cfg, "weight_decay", 0.0)},
        "precision": getattr(cfg, "precision", "fp32"),
        "fp16_allreduce": cfg.fp16_allreduce,
        "seed": cfg.seed,
        "world": dict(world),
        "versions": dict(versions),
        "flags": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()},
    }


def dataset_info(source: str, splits: Any) -> dict[str, Any]:
    """The dataset as given (a local directory made absolute), its kind (`dataset_kind`), and its splits' sizes."""
    kind = dataset_kind(source)
    local = kind in ("mds", "shards") and "://" not in source
    return {"source": str(Path(source).absolute()) if local else source, "kind": kind,
            "train_samples": len(splits.train), "val_samples": len(splits.val),
            "sample_shape": list(splits.sample_shape), "num_classes": splits.num_classes}


def dataset_kind(source: str) -> str:
    """digits, synthetic, mds (an MDS dataset root, a directory or a URL: streamed) or shards (a directory of
    .npz/.npy shards), as hvdtrain.train.recipe_data.load tells them apart."""
    from hvdtrain.formats import arrays
    from hvdtrain.stream import store
    from hvdtrain.train import streamed

    if source in (arrays.DIGITS, arrays.SYNTHETIC):
        return source
    return "mds" if store.is_url(source) or streamed.is_mds_root(Path(source)) else "shards"


def versions(**frameworks: str) -> dict[str, str]:
    """hvdtrain's, Horovod's, the framework's (`frameworks`, e.g. torch=torch.__version__) and Python's versions."""
    import horovod

    import hvdtrain

    return {"hvdtrain": hvdtrain.__version__, "horovod": horovod.__version__, **frameworks,
            "python": platform.python_version()}


def images_note(splits: Any, cpu: bool) -> str:
    """The recipes' start-up line's words on a dataset of image files ('' for others): the size and where it came
    from, the crops, and on a CPU a smaller --image-size when the default picked a large one."""
    train = splits.train
    aug = getattr(train, "augment", None)  # a StreamSplit's (hvdtrain/train/streamed.py): imported by then
    if aug is None:
        return ""
    from hvdtrain.train.streamed import CPU_IMAGE_SIZE, DEFAULT_IMAGE_SIZE

    given = bool(getattr(train, "size_given", False))
    how = "--image-size" if given else f"default: the first image's shorter side, at most {DEFAULT_IMAGE_SIZE}"
    crops = "train random-resized-crop + flip" if aug.train else "train centre-cropped (--no-augment)"
    note = f"  images {aug.size}x{aug.size} ({how}), {crops}, val centre-cropped"
    if cpu and not given and aug.size > CPU_IMAGE_SIZE:
        note += (f"  (a CPU step at {aug.size} px is slow: --image-size {CPU_IMAGE_SIZE} has "
                 f"{(aug.size / CPU_IMAGE_SIZE) ** 2:.0f}x fewer pixels)")
    return note
