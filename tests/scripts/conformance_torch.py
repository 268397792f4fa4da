"""Horovod's public PyTorch API on this build, case by case; writes OUT_DIR/result.<rank>.json.

Usage: conformance_torch.py OUT_DIR. Every rank runs the same cases in the same order (each case's collectives
complete on every rank before its checks run, so a failed check never leaves a peer waiting). Expected values come
from the rank and the size alone, never from Horovod. A case records "ok" or the first error; the test requires
"ok" for every case it knows, so a case that disappears fails too.
"""

import hashlib
import sys

import horovod.torch as hvd
import torch
from rank_results import Cases, write_result

out_dir = sys.argv[1]
hvd.init(process_sets="dynamic")
rank, size = hvd.rank(), hvd.size()
cases = Cases()
case = cases.case
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
FLOATS = [torch.float16, torch.float32, torch.float64]
TRIANGLE = size * (size + 1) // 2  # sum over ranks of (rank + 1)


def same(got, want, what):
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()} ({got.dtype}), want {want.tolist()} ({want.dtype})")


def name_of(dtype):
    return str(dtype).split(".")[1]


for dt in INTS + FLOATS:
    @case(f"allreduce_sum_{name_of(dt)}")
    def _(dt=dt):
        same(hvd.allreduce(torch.full((5,), rank + 1, dtype=dt), op=hvd.Sum), torch.full((5,), TRIANGLE, dtype=dt),
             "sum")

    @case(f"allgather_{name_of(dt)}")
    def _(dt=dt):
        want = torch.cat([torch.full((r + 1, 2), r, dtype=dt) for r in range(size)])
        same(hvd.allgather(torch.full((rank + 1, 2), rank, dtype=dt)), want, "allgather (uneven first dimension)")

    @case(f"broadcast_{name_of(dt)}")
    def _(dt=dt):
        same(hvd.broadcast(torch.full((3,), rank + 1, dtype=dt), root_rank=size - 1), torch.full((3,), size, dtype=dt),
             "broadcast")

    @case(f"alltoall_{name_of(dt)}")
    def _(dt=dt):
        sent = (torch.arange(2 * size) + 10 * rank).to(dt)
        want = torch.cat([(torch.arange(2 * rank, 2 * rank + 2) + 10 * r).to(dt) for r in range(size)])
        same(hvd.alltoall(sent), want, "alltoall")

    @case(f"reducescatter_sum_{name_of(dt)}")
    def _(dt=dt):
        got = hvd.reducescatter(torch.full((2 * size, 3), rank + 1, dtype=dt), op=hvd.Sum)
        same(got, torch.full((2, 3), TRIANGLE, dtype=dt), "reducescatter")

for dt in FLOATS:
    @case(f"allreduce_average_{name_of(dt)}")
    def _(dt=dt):
        same(hvd.allreduce(torch.full((4,), rank + 1, dtype=dt)), torch.full((4,), (size + 1) / 2, dtype=dt), "mean")


@case("allreduce_bfloat16_is_refused")
def _():
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.bfloat16))
    except (TypeError, ValueError, RuntimeError) as exc:
        if "bfloat16" not in str(exc).lower() and "type" not in str(exc).lower():
            raise AssertionError(f"refused without naming the type: {exc}") from None
        return
    raise AssertionError("bfloat16 allreduce returned a result: this build supports it now, update the test")


@case("allreduce_min_max_product_and_scaling")
def _():
    mine = torch.full((3,), float(rank + 1))
    same(hvd.allreduce(mine, op=hvd.Min), torch.full((3,), 1.0), "min")
    same(hvd.allreduce(mine, op=hvd.Max), torch.full((3,), float(size)), "max")
    product = 1.0
    for r in range(size):
        product *= r + 1
    same(hvd.allreduce(mine, op=hvd.Product), torch.full((3,), product), "product")
    got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    same(got, torch.full((3,), TRIANGLE * 0.5), "pre/postscale")


