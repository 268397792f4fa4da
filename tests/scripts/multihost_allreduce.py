"""Multi-host rank program: where did each rank run, and what did the collectives return? Results go to files.

Usage: multihost_allreduce.py OUT_DIR [LOOP_SECONDS]

Every rank writes OUT_DIR/result.<rank>.json: its hostname, the IPv4 addresses of the network namespace it runs in
(on the netns test hosts: that host's address), that namespace's inode, and the allreduce results. With
LOOP_SECONDS, each rank then writes OUT_DIR/ready.<rank> and keeps doing allreduces for that long (a training loop
to cut a host's link under), then writes OUT_DIR/finished.<rank>. Files are written atomically (tmp + rename).
"""

import json
import os
import socket
import sys
import time

import horovod.torch as hvd
import psutil
import torch


def write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


hvd.init()
rank, size = hvd.rank(), hvd.size()
out_dir = sys.argv[1]
mine = torch.tensor([float(rank + 1), 100.0 * (rank + 1)], dtype=torch.float64)
addresses = sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family == socket.AF_INET and not a.address.startswith("127."))
write(os.path.join(out_dir, f"result.{rank}.json"), {
    "rank": rank,
    "size": size,
    "local_rank": hvd.local_rank(),
    "cross_rank": hvd.cross_rank(),
    "hostname": socket.gethostname(),
    "addresses": addresses,
    "netns_inode": os.stat("/proc/self/ns/net").st_ino,
    "pid": os.getpid(),
    "sum": hvd.allreduce(mine, op=hvd.Sum, name="sum").tolist(),
    "average": hvd.allreduce(mine, op=hvd.Average, name="avg").tolist(),
    "gathered_ranks": hvd.allgather(torch.tensor([rank]), name="ranks").tolist(),
})
if len(sys.argv) > 2:
    deadline = time.monotonic() + float(sys.argv[2])
    steps = 0
    while time.monotonic() < deadline:
        hvd.allreduce(torch.ones(1000), name=f"step.{steps}")
        steps += 1
        if steps == 5:
            write(os.path.join(out_dir, f"ready.{rank}"), {"pid": os.getpid(), "time": time.time()})
        time.sleep(0.02)
    write(os.path.join(out_dir, f"finished.{rank}"), {"steps": steps})
