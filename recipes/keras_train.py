"""Data-parallel Keras training with Horovod, read top to bottom. Every Horovod step is marked `# Horovod:`.

Run it on 2 processes on this machine (digits: >= 95% validation accuracy in well under a minute on 2 CPU cores):

    horovodrun -np 2 -H localhost:2 .venv/bin/python recipes/keras_train.py --run-dir runs/keras-digits
    hvdtrain run jobs/keras-digits.yaml                   # the same, from a job spec

Other data:

    horovodrun -np 2 -H localhost:2 python recipes/keras_train.py --dataset synthetic --epochs 3
    horovodrun -np 4 -H host1:2,host2:2 python recipes/keras_train.py --dataset /data/shards --epochs 30

Keras 2 only: `horovod.tensorflow.keras` does not work with Keras 3 (TF >= 2.16's default `tf.keras`): its
DistributedOptimizer silently stops averaging gradients. This script sets `TF_USE_LEGACY_KERAS=1` before TensorFlow
is imported (so `tf.keras` is the `tf-keras` package, which must match TF's minor version) and stops with the fix
if `tf.keras` is still Keras 3 (see hvdtrain/tfkeras.py). `--dataset`, resume and `--run-dir` work as in
recipes/pytorch_train.py: re-running the same command resumes from the newest intact checkpoint. `--help` lists all.

What each rank does, in order (Horovod's six Keras steps, plus resume):
 1. hvd.init(); pin one GPU per process (visible device = local rank, memory growth), or on CPU split the
    cores between the local ranks (tf.config.threading); rank 0 locks the run directory (a second job on it
    stops with exit 2, naming the holder).
 2. tf.data input sharded per rank with hvdtrain's ShardSampler (same steps on every rank), prefetch(AUTOTUNE).
 3. LR = base LR × world size; wrap the optimizer in hvd.DistributedOptimizer.
 4. Callbacks in Horovod's order: BroadcastGlobalVariablesCallback(0), MetricAverageCallback(),
    LearningRateWarmupCallback, LR schedules; a NaN/Inf check of the weights after each step (every rank stops
    at the same step, exit 3); then, on rank 0 only, checkpoints and TensorBoard.
 5. Resume: rank 0 loads the newest checkpoint; the epoch is broadcast; the weights follow by the callback.
 6. Rank 0 writes <run-dir>/summary.json; every rank checks that the weights are identical everywhere.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain import tfkeras
from hvdtrain.data import ShardSampler, expected_batches
from hvdtrain.train import checkpoint, datasets, divergence, rundir
from hvdtrain.train.config import parse_config
from hvdtrain.train.entry import exit_with
from hvdtrain.train.lr import scaled_epochs
from hvdtrain.train.metrics import SUMMARY_NAME, History, build_summary, write_summary

try:
    # Horovod: Keras 2 for horovod.tensorflow.keras — TF_USE_LEGACY_KERAS=1 before TensorFlow is imported; stop
    # with the fix on Keras 3 (where DistributedOptimizer would silently not average gradients).
    tf, hvd = tfkeras.import_horovod_keras()
    import horovod.tensorflow as hvd_tf  # broadcast_object / allgather_object
except tfkeras.KerasVersionError as exc:
    sys.exit(f"{Path(__file__).name}: error: {exc}")

AUTOTUNE = tf.data.AUTOTUNE


@dataclass(frozen=True)
class Config:
    dataset: str = field(default="digits", metadata={"help": "digits | synthetic | DIR of .npz/.npy shards"})
    width: int = field(default=32, metadata={"help": "channels of the first conv layer / hidden units"})
    epochs: int = field(default=10, metadata={"help": "total epochs"})
    scale_epochs_by_size: bool = field(default=False, metadata={
        "help": "run ceil(epochs / world size) epochs, as Horovod's Keras examples do"})
    batch_size: int = field(default=32, metadata={"help": "samples per rank per step"})
    base_lr: float = field(default=0.05, metadata={"help": "single-process LR; × world size"})
    momentum: float = 0.9
    warmup_epochs: int = field(default=2, metadata={"help": "epochs of linear LR warmup (0: none)"})
    lr_milestones: tuple[int, ...] = field(default=(), metadata={"help": "epochs where LR ×= gamma, e.g. 10,20"})
    lr_gamma: float = 0.1
    fp16_allreduce: bool = field(default=False, metadata={"help": "compress gradients to fp16 for allreduce"})
    threads: int | None = field(default=None, metadata={"help": "CPU threads per rank (cores // local ranks)"})
    seed: int = 42
    val_fraction: float = field(default=0.2, metadata={"help": "held-out share (digits, shard dirs)"})
    synthetic_shape: tuple[int, ...] = field(default=(3, 32, 32), metadata={"help": "sample shape, C,H,W"})
    synthetic_samples: int = 1024
    num_classes: int | None = field(default=None, metadata={
        "help": "classes; labels must be below it (none: 10 for digits and synthetic, from the labels of shards)"})
    check_finite: bool = field(default=True, metadata={
        "help": "stop on NaN/Inf: in the samples (at load), the weights (each step), the loss (each epoch)"})
    run_dir: str = field(default="runs/keras", metadata={"help": "checkpoints, TensorBoard, summary.json"})
    keep_checkpoints: int = 3
    resume: bool = field(default=True, metadata={"help": "resume from the newest intact checkpoint"})
    stop_after_epoch: int | None = field(default=None, metadata={
        "help": "stop cleanly after this epoch (re-run to resume)"})
    verbose: int = field(default=2, metadata={"choices": (0, 1, 2), "help": "Keras fit verbosity on rank 0"})
    tensorboard: bool = field(default=True, metadata={"help": "TensorBoard logs on rank 0"})

    def __post_init__(self) -> None:
        for name in ("width", "epochs", "batch_size", "keep_checkpoints", "synthetic_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup_epochs < 0:
            raise ValueError(f"--warmup-epochs must be >= 0, got {self.warmup_epochs}")
        if not (self.base_lr > 0 and math.isfinite(self.base_lr)):
            raise ValueError(f"--base-lr must be a finite number > 0, got {self.base_lr}")
        if list(self.lr_milestones) != sorted(set(self.lr_milestones)) or any(m < 1 for m in self.lr_milestones):
            raise ValueError(f"--lr-milestones must be increasing epochs >= 1, got {self.lr_milestones}")
        if self.num_classes is not None and self.num_classes < 2:
            raise ValueError(f"--num-classes must be >= 2 (or none), got {self.num_classes}")
        for name in ("threads", "stop_after_epoch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (or none), got {getattr(self, name)}")


def log(rank: int, *args: Any) -> None:
    if rank == 0:
        print(*args, flush=True)


# ---- 1. processes and devices ------------------------------------------------------------------------------

def setup_devices(local_rank: int, local_size: int, threads: int | None) -> str:
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        # Horovod: pin one GPU per process: visible device = local rank; allocate its memory as needed.
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(gpus[local_rank], "GPU")
        return f"GPU {local_rank}"
    # Horovod: on CPU, split this host's cores between its ranks, or they oversubscribe each other.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = threads or max(1, cores // local_size)
    tf.config.threading.set_intra_op_parallelism_threads(n)
    tf.config.threading.set_inter_op_parallelism_threads(max(1, min(2, n)))
    return f"CPU ({n} threads)"


# ---- 2. data -------------------------------------------------------------------------------------------------

def channels_last(ds: datasets.ArrayDataset) -> datasets.ArrayDataset:
    """hvdtrain's datasets are N×C×H×W (PyTorch's layout); Keras convolutions on CPU need N×H×W×C."""
    if ds.x.ndim != 4:
        return ds
    return datasets.ArrayDataset(np.ascontiguousarray(np.moveaxis(ds.x, 1, -1)), ds.y)


def train_dataset(ds: datasets.ArrayDataset, cfg: Config, rank: int, size: int, first: int, epochs: int) -> Any:
    """Epochs first..epochs-1 of this rank's shard as one tf.data pipeline (fit runs it with steps_per_epoch).

    Horovod: each rank reads only its shard: ShardSampler takes every size-th sample of a per-epoch permutation
    that is the same on every rank (seeded by seed and epoch, so a resumed run sees the same order), padded so
    every rank runs the same number of steps (an uneven shard would leave one rank waiting in an allreduce).
    """
    def epoch_indices(epoch: np.int64) -> np.ndarray:
        sampler = ShardSampler(len(ds), rank, size, seed=cfg.seed, shuffle=True, batch_size=cfg.batch_size)
        sampler.set_epoch(int(epoch))
        return sampler.indices().astype(np.int64)

    def one_epoch(epoch: Any) -> Any:
        idx = tf.numpy_function(epoch_indices, [epoch], tf.int64, stateful=False)
        return tf.data.Dataset.from_tensor_slices(idx).batch(cfg.batch_size)

    def fetch(idx: Any) -> tuple[Any, Any]:
        x, y = tf.numpy_function(ds.take, [idx], (tf.float32, tf.int64), stateful=False)
        return tf.ensure_shape(x, (None, *ds.x.shape[1:])), tf.ensure_shape(y, (None,))

    return (tf.data.Dataset.range(first, epochs).flat_map(one_epoch)
            .map(fetch, num_parallel_calls=AUTOTUNE, deterministic=True).prefetch(AUTOTUNE))


def val_dataset(ds: datasets.ArrayDataset, rank: int, size: int) -> Any:
    """This rank's share of the validation set (padded by wrapping to equal shares: up to size-1 repeats)."""
    idx = ShardSampler(len(ds), rank, size, shuffle=False).indices()
    return tf.data.Dataset.from_tensor_slices(ds.take(idx)).batch(256).prefetch(AUTOTUNE)


