"""What the two PyTorch recipes share that is not a Horovod step: their flags, hvdtrain's per-process set-up, the
loss over backward-pass chunks, validation batches and sums, checkpoints, the per-epoch report, the weights digest
and the summary.

Nothing here calls Horovod: the recipes (recipes/pytorch_train.py, recipes/pytorch_elastic.py) do every Horovod
step themselves, in order (pinning the GPU and scaling the LR included), and pass in what these helpers need (rank,
size, a reduction).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.data import sweep_stale_segments
from hvdtrain.data.idle import GpuIdleMeter
from hvdtrain.data.stall import StallMeter
from hvdtrain.formats import arrays
from hvdtrain.settings.recipes import TorchConfig
from hvdtrain.train import checkpoint, divergence
from hvdtrain.train.lr import LRSchedule
from hvdtrain.train.metrics import History, MetricSums, write_summary
from hvdtrain.train.precision import Precision, as_input
from hvdtrain.train.report import lr_text, wait_share
from hvdtrain.train.startup import StartupClock

CPU_CHANNELS_LAST = (
    "--channels-last needs a CUDA GPU, and none is visible: on CPU, torch's oneDNN backward of a 1x1 stride-2 "
    "convolution (the ResNet's shortcut) in channels-last corrupts memory and aborts the process when the batch "
    "size changes, e.g. at an epoch's smaller last batch (torch 2.13); leave --channels-last out on CPU")


def check_device(cfg: TorchConfig) -> None:
    """What the settings cannot check before launch, only this rank's machine: a GPU for --channels-last
    (`parse_config(..., check=check_device)` reports it as a usage error, exit 2)."""
    if cfg.channels_last and not torch.cuda.is_available():
        raise ValueError(CPU_CHANNELS_LAST)


@dataclass
class Meters:
    """Per step: the host's wait for its batch (StallMeter) and the GPU's idle gap before it (GpuIdleMeter)."""

    stall: StallMeter
    idle: GpuIdleMeter
    startup: StartupClock | None = None  # marks the first batch and the first step (hvdtrain.train.startup)

    @classmethod
    def on(cls, device: torch.device, startup: StartupClock | None = None) -> Meters:
        return cls(StallMeter(), GpuIdleMeter(device), startup)

    def wrap(self, loader: Any) -> Iterator[Any]:
        """One epoch of `loader`'s batches, both meters timing each step (the idle meter innermost; the startup
        clock, until the first step, outermost)."""
        batches = self.idle.wrap(self.stall.wrap(loader))
        return batches if self.startup is None or self.startup.done else self.startup.watch(batches)

    def ahead(self, loader: Any) -> None:
        """Mid-step, while the GPU computes: start the next batch's copy (DevicePrefetcher.ahead; other loaders:
        nothing), its time counted as this step's wait for data."""
        ahead = getattr(loader, "ahead", None)
        if ahead is not None:
            self.stall.wait_inside(ahead)

    def mark(self) -> tuple[int, int]:
        """Where the next epoch's steps start (for `epoch_shares`)."""
        return len(self.stall.steps), len(self.idle.idle_ms)

    def epoch_shares(self, mark: tuple[int, int]) -> dict[str, float]:
        """The epoch's data-wait share, and its GPU-idle share where a GPU is measured."""
        row = {"data_wait_share": wait_share(self.stall.waits[mark[0]:], self.stall.steps[mark[0]:])}
        if self.idle.measured:
            row["gpu_idle_share"] = self.idle.share_since(mark[1])
        return row

    def summary(self) -> dict[str, Any]:
        return {**self.stall.summary(), "gpu_idle": self.idle.summary()}


