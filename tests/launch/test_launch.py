"""`hvdtrain run/validate/schema`: the output router (in-process), the CLI (dry-runs of the shipped jobs pinned,
exit code 2 on bad input), and real 2-rank jobs with Gloo and MPI: argv safety, env, logs, a failing rank's exit
code, and SIGTERM/SIGINT forwarding that leaves no rank behind."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hvdtrain.job.model import Logs
from hvdtrain.job.plan import MPI_REMOTE_ENV
from hvdtrain.launch.failures import RankFailure
from tests.support.harness import BIN, REPO, expect_ok, route, run_bounded

HVDTRAIN = str(BIN / "hvdtrain")
HOROVODRUN = str(BIN / "hvdtrain-horovodrun")  # horovodrun without its build probe: hvdtrain.launch.hvdrun
PY = sys.executable
RECIPE = str(REPO / "recipes" / "pytorch_train.py")
ELASTIC_RECIPE = str(REPO / "recipes" / "pytorch_elastic.py")
CONTROLLERS = ["gloo", "mpi"]

SCRIPTS = REPO / "tests" / "scripts"
ECHO_ARGV = SCRIPTS / "echo_argv.py"  # each rank: its argv and env on stdout, a line on stderr
WAIT_FOR_SIGNAL = SCRIPTS / "wait_for_signal.py"  # each rank: writes its pid, then sleeps until stopped
# Starts `hvdtrain run JOB`, waits for both ranks to write their pid, sends SIGNAL to hvdtrain, and reports its
# exit code, how long it took, and which rank pids are still alive (then kills those, so nothing leaks).
SIGNALLER = SCRIPTS / "signaller.py"


# ---------------------------------------------------------------- output router (in-process)

def test_router_normalises_prefixes_filters_console_and_writes_rank_logs(tmp_path):
    lines = ["[0]<stdout>:gloo zero", "[1,1]<stdout>:mpi one", "[1,1]<stderr>:oops[1,1]<stderr>:",
             "launcher says hi", "Process name: [[1,1],1]", "  Exit code:    3", "Exit code: 9"]
    (tmp_path / "logs").mkdir()
    router, out, err = route(lines, Logs(dir=str(tmp_path / "logs"), console_ranks=[0]))
    assert out == "[0]<stdout>:gloo zero\nlauncher says hi\nProcess name: [[1,1],1]\n  Exit code:    3\nExit code: 9\n"
    assert err == ""  # rank 1 is not echoed
    assert (tmp_path / "logs" / "rank.0.log").read_text() == "gloo zero\n"
    assert (tmp_path / "logs" / "rank.1.log").read_text() == "mpi one\noops\n"
    assert "launcher says hi" in (tmp_path / "logs" / "launcher.log").read_text()
    assert router.failures.first == RankFailure(1, code=3)  # the first report wins


def test_router_removes_mpirun_tags_inside_a_line_and_finds_the_exception():
    # What mpirun printed in a real run when rank 1's traceback reached it in several chunks: the tags inside the
    # line hid the exception, and hvdtrain named the victim rank 0 instead of rank 1.
    lines = ["[1]<stderr>:RuntimeError[1,1]<stderr>:: [1,1]<stderr>:rank 1 is failing on purpose",
             "[0]<stderr>:horovod.common.exceptions.HorovodInternalError: Horovod has been shut down.",
             "Process name: [[10821,1],0]", "  Exit code:    1"]
    router, _, err = route(lines, Logs())
    assert "[1]<stderr>:RuntimeError: rank 1 is failing on purpose\n" in err
    assert router.failures.cause == (1, "RuntimeError: rank 1 is failing on purpose")
    assert router.failures.report(None)[0] == ("hvdtrain: rank 1 raised RuntimeError: rank 1 is failing on purpose "
                                               "(the cause); rank 0 exited with code 1 first, after Horovod shut down")


def test_router_echoes_every_rank_by_default_stderr_to_stderr_with_optional_timestamps():
    _, out, err = route(["[1]<stderr>:bad", "[0]<stdout>:good"], Logs(timestamp=True))
    assert out.endswith(" [0]<stdout>:good\n") and out[:4].isdigit()
    assert err.endswith(" [1]<stderr>:bad\n")


# ---------------------------------------------------------------- CLI

@pytest.fixture(scope="session")
def cache_env(tmp_path_factory) -> dict[str, str]:
    return {"HVDTRAIN_CACHE_DIR": str(tmp_path_factory.mktemp("hvdtrain-cache"))}


def quickstart_args() -> list[str]:
    return ["--dataset", "digits", "--epochs", "8", "--warmup-epochs", "1", "--lr-milestones", "5", "--run-dir",
            "runs/quickstart"]  # jobs/quickstart.yaml's recipe: settings, as the recipe's flags


PINNED_DRY_RUNS = {
    "quickstart.yaml": lambda: [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", PY, "-m", "hvdtrain.rank",
                                RECIPE, *quickstart_args()],
    "two_hosts.yaml": lambda: [
        HOROVODRUN, "-np", "8", "-H", "server1:4,server2:4", "--mpi", "--network-interfaces", "eth0",
        "--ssh-port", "2222", "--fusion-threshold-mb", "64", "--cycle-time-ms", "2.5",
        "--stall-check-warning-time-seconds", "120", "--log-level", "WARNING", PY, "-m", "hvdtrain.rank", RECIPE,
        "--dataset", "synthetic", "--model", "resnet", "--epochs", "3"],
    "elastic.yaml": lambda: [
        HOROVODRUN, "-np", "2", "--gloo", "--network-interfaces", "lo", "--host-discovery-script",
        str(REPO / "jobs" / "discover_hosts.sh"), "--min-np", "1", "--max-np", "4", "--reset-limit", "10",
        "--elastic-timeout", "120", "--blacklist-cooldown-range", "10", "60", PY, "-m", "hvdtrain.rank", ELASTIC_RECIPE,
        "--dataset", "digits", "--epochs", "8", "--warmup-epochs", "1", "--lr-milestones", "5", "--threads", "1",
        "--run-dir", "runs/elastic"],
}


@pytest.mark.parametrize("job", sorted(PINNED_DRY_RUNS))
def test_shipped_jobs_validate_and_dry_run_to_the_pinned_argv(job, cache_env):
    path = str(REPO / "jobs" / job)
    assert expect_ok(run_bounded([HVDTRAIN, "validate", path], timeout=60)).output.startswith(f"{path}: OK")
    out = expect_ok(run_bounded([HVDTRAIN, "run", path, "--dry-run"], timeout=180, env=cache_env)).output
    lines = out.splitlines()
    assert lines[0] == "# command"
    assert shlex.split(lines[1]) == PINNED_DRY_RUNS[job]()
    assert lines[2] == "# environment added (forwarded to every rank)"
    keepalive = sorted(f"{k}={v}" for k, v in MPI_REMOTE_ENV.items())  # two_hosts.yaml: MPI across hosts
    env = {"two_hosts.yaml": ["NCCL_DEBUG=WARN", *keepalive, "OMP_NUM_THREADS=4"]}
    assert lines[3:] == env.get(job, ["(none)"])


def test_invalid_spec_exits_2_with_the_message_and_no_traceback(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("script: t.py\nnp: 2\nhosts: 'a;touch /tmp/x:2'\n")
    for cmd in ("validate", "run"):
        res = run_bounded([HVDTRAIN, cmd, str(job), "--dry-run"][: 3 + (cmd == "run")], timeout=60)
        assert res.returncode == 2, res.describe()
        assert f"{job}:3: hosts: hosts entry 1: 'a;touch /tmp/x:2'" in res.output
        assert "Traceback" not in res.output
    res = run_bounded([HVDTRAIN, "validate", str(job), "-o", "hosts=null", "-o", "np=zero"], timeout=60)
    assert res.returncode == 2 and "override -o np=zero: np: Input should be a valid integer" in res.output


def test_schema_prints_the_json_schema():
    schema = json.loads(expect_ok(run_bounded([HVDTRAIN, "schema"], timeout=60)).output)
    assert schema["title"] == "JobSpec" and schema["additionalProperties"] is False


# ---------------------------------------------------------------- real 2-rank jobs

def write_job(tmp_path: Path, script: Path, **keys: object) -> Path:
    """tmp_path/job.yaml: a 2-rank job of `script` with the given spec keys."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"script": str(script), "np": 2, **keys}))
    return job


