"""hvdtrain on a real Slurm cluster (the private one-node cluster of tests/support/slurm.py: real munged, slurmctld and
slurmd), with real horovodrun jobs: issue 34's Slurm-aware `hvdtrain run` and the sbatch script of
`hvdtrain render slurm` (tests/job/test_slurm_env.py and tests/render/test_render.py test the same code from strings).

- A rendered script submitted with sbatch runs `hvdtrain run` on the spec inside the allocation: the hosts come
  from Slurm, the ranks' output, logs and records are hvdtrain's, and the job's exit code is the failing rank's
  own, under Gloo and under MPI (Open MPI's mpirun inside the allocation picks its Slurm components, plm/slurm and
  ras/slurm, by itself: on one node every rank is local, so no orted is started through srun). The shipped
  quickstart spec trains one epoch that way.
- scancel of a running rendered job leaves no process of it and no /dev/shm segment of its data loaders (an MPI
  job's Open MPI segments can stay: a known limitation, see the test).
- `hvdtrain run` in an salloc shell uses the allocation; started once per task by `srun -n2` it refuses before
  anything starts; an np larger than the allocation is an exit-2 error naming it.
- `--launcher srun` (`hvdtrain render slurm --launcher srun`, `hvdtrain run --launcher srun`): Slurm starts every
  rank as a task of one srun step (`--mpi=pmix`), under hvdtrain's supervisor; sbatch of the rendered script runs
  to the end with srun's labels turned into rank prefixes; a failing rank's own exit code is the job's (not srun's);
  scancel leaves no process or segment; SIGTERM to hvdtrain in an salloc shell stops every rank through one SIGINT
  (a KeyboardInterrupt the rank handles) and exits 143; each rank gets that SIGINT once, from Slurm.

The node is this machine (its short hostname, 127.0.0.1), so horovodrun runs every rank locally, without ssh.
Seen, not tested here: because mpirun takes the allocation from ras/slurm, a spec that keeps hosts of its own
inside an allocation must name Slurm's nodes (or localhost) under MPI: `hosts: 127.0.0.1:2` there fails with
"All nodes which are allocated for this job are already filled" (OMPI_MCA_ras=^slurm lets it run).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hvdtrain.launch.runner import GRACE_S, SRUN_ABORT_S
from tests.support.harness import REPO, SHM_DIR, SHM_PREFIX, STARTED_SESSIONS, kill_group, run_bounded
from tests.support.slurm import JOB_TIMEOUT_S, SALLOC_TIMEOUT_S, STOP_S, SlurmCluster, granted_job, render, submit

pytestmark = pytest.mark.slow

SCRIPTS = REPO / "tests" / "scripts"
READY_S = 60  # from sbatch until both ranks run
# scancel -> every job process gone: slurmd SIGTERMs them all at once and SIGKILLs what is left after KillWait=5.
GONE_S = 15

# Each rank averages its rank with the others' and says so in one write (mpirun tags every chunk it forwards: a
# line written in pieces could come out spliced with another rank's).
ALLREDUCE = """\
import os
import horovod.torch as hvd
import torch

hvd.init()
mean = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Average, name="mean").item()
os.write(1, f"RANK {hvd.rank()} of {hvd.size()}: mean {mean}\\n".encode())
"""

# Each rank runs a data loader with a worker that keeps writing batches into shared memory, and writes its pid to
# DIR/ready.<rank> once it has the first batch; it never ends by itself.
LOADER_FOREVER = """\
import os
import sys

import horovod.torch as hvd
import numpy as np

from hvdtrain.data import ShmLoader


def batches(worker_id, num_workers, epoch, seed):
    while True:
        yield np.ones(1 << 16, np.float32)


