"""Elastic data-parallel PyTorch training with Horovod: ranks may fail, leave or join while the job runs.

The elastic twin of recipes/pytorch_train.py (same flags, model, data, metrics and checkpoints, imported from
it), read top to bottom. Every Horovod step is marked `# Horovod:`. From the repository root, either of:

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
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch
from pytorch_train import (
    Config,
    Trainer,
    allreduce_sum,
    apply_gradients,
    build,
    check_in_sync,
    epoch_seed,
    evaluate,
    forward_backward,
    log,
    make_train_loader,
    report_epoch,
    save_checkpoint,
    setup_device,
    tensorboard_writer,
    torch_read,
)

from hvdtrain.atomic import atomic_write
from hvdtrain.data import StallMeter, sweep_stale_segments
from hvdtrain.train import checkpoint, datasets, divergence, rundir
from hvdtrain.train.config import parse_config
from hvdtrain.train.entry import exit_with
from hvdtrain.train.metrics import SUMMARY_NAME, History, MetricSums, build_summary, combine_stall, write_summary

EVENTS_NAME = "elastic.jsonl"


@dataclass(frozen=True)
class ElasticConfig(Config):
    run_dir: str = field(default="runs/elastic", metadata={"help": "checkpoints, TensorBoard, summary.json"})
    commit_every: int = field(default=10, metadata={
        "help": "commit the state every N optimizer steps (and at each epoch end): steps lost on a failure "
                "vs the cost of a commit (a state copy and a broadcast)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.commit_every < 1:
            raise ValueError(f"--commit-every must be >= 1, got {self.commit_every}")
        if self.scale_epochs_by_size:
            raise ValueError("--scale-epochs-by-size does not apply to elastic training: the size changes")


@dataclass
class ElasticTrainer(Trainer):
    """The main recipe's Trainer plus what a reset needs to rebuild the loader; rank/size follow the world."""

    splits: datasets.Splits | None = None
    run_dir: Path = Path()


# ---- 1.-3. process, data, model (once per process; no collectives before hvd.elastic.run) --------------------

def write_worker_file(run_dir: Path, rank: int, size: int) -> None:
    # Horovod: an elastic process keeps its host and slot for life (its rank may change); name the file by them.
    host, slot = os.environ.get("HOROVOD_HOSTNAME", "localhost"), hvd.local_rank()
    path = run_dir / "workers" / f"{host}.{slot}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "host": host, "slot": slot, "rank": rank, "size": size, "time": time.time()}
    atomic_write(path, lambda f: f.write(json.dumps(record).encode()))


def event(t: ElasticTrainer, kind: str, state: hvd.elastic.TorchState) -> None:
    """Rank 0 appends one JSON line per (re)start and commit to <run-dir>/elastic.jsonl (progress, for humans
    and tests)."""
    if t.rank != 0:
        return
    row = {"event": kind, "time": time.time(), "size": t.size, "epoch": state.epoch, "batch": state.batch,
           "samples": (state.data or {}).get("samples_consumed", 0), "resets": state.resets}
    with open(t.run_dir / EVENTS_NAME, "a") as f:
        f.write(json.dumps(row) + "\n")


