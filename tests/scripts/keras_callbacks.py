"""Every Horovod Keras callback that Horovod's examples use, in one `fit`, on tf_keras (TF_USE_LEGACY_KERAS=1) or
Keras 3 (TF_USE_LEGACY_KERAS=0).

Usage: keras_callbacks.py OUT_DIR. Each rank starts from its own random weights and fits its own data; the callbacks
are BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateWarmupCallback (2 epochs),
LearningRateScheduleCallback (x1 for epochs 2-3, x0.1 from 4) and the elastic ones (KerasState,
CommitStateCallback, UpdateBatchStateCallback, UpdateEpochStateCallback), with the legacy SGD with momentum so that
the momentum correction runs (Keras 3 has no optimizer whose momentum is a variable: its SGD, as below).
Then one epoch of warmup with Keras 2.11+'s SGD, whose momentum is a Python number:
Horovod 0.28.1 crashed there; the patched one warns that it skips the correction. Writes what each rank saw to
OUT_DIR/result.<rank>.json; the test checks it.
"""

import hashlib
import sys
import warnings

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from rank_results import write_result

out_dir = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
EPOCHS, STEPS, BATCH, LR = 6, 4, 4, 0.05 * size

tf.keras.utils.set_random_seed(100 + rank)  # different initial weights on each rank: the broadcast must fix that
model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(4, activation="tanh"),
                             tf.keras.layers.Dense(1)])
KERAS = type(model).__module__.split(".")[0]
optimizers = tf.keras.optimizers.legacy if KERAS == "tf_keras" else tf.keras.optimizers  # Keras 3 has no legacy ones
opt = hvd.DistributedOptimizer(optimizers.SGD(LR, momentum=0.9))
model.compile(loss="mse", optimizer=opt)
rng = np.random.default_rng(rank)
x = rng.normal(size=(STEPS * BATCH, 3)).astype(np.float32)
y = (x.sum(axis=1, keepdims=True) + rank).astype(np.float32)  # rank-dependent targets: local losses differ


def digest(weights) -> str:
    return hashlib.sha256(b"".join(np.asarray(w, dtype=np.float32).tobytes() for w in weights)).hexdigest()[:16]


initial = digest(model.get_weights())
state = hvd.elastic.KerasState(model, batch=0, epoch=0)
commits = []
original_commit = state.commit
state.commit = lambda: (commits.append(1), original_commit())[1]


class Record(tf.keras.callbacks.Callback):
    """After the Horovod callbacks: what they left in the logs and the optimizer, per epoch and per batch."""

    def __init__(self):
        super().__init__()
        self.epochs, self.batch_lr, self.batch_momentum = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.batch_lr.append(float(np.asarray(self.model.optimizer.learning_rate)))
        self.batch_momentum.append(float(np.asarray(self.model.optimizer.momentum)))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({"epoch": epoch, "loss": float(logs["loss"]), "lr": float(logs["lr"]),
                            "momentum": float(np.asarray(self.model.optimizer.momentum)),
                            "state_epoch": state.epoch, "state_batch": state.batch})


record = Record()
callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=2, steps_per_epoch=STEPS),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=LR, start_epoch=2, end_epoch=4, multiplier=1.0),
    hvd.callbacks.LearningRateScheduleCallback(initial_lr=LR, start_epoch=4, multiplier=lambda epoch: 0.1),
    hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.UpdateEpochStateCallback(state),
    record,
]
model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=callbacks)

# Keras 2.11+'s optimizer (tf_keras's default SGD, the one Horovod's examples build): momentum is a Python float.
new_model = tf.keras.Sequential([tf.keras.Input(shape=(3,)), tf.keras.layers.Dense(1)])
new_model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR, momentum=0.9)))
new_record = Record()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    new_model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                             hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=2,
                                                                      steps_per_epoch=STEPS), new_record])
new_optimizer = {"warnings": [str(w.message) for w in caught if "momentum correction" in str(w.message)],
                 "batch_lr": new_record.batch_lr, "batch_momentum": new_record.batch_momentum}
result = {"rank": rank, "size": size, "lr": LR, "steps": STEPS, "initial": initial,
          "final": digest(model.get_weights()), "epochs": record.epochs, "batch_lr": record.batch_lr,
          "batch_momentum": record.batch_momentum, "commits": len(commits),
          "keras": KERAS, "new_optimizer": new_optimizer}
write_result(out_dir, rank, result)