hvd.init()
loader = ShmLoader.from_generator(batches, rank=hvd.rank(), size=hvd.size(), num_workers=1, prefetch=2, timeout=60)
ready = os.path.join(sys.argv[1], f"ready.{hvd.rank()}")
for i, _ in enumerate(loader):
    if i == 0:
        with open(ready + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(ready + ".tmp", ready)
"""


def write_spec(folder: Path, script: str | Path, *args: str, extra: str = "") -> Path:
    """job.yaml in `folder`: 2 ranks of `script` (a path, or the text of one written to folder/rank.py), no hosts."""
    if not isinstance(script, Path):
        (folder / "rank.py").write_text(textwrap.dedent(script))
        script = folder / "rank.py"
    spec = folder / "job.yaml"
    spec.write_text(f"script: {json.dumps(str(script))}\nnp: 2\nargs: {json.dumps(list(args))}\n"
                    "env: {TF_CPP_MIN_LOG_LEVEL: '2'}\n" + extra)
    return spec


def hosts_line(cluster: SlurmCluster, job: int) -> str:
    return (f"hosts from Slurm job {job}: {cluster.node}:2 (SLURM_JOB_NODELIST={cluster.node}, "
            "SLURM_TASKS_PER_NODE=2)")


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_rendered_sbatch_runs_the_job_on_the_allocation(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                        controller: str) -> None:
    spec = write_spec(tmp_path, ALLREDUCE, extra="logs: {dir: logs}\n")
    script = render(spec, f"controller={controller}")
    text = script.read_text()
    assert "#SBATCH --output=job-%j.out" in text.splitlines(), text
    assert f"exec {sys.executable} -m hvdtrain.cli run {spec} -o controller={controller}" in text, text

    job = submit(slurm_cluster, script)
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    # The script's own --output: NAME-%j.out in the folder sbatch ran in.
    assert result.fields["StdOut"] == str(tmp_path / f"job-{job}.out"), result.fields
    assert (result.state, result.exit_code, result.signal) == ("COMPLETED", 0, 0), result.output_text
    out = result.output_text
    assert f"hvdtrain: {hosts_line(slurm_cluster, job)}\n" in out, out
    assert f" -np 2 -H {slurm_cluster.node}:2 --{controller} " in out, out
    ranks = sorted(re.findall(r"^\[(\d)\]<stdout>:RANK (\d) of 2: mean 0\.5$", out, re.M))
    assert ranks == [("0", "0"), ("1", "1")], out
    # logs.dir (relative to the spec) got every rank's output too: what the old script, horovodrun alone, ignored.
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank.{rank}.log").read_text()
        assert f"RANK {rank} of 2: mean 0.5" in log, log


def test_rendered_quickstart_trains(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """jobs/quickstart.yaml as shipped (its recipe and the embedded digits dataset), 1 epoch, the run directory
    here: the sbatch job trains to the end, with the controller `hvdtrain run` would pick."""
    run_dir = tmp_path / "run"
    script = render(REPO / "jobs" / "quickstart.yaml",
                    f"recipe={{dataset: digits, epochs: 1, run_dir: '{run_dir}'}}", out=tmp_path / "q.sbatch")
    assert "#SBATCH --output=quickstart-%j.out" in script.read_text().splitlines()
    job = submit(slurm_cluster, script)
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    assert result.fields["StdOut"] == str(tmp_path / f"quickstart-{job}.out"), result.fields
    assert (result.state, result.exit_code, result.signal) == ("COMPLETED", 0, 0), result.output_text
    assert f"hvdtrain: {hosts_line(slurm_cluster, job)}\n" in result.output_text, result.output_text
    assert "[0]<stdout>:weights identical on all 2 ranks" in result.output_text, result.output_text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["epochs_completed"], summary["world_size"]) == (1, 2), summary
    assert summary["val_accuracy"] > 0.5, summary  # ~0.94 after one epoch; a broken allreduce would not train


def test_the_warning_signal_checkpoints_requeues_and_resumes_to_the_same_weights(slurm_cluster: SlurmCluster,
                                                                                   tmp_path: Path) -> None:
    """The signal Slurm sends before a job's time limit (`#SBATCH --signal=B:USR1@T` goes to the batch shell, which
    is `exec hvdtrain run`), sent here at a chosen moment with `scancel --signal=USR1 --batch` once epoch 1's
    checkpoint is written: the ranks checkpoint at a step boundary and exit 75, hvdtrain requeues the job
    (`--requeue`), Slurm runs it again (appending to its output), it resumes there and ends with the weights and
    history of the same training run in one go outside Slurm. Over 30 s: the job runs twice through Slurm (stopped and
    requeued, then resumed to the end)."""
    settings = "dataset: digits, epochs: 3, warmup_epochs: 1, batch_size: 4, tensorboard: false, progress: false"

    def override(run_dir: Path) -> str:
        return f"recipe={{{settings}, run_dir: '{run_dir}'}}"

    reference = run_bounded([sys.executable, "-m", "hvdtrain.cli", "run", str(REPO / "jobs" / "quickstart.yaml"),
                             "-o", override(tmp_path / "reference")], timeout=JOB_TIMEOUT_S, cwd=tmp_path)
    assert reference.returncode == 0, reference.describe()

    run_dir = tmp_path / "run"
    script = render(REPO / "jobs" / "quickstart.yaml", override(run_dir), out=tmp_path / "q.sbatch")
    text = script.read_text().splitlines()
    assert {"#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"} <= set(text), text
    job = submit(slurm_cluster, script)
    deadline = time.monotonic() + READY_S
    while not (run_dir / "checkpoints" / "ckpt-epoch0001.pt").exists():
        assert time.monotonic() < deadline, slurm_cluster.job_fields(job)
        time.sleep(0.05)
    slurm_cluster.scancel(job, "--signal=USR1", "--batch")
    result = slurm_cluster.wait(job, 2 * JOB_TIMEOUT_S)
    out = result.output_text
    assert (result.state, result.exit_code, result.signal) == ("COMPLETED", 0, 0), out
    assert result.fields.get("Restarts") == "1", result.fields
    assert "hvdtrain: SIGUSR1: asking the ranks to checkpoint" in out, out
    assert f"hvdtrain: requeued Slurm job {job}" in out, out
    # Rank 0 says where it checkpointed; whichever rank saw the stop file first carried the others along.
    stopped = re.search(r"asked to stop \(SIGUSR1 to hvdtrain run\): checkpoint (\S+);", out)
    assert stopped, out
    name = Path(stopped[1]).name  # mid-epoch 2 almost always (its 180 steps take ~1 s); at its end if it came late
    assert re.fullmatch(r"ckpt-epoch000[12](-step\d{6})?\.pt", name), name
    assert f"resuming from {stopped[1]}" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    expected = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["weights_sha256_by_rank"] == expected["weights_sha256_by_rank"], out
    assert [(r["train_loss"], r["val_accuracy"]) for r in summary["history"]] == \
        [(r["train_loss"], r["val_accuracy"]) for r in expected["history"]]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_failing_ranks_exit_code_is_the_jobs(slurm_cluster: SlurmCluster, tmp_path: Path, controller: str) -> None:
    """Rank 1 exits 3 while rank 0 waits in an allreduce: Slurm's ExitCode is 3:0 (not horovodrun's 1), the output
    has hvdtrain's verdict, and the rank records in logs.dir say the same."""
    spec = write_spec(tmp_path, SCRIPTS / "raise_on_rank.py", "exit3", extra="logs: {dir: logs}\n")
    job = submit(slurm_cluster, render(spec, f"controller={controller}"))
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    assert (result.state, result.exit_code, result.signal) == ("FAILED", 3, 0), result.output_text
    # "(the first rank to fail)", or "(the cause); rank 0 exited with code 1 first, after Horovod shut down" when
    # rank 0 noticed first (seen with MPI): either way the verdict names rank 1 and its code.
    assert f"hvdtrain: rank 1 on host {slurm_cluster.node} exited with code 3 (" in result.output_text, \
        result.output_text
    records = [json.loads(p.read_text()) for p in (tmp_path / "logs" / "records").glob("rank.*.json")]
    assert {(r["rank"], r["code"]) for r in records} >= {(1, 3)}, records