# ---- 3. model and optimizer ---------------------------------------------------------------------------------

def build_model(sample_shape: tuple[int, ...], num_classes: int, width: int) -> Any:
    layers = tf.keras.layers
    if len(sample_shape) == 3:  # images, H×W×C
        body = [layers.Conv2D(width, 3, padding="same", activation="relu"),
                layers.Conv2D(2 * width, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
                layers.Flatten()]
    else:
        body = [layers.Flatten(), layers.Dense(4 * width, activation="relu")]
    return tf.keras.Sequential([tf.keras.Input(sample_shape), *body,
                                layers.Dense(4 * width, activation="relu"), layers.Dense(num_classes)])


def compile_model(model: Any, cfg: Config, size: int) -> float:
    # Horovod: scale the LR by the number of workers (the effective batch is size × larger; Goyal et al.).
    lr = cfg.base_lr * size
    opt = tf.keras.optimizers.SGD(learning_rate=lr, momentum=cfg.momentum)
    # Horovod: wrap the optimizer: gradients are averaged over all ranks by allreduce before they are applied.
    opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16 if cfg.fp16_allreduce
                                   else hvd.Compression.none)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return lr


# ---- 4. callbacks: Horovod's, then checkpoints and TensorBoard on rank 0 -----------------------------------

def weights_digest(model: Any) -> str:
    """SHA-256 over the model's weights in order (shape, then raw bytes)."""
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(str(w.shape).encode())
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def write_npz(state: dict[str, Any], f: Any) -> None:
    arrays = {f"model/{i:04d}": w for i, w in enumerate(state["model"])}
    arrays |= {f"optimizer/{i:04d}": w for i, w in enumerate(state["optimizer"])}
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    buf = io.BytesIO()
    np.savez(buf, meta=np.array(json.dumps(meta)), **arrays)
    f.write(buf.getvalue())


