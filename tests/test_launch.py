"""`hvdtrain run/validate/schema`: the output router (in-process), the CLI (dry-runs of the shipped jobs pinned,
exit code 2 on bad input), and real 2-rank jobs with Gloo and MPI: argv safety, env, logs, a failing rank's exit
code, and SIGTERM/SIGINT forwarding that leaves no rank behind."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hvdtrain.failures import RankFailure
from hvdtrain.jobspec import Logs
from hvdtrain.plan import MPI_REMOTE_ENV
from tests.harness import BIN, REPO, expect_ok, route, run_bounded

HVDTRAIN = str(BIN / "hvdtrain")
HOROVODRUN = str(BIN / "horovodrun")
PY = sys.executable
RECIPE = str(REPO / "recipes" / "pytorch_train.py")
ELASTIC_RECIPE = str(REPO / "recipes" / "pytorch_elastic.py")
CONTROLLERS = ["gloo", "mpi"]

ECHO_ARGV = """
import json, os, sys, time
import horovod.torch as hvd
hvd.init()
time.sleep(0.2 * hvd.rank())  # mpirun's output forwarding can splice lines written at the same instant
print("ARGV " + json.dumps({"rank": hvd.rank(), "argv": sys.argv[1:], "env": os.environ.get("HVDTRAIN_TEST")}),
      flush=True)
time.sleep(0.5)
print(f"rank {hvd.rank()} says hi on stderr", file=sys.stderr, flush=True)
"""

WAIT_FOR_SIGNAL = """
import os, sys, time
import horovod.torch as hvd
hvd.init()
ready = os.path.join(sys.argv[1], f"ready.{hvd.rank()}")
with open(ready + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(ready + ".tmp", ready)
time.sleep(300)
"""

# Starts `hvdtrain run JOB`, waits for both ranks to write their pid, sends SIGNAL to hvdtrain, and reports its
# exit code, how long it took, and which rank pids are still alive (then kills those, so nothing leaks).
SIGNALLER = """
import json, os, subprocess, sys, time
import psutil
hvdtrain, job, signum, piddir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open(os.path.join(piddir, "out.txt"), "w") as out:
    proc = subprocess.Popen([hvdtrain, "run", job], stdout=out, stderr=subprocess.STDOUT)
pids, deadline = {}, time.monotonic() + 120
while len(pids) < 2 and proc.poll() is None and time.monotonic() < deadline:
    for r in (0, 1):
        path = os.path.join(piddir, f"ready.{r}")
        if os.path.exists(path):
            pids[r] = int(open(path).read())
    time.sleep(0.2)
t0 = time.monotonic()
proc.send_signal(signum)
try:
    code = proc.wait(timeout=60)
except subprocess.TimeoutExpired:
    proc.kill()
    code = "hung"
elapsed = time.monotonic() - t0
def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
left = [p for p in pids.values() if alive(p)]
for p in left:
    psutil.Process(p).kill()
print("REPORT " + json.dumps({"code": code, "elapsed": elapsed, "ranks": len(pids), "alive": left}))
"""


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
    return [str(a) for a in yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text()).get("args") or []]


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
    env = {"two_hosts.yaml": ["NCCL_DEBUG=WARN", *keepalive, "OMP_NUM_THREADS=4"],
           "quickstart.yaml": ["TF_CPP_MIN_LOG_LEVEL=2"]}
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

def write_job(tmp_path: Path, script: str, **keys: object) -> Path:
    (tmp_path / "job.py").write_text(script)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"script": "job.py", "np": 2, **keys}))
    return job


@pytest.mark.slow
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_real_job_passes_hostile_args_literally_forwards_env_and_writes_rank_logs(controller, tmp_path):
    marker = tmp_path / "PWNED"
    hostile = [f"$(touch {marker})", f"`touch {marker}`", f"; touch {marker}", "a b", "'", '"', "*"]
    job = write_job(tmp_path, ECHO_ARGV, controller=controller, args=hostile,
                    env={"HVDTRAIN_TEST": f"$(touch {marker}) x"}, logs={"dir": "logs", "console_ranks": [0]})
    res = expect_ok(run_bounded([HVDTRAIN, "run", str(job)], timeout=180, cwd=tmp_path))
    assert not marker.exists(), "a spec value reached a shell"
    seen = [json.loads(line.split("ARGV ", 1)[1]) for line in res.output.splitlines() if "]<stdout>:ARGV " in line]
    assert seen == [{"rank": 0, "argv": hostile, "env": f"$(touch {marker}) x"}], res.describe()  # rank 0 only
    assert "[0]<stderr>:rank 0 says hi on stderr" in res.output
    assert "[1,0]" not in res.output  # MPI's tag is normalised
    rank1 = (tmp_path / "logs" / "rank.1.log").read_text()
    assert json.loads(rank1.split("ARGV ", 1)[1].splitlines()[0])["argv"] == hostile
    assert "rank 1 says hi on stderr" in rank1


@pytest.mark.slow
@pytest.mark.parametrize("controller", CONTROLLERS)
def test_exit_code_is_the_failing_ranks(controller, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"script": str(REPO / "tests" / "scripts" / "fail_rank.py"), "np": 2,
                                   "controller": controller}))
    res = run_bounded([HVDTRAIN, "run", str(job)], timeout=180)
    assert res.returncode == 3, res.describe()
    assert "rank 1 is failing on purpose" in res.output
    assert "hvdtrain: rank 1 on host localhost exited with code 3 (the first rank to fail)" in res.output


@pytest.mark.slow
@pytest.mark.parametrize(("controller", "signum"), [("gloo", signal.SIGTERM), ("mpi", signal.SIGINT)])
def test_signal_stops_the_whole_job(controller, signum, tmp_path):
    job = write_job(tmp_path, WAIT_FOR_SIGNAL, controller=controller, args=[str(tmp_path)])
    (tmp_path / "signaller.py").write_text(SIGNALLER)
    res = run_bounded([PY, str(tmp_path / "signaller.py"), HVDTRAIN, str(job), str(int(signum)), str(tmp_path)],
                      timeout=240)
    report = json.loads(res.output.split("REPORT ", 1)[1])
    log = (tmp_path / "out.txt").read_text()
    assert report["ranks"] == 2, f"ranks never became ready\n{log}"
    assert report["alive"] == [], f"ranks outlived hvdtrain\n{log}"
    assert report["code"] == 128 + signum, log
    assert report["elapsed"] < 30, log


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
