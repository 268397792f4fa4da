"""Horovod's collectives on CUDA tensors, results checked: run by scripts/gpu_check.sh on a GPU machine as

    horovodrun -np 1 -H localhost:1 --gloo python tests/scripts/gpu_collectives.py --out RESULT.json

With a Horovod built with HOROVOD_GPU_OPERATIONS=NCCL, CUDA tensors go through NCCL (one rank per GPU: NCCL
refuses two ranks on one device, so one GPU means -np 1). Exit 0 only if every result is right and NCCL ops are
built; the JSON names each check and its outcome.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import horovod.torch as hvd
import torch


def checks(device: torch.device) -> dict[str, bool]:
    rank, size = hvd.rank(), hvd.size()
    n = 1 << 22  # 16 MiB of float32: large enough to take NCCL's ring path, not only its small-message path
    x = torch.full((n,), float(rank + 1), device=device)
    got: dict[str, bool] = {}
    total = size * (size + 1) / 2
    got["allreduce_sum"] = bool(torch.all(hvd.allreduce(x, op=hvd.Sum, name="sum") == total))
    got["allreduce_average"] = bool(torch.all(hvd.allreduce(x, op=hvd.Average, name="avg") == total / size))
    half = hvd.allreduce(x.half(), op=hvd.Sum, name="half")
    got["allreduce_fp16"] = half.dtype == torch.float16 and bool(torch.all(half == total))
    gathered = hvd.allgather(torch.full((2, 3), float(rank), device=device), name="gather")
    got["allgather"] = gathered.shape == (2 * size, 3) and gathered.is_cuda
    b = torch.arange(1000, dtype=torch.float32, device=device) * (rank + 1)
    got["broadcast"] = bool(torch.all(hvd.broadcast(b, root_rank=0, name="bcast") == torch.arange(1000, device=device)))
    grouped = hvd.grouped_allreduce([x[:10], x[10:20]], op=hvd.Sum, name="grouped")
    got["grouped_allreduce"] = all(bool(torch.all(t == total)) for t in grouped)
    got["results_on_device"] = all(t.device == device for t in (half, gathered, grouped[0]))
    # hvdtrain's patch: channels-last tensors (a model in torch.channels_last) through NCCL, layout kept.
    base = torch.arange(8 * 16 * 7 * 7, dtype=torch.float32, device=device).reshape(8, 16, 7, 7)
    cl = hvd.allreduce((base * (rank + 1)).to(memory_format=torch.channels_last), op=hvd.Sum, name="cl")
    got["allreduce_channels_last"] = (cl.is_contiguous(memory_format=torch.channels_last)
                                      and bool(torch.all(cl == base * total)))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the results")
    args = ap.parse_args()
    hvd.init()
    if not torch.cuda.is_available():
        print("gpu_collectives: no CUDA device visible", file=sys.stderr)
        return 2
    torch.cuda.set_device(hvd.local_rank())  # Horovod: pin one GPU per local rank
    device = torch.device("cuda", hvd.local_rank())
    t0 = time.perf_counter()
    got = checks(device)
    torch.cuda.synchronize()
    result = {"nccl_built": bool(hvd.nccl_built()), "size": hvd.size(), "device": torch.cuda.get_device_name(device),
              "checks": got, "seconds": round(time.perf_counter() - t0, 3)}
    result["ok"] = result["nccl_built"] and all(got.values())
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps(result))
    hvd.shutdown()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
