"""Horovod's own v0.28.1 Keras tests, ported to Keras 3 (TensorFlow backend), case by case; writes
OUT_DIR/result.<rank>.json.

Usage: keras3_upstream.py OUT_DIR (2 ranks). Each case is named after the upstream test it ports, re-written here
from what that test checks: test/parallel/test_tensorflow2_keras.py -> "tf2keras.*",
test_tensorflow2_keras_process_sets.py -> "process_sets.*", test_keras.py -> "keras.*" (a TF1-only file upstream,
but its tests apply to horovod.keras, which under `import keras` is Keras 3 now). What each port changes, and why,
is listed in docs/recipes.md ("Horovod's own Keras tests on Keras 3"); where upstream asserted nothing ("we just
need to verify that it doesn't hang") the port also checks the result (weights equal on both ranks, the update the
averaged gradient gives). Every rank runs the same cases in the same order; each records "ok" or its first error.
"""

import os
import sys

import horovod.keras as hvd_keras
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import keras
import numpy as np
import tensorflow as tf
from rank_results import Cases, write_result

out_dir = sys.argv[1]
even_set, odd_set = hvd.ProcessSet([0]), hvd.ProcessSet([1])
hvd.init(process_sets=[even_set, odd_set])  # process_sets.* needs them; the other cases use the global set
rank, size = hvd.rank(), hvd.size()
rng = np.random.default_rng(rank)  # the ranks' data differ, as upstream's unseeded np.random.random
cases = Cases()
case = cases.case
layers = tf.keras.layers


def distributed(opt) -> bool:
    return hasattr(opt, "_hvd_state")


def same_on_all_ranks(arrays, what):
    """Each array equal to rank 0's (bit for bit)."""
    for i, a in enumerate(arrays):
        a = np.asarray(a)
        root = hvd.broadcast(tf.constant(a), root_rank=0, name=f"{what}.{i}").numpy()
        if not np.array_equal(a, root):
            raise AssertionError(f"{what}[{i}] differs from rank 0's: max diff {np.max(np.abs(a - root))}")


def agree(ok, what):
    """Raise on every rank unless ok on every rank: a rank that goes on alone would hang in a collective."""
    oks = hvd.allreduce(tf.constant(1.0 if ok else 0.0), op=hvd_tf.Min, name=f"agree.{what}").numpy()
    if oks < 1.0:
        raise AssertionError(f"{what}: {'also on' if not ok else 'not on'} another rank")


def broadcast_model(model):
    hvd_tf.broadcast_variables(model.variables, root_rank=0)


def small_model():
    """Upstream's Dense(2, input_shape=(3,)) / RepeatVector(3) / TimeDistributed(Dense(3)), with Keras 3's Input."""
    return tf.keras.Sequential([tf.keras.Input((3,)), layers.Dense(2), layers.RepeatVector(3),
                                layers.TimeDistributed(layers.Dense(3))])


class AddGradient(tf.keras.optimizers.Optimizer):
    """Upstream's TestingOptimizer: each update adds the gradient it is given (Keras 3's update_step signature)."""

    def __init__(self, name="test", learning_rate=0.1, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_add(tf.convert_to_tensor(gradient))


@case("tf2keras.train_model_lr_schedule")
def _():
    initial_lr = 0.1 * size
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam())
    # Keras 3 removed ThresholdedReLU (ReLU(threshold=...) is it) and compile's experimental_run_tf_function.
    model = tf.keras.Sequential([tf.keras.Input((3,)), layers.Dense(2), layers.RepeatVector(3),
                                 layers.ReLU(threshold=0.5)])
    model.compile(loss="mse", optimizer=opt, metrics=[tf.keras.metrics.categorical_accuracy])
    x, y = rng.random((10, 3)), rng.random((10, 3, 2))
    seen = []

    class StoreLearningRate(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            lr = float(self.model.optimizer.learning_rate)  # Keras 3: no `lr` alias
            seen.append(lr)
            if 0 <= epoch < 5:
                assert lr <= initial_lr or np.isclose(lr, initial_lr), (epoch, lr)
            if 5 < epoch < 10:
                assert lr <= initial_lr * 1e-1 or np.isclose(lr, initial_lr * 1e-1), (epoch, lr)
            if 10 < epoch < 15:
                assert lr < initial_lr * 1e-2 or np.isclose(lr, initial_lr * 1e-2), (epoch, lr)
            if 15 <= epoch < 20:
                assert np.isclose(lr, initial_lr * epoch), (epoch, lr)

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=initial_lr, warmup_epochs=5),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-1, start_epoch=5,
                                                   end_epoch=10),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=1e-2, start_epoch=10,
                                                   end_epoch=15),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=initial_lr, multiplier=lambda epoch: epoch,
                                                   start_epoch=15, end_epoch=20),
        StoreLearningRate()]
    # batch_size=2: 5 steps of the 10 samples (Keras 3 ends training when an array input runs out).
    history = model.fit(x, y, batch_size=2, steps_per_epoch=5, callbacks=callbacks, epochs=20, verbose=0)
    assert len(seen) == 20, f"{len(seen)} epochs ran, not 20"
    loss = tf.convert_to_tensor(history.history["loss"], dtype=tf.float32)
    np.testing.assert_allclose(hvd.broadcast(loss, root_rank=0).numpy(), loss.numpy())  # MetricAverageCallback


