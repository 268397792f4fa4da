"""Usage: raise_on_rank.py MODE. Rank 1 ends the job, the other ranks wait for it in an allreduce (its victims).

MODE: raise   rank 1 prints a line that mentions a timeout (user text, not Gloo's) and raises ValueError;
      exit3   rank 1 calls sys.exit(3);
      exit3-slow  as exit3, but rank 1 is still shutting down (an atexit sleep) when the teardown stops it;
      orphan  rank 1 SIGKILLs its supervisor (hvdtrain.rank), and so itself (its death signal): no record is left.
"""

import atexit
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

mode = sys.argv[1]
if mode == "exit3-slow" and os.environ.get("HOROVOD_RANK") == "1":  # Gloo's rank, known before hvd.init()
    atexit.register(time.sleep, 120)  # registered before Horovod's own: runs after its shutdown (LIFO)
hvd.init()
if hvd.rank() == 1:
    if mode == "raise":
        print("Timed out waiting for the coffee machine (a user's own line)", flush=True)
        raise ValueError("bad sample 17 in shard 3")
    if mode in ("exit3", "exit3-slow"):
        sys.exit(3)
    if mode == "orphan":
        os.kill(os.getppid(), signal.SIGKILL)
        signal.pause()
hvd.allreduce(torch.zeros(1), name="never_completes")
