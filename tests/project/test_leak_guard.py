"""The leak guard of tests/conftest.py sees what Horovod hides: a test session (tests/scripts/leaky_tests.py, run
with the real conftest) whose test orphans a `setsid`ed process fails that test naming the process, and kills it;
an orphan that ends by itself within the grace is no leak, nor is a process a module-scoped fixture keeps."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import psutil

from tests.support.harness import REPO, JobResult, run_bounded

DEMO = REPO / "tests" / "scripts" / "leaky_tests.py"
GRACE_S = 2  # the inner session's leak grace (10 s in a normal run)


def run_leaky_session(tmp_path: Path, marker: str) -> JobResult:
    """`pytest leaky_tests.py` in the checkout (so tests/conftest.py applies), in a session of its own."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "inner"),
            str(DEMO.relative_to(REPO))]
    env = {"LEAK_DEMO_PID_FILE": str(tmp_path / "pid"), "LEAK_DEMO_MARKER": marker,
           "HVDTRAIN_TEST_LEAK_GRACE_S": str(GRACE_S)}
    return run_bounded(argv, timeout=120, env=env, cwd=REPO)


def running_with(marker: str) -> list[int]:
    """Pids of processes (zombies aside) whose command line holds `marker`."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and marker in (p.info["cmdline"] or []):
            found.append(p.pid)
    return found


def test_a_setsid_orphan_fails_its_test_by_name_and_is_killed(tmp_path):
    marker = f"leak-demo-{uuid.uuid4().hex}"
    res = run_leaky_session(tmp_path, marker)
    long_pid, short_pid = (int((tmp_path / f"pid.{name}").read_text()) for name in ("long", "short"))
    assert res.returncode == 1, res.describe()
    assert res.output.splitlines()[-1].startswith("4 passed, 1 error"), res.describe()
    assert "ERROR at teardown of test_an_orphan_in_a_session_of_its_own_is_a_leak" in res.output, res.describe()
    assert f"1 process(es) outlived the test (killed now):\n  pid {long_pid} (python" in res.output, res.describe()
    assert marker in res.output and f"pid {short_pid} " not in res.output, res.describe()
    assert running_with(marker) == [], "the guard did not kill the leaked process"
    assert running_with(marker + "-fixture") == [], "the module fixture's process outlived the session"
