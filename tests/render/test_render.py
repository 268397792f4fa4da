"""hvdtrain render: MPIJob manifests validated against the MPI Operator's CRD schema, sbatch scripts checked with
`bash -n` and run against stub `scontrol`/`horovodrun`/`srun` to prove every spec value arrives intact."""

from __future__ import annotations

import copy
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hvdtrain.cli import main
from hvdtrain.job.plan import build_plan
from hvdtrain.render import ClusterOptions, K8sOptions, RenderError, SlurmOptions, render_file
from hvdtrain.render.common import load_for_cluster
from hvdtrain.render.k8s import mpijob

ROOT = Path(__file__).resolve().parents[2]
# Shell metacharacters, quotes, spaces, a newline and a would-be command substitution.
NASTY = "a b 'c' \"d\" $(touch PWNED) `touch PWNED2` ; & | > \\ *\nnext line"


def write_spec(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


SPEC = """\
script: ../recipes/train.py
args: [--epochs, 3, "--note=two words"]
np: 8
hosts: a:4,b:4
controller: mpi
gpus_per_rank: 1
env:
  NCCL_DEBUG: WARN
  NOTE: "{nasty}"
horovod:
  fusion_threshold_mb: 64
kubernetes:
  image: reg.example/hvd:1
  run_volume: runs-pvc
  shm_size: 8Gi
""".format(nasty=NASTY.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))


# What render k8s needs besides the job (a spec for both targets: `hvdtrain run` and Slurm do not read it).
K8S = "kubernetes: {image: reg.example/hvd:1, run_volume: runs-pvc, shm_size: 1Gi}\n"


def cluster(**kw) -> ClusterOptions:
    return ClusterOptions(**{"name": "job", **kw})


def test_spec_fixture_round_trips_the_nasty_value(tmp_path):
    spec = load_for_cluster(write_spec(tmp_path, SPEC), "/opt/hvdtrain/jobs")
    assert spec.env["NOTE"] == NASTY
    assert spec.script == "/opt/hvdtrain/recipes/train.py"


def test_mpijob_validates_against_the_crd_schema(tmp_path, validator):
    text = render_file("k8s", write_spec(tmp_path, SPEC), cluster(), K8sOptions(namespace="ml"))
    obj = yaml.safe_load(text)
    errors = sorted(validator.iter_errors(obj), key=str)
    assert not errors, "\n".join(e.message for e in errors)
    assert obj["apiVersion"] == "kubeflow.org/v2beta1" and obj["kind"] == "MPIJob"
    assert obj["metadata"] == {"name": "job", "namespace": "ml", "labels": {"app.kubernetes.io/name": "hvdtrain"}}
    assert set(obj["spec"]["mpiReplicaSpecs"]) == {"Launcher", "Worker"}  # the operator accepts only these two