@case("inplace_async_and_grouped")
def _():
    t = torch.full((4,), float(rank + 1))
    hvd.allreduce_(t, op=hvd.Sum)
    same(t, torch.full((4,), float(TRIANGLE)), "allreduce_")
    b = torch.full((2,), float(rank))
    hvd.broadcast_(b, root_rank=0)
    same(b, torch.zeros(2), "broadcast_")
    handle = hvd.allreduce_async(torch.full((2,), float(rank + 1)), op=hvd.Sum)
    same(hvd.synchronize(handle), torch.full((2,), float(TRIANGLE)), "allreduce_async")
    outs = hvd.grouped_allreduce([torch.full((2,), float(rank)), torch.full((3,), 2.0 * rank)], op=hvd.Sum)
    same(outs[0], torch.full((2,), float(TRIANGLE - size)), "grouped_allreduce[0]")
    same(outs[1], torch.full((3,), 2.0 * (TRIANGLE - size)), "grouped_allreduce[1]")
    gathered = hvd.grouped_allgather([torch.full((1,), float(rank)), torch.full((2,), float(rank))])
    same(gathered[0], torch.arange(size, dtype=torch.float32), "grouped_allgather[0]")
    same(gathered[1], torch.arange(size, dtype=torch.float32).repeat_interleave(2), "grouped_allgather[1]")
    scattered = hvd.grouped_reducescatter([torch.full((size,), float(rank + 1))], op=hvd.Sum)
    same(scattered[0], torch.full((1,), float(TRIANGLE)), "grouped_reducescatter")


@case("alltoall_uneven_splits")
def _():
    splits = torch.tensor([r + 1 for r in range(size)], dtype=torch.int32)  # r + 1 elements go to rank r
    sent = torch.full((int(splits.sum()),), float(rank))
    got, received = hvd.alltoall(sent, splits=splits)
    same(got, torch.cat([torch.full((rank + 1,), float(r)) for r in range(size)]), "values")
    same(received, torch.full((size,), rank + 1, dtype=torch.int32), "received splits")


@case("objects_join_barrier")
def _():
    got = hvd.broadcast_object({"from": rank, "list": [rank] * 3}, root_rank=size - 1)
    if got != {"from": size - 1, "list": [size - 1] * 3}:
        raise AssertionError(f"broadcast_object: {got}")
    if hvd.allgather_object(("r", rank)) != [("r", r) for r in range(size)]:
        raise AssertionError("allgather_object")
    hvd.barrier()
    last = hvd.join()
    if not 0 <= last < size:
        raise AssertionError(f"join returned {last}")


@case("process_sets")
def _():
    singles = [hvd.add_process_set([r]) for r in range(size)]
    mine = singles[rank]
    if not mine.included() or mine.size() != 1 or mine.rank() != 0:
        raise AssertionError(f"own set: included={mine.included()} size={mine.size()} rank={mine.rank()}")
    if any(s.included() for r, s in enumerate(singles) if r != rank):
        raise AssertionError("a rank is included in another rank's set")
    same(hvd.allreduce(torch.full((2,), float(rank + 1)), op=hvd.Sum, process_set=mine),
         torch.full((2,), float(rank + 1)), "allreduce within a one-rank set")
    same(hvd.allreduce(torch.full((2,), float(rank + 1)), op=hvd.Sum), torch.full((2,), float(TRIANGLE)),
         "global set alongside")
    for s in singles:
        if not hvd.remove_process_set(s):
            raise AssertionError("remove_process_set returned False")


@case("compression_fp16")
def _():
    got = hvd.allreduce(torch.full((4,), rank + 0.5), compression=hvd.Compression.fp16)
    same(got, torch.full((4,), sum(r + 0.5 for r in range(size)) / size), "fp16-compressed mean")


@case("channels_last")
def _():
    # hvdtrain's patch: allreduce and broadcast take channels-last tensors (a model in torch.channels_last: its
    # weights, gradients, momentum), the output in the same layout and every element in its logical place.
    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    x = (base * (rank + 1)).to(memory_format=torch.channels_last)
    got = hvd.allreduce(x, op=hvd.Sum)
    if not got.is_contiguous(memory_format=torch.channels_last):
        raise AssertionError(f"allreduce output strides {got.stride()}, want channels-last")
    same(got.contiguous(), base * TRIANGLE, "channels-last allreduce")
    same(hvd.allreduce(x, op=hvd.Average).contiguous(), base * TRIANGLE / size, "channels-last average")
    same(hvd.grouped_allreduce([x, x[:1]], op=hvd.Sum)[1].contiguous(), base[:1] * TRIANGLE, "grouped")
    y = (base * (rank + 1)).to(memory_format=torch.channels_last)
    hvd.broadcast_(y, root_rank=size - 1)
    same(y.contiguous(), base * size, "channels-last in-place broadcast")
    v = torch.zeros(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d) + rank + 1
    same(hvd.allreduce(v, op=hvd.Sum).contiguous(), torch.full((2, 3, 4, 5, 6), float(TRIANGLE)), "3-d")
    try:
        hvd.allreduce(base.transpose(0, 3), op=hvd.Sum)  # neither layout: still refused
    except ValueError as e:
        if "contiguous" not in str(e):
            raise
    else:
        raise AssertionError("a transposed (non-dense) tensor was accepted")


