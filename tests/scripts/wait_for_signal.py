"""Each rank writes its pid to DIR/ready.<rank> (atomically), then sleeps until it is stopped.

Usage: wait_for_signal.py DIR
"""

import os
import sys
import time

import horovod.torch as hvd

hvd.init()
ready = os.path.join(sys.argv[1], f"ready.{hvd.rank()}")
with open(ready + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(ready + ".tmp", ready)
time.sleep(300)
