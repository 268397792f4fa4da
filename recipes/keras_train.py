"""Data-parallel Keras training with Horovod, read top to bottom. Every Horovod step is marked `# Horovod:`.

Run it on 2 processes on this machine (digits: >= 95% validation accuracy in well under a minute on 2 CPU cores):

    horovodrun -np 2 -H localhost:2 .venv/bin/python recipes/keras_train.py --run-dir runs/keras-digits
    hvdtrain run jobs/keras-digits.yaml                   # the same, from a job spec

Other data:

    horovodrun -np 2 -H localhost:2 python recipes/keras_train.py --dataset synthetic --epochs 3
    horovodrun -np 4 -H host1:2,host2:2 python recipes/keras_train.py --dataset /data/shards --epochs 30

Keras 3 (TF >= 2.16's `tf.keras`) by default; Keras 2 (the `tf-keras` package, matching TF's minor version) when
the job's environment sets TF_USE_LEGACY_KERAS=1 (`env:` in a job spec; TensorFlow reads it at import):

    TF_USE_LEGACY_KERAS=1 horovodrun -np 2 -H localhost:2 python recipes/keras_train.py

The same code runs on both (the Horovod that scripts/setup.sh builds averages under Keras 3); Keras 3 on another
backend than TensorFlow (KERAS_BACKEND) stops with the fix (hvdtrain/tfkeras.py). A checkpoint resumes under the
Keras that wrote it (their optimizer states differ).
`--dataset`, resume and `--run-dir` work as in recipes/pytorch_train.py (a directory, an MDS dataset root or its
URL: the same loader, sharding and node cache as the PyTorch recipes); re-running the same command resumes from
the newest intact checkpoint. `--help` lists all.

What each rank does, in order (Horovod's six Keras steps, plus resume):
 0. TensorFlow's log level (TF_CPP_MIN_LOG_LEVEL=1 unless set: no INFO lines), import TensorFlow (its tf.keras
    checked: Keras 3 on TensorFlow, or tf_keras) and horovod.tensorflow.keras.
 1. hvd.init(); pin one GPU per process (visible device = local rank, memory growth), or on CPU split the
    cores between the local ranks (tf.config.threading); rank 0 locks the run directory (a second job on it
    stops with exit 2, naming the holder).
 2. The model (--precision bf16/fp16: a mixed dtype policy); LR = base LR × world size; wrap the optimizer in
    hvd.DistributedOptimizer (fp16: that in a LossScaleOptimizer, NOTE [Keras loss scaling with Horovod]).
 3. Resume: rank 0 loads the newest checkpoint; the epoch and history are broadcast, the weights and optimizer
    state too (before fit, and by the callback after the first batch); from a checkpoint written mid-epoch, the
    position too: the rest of that epoch is a fit of its own, each rank's metric sums put back.
 4. Callbacks in Horovod's order: BroadcastGlobalVariablesCallback(0), MetricAverageCallback(),
    LearningRateScheduleCallback (the PyTorch recipe's warmup and milestones); a NaN/Inf check of the weights
    after each step (every rank stops at the same step, exit 3); then, on rank 0 only, checkpoints and TensorBoard;
    last, on every rank, the stop vote (below).
    Then fit on each rank's shard of the training set (hvdtrain's ShardSampler: the same steps on every rank) from
    the loader's producer processes (ShmLoader: batches read, checked and moved to N×H×W×C there, an MDS dataset
    or URL streamed with fetch ahead) through tf.data (to_tf_dataset), one loader epoch per Keras epoch; this
    rank's share of the validation set read in the trainer, batch by batch.
 5. Rank 0 writes <run-dir>/summary.json; every rank checks that the weights are identical everywhere.
Asked to stop (SIGUSR1 or SIGTERM to any rank; `hvdtrain run` given SIGUSR1, as a Slurm job is before its time
limit) every rank stops after the same step (the last callback votes), rank 0 checkpoints there (mid-epoch, with
the loader's position and each rank's metric sums) and all exit 75; run the same command again to resume at that
step (NOTE [Keras stops mid-epoch] in hvdtrain/train/kerasstop.py).
"""

from __future__ import annotations

