"""Rank 1 waits in an allreduce that rank 0 joins only after 60 s, with a stop request installed (grace: argv[2]
seconds); it writes its pid to argv[1] first. tests/train/test_preempt.py SIGTERMs it there."""

import os
import sys
import time

import horovod.torch as hvd
import torch

from hvdtrain.train import preempt

hvd.init()
preempt.StopRequest(None, sigterm_grace_s=float(sys.argv[2])).install()
if hvd.rank() == 0:
    time.sleep(60)
else:
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
hvd.allreduce(torch.ones(1), name="blocked")
print(f"rank {hvd.rank()} returned", flush=True)
