"""hvd.init() / allreduce / hvd.shutdown() CYCLES times in one process; writes OUT_DIR/result.<rank>.json.

Usage: gloo_reinit.py OUT_DIR CYCLES. Each cycle's allreduce must equal the sum of the ranks; every re-init redoes
Gloo's rendezvous through horovodrun's HTTP store, which is where 0.28.1 could hand a rank its peer's stale address
from the cycle before (a "Connect timeout", then an abort; see the http_server.py hunk of the Horovod patch and
tests/scripts/horovodrun_slow_rank.py, which makes that interleaving happen every time).
"""

import sys
import time

import horovod.torch as hvd
import torch
from rank_results import write_result

out_dir, cycles = sys.argv[1], int(sys.argv[2])
sums, seconds = [], []
for cycle in range(cycles):
    start = time.monotonic()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, name=f"cycle{cycle}")
    sums.append(float(total))
    hvd.shutdown()
    seconds.append(time.monotonic() - start)
result = {"rank": rank, "size": size, "sums": sums, "max_cycle_s": max(seconds)}
write_result(out_dir, rank, result)