def read_npz(f: Any) -> dict[str, Any]:
    with np.load(f, allow_pickle=False) as z:
        state = json.loads(str(z["meta"]))
        for part in ("model", "optimizer"):
            state[part] = [z[k] for k in sorted(n for n in z.files if n.startswith(part + "/"))]
    return state


class Checkpoint(tf.keras.callbacks.Callback):
    """Rank 0's ModelCheckpoint: weights + optimizer state + history after each epoch, written atomically
    (temp file + rename, SHA-256 verified on load, the newest `keep` kept) with hvdtrain.train.checkpoint.
    Keras's own ModelCheckpoint writes in place, so a crash mid-write would leave a torn file to resume from."""

    def __init__(self, directory: Path, keep: int, history: History) -> None:
        super().__init__()
        self.directory, self.keep, self.history = directory, keep, history

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        state = {"model": self.model.get_weights(), "history": self.history.epochs,
                 "optimizer": [np.asarray(v.numpy()) for v in self.model.optimizer.variables]}
        checkpoint.save(self.directory, epoch + 1, state, write_npz, keep=self.keep)


class Recorder(tf.keras.callbacks.Callback):
    """Times each epoch's training part and records the (rank-averaged) metrics in `history` on every rank."""

    def __init__(self, history: History, samples_per_epoch: int, rank: int, epochs: int,
                 stop_after: int | None) -> None:
        super().__init__()
        self.history, self.samples, self.rank, self.epochs, self.stop_after = (
            history, samples_per_epoch, rank, epochs, stop_after)
        self.start = self.train_end = 0.0
        self.trained_s = self.trained_samples = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.start, self.train_end = time.perf_counter(), 0.0

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.train_end = self.train_end or time.perf_counter()  # validation starts: the training part ended

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs or {}
        took = (self.train_end or time.perf_counter()) - self.start
        self.trained_s, self.trained_samples = self.trained_s + took, self.trained_samples + self.samples
        lr = float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))
        row = self.history.record(epoch + 1, train_loss=logs["loss"], train_accuracy=logs["accuracy"],
                                  val_loss=logs.get("val_loss", math.nan),
                                  val_accuracy=logs.get("val_accuracy", math.nan), lr=lr,
                                  samples_per_sec=self.samples / took)
        log(self.rank, f"epoch {epoch + 1}/{self.epochs}  train loss {row['train_loss']:.4f} acc "
                       f"{row['train_accuracy']:.2%}  val loss {row['val_loss']:.4f} acc {row['val_accuracy']:.2%}"
                       f"  lr {lr:.4g}  {row['samples_per_sec']:.0f} samples/s")
        if self.stop_after is not None and self.stop_after <= epoch + 1 < self.epochs:
            log(self.rank, f"stopping after epoch {epoch + 1} as asked (--stop-after-epoch); run again to resume")
            self.model.stop_training = True


