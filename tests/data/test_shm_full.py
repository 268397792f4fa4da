"""A /dev/shm too small for the loader's batches (Docker's default is 64 MiB) is a SharedMemoryFullError naming its
size, the loader's need and the fixes, raised before any producer writes: never a producer dead of SIGBUS
(NOTE [shm reservation] in hvdtrain/data/shm.py). Each case runs in a private mount namespace whose /dev/shm is a
16 MiB tmpfs, so the machine's /dev/shm is never filled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.support.harness import REPO

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare for a private /dev/shm")

PROGRAM = textwrap.dedent("""
    import os, sys
    import numpy as np
    from hvdtrain.data import ShmLoader, SharedMemoryFullError
    if sys.argv[1] == "unreserved":  # what the loader did before NOTE [shm reservation]
        os.posix_fallocate = lambda *args: None

    def batches(worker_id, num_workers, epoch, seed):
        for _ in range(4):
            yield np.ones(int(sys.argv[2]) << 18, np.float32)  # argv[2] MiB

    try:
        with ShmLoader.from_generator(batches, rank=0, size=1, num_workers=2, prefetch=2, timeout=60) as loader:
            print("batches:", sum(1 for _ in loader), flush=True)
    except SharedMemoryFullError as exc:
        print("full:", exc, flush=True)
    print("left in /dev/shm:", sorted(os.listdir("/dev/shm")), flush=True)
""")


def run_in_small_shm(mode: str, batch_mib: int, shm_mib: int = 16) -> subprocess.CompletedProcess:
    inner = (f"mount -t tmpfs -o size={shm_mib}m hvdtrain-test /dev/shm && exec \"$0\" -c \"$1\" {mode} "
             f"{batch_mib}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner, sys.executable,
                           PROGRAM], capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_a_full_dev_shm_is_a_clear_error_not_a_sigbus():
    result = run_in_small_shm("reserved", 8)  # 2 workers x 3 slots x 8 MiB = 48 MiB > 16 MiB
    assert result.returncode == 0, result.stderr
    assert "rank 0's data loader: /dev/shm cannot hold a 8.0 MiB batch segment (" in result.stdout
    assert "free of 16.0 MiB)" in result.stdout
    assert "needs about 48.0 MiB of shared memory: 2 worker(s) x 3 slots (prefetch + 1) x 8.0 MiB" in result.stdout
    assert "--shm-size" in result.stdout and "--ipc=host" in result.stdout and "medium: Memory" in result.stdout
    assert "left in /dev/shm: []" in result.stdout
    assert "SIGBUS" not in result.stdout + result.stderr


def test_too_small_for_the_first_slots_says_the_need_is_a_lower_bound():
    result = run_in_small_shm("reserved", 16, shm_mib=4)  # 6 first slots of 1 MiB (and a ring) do not fit in 4
    assert result.returncode == 0, result.stderr
    assert "/dev/shm cannot hold a 1.0 MiB first slot segment (" in result.stdout
    assert "It needs at least 6.0 MiB of shared memory before its first batch" in result.stdout
    assert "left in /dev/shm: []" in result.stdout


def test_the_same_loader_unreserved_dies_of_sigbus_and_says_where_to_look():
    """The defect the reservation removes, shown on the same machine: and even then the message names /dev/shm."""
    result = run_in_small_shm("unreserved", 8)
    assert result.returncode != 0
    assert "died with signal SIGBUS (a write to shared memory that is not there: is /dev/shm full?" in result.stderr


def test_batches_that_fit_are_unaffected():
    result = run_in_small_shm("reserved", 1)  # 6 slots x 1 MiB fit in 16 MiB
    assert result.returncode == 0, result.stderr
    assert "batches: 8" in result.stdout and "left in /dev/shm: []" in result.stdout