def embedding_model():
    """Upstream's Embedding(1000, 64, input_length=10) (Keras 3: no input_length; the Input says it)."""
    return tf.keras.Sequential([tf.keras.Input((10,), dtype="int32"), layers.Embedding(1000, 64)])


def embedding_batch():
    return rng.integers(1000, size=(32, 10)), rng.random((32, 10, 64))


for module, name in ((hvd, "tf2keras"), (hvd_keras, "keras")):
    @case(f"{name}.sparse_as_dense")
    def _(module=module):
        for sparse_as_dense in (True, False):  # the IndexedSlices gradient made dense, and allgathered as it is
            opt = module.DistributedOptimizer(tf.keras.optimizers.RMSprop(learning_rate=0.0001),
                                              sparse_as_dense=sparse_as_dense)
            model = embedding_model()
            model.compile(loss="mse", optimizer=opt)
            broadcast_model(model)
            before = model.get_weights()[0]
            model.train_on_batch(*embedding_batch())
            after = model.get_weights()[0]
            assert not np.array_equal(before, after), "the step changed nothing"
            same_on_all_ranks([after], f"embedding (sparse_as_dense={sparse_as_dense})")


@case("tf2keras.sparse_as_dense_with_grad_aggregation")
def _():
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.RMSprop(learning_rate=0.0001), sparse_as_dense=True,
                                   backward_passes_per_step=2)
    model = embedding_model()
    model.compile(loss="mse", optimizer=opt)
    broadcast_model(model)
    weights = [model.get_weights()[0]]
    for _step in range(3):
        model.train_on_batch(*embedding_batch())
        weights.append(model.get_weights()[0])
    # Upstream read Horovod's aggregation counter (3 % 2); Keras 3 accumulates itself: the weights move on the
    # 2nd micro-step only, to the same values on both ranks, and one micro-step is pending.
    assert opt.gradient_accumulation_steps == 2
    assert np.array_equal(weights[0], weights[1]) and np.array_equal(weights[2], weights[3]), "updated off-cycle"
    assert not np.array_equal(weights[1], weights[2]), "the 2nd micro-step did not update"
    assert int(opt._iterations.numpy()) % 2 == 3 % 2  # micro-steps (Keras 3's `iterations` counts updates)
    same_on_all_ranks(weights[2:3], "embedding")


@case("tf2keras.grad_aggregation_with_inf_grad")
def _():
    step = tf.Variable(0, trainable=False, dtype=tf.int32)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(), backward_passes_per_step=2, sparse_as_dense=True)
    x = tf.Variable(0.0)
    opt.build([x])

    def loss():
        step.assign_add(1)
        return tf.cond(step > 1, lambda: x, lambda: x * float("inf"))

    for i in range(4):
        # The first cycle's gradient is infinite; upstream checked that Horovod's aggregation buffer was cleared
        # after the update. Keras 3 accumulates: its accumulator must be back to 0 after each update.
        with tf.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, [x])
        opt.apply_gradients(zip(grads, [x], strict=True))
        accumulated = opt._accumulated_gradients[0].numpy()
        if i % 2 == 1:
            assert accumulated == 0.0, f"micro-step {i + 1}: accumulator {accumulated} after the update"
    assert tf.math.is_finite(grads[0]), grads