class StopOnNonFinite(tf.keras.callbacks.Callback):
    """Stops every rank at the same step when the weights hold NaN/Inf after an update, and after an epoch whose
    (rank-averaged) loss is NaN/Inf, before it is checkpointed. The weights are the same on every rank (broadcast
    after the first step, then the same averaged gradients everywhere): NOTE [divergence checks] in
    hvdtrain/train/divergence.py. Keras's TerminateOnNaN reads each rank's own loss: one rank would stop while the
    others wait for it in their next allreduce."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps, self.epoch = steps, 0
        self.all_finite: Any = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        variables = self.model.trainable_variables
        self.all_finite = tf.function(lambda: tf.reduce_all([tf.reduce_all(tf.math.is_finite(v))
                                                             for v in variables]))
        self.all_finite()  # traced now, not inside the first step's timing

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not bool(self.all_finite()):
            raise divergence.at_step(self.epoch, batch, self.steps, "the weights hold NaN/Inf after the update",
                                     float((logs or {}).get("loss", math.nan)),
                                     loss_label="this rank's mean loss so far in the epoch")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        divergence.check_epoch(epoch, {k: float(v) for k, v in (logs or {}).items() if k in ("loss", "val_loss")})


def lr_callbacks(cfg: Config, lr: float, steps: int, rank: int) -> list[Any]:
    # momentum_correction=False: Keras 2.11+ optimizers hold momentum as a Python float, which Horovod 0.28.1's
    # correction (scale momentum by new_lr / old_lr for one step) tries to set as a variable and fails.
    cbs: list[Any] = []
    if cfg.warmup_epochs:
        # Horovod: ramp the LR from lr / size to lr over the first epochs, every step (Goyal et al.).
        cbs.append(hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=lr, warmup_epochs=cfg.warmup_epochs, steps_per_epoch=steps, momentum_correction=False,
            verbose=int(rank == 0)))
    # Horovod: then the schedule: lr × gamma^k from the k-th milestone on.
    bounds = [cfg.warmup_epochs, *(m for m in cfg.lr_milestones if m > cfg.warmup_epochs)]
    for k, start in enumerate(bounds):
        end = bounds[k + 1] if k + 1 < len(bounds) else None
        cbs.append(hvd.callbacks.LearningRateScheduleCallback(
            initial_lr=lr, multiplier=cfg.lr_gamma ** sum(m <= start for m in cfg.lr_milestones),
            start_epoch=start, end_epoch=end, steps_per_epoch=steps, momentum_correction=False))
    return cbs


def make_callbacks(cfg: Config, rank: int, lr: float, steps: int, run_dir: Path, recorder: Recorder) -> list[Any]:
    cbs = [
        # Horovod: after the first batch, copy rank 0's weights and optimizer state to every rank (random init,
        # or the checkpoint rank 0 resumed from).
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average the epoch's metrics (loss, accuracy, val_*) over all ranks before anything logs them.
        hvd.callbacks.MetricAverageCallback(),
        *lr_callbacks(cfg, lr, steps, rank),
        *([StopOnNonFinite(steps)] if cfg.check_finite else []),  # before the epoch is recorded or checkpointed
        recorder,
    ]
    if rank == 0:  # Horovod: checkpoints and TensorBoard on rank 0 only (every rank holds the same weights).
        cbs.append(Checkpoint(run_dir / "checkpoints", cfg.keep_checkpoints, recorder.history))
        if cfg.tensorboard:
            cbs.append(tf.keras.callbacks.TensorBoard(log_dir=str(run_dir / "tensorboard"), write_graph=False,
                                                      profile_batch=0))
    return cbs


# ---- 5. resume ---------------------------------------------------------------------------------------------

def resume(cfg: Config, rank: int, model: Any, ckpt_dir: Path) -> tuple[int, History]:
    """Rank 0 restores the newest intact checkpoint; every rank gets rank 0's epoch and history."""
    first, history = 0, History()
    # Create the optimizer's variables (momentum, iterations) the same way on every rank, before fit: rank 0 must
    # have them to restore into, and BroadcastGlobalVariablesCallback matches variables across ranks by name
    # (variables created here and ones created lazily inside fit are named differently: the broadcast would hang).
    model.optimizer.build(model.trainable_variables)
    if rank == 0 and cfg.resume:
        found = checkpoint.find_latest(ckpt_dir, read_npz, required_keys=("model", "optimizer", "history"),
                                       warn=lambda msg: print(f"WARNING: {msg}", flush=True))
        if found is not None:
            model.set_weights(found.state["model"])
            model.optimizer.set_weights(found.state["optimizer"])
            first, history = found.epoch, History(list(found.state["history"]))
            print(f"resuming from {found.path} (epoch {found.epoch} done)", flush=True)
    # Horovod: every rank starts at rank 0's epoch and history, and with rank 0's weights and optimizer state.
    # BroadcastGlobalVariablesCallback does the latter only after the first batch, whose averaged gradient would
    # then include other ranks' gradients at their own (fresh) weights: on resume, broadcast before fit as well.
    first = hvd_tf.broadcast_object(first, root_rank=0, name="resume.epoch")
    history = hvd_tf.broadcast_object(history, root_rank=0, name="resume.history")
    if first:
        hvd_tf.broadcast_variables(model.variables + list(model.optimizer.variables), root_rank=0)
    return first, history


