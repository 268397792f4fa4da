"""Session-wide guarantees: no process of a test's job and no hvdtrain shared-memory segment outlives the run."""

from __future__ import annotations

import os
import time

import pytest

from tests import harness


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    yield
    deadline = time.monotonic() + 10  # killed processes need a moment to be reaped
    while (alive := harness.live_job_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = harness.leaked_segments({os.getpid()})
    problems = []
    if alive:
        problems.append("processes outlived their test:\n  " + "\n  ".join(alive))
    if leaked:
        problems.append("shared-memory segments leaked in /dev/shm: " + ", ".join(leaked))
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
