"""A rank's way to its first training step: hvdtrain.train.startup's clock on a fake clock (the real run:
tests/launch/test_quiet_start.py reads the recipe's line and summary.json), the process start it counts from, and the
digits read without importing scikit-learn."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hvdtrain import records
from hvdtrain.train.startup import StartupClock


def clock(launched: float | None = 100.0, **kwargs) -> tuple[StartupClock, list[float]]:
    now = [103.0]
    return StartupClock(launched=launched, process=101.5, now=lambda: now[0], **kwargs), now


def test_parts_are_named_by_the_mark_that_ends_them_and_add_up() -> None:
    c, now = clock()
    c.mark("imports")
    now[0] = 103.25
    c.mark("rendezvous")
    assert c.parts() == {"launcher": 1.5, "imports": 1.5, "rendezvous": 0.25}
    assert c.report() == {"from": "launched", "total_s": 3.25,
                          "parts_s": {"launcher": 1.5, "imports": 1.5, "rendezvous": 0.25}}
    assert c.line() == ("first step 3.25 s after `hvdtrain run` started: launcher 1.50 s, imports 1.50 s, "
                        "rendezvous 0.25 s")


def test_without_hvdtrain_run_the_clock_starts_at_the_process() -> None:
    c, _ = clock(launched=None)
    c.mark("imports")
    assert c.parts() == {"imports": 1.5} and c.report()["from"] == "process"
    assert c.line().startswith("first step 1.50 s after this rank's process started: imports 1.50 s")


def test_watch_marks_the_first_batch_then_the_first_step_when_the_second_batch_is_asked_for() -> None:
    told: list[str] = []
    c, now = clock(on_first_step=lambda k: told.append(k.line()))
    seen = []
    for batch in c.watch(iter([1, 2, 3])):
        seen.append((batch, [name for name, _ in c.marks][-1], c.done))
        now[0] += 1.0
    assert seen == [(1, "first batch", False), (2, "first step", True), (3, "first step", True)]
    assert len(told) == 1 and told[0].endswith("launcher 1.50 s, first batch 1.50 s, first step 1.00 s")
    c.mark("later")  # after the first step nothing is marked: the report stays the way to the first step
    assert list(c.parts())[-1] == "first step"
    assert list(c.watch([4, 5])) == [4, 5] and len(told) == 1  # the next epochs pass through


def test_an_empty_epoch_marks_nothing() -> None:
    c, _ = clock()
    assert list(c.watch([])) == [] and not c.done and list(c.parts()) == ["launcher"]


@pytest.mark.parametrize("value, expected", [("1795815397.125", 1795815397.125), ("", None), ("soon", None)])
def test_launched_at_reads_the_launchers_variable(value: str, expected: float | None) -> None:
    assert records.launched_at({records.LAUNCHED_ENV: value}) == expected
    assert records.launched_at({}) is None


def test_process_started_is_this_processs_start_on_time_times_clock() -> None:
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from hvdtrain import records; "
                          "print(records.process_started(), time.time())"], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    started, now = float(out[0]), float(out[1])
    assert before - 0.02 <= started <= now  # a clock tick (10 ms) of rounding, at most


def test_the_launcher_starts_when_hvdtrain_does_even_when_a_script_execs_it() -> None:
    """scripts/quickstart.sh sets up (minutes on a fresh machine), then `exec hvdtrain run`: the process is the
    script's, so its start made the quickstart's first-step line say "launcher 808.04 s" (issue 59 item 9)."""
    code = "import time; from hvdtrain import records; print(time.time() - records.launcher_started())"
    for prefix in ("", "sleep 2.5; "):
        before = time.time()
        out = subprocess.run(["bash", "-c", f'{prefix}exec "$0" -c "$1"', sys.executable, code], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        # not the 2.5 s the script slept first; a clock tick (10 ms) of rounding in the process's start, at most
        assert 0 <= float(out) < min(1.5, time.time() - before + 0.02), (prefix, out)


def test_the_digits_are_scikit_learns_without_importing_it() -> None:
    """arrays.digits() reads scikit-learn's file itself (importing scikit-learn took ~2 s of a rank's start)."""
    code = ("import sys, numpy as np\nfrom hvdtrain.formats import arrays\nimages, target = arrays._digits_file()\n"
            "print('sklearn' in sys.modules)\nfrom sklearn.datasets import load_digits\nb = load_digits()\n"
            "print(np.array_equal(images, b.images) and images.dtype == b.images.dtype, "
            "np.array_equal(target, b.target) and target.dtype == b.target.dtype, images.shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    assert out == ["False", "True True (1797, 8, 8)"]