def load_latest(cfg: ElasticConfig, rank: int, ckpt_dir: Path, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> tuple[int, list[dict[str, float]]]:
    """Rank 0 loads the newest intact checkpoint (the others get it from TorchState's sync); (epoch, history)."""
    if rank != 0 or not cfg.resume:
        return 0, []
    found = checkpoint.find_latest(ckpt_dir, torch_read, required_keys=("model", "optimizer", "history"),
                                   warn=lambda msg: print(f"WARNING: {msg}", flush=True))
    if found is None:
        return 0, []
    model.load_state_dict(found.state["model"])
    optimizer.load_state_dict(found.state["optimizer"])
    print(f"resuming from {found.path} (epoch {found.epoch} done)", flush=True)
    return found.epoch, list(found.state["history"])


def setup(cfg: ElasticConfig) -> tuple[ElasticTrainer, hvd.elastic.TorchState]:
    """Everything before hvd.elastic.run, after hvd.init(); returns the trainer and the elastic state."""
    rank, size = hvd.rank(), hvd.size()
    device = setup_device(hvd.local_rank(), hvd.local_size(), cfg.threads)
    run_dir = Path(cfg.run_dir).absolute()
    # Horovod: data, model, LR × world size (rescaled by the reset callback when the world changes), and the
    # optimizer wrapped in hvd.DistributedOptimizer, exactly as the main recipe builds them.
    splits, model, schedule, optimizer = build(cfg, size, device)
    first, history = load_latest(cfg, rank, run_dir / "checkpoints", model, optimizer)
    # Horovod: the state every rank must agree on after a reset; rank 0's copy is broadcast by state.sync().
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=first, batch=0, data=None,
                                   train_sums=(0.0, 0.0, 0.0), history=tuple(history), sizes=(size,), resets=0)
    t = ElasticTrainer(cfg, rank, size, cfg.epochs, model, optimizer, schedule,
                       train_loader=make_train_loader(cfg, splits, rank, size, device), val_set=splits.val,
                       device=device, meter=StallMeter(), history=History(list(history)),
                       ckpt_dir=run_dir / "checkpoints", writer=None,
                       splits=splits, run_dir=run_dir)
    # Horovod: called on the surviving ranks after every reset (not on new ones: they build all of this).
    state.register_reset_callbacks([lambda: on_reset(t, state)])
    log(rank, f"{size} ranks (elastic) on {device.type} ({torch.get_num_threads()} threads each)  dataset "
              f"{splits.name}: {len(splits.train)} train / {len(splits.val)} val  model {type(model).__name__}  "
              f"epochs {f'{first + 1}..{cfg.epochs}' if first < cfg.epochs else 'all done'}  batch "
              f"{cfg.batch_size}×ranks  commit every {cfg.commit_every}")
    return t, state


# ---- 4. a reset: the world changed -------------------------------------------------------------------------

def epoch_progress(t: ElasticTrainer, state: hvd.elastic.TorchState) -> float:
    """The fractional epoch reached at the committed position (drives the LR schedule)."""
    samples = (state.data or {}).get("samples_consumed", 0)
    return state.epoch + min(samples / max(len(t.splits.train), 1), 1.0)


def on_reset(t: ElasticTrainer, state: hvd.elastic.TorchState) -> None:
    # Horovod: Horovod has shut down and re-initialised: hvd.rank()/hvd.size() are the new world's. No collective
    # here: ranks that join now do not run this; they meet the others in state.sync().
    rank, size = hvd.rank(), hvd.size()
    if (rank, size) != (t.rank, t.size):
        # Horovod: re-shard the data for the new (rank, size): stop this loader's producer processes and free its
        # shared memory, then start one for the new shard; train() positions it at the committed sample offset.
        t.train_loader.close()
        t.train_loader = make_train_loader(t.cfg, t.splits, rank, size, t.device)
    log(rank, f"reset: world size {t.size} -> {size}; LR rescaled ×{size}/{t.size}; resuming at epoch "
              f"{state.epoch + 1}, {(state.data or {}).get('samples_consumed', 0)} samples in")
    t.rank, t.size = rank, size
    # Horovod: rescale the LR by the new number of workers.
    t.schedule = replace(t.schedule, size=size)
    for group in t.optimizer.param_groups:
        group["lr"] = t.schedule.lr_at(epoch_progress(t, state))
    # Horovod: sync() broadcasts rank 0's last *saved* state, so record the reset and save (a commit without the
    # host check, which would be a collective). The weights are the committed ones here (restored, or committed
    # just before a HostsUpdatedInterrupt).
    state.resets += 1
    state.sizes += (size,)
    state.save()


# ---- 5. train with commits ----------------------------------------------------------------------------------

