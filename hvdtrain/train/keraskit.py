"""What the Keras recipe (recipes/keras_train.py) needs that is not a Horovod step: hvdtrain's per-process set-up,
its input (training batches from an ShmLoader's producer processes through `tf.data`, validation batches read here,
both N×H×W×C), the model, checkpoints in .npz, its callbacks (atomic checkpoints, the per-epoch record, the NaN/Inf
stop), and bad data met inside `tf.data` re-raised as itself (exit 2 with its message).

Importing this module imports TensorFlow and checks that tf.keras is Keras 3 on TensorFlow or Keras 2 (tf_keras,
under TF_USE_LEGACY_KERAS=1) (hvdtrain.tfkeras: KerasVersionError otherwise); it sets nothing. Both run the same
code; where the two Kerases differ (the loss scale's variables, building the metrics before the first step) the
helpers below say so (`KERAS3`). The loader's `fetch`
(`take_channels_last`) lives in hvdtrain/train/channels_last.py, which does not import TensorFlow: the producer
processes import only that.

Mixed precision (`--precision`): bf16 and fp16 set the global Keras dtype policy (mixed_bfloat16, mixed_float16)
before the model is built: layers compute in 16 bits, their variables (what is checkpointed, broadcast and
averaged) stay float32, and the last layer computes in float32, so the loss is an fp32 loss. fp16 adds dynamic loss
scaling, NOTE [Keras loss scaling with Horovod].

NOTE [Keras loss scaling with Horovod]
fp16 gradients can overflow or vanish, so a LossScaleOptimizer multiplies the loss by a scale before the gradients
and divides them back after, and with a dynamic scale skips every step whose gradients are not finite (halving the
scale; doubling it after 2000 finite steps in a row). It wraps Horovod's DistributedOptimizer, never the other way
round (and Keras 3's compile() wraps it so itself under mixed_float16):
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(...))
    opt = tf.keras.mixed_precision.LossScaleOptimizer(opt)
Every rank must skip the same steps and keep the same scale, or the weights part:
- tf_keras: in fit, LossScaleOptimizer.compute_gradients scales the loss and asks the inner optimizer for the
  gradients; that is Horovod's compute_gradients, which allreduces them (the *scaled* gradients, the same scale on
  every rank); the averages are unscaled, and apply_gradients decides from them whether to step. An overflow on any
  rank makes the average inf/NaN on every rank, so every rank skips the same step. Wrapped the other way
  (hvd.DistributedOptimizer(LossScaleOptimizer(...))) Horovod rebuilds the optimizer from its class and config,
  which a LossScaleOptimizer does not survive (horovod/horovod #2989, #3807).
- Keras 3: LossScaleOptimizer.apply unscales each rank's own gradients and checks them before the inner apply (where
  Horovod's DistributedOptimizer averages): the Horovod that scripts/setup.sh builds makes that check an all-rank
  decision (an allreduce of "finite" before the step; horovod/_keras/keras3.py), so an overflow on one rank skips
  the step on every rank (tests/recipes/test_keras_precision.py: rank 1 overflows, both ranks skip).
The scale and its count of finite steps are checkpointed as their own part (a checkpoint resumes across
--precision) and broadcast from rank 0 with the rest on resume (`loss_scale_variables`; tf_keras keeps them outside
`optimizer.variables`, Keras 3 among them: `optimizer_variables`).
TensorFlow's CPU kernels compute float16 (without AVX-512, slower than float32): fp16 runs on CPU, for testing;
bf16 is the CPU's 16-bit format.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np

from hvdtrain import tfkeras
from hvdtrain.data import ShardSampler, ShmLoader, WorkerError, sweep_stale_segments, to_tf_dataset
from hvdtrain.data.errors import DataError
from hvdtrain.train import checkpoint, divergence
from hvdtrain.train.channels_last import channels_last_shape, take_channels_last
from hvdtrain.train.metrics import History
from hvdtrain.train.report import log, lr_text

tf = tfkeras.import_tensorflow()
KERAS = tfkeras.keras_info(tf)
KERAS3 = KERAS.major >= 3  # else tf_keras (Keras 2)
T = TypeVar("T")


# TensorFlow is untyped here (`tf` is Any): mypy cannot resolve `tf.keras.callbacks.Callback` as a base class.
Callback: Any = tf.keras.callbacks.Callback

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}  # --precision: Keras's policy


def setup_process(threads: int | None, local_size: int) -> str:
    """hvdtrain's own per-process set-up (call once, after the recipe pinned its GPU, before TensorFlow starts its
    runtime): sweep the /dev/shm segments a crashed earlier run left (dead creator pid, older than 60 s); on CPU,
    split this host's cores between its `local_size` ranks (`threads` each if given), or they oversubscribe each
    other. Returns where this rank trains, for the log."""
    sweep_stale_segments()
    gpus = tf.config.get_visible_devices("GPU")
    if gpus:
        return f"GPU {gpus[0].name.rsplit(':', 1)[-1]}"  # /physical_device:GPU:<index>
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = threads or max(1, cores // local_size)
    tf.config.threading.set_intra_op_parallelism_threads(n)
    tf.config.threading.set_inter_op_parallelism_threads(max(1, min(2, n)))
    return f"CPU ({n} threads)"


def set_precision(precision: str) -> None:
    """The global dtype policy for --precision (fp32, bf16, fp16); set it before the model is built."""
    if precision not in POLICIES:
        raise ValueError(f"precision must be one of {', '.join(POLICIES)}; got {precision!r}")
    tf.keras.mixed_precision.set_global_policy(POLICIES[precision])


def loss_scaled(optimizer: Any, precision: str) -> Any:
    """fp16: `optimizer` (Horovod's DistributedOptimizer) in a dynamic LossScaleOptimizer, the order of
    NOTE [Keras loss scaling with Horovod]; fp32, bf16: `optimizer` itself."""
    return tf.keras.mixed_precision.LossScaleOptimizer(optimizer) if precision == "fp16" else optimizer


def loss_scale_variables(optimizer: Any) -> list[Any]:
    """A dynamic LossScaleOptimizer's scale and its count of finite steps, once built (tf_keras: not among
    `optimizer.variables`; Keras 3, whose loss scale is always dynamic: among them); [] for any other optimizer."""
    if not isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer):
        return []
    if KERAS3:
        return [optimizer.dynamic_scale, optimizer.step_counter] if optimizer.built else []
    return [optimizer._loss_scale.current_loss_scale, optimizer.dynamic_counter] if optimizer.dynamic else []


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The optimizer's state but a LossScaleOptimizer's own, on both Kerases: the inner optimizer's variables. What a
    checkpoint holds as "optimizer", so that it resumes across --precision (the loss scale is its own part). tf_keras
    lists only these for a LossScaleOptimizer too; Keras 3 lists its own first: the scale and its count, and an
    iteration count and learning rate it never updates (its `iterations` and `learning_rate` are the inner's)."""
    return list(getattr(optimizer, "inner_optimizer", optimizer).variables)