def job_pids(cluster: SlurmCluster, job: int) -> dict[int, float]:
    """pid -> create time of the job's processes (psutil: a recycled pid is never mistaken for one of them)."""
    found = {}
    for pid in cluster.processes(job):
        with contextlib.suppress(psutil.Error):
            found[pid] = psutil.Process(pid).create_time()
    return found


def alive(pids: dict[int, float]) -> list[str]:
    left = []
    for pid, created in pids.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid}: {' '.join(p.cmdline())}")
    return left


def segments_of(pids: dict[int, float]) -> list[str]:
    """hvdtrain's segments in /dev/shm created by one of `pids` (hvdtrain_<creator pid>_<token>)."""
    return sorted(p.name for p in SHM_DIR.glob(SHM_PREFIX + "*") if int(p.name.split("_")[1]) in pids)


def mapped_shm_files(pids: dict[int, float]) -> set[Path]:
    """The /dev/shm files the processes have mapped and whose names still exist (Open MPI's vader_segment.* of an
    MPI job; hvdtrain's own segments are unlinked as soon as a worker has attached)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1]
                if path.startswith(f"{SHM_DIR}/") and not path.endswith(" (deleted)"):
                    found.add(Path(path))
    return found


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_scancel_leaves_no_process_and_no_segment(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                  controller: str) -> None:
    """scancel SIGTERMs every process of the job at once (hvdtrain, horovodrun, mpirun, the ranks, their loader
    workers), SIGKILLs what is left after KillWait: none of them may survive, nor any shared memory of theirs."""
    spec = write_spec(tmp_path, LOADER_FOREVER, str(tmp_path))
    job = submit(slurm_cluster, render(spec, f"controller={controller}"))
    ready = [tmp_path / f"ready.{rank}" for rank in (0, 1)]
    wait_ready(slurm_cluster, job, ready)
    pids = job_pids(slurm_cluster, job)
    rank_pids = {int(p.read_text()) for p in ready}
    assert rank_pids <= set(pids), (rank_pids, slurm_cluster.processes(job))  # the ranks are the job's processes
    # The launcher, both ranks (under their supervisors) and both loader workers are among what is watched below.
    commands = list(slurm_cluster.processes(job).values())
    assert any(" -m hvdtrain.cli run " in c for c in commands), commands
    assert sum(" -m hvdtrain.rank_main " in c for c in commands) == 2, commands
    workers = sorted(w for c in commands for w in re.findall(r"hvdtrain-data-r\d+-w\d+", c))  # forked or spawned
    assert workers == ["hvdtrain-data-r0-w0", "hvdtrain-data-r1-w0"], commands
    mapped = mapped_shm_files(pids)

    leaked = cancel_and_sweep(slurm_cluster, job, pids, mapped)
    # Open MPI's own files (vader_segment.*, which its PMIx server unlinks as the ranks end) can outlive a cancelled
    # MPI job: scancel SIGTERMs mpirun and hvdtrain at once, hvdtrain forwards its SIGTERM, and mpirun takes the
    # second within 5 s of the first as "exit now, clean nothing up". A known limitation (README, "What is not
    # verified"); a SIGTERM to hvdtrain alone no longer does it (tests/launch/test_launch.py). Removed (4 MiB each).
    assert not [p for p in leaked if not p.name.startswith("vader_segment.")], leaked


def test_run_in_salloc_uses_the_allocation(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, SCRIPTS / "allreduce_mean.py", str(tmp_path), extra="controller: gloo\n")
    run = [sys.executable, "-m", "hvdtrain.cli", "run", str(spec)]
    dry = slurm_cluster.run(["salloc", "-n2", *run, "--dry-run"], SALLOC_TIMEOUT_S)
    assert dry.returncode == 0, dry.describe()
    printed = [line for line in dry.output.splitlines() if not line.startswith("salloc:")]
    assert printed[0] == f"# {hosts_line(slurm_cluster, granted_job(dry.output))}", dry.describe()

    result = slurm_cluster.run(["salloc", "-n2", *run], SALLOC_TIMEOUT_S)
    assert result.returncode == 0, result.describe()
    assert f"hvdtrain: {hosts_line(slurm_cluster, granted_job(result.output))}\n" in result.output, result.describe()
    results = [json.loads((tmp_path / f"result.{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["rank"], r["size"], r["average"]) for r in results] == [(0, 2, [0.5, 6.0]), (1, 2, [0.5, 6.0])]


def test_run_under_srun_refuses_in_every_task_before_starting_anything(slurm_cluster: SlurmCluster,
                                                                       tmp_path: Path) -> None:
    spec = write_spec(tmp_path, SCRIPTS / "allreduce_mean.py", str(tmp_path), extra="controller: gloo\n")
    result = slurm_cluster.run(["salloc", "-n2", "srun", "-n2", sys.executable, "-m", "hvdtrain.cli", "run",
                                str(spec)], SALLOC_TIMEOUT_S)
    assert result.returncode == 2, result.describe()
    job = granted_job(result.output)
    for task in (0, 1):
        assert f"this is task {task} of 2 of Slurm step {job}.0: every task would start the whole job" \
            in result.output, result.describe()
    assert "hvdtrain: starting" not in result.output, result.describe()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]  # no rank wrote its result


def test_np_beyond_the_allocation_is_an_error_naming_it(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    spec = write_spec(tmp_path, SCRIPTS / "allreduce_mean.py", str(tmp_path), extra="controller: gloo\n")
    result = slurm_cluster.run(["salloc", "-n2", sys.executable, "-m", "hvdtrain.cli", "run", str(spec),
                                "-o", "np=3"], SALLOC_TIMEOUT_S)
    assert result.returncode == 2, result.describe()
    job = granted_job(result.output)
    assert (f"the Slurm allocation (job {job}): np = 3 but the hosts offer only 2 slot(s) ({slurm_cluster.node}:2)"
            in result.output), result.describe()
    assert "hvdtrain: starting" not in result.output, result.describe()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


# ---------------------------------------------------------------- --launcher srun
# Slurm starts every rank (`srun --label --mpi=pmix ... python -m hvdtrain.rank SCRIPT`), each under hvdtrain's
# supervisor, and Horovod initialises through MPI from PMIx: no mpirun, no ssh. This machine's srun has the pmix
# plugin (Debian's slurm-wlm: `srun --mpi=list` says pmix, pmix_v4, pmi2, cray_shasta, none).

SRUN_ARGV = "srun --label --disable-status --export=ALL --ntasks=2 --mpi=pmix --kill-on-bad-exit=1"

# ALLREDUCE, saying also which Slurm task and PMIx rank it is: a rank is Slurm's task, not mpirun's process.
SRUN_ALLREDUCE = """\
import os
import horovod.torch as hvd
import torch

