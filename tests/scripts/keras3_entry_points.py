"""Under Keras 3 on a backend other than TensorFlow (run with KERAS_BACKEND=torch), call each entry point of
horovod.keras that takes or builds a Keras object and print REFUSED or ACCEPTED NAME for each; one process, no
collective runs. Horovod's Keras integration is TensorFlow code: on another backend it must refuse, naming it."""

import horovod.keras as hvd
import horovod.tensorflow as hvd_tf
import keras
from horovod.common.keras_version import UnsupportedKerasError

hvd.init()
model = keras.Sequential([keras.Input(shape=(2,)), keras.layers.Dense(1)])
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
    "SyncBatchNormalization": lambda: hvd_tf.SyncBatchNormalization(),
    "load_model": lambda: hvd.load_model("never-read.keras"),
    "DistributedOptimizer": lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
}
for name, call in entry_points.items():
    try:
        call()
    except UnsupportedKerasError as exc:
        print(f"REFUSED {name}: {exc}", flush=True)
    else:
        print(f"ACCEPTED {name}", flush=True)
