"""Data-parallel PyTorch training with Horovod, read top to bottom. Every Horovod step is marked `# Horovod:`.

The quickstart (2 processes on this machine; scikit-learn's bundled digits; ~99% validation accuracy after 8
epochs, well under a minute of training on 2 CPU cores), from the repository root — either of:

    hvdtrain run jobs/quickstart.yaml
    horovodrun -np 2 -H localhost:2 .venv/bin/python recipes/pytorch_train.py \
        --dataset digits --epochs 8 --warmup-epochs 1 --lr-milestones 5 --run-dir runs/quickstart

Other data and models:

    horovodrun -np 2 -H localhost:2 python recipes/pytorch_train.py --dataset synthetic --model resnet
    horovodrun -np 4 -H host1:2,host2:2 python recipes/pytorch_train.py --dataset /data/shards --epochs 30

`--dataset` is `digits` (scikit-learn's bundled 8x8 digits, nothing downloaded), `synthetic` (random tensors of
`--synthetic-shape`: the throughput ceiling) or a directory of `.npz` shards (arrays `x`, `y`) or
`NAME_x.npy`/`NAME_y.npy` pairs. Re-running the same command resumes from the newest intact checkpoint in
`<run-dir>/checkpoints`; `--no-resume` starts over. `--help` lists every option.

What each rank does, in order:
 1. hvd.init(); pin one GPU per process (local rank), or on CPU split the cores between the local ranks;
    rank 0 locks the run directory (a second job on it stops with exit 2, naming the holder).
 2. Load the dataset (checked: unreadable shards, labels not below --num-classes, NaN/Inf samples: exit 2,
    naming the file and index); shard it per rank with hvdtrain's sampler; batches come from shared-memory
    producer processes (ShmLoader) through a device prefetcher; a StallMeter times data-wait vs step time.
 3. LR = base LR × world size × backward passes per step, linear warmup, optional step decay (Goyal et al.).
 4. Wrap the optimizer in hvd.DistributedOptimizer (gradients averaged by allreduce); on resume rank 0 loads
    the checkpoint; broadcast the optimizer state and the weights from rank 0.
 5. Train; each step checks the averaged gradients before applying them (NaN/Inf from any rank: every rank
    stops at that step, exit 3; --no-check-finite: no checks); after each epoch average the metrics over ranks
    (allreduce) and validate; rank 0 alone writes the checkpoint (atomically, keeping the last K), TensorBoard
    scalars and the progress bar.
 6. Rank 0 writes <run-dir>/summary.json; every rank checks that the weights are identical everywhere.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from pytorch_models import MODELS, make_model
from torch import nn

from hvdtrain.data import DevicePrefetcher, ShardSampler, ShmLoader, StallMeter, sweep_stale_segments
from hvdtrain.train import checkpoint, datasets, divergence, rundir
from hvdtrain.train.config import parse_config
from hvdtrain.train.entry import exit_with
from hvdtrain.train.lr import LRSchedule, scaled_epochs
from hvdtrain.train.metrics import SUMMARY_NAME, History, MetricSums, build_summary, combine_stall, write_summary
from hvdtrain.train.progress import progress_bar


@dataclass(frozen=True)
class Config:
    dataset: str = field(default="digits", metadata={"help": "digits | synthetic | DIR of .npz/.npy shards"})
    model: str = field(default="auto", metadata={"choices": ("auto", *MODELS),
                                                 "help": "auto: cnn for digits, resnet for synthetic"})
    model_width: int | None = field(default=None, metadata={"help": "channels/hidden units (model default)"})
    epochs: int = field(default=15, metadata={"help": "total epochs"})
    scale_epochs_by_size: bool = field(default=False, metadata={
        "help": "run ceil(epochs / world size) epochs, as Horovod's Keras example does"})
    batch_size: int = field(default=32, metadata={"help": "samples per rank per backward pass"})
    base_lr: float = field(default=0.05, metadata={"help": "single-process LR; × size × backward passes"})
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_epochs: float = field(default=2.0, metadata={"help": "linear LR warmup (Goyal et al.)"})
    lr_milestones: tuple[int, ...] = field(default=(), metadata={"help": "epochs where LR ×= gamma, e.g. 10,20"})
    lr_gamma: float = 0.1
    backward_passes_per_step: int = field(default=1, metadata={
        "help": "accumulate this many batches locally before each allreduce"})
    fp16_allreduce: bool = field(default=False, metadata={"help": "compress gradients to fp16 for allreduce"})
    num_workers: int = field(default=1, metadata={"help": "data producer processes per rank"})
    threads: int | None = field(default=None, metadata={"help": "CPU threads per rank (cores // local ranks)"})
    seed: int = 42
    val_fraction: float = field(default=0.2, metadata={"help": "held-out share (digits, shard dirs)"})
    synthetic_shape: tuple[int, ...] = field(default=(3, 32, 32), metadata={"help": "sample shape, C,H,W"})
    synthetic_samples: int = 1024
    num_classes: int | None = field(default=None, metadata={
        "help": "classes; labels must be below it (none: 10 for digits and synthetic, from the labels of shards)"})
    check_finite: bool = field(default=True, metadata={
        "help": "stop on NaN/Inf: in the samples (at load), the averaged gradients (each step), the loss (each "
                "epoch)"})
    run_dir: str = field(default="runs/pytorch", metadata={"help": "checkpoints, TensorBoard, summary.json"})
    keep_checkpoints: int = 3
    resume: bool = field(default=True, metadata={"help": "resume from the newest intact checkpoint"})
    stop_after_epoch: int | None = field(default=None, metadata={
        "help": "stop cleanly after this epoch (re-run to resume)"})
    progress: bool = field(default=True, metadata={"help": "tqdm progress bar on rank 0"})
    tensorboard: bool = field(default=True, metadata={"help": "TensorBoard scalars on rank 0"})
    stall_plot: bool = field(default=False, metadata={
        "help": "rank 0 plots its wait-for-data and step time per step to <run-dir>/stall.png"})

    def __post_init__(self) -> None:
        positive = ("epochs", "batch_size", "backward_passes_per_step", "num_workers", "keep_checkpoints",
                    "synthetic_samples")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("threads", "stop_after_epoch", "model_width"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (or none), got {getattr(self, name)}")
        if self.num_classes is not None and self.num_classes < 2:
            raise ValueError(f"--num-classes must be >= 2 (or none), got {self.num_classes}")
        for name in ("momentum", "weight_decay"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
        try:  # the schedule checks its own values; say which flags they came from
            LRSchedule(base_lr=self.base_lr, warmup_epochs=self.warmup_epochs, milestones=self.lr_milestones,
                       gamma=self.lr_gamma)
        except ValueError as e:
            raise ValueError(f"LR flags (--base-lr, --warmup-epochs, --lr-milestones, --lr-gamma): {e}") from None


def log(rank: int, *args: Any) -> None:
    if rank == 0:
        print(*args, flush=True)


# ---- 1. processes and devices ------------------------------------------------------------------------------

def setup_device(local_rank: int, local_size: int, threads: int | None) -> torch.device:
    if torch.cuda.is_available():
        # Horovod: pin one GPU per process, chosen by local rank (Horovod never sets CUDA_VISIBLE_DEVICES).
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # Horovod: on CPU, split this host's cores between its ranks, or they oversubscribe each other.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(threads or max(1, cores // local_size))
    return torch.device("cpu")


# ---- 2. data -------------------------------------------------------------------------------------------------

def make_train_loader(cfg: Config, splits: datasets.Splits, rank: int, size: int,
                      device: torch.device) -> DevicePrefetcher:
    # Horovod: each rank reads only its shard (ShardSampler inside: strided over a per-epoch permutation that is
    # the same on every rank; padded so that every rank runs the same number of steps — an uneven shard would
    # leave one rank waiting in an allreduce). Batches are built by producer processes into shared memory.
    loader = ShmLoader(splits.train, rank=rank, size=size, batch_size=cfg.batch_size * cfg.backward_passes_per_step,
                       num_workers=cfg.num_workers, seed=cfg.seed, fetch=datasets.ArrayDataset.take, shuffle=True)
    return DevicePrefetcher(loader, device)  # host -> GPU copies overlap compute; a zero-copy pass-through on CPU


def val_batches(ds: datasets.ArrayDataset, rank: int, size: int, batch_size: int,
                device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the validation set, each sample counted once over all ranks.

    The sampler pads the last round by wrapping (strided sharding: position p of the epoch's order goes to rank
    p % size); positions >= len(ds) are those repeats and are left out here, so the allreduced sums cover the
    validation set exactly.
    """
    sampler = ShardSampler(len(ds), rank, size, shuffle=False, batch_size=batch_size)
    for j, idx in enumerate(sampler.batches()):
        positions = (j * batch_size + np.arange(len(idx))) * size + rank
        idx = idx[positions < len(ds)]
        if len(idx):
            x, y = ds.take(idx)
            yield torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


