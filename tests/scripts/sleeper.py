"""A rank stand-in for tests of hvdtrain.rank: writes its pid to PID_FILE, then sleeps, printing nothing.

Usage: sleeper.py PID_FILE [EXIT_CODE_AFTER_S CODE] [--ignore-term]
With EXIT_CODE_AFTER_S and CODE it exits with CODE after that many seconds; --ignore-term ignores SIGTERM (a rank
stuck in C code); SIGUSR1 makes it write "usr1" next to PID_FILE (to see forwarded signals arrive).
"""

import os
import signal
import sys
import time

args = [a for a in sys.argv[1:] if a != "--ignore-term"]
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, lambda *_: open(args[0] + ".usr1", "w").close())
with open(args[0] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(args[0] + ".tmp", args[0])
if len(args) >= 3:
    time.sleep(float(args[1]))
    sys.exit(int(args[2]))
while True:
    time.sleep(0.1)
