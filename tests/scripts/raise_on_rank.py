"""Usage: raise_on_rank.py MODE. Rank 1 ends the job, the other ranks wait for it in an allreduce (its victims).

MODE: raise   rank 1 prints a line that mentions a timeout (user text, not Gloo's) and raises ValueError;
      exit3   rank 1 calls sys.exit(3);
      orphan  rank 1 SIGKILLs its supervisor (hvdtrain.rank), and so itself (its death signal): no record is left.
"""

import os
import signal
import sys

import horovod.torch as hvd
import torch

mode = sys.argv[1]
hvd.init()
if hvd.rank() == 1:
    if mode == "raise":
        print("Timed out waiting for the coffee machine (a user's own line)", flush=True)
        raise ValueError("bad sample 17 in shard 3")
    if mode == "exit3":
        sys.exit(3)
    if mode == "orphan":
        os.kill(os.getppid(), signal.SIGKILL)
        signal.pause()
hvd.allreduce(torch.zeros(1), name="never_completes")