# ---- 3.-4. model, optimizer, LR schedule, resume ------------------------------------------------------------

def pick_model(cfg: Config, splits: datasets.Splits) -> nn.Module:
    name = cfg.model
    if name == "auto":
        fallback = "cnn" if len(splits.sample_shape) == 3 else "mlp"
        name = {"digits": "cnn", "synthetic": "resnet"}.get(splits.name, fallback)
    return make_model(name, splits.sample_shape, splits.num_classes, cfg.model_width)


def torch_read(f: Any) -> Any:
    return torch.load(f, map_location="cpu", weights_only=True)


def resume(cfg: Config, rank: int, ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer
           ) -> tuple[int, History]:
    """Rank 0 loads the newest intact checkpoint; returns (epochs completed, history) as rank 0 saw them."""
    epochs_done, history = 0, History()
    if rank == 0 and cfg.resume:
        found = checkpoint.find_latest(ckpt_dir, torch_read, required_keys=("model", "optimizer", "history"),
                                       warn=lambda msg: print(f"WARNING: {msg}", flush=True))
        if found is not None:
            model.load_state_dict(found.state["model"])
            optimizer.load_state_dict(found.state["optimizer"])
            epochs_done, history = found.epoch, History(list(found.state["history"]))
            print(f"resuming from {found.path} (epoch {found.epoch} done)", flush=True)
    # Horovod: every rank resumes at rank 0's epoch, with rank 0's history; weights and optimizer state follow
    # in broadcast_state().
    epochs_done = hvd.broadcast_object(epochs_done, root_rank=0, name="resume.epoch")
    history = hvd.broadcast_object(history, root_rank=0, name="resume.history")
    return epochs_done, history