def optimizer_state(optimizer: Any) -> list[Any]:
    """What rank 0 broadcasts of the optimizer on resume: what a checkpoint holds of it, the inner optimizer's
    variables (`optimizer_variables`) and the loss scale's (`loss_scale_variables`), on both Kerases."""
    return optimizer_variables(optimizer) + loss_scale_variables(optimizer)


def build_model(sample_shape: tuple[int, ...], num_classes: int, width: int) -> Any:
    """The model under the global dtype policy (`set_precision`); its last layer computes in float32 whatever the
    policy, so the loss (from these logits) is computed in float32."""
    layers = tf.keras.layers
    if len(sample_shape) == 3:  # images, H×W×C
        body = [layers.Conv2D(width, 3, padding="same", activation="relu"),
                layers.Conv2D(2 * width, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
                layers.Flatten()]
    else:
        body = [layers.Flatten(), layers.Dense(4 * width, activation="relu")]
    return tf.keras.Sequential([tf.keras.Input(sample_shape), *body,
                                layers.Dense(4 * width, activation="relu"),
                                layers.Dense(num_classes, dtype="float32")])


def model_info(model: Any, width: int) -> dict[str, Any]:
    """The model for summary.json's config, as build_model made it: cnn (images) or mlp, --width, parameters."""
    name = "cnn" if len(model.input_shape) == 4 else "mlp"  # N×H×W×C images
    return {"name": name, "class": type(model).__name__, "width": width, "parameters": int(model.count_params())}


def weights_digest(model: Any) -> str:
    """SHA-256 over the model's weights in order (shape, then raw bytes)."""
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(str(w.shape).encode())
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


_PARTS = ("model", "optimizer", "loss_scale")  # lists of arrays; the rest of a checkpoint is JSON


def write_npz(state: Mapping[str, Any], f: BinaryIO) -> None:
    arrays = {f"model/{i:04d}": w for i, w in enumerate(state["model"])}
    arrays |= {f"optimizer/{i:04d}": w for i, w in enumerate(state["optimizer"])}
    arrays |= {f"loss_scale/{i:04d}": w for i, w in enumerate(state.get("loss_scale", []))}
    meta = {k: v for k, v in state.items() if k not in _PARTS}
    buf = io.BytesIO()
    np.savez(buf, meta=np.array(json.dumps(meta)), **arrays)
    f.write(buf.getvalue())


def read_npz(f: Any) -> dict[str, Any]:
    with np.load(f, allow_pickle=False) as z:
        state = json.loads(str(z["meta"]))
        for part in _PARTS:  # a checkpoint from before --precision has no loss_scale part: []
            state[part] = [z[k] for k in sorted(n for n in z.files if n.startswith(part + "/"))]
    return state


def load_latest(ckpt_dir: Path, model: Any) -> tuple[int, list[dict[str, Any]], dict[str, Any] | None]:
    """Load the newest intact checkpoint into `model` and its optimizer (built: `model.optimizer.build`), and fp16's
    loss scale if the checkpoint has one; (epochs it completed, history, the position inside the next epoch of a
    checkpoint written mid-epoch, else None), (0, [], None) if none."""
    found = checkpoint.find_latest(ckpt_dir, read_npz, required_keys=("model", "optimizer", "history"),
                                   warn=lambda msg: print(f"WARNING: {msg}", flush=True))
    if found is None:
        return 0, [], None
    written = found.state.get("keras", "tf_keras 2")  # checkpoints from before Keras 3 were tf_keras's
    if tfkeras.major_version(written.split()[-1]) != KERAS.major:
        raise checkpoint.CheckpointMismatch(
            f"{found.path} was written under {written}, this run is on {KERAS.package} {KERAS.version}: their "
            f"optimizer states differ; resume under the Keras that wrote it ({tfkeras.LEGACY_ENV}=1 selects tf_keras, "
            "unset it for Keras 3), or train in a new --run-dir, or pass --no-resume")
    try:
        model.set_weights(found.state["model"])
        assign_all(optimizer_variables(model.optimizer), found.state["optimizer"], "optimizer")
    except ValueError as e:
        what = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise checkpoint.CheckpointMismatch(
            f"{found.path} does not fit this model or optimizer ({what}): it was written with another model or "
            "input shape (the dataset), or by an earlier version of the recipe; train in a new --run-dir, or pass "
            "--no-resume to start from scratch") from None
    scale = loss_scale_variables(model.optimizer)
    if scale and len(found.state["loss_scale"]) == len(scale):  # else (fp32/bf16 before): the initial scale
        for variable, value in zip(scale, found.state["loss_scale"], strict=True):
            variable.assign(value)
    position = found.state.get("position") if found.step else None
    print(f"resuming from {found.path} (epoch {found.epoch} done"
          f"{f', then {found.step} steps of epoch {found.epoch + 1}' if position else ''})", flush=True)
    return found.epoch, list(found.state["history"]), position


def assign_all(variables: list[Any], values: list[Any], what: str) -> None:
    """Each variable its value, in order; ValueError (before any is assigned) if the counts or a shape differ."""
    if len(values) != len(variables):
        raise ValueError(f"the {what} has {len(variables)} variables, the checkpoint {len(values)}")
    for i, (variable, value) in enumerate(zip(variables, values, strict=True)):
        if tuple(variable.shape) != tuple(np.shape(value)):
            raise ValueError(f"{what} variable {i} has shape {tuple(variable.shape)}, the checkpoint's "
                             f"{tuple(np.shape(value))}")
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def checkpoint_state(model: Any, history: History) -> dict[str, Any]:
    """What a checkpoint holds: weights, optimizer state, fp16's loss scale, history, and which Keras wrote it."""
    return {"model": model.get_weights(), "history": history.epochs, "keras": f"{KERAS.package} {KERAS.version}",
            "optimizer": [np.asarray(v.numpy()) for v in optimizer_variables(model.optimizer)],
            "loss_scale": [np.asarray(v.numpy()) for v in loss_scale_variables(model.optimizer)]}


def save_checkpoint(directory: Path, keep: int, model: Any, history: History, epochs_done: int,
                    position: dict[str, Any] | None = None) -> Path:
    """Rank 0's checkpoint after `epochs_done` epochs, or, with `position` (a stop mid-epoch), after
    position["step"] steps of the next one."""
    state = checkpoint_state(model, history) | ({"position": position} if position is not None else {})
    return checkpoint.save(directory, epochs_done, state, write_npz, keep=keep,
                           step=position["step"] if position is not None else 0)


class Checkpoint(Callback):
    """Rank 0's ModelCheckpoint: weights + optimizer state (+ fp16's loss scale) + history after each epoch, written
    atomically (temp file + rename, SHA-256 verified on load, the newest `keep` kept) with hvdtrain.train.checkpoint.
    Keras's own ModelCheckpoint writes in place, so a crash mid-write would leave a torn file to resume from."""

    def __init__(self, directory: Path, keep: int, history: History) -> None:
        super().__init__()
        self.directory, self.keep, self.history = directory, keep, history

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        save_checkpoint(self.directory, self.keep, self.model, self.history, epoch + 1)


class Recorder(Callback):
    """Times each epoch's training part and records the (rank-averaged) metrics in `history` on every rank, with the
    LR of the epoch's first step (`lr_first`, read after the LR callbacks before it in the list have set it) and of
    its last (`lr`). `resumed(share, lr_first)` before a fit of the rest of a stopped epoch: its share of the epoch's
    samples, and its first step's LR (that fit starts later in the epoch)."""

    def __init__(self, history: History, samples_per_epoch: int, rank: int, epochs: int,
                 stop_after: int | None) -> None:
        super().__init__()
        self.history, self.samples, self.rank, self.epochs, self.stop_after = (
            history, samples_per_epoch, rank, epochs, stop_after)
        self.start = self.train_end = self.lr_first = 0.0
        self.trained_s = self.trained_samples = 0.0
        self.share = 1.0  # of the next epoch's samples: the part this fit trains
        self.resumed_lr: float | None = None  # the next epoch's first step's LR, when this fit starts after it

    def resumed(self, share: float, lr_first: float) -> None:
        self.share, self.resumed_lr = share, float(np.float32(lr_first))  # as the optimizer holds an LR: float32

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.start, self.train_end = time.perf_counter(), 0.0

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if batch == 0:
            self.lr_first = self._lr() if self.resumed_lr is None else self.resumed_lr

    def _lr(self) -> float:
        return float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self.train_end = self.train_end or time.perf_counter()  # validation starts: the training part ended

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = logs or {}
        took = (self.train_end or time.perf_counter()) - self.start
        samples, self.share, self.resumed_lr = self.samples * self.share, 1.0, None
        self.trained_s, self.trained_samples = self.trained_s + took, self.trained_samples + samples
        row = self.history.record(epoch + 1, train_loss=logs["loss"], train_accuracy=logs["accuracy"],
                                  val_loss=logs.get("val_loss", math.nan),
                                  val_accuracy=logs.get("val_accuracy", math.nan), lr_first=self.lr_first,
                                  lr=self._lr(), samples_per_sec=samples / took)
        log(self.rank, f"epoch {epoch + 1}/{self.epochs}  train loss {row['train_loss']:.4f} acc "
                       f"{row['train_accuracy']:.2%}  val loss {row['val_loss']:.4f} acc {row['val_accuracy']:.2%}"
                       f"  {lr_text(row['lr_first'], row['lr'])}  {row['samples_per_sec']:.0f} samples/s")
        if self.stop_after is not None and self.stop_after <= epoch + 1 < self.epochs:
            log(self.rank, f"stopping after epoch {epoch + 1} as asked (--stop-after-epoch); run again to resume")
            self.model.stop_training = True


class StopOnNonFinite(Callback):
    """Stops every rank at the same step when the weights hold NaN/Inf after an update, and after an epoch whose
    (rank-averaged) loss is NaN/Inf, before it is checkpointed. The weights are the same on every rank (broadcast
    after the first step, then the same averaged gradients everywhere): NOTE [divergence checks] in
    hvdtrain/train/divergence.py. Keras's TerminateOnNaN reads each rank's own loss: one rank would stop while the
    others wait for it in their next allreduce. `first_step`: steps of the first epoch done before this fit (the
    rest of a stopped epoch), for the step it names."""

    def __init__(self, steps: int, first_step: int = 0) -> None:
        super().__init__()
        self.steps, self.first_step, self.epoch = steps, first_step, 0
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
            raise divergence.at_step(self.epoch, self.first_step + batch, self.steps,
                                     "the weights hold NaN/Inf after the update",
                                     float((logs or {}).get("loss", math.nan)),
                                     loss_label="this rank's mean loss so far in the epoch")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.first_step = 0
        divergence.check_epoch(epoch, {k: float(v) for k, v in (logs or {}).items() if k in ("loss", "val_loss")})


# ---- input ---------------------------------------------------------------------------------------------------


def batch_signature(sample_shape: tuple[int, ...]) -> tuple[Any, Any]:
    """The (x, y) batches' TensorSpecs: float32 N×`sample_shape`, int64 labels."""
    return tf.TensorSpec((None, *sample_shape), tf.float32), tf.TensorSpec((None,), tf.int64)


class LoaderEpochs:
    """The loader's epochs `first`..`epochs`-1 back to back, `loader.set_epoch(epoch)` before each one's first
    batch: the one pass `to_tf_dataset` makes over its source (see `train_input`). `starts[epoch]`: the loader's
    state as that epoch started (a resumed one: at its position); `finished`: set when the pass has ended, however
    (NOTE [Keras stops mid-epoch] in hvdtrain/train/kerasstop.py)."""

    def __init__(self, loader: ShmLoader, first: int, epochs: int) -> None:
        self.loader, self.first, self.epochs = loader, first, epochs
        self.starts: dict[int, dict[str, Any]] = {}
        self.finished = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        try:
            for epoch in range(self.first, self.epochs):
                self.loader.set_epoch(epoch)  # a new shuffle each epoch, the same permutation on every rank
                self.starts[epoch] = self.loader.state_dict()
                yield from _watched(self.loader)
        finally:
            self.finished.set()


def train_input(epochs: LoaderEpochs, sample_shape: tuple[int, ...]) -> Any:
    """The loader's `epochs` (its batches N×`sample_shape`) as one tf.data dataset for `model.fit(...,
    steps_per_epoch=len(loader), initial_epoch=epochs.first, epochs=epochs.epochs)` (the rest of a stopped epoch:
    its own fit, `steps_per_epoch` = the batches left).

    One dataset spans the epochs, not one `iter(loader)` per Keras epoch: given steps_per_epoch, both Kerases keep a
    single iterator over a dataset of unknown length for the whole of `fit` (tf_keras re-creates one per epoch only
    when the dataset's cardinality equals steps_per_epoch, and then before `on_epoch_begin`, so a `set_epoch` there
    could come after tf.data has asked for the epoch's first batch; Keras 3's EpochIterator re-creates it only when
    it knows the dataset's length and has read it all). Every loader epoch has exactly `len(loader)` batches
    on every rank (the sampler pads), so Keras epoch e consumes loader epoch e, whole and only it; the producers
    start on epoch e+1 (`set_epoch` here, and an MDS split's fetch ahead) while Keras finishes or validates epoch e.
    """
    data = to_tf_dataset(epochs, batch_signature(sample_shape))
    return data.prefetch(2)  # the producers prefetch too; this overlaps the copy out of shared memory with the step


def val_input(ds: Any, rank: int, size: int, batch_size: int = 256) -> Any:
    """This rank's share of the validation split (`ShardSampler(shuffle=False)`: padded to equal
    shares, up to size-1 repeats), read here with `ds.take` one batch at a time as N×H×W×C: bounded memory, any
    split that has `take` and `sample_shape` (in memory, memory-mapped, streamed)."""
    idx = ShardSampler(len(ds), rank, size, shuffle=False).indices()

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, len(idx), batch_size):
            x, y = take_channels_last(ds, idx[start:start + batch_size])
            yield np.ascontiguousarray(x), y

    signature = batch_signature(channels_last_shape(ds.sample_shape))
    data = tf.data.Dataset.from_generator(lambda: _watched(batches()), output_signature=signature)
    # Its length, told: Keras 3 warns "Your input ran out of data" at the end of a dataset of unknown length.
    return data.apply(tf.data.experimental.assert_cardinality(math.ceil(len(idx) / batch_size))).prefetch(1)


# ---- bad data met inside tf.data -------------------------------------------------------------------------------

_DATA_ERRORS: list[Exception] = []


def _watched(batches: Iterable[T]) -> Iterator[T]:
    """`batches`, remembering the bad data met in them: a producer's WorkerError(bad_data=True) (a streamed shard
    unreadable, a label out of range, NaN/Inf) or a StreamError raised here. tf.data re-raises a generator's
    exception as its own error type, so the recipe could not tell bad data from a bug (`data_errors_reraised`)."""
    try:
        yield from batches
    except WorkerError as e:
        if e.bad_data:
            _DATA_ERRORS.append(e)
        raise
    except DataError as e:
        _DATA_ERRORS.append(e)
        raise


@contextlib.contextmanager
def data_errors_reraised() -> Iterator[None]:
    """Around `model.fit`: a TensorFlow error caused by bad data is re-raised as the WorkerError or StreamError
    itself (exit 2 with its message, through `hvdtrain.train.entry.exit_with`)."""
    _DATA_ERRORS.clear()
    try:
        yield
    except tf.errors.OpError:
        if _DATA_ERRORS:
            raise _DATA_ERRORS[0] from None
        raise
