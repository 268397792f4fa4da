"""Rank 1 fails with a recognisable message; rank 0 would otherwise block in a collective."""

import sys

import horovod.torch as hvd

hvd.init()
if hvd.rank() == 1:
    print("rank 1 is failing on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
print("rank 0 done", flush=True)
