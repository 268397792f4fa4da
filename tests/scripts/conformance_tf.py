"""Horovod's public TensorFlow API on this build, case by case; writes OUT_DIR/result.<rank>.json.

Usage: conformance_tf.py OUT_DIR (run with TF_USE_LEGACY_KERAS=1: Horovod's SyncBatchNormalization subclasses
tf.keras's BatchNormalization; it is checked here on tf_keras, and under Keras 3 in keras3_upstream.py). Same rules as
conformance_torch.py: every rank runs the same cases in the same order, expected values come from the rank and the
size alone, and each case records "ok" or its first error.
"""

import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from rank_results import Cases, write_result

out_dir = sys.argv[1]
hvd.init(process_sets="dynamic")
rank, size = hvd.rank(), hvd.size()
cases = Cases()
case = cases.case
TRIANGLE = size * (size + 1) // 2
# The dtypes each op is registered for in horovod/tensorflow/mpi_ops.cc (0.28.1).
REDUCE = [tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64]
MOVE = [tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64, tf.bool]
SCATTER = [tf.int32, tf.int64, tf.float16, tf.float32, tf.float64]


def same(got, want, what):
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()} ({got.dtype}), want {want.tolist()} ({want.dtype})")


def full(shape, value, dt):
    return tf.cast(tf.fill(shape, value), dt)


def np_full(shape, value, dt):
    return np.full(shape, value).astype(dt.as_numpy_dtype)


for dt in REDUCE:
    @case(f"allreduce_sum_{dt.name}")
    def _(dt=dt):
        same(hvd.allreduce(full([5], rank + 1, dt), op=hvd.Sum), np_full((5,), TRIANGLE, dt), "sum")

for dt in [tf.float16, tf.float32, tf.float64]:
    @case(f"allreduce_average_{dt.name}")
    def _(dt=dt):
        same(hvd.allreduce(full([4], rank + 1, dt)), np_full((4,), (size + 1) / 2, dt), "mean")

for dt in MOVE:
    @case(f"allgather_{dt.name}")
    def _(dt=dt):
        want = np.concatenate([np_full((r + 1, 2), r % 2 if dt == tf.bool else r, dt) for r in range(size)])
        got = hvd.allgather(full([rank + 1, 2], rank % 2 if dt == tf.bool else rank, dt))
        same(got, want, "allgather (uneven first dimension)")

    @case(f"broadcast_{dt.name}")
    def _(dt=dt):
        value = (lambda r: r % 2 == 1) if dt == tf.bool else (lambda r: r + 1)
        same(hvd.broadcast(full([3], value(rank), dt), root_rank=size - 1), np_full((3,), value(size - 1), dt),
             "broadcast")

    @case(f"alltoall_{dt.name}")
    def _(dt=dt):
        def base(r):
            return np.arange(2 * size) % 2 == r % 2 if dt == tf.bool else np.arange(2 * size) + 10 * r

        got = hvd.alltoall(tf.constant(base(rank).astype(dt.as_numpy_dtype)))
        want = np.concatenate([base(r)[2 * rank:2 * rank + 2] for r in range(size)]).astype(dt.as_numpy_dtype)
        same(got, want, "alltoall")

for dt in SCATTER:
    @case(f"reducescatter_sum_{dt.name}")
    def _(dt=dt):
        same(hvd.reducescatter(full([2 * size, 3], rank + 1, dt), op=hvd.Sum), np_full((2, 3), TRIANGLE, dt),
             "reducescatter")


@case("grouped_and_in_tf_function")
def _():
    outs = hvd.grouped_allreduce([full([2], rank, tf.float32), full([3], 2 * rank, tf.float32)], op=hvd.Sum)
    same(outs[0], np_full((2,), TRIANGLE - size, tf.float32), "grouped_allreduce[0]")
    same(outs[1], np_full((3,), 2 * (TRIANGLE - size), tf.float32), "grouped_allreduce[1]")
    gathered = hvd.grouped_allgather([full([1], rank, tf.float32), full([2], rank, tf.float32)])
    same(gathered[1], np.repeat(np.arange(size, dtype=np.float32), 2), "grouped_allgather[1]")
    scattered = hvd.grouped_reducescatter([full([size], rank + 1, tf.float32)], op=hvd.Sum)
    same(scattered[0], np_full((1,), TRIANGLE, tf.float32), "grouped_reducescatter")

    @tf.function
    def graph_sum(x):
        return hvd.allreduce(x, op=hvd.Sum, name="in_graph")

    same(graph_sum(full([2], rank + 1, tf.float32)), np_full((2,), TRIANGLE, tf.float32), "allreduce in tf.function")
    got = hvd.allreduce(full([3], rank + 1, tf.float32), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    same(got, np_full((3,), TRIANGLE * 0.5, tf.float32), "pre/postscale")


@case("objects_variables_and_process_sets")
def _():
    if hvd.broadcast_object({"from": rank}, root_rank=size - 1) != {"from": size - 1}:
        raise AssertionError("broadcast_object")
    if hvd.allgather_object(rank) != list(range(size)):
        raise AssertionError("allgather_object")
    v = tf.Variable(np.full((2,), float(rank), dtype=np.float32))
    hvd.broadcast_variables([v], root_rank=size - 1)
    same(v.numpy(), np.full((2,), float(size - 1), dtype=np.float32), "broadcast_variables")
    singles = [hvd.add_process_set([r]) for r in range(size)]
    mine = singles[rank]
    if not mine.included() or mine.size() != 1:
        raise AssertionError("own process set")
    same(hvd.allreduce(full([2], rank + 1, tf.float32), op=hvd.Sum, process_set=mine),
         np_full((2,), rank + 1, tf.float32), "allreduce within a one-rank set")
    for s in singles:
        hvd.remove_process_set(s)


@case("compression_fp16")
def _():
    got = hvd.allreduce(full([4], rank + 0.5, tf.float32), compression=hvd.Compression.fp16)
    same(got, np_full((4,), sum(r + 0.5 for r in range(size)) / size, tf.float32), "fp16-compressed mean")


@case("distributed_gradient_tape_averages")
def _():
    w = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        loss = w * (rank + 1.0)
    grad = hvd.DistributedGradientTape(tape).gradient(loss, [w])[0]
    same(grad, np.float32((size + 1) / 2), "averaged gradient")


@case("sync_batch_normalization")
def _():
    x = (np.random.default_rng(0).normal(size=(3 + rank, 4)) + rank).astype(np.float32)
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    y = layer(x, training=True).numpy()
    full_x = hvd.allgather(tf.constant(x)).numpy()
    mean, var = full_x.mean(axis=0), full_x.var(axis=0)
    start = sum(3 + r for r in range(rank))
    want = (full_x - mean) / np.sqrt(var + 1e-3)
    np.testing.assert_allclose(y, want[start:start + x.shape[0]], rtol=1e-4, atol=1e-4)


@case("adasum")
def _():
    a = np.array([1.0, 0.0, 2.0] if rank == 0 else [1.0, 1.0, 0.0], dtype=np.float32)
    got = hvd.allreduce(tf.constant(a), op=hvd.Adasum).numpy()
    x, y = np.array([1.0, 0.0, 2.0]), np.array([1.0, 1.0, 0.0])
    dot = x @ y
    want = (1 - dot / (2 * (x @ x))) * x + (1 - dot / (2 * (y @ y))) * y
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


result = {"rank": rank, "size": size, "controller": "mpi" if hvd.mpi_enabled() else "gloo", "cases": cases.results}
hvd.shutdown()
write_result(out_dir, rank, result)