def broadcast_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    # Horovod: start every rank from rank 0's optimizer state (momentum buffers, LR) and weights. The optimizer
    # state goes first: on a rank with an empty state, broadcast_optimizer_state initializes it with a
    # zero-gradient step, which with weight decay moves the weights; broadcasting the weights last undoes that.
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)


def allreduce_sum(values: np.ndarray) -> np.ndarray:
    # Horovod: sum a small vector of local metric sums over all ranks.
    return hvd.allreduce(torch.from_numpy(values), op=hvd.Sum).numpy()


def average_buffers(model: nn.Module) -> None:
    # Horovod: gradients are averaged but BatchNorm running statistics are not; average them too, so every
    # rank validates and rank 0 checkpoints the same model (as timm's distribute_bn does).
    for name, buf in model.named_buffers():
        if buf.is_floating_point():
            buf.copy_(hvd.allreduce(buf, op=hvd.Average, name=f"buffer.{name}"))


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over the state dict's tensors in order (names, then raw bytes on CPU)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---- 5. train and validate ----------------------------------------------------------------------------------

@dataclass
class Trainer:
    """What every epoch needs, built once in main()."""

    cfg: Config
    rank: int
    size: int
    epochs: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    train_loader: DevicePrefetcher
    val_set: datasets.ArrayDataset
    device: torch.device
    meter: StallMeter
    history: History
    ckpt_dir: Path
    writer: Any = None
    run_lock: rundir.RunDirLock | None = None  # rank 0's lock on the run directory, held for the process's life


