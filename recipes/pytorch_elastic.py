"""Elastic data-parallel PyTorch training with Horovod: ranks may fail, leave or join while the job runs.

The elastic twin of recipes/pytorch_train.py (the same flags, model, data, metrics and checkpoints, from
hvdtrain.train.torchkit), read top to bottom. Every Horovod step is marked `# Horovod:`. From the repository root,
either of:

    hvdtrain run jobs/elastic.yaml
    horovodrun -np 2 --gloo --network-interfaces lo --host-discovery-script jobs/discover_hosts.sh \
        --min-np 1 --max-np 4 --reset-limit 10 --elastic-timeout 120 --blacklist-cooldown-range 10 60 \
        .venv/bin/python recipes/pytorch_elastic.py --dataset digits --epochs 8 --warmup-epochs 1 \
        --lr-milestones 5 --threads 1 --run-dir runs/elastic

The discovery script prints one `host:slots` line per host that may run ranks now (horovodrun runs it every
second); jobs/discover_hosts.sh prints this machine under two names (localhost, 127.0.0.1), or the lines of the
file named by $HVDTRAIN_HOSTS_FILE. Horovod blacklists a host (by name) when one of its ranks fails; it rejoins
only after its cooldown (--blacklist-cooldown-range) and only while discovery lists it. A rank that was not
exchanging data with the failed one notices the failure only when its Gloo operation times out
(--gloo-timeout-seconds, default 30 s); that timeout also bounds how long the others wait for a joining rank.

What each rank does, in order:
 1. hvd.init(); device and threads as in the main recipe.
 2. Load the dataset; a loader for this rank's shard (ShmLoader: producer processes, shared memory).
 3. Model, optimizer wrapped in hvd.DistributedOptimizer, LR × world size; rank 0 alone loads the newest
    checkpoint (no collective may run before hvd.elastic.run: a late joiner would meet the others' sync there).
 4. Everything that must survive a reset goes into hvd.elastic.TorchState: weights, optimizer state, epoch,
    batch, the loader position (global samples consumed in the epoch), the epoch's metric sums, the history.
 5. @hvd.elastic.run train(state): state.sync() (rank 0's state everywhere); rank 0 locks the run directory (a
    second job on it stops with exit 2; a new rank 0 takes the lock over after a reset); each process writes
    <run-dir>/workers/<host>.<slot>.json (pid, rank); then train, committing every
    --commit-every steps and at each epoch end. A failed rank -> HorovodInternalError on the others -> restore
    the last commit; a host added/removed -> HostsUpdatedInterrupt at the next commit. Either way Horovod
    re-initialises, our reset callback rescales the LR and re-shards the loader for the new (rank, size), and
    train(state) runs again from the committed position: no sample of the epoch is skipped or trained twice
    (but the padding of the epoch's last round).
 6. At the end every rank compares weight digests (allgather); rank 0 writes summary.json with the world sizes
    seen and the number of resets; rank 0 also appends one line per (re)start and commit to elastic.jsonl.
Asked to stop (SIGUSR1 to any rank; `hvdtrain run` given SIGUSR1, as a Slurm job is before its time limit) every
rank stops at the next commit (the commit's allreduce counts the ranks asked; heard after an epoch's last commit:
after its validation and checkpoint), rank 0 checkpoints that position (mid-epoch: the loader's global position,
the epoch's metric sums, each rank's BatchNorm statistics) and all exit 75, which ends the elastic job
(Horovod's driver stops when every rank failed); run the same command again to resume there. SIGTERM to a rank
keeps its elastic meaning: that rank goes, and the others carry on from the last commit.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
from pytorch_models import make_model
from torch import nn

from hvdtrain import exitcodes, records, rundir
from hvdtrain.atomic import atomic_write
from hvdtrain.data import DevicePrefetcher, ShmLoader, StallMeter
from hvdtrain.formats import arrays
from hvdtrain.settings.parse import parse_config
from hvdtrain.settings.recipes import PytorchElasticConfig as Config  # every flag, defined once
from hvdtrain.train import checkpoint, divergence, preempt, torchkit
from hvdtrain.train.checkpoint import CheckpointMismatch
from hvdtrain.train.entry import exit_with
from hvdtrain.train.lr import LRSchedule
from hvdtrain.train.metrics import History, MetricSums, build_summary, combine_stall
from hvdtrain.train.precision import Precision, prepare_model
from hvdtrain.train.recipe_data import load_splits
from hvdtrain.train.report import log, nothing_to_train, run_config, same_weights, versions, wait_share

EVENTS_NAME = "elastic.jsonl"
# What hvd.DistributedOptimizer returns: the torch optimizer's class extended with Horovod's synchronize() and
# skip_synchronize(); horovod has no types, so this is Any to mypy.
HvdOptimizer = Any


@dataclass
class Job:
    """What train() and the reset callback share, built once per process in main(); rank and size follow the
    world (the reset callback updates them)."""

    cfg: Config
    rank: int
    size: int
    device: torch.device
    splits: arrays.Splits
    model: nn.Module
    net: nn.Module  # what the training step calls: model, or torch.compile(model) with --compile
    precision: Precision
    optimizer: HvdOptimizer
    schedule: LRSchedule
    loader: DevicePrefetcher
    run_dir: Path
    request: preempt.StopRequest
    meter: StallMeter = field(default_factory=StallMeter)
    writer: Any = None
    run_lock: rundir.RunDirLock | None = None


class StopAgreed(Exception):  # not an error: every rank was asked to stop, and the checkpoint is written
    """The ranks agreed at a commit to stop; `path` is the checkpoint to resume from."""

    def __init__(self, path: str) -> None:
        super().__init__(f"stopped at a commit; checkpoint {path}")
        self.path = path


def make_loader(cfg: Config, splits: arrays.Splits, rank: int, size: int, device: torch.device) -> DevicePrefetcher:
    # Horovod: this rank's shard of the epoch's order (ShardSampler inside: the same permutation on every rank,
    # padded to the same number of steps), built by producer processes into shared memory.
    return DevicePrefetcher(ShmLoader(
        splits.train, rank=rank, size=size, batch_size=cfg.batch_size * cfg.backward_passes_per_step,
        num_workers=cfg.num_workers, seed=cfg.seed, fetch=arrays.take, order=splits.train.order,
        epochs=cfg.epochs), device)


# Horovod: sum a small vector of local metric sums over all ranks (MetricSums.reduce takes numpy arrays).
allreduce_sum = torchkit.on_numpy(lambda values: hvd.allreduce(values, op=hvd.Sum))


def write_worker_file(run_dir: Path, rank: int, size: int) -> None:
    # Horovod: an elastic process keeps its host and slot for life (its rank may change); name the file by them.
    host, slot = os.environ.get("HOROVOD_HOSTNAME", "localhost"), hvd.local_rank()
    record = {"pid": os.getpid(), "host": host, "slot": slot, "rank": rank, "size": size, "time": time.time()}
    atomic_write(run_dir / "workers" / f"{host}.{slot}.json", lambda f: f.write(json.dumps(record).encode()))


def event(j: Job, kind: str, state: hvd.elastic.TorchState) -> None:
    """Rank 0 appends one JSON line per (re)start and commit to <run-dir>/elastic.jsonl (progress, for humans
    and tests)."""
    if j.rank != 0:
        return
    row = {"event": kind, "time": time.time(), "size": j.size, "epoch": state.epoch, "batch": state.batch,
           "samples": (state.data or {}).get("samples_consumed", 0), "resets": state.resets}
    with open(j.run_dir / EVENTS_NAME, "a") as f:
        f.write(json.dumps(row) + "\n")


def resume_point(cfg: Config, run_dir: Path, model: nn.Module, optimizer: HvdOptimizer,
                 rank: int) -> tuple[int, list[dict[str, Any]], dict[str, Any] | None, str | None]:
    """Rank 0: the newest checkpoint loaded into model and optimizer; (epochs done, history, the position of one
    written mid-epoch by this recipe's stop, why it cannot resume from it). No rank may stop here: a refusal is
    raised in train() on every rank after the state's sync, or the others would wait for rank 0 until the Gloo
    timeout and then train from scratch without it."""
    if rank != 0 or not cfg.resume:
        return 0, [], None, None
    try:
        first, rows, position = torchkit.load_latest(run_dir / "checkpoints", model, optimizer)
    except CheckpointMismatch as e:
        return 0, [], None, str(e)
    if position is not None and "sums" not in position:  # pytorch_train.py's: each rank's own state, not ours
        return 0, [], None, (f"the newest checkpoint in {run_dir / 'checkpoints'} was written mid-epoch by "
                             "recipes/pytorch_train.py when it was asked to stop: resume it with that recipe, or "
                             "train this one in a new --run-dir")
    return first, rows, position, None


# ---- a reset: the world changed ----------------------------------------------------------------------------

def on_reset(j: Job, state: hvd.elastic.TorchState) -> None:
    # Horovod: Horovod has shut down and re-initialised: hvd.rank()/hvd.size() are the new world's. No collective
    # here: ranks that join now do not run this; they meet the others in state.sync().
    rank, size = hvd.rank(), hvd.size()
    if (rank, size) != (j.rank, j.size):
        # Horovod: re-shard the data for the new (rank, size): stop this loader's producer processes and free its
        # shared memory, then start one for the new shard; train() positions it at the committed sample offset.
        j.loader.close()
        j.loader = make_loader(j.cfg, j.splits, rank, size, j.device)
    samples = (state.data or {}).get("samples_consumed", 0)
    log(rank, f"reset: world size {j.size} -> {size}; LR rescaled ×{size}/{j.size}; resuming at epoch "
              f"{state.epoch + 1}, {samples} samples in")
    j.rank, j.size = rank, size
    # Horovod: rescale the LR by the new number of workers, at the committed position's fractional epoch.
    lr = j.cfg.base_lr * hvd.size() * j.cfg.backward_passes_per_step
    j.schedule = torchkit.lr_schedule(j.cfg, lr)
    for group in j.optimizer.param_groups:
        group["lr"] = j.schedule.lr_at(state.epoch + min(samples / max(len(j.splits.train), 1), 1.0))
    # Horovod: sync() broadcasts rank 0's last *saved* state, so record the reset and save (a commit without the
    # host check, which would be a collective). The weights are the committed ones here (restored, or committed
    # just before a HostsUpdatedInterrupt).
    state.resets += 1
    state.sizes += (size,)
    state.save()


# ---- train with commits ------------------------------------------------------------------------------------

def train_step(j: Job, state: hvd.elastic.TorchState, x: torch.Tensor, y: torch.Tensor, lr: float,
               sums: MetricSums) -> None:
    for group in j.optimizer.param_groups:
        group["lr"] = lr
    j.optimizer.zero_grad()
    # Horovod: backward_passes_per_step chunks, each a backward() DistributedOptimizer accumulates locally.
    losses = torchkit.forward_backward(j.net, x, y, j.cfg.backward_passes_per_step, sums, j.precision,
                                       j.cfg.channels_last)
    # Horovod: wait for the averaged gradients, check them for NaN/Inf (every rank alike, NOTE [divergence
    # checks]), apply them without waiting again. The step counts from the epoch's start over every world size it
    # saw, so no per-epoch total is shown.
    j.optimizer.synchronize()
    if j.cfg.check_finite and j.precision.diverged(j.model, j.optimizer):
        raise divergence.at_step(state.epoch, state.batch, None, "the averaged gradients hold NaN/Inf",
                                 divergence.worst([float(v) for v in losses]))
    with j.optimizer.skip_synchronize():
        j.precision.step(j.optimizer)


def commit(j: Job, state: hvd.elastic.TorchState, sums: MetricSums, vote: bool = True) -> None:
    # Horovod: fold this rank's metric sums since the last commit into the state's global sums, so that a restore
    # neither loses nor double-counts them, and (`vote`) count the ranks asked to stop: one allreduce.
    total = allreduce_sum(np.append(sums.values(), float(vote and j.request.heard())))
    state.train_sums = tuple(float(a + b) for a, b in zip(state.train_sums, total[:3], strict=True))
    sums.loss_sum, sums.correct, sums.count = 0.0, 0, 0
    state.data = j.loader.state_dict()  # the global samples consumed in this epoch: a prefix of its order
    if total[3] > 0:  # every rank got the same count: all stop here, at this commit's position
        raise StopAgreed(save_stop(j, state))
    event(j, "commit", state)
    # Horovod: save the state in memory, then raise HostsUpdatedInterrupt if hosts were added or removed.
    state.commit()


def save_stop(j: Job, state: hvd.elastic.TorchState) -> str:
    """Every rank, at the commit the ranks agreed to stop at: rank 0 writes the checkpoint of this position in the
    epoch (what a commit holds: weights, optimizer, the loader's global position, the epoch's global metric sums;
    and each rank's BatchNorm statistics, averaged only at the epoch's end); returns its path."""
    # Horovod: gather what of every rank no collective has made equal yet: its buffers.
    buffers = hvd.allgather_object({name: buf.detach().cpu().clone() for name, buf in j.model.named_buffers()},
                                   name="stop.buffers")
    path = ""
    if j.rank == 0:
        position = {"epoch": state.epoch, "step": state.batch, "loader": state.data, "sums": list(state.train_sums),
                    "buffers": buffers}
        path = str(torchkit.save_checkpoint(j.cfg, j.run_dir / "checkpoints", state.epoch, j.model, j.optimizer,
                                            History(list(state.history)), position=position))
    # Horovod: no rank exits before the checkpoint is written.
    path = str(hvd.broadcast_object(path, root_rank=0, name="stop.saved"))
    j.request.disarm()
    return path


def put_back_buffers(j: Job, state: hvd.elastic.TorchState) -> None:
    """Resumed from this recipe's stop: each rank's own BatchNorm statistics as they were (sync gave every rank
    rank 0's); once (train() then saves the state: a restore never brings them back)."""
    if state.buffers is None:
        return
    if len(state.buffers) == hvd.size():
        buffers = dict(j.model.named_buffers())
        with torch.no_grad():
            for name, saved in state.buffers[hvd.rank()].items():
                buffers[name].copy_(saved)
    else:  # another world size: rank i's statistics cannot be matched to a rank
        log(hvd.rank(), f"the checkpoint stopped mid-epoch with {len(state.buffers)} ranks, this run has "
                        f"{hvd.size()}: every rank starts from rank 0's BatchNorm statistics (not bit-identical)")
    state.buffers = None


def train_rest_of_epoch(j: Job, state: hvd.elastic.TorchState) -> None:
    """From the committed position to the end of the epoch, committing every cfg.commit_every steps."""
    epoch, n = state.epoch, len(j.splits.train)
    torch.manual_seed(torchkit.epoch_seed(j.cfg.seed, epoch, j.rank) + state.batch)
    j.loader.set_epoch(epoch)  # the epoch's order, the same on every rank
    if state.data is not None and state.data["epoch"] == epoch:
        # the committed position, saved under any world size: re-sharded for this one (ShardSampler)
        j.loader.load_state_dict(state.data)
    j.model.train()
    sums = MetricSums()
    for x, y in j.meter.wrap(j.loader):
        done = j.loader.state_dict()["samples_consumed"]  # after this batch, over all ranks
        train_step(j, state, x, y, j.schedule.lr_at(epoch + min(done / n, 1.0)), sums)
        state.batch += 1
        if state.batch % j.cfg.commit_every == 0:
            commit(j, state, sums)
    commit(j, state, sums, vote=False)  # the epoch's end: a request heard now stops after its checkpoint


def end_epoch(j: Job, state: hvd.elastic.TorchState, started: float, samples0: float, step0: int) -> None:
    # Horovod: average the BatchNorm buffers (gradients are averaged, buffers are not), then the validation
    # sums over every rank's shard.
    torchkit.average_buffers(j.model, lambda buf, name: hvd.allreduce(buf, op=hvd.Average, name=name))
    val = torchkit.validation_sums(j.model, j.splits.val, j.rank, j.size, j.device, j.precision,
                                   j.cfg.channels_last).reduce(allreduce_sum)
    loss_sum, correct, count = state.train_sums
    train_loss = loss_sum / max(count, 1)
    if j.cfg.check_finite:  # before the epoch is recorded or checkpointed (NOTE [divergence checks])
        divergence.check_epoch(state.epoch, {"train_loss": train_loss, "val_loss": val["loss"]})
    history = History(list(state.history))
    row = history.record(state.epoch + 1, train_loss=train_loss, train_accuracy=correct / max(count, 1),
                         val_loss=val["loss"], val_accuracy=val["accuracy"], lr=j.optimizer.param_groups[0]["lr"],
                         samples_per_sec=(count - samples0) / (time.perf_counter() - started),
                         data_wait_share=wait_share(j.meter.waits[step0:], j.meter.steps[step0:]), world_size=j.size)
    if j.rank == 0:  # Horovod: only rank 0 reports and writes checkpoints (all ranks hold the same weights).
        torchkit.report_epoch(row, j.cfg.epochs, j.writer)
        torchkit.save_checkpoint(j.cfg, j.run_dir / "checkpoints", state.epoch + 1, j.model, j.optimizer, history)
    state.history = (*state.history, row)
    state.epoch, state.batch, state.data, state.train_sums = state.epoch + 1, 0, None, (0.0, 0.0, 0.0)
    # Horovod: asked to stop (in the epoch's last steps or its validation) on any rank? Then stop after this
    # epoch's checkpoint, before the next epoch starts.
    if state.epoch < j.cfg.epochs and allreduce_sum(np.array([float(j.request.heard())]))[0] > 0:
        j.request.disarm()
        raise StopAgreed(str(checkpoint.checkpoint_path(j.run_dir / "checkpoints", state.epoch)))
    event(j, "commit", state)
    # Horovod: commit the finished epoch (a failure from here on never repeats it).
    state.commit()


@hvd.elastic.run
def train(state: hvd.elastic.TorchState, j: Job) -> None:
    """Runs on every rank; on a reset Horovod calls it again (after restore/reset/sync) from the top."""
    # Horovod: TorchState.sync() broadcasts the weights before the optimizer state; on a rank that joined, the
    # latter initialises empty optimizer state with a zero-gradient step, which moves weights under weight decay.
    # Broadcast the weights once more so every rank starts from rank 0's.
    if state.refused:  # rank 0's checkpoint does not fit: every rank stops with exit 2, so the driver ends the job
        raise CheckpointMismatch(state.refused)
    hvd.broadcast_parameters(j.model.state_dict(), root_rank=0)
    put_back_buffers(j, state)  # after a stop mid-epoch: each rank's own BatchNorm statistics
    # Horovod: sync() does not save: a restore (a rank lost before the first commit) would bring back this rank's
    # state from before the sync, its initial weights on a rank other than 0. Save what every rank starts from.
    state.save()
    # Horovod: rank 0 alone writes the run directory and locks it; a broadcast tells every rank whether another job
    # holds it (then all stop with exit 2). After a reset a new rank 0 takes the lock over from the old one.
    j.run_lock = rundir.claim(j.run_dir, hvd.rank(), lambda v: hvd.broadcast_object(v, 0, name="run_dir.lock"),
                              held=j.run_lock, wait_s=10.0)
    # Only now, with the directory ours, write into it: this process's worker file, rank 0's TensorBoard writer.
    write_worker_file(j.run_dir, hvd.rank(), hvd.size())
    if j.writer is None:
        j.writer = torchkit.tensorboard_writer(hvd.rank() == 0 and j.cfg.tensorboard, j.run_dir)
    event(j, "start", state)
    first = state.epoch
    while state.epoch < j.cfg.epochs:
        if j.cfg.stop_after_epoch is not None and j.cfg.stop_after_epoch <= state.epoch:
            log(j.rank, f"stopping after epoch {state.epoch} as asked (--stop-after-epoch)")
            break
        started, samples0, step0 = time.perf_counter(), state.train_sums[2], len(j.meter.steps)
        train_rest_of_epoch(j, state)
        end_epoch(j, state, started, samples0, step0)
    finish(j, state, trained=state.epoch > first or state.resets > 0)


def finish(j: Job, state: hvd.elastic.TorchState, trained: bool) -> None:
    # Horovod: every rank must end with identical weights: gather each rank's digest and compare.
    digests = hvd.allgather_object(torchkit.weights_digest(j.model), name="final.digest")
    log(j.rank, same_weights(digests, j.size))
    # Horovod: gather every rank's data-wait statistics for the summary.
    stall = combine_stall(hvd.allgather_object(j.meter.summary(), name="final.stall"))
    if j.rank != 0:
        return
    if not trained:
        print(nothing_to_train(j.cfg.epochs, j.run_dir / "checkpoints", j.run_dir), flush=True)
        return
    history = History(list(state.history))
    rates = [row["samples_per_sec"] for row in history.epochs]
    # Horovod: what the run was, with the world it ended in: hvd.size() ranks, hvd.local_size() on this host, on
    # hvd.cross_size() hosts (world_sizes below: every size it trained at).
    config = run_config(
        j.cfg, j.splits, model=torchkit.model_info(torchkit.model_name(j.cfg, j.splits), j.model, j.cfg.model_width),
        epochs=j.cfg.epochs, peak_lr=j.schedule.peak_lr, versions=versions(torch=torch.__version__),
        world={"size": j.size, "local_size": hvd.local_size(), "hosts": hvd.cross_size()})
    summary = build_summary(
        epochs_completed=state.epoch, epochs_total=j.cfg.epochs, history=history,
        samples_per_sec=float(np.mean(rates)) if rates else math.nan, stall=stall, config=config,
        extra={"world_size": j.size, "world_sizes": list(state.sizes), "resets": state.resets,
               "weights_sha256_by_rank": digests})
    path = torchkit.write_run_summary(j.run_dir, summary, j.meter, j.cfg.stall_plot, j.size)
    print(f"done: {state.epoch}/{j.cfg.epochs} epochs, world sizes {list(state.sizes)}, {state.resets} resets, "
          f"validation accuracy {summary['val_accuracy'] or math.nan:.2%}\nsummary:    {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0], check=torchkit.check_device)
    # ---- 1. process and device (once per process; no collective may run before hvd.elastic.run: a rank that
    # joins later would meet the others' collectives there)
    hvd.init()  # Horovod: join the job; rank/size come from horovodrun's elastic driver.
    rank, size = hvd.rank(), hvd.size()
    # Horovod: pin one GPU per process, chosen by its local rank (Horovod never sets CUDA_VISIBLE_DEVICES).
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    where = torchkit.setup_process(cfg.threads, hvd.local_size())  # CPU threads per rank; stale /dev/shm swept
    run_dir = Path(cfg.run_dir).absolute()

    # ---- 2.-3. data, model, LR, optimizer
    splits = load_splits(cfg)
    torch.manual_seed(cfg.seed)
    model = make_model(torchkit.model_name(cfg, splits), splits.sample_shape, splits.num_classes,
                       cfg.model_width).to(device)
    # Horovod: scale the LR by the number of workers and the batches accumulated per allreduce (the effective batch);
    # the reset callback rescales it when the world changes.
    lr = cfg.base_lr * hvd.size() * cfg.backward_passes_per_step
    schedule = torchkit.lr_schedule(cfg, lr)  # warmup from lr / hvd.size() to lr, then the milestones
    # Horovod: wrap the optimizer: gradients are averaged over all ranks by allreduce inside step().
    optimizer = hvd.DistributedOptimizer(
        torchkit.sgd(cfg, model, schedule.lr_at(0)), named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=cfg.backward_passes_per_step)
    # Rank 0 alone loads the newest checkpoint; the others get it from TorchState's sync in train().
    first, rows, position, refused = resume_point(cfg, run_dir, model, optimizer, rank)
    # Asked to stop (SIGUSR1, hvdtrain run's stop file) from now on: every rank stops at the next commit. SIGTERM
    # keeps its elastic meaning: that rank goes, the others carry on from the last commit (NOTE [stop requests]).
    request = preempt.StopRequest(records.directory(), signals=(signal.SIGUSR1,)).install()

    # ---- 4. the elastic state
    # Horovod: everything every rank must agree on after a reset; rank 0's copy is broadcast by state.sync(). From
    # a checkpoint this recipe wrote mid-epoch (stopped), its position, as a commit holds it.
    state = hvd.elastic.TorchState(
        model=model, optimizer=optimizer, epoch=first, batch=position["step"] if position else 0,
        data=position["loader"] if position else None,
        train_sums=tuple(position["sums"]) if position else (0.0, 0.0, 0.0), history=tuple(rows), sizes=(size,),
        resets=0, buffers=position["buffers"] if position else None, refused=refused)
    # --channels-last / --compile / --precision bf16 as in recipes/pytorch_train.py (`net` is what trains).
    net = prepare_model(model, cfg.channels_last, cfg.compile)
    j = Job(cfg, rank, size, device, splits, model, net, Precision(cfg.precision, device), optimizer, schedule,
            loader=make_loader(cfg, splits, rank, size, device), run_dir=run_dir, request=request)
    # Horovod: called on the surviving ranks after every reset (not on new ones: they build all of this).
    state.register_reset_callbacks([lambda: on_reset(j, state)])
    log(rank, f"{size} ranks (elastic) on {where}  dataset "
              f"{splits.name}: {len(splits.train)} train / {len(splits.val)} val  model {type(model).__name__}  "
              f"epochs {f'{first + 1}..{cfg.epochs}' if first < cfg.epochs else 'all done'}  batch "
              f"{cfg.batch_size}×ranks  commit every {cfg.commit_every}")

    # ---- 5.-6. train (Horovod restarts train() from the last commit after every reset), then the summary
    try:
        train(state, j)
    except StopAgreed as stop:  # every rank, at the same commit; checkpointed
        if hvd.rank() == 0:
            print(preempt.stop_line(request, stop.path), flush=True)
        return exitcodes.PREEMPTED
    finally:
        j.loader.close()  # stops the producer processes, frees the shared memory
        if j.writer is not None:
            j.writer.close()
    return 0


if __name__ == "__main__":
    exit_with(main, __file__)  # bad data: exit 2, divergence: exit 3, with the message, no traceback