def echoed(console: list[str]) -> list[tuple[int, dict]]:
    """(rank tag, payload) of every `[rank]<stdout>:ARGV {json}` console line echo_argv.py's ranks printed."""
    found = []
    for line in console:
        if m := re.fullmatch(r"\[(\d+)\]<stdout>:ARGV (.*)", line):
            found.append((int(m.group(1)), json.loads(m.group(2))))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_real_job_passes_hostile_args_literally_forwards_env_and_writes_rank_logs(controller, tmp_path):
    marker = tmp_path / "PWNED"
    hostile = [f"$(touch {marker})", f"`touch {marker}`", f"; touch {marker}", "a b", "'", '"', "*"]
    (tmp_path / "work_dir").mkdir()  # workdir: relative to the spec file, whatever folder hvdtrain starts in
    job = write_job(tmp_path, ECHO_ARGV, controller=controller, args=hostile, workdir="work_dir",
                    env={"HVDTRAIN_TEST": f"$(touch {marker}) x"}, logs={"dir": "logs", "console_ranks": [0]})
    res = expect_ok(run_bounded([HVDTRAIN, "run", str(job)], timeout=180, cwd="/"))
    assert not marker.exists(), "a spec value reached a shell"
    given = {"argv": hostile, "env": f"$(touch {marker}) x", "cwd": str(tmp_path / "work_dir")}
    # Whole lines, in any order: the ranks write at the same time (each line in one write, which mpirun keeps whole).
    console = res.output.splitlines()
    assert echoed(console) == [(0, {"rank": 0, **given})], res.describe()  # rank 0 only
    assert "[0]<stderr>:rank 0 says hi on stderr" in console, res.describe()
    assert "[1,0]" not in res.output  # MPI's tag is normalised
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank.{rank}.log").read_text().splitlines()
        assert [json.loads(line[len("ARGV "):]) for line in log if line.startswith("ARGV ")] == [
            {"rank": rank, **given}], log
        assert f"rank {rank} says hi on stderr" in log, log