def cpu_threads(local_size: int, threads: int | None) -> int:
    """Threads for one of `local_size` ranks on this host: `threads`, or an equal share of the usable cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return threads or max(1, cores // local_size)


def setup_process(threads: int | None, local_size: int) -> str:
    """hvdtrain's own per-process set-up (call once, after the recipe pinned its GPU): sweep the /dev/shm segments a
    crashed earlier run left (dead creator pid, older than 60 s); on CPU, split this host's cores between its
    `local_size` ranks (`threads` each if given), or they oversubscribe each other. Returns where this rank trains,
    for the log."""
    sweep_stale_segments()
    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads(local_size, threads))
    return f"{'cuda' if torch.cuda.is_available() else 'cpu'} ({torch.get_num_threads()} threads each)"


def lr_schedule(cfg: TorchConfig, lr: float) -> LRSchedule:
    """Per step: a linear warmup over --warmup-epochs from the single-worker LR (× backward passes: lr / size) up to
    the scaled `lr` (Goyal et al.; Horovod's ImageNet example), then × --lr-gamma from each --lr-milestones epoch."""
    return LRSchedule(peak_lr=lr, start_lr=cfg.base_lr * cfg.backward_passes_per_step,
                      warmup_epochs=cfg.warmup_epochs, milestones=cfg.lr_milestones, gamma=cfg.lr_gamma)


def on_numpy(collective: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[np.ndarray], np.ndarray]:
    """A collective on torch tensors (the recipe's Horovod call) as a function of numpy arrays, as
    `MetricSums.reduce` takes it."""
    return lambda values: collective(torch.from_numpy(values)).numpy()


def sgd(cfg: TorchConfig, model: nn.Module, lr: float) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def model_name(cfg: TorchConfig, splits: arrays.Splits) -> str:
    """--model, or for auto: cnn for digits, resnet for synthetic, else cnn for C,H,W samples and mlp for others."""
    if cfg.model != "auto":
        return cfg.model
    fallback = "cnn" if len(splits.sample_shape) == 3 else "mlp"
    return {"digits": "cnn", "synthetic": "resnet"}.get(splits.name, fallback)


def model_info(name: str, model: nn.Module, width: int | None) -> dict[str, Any]:
    """The model for summary.json's config: --model's choice, its class, --model-width (None: the model's own) and
    its parameter count."""
    return {"name": name, "class": type(model).__name__, "width": width,
            "parameters": sum(p.numel() for p in model.parameters())}


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int, sums: MetricSums,
                     precision: Precision | None = None, channels_last: bool = False) -> list[torch.Tensor]:
    """Forward and backward passes over the batch in `chunks` pieces (DistributedOptimizer's
    backward_passes_per_step: it accumulates them locally before one allreduce); each piece's loss is scaled so
    the gradients add up to the batch mean. Forward and loss run under `precision`'s autocast, backward through
    its scaler. Returns each piece's loss as a 0-d tensor: nothing here waits for the GPU (`sums` keeps tensors)."""
    precision = precision or Precision("fp32", x.device)
    pieces, losses = list(zip(x.chunk(chunks), y.chunk(chunks), strict=True)), []
    for xc, yc in pieces:
        with precision.autocast():
            out = model(as_input(xc, channels_last))
            loss = F.cross_entropy(out, yc)
        precision.backward(loss / len(pieces) if len(pieces) > 1 else loss)  # (x / 1: two kernels for nothing)
        losses.append(loss.detach())
        sums.add(losses[-1], (out.argmax(1) == yc).sum(), len(yc))
    return losses


def step_vector(bad: torch.Tensor, losses: list[torch.Tensor], width: int) -> torch.Tensor:
    """[diverged, each backward pass's loss] as `width` float32 values on the losses' device (nothing waits): a
    short last batch splits into fewer passes, so the last loss is repeated (`divergence.worst` reads the same)."""
    padded = [*losses, *[losses[-1]] * (width - 1 - len(losses))]
    return torch.stack([bad.to(losses[0].device, torch.float32), *(v.float() for v in padded)])


def read_back(rows: list[tuple[int, np.ndarray]], epoch: int, steps: int, bar: Any, lr: float) -> None:
    """The values of earlier steps, read now (NOTE [flags read a step late] in stepflags.py): stop at
    a diverged step (exit 3, every rank at the same one), else show the loss on rank 0's progress bar."""
    for step, row in rows:
        if row[0]:
            raise divergence.at_step(epoch, step, steps, "the averaged gradients hold NaN/Inf",
                                     divergence.worst([float(v) for v in row[1:]]))
        if bar.disable is False and (step % 50 == 0 or step == steps - 1):
            bar.set_postfix(loss=f"{row[-1]:.3f}", lr=f"{lr:.3g}", refresh=False)