import gc
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hvdtrain import exitcodes, records, rundir, tfkeras
from hvdtrain.data import LoaderError, ShmLoader, expected_batches
from hvdtrain.formats import arrays
from hvdtrain.settings.parse import parse_config
from hvdtrain.settings.recipes import KerasTrainConfig as Config  # every flag, defined once
from hvdtrain.train import checkpoint, preempt
from hvdtrain.train.channels_last import channels_last_shape, take_channels_last
from hvdtrain.train.entry import exit_with
from hvdtrain.train.lr import LRSchedule, scaled_epochs
from hvdtrain.train.metrics import History, build_summary, write_summary
from hvdtrain.train.recipe_data import load_splits
from hvdtrain.train.report import images_note, log, nothing_to_train, run_config, same_weights, versions

if TYPE_CHECKING:  # imported in main(), after TensorFlow
    from hvdtrain.train.kerasstop import Leg


def import_tensorflow() -> Any:
    """TensorFlow, its tf.keras checked to be Keras 3 on TensorFlow or Keras 2 (tf_keras); else stop with the fix
    (exit 1)."""
    try:
        return tfkeras.import_tensorflow()
    except tfkeras.KerasVersionError as exc:
        sys.exit(f"{Path(__file__).name}: error: {exc}")


def lr_schedule(cfg: Config, lr: float) -> LRSchedule:
    """Per step: a linear warmup over --warmup-epochs from the single-worker LR (lr / size) up to the scaled `lr`
    (Goyal et al.; Horovod's LearningRateWarmupCallback), then × --lr-gamma from each --lr-milestones epoch."""
    return LRSchedule(peak_lr=lr, start_lr=cfg.base_lr, warmup_epochs=cfg.warmup_epochs,
                      milestones=cfg.lr_milestones, gamma=cfg.lr_gamma)


@dataclass
class Run:
    """What this run's fits share, made once by main() (after it imported TensorFlow and Horovod); the Horovod calls
    stay in the functions that use it."""

    cfg: Config
    hvd: Any  # horovod.tensorflow.keras
    hvd_tf: Any  # horovod.tensorflow: broadcast_object, allgather_object
    request: preempt.StopRequest
    where: str  # the device line: a GPU, or the CPU threads of this rank
    run_dir: Path
    run_lock: rundir.RunDirLock | None
    splits: arrays.Splits
    steps: int  # per epoch, the same on every rank
    epochs: int
    model: Any
    lr: float  # the peak LR, scaled by the world size
    schedule: LRSchedule
    first: int = 0  # the first epoch this run trains (after a resume: rank 0's checkpoint's)
    history: History = field(default_factory=History)
    recorder: Any = None  # keraskit.Recorder, made by train()

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


def lr_callback(hvd: Any, schedule: LRSchedule, leg: Leg) -> Any:
    # Horovod: the LR of every step: scaled by the world size, ramped up linearly over the warmup epochs (Goyal et
    # al.), × gamma from each milestone on. One LearningRateScheduleCallback with the PyTorch recipe's schedule
    # (hvdtrain/train/lr.py), evaluated at each step's end as there: Horovod's own warmup callback plus a constant
    # multiplier per milestone would compound (it applies a constant as multiplier ** (epoch - start_epoch)).
    # momentum_correction=False: Keras 2.11+ optimizers hold momentum as a Python float, which Horovod 0.28.1's
    # correction (scale momentum by new_lr / old_lr for one step) tries to set as a variable and fails.
    peak, steps = schedule.peak_lr, leg.first_step + leg.steps  # the epoch's steps (a resumed leg: its rest)

    def multiplier(at: float) -> float:  # Horovod calls it with epoch + batch / leg.steps before each batch
        epoch = int(at)
        step = leg.first_step + min(round((at - epoch) * leg.steps), leg.steps - 1)
        return schedule.lr_for_step(epoch, step, steps) / peak

    return hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=peak, multiplier=multiplier, staircase=False, steps_per_epoch=leg.steps,
        momentum_correction=False)


# The helpers below run inside main(), after it imported TensorFlow: they import keraskit
# (which imports TensorFlow) there, not at the top of this file: importing the recipe, or --help, imports no
# TensorFlow.

def build_model(cfg: Config, splits: arrays.Splits) -> Any:
    """The model for N×H×W×C batches under --precision's dtype policy (bf16/fp16 layers, fp32 weights and output),
    its weights seeded alike on every rank (rank 0's are broadcast anyway)."""
    from hvdtrain.train import keraskit

    keraskit.set_precision(cfg.precision)  # the global Keras policy: before any layer is made
    keraskit.tf.keras.utils.set_random_seed(cfg.seed)
    return keraskit.build_model(channels_last_shape(splits.train.sample_shape), splits.num_classes, cfg.width)


