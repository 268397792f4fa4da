"""The plain Horovod Keras pattern, as Horovod's own examples write it: no hvdtrain code on the way.

Usage: keras_plain.py OUT_DIR [keras3-optimizer]. One step of SGD(0.1) on a 1-weight linear model whose targets
depend on the rank (rank r fits y = r + 1), so averaged gradients give w = 0.3 on both ranks where each rank's own
gradient would give 0.2 and 0.4. Writes OUT_DIR/result.<rank>.json. Whether tf.keras is Keras 2 (tf_keras) or
Keras 3 is the caller's TF_USE_LEGACY_KERAS; `keras3-optimizer` hands DistributedOptimizer an optimizer made
from `import keras` (Keras 3) whatever tf.keras is. Under Keras 3 the patched Horovod must refuse.
"""

import os
import sys

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from rank_results import write_result

out_dir = sys.argv[1]
hvd.init()
rank = hvd.rank()

if sys.argv[2:] == ["keras3-optimizer"]:
    import keras

    base = keras.optimizers.SGD(0.1)
else:
    base = tf.keras.optimizers.SGD(0.1)
model = tf.keras.Sequential([tf.keras.Input(shape=(1,)),
                             tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
try:
    optimizer = hvd.DistributedOptimizer(base)
except Exception as exc:  # the refusal: recorded by every rank before any of them exits (horovodrun stops the
    with open(os.path.join(out_dir, f"refused.{rank}.txt"), "w") as f:  # others when one fails)
        f.write(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
    if hvd.size() > 1:
        hvd.allgather_object(rank)
    raise
model.compile(loss="mse", optimizer=optimizer)
x = np.ones((4, 1), dtype=np.float32)
y = np.full((4, 1), rank + 1.0, dtype=np.float32)
model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
result = {"rank": rank, "keras": type(model).__module__.split(".")[0], "w": float(model.get_weights()[0][0, 0])}
write_result(out_dir, rank, result)
