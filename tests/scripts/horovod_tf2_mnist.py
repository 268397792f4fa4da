# ruff: noqa: I001, B905, UP031  (Horovod's example as written: its imports, zip and % formats)
"""Horovod v0.28.1's examples/tensorflow2/tensorflow2_mnist.py: every Horovod line and the training step as written
there; only the data (a local random "digits" set instead of MNIST's download), the number of steps (40, not 10000)
and what is written at the end (each rank's weights, for the test) differ.

Usage: horovod_tf2_mnist.py OUT_DIR. Each rank draws its own initial weights (Keras seeds them at random) and its
own images: only averaged gradients after the first step's broadcast keep the ranks' weights equal. Under Keras 3
this example died in hvd.DistributedGradientTape (`'Variable' object has no attribute 'ref'`) and at
`opt.variables()` (a property in Keras 3).
"""

import hashlib
import os
import sys

import numpy as np
import tensorflow as tf
from rank_results import write_result

import horovod.tensorflow as hvd

out_dir = sys.argv[1]


def local_digits(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=2000)
    images = (rng.random((2000, 28, 28)) * 64 + labels[:, None, None] * 19).astype(np.uint8)
    return images, labels


def train():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    mnist_images, mnist_labels = local_digits(hvd.rank())

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
                 tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])
    loss = tf.losses.SparseCategoricalCrossentropy()

    # Horovod: adjust learning rate based on number of GPUs.
    opt = tf.optimizers.Adam(0.001 * hvd.size())

    checkpoint_dir = os.path.join(out_dir, 'checkpoints')
    checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)

        # Horovod: add Horovod Distributed GradientTape.
        tape = hvd.DistributedGradientTape(tape)

        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))

        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        #
        # Note: broadcast should be done after the first gradient step to ensure optimizer
        # initialization.
        if first_batch:
            hvd.broadcast_variables(mnist_model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables(), root_rank=0)

        return loss_value

    losses = []
    # Horovod: adjust number of steps based on number of GPUs.
    for batch, (images, labels) in enumerate(dataset.take(40 // hvd.size())):
        loss_value = training_step(images, labels, batch == 0)
        losses.append(float(loss_value))

        if batch % 10 == 0 and hvd.local_rank() == 0:
            print('Step #%d\tLoss: %.6f' % (batch, loss_value))

    # Horovod: save checkpoints only on worker 0 to prevent other workers from
    # corrupting it.
    if hvd.rank() == 0:
        checkpoint.save(checkpoint_dir)
    weights = b"".join(np.asarray(w, dtype=np.float32).tobytes() for w in mnist_model.get_weights())
    slots = b"".join(np.asarray(v, dtype=np.float32).tobytes() for v in opt.variables()[1:])
    write_result(out_dir, hvd.rank(), {"keras": tf.keras.Model.__module__.split(".")[0], "losses": losses,
                                       "weights": hashlib.sha256(weights).hexdigest()[:16],
                                       "optimizer_state": hashlib.sha256(slots).hexdigest()[:16]})


if __name__ == '__main__':
    train()