def make_optimizer(cfg: Config, hvd: Any, lr: float) -> Any:
    """SGD at `lr` (the schedule's first step) wrapped in Horovod's DistributedOptimizer; fp16: that in a
    LossScaleOptimizer."""
    from hvdtrain.train import keraskit

    sgd = keraskit.tf.keras.optimizers.SGD(learning_rate=lr, momentum=cfg.momentum)
    # Horovod: wrap the optimizer: gradients are averaged over all ranks by allreduce before they are applied.
    opt = hvd.DistributedOptimizer(sgd, compression=hvd.Compression.fp16 if cfg.fp16_allreduce else
                                   hvd.Compression.none)
    # Horovod: fp16: the loss scale wraps the DistributedOptimizer (not the reverse), so the scaled gradients are
    # averaged before the scale decides: every rank skips the same overflowing steps, see
    # NOTE [Keras loss scaling with Horovod] in hvdtrain/train/keraskit.py.
    return keraskit.loss_scaled(opt, cfg.precision)


def compile_model(model: Any, optimizer: Any) -> None:
    """Compile with `optimizer`, and create its variables (momentum, iterations) now, before fit, the same way on every
    rank: rank 0 must have them to restore into, and BroadcastGlobalVariablesCallback matches variables across ranks
    by name (variables created here and ones created lazily inside fit are named differently: the broadcast would
    hang)."""
    from hvdtrain.train import keraskit

    model.compile(optimizer=optimizer, loss=keraskit.tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.optimizer.build(model.trainable_variables)


def set_up_process(cfg: Config, tf: Any, hvd: Any, hvd_tf: Any) -> tuple[str, Path, rundir.RunDirLock | None]:
    """This rank's device (its GPU, or its share of the CPU cores) and the run directory, locked by rank 0."""
    from hvdtrain.train import keraskit

    # Horovod: pin one GPU per process (visible device = the local rank's), its memory allocated as needed.
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
    where = keraskit.setup_process(cfg.threads, hvd.local_size())  # CPU threads per rank; stale /dev/shm swept
    run_dir = Path(cfg.run_dir).absolute()
    # Horovod: rank 0 alone writes the run directory and locks it; if another job holds it, every rank stops: exit 2.
    run_lock = rundir.claim(run_dir, hvd.rank(), lambda v: hvd_tf.broadcast_object(v, root_rank=0,
                                                                                   name="run_dir.lock"))
    return where, run_dir, run_lock


def start_line(run: Run) -> str:
    from hvdtrain.train import keraskit

    cfg, splits, size = run.cfg, run.splits, run.hvd.size()
    return (f"{size} ranks on {run.where}  dataset {splits.name}: {len(splits.train)} train / {len(splits.val)} val  "
            f"{tfkeras.keras_info(keraskit.tf).describe()}  epochs {run.first + 1}..{run.epochs}  batch "
            f"{cfg.batch_size}×{size} ranks  {run.steps} steps/epoch  peak lr {run.lr:g}  {cfg.precision}"
            f"{images_note(splits, cpu=not run.where.startswith('GPU'))}")


def rank_0_callbacks(cfg: Config, run_dir: Path, history: History) -> list[Any]:
    """Atomic checkpoints after each epoch (Keras's ModelCheckpoint writes in place: a crash mid-write would leave a
    torn file to resume from) and, with --tensorboard, TensorBoard."""
    from hvdtrain.train import keraskit

    callbacks = [keraskit.Checkpoint(run_dir / "checkpoints", cfg.keep_checkpoints, history)]
    if cfg.tensorboard:
        callbacks.append(keraskit.tf.keras.callbacks.TensorBoard(log_dir=str(run_dir / "tensorboard"),
                                                                 write_graph=False, profile_batch=0))
    return callbacks


def stop_vote(hvd_tf: Any, request: preempt.StopRequest) -> preempt.StopVote:
    """SIGUSR1, SIGTERM or `hvdtrain run`'s stop file on any rank stops every rank after the same step (NOTE [stop
    requests] in hvdtrain/train/preempt.py)."""
    from hvdtrain.train import keraskit

    tf = keraskit.tf
    # Horovod: each rank's [0/1 flag, steps until the next vote], maxed over the ranks by an allreduce about every
    # 0.25 s (horovod.tensorflow's allreduce returns when it is done: NOTE [Keras stops mid-epoch]).
    return preempt.StopVote(
        request, lambda values: hvd_tf.allreduce(tf.constant(values, tf.int32), op=hvd_tf.Max, name="stop.vote"),
        lambda result: [int(v) for v in result.numpy()])


def save_stop(run: Run, leg: Leg, epoch: int, step: int, trained: int) -> str:
    """Every rank, after the step the ranks agreed to stop at (`step` of epoch `epoch`, `trained` of them in this
    leg): rank 0 writes the checkpoint of this point in the epoch; returns its path."""
    from hvdtrain.train import keraskit, kerasstop

    hvd_tf = run.hvd_tf
    # Horovod: rank 0 keeps what of every rank no collective has made equal (its metric sums): gather it.
    ranks = hvd_tf.allgather_object(kerasstop.metric_state(run.model), name="stop.ranks")
    path = ""
    if hvd_tf.rank() == 0:  # the loader's position: the epoch's start + the steps trained (tf.data reads ahead)
        loader = kerasstop.advanced(leg.data.loader.sampler, leg.data.starts[epoch], trained)
        position = {"epoch": epoch, "step": step, "loader": loader, "ranks": ranks}
        path = str(keraskit.save_checkpoint(run.ckpt_dir, run.cfg.keep_checkpoints, run.model, run.history, epoch,
                                            position))
    # Horovod: no rank exits before the checkpoint is written (under horovodrun the first exit ends the job).
    return str(hvd_tf.broadcast_object(path, root_rank=0, name="stop.saved"))


def fit(run: Run, position: dict[str, Any] | None, callbacks: Callable[[Leg], list[Any]]) -> None:
    """Keras epochs run.first..run.epochs-1 on this rank's shard of the training set, validating on its share of the
    validation split; `callbacks(leg)` gives each fit's."""
    from hvdtrain.train import keraskit, kerasstop

    cfg, splits, model, rank, size = run.cfg, run.splits, run.model, run.hvd.rank(), run.hvd.size()
    # Horovod: each rank reads only its shard (ShardSampler: strided over a per-epoch permutation that is the same on
    # every rank; padded so that every rank runs the same `steps`: an uneven shard would leave one rank waiting in an
    # allreduce), built by producer processes into shared memory (an MDS dataset is read there, shuffle block by
    # shuffle block: `order`) and moved to N×H×W×C there; each Keras epoch is one epoch of the loader (its
    # set_epoch: the same shuffle on every rank). Leaving the block stops the producers; bad data met in tf.data is
    # re-raised as itself (exit 2 with its message).
    with ShmLoader(splits.train, rank=rank, size=size, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                   seed=cfg.seed, fetch=take_channels_last, order=splits.train.order,
                   epochs=run.epochs) as loader, keraskit.data_errors_reraised():
        todo = kerasstop.legs(loader, run.first, run.epochs, run.steps, position,
                              kerasstop.resumed_metrics(position, rank, size), run.ckpt_dir)
        for i, leg in enumerate(todo):
            model.fit(keraskit.train_input(leg.data, channels_last_shape(splits.train.sample_shape)),
                      steps_per_epoch=leg.steps, epochs=leg.data.epochs, initial_epoch=leg.data.first,
                      validation_data=keraskit.val_input(splits.val, rank, size), callbacks=callbacks(leg),
                      shuffle=False,  # the loader shuffles (Keras 3 warns that it cannot shuffle a tf.data input)
                      verbose=cfg.verbose if rank == 0 else 0)  # Horovod: output on rank 0 only
            if model.stop_training or i + 1 == len(todo):  # --stop-after-epoch (every rank alike), or the last leg
                return
            # One thread at a time iterates the loader: this leg's input has ended before the next one starts.
            if not leg.data.finished.wait(loader.timeout):
                raise LoaderError(f"the input of epochs {leg.data.first + 1}..{leg.data.epochs} did not end within "
                                  f"{loader.timeout:g} s of their last step")


def resume(run: Run) -> dict[str, Any] | None:
    """Rank 0 restores the newest intact checkpoint (unless --no-resume); every rank starts from rank 0's epoch,
    history, weights and optimizer state. Returns the position of a checkpoint written mid-epoch, else None."""
    from hvdtrain.train import keraskit

    hvd_tf = run.hvd_tf
    first, rows, position = (keraskit.load_latest(run.ckpt_dir, run.model) if hvd_tf.rank() == 0 and run.cfg.resume
                             else (0, [], None))
    # Horovod: every rank starts at rank 0's epoch and history, and with its weights and optimizer state: before fit
    # too (the callback below broadcasts after the first batch, which would average in gradients at other weights);
    # from a checkpoint written mid-epoch, at its step with each rank's own metric sums (NOTE [Keras stops
    # mid-epoch] in hvdtrain/train/kerasstop.py).
    run.first = hvd_tf.broadcast_object(first, root_rank=0, name="resume.epoch")
    run.history = History(hvd_tf.broadcast_object(rows, root_rank=0, name="resume.history"))
    position = hvd_tf.broadcast_object(position, root_rank=0, name="resume.position")
    if run.first or position is not None:
        hvd_tf.broadcast_variables(run.model.variables + keraskit.optimizer_state(run.model.optimizer),
                                   root_rank=0)  # fp16's scale too
    return position


def leg_callbacks(run: Run, leg: Leg, broadcast: Any, vote: preempt.StopVote) -> list[Any]:
    """A fit's callbacks, in Horovod's order."""
    from hvdtrain.train import keraskit, kerasstop

    hvd, schedule, recorder = run.hvd, run.schedule, run.recorder
    if leg.first_step:  # the rest of a stopped epoch: its share of the samples, its first step's LR
        recorder.resumed(leg.steps / (leg.first_step + leg.steps),
                         schedule.lr_for_step(leg.data.first, 0, leg.first_step + leg.steps))
    return [
        broadcast,  # Horovod: rank 0's weights and optimizer state
        hvd.callbacks.MetricAverageCallback(),  # Horovod: each epoch's metrics averaged over all ranks
        lr_callback(hvd, schedule, leg),  # Horovod: the LR of every step (warmup, milestones)
        *([keraskit.StopOnNonFinite(leg.first_step + leg.steps, leg.first_step)] if run.cfg.check_finite
          else []),  # NaN/Inf: every rank stops at the same step
        recorder,  # each epoch's (averaged) metrics, LR and timing into the history, on every rank
        *(rank_0_callbacks(run.cfg, run.run_dir, run.history) if hvd.rank() == 0 else []),  # Horovod: rank 0 only
        kerasstop.StopAtBoundary(  # last: a stop request on any rank stops every rank after the same step
            vote, lambda epoch, step, trained: save_stop(run, leg, epoch, step, trained),
            lambda done: str(checkpoint.checkpoint_path(run.ckpt_dir, done)), run.epochs, first_step=leg.first_step,
            metrics=leg.metrics),
    ]


def train(run: Run, position: dict[str, Any] | None) -> str:
    """The fits, with their callbacks; the checkpoint to resume from if the ranks agreed to stop (exit 75), else
    ""."""
    from hvdtrain.train import keraskit, kerasstop

    rank, size = run.hvd.rank(), run.hvd.size()
    samples = math.ceil(len(run.splits.train) / size) * size  # per epoch, over all ranks
    run.recorder = keraskit.Recorder(run.history, samples, rank, run.epochs, run.cfg.stop_after_epoch)
    broadcast = run.hvd.callbacks.BroadcastGlobalVariablesCallback(0)  # one for every fit: it broadcasts once
    vote = stop_vote(run.hvd_tf, run.request)  # SIGUSR1/SIGTERM: checkpoint at the next step boundary, exit 75
    try:
        fit(run, position, lambda leg: leg_callbacks(run, leg, broadcast, vote))
    except kerasstop.Preempted as stop:  # every rank, after the same step; checkpointed
        return stop.path
    return ""


def finish(run: Run) -> None:
    """Every rank: compare the weights; rank 0: summary.json, or nothing if this run trained nothing; then the run
    directory is released."""
    from hvdtrain.train import keraskit

    cfg, hvd, tf, history = run.cfg, run.hvd, keraskit.tf, run.history
    rank, size, first, epochs = hvd.rank(), hvd.size(), run.first, run.epochs
    # Horovod: every rank must end with identical weights; gather each rank's digest and compare.
    digests = run.hvd_tf.allgather_object(keraskit.weights_digest(run.model), name="final.digest")
    log(rank, same_weights(digests, size))
    done = int(history.epochs[-1]["epoch"]) if history.epochs else first
    if rank == 0 and done == first:
        print(nothing_to_train(epochs, run.ckpt_dir, run.run_dir), flush=True)
    elif rank == 0:
        # Horovod: rank 0 writes the summary, with what the run was; its world: hvd.size() ranks, hvd.local_size()
        # on this host, on hvd.cross_size() hosts (the ranks whose local rank is 0, as this one's).
        keras = tfkeras.keras_info(tf)  # keras (3) or tf_keras (2), its version
        config = run_config(cfg, run.splits, model=keraskit.model_info(run.model, cfg.width), epochs=epochs,
                            peak_lr=run.lr,
                            world={"size": size, "local_size": hvd.local_size(), "hosts": hvd.cross_size()},
                            versions=versions(tensorflow=tf.__version__, **{keras.package: keras.version}))
        recorder = run.recorder
        summary = build_summary(
            epochs_completed=done, epochs_total=epochs, history=history, stall=None, config=config,
            samples_per_sec=recorder.trained_samples / recorder.trained_s if recorder and recorder.trained_s
            else math.nan,
            extra={"world_size": size, "resumed_from_epoch": first, "weights_sha256_by_rank": digests,
                   "keras": keras.describe()})
        path = write_summary(run.run_dir, summary)
        last = summary["val_accuracy"]
        print(f"done: {done}/{epochs} epochs, validation accuracy {'n/a' if last is None else format(last, '.2%')}"
              f"\nsummary:    {path}", flush=True)
    if run.run_lock is not None:
        run.run_lock.release()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    # TensorFlow's INFO lines (and its start-up lines: hvdtrain/tfkeras.py) stay off the console unless set.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    tf = import_tensorflow()  # Keras 3 on TensorFlow, or tf_keras under TF_USE_LEGACY_KERAS=1; else stops with the fix
    import horovod.tensorflow as hvd_tf  # broadcast_object / allgather_object
    import horovod.tensorflow.keras as hvd

    # ---- 1. processes and devices
    hvd.init()  # Horovod: join the job; rank/size come from horovodrun (or mpirun).
    # Asked to stop (SIGUSR1, SIGTERM, hvdtrain run's stop file) from now on: acted on at the first step boundary.
    request = preempt.StopRequest(records.directory(), sigterm_grace_s=cfg.sigterm_grace).install()
    where, run_dir, run_lock = set_up_process(cfg, tf, hvd, hvd_tf)
    # ---- 2. data (each rank's shard is read in fit, below), model, LR, optimizer
    splits = load_splits(cfg)
    steps = expected_batches(len(splits.train), hvd.size(), cfg.batch_size)  # per epoch, the same on every rank
    model = build_model(cfg, splits)
    # Horovod: scale the LR by the number of workers (the effective batch is hvd.size() × larger; Goyal et al.).
    lr = cfg.base_lr * hvd.size()
    schedule = lr_schedule(cfg, lr)  # warmup from lr / hvd.size() to lr, then the milestones
    compile_model(model, make_optimizer(cfg, hvd, schedule.lr_at(0)))
    epochs = scaled_epochs(cfg.epochs, hvd.size(), cfg.scale_epochs_by_size)  # Horovod: ceil(epochs / size) if asked
    run = Run(cfg, hvd, hvd_tf, request, where, run_dir, run_lock, splits, steps, epochs, model, lr, schedule)
    # ---- 3. resume: rank 0 restores the newest intact checkpoint; every rank starts from rank 0's
    position = resume(run)
    log(hvd.rank(), start_line(run))
    # ---- 4. callbacks in Horovod's order, then fit on this rank's shard
    if run.first < run.epochs:
        stop = train(run, position)
        if stop:
            if hvd.rank() == 0:
                print(preempt.stop_line(request, stop), flush=True)
            gc.collect()  # the stopped fit's tf.data iterator ends now: at interpreter exit TensorFlow warns of it
            return exitcodes.PREEMPTED
    # ---- 5. the end: identical weights everywhere; rank 0 writes summary.json
    finish(run)
    return 0


if __name__ == "__main__":
    exit_with(main, __file__)  # bad data: exit 2, divergence: exit 3, with the message, no traceback
