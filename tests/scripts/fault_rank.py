"""A training-shaped loop for fault tests: ShmLoader batches (producer processes, shared memory) -> allreduce.

Usage: fault_rank.py OUT_DIR MODE, MODE one of
  raise  rank 1 raises mid-epoch (an ordinary Python exception) once OUT_DIR/go exists;
  wait   every rank loops until killed (the test SIGKILLs one rank by the pid it wrote).
Each rank writes OUT_DIR/pid.<rank> (its pid) once its loader is running and it has done one allreduce.
"""

import os
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch

from hvdtrain.data import ShmLoader

out_dir, mode = sys.argv[1], sys.argv[2]
hvd.init()
rank, size = hvd.rank(), hvd.size()
data = np.arange(4096, dtype=np.float32).reshape(1024, 4)
with ShmLoader(data, rank=rank, size=size, batch_size=16, num_workers=1, seed=0) as loader:
    for epoch in range(10**6):
        loader.set_epoch(epoch)
        for step, batch in enumerate(loader):
            hvd.allreduce(torch.from_numpy(batch).sum(0), name=f"grad.{step}")
            if epoch == 0 and step == 0:
                tmp = os.path.join(out_dir, f".pid.{rank}.tmp")
                with open(tmp, "w") as f:
                    f.write(str(os.getpid()))
                os.replace(tmp, os.path.join(out_dir, f"pid.{rank}"))
            if mode == "raise" and rank == 1 and os.path.exists(os.path.join(out_dir, "go")):
                raise RuntimeError("rank 1 is failing on purpose mid-epoch")
            time.sleep(0.01)