@case("sync_batch_norm")
def _():
    torch.manual_seed(0)
    x = torch.randn(3 + rank, 4, 5) + rank  # uneven batches, rank-dependent statistics
    bn = hvd.SyncBatchNorm(4, momentum=0.5)
    y = bn(x)
    full = hvd.allgather(x)
    ref = torch.nn.BatchNorm1d(4, momentum=0.5)
    y_ref = ref(full)
    start = sum(3 + r for r in range(rank))
    torch.testing.assert_close(y, y_ref[start:start + x.shape[0]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-5, atol=1e-6)


def state_digest(model, optimizer) -> str:
    h = hashlib.sha256()

    def feed(value):
        if torch.is_tensor(value):
            h.update(value.detach().contiguous().cpu().numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                h.update(str(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                feed(item)
        else:
            h.update(repr(value).encode())

    feed(model.state_dict())
    state = optimizer.state_dict()
    feed(state["state"])
    feed([{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]])
    return h.hexdigest()


def optimizers():
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
            yield name, cls


for opt_name, opt_cls in optimizers():
    @case(f"broadcast_optimizer_state_{opt_name}")
    def _(opt_cls=opt_cls):
        torch.manual_seed(rank)
        if opt_cls is torch.optim.SparseAdam:  # sparse gradients only
            model = torch.nn.Embedding(6, 3, sparse=True)
            loss_of = lambda: model(torch.tensor([rank, 2, 5])).pow(2).sum()  # noqa: E731
        else:  # Muon takes 2-D parameters only: no biases
            model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Tanh(),
                                        torch.nn.Linear(3, 2, bias=False))
            loss_of = lambda: model(torch.full((5, 4), rank + 1.0)).pow(2).sum()  # noqa: E731
        optimizer = opt_cls(model.parameters(), lr=0.01 * (rank + 1))

        def closure():
            optimizer.zero_grad()
            loss = loss_of()
            loss.backward()
            return loss

        optimizer.step(closure)  # each rank builds its own state
        before = state_digest(model, optimizer)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if opt_cls is torch.optim.LBFGS:
            try:
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            except ValueError as exc:
                if "LBFGS" not in str(exc):
                    raise
                return  # Horovod refuses L-BFGS state by design, with a clear error
            raise AssertionError("broadcast_optimizer_state accepted LBFGS: update the test")
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        after = state_digest(model, optimizer)
        digests = hvd.allgather_object((before, after))
        if len({a for _, a in digests}) != 1:
            raise AssertionError("states differ across ranks after the broadcast")
        if digests[0][0] != digests[0][1]:
            raise AssertionError("the root's own state changed")
        if digests[0][0] == digests[-1][0]:
            raise AssertionError("the ranks' states were equal before the broadcast: the case proves nothing")


@case("adasum")
def _():
    a = torch.tensor([1.0, 0.0, 2.0]) if rank == 0 else torch.tensor([1.0, 1.0, 0.0])
    if size != 2:
        raise AssertionError("the expected value below is written for 2 ranks")
    got = hvd.allreduce(a, op=hvd.Adasum)
    x, y = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, 1.0, 0.0])
    dot = float(x @ y)
    want = (1 - dot / (2 * float(x @ x))) * x + (1 - dot / (2 * float(y @ y))) * y
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


result = {"rank": rank, "size": size, "controller": "mpi" if hvd.mpi_enabled() else "gloo", "cases": cases.results}
hvd.shutdown()
write_result(out_dir, rank, result)
