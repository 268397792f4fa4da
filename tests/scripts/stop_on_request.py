"""A rank that answers hvdtrain's stop request (SIGUSR1 to `hvdtrain run`: records.request_stop) as a recipe does,
without Horovod: the launcher's side is what is tested.

Each rank writes DIR/ready.<rank> (atomically), then polls `records.stop_requested(records.directory())`. Once
asked: MODE `stop` "checkpoints" (sleeps CHECKPOINT_S) and exits 75; MODE `finish` ignores the request and finishes
normally (exit 0). Never asked within WAIT_S: exit 1.

Usage: stop_on_request.py DIR stop|finish
"""

import os
import sys
import time

from hvdtrain import exitcodes, records

WAIT_S = 120.0
CHECKPOINT_S = 1.0

folder, mode = sys.argv[1], sys.argv[2]
rank, _, _ = records.identity()
ready = os.path.join(folder, f"ready.{rank}")
with open(ready + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(ready + ".tmp", ready)
deadline = time.monotonic() + WAIT_S
while not records.stop_requested(records.directory()):
    if time.monotonic() > deadline:
        print(f"rank {rank}: never asked to stop", flush=True)
        sys.exit(1)
    time.sleep(0.05)
print(f"rank {rank}: asked to stop ({mode})", flush=True)
if mode == "stop":
    time.sleep(CHECKPOINT_S)
    sys.exit(exitcodes.PREEMPTED)
