"""Under Keras 3 (run with TF_USE_LEGACY_KERAS=0), call each entry point of horovod.tensorflow.keras that takes or
builds a Keras object and print REFUSED or ACCEPTED NAME for each; one process, no collective runs."""

import horovod.tensorflow.keras as hvd
import tensorflow as tf
from horovod.common.keras_version import UnsupportedKerasError

hvd.init()
model = tf.keras.Sequential([tf.keras.Input(shape=(2,)), tf.keras.layers.Dense(1)])
state = object()
entry_points = {
    "BroadcastGlobalVariablesCallback": lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    "MetricAverageCallback": lambda: hvd.callbacks.MetricAverageCallback(),
    "LearningRateWarmupCallback": lambda: hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1),
    "LearningRateScheduleCallback": lambda: hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=1.0),
    "CommitStateCallback": lambda: hvd.elastic.CommitStateCallback(state),
    "UpdateBatchStateCallback": lambda: hvd.elastic.UpdateBatchStateCallback(state),
    "UpdateEpochStateCallback": lambda: hvd.elastic.UpdateEpochStateCallback(state),
    "KerasState": lambda: hvd.elastic.KerasState(model),
    "load_model": lambda: hvd.load_model("never-read.keras"),
    "DistributedOptimizer": lambda: hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)),
}
for name, call in entry_points.items():
    try:
        call()
    except UnsupportedKerasError:
        print(f"REFUSED {name}", flush=True)
    else:
        print(f"ACCEPTED {name}", flush=True)
