"""The plain Horovod Keras pattern, as Horovod's keras examples write it (horovod.keras, `import keras`: Keras 3
whatever TF_USE_LEGACY_KERAS says): no hvdtrain code on the way. tf.keras's plain pattern runs in
keras_combined_batch.py.

Usage: keras_plain.py OUT_DIR. One step of SGD(0.1) on a 1-weight linear model whose targets depend on the rank
(rank r fits y = r + 1), so averaged gradients give w = 0.3 on both ranks where each rank's own gradient would give
0.2 and 0.4. Writes OUT_DIR/result.<rank>.json.
"""

import sys

import horovod.keras as hvd
import keras
import numpy as np
from rank_results import write_result

out_dir = sys.argv[1]
hvd.init()
rank = hvd.rank()

model = keras.Sequential([keras.Input(shape=(1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
x = np.ones((4, 1), dtype=np.float32)
y = np.full((4, 1), rank + 1.0, dtype=np.float32)
model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
result = {"rank": rank, "keras": type(model).__module__.split(".")[0], "w": float(model.get_weights()[0][0, 0])}
write_result(out_dir, rank, result)