for module, name in ((hvd, "tf2keras"), (hvd_keras, "keras")):
    @case(f"{name}.from_config")
    def _(module=module):
        hopt = module.DistributedOptimizer(tf.keras.optimizers.Adam())
        cfg = hopt.get_config()
        for copy in (hopt.from_config(cfg), hopt.__class__.from_config(cfg)):
            assert copy.get_config() == cfg, (copy.get_config(), cfg)
            assert distributed(copy), "from_config lost the Horovod optimizer"

    @case(f"{name}.elastic_state")
    def _(module=module):
        v = 1.0 if rank == 0 else 2.0
        model1 = tf.keras.Sequential([layers.Dense(2, activation="softmax")])
        model1.build((2, 2))
        model1.set_weights([np.full((2, 2), v, np.float32), np.full((2,), v, np.float32)])
        model2 = tf.keras.Sequential([layers.Dense(2, activation="softmax")])
        model2.build((2, 2))
        model2.set_weights([np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.zeros(2, np.float32)])
        state = module.elastic.KerasState(model1, tf.keras.optimizers.Adam(0.001 * size), batch=20 + rank,
                                          epoch=10 + rank)
        state.sync()
        model1_weights, model2_weights = model1.get_weights(), model2.get_weights()
        for w in state.model.get_weights():  # after sync: rank 0's values
            np.testing.assert_allclose(w, np.ones_like(w))
        assert (state.batch, state.epoch) == (20, 10)
        model1.set_weights(model2_weights)  # partly modified, then restored
        state.batch, state.epoch = 21, 11
        state.restore()
        for w1, w2 in zip(model1.get_weights(), model1_weights, strict=True):
            np.testing.assert_allclose(w1, w2)
        assert (state.batch, state.epoch) == (20, 10)
        model1.set_weights(model2_weights)  # partly modified, then committed
        state.batch, state.epoch = 21, 11
        state.commit()
        state.restore()
        for w1, w2 in zip(model1.get_weights(), model2_weights, strict=True):
            np.testing.assert_allclose(w1, w2)
        assert (state.batch, state.epoch) == (21, 11)


def aggregation_case(average, local_vars):
    """Upstream's test_gradient_aggregation(_with_local_vars): 4 backward passes per step, 10 micro-steps in a
    tf.function, IndexedSlices gradients (tf.gather). Keras 3 ports: the optimizer's update_step signature, its
    build before the tf.function (Keras 3 optimizers create variables at build), tape gradients instead of Keras 2's
    private _compute_gradients, Keras 3's own accumulation instead of Horovod's helper counter."""
    passes, count, n_local = 4, 8 if local_vars else 1, 4 if local_vars else 0
    opt = hvd.DistributedOptimizer(optimizer=AddGradient(), backward_passes_per_step=passes,
                                   average_aggregated_gradients=average, sparse_as_dense=True)
    xs = [tf.Variable([0.0]) for _ in range(count)]
    ys = [tf.Variable([1.0, 2.0]) for _ in range(count)]
    variables = xs + ys
    opt.build(variables)
    for i in range(n_local):
        opt.register_local_var(xs[i])
        opt.register_local_var(ys[i])
    factor = float(rank + 1) if local_vars else 1.0  # dloss/dy0 = -(rank + 1): the ranks' gradients differ

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(x - factor * tf.gather(y, [0])) for x, y in zip(xs, ys, strict=True)])
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables, strict=True))

    for idx in range(10):
        step()
        updates = (idx + 1) // passes
        per_update = 1.0 if average else float(passes)
        mean_factor = (size + 1) / 2 if local_vars else 1.0  # (1 + 2 + ... + size) / size
        for i in range(count):
            local = i < n_local
            want_x = updates * per_update * (1.0 / size if local else 1.0)
            want_y0 = 1.0 - updates * per_update * (factor / size if local else mean_factor)
            np.testing.assert_allclose(xs[i].numpy(), [want_x], rtol=1e-6, err_msg=f"x[{i}] at micro-step {idx}")
            np.testing.assert_allclose(ys[i].numpy(), [want_y0, 2.0], rtol=1e-6,
                                       err_msg=f"y[{i}] at micro-step {idx}")
        # Upstream: Keras 2 counted every micro-step in `iterations`; Keras 3 counts them in `_iterations` and
        # updates in `iterations`.
        assert (int(opt._iterations.numpy()), int(opt.iterations.numpy())) == (idx + 1, updates), idx
    assert int(opt._iterations.numpy()) % passes == 10 % passes


