"""Tests that leave processes behind on purpose, for tests/project/test_leak_guard.py (not collected by the suite: run
it by path, so that tests/conftest.py's leak guard applies to it as to every test).

Each orphan is started the way Horovod starts a rank: `setsid` into a session of its own, by a middleman that
exits at once. Its pid goes to $LEAK_DEMO_PID_FILE.short or .long (how long it sleeps); $LEAK_DEMO_MARKER is on its
command line, so the outer test can tell it from any other process. A module-scoped fixture's process (marked
$LEAK_DEMO_MARKER-fixture) lives across two tests: it is no test's leak.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SLEEP = "import sys, time; time.sleep(float(sys.argv[1]))"


def orphan(seconds: float, name: str) -> int:
    """Start a sleeper for `seconds` in a new session whose starter exits at once; write and return its pid."""
    argv = [sys.executable, "-c", SLEEP, str(seconds), os.environ["LEAK_DEMO_MARKER"]]
    started = subprocess.run(["setsid", "sh", "-c", '"$@" </dev/null >/dev/null 2>&1 & echo $!', "sh", *argv],
                             capture_output=True, text=True, timeout=30, check=True)
    pid = int(started.stdout)
    Path(f"{os.environ['LEAK_DEMO_PID_FILE']}.{name}").write_text(str(pid))
    return pid


@pytest.fixture(scope="module")
def server() -> Iterator[subprocess.Popen]:
    """A process kept for the whole module, ended by the fixture's own teardown."""
    argv = [sys.executable, "-c", SLEEP, "300", os.environ["LEAK_DEMO_MARKER"] + "-fixture"]
    proc = subprocess.Popen(argv, start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(timeout=30)


def test_a_module_fixtures_process_is_no_leak(server: subprocess.Popen) -> None:
    assert server.poll() is None


def test_it_is_still_there_for_the_next_test(server: subprocess.Popen) -> None:
    assert server.poll() is None


def test_an_orphan_that_ends_within_the_grace_is_no_leak() -> None:
    orphan(0.5, "short")


def test_an_orphan_in_a_session_of_its_own_is_a_leak() -> None:
    orphan(300, "long")