def train_step(t: ElasticTrainer, state: hvd.elastic.TorchState, x: torch.Tensor, y: torch.Tensor, lr: float,
               sums: MetricSums) -> float:
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    t.optimizer.zero_grad()
    losses = forward_backward(t, x, y, sums)  # Horovod: backward_passes_per_step chunks (main recipe)
    # Horovod: the averaged gradients, checked for NaN/Inf (every rank alike) and applied (main recipe). The step
    # counts from the epoch's start over every world size it saw, so no per-epoch total is shown.
    apply_gradients(t, state.epoch, state.batch, None, divergence.worst(losses))
    return losses[-1]


def commit(t: ElasticTrainer, state: hvd.elastic.TorchState, sums: MetricSums) -> None:
    # Horovod: fold this rank's metric sums since the last commit into the state's global sums (one allreduce),
    # so that a restore neither loses nor double-counts them.
    total = allreduce_sum(np.array([sums.loss_sum, sums.correct, sums.count], dtype=np.float64))
    state.train_sums = tuple(float(a + b) for a, b in zip(state.train_sums, total, strict=True))
    sums.loss_sum, sums.correct, sums.count = 0.0, 0, 0
    state.data = t.train_loader.state_dict()  # the global samples consumed in this epoch: a prefix of its order
    event(t, "commit", state)
    # Horovod: save the state in memory, then raise HostsUpdatedInterrupt if hosts were added or removed.
    state.commit()


def train_rest_of_epoch(t: ElasticTrainer, state: hvd.elastic.TorchState) -> None:
    """From the committed position to the end of the epoch, committing every cfg.commit_every steps."""
    epoch, n = state.epoch, len(t.splits.train)
    torch.manual_seed(epoch_seed(t.cfg.seed, epoch, t.rank) + state.batch)
    t.train_loader.set_epoch(epoch)  # the epoch's order, the same on every rank
    if state.data is not None and state.data["epoch"] == epoch:
        # the committed position, saved under any world size: re-sharded for this one (ShardSampler)
        t.train_loader.load_state_dict(state.data)
    sums = MetricSums()
    for x, y in t.meter.wrap(t.train_loader):
        done = t.train_loader.state_dict()["samples_consumed"]  # after this batch, over all ranks
        train_step(t, state, x, y, t.schedule.lr_at(epoch + min(done / n, 1.0)), sums)
        state.batch += 1
        if state.batch % t.cfg.commit_every == 0:
            commit(t, state, sums)
    commit(t, state, sums)


def end_epoch(t: ElasticTrainer, state: hvd.elastic.TorchState, started: float, samples0: float, step0: int) -> None:
    val = evaluate(t)  # Horovod: BatchNorm buffers averaged, validation sums allreduced (main recipe)
    loss_sum, correct, count = state.train_sums
    took = time.perf_counter() - started
    wait_share = sum(t.meter.waits[step0:]) / max(sum(t.meter.steps[step0:]), 1e-12)
    train_loss = loss_sum / max(count, 1)
    if t.cfg.check_finite:  # before the epoch is recorded or checkpointed (NOTE [divergence checks])
        divergence.check_epoch(state.epoch, {"train_loss": train_loss, "val_loss": val["loss"]})
    t.history = History(list(state.history))
    row = t.history.record(state.epoch + 1, train_loss=train_loss,
                           train_accuracy=correct / max(count, 1), val_loss=val["loss"],
                           val_accuracy=val["accuracy"], lr=t.optimizer.param_groups[0]["lr"],
                           samples_per_sec=(count - samples0) / took, data_wait_share=wait_share,
                           world_size=t.size)
    report_epoch(t, row)
    if t.rank == 0:  # Horovod: only rank 0 writes checkpoints (all ranks hold the same weights).
        save_checkpoint(t, state.epoch + 1)
    state.history = (*state.history, row)
    state.epoch, state.batch, state.data, state.train_sums = state.epoch + 1, 0, None, (0.0, 0.0, 0.0)
    event(t, "commit", state)
    # Horovod: commit the finished epoch (a failure from here on never repeats it).
    state.commit()