for average in (True, False):
    case(f"tf2keras.gradient_aggregation[average={average}]")(lambda average=average: aggregation_case(average, False))
    case(f"tf2keras.gradient_aggregation_with_local_vars[average={average}]")(
        lambda average=average: aggregation_case(average, True))


@case("tf2keras.partial_distributed_optimizer")
def _():
    x, y = rng.random((1, 3)), rng.random((1, 3, 3))
    for n_local in range(3):  # 0, 1 and 2 local layers of the 3
        init = tf.keras.initializers.Constant(rank)  # the ranks' weights, so their gradients, differ
        model = tf.keras.Sequential([tf.keras.Input((3,)), layers.Dense(2, kernel_initializer=init,
                                                                        bias_initializer=init),
                                     layers.RepeatVector(3),
                                     layers.TimeDistributed(layers.Dense(3, kernel_initializer=init,
                                                                         bias_initializer=init))])
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.MSE(y, model(x, training=True)))
        variables = model.trainable_weights
        grads = tape.gradient(loss, variables)
        local = {id(v) for layer in model.layers[:n_local] for v in layer.trainable_weights}
        # Upstream compared Keras 2's private _compute_gradients output; here SGD(1) applies the gradient it is
        # given, so the update is that gradient.
        opt = hvd_keras.PartialDistributedOptimizer(tf.keras.optimizers.SGD(1.0), sparse_as_dense=True,
                                                    local_layers=model.layers[:n_local])
        before = [v.numpy() for v in variables]
        opt.apply_gradients(zip(grads, variables, strict=True))
        for v, g, b in zip(variables, grads, before, strict=True):
            applied = b - v.numpy()
            if id(v) in local:  # kept local, scaled by 1 / size
                np.testing.assert_allclose(applied * size, g.numpy(), rtol=1e-5, atol=1e-7, err_msg=v.path)
            else:  # the ranks' average, not this rank's own
                np.testing.assert_allclose(applied, hvd.allreduce(g).numpy(), rtol=1e-5, atol=1e-7,
                                           err_msg=v.path)
                assert not np.allclose(applied, g.numpy()), f"{v.path}: this rank's own gradient applied"


@case("tf2keras.broadcast_global_variables_callback_with_local_vars")
def _():
    root = size - 1
    init = tf.keras.initializers.Constant(rank)
    dense = [layers.Dense(3, kernel_initializer=init, bias_initializer=init, trainable=False) for _ in range(5)]
    model = tf.keras.Sequential([tf.keras.Input((3,)), *dense[:4], layers.RepeatVector(3), dense[4]])
    model.compile(loss="mse", metrics=[tf.keras.metrics.categorical_accuracy])
    local = list(model.layers[0].variables)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=root, local_variables=local)]
    model.fit(rng.random((1, 3)), rng.random((1, 3, 3)), callbacks=callbacks, verbose=0)
    local_ids = {id(v) for v in local}
    for v in model.variables:
        want = float(rank) if id(v) in local_ids else float(root)
        np.testing.assert_allclose(v.numpy(), np.full(v.shape, want), err_msg=v.path)


@case("process_sets.process_set_optimizer")
def _():
    opt = hvd.DistributedOptimizer(AddGradient(name="TestOpti"), process_set=even_set)
    variable = tf.Variable([0.0])
    opt.apply_gradients([(tf.constant([float(rank)]), variable)])  # upstream's get_gradients returned [rank]
    want = sum(range(0, size, 2)) / even_set.size() if even_set.included() else float(rank)
    np.testing.assert_allclose(variable.numpy(), [want])