@pytest.mark.slow
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_exit_code_is_the_failing_ranks(controller, tmp_path):
    job = write_job(tmp_path, SCRIPTS / "fail_rank.py", controller=controller)
    res = run_bounded([HVDTRAIN, "run", str(job)], timeout=180)
    assert res.returncode == 3, res.describe()
    assert "rank 1 is failing on purpose" in res.output
    assert "hvdtrain: rank 1 on host localhost exited with code 3 (the first rank to fail)" in res.output


def test_hosts_horovodrun_cannot_reach_are_said_with_the_check_to_run(tmp_path):
    """horovodrun's ssh check fails before any rank starts: its lines name each host, its traceback is left out, and
    hvdtrain says what to check, naming every host of -H (tests/cluster/test_slurm_nodes.py: the same inside a two-node
    Slurm allocation). 127.0.0.2 and .3 are not this machine's addresses to horovodrun, so it checks them with ssh;
    nothing listens on port 1: refused at once, no name to resolve. Without the cache (--disable-cache): horovodrun
    skips the check for hosts that passed it in the last hour."""
    if shutil.which("ssh") is None:
        pytest.skip("ssh is not installed (scripts/setup.sh installs openssh-client)")
    job = write_job(tmp_path, SCRIPTS / "fail_rank.py", hosts="127.0.0.2:1,127.0.0.3:2", ssh={"port": 1},
                    extra_args=["--disable-cache"])
    res = run_bounded([HVDTRAIN, "run", str(job)], timeout=120)
    assert res.returncode == 1, res.describe()
    for host in ("127.0.0.2", "127.0.0.3"):
        assert f"ssh not successful for host {host}:\nssh: connect to host {host} port 1: Connection refused" \
            in res.output, res.describe()
    assert "Traceback" not in res.output and "RuntimeError" not in res.output, res.describe()
    assert "hvdtrain: horovodrun could not reach every host over ssh (`ssh not successful for host ...` above names " \
        "each, with ssh's error), so no rank started. Check the hosts with `hvdtrain doctor --hosts " \
        "127.0.0.2:1,127.0.0.3:2 --ssh-port 1`: " in res.output, res.describe()


@pytest.mark.slow
@pytest.mark.parametrize(("controller", "signum"), [("gloo", signal.SIGTERM), ("mpi", signal.SIGINT),
                                                    ("mpi", signal.SIGTERM)])
def test_signal_stops_the_whole_job(controller, signum, tmp_path):
    """Every rank ends, and mpirun removes the ranks' shared memory (it did not when hvdtrain's sweep signalled it
    a second time while it stopped them: NOTE [job shutdown])."""
    job = write_job(tmp_path, WAIT_FOR_SIGNAL, controller=controller, args=[str(tmp_path)])
    res = run_bounded([PY, str(SIGNALLER), HVDTRAIN, str(job), str(int(signum)), str(tmp_path)],
                      timeout=240)
    report = json.loads(res.output.split("REPORT ", 1)[1])
    log = (tmp_path / "out.txt").read_text()
    assert report["ranks"] == 2, f"ranks never became ready\n{log}"
    assert report["alive"] == [], f"ranks outlived hvdtrain\n{log}"
    assert report["code"] == 128 + signum, log
    assert report["elapsed"] < 30, log
    assert report["shm_left"] == [], log


def test_run_refuses_an_interpreter_without_hvdtrain_before_starting_anything(tmp_path):
    bare = tmp_path / "bare-venv"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=120)
    job = tmp_path / "job.yaml"
    job.write_text(f"script: t.py\nnp: 2\ncontroller: gloo\npython: {bare}/bin/python\n")
    (tmp_path / "t.py").write_text("print('never')\n")
    res = run_bounded([HVDTRAIN, "run", str(job)], timeout=60, cwd=tmp_path)  # not the checkout: it is on sys.path
    assert res.returncode == 2, res.describe()
    assert f"hvdtrain: error: {bare}/bin/python cannot import hvdtrain.rank, which starts every rank" in res.output
    assert "install hvdtrain into that interpreter" in res.output
    assert "hvdtrain: starting" not in res.output and "Traceback" not in res.output