@hvd.elastic.run
def train(state: hvd.elastic.TorchState, t: ElasticTrainer) -> None:
    """Runs on every rank; on a reset Horovod calls it again (after restore/reset/sync) from the top."""
    # Horovod: TorchState.sync() broadcasts the weights before the optimizer state; on a rank that joined, the
    # latter initialises empty optimizer state with a zero-gradient step, which moves weights under weight decay.
    # Broadcast the weights once more so every rank starts from rank 0's.
    hvd.broadcast_parameters(t.model.state_dict(), root_rank=0)
    # Horovod: rank 0 alone writes the run directory and locks it; a broadcast tells every rank whether another job
    # holds it (then all stop with exit 2). After a reset a new rank 0 takes the lock over from the old one.
    t.run_lock = rundir.claim(t.run_dir, hvd.rank(), lambda v: hvd.broadcast_object(v, 0, name="run_dir.lock"),
                              held=t.run_lock, wait_s=10.0)
    # Only now, with the directory ours, write into it: this process's worker file, rank 0's TensorBoard writer.
    write_worker_file(t.run_dir, hvd.rank(), hvd.size())
    if t.writer is None:
        t.writer = tensorboard_writer(t.cfg, hvd.rank(), t.run_dir)
    event(t, "start", state)
    first = state.epoch
    while state.epoch < t.epochs:
        if t.cfg.stop_after_epoch is not None and t.cfg.stop_after_epoch <= state.epoch:
            log(t.rank, f"stopping after epoch {state.epoch} as asked (--stop-after-epoch)")
            break
        started, samples0, step0 = time.perf_counter(), state.train_sums[2], len(t.meter.steps)
        train_rest_of_epoch(t, state)
        end_epoch(t, state, started, samples0, step0)
    finish(t, state, trained=state.epoch > first or state.resets > 0)


# ---- 6. the end ---------------------------------------------------------------------------------------------

def finish(t: ElasticTrainer, state: hvd.elastic.TorchState, trained: bool) -> None:
    digests = check_in_sync(t.rank, t.size, t.model)  # Horovod: allgather of every rank's weights digest
    # Horovod: gather every rank's data-wait statistics for the summary.
    stall = combine_stall(hvd.allgather_object(t.meter.summary(), name="final.stall"))
    if t.rank != 0:
        return
    if not trained:
        print(f"nothing to train: all {t.epochs} epochs are done in {t.ckpt_dir}\nsummary:    "
              f"{t.run_dir / SUMMARY_NAME}", flush=True)
        return
    history = History(list(state.history))
    rates = [row["samples_per_sec"] for row in history.epochs]
    summary = build_summary(
        epochs_completed=state.epoch, epochs_total=t.epochs, history=history,
        samples_per_sec=float(np.mean(rates)) if rates else math.nan, stall=stall,
        extra={"world_size": t.size, "world_sizes": list(state.sizes), "resets": state.resets,
               "weights_sha256_by_rank": digests})
    path = write_summary(t.run_dir, summary)
    if t.cfg.stall_plot:
        print(f"stall plot: {t.meter.plot(t.run_dir / 'stall.png', title=f'rank 0 of {t.size}: input stall')}",
              flush=True)
    print(f"done: {state.epoch}/{t.epochs} epochs, world sizes {list(state.sizes)}, {state.resets} resets, "
          f"validation accuracy {summary['val_accuracy'] or math.nan:.2%}\nsummary:    {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(ElasticConfig, argv, description=__doc__.split("\n\n")[0])
    hvd.init()  # Horovod: join the job; rank/size come from horovodrun's elastic driver.
    sweep_stale_segments()  # /dev/shm segments a crashed earlier run left (dead creator pid, older than 60 s)
    t, state = setup(cfg)
    try:
        train(state, t)
    finally:
        t.train_loader.close()  # stops the producer processes, frees the shared memory
        if t.writer is not None:
            t.writer.close()
    return 0


if __name__ == "__main__":
    exit_with(main, __file__)  # bad data: exit 2, divergence: exit 3, with the message, no traceback
