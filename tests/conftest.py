"""Session-wide guarantees: no process of a test's job and no hvdtrain shared-memory segment outlives the run, and
no test reads or writes state of an earlier run (the user's ~/.cache/hvdtrain: each session gets a private one)."""

from __future__ import annotations

import os
import time

import pytest

from tests import harness


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """hvdtrain's cache (the Horovod build probe) lives in this session's temporary directory, for this process and
    every job it starts: a result must not depend on what an earlier run, or the user, left in ~/.cache/hvdtrain."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HVDTRAIN_CACHE_DIR", str(tmp_path_factory.mktemp("hvdtrain-cache")))
        yield


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    # Segments an earlier run left (a killed run, another user's job) are not this run's: only new ones count.
    earlier = {entry.name for entry in harness.SHM_DIR.glob(harness.SHM_PREFIX + "*")}
    yield
    deadline = time.monotonic() + 10  # killed processes need a moment to be reaped
    while (alive := harness.live_job_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = [name for name in harness.leaked_segments({os.getpid()}) if name not in earlier]
    problems = []
    if alive:
        problems.append("processes outlived their test:\n  " + "\n  ".join(alive))
    if leaked:
        problems.append("shared-memory segments leaked in /dev/shm: " + ", ".join(leaked))
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
