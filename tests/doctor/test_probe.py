"""hvdtrain.doctor.probe against this venv's real Horovod build: the modes, the cache and its invalidation, failures as
data, and `run --dry-run` writing nothing."""

from __future__ import annotations

import json
import os
import platform
import sys

import pytest

from hvdtrain.doctor import probe
from hvdtrain.doctor.probe import Facts
from tests.support.harness import BIN, REPO, run_bounded


def test_versions_mode_reads_metadata_only_and_first_mode_reports_the_controllers():
    quick = probe.run(sys.executable, "versions")
    assert quick.python == platform.python_version() and quick.executable == sys.executable
    assert quick.horovod == "0.28.1" and quick.torch and quick.built == {} and quick.errors == {}
    full = probe.run(sys.executable, "first")
    assert list(full.built) == ["torch"], full  # the first framework that loads, and only that one
    assert full.controllers()["gloo"] and full.controllers()["mpi"] and not full.controllers()["nccl"]
    assert os.path.isfile(full.extensions["torch"])


def test_a_probe_that_cannot_run_or_answer_is_data(tmp_path):
    assert "cannot run" in probe.run(str(tmp_path / "no-python"), "first").errors["horovod"]
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\necho oops >&2\nexit 3\n")
    silent.chmod(0o755)
    facts = probe.run(str(silent), "first")
    assert facts.errors == {"horovod": "the probe failed (exit 3): oops"} and facts.controllers() == {}


def test_parse_takes_the_last_marked_line_and_ignores_what_a_login_shell_prints():
    line = probe.MARKER + json.dumps({"python": "3.11.9", "horovod": "0.28.1", "unknown_key": 1})
    assert probe.parse(f"Welcome!\n{probe.MARKER}{{}}\n{line}\n") == Facts(python="3.11.9", horovod="0.28.1")
    assert probe.parse("no marker\n") is None
    assert probe.parse(f"{probe.MARKER}{{not json\n") is None


@pytest.mark.slow
def test_the_build_is_cached_until_the_extension_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    real_run = probe.run
    monkeypatch.setattr(probe, "run", lambda python, mode: calls.append(mode) or real_run(python, mode))
    assert probe.horovod_build(sys.executable, save=False).controllers()["gloo"]
    assert not (tmp_path / "cache").exists()  # save=False writes nothing
    first = probe.horovod_build(sys.executable)
    assert probe.horovod_build(sys.executable) == first and calls == ["first", "first"]  # the third from the cache
    entry = json.loads((tmp_path / "cache" / "horovod-build.json").read_text())[sys.executable]
    entry["stamp"][0] -= 1  # as if Horovod had been rebuilt since
    (tmp_path / "cache" / "horovod-build.json").write_text(json.dumps({sys.executable: entry}))
    assert probe.horovod_build(sys.executable) == first and calls == ["first", "first", "first"]


@pytest.mark.parametrize("job", ["quickstart.yaml", "elastic.yaml"])
def test_a_dry_run_writes_nothing(job, tmp_path):
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    env = {**os.environ, "HVDTRAIN_CACHE_DIR": str(cache)}
    res = run_bounded([str(BIN / "hvdtrain"), "run", str(REPO / "jobs" / job), "--dry-run", "-o", f"logs.dir={logs}"],
                      timeout=120, env=env)
    assert res.returncode == 0, res.describe()
    assert "# command" in res.output and not cache.exists() and not logs.exists()


def test_run_plan_refuses_to_run_off_the_main_thread(tmp_path):
    import threading

    from hvdtrain.job.model import Logs
    from hvdtrain.job.plan import LaunchPlan
    from hvdtrain.launch.preflight import LaunchError
    from hvdtrain.launch.runner import run_plan

    raised: list[BaseException] = []

    def call() -> None:
        try:
            run_plan(LaunchPlan(argv=["true"]), Logs(dir=str(tmp_path / "logs")))
        except LaunchError as exc:
            raised.append(exc)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join(timeout=30)
    assert [str(e) for e in raised] == ["run_plan must be called from the main thread"]
    assert not (tmp_path / "logs").exists()  # refused before it did anything