def test_mpijob_layout_gpus_env_and_command(tmp_path):
    spec = load_for_cluster(write_spec(tmp_path, SPEC), "/opt/hvdtrain/jobs")
    obj = mpijob(spec, cluster(), K8sOptions())
    replicas = obj["spec"]["mpiReplicaSpecs"]
    launcher = replicas["Launcher"]["template"]["spec"]["containers"][0]
    worker = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert obj["spec"]["slotsPerWorker"] == 4 and replicas["Worker"]["replicas"] == 2
    assert replicas["Launcher"]["replicas"] == 1
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": 4}}
    assert "resources" not in launcher
    assert launcher["image"] == worker["image"] == "reg.example/hvd:1"
    assert worker["command"] == ["/usr/local/bin/hvdtrain-entrypoint", "sshd", "-p", "2222"]
    stop_wait = {"name": "HVDTRAIN_STOP_WAIT_S", "value": "110"}  # the entrypoint's (kubernetes.termination_grace_s)
    assert launcher["env"] == [{"name": "NCCL_DEBUG", "value": "WARN"}, {"name": "NOTE", "value": NASTY}, stop_wait]
    assert worker["env"] == [stop_wait]  # ranks get the launcher's environment from horovodrun, not the sshd's
    # The same argv `hvdtrain run` builds, with the operator's hostfile in place of -H and the image's paths.
    expected = build_plan(spec.model_copy(update={"python": "/opt/hvdtrain/.venv/bin/python",
                                                  "ssh": spec.ssh.model_copy(update={"port": 2222})}),
                          controller="mpi", horovodrun="/opt/hvdtrain/.venv/bin/hvdtrain-horovodrun").argv
    at = expected.index("-H")
    expected[at:at + 2] = ["--hostfile", "/etc/mpi/hostfile"]
    # ... started once every worker's sshd takes connections (docker/entrypoint.sh wait-ssh).
    assert launcher["command"] == ["/usr/local/bin/hvdtrain-entrypoint", "wait-ssh", "/etc/mpi/hostfile", "2222",
                                   "900", "--", *expected]
    assert launcher["command"][-7:] == ["/opt/hvdtrain/.venv/bin/python", "-m", "hvdtrain.rank",
                                        "/opt/hvdtrain/recipes/train.py",
                                        "--epochs", "3", "--note=two words"]
    assert worker["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "runs", "mountPath": "/runs"}]
    # The ranks start in the launcher's folder on the workers, where the claim is; the launcher writes nothing there.
    assert launcher["workingDir"] == "/runs" and "volumeMounts" not in launcher
    assert "volumes" not in replicas["Launcher"]["template"]["spec"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs-pvc"}} in \
        replicas["Worker"]["template"]["spec"]["volumes"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in \
        replicas["Worker"]["template"]["spec"]["volumes"]


def test_schema_check_can_fail(tmp_path, validator):
    """The strict schema rejects what the API server would: a misspelt key, a bad quantity, a missing name."""
    good = yaml.safe_load(render_file("k8s", write_spec(tmp_path, SPEC), cluster(), K8sOptions()))
    typo = copy.deepcopy(good)
    typo["spec"]["slotPerWorker"] = typo["spec"].pop("slotsPerWorker")
    quantity = copy.deepcopy(good)
    worker = quantity["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "four"
    nameless = copy.deepcopy(good)
    del nameless["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["name"]
    for bad in (typo, quantity, nameless):
        assert list(validator.iter_errors(bad)), bad


def test_cpu_job_has_no_gpu_limit_and_default_layout_is_one_node(tmp_path, validator):
    path = write_spec(tmp_path, "script: t.py\nnp: 3\n" + K8S)
    obj = yaml.safe_load(render_file("k8s", path, cluster(gpus_per_node=0), K8sOptions()))
    assert not list(validator.iter_errors(obj))
    worker = obj["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 1 and obj["spec"]["slotsPerWorker"] == 3
    assert "resources" not in worker["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("job", sorted(p.name for p in (ROOT / "jobs").glob("*.yaml")))
def test_every_shipped_job_renders_valid(job, validator, tmp_path):
    spec_path = ROOT / "jobs" / job
    data = yaml.safe_load(spec_path.read_text())
    # A shipped job without a kubernetes section gets the image and the run volume from the render's options.
    for_k8s = [] if "kubernetes" in data else ["kubernetes.image=reg.example/hvd:1", "kubernetes.run_volume=runs"]
    if "elastic" in data:
        with pytest.raises(RenderError, match="elastic"):
            render_file("k8s", spec_path, cluster(), K8sOptions(), for_k8s)
    elif "AWS_SECRET_ACCESS_KEY" in data.get("env", {}):  # its demo credentials: never written into a manifest
        with pytest.raises(RenderError, match=r"env AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY: a credential would"):
            render_file("k8s", spec_path, cluster(), K8sOptions(), for_k8s)
    else:
        obj = yaml.safe_load(render_file("k8s", spec_path, cluster(), K8sOptions(), for_k8s))
        assert not list(validator.iter_errors(obj))
    if "elastic" not in data:
        script = tmp_path / "job.sbatch"
        script.write_text(render_file("slurm", spec_path, cluster(), SlurmOptions()))
        subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize(("spec_text", "opts", "match"), [
    ("script: t.py\nnp: 6\nhosts: a:4,b:4\n", {}, r"np = 6 does not fill nodes of 4 slots"),
    ("script: t.py\nnp: 8\n", {"nodes": 3}, r"np = 8 does not fill nodes of 3 slots"),
    ("script: t.py\nnp: 8\n", {"nodes": 4, "slots_per_node": 4}, r"--nodes 4 with 4 slots per node gives 16"),
    ("script: t.py\nnp: 2\n", {"name": "Bad_Name"}, r"job name 'Bad_Name'"),
    ("script: t.py\nnp: 2\n", {"slots_per_node": 0}, r"--slots-per-node 0"),
    ("script: t.py\nnp: 2\nelastic: {discovery_script: d.sh}\n", {}, r"elastic jobs cannot be rendered"),
])
def test_layout_and_option_errors_name_the_value(tmp_path, spec_text, opts, match):
    path = write_spec(tmp_path, spec_text)
    for target, target_opts in (("k8s", K8sOptions()), ("slurm", SlurmOptions())):
        with pytest.raises(RenderError, match=match):
            render_file(target, path, cluster(**opts), target_opts)


@pytest.mark.parametrize(("opts", "match"), [
    ({"image": "has space:1"}, r"--image 'has space:1'"),
    ({"namespace": "Team_A"}, r"--namespace 'Team_A'"),
    ({"shm_size": "lots"}, r"--shm-size 'lots'"),
    ({"ssh_port": 70000}, r"--ssh-port 70000"),
])
def test_k8s_option_errors(tmp_path, opts, match):
    with pytest.raises(RenderError, match=match):
        render_file("k8s", write_spec(tmp_path, SPEC), cluster(), K8sOptions(**opts))


def stub_bin(tmp_path: Path) -> Path:
    """A bin/ with srun and python that print their argv NUL-separated (and $NOTE, and where they started)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    echo = "#!/usr/bin/env bash\nprintf '%s\\0' \"$(basename \"$0\")\" \"$@\" > \"$STUB_OUT\"\n" \
           "printf '%s' \"$NOTE\" > \"$STUB_OUT.note\"\npwd > \"$STUB_OUT.cwd\"\n"
    for name in ("srun", "python"):
        path = bin_dir / name
        path.write_text(echo)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


# What Slurm sets in a batch script of a 2-node job with 4 tasks on each (tests/cluster/test_slurm.py runs the real
# one).
ALLOCATION = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)"}


def run_sbatch(tmp_path: Path, text: str, bin_dir: Path) -> tuple[subprocess.CompletedProcess, list[str], str]:
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = tmp_path / "argv"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_OUT": str(out), **ALLOCATION}
    env.pop("NOTE", None)
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    argv = out.read_bytes().decode().split("\0")[:-1] if out.exists() else []
    note = Path(f"{out}.note").read_text() if Path(f"{out}.note").exists() else ""
    return proc, argv, note


def test_sbatch_runs_hvdtrain_run_on_the_spec_with_every_value_intact(tmp_path):
    """The script runs `hvdtrain run` on the spec file (no env values copied into it); that run, inside the
    allocation, plans horovodrun on the allocation's nodes with every spec value intact."""
    bin_dir = stub_bin(tmp_path)
    (tmp_path / "train.py").write_text("")
    path = write_spec(tmp_path, SPEC.replace("../recipes/train.py", "train.py"))
    opts = SlurmOptions(time="02:00:00", partition="gpu", account="proj42", cpus_per_task=8)
    text = render_file("slurm", path, cluster(python=str(bin_dir / "python")), opts, overrides=["args=[--epochs, 3]"])
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --time=02:00:00", "#SBATCH --partition=gpu", "#SBATCH --account=proj42",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --job-name=job", "#SBATCH --signal=B:USR1@120",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in text.splitlines()
    assert "NCCL_DEBUG" not in text and "PWNED" not in text  # env stays in the spec: no secrets in the script
    assert "--ssh-port" not in text and "2222" not in text and "/opt/hvdtrain" not in text
    proc, argv, _ = run_sbatch(tmp_path, text, bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert argv == ["python", "-m", "hvdtrain.cli", "run", str(path), "-o", "args=[--epochs, 3]",
                    "-o", "hosts=null", "-o", "hostfile=null", "--requeue"]
    out = dry_run_in_allocation(argv)
    assert "# hosts from Slurm job 42: node01:4,node02:4" in out
    command = shlex.split(out.split("# command\n")[1].split("\n")[0])
    assert command[1:5] == ["-np", "8", "-H", "node01:4,node02:4"]
    assert command[command.index("--fusion-threshold-mb"):][:2] == ["--fusion-threshold-mb", "64"]
    assert command[-3:] == [str(tmp_path / "train.py"), "--epochs", "3"]
    assert f"NOTE={shlex.quote(NASTY)}" in out
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED2").exists()


def dry_run_in_allocation(argv: list[str]) -> str:
    """The rendered script's `hvdtrain run` with --dry-run, inside ALLOCATION: what it would start."""
    dry = subprocess.run([sys.executable, *argv[1:], "--dry-run"], env={**os.environ, **ALLOCATION},
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    return dry.stdout


def test_sbatch_srun_launcher_runs_hvdtrain_run_with_srun(tmp_path):
    bin_dir = stub_bin(tmp_path)
    workdir = tmp_path / "work_dir"
    workdir.mkdir()
    (tmp_path / "train.py").write_text("")
    spec = ("script: train.py\nargs: ['x y', \"$(id)\"]\nnp: 8\nhosts: a:4,b:4\nenv: {NOTE: '$HOME'}\n"
            f"workdir: '{workdir}'\n")
    path = write_spec(tmp_path, spec)
    text = render_file("slurm", path, cluster(python=str(bin_dir / "python")), SlurmOptions(launcher="srun"))
    assert "#SBATCH --gpus-per-node" not in text and "$HOME" not in text  # a CPU job; env stays in the spec
    proc, argv, _ = run_sbatch(tmp_path, text, bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert argv == ["python", "-m", "hvdtrain.cli", "run", str(path), "-o", "hosts=null", "-o", "hostfile=null",
                    "--launcher", "srun", "--srun-mpi", "pmix", "--requeue"]
    out = dry_run_in_allocation(argv)
    assert out.startswith("# hosts from Slurm job 42: node01:4,node02:4")
    assert f"# working directory\n{workdir}\n" in out  # srun, and so every rank, starts there
    command = shlex.split(out.split("# command\n")[1].split("\n")[0])
    assert command == ["srun", "--label", "--disable-status", "--export=ALL", "--ntasks=8", "--mpi=pmix",
                       "--kill-on-bad-exit=1", sys.executable, "-m", "hvdtrain.rank", str(tmp_path / "train.py"),
                       "x y", "$(id)"]
    assert "NOTE='$HOME'" in out


def test_workdir_is_where_the_mpijob_launcher_starts(tmp_path):
    workdir = tmp_path / "work_dir"
    workdir.mkdir()
    spec = f"script: ../recipes/train.py\nnp: 2\nhosts: a:1,b:1\nworkdir: '{workdir}'\n" + K8S
    obj = mpijob(load_for_cluster(write_spec(tmp_path, spec), "/opt/hvdtrain/jobs"), cluster(),
                 K8sOptions(image="reg.example/hvd:1"))
    launcher_container = obj["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    assert launcher_container["workingDir"] == str(workdir)


def test_srun_refuses_horovodrun_only_settings(tmp_path):
    with pytest.raises(RenderError, match=r"horovod\.fusion_threshold_mb.*use the horovodrun launcher"):
        render_file("slurm", write_spec(tmp_path, SPEC), cluster(), SlurmOptions(launcher="srun"))
    with pytest.raises(RenderError, match=r"cannot apply controller: gloo"):  # --controller as well as the spec's
        render_file("slurm", write_spec(tmp_path, "script: t.py\nnp: 2\n"), cluster(controller="gloo"),
                    SlurmOptions(launcher="srun"))


@pytest.mark.parametrize(("opts", "match"), [
    ({"partition": "gpu a100"}, r"--partition 'gpu a100' cannot go on an #SBATCH line"),
    ({"output": "out\n#SBATCH --x"}, r"--output 'out\\n#SBATCH --x'"),
    ({"time": "two hours"}, r"--time 'two hours' is not a Slurm time"),
    ({"cpus_per_task": 0}, r"--cpus-per-task 0"),
    ({"launcher": "mpirun"}, r"--launcher 'mpirun'"),
    ({"signal_before": -5}, r"--signal-before -5 is not allowed: use a whole number of seconds from 0 to 65535"),
    ({"signal_before": 70000}, r"--signal-before 70000 is not allowed"),
    ({"signal_before": 1.5}, r"--signal-before 1\.5 is not allowed"),
    ({"time": "3"}, r"--signal-before 120 with --time 3 \(180 s\): Slurm may send SIGUSR1 up to 60 s early.*"
                    r"use --signal-before below 120, a longer --time, or --signal-before 0"),
    ({"time": "00:02:30"}, r"--signal-before 120 with --time 00:02:30 \(150 s\)"),
    ({"time": "0-0:3", "signal_before": 120}, r"--signal-before 120 with --time 0-0:3 \(180 s\)"),
    ({"time": "1", "signal_before": 1}, r"with --time 1 \(60 s\).*use a longer --time, or --signal-before 0"),
])
def test_sbatch_option_errors(tmp_path, opts, match):
    with pytest.raises(RenderError, match=match):
        render_file("slurm", write_spec(tmp_path, SPEC), cluster(), SlurmOptions(**opts))


SBATCH_PREEMPTION = ("#SBATCH --signal=", "#SBATCH --requeue", "#SBATCH --open-mode=")


@pytest.mark.parametrize("launcher", ["horovodrun", "srun"])
@pytest.mark.parametrize(("flags", "lines", "requeue"), [
    ([], ["#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"], True),
    (["--signal-before", "300", "--time", "1-00:00"], ["#SBATCH --signal=B:USR1@300", "#SBATCH --requeue",
                                                       "#SBATCH --open-mode=append"], True),
    (["--signal-before", "0"], ["#SBATCH --requeue", "#SBATCH --open-mode=append"], True),
    (["--no-requeue"], ["#SBATCH --signal=B:USR1@120"], False),
    (["--signal-before", "0", "--no-requeue"], [], False),
])
def test_sbatch_signals_before_the_time_limit_and_requeues(tmp_path, capsys, launcher, flags, lines, requeue):
    """The render CLI's --signal-before/--no-requeue become #SBATCH lines (before the first command, where sbatch
    reads them) and `hvdtrain run --requeue`, with either launcher; the header says what they do."""
    path = write_spec(tmp_path, "script: t.py\nnp: 2\ncontroller: mpi\n")
    assert main(["render", "slurm", str(path), "--launcher", launcher, *flags]) == 0
    text = capsys.readouterr().out.splitlines()
    directives = [line for line in text if line.startswith(SBATCH_PREEMPTION)]
    assert directives == lines
    assert all(text.index(line) < text.index("set -euo pipefail") for line in directives)
    run = [line for line in text if line.startswith("exec ")]
    assert len(run) == 1 and run[0].endswith(" --requeue") == requeue and run[0].count("--requeue") == requeue
    if "#SBATCH --signal=B:USR1@120" in lines:
        assert "# Slurm sends SIGUSR1 120 s before the time limit (it may be up to 60 s early) to the batch shell " \
               "(B:), which" in text


@pytest.mark.parametrize("value", ["-5", "abc", "1.5", "", "70000"])
def test_render_cli_refuses_a_bad_signal_before(tmp_path, capsys, value):
    assert main(["render", "slurm", str(write_spec(tmp_path, SPEC)), f"--signal-before={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdtrain render: error: --signal-before ") and "is not allowed: use a whole number of " \
        "seconds from 0 to 65535 (0: no signal before the time limit)" in err, err


def test_cli_prints_writes_and_exits_2_on_errors(tmp_path, capsys):
    path = write_spec(tmp_path, SPEC)
    out = tmp_path / "job.k8s.yaml"
    assert main(["render", "k8s", str(path), "--output", str(out), "--image", "reg/hvd:1"]) == 0
    assert yaml.safe_load(out.read_text())["metadata"]["name"] == "job"
    assert main(["render", "slurm", str(path), "-o", "np=4", "--slots-per-node", "2"]) == 0
    assert "#SBATCH --nodes=2" in capsys.readouterr().out
    assert main(["render", "k8s", str(path), "-o", "np=7"]) == 2
    assert "np = 7 does not fill nodes of 4 slots" in capsys.readouterr().err
    assert main(["render", "k8s", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the spec" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["k8s", "slurm"])
def test_a_job_larger_than_one_hosts_slot_limit_renders(kind, tmp_path):
    text = "script: ../recipes/train.py\nnp: 8192\nhosts: a:4096,b:4096\ncontroller: mpi\n" + K8S
    opts = K8sOptions() if kind == "k8s" else SlurmOptions()
    rendered = render_file(kind, write_spec(tmp_path, text), cluster(), opts)
    assert "cluster-hosts" not in rendered
    assert ("8192" in rendered) if kind == "k8s" else ("#SBATCH --ntasks-per-node=4096" in rendered)