def train_epoch(t: Trainer, epoch: int) -> dict[str, float]:
    t.model.train()
    sums, steps = MetricSums(), len(t.train_loader)
    batches = t.meter.wrap(t.train_loader)  # times the wait for each batch and the step after it
    # Horovod: only rank 0 shows progress (every rank's bar would interleave in the output).
    bar = progress_bar(batches, steps, f"epoch {epoch + 1}/{t.epochs}", enabled=t.rank == 0 and t.cfg.progress)
    for step, (x, y) in enumerate(bar):
        lr = t.schedule.lr_for_step(epoch, step, steps)
        for group in t.optimizer.param_groups:
            group["lr"] = lr
        t.optimizer.zero_grad()
        losses = forward_backward(t, x, y, sums)
        apply_gradients(t, epoch, step, steps, divergence.worst(losses))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.3g}", refresh=False)
    bar.close()
    # Horovod: average loss and accuracy over all ranks' samples (one allreduce).
    return sums.reduce(allreduce_sum)


def forward_backward(t: Trainer, x: torch.Tensor, y: torch.Tensor, sums: MetricSums) -> list[float]:
    """Forward and backward passes over the batch in backward_passes_per_step chunks; each chunk's loss."""
    bpps = t.cfg.backward_passes_per_step
    # Horovod: each chunk's backward() is one of the backward_passes_per_step that DistributedOptimizer
    # accumulates locally before one allreduce; scale the loss so the sum is the batch mean.
    chunks, losses = list(zip(x.chunk(bpps), y.chunk(bpps), strict=True)), []
    for xc, yc in chunks:
        out = t.model(xc)
        loss = F.cross_entropy(out, yc)
        (loss / len(chunks)).backward()
        losses.append(loss.item())
        sums.add(losses[-1], int((out.argmax(1) == yc).sum()), len(yc))
    return losses


def apply_gradients(t: Trainer, epoch: int, step: int, steps: int | None, loss: float) -> None:
    # Horovod: wait for the allreduce of the gradients (synchronize), check the averaged gradients (the same on
    # every rank: all ranks stop at the same step, NOTE [divergence checks] in hvdtrain/train/divergence.py), then
    # apply them (skip_synchronize: step() must not wait for the allreduce a second time).
    t.optimizer.synchronize()
    if t.cfg.check_finite:
        grads = [p.grad for p in t.model.parameters() if p.grad is not None]
        if grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=math.inf)):
            raise divergence.at_step(epoch, step, steps, "the averaged gradients hold NaN/Inf", loss)
    with t.optimizer.skip_synchronize():
        t.optimizer.step()


@torch.no_grad()
def evaluate(t: Trainer) -> dict[str, float]:
    average_buffers(t.model)
    t.model.eval()
    sums = MetricSums()
    for x, y in val_batches(t.val_set, t.rank, t.size, 256, t.device):
        out = t.model(x)
        sums.add(F.cross_entropy(out, y).item(), int((out.argmax(1) == y).sum()), len(y))
    # Horovod: validation metrics over the whole validation set = sums over every rank's shard.
    return sums.reduce(allreduce_sum)