def val_batches(ds: arrays.Split, rank: int, size: int, batch_size: int,
                device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the validation set, each sample counted once over all ranks.

    The sampler pads the last round with repeats (strided sharding: position p of the epoch's order goes to rank
    p % size); positions >= len(ds) are those repeats and are left out here, so the allreduced sums cover the
    validation set exactly.
    """
    from hvdtrain.data import ShardSampler

    sampler = ShardSampler(len(ds), rank, size, shuffle=False, batch_size=batch_size)
    for j, idx in enumerate(sampler.batches()):
        positions = (j * batch_size + np.arange(len(idx))) * size + rank
        idx = idx[positions < len(ds)]
        if len(idx):
            x, y = ds.take(idx)
            yield torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


@torch.no_grad()
def average_buffers(model: nn.Module, average: Callable[[torch.Tensor, str], torch.Tensor]) -> None:
    """Replace each floating-point buffer (BatchNorm running statistics) by `average(buffer, name)`: gradients are
    averaged over the ranks, buffers are not (as timm's distribute_bn does)."""
    for name, buf in model.named_buffers():
        if buf.is_floating_point():
            buf.copy_(average(buf, f"buffer.{name}"))


@torch.no_grad()
def validation_sums(model: nn.Module, ds: arrays.Split, rank: int, size: int, device: torch.device,
                    precision: Precision | None = None, channels_last: bool = False) -> MetricSums:
    """Loss and accuracy sums over this rank's share of the validation set (the caller reduces them), in the
    training's precision and layout."""
    model.eval()
    sums, precision = MetricSums(), precision or Precision("fp32", device)
    for x, y in val_batches(ds, rank, size, 256, device):
        with precision.autocast():
            out = model(as_input(x, channels_last))
            loss = F.cross_entropy(out, y)
        sums.add(loss, (out.argmax(1) == y).sum(), len(y))
    return sums


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Per (seed, epoch, rank) RNG seed: a resumed run draws the same random numbers as an uninterrupted one."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def torch_read(f: Any) -> Any:
    return torch.load(f, map_location="cpu", weights_only=True)


def load_latest(ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                precision: Precision | None = None) -> tuple[int, list[dict[str, Any]], dict[str, Any] | None]:
    """Load the newest intact checkpoint into model, optimizer (and the fp16 scaler, if both have one); (epochs
    it completed, history, the position inside the next epoch of a checkpoint written mid-epoch, else None);
    (0, [], None) if none."""
    found = checkpoint.find_latest(ckpt_dir, torch_read, required_keys=("model", "optimizer", "history"),
                                   warn=lambda msg: print(f"WARNING: {msg}", flush=True))
    if found is None:
        return 0, [], None
    try:
        model.load_state_dict(found.state["model"])
        optimizer.load_state_dict(found.state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        what = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise checkpoint.CheckpointMismatch(
            f"{found.path} does not fit this model or optimizer ({what}): it was written with another --model, "
            "--model-width or input shape (--image-size, the dataset), or by an earlier version of the model; train "
            "in a new --run-dir, or pass --no-resume to start from scratch") from None
    if precision is not None:
        precision.load_state_dict(found.state.get("precision", {}))
    position = found.state.get("position") if found.step else None
    print(f"resuming from {found.path} (epoch {found.epoch} done"
          f"{f', then {found.step} steps of epoch {found.epoch + 1}' if position else ''})", flush=True)
    return found.epoch, list(found.state["history"]), position


def save_checkpoint(cfg: TorchConfig, ckpt_dir: Path, epochs_done: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, history: History, precision: Precision | None = None,
                    position: dict[str, Any] | None = None) -> Path:
    """Rank 0's checkpoint after `epochs_done` epochs, or, with `position` (a stop mid-epoch: the recipe's
    `save_stop`), after position["step"] steps of the next one."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "history": history.epochs,
             "precision": precision.state_dict() if precision is not None else {},
             "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}}
    if position is not None:
        state["position"] = position
    return checkpoint.save(ckpt_dir, epochs_done, state, torch.save, keep=cfg.keep_checkpoints,
                           step=position["step"] if position is not None else 0)


def rank_state(model: nn.Module, sums: MetricSums) -> dict[str, Any]:
    """What of one rank a stop mid-epoch keeps that no collective has made equal yet (NOTE [stop requests] in
    hvdtrain/train/preempt.py): its RNG, its buffers (BatchNorm running statistics: averaged only at the epoch's
    end) and its epoch's metric sums so far."""
    return {"rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "buffers": {name: buf.detach().cpu().clone() for name, buf in model.named_buffers()},
            "sums": [float(v) for v in sums.values()]}


def restore_rank_state(state: dict[str, Any], model: nn.Module) -> MetricSums:
    """Put back what `rank_state` kept; returns the epoch's metric sums so far."""
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, saved in state["buffers"].items():
            buffers[name].copy_(saved)
    loss_sum, correct, count = state["sums"]
    return MetricSums(loss_sum=loss_sum, correct=int(correct), count=int(count))


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over the state dict's tensors in order (names, then raw bytes on CPU)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


TENSORBOARD_NO_TF = "tensorboard.compat.notf"  # its presence makes TensorBoard use its own TF stub


def tensorboard_writer(enabled: bool, run_dir: Path) -> LazyWriter | None:
    """A TensorBoard writer under <run_dir>/tensorboard, or None. It is made with the first scalar: importing
    TensorBoard (~0.4 s) stays off the way to the first training step (hvdtrain/train/startup.py); what would stop
    it then (TensorBoard not installed, the directory not writable) stops the run now, before any training."""
    if not enabled:
        return None
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError("TensorBoard is not installed (pip install tensorboard), or pass --no-tensorboard")
    (run_dir / "tensorboard").mkdir(parents=True, exist_ok=True)
    return LazyWriter(run_dir / "tensorboard")


class LazyWriter:
    """What the recipes use of TensorBoard's SummaryWriter (add_scalar, flush, close), the writer made on first use.

    Without TensorFlow: TensorBoard's writer reads its file API from `tensorboard.compat.tf`, which imports
    TensorFlow when it is installed (seconds, and TensorFlow's start-up lines in a PyTorch job) unless the marker
    module `tensorboard.compat.notf` exists (TensorBoard's own switch, //tensorboard/compat:no_tensorflow); then it
    uses its stub, which writes the same event files. A process that already imported TensorFlow keeps it."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer: Any = None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self._writer is None:
            if "tensorflow" not in sys.modules:
                sys.modules.setdefault(TENSORBOARD_NO_TF, types.ModuleType(TENSORBOARD_NO_TF))
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def report_epoch(row: dict[str, float], epochs: int, writer: Any = None) -> None:
    """One line per epoch on the console, and the row's scalars to TensorBoard (call on rank 0). The LR shown is the
    epoch's first step's → its last step's (`lr_first`, `lr`) where they differ."""
    if writer is not None:
        for key, value in row.items():
            if key != "epoch":
                writer.add_scalar(key.replace("_", "/", 1), value, int(row["epoch"]))
        writer.flush()
    print(f"epoch {int(row['epoch'])}/{epochs}  train loss {row['train_loss']:.4f} "
          f"acc {row['train_accuracy']:.2%}  val loss {row['val_loss']:.4f} acc {row['val_accuracy']:.2%}  "
          f"{lr_text(row.get('lr_first', row['lr']), row['lr'])}  {row['samples_per_sec']:.0f} samples/s  "
          f"data wait {row['data_wait_share']:.1%} of step time"
          + (f"  GPU idle {row['gpu_idle_share']:.1%}" if "gpu_idle_share" in row else ""), flush=True)


def write_run_summary(run_dir: Path, summary: dict[str, Any], meter: Any, plot: bool, size: int) -> Path:
    """summary.json (and, with `plot`, rank 0's stall plot) in `run_dir`; prints where they are (rank 0)."""
    path = write_summary(run_dir, summary)
    if plot:
        print(f"stall plot: {meter.plot(run_dir / 'stall.png', title=f'rank 0 of {size}: input stall')}",
              flush=True)
    return path
