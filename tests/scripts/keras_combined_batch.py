"""Horovod's Keras integration, used directly, against one process training on the combined batch.

Usage: keras_combined_batch.py OUT_DIR. Under horovodrun -np 2: every rank starts from the same weights and trains
an MLP for 3 epochs on its own half of each batch (rank 0 the first half, rank 1 the second); in the same process
it also trains a copy with the plain Keras optimizer on the whole batch (the reference: what averaged gradients
must give). First Horovod's plain pattern (w = 0.3 on both ranks after one step), then one run per way of getting
gradients to the optimizer:
- fit: `model.fit` with hvd.DistributedOptimizer;
- tape: Horovod's TF2 custom loop (hvd.DistributedGradientTape, optimizer.apply_gradients);
- apply (Keras 3): a custom loop handing tape gradients to DistributedOptimizer.apply();
- accumulate (Keras 3): backward_passes_per_step=2, average_aggregated_gradients=True, against Keras's own
  gradient_accumulation_steps=2 on the whole batch;
- clipnorm (Keras 3): SGD(clipnorm=...) clips the averaged gradient, as on the whole batch;
- groups (Keras 3): the gradients reduced in 2 groups;
- mixed (Keras 3): a mixed_float16 policy, so model.compile wraps the DistributedOptimizer in a
  LossScaleOptimizer; rank 1's half of every second step overflows float16 (the step must be skipped on both ranks).
Whether tf.keras is Keras 3 or tf_keras is the caller's TF_USE_LEGACY_KERAS. Writes OUT_DIR/result.<rank>.json:
per run, the largest difference from the reference, a digest of the weights and (mixed) the loss scale; and
(auto_xla) what jit_compile="auto" resolved to with and without a Horovod optimizer where a GPU is seen.
"""

import hashlib
import sys

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from rank_results import write_result

out_dir = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
keras = tf.keras
KERAS = keras.Model.__module__.split(".")[0]
EPOCHS, STEPS, HALF, LR = 3, 4, 8, 0.1
rng = np.random.default_rng(7)
X = rng.normal(size=(STEPS * HALF * size, 3)).astype(np.float32)
Y = (np.sin(X).sum(axis=1, keepdims=True) + 0.1 * X[:, :1] ** 2).astype(np.float32)


def batches(x, y, per_rank):
    """Step i's batch: the whole (per_rank=False) or this rank's half."""
    for i in range(STEPS):
        xs, ys = x[i * HALF * size:(i + 1) * HALF * size], y[i * HALF * size:(i + 1) * HALF * size]
        if per_rank:
            xs, ys = xs[rank * HALF:(rank + 1) * HALF], ys[rank * HALF:(rank + 1) * HALF]
        yield xs, ys


def make_model():
    keras.utils.set_random_seed(1)  # the same weights on every rank and for the reference
    return keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1, dtype="float32")])


def digest(model):
    data = b"".join(np.asarray(w, dtype=np.float32).tobytes() for w in model.get_weights())
    return hashlib.sha256(data).hexdigest()[:16]


def fit(model, optimizer, per_rank, x=X):
    model.compile(loss="mse", optimizer=optimizer)
    for _ in range(EPOCHS):
        for xs, ys in batches(x, Y, per_rank):
            model.train_on_batch(xs, ys)


def custom_loop(model, optimizer, per_rank, distributed_tape):
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(xs, ys):
        with tf.GradientTape() as tape:
            loss = loss_fn(ys, model(xs, training=True))
        if distributed_tape:
            tape = hvd_tf.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        if distributed_tape or KERAS == "tf_keras":
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        else:
            optimizer.apply(grads, model.trainable_variables)
        return loss

    for _ in range(EPOCHS):
        for xs, ys in batches(X, Y, per_rank):
            step(xs, ys)


def compare(train, make_optimizer, wrap, make_reference_optimizer=None):
    """Train the reference on whole batches, then this rank on its half (the optimizer wrapped with `wrap` unless it
    is None: the tape run wraps the tape instead); the largest difference, a digest, how far the weights moved."""
    reference, model = make_model(), make_model()
    train(reference, (make_reference_optimizer or make_optimizer)(), False)
    optimizer = make_optimizer()
    if wrap is not None:
        optimizer = hvd.DistributedOptimizer(optimizer, **wrap)
    train(model, optimizer, True)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), reference.get_weights(), strict=True))
    return {"diff": diff, "digest": digest(model), "iterations": int(optimizer.iterations.numpy()),
            "moved": float(np.max(np.abs(model.get_weights()[0] - make_model().get_weights()[0])))}


def plain_pattern():
    """Horovod's plain Keras pattern, one step: rank r fits y = r + 1 from w = 0 with SGD(0.1); the averaged gradient
    gives w = 0.3 on both ranks (each rank's own would give 0.2 and 0.4)."""
    model = keras.Sequential([keras.Input(shape=(1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    model.fit(np.ones((4, 1), np.float32), np.full((4, 1), rank + 1.0, np.float32), batch_size=4, epochs=1,
              verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return {"w": float(model.get_weights()[0][0, 0])}


runs = {
    "plain": plain_pattern(),
    "fit": compare(fit, lambda: keras.optimizers.SGD(LR), {}),
    "tape": compare(lambda m, o, p: custom_loop(m, o, p, distributed_tape=p), lambda: keras.optimizers.SGD(LR), None),
}
if KERAS == "keras":
    runs["apply"] = compare(lambda m, o, p: custom_loop(m, o, p, distributed_tape=False),
                            lambda: keras.optimizers.SGD(LR), {})
    runs["accumulate"] = compare(fit, lambda: keras.optimizers.SGD(LR),
                                 {"backward_passes_per_step": 2, "average_aggregated_gradients": True},
                                 lambda: keras.optimizers.SGD(LR, gradient_accumulation_steps=2))
    runs["clipnorm"] = compare(fit, lambda: keras.optimizers.SGD(LR, clipnorm=0.05), {})
    runs["groups"] = compare(fit, lambda: keras.optimizers.SGD(LR), {"groups": 2})
    # jit_compile="auto" (Keras 3's default) turns XLA on where TensorFlow sees a GPU; Horovod's ops have no XLA
    # kernels, so a model with a Horovod optimizer must resolve it to False. A GPU is faked (this test has none).
    from unittest import mock

    fake_gpu = [tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")]
    with mock.patch.object(tf.config, "list_physical_devices", lambda *args: fake_gpu):
        plain, wrapped = make_model(), make_model()
        plain.compile(loss="mse", optimizer=keras.optimizers.SGD(LR))
        wrapped.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)))
        runs["auto_xla"] = {"plain": bool(plain.jit_compile), "horovod": bool(wrapped.jit_compile)}

    keras.mixed_precision.set_global_policy("mixed_float16")
    model = make_model()
    x = X.copy()
    if rank == 1:
        x[HALF * size + HALF: 2 * HALF * size] = 1e5  # rank 1's half of step 2: beyond float16 (inf, then nan)
    fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), True, x=x)
    keras.mixed_precision.set_global_policy("float32")
    runs["mixed"] = {"digest": digest(model), "optimizer": type(model.optimizer).__name__,
                     "inner": type(model.optimizer.inner_optimizer).__name__,
                     "scale": float(model.optimizer.dynamic_scale.numpy()),
                     "initial_scale": float(model.optimizer.initial_scale),
                     "iterations": int(model.optimizer.iterations.numpy()),
                     "finite": bool(all(np.isfinite(w).all() for w in model.get_weights()))}
write_result(out_dir, rank, {"rank": rank, "keras": KERAS, "runs": runs})
