"""One training step of the Keras recipe's model and optimizer under --precision bf16 or fp16, on DIFFERENT data
per rank, next to what it must equal. Usage: keras_precision_step.py OUT_DIR PRECISION.

Every rank builds the recipe's model (hvdtrain.train.keraskit.build_model under keraskit.set_precision) from the same
seed and steps it three ways from the same weights w0, with SGD(LR) (no momentum: one step is w0 - LR * gradient):
  - "horovod": the recipe's optimizer, keraskit.loss_scaled(hvd.DistributedOptimizer(SGD)), on this rank's batch;
  - "reference": no Horovod, one process's step on the union of both ranks' batches (equal sizes: its gradient is
    the average of the two ranks' gradients), the same policy and loss scaling;
  - "alone": no Horovod, this rank's batch only (the control: what a rank does when nothing averages).
fp16 then takes a second step of the "horovod" and "alone" models where rank 1's batch overflows float16 (inputs
1e6) and rank 0's does not: with the averaged gradients both ranks must skip it and halve the loss scale alike.
Writes OUT_DIR/result.<rank>.json (weights flattened); the test does the arithmetic.
"""

import sys

import horovod.tensorflow.keras as hvd
import numpy as np
from rank_results import write_result

from hvdtrain.train import keraskit  # imports TensorFlow: Keras 3, or tf_keras under the caller's TF_USE_LEGACY_KERAS=1

tf = keraskit.tf
LR = 0.5
SHAPE, CLASSES, WIDTH, BATCH = (8, 8, 1), 4, 4, 16

out_dir, precision = sys.argv[1], sys.argv[2]
hvd.init()
rank = hvd.rank()
keraskit.set_precision(precision)


def batch(r: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(100 + r)  # rank r's data: different on every rank
    return (gen.normal(size=(BATCH, *SHAPE)) * scale).astype(np.float32), gen.integers(0, CLASSES, BATCH)


def model_with(optimizer, weights=None):
    tf.keras.utils.set_random_seed(7)  # the same initial weights on every rank and for every variant
    model = keraskit.build_model(SHAPE, CLASSES, WIDTH)
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    return model


def flat(model) -> list[float]:
    return np.concatenate([w.ravel() for w in model.get_weights()]).astype(np.float64).tolist()


def scale_of(model) -> float | None:
    found = keraskit.loss_scale_variables(model.optimizer)
    return float(found[0].numpy()) if found else None


x, y = batch(rank)
both = [batch(r) for r in (0, 1)]
horovod = model_with(keraskit.loss_scaled(hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR)), precision))
w0 = horovod.get_weights()
reference = model_with(keraskit.loss_scaled(tf.keras.optimizers.SGD(LR), precision), w0)
alone = model_with(keraskit.loss_scaled(tf.keras.optimizers.SGD(LR), precision), w0)
result = {"rank": rank, "precision": precision, "lr": LR, "w0": flat(horovod),
          "compute_dtype": horovod.layers[0].compute_dtype, "output_dtype": horovod.layers[-1].compute_dtype,
          "variable_dtypes": sorted({getattr(v.dtype, "name", v.dtype) for v in horovod.variables}),  # Keras 3: str
          "optimizer": type(horovod.optimizer).__name__, "scale_before": scale_of(horovod)}
horovod.train_on_batch(x, y)
reference.train_on_batch(np.concatenate([b[0] for b in both]), np.concatenate([b[1] for b in both]))
alone.train_on_batch(x, y)
result |= {"horovod": flat(horovod), "reference": flat(reference), "alone": flat(alone),
           "scale_after": scale_of(horovod)}
if precision == "fp16":  # rank 1 overflows: every rank must skip the step and halve the scale
    x_over, _ = batch(rank, scale=1e6 if rank == 1 else 1.0)
    horovod.train_on_batch(x_over, y)
    alone.train_on_batch(x_over, y)
    result |= {"horovod_overflow": flat(horovod), "alone_overflow": flat(alone),
               "scale_after_overflow": scale_of(horovod), "alone_scale_after_overflow": scale_of(alone)}
write_result(out_dir, rank, result)
