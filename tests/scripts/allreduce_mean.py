"""Each rank contributes its rank; writes what the collectives returned to OUT_DIR/result.<rank>.json.

Usage: allreduce_mean.py OUT_DIR. Results go to files, not stdout: mpirun's output forwarding can splice lines that
two ranks write at the same instant, which once made a correct run unparseable.
"""

import json
import os
import sys

import horovod.torch as hvd
import torch

hvd.init()
rank, size = hvd.rank(), hvd.size()
mine = torch.tensor([float(rank), 10.0 * rank + 1.0], dtype=torch.float64)
result = {
    "rank": rank,
    "size": size,
    "local_rank": hvd.local_rank(),
    "average": hvd.allreduce(mine, op=hvd.Average, name="avg").tolist(),
    "sum": hvd.allreduce(mine, op=hvd.Sum, name="sum").tolist(),
    "broadcast": hvd.broadcast(mine, root_rank=size - 1, name="bcast").tolist(),
    "allgather": hvd.allgather(mine.reshape(1, 2), name="gather").tolist(),
}
tmp = os.path.join(sys.argv[1], f".result.{rank}.tmp")
with open(tmp, "w") as f:
    json.dump(result, f)
os.replace(tmp, os.path.join(sys.argv[1], f"result.{rank}.json"))
