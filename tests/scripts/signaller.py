"""Start `hvdtrain run JOB`, wait until both ranks of wait_for_signal.py wrote their pid, send SIGNUM to hvdtrain,
and print one line, `REPORT {"code", "elapsed", "ranks", "alive", "shm_left"}`: hvdtrain's exit code ("hung" if it
did not exit within 60 s), seconds from the signal to that exit, how many ranks were ready, the pids of ranks still
alive (which are then killed, so that nothing leaks), and the /dev/shm files the ranks had mapped (Open MPI's
vader_segment.*) that are still there (then removed). hvdtrain's output goes to DIR/out.txt.

Usage: signaller.py HVDTRAIN JOB SIGNUM DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import psutil

RANKS = 2


def wait_for_ranks(proc: subprocess.Popen, piddir: str, timeout_s: float = 120) -> dict[int, int]:
    """rank -> pid, from DIR/ready.<rank>, until all RANKS are there, hvdtrain exits, or timeout_s passes."""
    pids: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(pids) < RANKS and proc.poll() is None and time.monotonic() < deadline:
        for rank in range(RANKS):
            path = os.path.join(piddir, f"ready.{rank}")
            if os.path.exists(path):
                with open(path) as f:
                    pids[rank] = int(f.read())
        time.sleep(0.2)
    return pids


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def mapped_shm(pids: list[int]) -> set[str]:
    """Files in /dev/shm that the processes map and whose names still exist."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                    found.add(path)
    return found


def main(hvdtrain: str, job: str, signum: int, piddir: str) -> dict:
    with open(os.path.join(piddir, "out.txt"), "w") as out:
        proc = subprocess.Popen([hvdtrain, "run", job], stdout=out, stderr=subprocess.STDOUT)
    pids = wait_for_ranks(proc, piddir)
    mapped = mapped_shm(list(pids.values()))
    t0 = time.monotonic()
    proc.send_signal(signum)
    try:
        code: int | str = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "hung"
    elapsed = time.monotonic() - t0
    left = [pid for pid in pids.values() if alive(pid)]
    for pid in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()
    shm_left = sorted(p for p in mapped if os.path.exists(p))
    for path in shm_left:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return {"code": code, "elapsed": elapsed, "ranks": len(pids), "alive": left, "shm_left": shm_left}


if __name__ == "__main__":
    print("REPORT " + json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])), flush=True)