def save_checkpoint(t: Trainer, epochs_done: int) -> Path:
    state = {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(), "history": t.history.epochs,
             "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(t.cfg).items()}}
    return checkpoint.save(t.ckpt_dir, epochs_done, state, torch.save, keep=t.cfg.keep_checkpoints)


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Per (seed, epoch, rank) RNG seed: a resumed run draws the same random numbers as an uninterrupted one."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def tensorboard_writer(cfg: Config, rank: int, run_dir: Path) -> Any:
    if rank != 0 or not cfg.tensorboard:  # Horovod: TensorBoard on rank 0 only.
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def report_epoch(t: Trainer, row: dict[str, float]) -> None:
    if t.rank != 0:
        return
    if t.writer is not None:
        for key, value in row.items():
            if key != "epoch":
                t.writer.add_scalar(key.replace("_", "/", 1), value, int(row["epoch"]))
        t.writer.flush()
    print(f"epoch {int(row['epoch'])}/{t.epochs}  train loss {row['train_loss']:.4f} "
          f"acc {row['train_accuracy']:.2%}  val loss {row['val_loss']:.4f} acc {row['val_accuracy']:.2%}  "
          f"lr {row['lr']:.4g}  {row['samples_per_sec']:.0f} samples/s  "
          f"data wait {row['data_wait_share']:.1%} of step time", flush=True)


def run_epochs(t: Trainer, first: int) -> tuple[int, float, float]:
    """Train epochs first+1..epochs; returns (epochs done, samples trained, seconds training) in this run."""
    done, samples, seconds = first, 0.0, 0.0
    for epoch in range(first, t.epochs):
        torch.manual_seed(epoch_seed(t.cfg.seed, epoch, t.rank))
        t.train_loader.set_epoch(epoch)  # a new shuffle each epoch, the same permutation on every rank
        start, step0 = time.perf_counter(), len(t.meter.steps)
        train = train_epoch(t, epoch)
        took = time.perf_counter() - start
        wait_share = sum(t.meter.waits[step0:]) / max(sum(t.meter.steps[step0:]), 1e-12)
        val = evaluate(t)
        if t.cfg.check_finite:  # before anything records or checkpoints the epoch (NOTE [divergence checks])
            divergence.check_epoch(epoch, {"train_loss": train["loss"], "val_loss": val["loss"]})
        done, samples, seconds = epoch + 1, samples + train["samples"], seconds + took
        row = t.history.record(done, train_loss=train["loss"], train_accuracy=train["accuracy"],
                               val_loss=val["loss"], val_accuracy=val["accuracy"],
                               lr=t.optimizer.param_groups[0]["lr"], samples_per_sec=train["samples"] / took,
                               data_wait_share=wait_share)
        report_epoch(t, row)
        if t.rank == 0:  # Horovod: only rank 0 writes checkpoints (all ranks hold the same weights).
            save_checkpoint(t, done)
        if t.cfg.stop_after_epoch is not None and t.cfg.stop_after_epoch <= done < t.epochs:
            log(t.rank, f"stopping after epoch {done} as asked (--stop-after-epoch); run again without it "
                        "to resume")
            break
    return done, samples, seconds


def check_in_sync(rank: int, size: int, model: nn.Module) -> list[str]:
    # Horovod: every rank must end with identical weights; gather each rank's digest and compare.
    digests = hvd.allgather_object(weights_digest(model), name="final.digest")
    if len(set(digests)) != 1:
        raise RuntimeError("weights differ across ranks after training: "
                           + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests)))
    log(rank, f"weights identical on all {size} ranks (sha256 {digests[0][:16]})")
    return digests


def finish(t: Trainer, run_dir: Path, first: int, done: int, samples: float, seconds: float) -> None:
    digests = check_in_sync(t.rank, t.size, t.model)
    # Horovod: gather every rank's data-wait statistics for the summary.
    stall = combine_stall(hvd.allgather_object(t.meter.summary(), name="final.stall"))
    if t.rank != 0:
        return
    if done == first:  # nothing trained in this run: keep the summary of the run that did the training
        print(f"nothing to train: all {t.epochs} epochs are done in {t.ckpt_dir} (--no-resume or another "
              f"--run-dir trains again)\nsummary:    {run_dir / SUMMARY_NAME}", flush=True)
        return
    # Horovod: rank 0 writes the summary.
    summary = build_summary(
        epochs_completed=done, epochs_total=t.epochs, history=t.history,
        samples_per_sec=samples / seconds if seconds else math.nan, stall=stall,
        extra={"world_size": t.size, "resumed_from_epoch": first, "weights_sha256_by_rank": digests})
    path = write_summary(run_dir, summary)
    if t.cfg.stall_plot:
        print(f"stall plot: {t.meter.plot(run_dir / 'stall.png', title=f'rank 0 of {t.size}: input stall')}",
              flush=True)
    newest = checkpoint.list_checkpoints(t.ckpt_dir)
    last = summary["val_accuracy"]
    print(f"done: {done}/{t.epochs} epochs, validation accuracy "
          f"{'n/a' if last is None else format(last, '.2%')}\n"
          f"checkpoint: {newest[-1][1] if newest else '(none)'}\nsummary:    {path}", flush=True)
    if t.writer is not None:
        print(f"tensorboard --logdir {run_dir / 'tensorboard'}", flush=True)


