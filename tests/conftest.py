"""Guarantees for every test: no process it started outlives it (setsid()ed ranks and orteds included: the pytest
process is a child subreaper, so every orphan re-parents to it), no hvdtrain shared-memory segment outlives the
run, and no test reads or writes state of an earlier run (the user's ~/.cache/hvdtrain: each session gets a private
one)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.support import harness


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """hvdtrain's caches (the Horovod build probe; the node cache of streamed datasets) live in this session's
    temporary directory, for this process and every job it starts: a result must not depend on what an earlier run,
    or the user, left in ~/.cache/hvdtrain or /tmp/hvdtrain-data-UID."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HVDTRAIN_CACHE_DIR", str(tmp_path_factory.mktemp("hvdtrain-cache")))
        mp.setenv("HVDTRAIN_DATA_CACHE", str(tmp_path_factory.mktemp("hvdtrain-data")))  # streamed datasets' shards
        yield


@pytest.fixture(scope="session", autouse=True)
def outside_slurm() -> Iterator[None]:
    """Run inside a Slurm job, the tests would see its SLURM_* variables, and `hvdtrain run` of a spec without hosts
    would plan on that job's allocation: every test starts outside Slurm (tests/support/slurm.py's cluster passes its
    own)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("SLURM_")]:
            mp.delenv(name)
        yield


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind() -> Iterator[harness.OrphanReaper]:
    """Adopt every orphan for the whole session; at its end, fail if any process (of a module- or session-scoped
    fixture, say: the per-test check exempts those) or any new hvdtrain shared-memory segment is left."""
    # Segments an earlier run left (a killed run, another user's job) are not this run's: only new ones count.
    earlier = {entry.name for entry in harness.SHM_DIR.glob(harness.SHM_PREFIX + "*")}
    reaper = harness.OrphanReaper()
    reaper.start()
    before = set(harness.descendants())
    yield reaper
    outlived = reaper.leaked_since(before)
    deadline = time.monotonic() + 10  # killed processes need a moment to be reaped
    while (alive := harness.live_job_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    reaper.stop()
    leaked = [name for name in harness.leaked_segments({os.getpid()}) if name not in earlier]
    problems = []
    if outlived or alive:
        problems.append("processes outlived their test (killed now):\n  " + "\n  ".join(outlived + alive))
    if leaked:
        problems.append("shared-memory segments leaked in /dev/shm: " + ", ".join(leaked))
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(nothing_left_behind: harness.OrphanReaper) -> Iterator[None]:
    """After the test and its function-scoped fixtures are torn down, every process started since it began must
    end within harness.LEAK_GRACE_S; those that do not fail the test and are SIGKILLed. Processes already there when
    it began (started by a module- or session-scoped fixture) are exempt; exited ones (zombies) are reaped."""
    before = set(harness.descendants())
    yield
    outlived = nothing_left_behind.leaked_since(before)
    if outlived:
        pytest.fail(f"{len(outlived)} process(es) outlived the test (killed now):\n  " + "\n  ".join(outlived),
                    pytrace=False)


@pytest.fixture(autouse=True)
def legacy_keras_variable_restored() -> Iterator[None]:
    """hvdtrain never sets TF_USE_LEGACY_KERAS (tests/horovod/test_tfkeras_guard.py checks it), but a test may, and
    every later test's subprocess would inherit it (and run on tf_keras instead of Keras 3). Each test leaves the
    variable as it found it."""
    name = "TF_USE_LEGACY_KERAS"
    saved = os.environ.get(name)
    yield
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Time per test folder (setup, call and teardown of every test in it; module fixtures count where they are
    built), printed before pytest's closing line: the table of docs/testing.md, from any run."""
    seconds: dict[str, float] = {}
    tests: dict[str, set[str]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                parts = report.nodeid.split("::")[0].split("/")
                folder = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
                seconds[folder] = seconds.get(folder, 0.0) + report.duration
                tests.setdefault(folder, set()).add(report.nodeid)
    if not seconds:
        return
    total = sum(seconds.values())
    terminalreporter.write_sep("=", "time per test folder")
    terminalreporter.write_line(f"{'folder':<10} {'tests':>6} {'minutes':>8} {'share':>6}")
    for folder in sorted(seconds, key=seconds.__getitem__, reverse=True):
        terminalreporter.write_line(f"{folder:<10} {len(tests[folder]):>6} {seconds[folder] / 60:>8.1f} "
                                    f"{seconds[folder] / total:>6.0%}")
    terminalreporter.write_line(f"{'all':<10} {sum(map(len, tests.values())):>6} {total / 60:>8.1f}")