hvd.init()
mean = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Average, name="mean").item()
env = os.environ
os.write(1, f"RANK {hvd.rank()} of {hvd.size()}: mean {mean}; Slurm task {env['SLURM_PROCID']} of step "
            f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}, PMIx rank {env['PMIX_RANK']}\\n".encode())
"""

# Rank 1 exits 3 at once; rank 0 sleeps, in no collective that would fail when rank 1 is gone.
RANK1_EXITS_3 = """\
import sys
import time

import horovod.torch as hvd

hvd.init()
if hvd.rank() == 1:
    sys.exit(3)
time.sleep(300)
"""

# Each rank writes its pid to DIR/ready.<rank> and sleeps; SIGINT interrupts it as Ctrl-C would (KeyboardInterrupt),
# and it stops as a training script does: DIR/interrupted.<rank> (its pid), then the KeyboardInterrupt goes on up.
# Only the first SIGINT raises: a repeated one is counted, so that it could not break into the handling of the
# first (test_srun_stop_signal_reaches_each_rank_once checks that there is none).
STOP_GRACEFULLY = """\
import os
import signal
import sys
import time

import horovod.torch as hvd

interrupts = []


def on_sigint(signum, frame):
    interrupts.append(signum)
    if len(interrupts) == 1:
        raise KeyboardInterrupt


