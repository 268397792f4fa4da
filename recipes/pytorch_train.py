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
 5. Train; each step checks the averaged gradients (NaN/Inf from any rank: every rank stops, naming that step,
    exit 3; --no-check-finite: no checks), read a step later so the host never waits for the GPU; the next
    batch's copy starts during the backward pass; after each epoch average the metrics over ranks
    (allreduce) and validate; rank 0 alone writes the checkpoint (atomically, keeping the last K), TensorBoard
    scalars and the progress bar.
 6. Rank 0 writes <run-dir>/summary.json; every rank checks that the weights are identical everywhere.
Rank 0 also says, at its first step, how long that step took to come and where the time went (from `hvdtrain
run`'s start: the launcher, imports, hvd.init(), setup, data, model, logging, first batch, the step itself;
summary.json's `startup`; hvdtrain/train/startup.py).
Asked to stop (SIGUSR1 or SIGTERM to any rank; `hvdtrain run` given SIGUSR1, as a Slurm job is before its time
limit) every rank stops after the same step, rank 0 checkpoints there (mid-epoch, with the loader's position and
each rank's own state) and all exit 75; run the same command again to resume at that step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch
from pytorch_models import make_model
from torch import nn

from hvdtrain import exitcodes, records, rundir
from hvdtrain.data import DevicePrefetcher, ShmLoader
from hvdtrain.formats import arrays
from hvdtrain.settings.parse import parse_config
from hvdtrain.settings.recipes import PytorchTrainConfig as Config  # every flag, defined once
from hvdtrain.train import checkpoint, divergence, preempt, torchkit
from hvdtrain.train.entry import exit_with
from hvdtrain.train.lr import LRSchedule, scaled_epochs
from hvdtrain.train.metrics import History, MetricSums, build_summary, combine_stall
from hvdtrain.train.precision import Precision, prepare_model
from hvdtrain.train.progress import progress_bar
from hvdtrain.train.recipe_data import load_splits
from hvdtrain.train.report import images_note, log, nothing_to_train, run_config, same_weights, versions
from hvdtrain.train.startup import StartupClock
from hvdtrain.train.stepflags import LateReads
from hvdtrain.train.torchkit import (
    Meters,
    average_buffers,
    epoch_seed,
    forward_backward,
    load_latest,
    model_info,
    model_name,
    rank_state,
    report_epoch,
    restore_rank_state,
    save_checkpoint,
    sgd,
    tensorboard_writer,
    validation_sums,
    weights_digest,
    write_run_summary,
)

# What hvd.DistributedOptimizer returns: the torch optimizer's class extended with Horovod's synchronize() and
# skip_synchronize(); horovod has no types, so this is Any to mypy.
HvdOptimizer = Any


def shard_loader(cfg: Config, splits: arrays.Splits, rank: int, size: int, epochs: int,
                 device: torch.device) -> DevicePrefetcher:
    """This rank's shard of the training set (ShardSampler inside: strided over a per-epoch permutation that is the
    same on every rank; padded so that every rank runs the same number of steps — an uneven shard would leave one
    rank waiting in an allreduce). Batches are built by producer processes into shared memory (an MDS dataset is read
    there, shuffle block by shuffle block: `order`); the prefetcher overlaps host -> GPU copies with compute (a
    zero-copy pass-through on CPU). A batch holds `backward_passes_per_step` chunks."""
    return DevicePrefetcher(ShmLoader(
        splits.train, rank=rank, size=size, batch_size=cfg.batch_size * cfg.backward_passes_per_step,
        num_workers=cfg.num_workers, seed=cfg.seed, fetch=arrays.take, order=splits.train.order,
        epochs=epochs), device)


def build_model(cfg: Config, splits: arrays.Splits, device: torch.device) -> tuple[nn.Module, nn.Module, Precision]:
    """(model, net, precision): the model on `device`, seeded alike on every rank (rank 0's weights are broadcast
    anyway); `net` is what trains: channels-last weights with --channels-last, torch.compile(model) with --compile
    (`model` is kept for checkpoints, validation and the digests: both share the parameters); --precision's autocast
    (+ fp16 scaler)."""
    torch.manual_seed(cfg.seed)
    model = make_model(model_name(cfg, splits), splits.sample_shape, splits.num_classes, cfg.model_width).to(device)
    return model, prepare_model(model, cfg.channels_last, cfg.compile), Precision(cfg.precision, device)


# Horovod: sum a small vector of local metric sums over all ranks (MetricSums.reduce takes numpy arrays).
allreduce_sum = torchkit.on_numpy(lambda values: hvd.allreduce(values, op=hvd.Sum))


def stop_vote(request: preempt.StopRequest, every_s: float | None = None) -> preempt.StopVote:
    """SIGUSR1, SIGTERM or `hvdtrain run`'s stop file on any rank stops every rank after the same step (NOTE [stop
    requests] in hvdtrain/train/preempt.py)."""
    # Horovod: each rank's [0/1 flag, steps until the next vote], maxed by an allreduce that rides along with the
    # steps until that vote (about every 0.25 s).
    return preempt.StopVote(
        request, lambda values: hvd.allreduce_async(torch.tensor(values, dtype=torch.int32), op=hvd.Max,
                                                    name="stop.vote"),
        lambda handle: hvd.synchronize(handle).tolist(), every_s=every_s)


@dataclass(frozen=True)
class Stopped:
    """The ranks agreed to stop after `step` steps of the epoch (NOTE [stop requests])."""

    step: int
    sums: MetricSums


@dataclass
class Run:
    """What this run's epochs share, made once by main(); the Horovod calls stay in the functions that use it."""

    cfg: Config
    clock: StartupClock
    request: preempt.StopRequest
    device: torch.device
    where: str  # the device line: a GPU, or the CPU threads of this rank
    run_dir: Path
    splits: arrays.Splits
    epochs: int
    loader: DevicePrefetcher
    model: nn.Module
    net: nn.Module  # what trains: `model`, channels-last and/or compiled (sharing its parameters)
    precision: Precision
    lr: float  # the peak LR, scaled by the world size
    schedule: LRSchedule
    optimizer: HvdOptimizer
    first: int = 0  # the first epoch this run trains (after a resume: rank 0's checkpoint's)
    history: History = field(default_factory=History)
    done: int = 0  # epochs completed; samples trained and seconds spent in this run
    samples: float = 0.0
    seconds: float = 0.0
    # made when training starts (train_epochs)
    meters: Meters = field(init=False)
    writer: Any = field(init=False)
    vote: preempt.StopVote = field(init=False)

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def set_up_process(cfg: Config) -> tuple[torch.device, str, Path]:
    """This rank's device (its GPU, or its share of the CPU cores) and the run directory, locked by rank 0."""
    # Horovod: pin one GPU per process, chosen by its local rank (Horovod never sets CUDA_VISIBLE_DEVICES).
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    where = torchkit.setup_process(cfg.threads, hvd.local_size())  # CPU threads per rank; stale /dev/shm swept
    run_dir = Path(cfg.run_dir).absolute()
    # Horovod: rank 0 alone writes the run directory and locks it; if another job holds it, every rank stops: exit 2.
    rundir.claim(run_dir, hvd.rank(), lambda v: hvd.broadcast_object(v, root_rank=0, name="run_dir.lock"))
    return device, where, run_dir


def step_values(cfg: Config, net: nn.Module, optimizer: HvdOptimizer, precision: Precision,
                losses: list[torch.Tensor]) -> torch.Tensor:
    """[diverged, each backward pass's loss] of this step, on the device, for LateReads (nothing waits for it)."""
    # Horovod: the averaged gradients, the same on every rank: all ranks stop at the same step (NOTE [divergence
    # checks] in hvdtrain/train/divergence.py).
    device = losses[0].device
    bad = precision.nonfinite(net, optimizer) if cfg.check_finite else torch.zeros((), device=device)
    return torchkit.step_vector(bad, losses, 1 + cfg.backward_passes_per_step)


def train_epoch(run: Run, epoch: int, sums: MetricSums, start: int) -> int | None:
    """Train the epoch from step `start` (0, or where a stop left it), adding to `sums`; the steps done if the ranks
    agreed to stop before the epoch's end, else None. Nothing in a step makes the host wait for the GPU: the step's
    checks are read one step later (NOTE [flags read a step late] in hvdtrain/train/stepflags.py)."""
    cfg, net, optimizer, loader, precision = run.cfg, run.net, run.optimizer, run.loader, run.precision
    net.train()
    steps = start + len(loader)
    # Horovod: only rank 0 shows progress (every rank's bar would interleave in the output).
    bar = progress_bar(run.meters.wrap(loader), steps - start, f"epoch {epoch + 1}/{run.epochs}",
                       enabled=hvd.rank() == 0 and cfg.progress)
    late = LateReads(next(net.parameters()).device, 1 + cfg.backward_passes_per_step)
    lr = run.schedule.lr_at(epoch)
    for step, (x, y) in enumerate(bar, start):  # meters time the host's wait for each batch and the GPU's idle gap
        lr = run.schedule.lr_for_step(epoch, step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        # Horovod: backward_passes_per_step chunks, each a backward() DistributedOptimizer accumulates locally
        # (under --precision's autocast; fp16 scales the loss: NOTE [fp16 with Horovod] in precision.py).
        losses = forward_backward(net, x, y, cfg.backward_passes_per_step, sums, precision, cfg.channels_last)
        run.meters.ahead(loader)  # the next batch's copy is queued while the GPU runs this backward pass
        # Horovod: wait for the allreduce of the gradients, note whether the averages are finite, then apply them
        # (skip_synchronize: step() must not wait for the allreduce a second time).
        optimizer.synchronize()
        # The step's checks, queued; the previous step's, read now (NOTE [flags read a step late]).
        torchkit.read_back(late.push(step, step_values(cfg, net, optimizer, precision, losses)), epoch, steps, bar, lr)
        with optimizer.skip_synchronize():
            precision.step(optimizer)
        if run.vote.after_step() and step + 1 < steps:  # Horovod: every rank gets the same maximum: all stop here
            torchkit.read_back(late.drain(), epoch, steps, bar, lr)
            bar.close()
            return step + 1
    torchkit.read_back(late.drain(), epoch, steps, bar, lr)
    bar.close()
    run.vote.drain()
    return None


def evaluate(run: Run) -> dict[str, float]:
    # Horovod: gradients are averaged but BatchNorm running statistics are not; average them too, so every rank
    # validates and rank 0 checkpoints the same model.
    average_buffers(run.model, lambda buf, name: hvd.allreduce(buf, op=hvd.Average, name=name))
    # Horovod: validation metrics over the whole validation set = sums over every rank's shard.
    return validation_sums(run.model, run.splits.val, hvd.rank(), hvd.size(), run.device, run.precision,
                           run.cfg.channels_last).reduce(allreduce_sum)


def resume_rank(position: dict[str, Any] | None, model: nn.Module) -> tuple[MetricSums, int]:
    """(the epoch's metric sums so far, its steps done): this rank's own state from a checkpoint written mid-epoch
    (its RNG and BatchNorm statistics put back), else a fresh start."""
    if position is None:
        return MetricSums(), 0
    ranks = position["ranks"]
    if len(ranks) != hvd.size():  # the loader re-shards; what was each rank's own cannot be matched to a rank
        log(hvd.rank(), f"the checkpoint stopped mid-epoch with {len(ranks)} ranks, this run has {hvd.size()}: each "
                        "rank's RNG, BatchNorm statistics and metric sums start afresh (not bit-identical)")
        return MetricSums(), position["step"]
    return restore_rank_state(ranks[hvd.rank()], model), position["step"]


def train_and_validate(run: Run, epoch: int, position: dict[str, Any] | None
                       ) -> tuple[dict[str, float], float, float] | Stopped:
    """One epoch (from `position`, where a stop mid-epoch left it): train, validate, check, record in the history.
    Returns (the epoch's row, samples trained, seconds), or Stopped if the ranks agreed to stop inside it."""
    torch.manual_seed(epoch_seed(run.cfg.seed, epoch, hvd.rank()))
    run.loader.set_epoch(epoch)  # a new shuffle each epoch, the same permutation on every rank (resumed: its place)
    sums, first_step = resume_rank(position, run.model)
    start, mark = time.perf_counter(), run.meters.mark()
    steps = first_step + len(run.loader)
    stopped = train_epoch(run, epoch, sums, first_step)
    if stopped is not None:
        return Stopped(stopped, sums)
    # Horovod: average loss and accuracy over all ranks' samples (one allreduce).
    train = sums.reduce(allreduce_sum)
    took = time.perf_counter() - start
    val = evaluate(run)
    if run.cfg.check_finite:  # before anything records or checkpoints the epoch (NOTE [divergence checks])
        divergence.check_epoch(epoch, {"train_loss": train["loss"], "val_loss": val["loss"]})
    # the epoch's LR: its first step's and its last step's (they differ during the warmup)
    row = run.history.record(epoch + 1, train_loss=train["loss"], train_accuracy=train["accuracy"],
                             val_loss=val["loss"], val_accuracy=val["accuracy"],
                             lr_first=run.schedule.lr_for_step(epoch, 0, steps),
                             lr=run.optimizer.param_groups[0]["lr"],
                             samples_per_sec=train["samples"] * (steps - first_step) / steps / took,
                             **run.meters.epoch_shares(mark))
    return row, train["samples"] * (steps - first_step) / steps, took


def resume(run: Run) -> dict[str, Any] | None:
    """Rank 0 loads the newest intact checkpoint (unless --no-resume); every rank starts from rank 0's epoch,
    history, optimizer state and weights. Returns the position of a checkpoint written mid-epoch, else None."""
    cfg, ckpt_dir = run.cfg, run.ckpt_dir
    first, rows, position = (load_latest(ckpt_dir, run.model, run.optimizer, run.precision)
                             if hvd.rank() == 0 and cfg.resume else (0, [], None))
    # Horovod: every rank resumes at rank 0's epoch, with rank 0's history; from a checkpoint written mid-epoch,
    # at its step with each rank's own state (NOTE [stop requests] in hvdtrain/train/preempt.py).
    run.first = run.done = hvd.broadcast_object(first, root_rank=0, name="resume.epoch")
    run.history = History(hvd.broadcast_object(rows, root_rank=0, name="resume.history"))
    position = hvd.broadcast_object(position, root_rank=0, name="resume.position")
    if position is not None and "ranks" not in position:  # pytorch_elastic.py's: no rank's own state to put back
        raise checkpoint.CheckpointMismatch(
            f"the newest checkpoint in {ckpt_dir} was written mid-epoch by recipes/pytorch_elastic.py when it was "
            "asked to stop: resume it with that recipe, or train this one in a new --run-dir")
    if position is not None:
        checkpoint.resume_loader(run.loader, position["loader"], ckpt_dir)
    # Horovod: start every rank from rank 0's optimizer state (momentum buffers, LR), then its weights: on a rank with
    # an empty state, broadcast_optimizer_state takes a zero-gradient step, which with weight decay moves the weights.
    hvd.broadcast_optimizer_state(run.optimizer, root_rank=0)
    hvd.broadcast_parameters(run.model.state_dict(), root_rank=0)
    # Horovod: fp16's loss scale too (NOTE [fp16 with Horovod]): every rank skips the same overflowing steps.
    run.precision.load_state_dict(hvd.broadcast_object(run.precision.state_dict(), root_rank=0,
                                                       name="resume.precision"))
    return position


def start_line(run: Run) -> str:
    cfg, splits, size = run.cfg, run.splits, hvd.size()
    return (f"{size} ranks on {run.where}  dataset {splits.name}: {len(splits.train)} train / {len(splits.val)} "
            f"val  model {type(run.model).__name__}  epochs "
            f"{f'{run.first + 1}..{run.epochs}' if run.first < run.epochs else 'all done'}"
            f"  batch {cfg.batch_size}×{size} ranks  peak lr {run.lr:g}  {cfg.precision}"
            f"{'  channels-last' if cfg.channels_last else ''}{'  compiled' if cfg.compile else ''}"
            f"{images_note(splits, cpu=run.where.startswith('cpu'))}")


def stop_asked(cfg: Config, done: int, epochs: int) -> bool:
    """--stop-after-epoch reached (with epochs left to train): say so."""
    if cfg.stop_after_epoch is not None and cfg.stop_after_epoch <= done < epochs:
        log(hvd.rank(), f"stopping after epoch {done} as asked (--stop-after-epoch); run again without it to resume")
        return True
    return False


def save_stop(run: Run, epoch: int, stopped: Stopped) -> str:
    """Every rank, after the step the ranks agreed to stop at: rank 0 writes the checkpoint of this point in the
    epoch; returns its path."""
    # Horovod: rank 0 keeps what of every rank no collective has made equal (NOTE [stop requests]): gather it.
    ranks = hvd.allgather_object(rank_state(run.model, stopped.sums), name="stop.ranks")
    path = ""
    if hvd.rank() == 0:  # the loader's position: the batches trained on (its look-ahead given back)
        position = {"epoch": epoch, "step": stopped.step, "loader": run.loader.state_dict(), "ranks": ranks}
        path = str(save_checkpoint(run.cfg, run.ckpt_dir, epoch, run.model, run.optimizer, run.history,
                                   run.precision, position))
    # Horovod: no rank exits before the checkpoint is written (under horovodrun the first exit ends the job).
    return str(hvd.broadcast_object(path, root_rank=0, name="stop.saved"))


def train_epochs(run: Run, position: dict[str, Any] | None) -> str:
    """Every epoch from `run.first` (the first from `position`); rank 0 reports and checkpoints each. Returns the
    checkpoint to resume from if the ranks agreed to stop (SIGUSR1/SIGTERM: exit 75), else ""."""
    rank, cfg = hvd.rank(), run.cfg
    run.meters = Meters.on(run.device, run.clock)  # the host's wait for data and, on a GPU, its idle gap, per step
    run.writer = tensorboard_writer(rank == 0 and cfg.tensorboard, run.run_dir)  # Horovod: TensorBoard on rank 0.
    run.vote = stop_vote(run.request)  # SIGUSR1/SIGTERM: checkpoint at the next step boundary, exit 75
    run.clock.mark("logging")
    run.clock.on_first_step = lambda c: log(rank, c.line())  # rank 0 says how long the first step took to come
    try:
        for epoch in range(run.first, run.epochs):
            result = train_and_validate(run, epoch, position if epoch == run.first else None)
            if isinstance(result, Stopped):
                stop = save_stop(run, epoch, result)
                run.request.disarm()  # checkpointed: SIGTERM's deadline may no longer end this rank
                return stop
            row, trained, took = result
            run.done, run.samples, run.seconds = epoch + 1, run.samples + trained, run.seconds + took
            if rank == 0:  # Horovod: only rank 0 reports and writes checkpoints (all ranks hold the same weights).
                report_epoch(row, run.epochs, run.writer)
                save_checkpoint(cfg, run.ckpt_dir, run.done, run.model, run.optimizer, run.history, run.precision)
            if stop_asked(cfg, run.done, run.epochs):
                break
            if run.done < run.epochs and run.vote.now():  # asked during validation or the epoch's last step
                run.request.disarm()
                return str(checkpoint.checkpoint_path(run.ckpt_dir, run.done))
    finally:
        run.loader.close()  # stops the producer processes, frees the shared memory
        if run.writer is not None:
            run.writer.close()
    return ""


def finish(run: Run) -> None:
    """Every rank: compare the weights; rank 0: summary.json (what this run trained), or nothing if it trained
    nothing."""
    rank, size, cfg, model = hvd.rank(), hvd.size(), run.cfg, run.model
    # Horovod: every rank must end with identical weights: gather each rank's digest and compare.
    digests = hvd.allgather_object(weights_digest(model), name="final.digest")
    log(rank, same_weights(digests, size))
    # Horovod: gather every rank's data-wait statistics for the summary.
    stall = combine_stall(hvd.allgather_object(run.meters.summary(), name="final.stall"))
    if rank != 0:
        return
    if run.done == run.first:  # nothing trained in this run: keep the summary of the run that did the training
        print(nothing_to_train(run.epochs, run.ckpt_dir, run.run_dir), flush=True)
        return
    # Horovod: rank 0 writes the summary, with what the run was; its world: hvd.size() ranks, hvd.local_size() on
    # this host, on hvd.cross_size() hosts (the ranks whose local rank is 0, as this one's).
    config = run_config(cfg, run.splits, model=model_info(model_name(cfg, run.splits), model, cfg.model_width),
                        epochs=run.epochs, peak_lr=run.lr,
                        world={"size": size, "local_size": hvd.local_size(), "hosts": hvd.cross_size()},
                        versions=versions(torch=torch.__version__))
    summary = build_summary(epochs_completed=run.done, epochs_total=run.epochs, history=run.history,
                            samples_per_sec=run.samples / run.seconds if run.seconds else math.nan,
                            stall=stall, config=config,
                            extra={"world_size": size, "resumed_from_epoch": run.first,
                                   "weights_sha256_by_rank": digests, "startup": run.clock.report()})
    path = write_run_summary(run.run_dir, summary, run.meters.stall, cfg.stall_plot, size)
    newest, last = checkpoint.list_checkpoints(run.ckpt_dir), summary["val_accuracy"]
    print(f"done: {run.done}/{run.epochs} epochs, validation accuracy "
          f"{'n/a' if last is None else format(last, '.2%')}\n"
          f"checkpoint: {newest[-1][1] if newest else '(none)'}\nsummary:    {path}", flush=True)
    if run.writer is not None:
        print(f"tensorboard --logdir {run.run_dir / 'tensorboard'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    clock = StartupClock.here()  # time to the first step and its parts, from `hvdtrain run`'s start (or this process's)
    clock.mark("imports")
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0], check=torchkit.check_device)
    # ---- 1. processes and devices
    hvd.init()  # Horovod: join the job; rank/size come from horovodrun (or mpirun).
    clock.mark("rendezvous")
    # Asked to stop (SIGUSR1, SIGTERM, hvdtrain run's stop file) from now on: acted on at the first step boundary.
    request = preempt.StopRequest(records.directory(), sigterm_grace_s=cfg.sigterm_grace).install()
    device, where, run_dir = set_up_process(cfg)
    clock.mark("setup")
    # ---- 2. data: Horovod: each rank reads only its shard (with --scale-epochs-by-size, ceil(epochs / size)).
    splits = load_splits(cfg)
    epochs = scaled_epochs(cfg.epochs, hvd.size(), cfg.scale_epochs_by_size)
    loader = shard_loader(cfg, splits, hvd.rank(), hvd.size(), epochs, device)
    clock.mark("data")
    # ---- 3. model, LR, optimizer
    model, net, precision = build_model(cfg, splits, device)
    # Horovod: scale the LR by the number of workers and the batches accumulated per allreduce (the effective batch).
    lr = cfg.base_lr * hvd.size() * cfg.backward_passes_per_step
    schedule = torchkit.lr_schedule(cfg, lr)  # warmup from lr / hvd.size() to lr, then the milestones
    # Horovod: wrap the optimizer: gradients are averaged over all ranks by allreduce inside step().
    optimizer = hvd.DistributedOptimizer(
        sgd(cfg, model, schedule.lr_at(0)), named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=cfg.backward_passes_per_step)
    run = Run(cfg, clock, request, device, where, run_dir, splits, epochs, loader, model, net, precision, lr,
              schedule, optimizer)
    # ---- 4. resume on rank 0, then the same starting point on every rank
    position = resume(run)
    clock.mark("model")
    log(hvd.rank(), start_line(run))
    # ---- 5. train and validate; checkpoint each epoch on rank 0
    stop = train_epochs(run, position)
    if stop:
        if hvd.rank() == 0:
            print(preempt.stop_line(request, stop), flush=True)
        return exitcodes.PREEMPTED
    # ---- 6. the end: identical weights everywhere; rank 0 writes summary.json
    finish(run)
    return 0


if __name__ == "__main__":
    exit_with(main, __file__)  # bad data: exit 2, divergence: exit 3, with the message, no traceback