# ---- 6. the run ---------------------------------------------------------------------------------------------

def finish(rank: int, model: Any, recorder: Recorder, run_dir: Path, first: int, epochs: int) -> None:
    # Horovod: every rank must end with identical weights; gather each rank's digest and compare.
    digests = hvd_tf.allgather_object(weights_digest(model), name="final.digest")
    if len(set(digests)) != 1:
        raise RuntimeError("weights differ across ranks after training: "
                           + ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests)))
    log(rank, f"weights identical on all {len(digests)} ranks (sha256 {digests[0][:16]})")
    done = int(recorder.history.epochs[-1]["epoch"]) if recorder.history.epochs else first
    if rank != 0:
        return
    if done == first:
        print(f"nothing to train: all {epochs} epochs are done in {run_dir / 'checkpoints'} (--no-resume or "
              f"another --run-dir trains again)\nsummary:    {run_dir / SUMMARY_NAME}", flush=True)
        return
    summary = build_summary(  # Horovod: rank 0 writes the summary.
        epochs_completed=done, epochs_total=epochs, history=recorder.history, stall=None,
        samples_per_sec=recorder.trained_samples / recorder.trained_s if recorder.trained_s else math.nan,
        extra={"world_size": len(digests), "resumed_from_epoch": first, "weights_sha256_by_rank": digests,
               "keras": tfkeras.keras_info(tf).describe()})
    path = write_summary(run_dir, summary)
    val = summary["val_accuracy"]
    print(f"done: {done}/{epochs} epochs, validation accuracy {'n/a' if val is None else format(val, '.2%')}\n"
          f"summary:    {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(Config, argv, description=__doc__.split("\n\n")[0])
    hvd.init()  # Horovod: join the job; rank/size come from horovodrun (or mpirun).
    rank, size = hvd.rank(), hvd.size()
    device = setup_devices(hvd.local_rank(), hvd.local_size(), cfg.threads)
    run_dir = Path(cfg.run_dir).absolute()
    # Horovod: rank 0 alone writes the run directory; it locks it for the job's life, and a broadcast tells every
    # rank whether another job holds it (then all stop here with exit 2, before reading or writing anything).
    run_lock = rundir.claim(run_dir, rank, lambda v: hvd_tf.broadcast_object(v, root_rank=0, name="run_dir.lock"))
    splits = datasets.load(cfg.dataset, val_fraction=cfg.val_fraction, split_seed=0,
                           synthetic_shape=cfg.synthetic_shape, synthetic_samples=cfg.synthetic_samples,
                           num_classes=cfg.num_classes, seed=cfg.seed, check_finite=cfg.check_finite)
    train, val = channels_last(splits.train), channels_last(splits.val)
    tf.keras.utils.set_random_seed(cfg.seed)
    model = build_model(train.x.shape[1:], splits.num_classes, cfg.width)
    lr = compile_model(model, cfg, size)
    epochs = scaled_epochs(cfg.epochs, size, cfg.scale_epochs_by_size)
    first, history = resume(cfg, rank, model, run_dir / "checkpoints")
    steps = expected_batches(len(train), size, cfg.batch_size)
    log(rank, f"{size} ranks on {device}  dataset {splits.name}: {len(train)} train / {len(val)} val  "
              f"{tfkeras.keras_info(tf).describe()}  epochs {first + 1}..{epochs}  batch {cfg.batch_size}×{size} "
              f"ranks  {steps} steps/epoch  peak lr {lr:g}")
    recorder = Recorder(history, math.ceil(len(train) / size) * size, rank, epochs, cfg.stop_after_epoch)
    if first < epochs:
        model.fit(train_dataset(train, cfg, rank, size, first, epochs), steps_per_epoch=steps, epochs=epochs,
                  initial_epoch=first, validation_data=val_dataset(val, rank, size),
                  callbacks=make_callbacks(cfg, rank, lr, steps, run_dir, recorder),
                  verbose=cfg.verbose if rank == 0 else 0)  # Horovod: Keras output on rank 0 only.
    finish(rank, model, recorder, run_dir, first, epochs)
    if run_lock is not None:
        run_lock.release()
    return 0


if __name__ == "__main__":
    exit_with(main, __file__)  # bad data: exit 2, divergence: exit 3, with the message, no traceback