hvd.init()
signal.signal(signal.SIGINT, on_sigint)
folder, rank = sys.argv[1], hvd.rank()
with open(os.path.join(folder, f"ready.{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(folder, f"ready.{rank}.tmp"), os.path.join(folder, f"ready.{rank}"))
try:
    time.sleep(300)
except KeyboardInterrupt:
    with open(os.path.join(folder, f"interrupted.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    raise
"""

# Each rank takes SIGINT only through sigtimedwait (blocked before anything starts a thread, so in every thread), and
# writes DIR/sigint.<rank>: who sent each SIGINT it got until 1 s after the first (then it exits 0). Two SIGINTs that
# arrive while the first is still pending are merged by the kernel: only a rank waiting in sigtimedwait when they come
# (and woken at once: a core free) sees both.
COUNT_SIGINTS = """\
import json
import os
import signal
import sys
import time

signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
import horovod.torch as hvd  # noqa: E402

hvd.init()
folder, rank = sys.argv[1], hvd.rank()
with open(os.path.join(folder, f"ready.{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(folder, f"ready.{rank}.tmp"), os.path.join(folder, f"ready.{rank}"))
senders, until = [], time.monotonic() + 300
while time.monotonic() < until:
    info = signal.sigtimedwait([signal.SIGINT], 0.5)
    if info is None:
        continue
    try:
        with open(f"/proc/{info.si_pid}/cmdline", "rb") as f:
            who = f.read().replace(b"\\0", b" ").decode().strip()
    except OSError:
        who = "?"
    senders.append({"pid": info.si_pid, "cmdline": who, "supervisor": info.si_pid == os.getppid()})
    until = min(until, time.monotonic() + 1)
with open(os.path.join(folder, f"sigint.{rank}"), "w") as f:
    json.dump(senders, f)
"""


def srun_script(spec: Path, *overrides: str) -> Path:
    """`hvdtrain render slurm SPEC --launcher srun`; checks that it runs `hvdtrain run --launcher srun` on the spec."""
    script = render(spec, *overrides, flags=("--launcher", "srun"))
    text = script.read_text()
    run = [line for line in text.splitlines() if line.startswith("exec ")]
    assert len(run) == 1 and run[0].startswith(f"exec {sys.executable} -m hvdtrain.cli run {spec} "), text
    assert " --launcher srun" in run[0] and "horovodrun" not in run[0], text
    return script


@pytest.mark.parametrize("controller", [None, "mpi"])
def test_srun_launcher_sbatch_runs_every_rank_as_a_slurm_task(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                              controller: str | None) -> None:
    spec = write_spec(tmp_path, SRUN_ALLREDUCE, extra="logs: {dir: logs}\n" +
                      (f"controller: {controller}\n" if controller else ""))
    job = submit(slurm_cluster, srun_script(spec))
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    out = result.output_text
    assert (result.state, result.exit_code, result.signal) == ("COMPLETED", 0, 0), out
    assert f"hvdtrain: {hosts_line(slurm_cluster, job)}\n" in out, out
    assert f"hvdtrain: starting {SRUN_ARGV} {sys.executable} -m hvdtrain.rank {tmp_path / 'rank.py'}\n" in out, out
    # srun's `N: ` labels became hvdtrain's rank prefixes; Horovod's rank is the Slurm task's and the PMIx rank.
    ranks = sorted(re.findall(rf"^\[(\d)\]<stdout>:RANK (\d) of 2: mean 0\.5; Slurm task (\d) of step {job}\.0, "
                              r"PMIx rank (\d)$", out, re.M))
    assert ranks == [("0",) * 4, ("1",) * 4], out
    assert not re.search(r"^ *\d+: ", out, re.M), out  # no line kept srun's own label
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank.{rank}.log").read_text()
        assert f"RANK {rank} of 2: mean 0.5" in log, log


def test_srun_launcher_a_failing_ranks_exit_code_is_the_jobs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Rank 1 exits 3 while rank 0 sleeps (no collective would tell it): srun (--kill-on-bad-exit) has Slurm kill
    rank 0 and exits 143 itself (seen by hand: `srun ...` alone exits 143 here), but the job's ExitCode is 3:0,
    rank 1's own, from the ranks' records."""
    spec = write_spec(tmp_path, RANK1_EXITS_3, extra="logs: {dir: logs}\n")
    job = submit(slurm_cluster, srun_script(spec))
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    out = result.output_text
    assert (result.state, result.exit_code, result.signal) == ("FAILED", 3, 0), out
    assert f"srun: Force Terminated StepId={job}.0\n" in out, out  # srun killed the step: its own code is 143
    assert f"hvdtrain: rank 1 on host {slurm_cluster.node} exited with code 3 (the first rank to fail)\n" in out, out
    records = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())
               for p in (tmp_path / "logs" / "records").glob("rank.*.json")}
    assert (records[1]["code"], records[1]["exception"]) == (3, "SystemExit"), records
    assert (records[0]["code"], records[0]["signum"]) == (None, signal.SIGTERM), records  # killed by Slurm


def wait_ready(cluster: SlurmCluster, job: int | None, ready: list[Path], proc: subprocess.Popen[bytes] | None = None,
               output: Path | None = None) -> None:
    """Wait (READY_S) until every file in `ready` exists, failing at once if the job (or `proc`) ended first."""
    deadline = time.monotonic() + READY_S
    while not all(p.exists() for p in ready):
        if job is not None:
            fields = cluster.job_fields(job)
            assert fields.get("JobState") in ("PENDING", "RUNNING"), fields
        if proc is not None:
            text = output.read_text(errors="replace") if output else ""
            assert proc.poll() is None, f"exited {proc.returncode} before the ranks were ready:\n{text}"
        assert time.monotonic() < deadline, "the ranks never got ready" + (f":\n{output.read_text()}" if output else "")
        time.sleep(0.2)


def cancel_and_sweep(cluster: SlurmCluster, job: int, pids: dict[int, float], mapped: set[Path]) -> list[Path]:
    """scancel the job; check every process of it is gone, no hvdtrain segment left and the job CANCELLED; then
    remove and return the files of `mapped` (/dev/shm files the ranks had mapped) that outlived it."""
    cluster.scancel(job)
    wait_all_gone(cluster, job, pids, "scancel")
    assert segments_of(pids) == []
    result = cluster.wait(job, JOB_TIMEOUT_S)
    assert result.state == "CANCELLED", result
    leaked = sorted(p for p in mapped if p.exists())
    for path in leaked:
        path.unlink(missing_ok=True)
    return leaked


def wait_all_gone(cluster: SlurmCluster, job: int, pids: dict[int, float], after: str) -> None:
    """Wait (GONE_S) until none of `pids`, no process of the job and none of its slurmstepds is left."""
    since = time.monotonic()
    while left := alive(pids) + [f"{pid}: {cmd}" for pid, cmd in
                                 {**cluster.processes(job), **cluster.step_daemons(job)}.items()]:
        assert time.monotonic() - since < GONE_S, f"still running {GONE_S} s after {after}:\n" + "\n".join(left)
        time.sleep(0.2)


def test_srun_launcher_scancel_leaves_no_process_and_no_segment(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """scancel of a running `--launcher srun` job: every process of it ends (hvdtrain and srun in the batch step;
    the ranks, their supervisors and their loader workers in step 0), and no hvdtrain segment is left."""
    spec = write_spec(tmp_path, LOADER_FOREVER, str(tmp_path))
    job = submit(slurm_cluster, srun_script(spec))
    ready = [tmp_path / f"ready.{rank}" for rank in (0, 1)]
    wait_ready(slurm_cluster, job, ready)
    pids = job_pids(slurm_cluster, job)
    rank_pids = {int(p.read_text()) for p in ready}
    assert rank_pids <= set(pids), (rank_pids, slurm_cluster.processes(job))
    commands = list(slurm_cluster.processes(job).values())
    assert any(" -m hvdtrain.cli run " in c and " --launcher srun --srun-mpi pmix" in c for c in commands), \
        commands
    assert sum(c.startswith(f"{SRUN_ARGV} ") for c in commands) >= 1, commands
    assert sum(c.startswith(f"{sys.executable} -m hvdtrain.rank ") for c in commands) == 2, commands  # the supervisors
    assert sum(c.startswith(f"{sys.executable} -m hvdtrain.rank_main ") for c in commands) == 2, commands
    workers = sorted(w for c in commands for w in re.findall(r"hvdtrain-data-r\d+-w\d+", c))  # forked or spawned
    assert workers == ["hvdtrain-data-r0-w0", "hvdtrain-data-r1-w0"], commands
    mapped = mapped_shm_files(pids)
    # Open MPI's shared-memory transport between the two ranks (vader_segment.*): what the last check is about.
    assert mapped, "the ranks map no named file in /dev/shm"

    leaked = cancel_and_sweep(slurm_cluster, job, pids, mapped)
    assert leaked == [], f"shared-memory files of the cancelled job's processes outlived it: {leaked}"


@contextlib.contextmanager
def salloc_in_background(cluster: SlurmCluster, cwd: Path, *argv: str, tasks: int = 2
                         ) -> Iterator[subprocess.Popen[bytes]]:
    """`salloc -nTASKS ARGV` in a session of its own, its output to CWD/salloc.out; afterwards (however the test
    went) nothing of its job is left: the allocation cancelled, salloc's group and the job's processes SIGKILLed."""
    with open(cwd / "salloc.out", "wb") as out:
        proc = subprocess.Popen(["salloc", f"-n{tasks}", *argv], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd=cwd, env=cluster.full_env(), start_new_session=True)
    STARTED_SESSIONS.add(proc.pid)
    try:
        yield proc
    finally:
        job = re.search(r"^salloc: Granted job allocation (\d+)$", (cwd / "salloc.out").read_text(), re.M)
        if proc.poll() is None or (job and cluster.processes(int(job[1]))):
            if job:
                cluster.run(["scancel", job[1]], timeout_s=10)
            deadline = time.monotonic() + GONE_S
            while time.monotonic() < deadline:
                kill_group(proc)
                left = cluster.processes(int(job[1])) if job else {}
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                if proc.poll() is not None and not left:
                    break
                time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_S)


def hvdtrain_in(cluster: SlurmCluster, job: int, salloc: subprocess.Popen[bytes]) -> int:
    """The pid of `hvdtrain run`, salloc's command (it runs in a process group of its own, not salloc's)."""
    found = [pid for pid, cmd in cluster.processes(job).items() if " -m hvdtrain.cli run " in cmd]
    assert len(found) == 1, cluster.processes(job)
    assert psutil.Process(found[0]).ppid() == salloc.pid, cluster.processes(job)
    return found[0]


def test_srun_launcher_sigterm_stops_every_rank_gracefully(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """SIGTERM to `hvdtrain run --launcher srun` in an salloc shell (salloc itself ignores SIGTERM once its command
    runs, so a user's `kill` or a terminal's hang-up goes to hvdtrain): hvdtrain forwards it to srun as SIGINT, srun
    passes it to the tasks, each rank gets a KeyboardInterrupt and stops by itself, well within hvdtrain's grace;
    exit code 143, and nothing of the job is left."""
    spec = write_spec(tmp_path, STOP_GRACEFULLY, str(tmp_path), extra="logs: {dir: logs}\n")
    output = tmp_path / "salloc.out"
    with salloc_in_background(slurm_cluster, tmp_path, sys.executable, "-m", "hvdtrain.cli", "run", str(spec),
                              "--launcher", "srun") as salloc:
        ready = [tmp_path / f"ready.{rank}" for rank in (0, 1)]
        wait_ready(slurm_cluster, None, ready, salloc, output)
        job = granted_job(output.read_text())
        pids = job_pids(slurm_cluster, job)
        hvdtrain = hvdtrain_in(slurm_cluster, job, salloc)
        os.kill(hvdtrain, signal.SIGTERM)
        signalled_at = time.monotonic()
        code = salloc.wait(timeout=GRACE_S + SRUN_ABORT_S + 30)
        took = time.monotonic() - signalled_at
    out = output.read_text()
    assert code == 143, out  # salloc exits with its command's code
    assert took < GRACE_S, f"{took:.1f} s: the ranks did not stop by themselves, hvdtrain escalated\n{out}"
    assert "hvdtrain: SIGTERM received: stopping every rank\n" in out, out
    assert f"srun: sending Ctrl-C to StepId={job}.0\n" in out, out  # srun got SIGINT (a SIGTERM kills the step)
    assert "hvdtrain: the job was stopped by SIGTERM; exit code 143\n" in out, out
    for rank in (0, 1):
        marker = tmp_path / f"interrupted.{rank}"
        assert marker.exists(), f"rank {rank} got no KeyboardInterrupt\n{out}"
        assert marker.read_text() == (tmp_path / f"ready.{rank}").read_text()  # the same process
    records = [json.loads(p.read_text()) for p in (tmp_path / "logs" / "records").glob("rank.*.json")]
    assert sorted((r["rank"], r["exception"]) for r in records) == [(0, "KeyboardInterrupt"), (1, "KeyboardInterrupt")]
    # Each rank ends by its SIGINT, or (CI, 2026-12-02) by SIGTERM: a rank still unwinding its KeyboardInterrupt
    # when the other's task has ended is stopped by srun's --kill-on-bad-exit (hvdtrain/job/plan.py).
    assert {r["signum"] for r in records} <= {signal.SIGINT, signal.SIGTERM} and signal.SIGINT in \
        {r["signum"] for r in records}, records
    wait_all_gone(slurm_cluster, job, pids, "hvdtrain exited")
    result = slurm_cluster.wait(job, JOB_TIMEOUT_S)
    assert (result.state, result.exit_code, result.signal) == ("FAILED", 143, 0), result  # the allocation's command


def test_srun_stop_signal_reaches_each_rank_once(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """One SIGTERM to hvdtrain is one SIGINT to each rank (one Ctrl-C: a second one would break into the rank's
    handling of the first, e.g. a checkpoint written on KeyboardInterrupt). One rank, so that a core is free to wake
    it for each SIGINT and a second one would be seen: when the supervisor still passed Slurm's SIGINT on, two
    ranks on this 2-core machine saw both copies about every other time (merged while pending), one rank 8 times
    in 8."""
    spec = write_spec(tmp_path, COUNT_SIGINTS, str(tmp_path))
    output = tmp_path / "salloc.out"
    with salloc_in_background(slurm_cluster, tmp_path, sys.executable, "-m", "hvdtrain.cli", "run", str(spec),
                              "-o", "np=1", "--launcher", "srun", tasks=1) as salloc:
        wait_ready(slurm_cluster, None, [tmp_path / "ready.0"], salloc, output)
        job = granted_job(output.read_text())
        pids = job_pids(slurm_cluster, job)
        os.kill(hvdtrain_in(slurm_cluster, job, salloc), signal.SIGTERM)
        code = salloc.wait(timeout=GRACE_S + SRUN_ABORT_S + 30)
    out = output.read_text()
    assert code == 143, out
    wait_all_gone(slurm_cluster, job, pids, "hvdtrain exited")
    senders = json.loads((tmp_path / "sigint.0").read_text())
    # Once, from slurmstepd (it signals every process of the step): the supervisor does not pass a second copy on
    # (HVDTRAIN_SLURM_SIGNALS, NOTE [no orphans] in hvdtrain/rank.py); it used to, and the rank got two Ctrl-Cs.
    assert len(senders) == 1 and not senders[0]["supervisor"], (senders, out)
