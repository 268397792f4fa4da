"""Rank records (hvdtrain.records, hvdtrain.rank_main): what a script sees when started through them, the records
written and read back, and real jobs (Gloo, MPI) whose failing rank is named from its record, or from horovodrun's
lines when it left none."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from hvdtrain import records
from hvdtrain.records import RankRecord
from tests.support.harness import BIN, REPO, run_bounded

SCRIPTS = REPO / "tests" / "scripts"
JOB_TIMEOUT_S = 180


def _facts(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **env},
                          stdin=subprocess.DEVNULL, check=False)


def test_a_script_sees_what_python_script_would_give_it(tmp_path):
    script = str(SCRIPTS / "main_facts.py")
    direct = _facts([sys.executable, script, "a", "1:30"])
    wrapped = _facts([sys.executable, "-m", "hvdtrain.rank_main", script, "a", "1:30"], HVDTRAIN_RECORDS=str(tmp_path))
    assert direct.returncode == wrapped.returncode == 0, wrapped.stderr
    assert wrapped.stdout == direct.stdout and wrapped.stderr == direct.stderr == ""
    lines = direct.stdout.splitlines()  # the facts, then the atexit line
    assert len(lines) == 2, direct.stdout
    facts = json.loads(lines[0])
    assert facts["spawned"] == [9] and facts["path0"] == str(SCRIPTS)
    assert lines[-1].startswith("atexit pickled ")  # __main__ is still the script's module at exit
    assert list(tmp_path.iterdir()) == []  # a rank that ends well notes nothing


def test_a_script_that_cannot_be_opened_exits_2_with_pythons_message(tmp_path):
    missing = tmp_path / "nope.py"
    direct = _facts([sys.executable, str(missing)])
    wrapped = _facts([sys.executable, "-m", "hvdtrain.rank_main", str(missing)])
    assert direct.returncode == wrapped.returncode == 2
    assert wrapped.stderr.split(":", 1)[1] == direct.stderr.split(":", 1)[1]  # after the interpreter's name


def test_an_exception_is_printed_as_python_would_and_noted_for_the_record(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("def f():\n    raise ValueError('bad sample 17')\nf()\n")
    direct = _facts([sys.executable, str(script)])
    wrapped = _facts([sys.executable, "-m", "hvdtrain.rank_main", str(script)], HVDTRAIN_RECORDS=str(tmp_path))
    assert direct.returncode == wrapped.returncode == 1
    assert wrapped.stderr == direct.stderr  # no frame of hvdtrain's or runpy's in the traceback
    (noted,) = tmp_path.glob("exception.*.json")
    data = json.loads(noted.read_text())
    assert (data["exception"], data["message"]) == ("ValueError", "bad sample 17")
    assert "line 2, in f" in data["traceback"]


def test_keyboard_interrupt_and_exit_codes_keep_pythons_handling():
    script = str(SCRIPTS / "main_facts.py")
    direct = _facts([sys.executable, script, "interrupt"])
    wrapped = _facts([sys.executable, "-m", "hvdtrain.rank_main", script, "interrupt"])
    assert direct.returncode == wrapped.returncode == -signal.SIGINT  # Python dies by SIGINT on Ctrl-C
    code = _facts([sys.executable, "-m", "hvdtrain.rank_main", "-c"]).returncode  # no such file: as python -c
    assert code != 0
    assert _facts([sys.executable, "-m", "hvdtrain.rank_main"]).returncode == 2


def test_identity_from_horovodrun_and_mpirun_environments():
    assert records.identity({"HOROVOD_RANK": "3", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_HOSTNAME": "h2"}) == (3, 1, "h2")
    rank, local, host = records.identity({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "0"})
    assert (rank, local) == (5, 0) and host


def test_the_supervisors_record_merges_the_noted_exception_and_is_read_back(tmp_path):
    env = {"HOROVOD_RANK": "1", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_HOSTNAME": "h1"}
    (tmp_path / "exception.h1.1.42.json").write_text(json.dumps({"exception": "KeyError", "message": "'x'",
                                                            "traceback": "Traceback ..."}))
    records.write_record(tmp_path, 42, 1, env)
    records.write_record(tmp_path, 43, -9, {**env, "HOROVOD_RANK": "0", "HOROVOD_LOCAL_RANK": "0"})
    got = records.read_records(tmp_path)
    assert [(r.rank, r.code, r.signum, r.exception, r.message) for r in got] == [
        (1, 1, None, "KeyError", "'x'"), (0, None, 9, None, None)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank.h1.0.43.json", "rank.h1.1.42.json"]
    assert got[0].failed and RankRecord(0, 0, "h", 1, code=0).failed is False


def test_a_rank_killed_while_exiting_with_a_code_keeps_that_code(tmp_path):
    env = {"HOROVOD_RANK": "1", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_HOSTNAME": "h1"}
    records.write_record(tmp_path, 42, 3, env, final=False)  # the rank's own, as sys.exit(3) runs
    records.write_record(tmp_path, 42, -signal.SIGTERM, env)  # the supervisor's: the teardown then stopped it
    records.write_record(tmp_path, 43, -signal.SIGTERM, {**env, "HOROVOD_RANK": "0", "HOROVOD_LOCAL_RANK": "0"})
    got = {r.rank: r for r in records.read_records(tmp_path)}
    assert (got[1].code, got[1].signum) == (3, None)
    assert (got[0].code, got[0].signum) == (None, signal.SIGTERM)  # no provisional record: the signal stands


def test_records_go_only_where_the_directory_is(tmp_path):
    missing = tmp_path / "not-here"
    assert records.directory({records.ENV: str(missing)}) is None  # not shared with this host: nothing is made
    assert not missing.exists()
    assert records.directory({records.ENV: str(tmp_path)}) == tmp_path
    assert records.directory({}) is None


def _run_job(tmp_path: Path, controller: str, mode: str, logs: bool):
    """The launcher's temporary directory is this test's own (TMPDIR): another hvdtrain job on the machine, or a
    test running beside this one, may have a records directory in /tmp at any moment."""
    spec = {"script": str(SCRIPTS / "raise_on_rank.py"), "args": [mode], "np": 2, "controller": controller,
            **({"logs": {"dir": str(tmp_path / "logs")}} if logs else {})}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    return run_bounded([str(BIN / "hvdtrain"), "run", str(job)], timeout=JOB_TIMEOUT_S,
                       env={"TMPDIR": str(_private_tmp(tmp_path))})


def _private_tmp(tmp_path: Path) -> Path:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return tmp_path / "tmp"


def _temp_records(tmp_path: Path) -> set[str]:
    return {p.name for p in _private_tmp(tmp_path).glob("hvdtrain-records-*")}


@pytest.mark.slow
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_rank_that_raises_is_named_with_its_exception_from_its_record(controller, tmp_path):
    before = _temp_records(tmp_path)
    res = _run_job(tmp_path, controller, "raise", logs=True)
    assert res.returncode == 1, res.describe()
    assert ("hvdtrain: rank 1 on host localhost raised ValueError: bad sample 17 in shard 3 and exited with code 1"
            in res.output), res.describe()
    found = {r.rank: r for r in records.read_records(tmp_path / "logs" / "records")}
    assert found[1].exception == "ValueError" and found[1].code == 1, found
    assert "raise ValueError" in found[1].traceback and found[1].pid > 0 and found[1].time > 0
    assert found[0].failed  # the victim: Horovod shut down under it (or it was stopped)
    assert _temp_records(tmp_path) == before == set()  # with logs.dir no temporary directory is made


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit3", "exit3-slow"])
def test_exit_codes_come_from_the_record_and_the_temporary_directory_is_removed(mode, tmp_path):
    before = _temp_records(tmp_path)
    res = _run_job(tmp_path, "gloo", mode, logs=False)
    assert res.returncode == 3, res.describe()
    # rank 1 may still be shutting down when the teardown stops it (always, with exit3-slow): its own provisional
    # record said it was ending with 3, which its supervisor's record keeps
    assert re.search(r"hvdtrain: rank 1 on host localhost exited with code 3 \((the first rank to fail|the cause)",
                     res.output), res.describe()
    assert _temp_records(tmp_path) == before == set()  # its own was removed


@pytest.mark.slow
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_rank_that_left_no_record_is_named_from_the_launchers_lines(controller, tmp_path):
    res = _run_job(tmp_path, controller, "orphan", logs=True)
    assert res.returncode != 0, res.describe()
    # The host as the spec names it (Gloo) or as mpirun names it (this machine's hostname).
    assert re.search(r"hvdtrain: rank 1 on host \S+ was killed by SIGKILL \(the first rank to fail\)", res.output), \
        res.describe()
    assert 1 not in {r.rank for r in records.read_records(tmp_path / "logs" / "records")}


def test_a_rank_ending_with_sys_exit_leaves_a_provisional_record_the_supervisor_then_replaces(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text("import sys\nsys.exit(3)\n")
    env = {records.ENV: str(tmp_path), "HOROVOD_RANK": "1", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_HOSTNAME": "h1"}
    child = _facts([sys.executable, "-m", "hvdtrain.rank_main", str(script)], **env)
    assert child.returncode == 3
    (provisional,) = records.read_records(tmp_path)  # what is left if the teardown killed rank and supervisor
    assert (provisional.rank, provisional.code, provisional.exception, provisional.message) == (1, 3, "SystemExit", "3")
    supervised = _facts([sys.executable, "-m", "hvdtrain.rank", str(script)], **env)
    assert supervised.returncode == 3
    final = [r for r in records.read_records(tmp_path) if r.pid != provisional.pid]
    assert [(r.rank, r.code, r.exception) for r in final] == [(1, 3, "SystemExit")]
    # the supervisor merged its rank's note and removed it; the unsupervised run's note stays
    assert [p.name for p in tmp_path.glob("exception.*.json")] == [f"exception.h1.1.{provisional.pid}.json"]


def test_a_temporary_records_directory_is_locked_while_used_and_a_stale_one_is_removed(tmp_path, monkeypatch):
    import fcntl

    from hvdtrain.launch import runner

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale, live = tmp_path / f"{runner.RECORDS_TMP}stale", tmp_path / f"{runner.RECORDS_TMP}live"
    for d in (stale, live):
        d.mkdir()
        (d / ".lock").touch()
    (tmp_path / f"{runner.RECORDS_TMP}starting").mkdir()  # a launcher between mkdtemp and its lock
    with open(live / ".lock", "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running launcher (in any pid namespace) holds it
        with runner._records_dir(None) as where:
            assert where.is_dir() and not stale.exists() and live.is_dir()
            assert (tmp_path / f"{runner.RECORDS_TMP}starting").is_dir()
            with open(where / ".lock", "rb") as f, pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this launcher's own, held for the job
        assert not where.exists()