# ---- 6. the run ---------------------------------------------------------------------------------------------

def build(cfg: Config, size: int, device: torch.device
          ) -> tuple[datasets.Splits, nn.Module, LRSchedule, torch.optim.Optimizer]:
    """The dataset, the model, the LR schedule and the Horovod-wrapped optimizer (steps 2-4)."""
    splits = datasets.load(cfg.dataset, val_fraction=cfg.val_fraction, split_seed=0,
                           synthetic_shape=cfg.synthetic_shape, synthetic_samples=cfg.synthetic_samples,
                           num_classes=cfg.num_classes, seed=cfg.seed, check_finite=cfg.check_finite)
    torch.manual_seed(cfg.seed)
    model = pick_model(cfg, splits).to(device)
    # Horovod: scale the LR by the number of workers (and backward passes per step), warm it up (Goyal et al.).
    schedule = LRSchedule(base_lr=cfg.base_lr, size=size, backward_passes_per_step=cfg.backward_passes_per_step,
                          warmup_epochs=cfg.warmup_epochs, milestones=cfg.lr_milestones, gamma=cfg.lr_gamma)
    optimizer = torch.optim.SGD(model.parameters(), lr=schedule.lr_at(0), momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    # Horovod: wrap the optimizer: gradients are averaged over all ranks by allreduce inside step().
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=cfg.backward_passes_per_step)
    return splits, model, schedule, optimizer


def setup(cfg: Config) -> tuple[Trainer, int]:
    """Everything before the first epoch, after hvd.init(); returns the trainer and the epochs already done."""
    rank, size = hvd.rank(), hvd.size()
    device = setup_device(hvd.local_rank(), hvd.local_size(), cfg.threads)
    run_dir = Path(cfg.run_dir).absolute()
    # Horovod: rank 0 alone writes the run directory; it locks it for the job's life, and a broadcast tells every
    # rank whether another job holds it (then all stop here with exit 2, before reading or writing anything).
    run_lock = rundir.claim(run_dir, rank, lambda v: hvd.broadcast_object(v, root_rank=0, name="run_dir.lock"))
    splits, model, schedule, optimizer = build(cfg, size, device)
    epochs = scaled_epochs(cfg.epochs, size, cfg.scale_epochs_by_size)
    first, history = resume(cfg, rank, run_dir / "checkpoints", model, optimizer)
    broadcast_state(model, optimizer)

    epochs_text = f"{first + 1}..{epochs}" if first < epochs else "all done"
    log(rank, f"{size} ranks on {device.type} ({torch.get_num_threads()} threads each)  dataset {splits.name}: "
              f"{len(splits.train)} train / {len(splits.val)} val  model {type(model).__name__}  epochs "
              f"{epochs_text}  batch {cfg.batch_size}×{size} ranks  peak lr {schedule.peak_lr:g}")
    return Trainer(cfg, rank, size, epochs, model, optimizer, schedule,
                   train_loader=make_train_loader(cfg, splits, rank, size, device), val_set=splits.val,
                   device=device, meter=StallMeter(), history=history, ckpt_dir=run_dir / "checkpoints",
                   writer=tensorboard_writer(cfg, rank, run_dir), run_lock=run_lock), first


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    hvd.init()  # Horovod: join the job; rank/size come from horovodrun (or mpirun).
    sweep_stale_segments()  # /dev/shm segments a crashed earlier run left (dead creator pid, older than 60 s)
    t, first = setup(cfg)
    try:
        done, samples, seconds = run_epochs(t, first)
    finally:
        t.train_loader.close()  # stops the producer processes, frees the shared memory
        if t.writer is not None:
            t.writer.close()
    finish(t, Path(cfg.run_dir).absolute(), first, done, samples, seconds)
    return 0


if __name__ == "__main__":
    exit_with(main, __file__)  # bad data: exit 2, divergence: exit 3, with the message, no traceback