def load_model_case(custom):
    """test_keras.py's load_model tests on horovod.keras: upstream's model and optimizer, a .keras file (Keras 3
    saves no other format by default), no sample_weight_mode (Keras 3 removed it), the learning rate as
    `learning_rate`. Upstream required the loaded class's module to be horovod._keras; a Keras 3 Horovod optimizer
    keeps its optimizer's module and name (a saved model loads without Horovod), so the port checks that it is
    Horovod's and averages (one step)."""

    class TestOptimizer(keras.optimizers.RMSprop):
        pass

    base = keras.optimizers.RMSprop if custom is None else TestOptimizer
    opt = hvd_keras.DistributedOptimizer(base(learning_rate=0.0001))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.RepeatVector(3),
                              keras.layers.TimeDistributed(keras.layers.Dense(3))])
    model.compile(loss="mse", optimizer=opt, metrics=[keras.metrics.categorical_accuracy])
    model.train_on_batch(rng.random((1, 3)), rng.random((1, 3, 3)))
    path = os.path.join(out_dir, f"model.{custom}.{rank}.keras")
    model.save(path)
    if custom == "custom_optimizers":
        new = hvd_keras.load_model(path, custom_optimizers=[TestOptimizer])
    elif custom == "custom_objects":  # a factory, as upstream's lambda **kwargs: ...
        new = hvd_keras.load_model(path, custom_objects={
            "TestOptimizer": lambda **kwargs: hvd_keras.DistributedOptimizer(TestOptimizer(**kwargs))})
    else:
        new = hvd_keras.load_model(path)
    new_opt = new.optimizer
    assert distributed(new_opt), f"{type(new_opt)} loaded without Horovod"
    assert type(new_opt).__name__ == base.__name__, type(new_opt)
    assert float(new_opt.learning_rate) == float(opt.learning_rate)
    assert len(opt.variables) == len(new_opt.variables) > 2, (opt.variables, new_opt.variables)
    for a, b in zip(opt.variables, new_opt.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    # It averages: from rank 0's weights and optimizer state, one step on each rank's own batch leaves the ranks
    # equal (each rank's own gradient would not).
    hvd_tf.broadcast_variables(new.variables + new_opt.variables, root_rank=0)
    new.train_on_batch(rng.random((1, 3)), rng.random((1, 3, 3)))
    same_on_all_ranks(new.get_weights(), "weights after a step")


for custom in (None, "custom_optimizers", "custom_objects"):
    case("keras.load_model" + (f"_{custom}" if custom else ""))(lambda custom=custom: load_model_case(custom))


@case("keras3.load_model_adamw_loss_scale_and_plain")
def _():
    """Beyond upstream: AdamW (a subclass of Adam), a LossScaleOptimizer (Horovod's LossScaleOptimizer holding a
    plain SGD, not a Horovod optimizer inside another: nothing reduced twice), and a model saved by a script without
    Horovod (SGD with momentum, saved as Keras's own class) each come back Horovod's, with their state."""
    for opt, horovod in ((keras.optimizers.AdamW(0.001), True),
                         (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), True),
                         (keras.optimizers.SGD(0.01, momentum=0.9), False)):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(loss="mse", optimizer=hvd_keras.DistributedOptimizer(opt) if horovod else opt)
        model.train_on_batch(rng.random((2, 3)), rng.random((2, 2)))
        path = os.path.join(out_dir, f"model.{type(opt).__name__}.{rank}.keras")
        model.save(path)
        loaded = hvd_keras.load_model(path).optimizer
        inner = getattr(loaded, "inner_optimizer", None)
        assert type(loaded).__name__ == type(opt).__name__ and distributed(loaded) and not distributed(inner), \
            (type(loaded), inner)
        saved = model.optimizer.variables
        assert len(loaded.variables) == len(saved), (loaded.variables, saved)
        for a, b in zip(saved, loaded.variables, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{type(opt).__name__}: {a.path}")


@case("keras.load_model_broadcast")
def _():
    def create_model():
        opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.01 * size, momentum=0.9))
        # Layers unnamed, as upstream: rank 0's loaded model and the others' new one name their variables apart
        # (Keras 3: "dense_4/kernel" loaded, "sequential_9/dense_4/kernel" new); 0.28.1 named its collectives
        # from them and hung here (upstream ran 0 epochs, so never allreduced).
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.RepeatVector(3),
                                  keras.layers.TimeDistributed(keras.layers.Dense(3))])
        model.compile(loss="mse", optimizer=opt, metrics=[keras.metrics.categorical_accuracy])
        return model

    x, y = rng.random((1, 3)), rng.random((1, 3, 3))
    path = os.path.join(out_dir, "model.broadcast.keras")
    model = create_model()
    model.train_on_batch(x, y)
    if rank == 0:
        model.save(path)
    hvd.allreduce(tf.constant(0.0), name="saved")  # a barrier: rank 0's file is complete
    keras.backend.clear_session()
    model = hvd_keras.load_model(path) if rank == 0 else create_model()
    # Upstream: 5 optimizer weights on the loaded model, 0 on the new one (Keras 2). Keras 3 creates iterations and
    # the learning rate at construction and one momentum per variable (4 here) at build.
    count, want = len(model.optimizer.variables), 6 if rank == 0 else 2
    agree(count == want and distributed(model.optimizer),
          f"rank {rank}: {count} optimizer variables (want {want}), {type(model.optimizer)}")

    def batches():
        while True:
            yield x, y

    # Upstream ran 0 epochs (fit_generator, workers=4: Keras 3 has neither); one epoch shows what the broadcast did.
    model.fit(batches(), steps_per_epoch=10, epochs=2, initial_epoch=1, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert len(model.optimizer.variables) == 6, model.optimizer.variables
    same_on_all_ranks(model.get_weights(), "weights")
    same_on_all_ranks([v.numpy() for v in model.optimizer.variables], "optimizer")


@case("keras.plain_pattern")
def _():
    """The plain pattern as Horovod's keras examples write it (horovod.keras, `import keras`): one step of SGD(0.1)
    on one weight, rank r fitting y = r + 1: the averaged gradient gives w = 0.3 on both ranks (each rank's own
    would give 0.2 and 0.4). tf.keras's plain pattern runs in keras_combined_batch.py."""
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(loss="mse", optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    model.fit(np.ones((4, 1), np.float32), np.full((4, 1), rank + 1.0, np.float32), batch_size=4, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert type(model).__module__.split(".")[0] == "keras", type(model)
    np.testing.assert_allclose(model.get_weights()[0], [[0.3]], atol=1e-6)


# Beyond upstream's Keras tests (its Keras 2 test_tensorflow.py covers these for tf_keras): the reduction op and
# compression through a Keras 3 DistributedOptimizer, and SyncBatchNormalization as a Keras 3 layer.
@case("keras3.op_sum_and_fp16_compression")
def _():
    for op, compression, want in ((hvd.Sum, hvd.Compression.none, size * (size + 1) / 2),
                                  (hvd.Average, hvd.Compression.fp16, (size + 1) / 2)):
        opt = hvd.DistributedOptimizer(AddGradient(), op=op, compression=compression)
        w = tf.Variable([0.0, 0.0])
        opt.apply_gradients([(tf.constant([rank + 1.0, 0.5]), w)])
        np.testing.assert_allclose(w.numpy(), [want, 0.5 * (size if op == hvd.Sum else 1)])


@case("keras3.two_optimizers_in_one_step")
def _():
    # Allreduces are named by position, not from the graph, each optimizer's under its own serial: two Horovod
    # optimizers of one class applied in one tf.function step (nothing orders their allreduces) must not meet
    # under one name. Same shapes: a gradient averaged with the other optimizer's would show.
    a, b = tf.Variable([0.0, 0.0]), tf.Variable([0.0, 0.0])
    opt_a, opt_b = (hvd.DistributedOptimizer(tf.keras.optimizers.SGD(1.0)) for _ in range(2))
    opt_a.build([a])
    opt_b.build([b])

    @tf.function
    def step():
        opt_a.apply_gradients([(tf.fill([2], rank + 1.0), a)])
        opt_b.apply_gradients([(tf.fill([2], 10.0 * (rank + 1)), b)])

    for _step in range(3):
        step()
    mean = (size + 1) / 2
    np.testing.assert_allclose(a.numpy(), [-3 * mean] * 2)
    np.testing.assert_allclose(b.numpy(), [-30 * mean] * 2)


@case("keras3.sync_batch_normalization")
def _():
    # Rank r holds r + 1 samples: the statistics are the combined batch's (weighted by each rank's count).
    data = np.arange(2 * 12, dtype=np.float32).reshape(12, 2) ** 1.5
    counts = list(range(1, size + 1))
    start = sum(counts[:rank])
    mine = data[start:start + counts[rank]]
    combined = data[:sum(counts)]
    layer = hvd_tf.SyncBatchNormalization(momentum=0.0)
    out = layer(tf.constant(mine), training=True).numpy()
    mean, var = combined.mean(axis=0), combined.var(axis=0)
    np.testing.assert_allclose(out, (mine - mean) / np.sqrt(var + layer.epsilon), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-5)


write_result(out_dir, rank, {"keras": tf.keras.optimizers.Optimizer.__module__.split(".")[0], "size": size,
                             "cases": cases.results})
