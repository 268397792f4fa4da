"""Each rank contributes its rank; prints what the collectives returned, for the test to check."""

import json

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
print("RESULT " + json.dumps(result), flush=True)
