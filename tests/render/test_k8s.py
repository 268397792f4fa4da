"""hvdtrain render k8s, what a cluster needs: the image and run volume from the spec, credentials from Secrets only,
/dev/shm sized from what the loaders need. Manifests are validated against the MPI Operator's CRD (strict,
tests/render/test_render.py's validator) and each pod template against Kubernetes' own schema (kubernetes-validate,
strict); the /dev/shm size is checked against the real loader in a private tmpfs of that size."""

from __future__ import annotations

import copy
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import kubernetes_validate
import pytest
import yaml

from hvdtrain.cli import main
from hvdtrain.formats.arrays import digits
from hvdtrain.job.load import SpecError
from hvdtrain.job.model import quantity_bytes
from hvdtrain.render import ClusterOptions, K8sOptions, RenderError, render_file
from hvdtrain.render.shmsize import SAMPLE_BYTES, SLOT_BYTES, per_rank_bytes
from tests.support.harness import REPO

K8S_VERSION = "1.33"  # a Kubernetes release kubernetes-validate carries the schemas of

FULL = """\
script: ../recipes/pytorch_train.py
args: [--dataset, synthetic, --synthetic-shape, "3,224,224", --batch-size, "64", --num-workers, "4",
       --run-dir, runs/resnet]
np: 16
hosts: a:8,b:8
gpus_per_rank: 1
env: {NCCL_DEBUG: WARN, AWS_ENDPOINT_URL: "https://s3.example.com", GOOGLE_APPLICATION_CREDENTIALS: /etc/gcp/k.json,
      TOKENIZERS_PARALLELISM: "false", AWS_SHARED_CREDENTIALS_FILE: /etc/aws/credentials, KEYRING_BACKEND: none}
kubernetes:
  image: registry.example.com/team/hvdtrain:gpu
  namespace: ml
  run_volume: hvdtrain-runs
  secret_env:
    AWS_ACCESS_KEY_ID: {secret: s3-creds, key: access-key}
    AWS_SECRET_ACCESS_KEY: {secret: s3-creds, key: secret-key}
"""


def render(tmp_path, text: str, opts: K8sOptions | None = None, overrides=()) -> dict:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return yaml.safe_load(render_file("k8s", path, ClusterOptions(name="job"), opts or K8sOptions(), overrides))


def pods(obj: dict) -> dict[str, dict]:
    return {role: spec["template"]["spec"] for role, spec in obj["spec"]["mpiReplicaSpecs"].items()}


def as_pod_template(pod: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": {"spec": pod}}


def test_full_spec_is_valid_for_the_crd_and_for_kubernetes(tmp_path, validator):
    as_documented = ClusterOptions(name="k8s", slots_per_node=8)  # jobs/k8s.yaml's render command
    shipped = yaml.safe_load(render_file("k8s", REPO / "jobs" / "k8s.yaml", as_documented, K8sOptions()))
    for obj in (render(tmp_path, FULL), shipped):
        assert not sorted(validator.iter_errors(obj), key=str)
        for pod in pods(obj).values():
            kubernetes_validate.validate(as_pod_template(pod), K8S_VERSION, strict=True)
    assert shipped["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2  # as jobs/k8s.yaml's comment says
    assert pods(shipped)["Worker"]["volumes"][0]["emptyDir"]["sizeLimit"] == "8448Mi"
    obj = render(tmp_path, FULL)
    # Kubernetes' schema can fail: a volume without its claim's name, a misspelt secretKeyRef.
    broken = copy.deepcopy(pods(obj)["Worker"])
    broken["volumes"][1]["persistentVolumeClaim"] = {"readOnly": False}
    with pytest.raises(kubernetes_validate.ValidationError, match="claimName"):
        kubernetes_validate.validate(as_pod_template(broken), K8S_VERSION, strict=True)
    broken = copy.deepcopy(pods(obj)["Launcher"])
    broken["containers"][0]["env"][-1]["valueFrom"] = {"secretKeyRefs": {"name": "s3-creds", "key": "k"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(as_pod_template(broken), K8S_VERSION, strict=True)


def test_image_run_volume_secrets_and_gpus_come_from_the_spec(tmp_path):
    obj = render(tmp_path, FULL)
    assert obj["metadata"]["namespace"] == "ml"
    launcher, worker = pods(obj)["Launcher"], pods(obj)["Worker"]
    assert launcher["containers"][0]["image"] == worker["containers"][0]["image"] == \
        "registry.example.com/team/hvdtrain:gpu"
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "hvdtrain-runs"}} in worker["volumes"]
    assert {"name": "runs", "mountPath": "/runs"} in worker["containers"][0]["volumeMounts"]
    container = launcher["containers"][0]
    assert container["workingDir"] == "/runs"  # the ranks start there on the workers: a relative --run-dir is on it
    assert container["command"][:7] == ["/usr/local/bin/hvdtrain-entrypoint", "wait-ssh", "/etc/mpi/hostfile", "2222",
                                        "900", "--", "/opt/hvdtrain/.venv/bin/hvdtrain-horovodrun"]
    assert container["env"][-3:-1] == [
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "access-key"}}},
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "secret-key"}}}]
    assert worker["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert obj["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2


def test_flags_override_the_spec_and_are_checked_like_it(tmp_path):
    obj = render(tmp_path, FULL, K8sOptions(image="other.example/hvd:2", namespace="team-b", image_pull_policy="Always",
                                            shm_size="3Gi"))
    worker = pods(obj)["Worker"]
    assert worker["containers"][0]["image"] == "other.example/hvd:2"
    assert worker["containers"][0]["imagePullPolicy"] == "Always" and obj["metadata"]["namespace"] == "team-b"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "3Gi"}} in worker["volumes"]
    with pytest.raises(RenderError, match=r"--pull-policy 'Sometimes': Input should be 'Always', 'IfNotPresent'"):
        render(tmp_path, FULL, K8sOptions(image_pull_policy="Sometimes"))


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.replace("  image: registry.example.com/team/hvdtrain:gpu\n", ""),
     r"kubernetes.image is not set: .*docker/Dockerfile.* or with --image"),
    (lambda t: t.replace("  run_volume: hvdtrain-runs\n", ""),
     r"kubernetes.run_volume is not set: without a PersistentVolumeClaim the run directory"),
    (lambda t: t.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: WARN, HF_TOKEN: hf_abc, DB_PASSWORD: pw"),
     r"env HF_TOKEN, DB_PASSWORD: a credential would be written into the manifest as plain text\. Put it in a "
     r"Secret \(kubectl create secret generic job-secrets --from-literal=HF_TOKEN=\.\.\.\) .*secret_env"),
    (lambda t: t.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: WARN, AWS_ACCESS_KEY_ID: AKIA"), r"env AWS_ACCESS_KEY_ID"),
    (lambda t: t.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: WARN, WANDB_API_KEY: x, PGPASSWORD: y, SSH_KEY: z"),
     r"env WANDB_API_KEY, PGPASSWORD, SSH_KEY: a credential"),
    (lambda t: t.replace("runs/resnet", "/data/runs"),
     r"the run directory /data/runs is not on the run volume \(kubernetes.run_mount /runs\)"),
    (lambda t: t + "workdir: /opt/work\n", r"the run directory /opt/work/runs/resnet is not on the run volume.*"
                                           r"and a workdir under it"),
    (lambda t: t + "  run_mount: /opt\n", r"kubernetes.run_mount '/opt' would cover /opt/hvdtrain in the pods"),
    (lambda t: t + "  run_mount: /dev/shm\n", r"kubernetes.run_mount '/dev/shm' is inside /dev"),
    (lambda t: t + "  run_mount: /root/\n", r"kubernetes.run_mount '/root/' would cover /root/.ssh"),
    (lambda t: t + "  run_mount: /\n", r"kubernetes.run_mount '/' would cover the whole image"),
    (lambda t: t + "  run_mount: /usr/local/runs\n", r"kubernetes.run_mount '/usr/local/runs' is inside /usr"),
    (lambda t: t.replace("runs/resnet", "runs/resnet, --run, /data/x"), r"the run directory /data/x is not on"),
    (lambda t: t.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: WARN, MLFLOW_TRACKING_URI: 'https://me:pw@mlflow.example'"),
     r"env MLFLOW_TRACKING_URI: a credential"),
    (lambda t: t + "horovod: {verbose: true}\n",
     r"horovod.verbose with kubernetes.secret_env under Gloo: horovodrun would print every rank's command"),
    (lambda t: t.replace("runs/resnet", "runs/resnet, --sigterm-grace, '110'"),
     r"args --sigterm-grace 110 does not fit in the pods' time to stop: kubernetes.termination_grace_s 120 s, less "
     r"the entrypoint's 10 s, .* \(e.g. -o kubernetes.termination_grace_s=130\) or lower --sigterm-grace"),
    (lambda t: t.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: WARN, HVDTRAIN_STOP_WAIT_S: '50'"),
     r"env HVDTRAIN_STOP_WAIT_S is set by the render from kubernetes.termination_grace_s \(120 s, less 10 s\)"),
    (lambda t: t + "    HVDTRAIN_STOP_WAIT_S: {secret: s, key: k}\n",
     r"kubernetes.secret_env HVDTRAIN_STOP_WAIT_S is set by the render .* remove it from kubernetes.secret_env"),
])
def test_what_a_cluster_cannot_take_is_refused_with_the_fix(tmp_path, edit, match):
    with pytest.raises(RenderError, match=match):
        render(tmp_path, edit(FULL))


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.replace("runs/resnet", "runs/resnet, --sigterm, soon"),
     r"job.yaml:3: args\[10\]: pytorch_train.py refuses it: argument --sigterm-grace: --sigterm-grace: expected float"),
    (lambda t: t.replace("runs/resnet", "runs/resnet, --sigterm-grace, nan"),
     r"args\[10\]: .*--sigterm-grace must be 0..3600 seconds, got nan"),
    (lambda t: t.replace("runs/resnet", "runs/resnet, --sigterm-grace=-5"),
     r"args\[10\]: .*--sigterm-grace must be 0..3600 seconds, got -5.0"),
    (lambda t: t.replace('"64"', '"many"'), r"args\[4\]: .*--batch-size: expected int, got 'many'"),
    (lambda t: t.replace("3,224,224", "3,-224,224"), r"args\[2\]: .*--synthetic-shape must be positive integers"),
    (lambda t: t.replace("3,224,224", "3x224x224"), r"args\[2\]: .*--synthetic-shape: expected comma-separated int"),
])
def test_a_recipe_setting_the_recipe_would_refuse_is_refused_before_rendering(tmp_path, edit, match):
    """The recipe's own parser reads its args when the spec loads (hvdtrain/job/recipe.py): what a pod's rank would
    refuse after the cluster started it, the render refuses, naming the spec's line and args entry."""
    with pytest.raises(SpecError, match=match):
        render(tmp_path, edit(FULL))


def test_the_workers_sshd_listens_where_horovodrun_connects(tmp_path):
    for text, opts, port in ((FULL, K8sOptions(), "2222"), (FULL + "ssh: {port: 22}\n", K8sOptions(), "22"),
                             (FULL, K8sOptions(ssh_port=2200), "2200")):
        obj = render(tmp_path, text, opts)
        launcher = pods(obj)["Launcher"]["containers"][0]["command"]
        assert pods(obj)["Worker"]["containers"][0]["command"] == ["/usr/local/bin/hvdtrain-entrypoint", "sshd", "-p",
                                                                   port]
        assert launcher[3] == port and launcher[launcher.index("--ssh-port") + 1] == port


def test_plain_env_lets_a_name_that_only_looks_secret_through(tmp_path):
    text = FULL.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: WARN, HF_HUB_DISABLE_IMPLICIT_TOKEN: '1'")
    with pytest.raises(RenderError, match=r"if it is not a credential, list it in kubernetes\.plain_env"):
        render(tmp_path, text)
    env = pods(render(tmp_path, text + "  plain_env: [HF_HUB_DISABLE_IMPLICIT_TOKEN]\n"))["Launcher"]
    assert {"name": "HF_HUB_DISABLE_IMPLICIT_TOKEN", "value": "1"} in env["containers"][0]["env"]
    # MPI passes variables by name: verbose is fine there.
    assert render(tmp_path, FULL + "horovod: {verbose: true}\ncontroller: mpi\n")
    path = tmp_path / "verbose.yaml"
    path.write_text(FULL + "horovod: {verbose: true}\n")
    assert render_file("k8s", path, ClusterOptions(name="job", controller="mpi"), K8sOptions())


def test_a_secret_value_never_reaches_the_manifest(tmp_path):
    text = FULL.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: WARN, AWS_SESSION_TOKEN: sekrit-value")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert main(["render", "k8s", str(path), "--output", str(tmp_path / "out.yaml")]) == 2
    assert not (tmp_path / "out.yaml").exists()
    # In secret_env instead, only its name and key are written.
    text = FULL.replace("    AWS_SECRET", "    AWS_SESSION_TOKEN: {secret: s3-creds, key: token}\n    AWS_SECRET")
    path.write_text(text)
    assert main(["render", "k8s", str(path), "--output", str(tmp_path / "out.yaml")]) == 0
    out = (tmp_path / "out.yaml").read_text()
    assert "sekrit" not in out and "secretKeyRef:\n" in out
    assert "# Needs, in the job's namespace: the PersistentVolumeClaim hvdtrain-runs (mounted on the workers at " \
        "/runs), the Secret s3-creds.\n" in out
    both = FULL.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: WARN, AWS_ACCESS_KEY_ID: x")
    with pytest.raises(RenderError, match="AWS_ACCESS_KEY_ID"):
        render(tmp_path, both)


def test_a_workers_memory_holds_its_shm_and_is_requested_and_limited(tmp_path, validator):
    obj = render(tmp_path, FULL + "  memory: 96Gi\n")
    worker = pods(obj)["Worker"]
    assert worker["containers"][0]["resources"] == {"requests": {"memory": "96Gi"},
                                                    "limits": {"nvidia.com/gpu": 8, "memory": "96Gi"}}
    assert "resources" not in pods(obj)["Launcher"]["containers"][0]
    assert not sorted(validator.iter_errors(obj), key=str)
    kubernetes_validate.validate(as_pod_template(worker), K8S_VERSION, strict=True)
    # /dev/shm (8448Mi here) counts against it: a limit it fills is refused, with both sizes.
    with pytest.raises(RenderError, match=r"kubernetes.memory 8Gi is not more than the workers' /dev/shm \(8448Mi, "
                                          r"auto: .*Raise kubernetes.memory .* or lower kubernetes.shm_size"):
        render(tmp_path, FULL + "  memory: 8Gi\n")
    assert render(tmp_path, FULL + "  memory: 8Gi\n  shm_size: 4Gi\n")
    path = tmp_path / "job.yaml"
    for memory, said in (("  memory: 100G\n", "(100G: kubernetes.memory)."),
                         ("", "(no limit set: kubernetes.memory).")):
        path.write_text(FULL + memory)
        assert main(["render", "k8s", str(path), "--output", str(tmp_path / "out.yaml")]) == 0
        assert f"rounded up); it counts against the pod's memory {said}\n" in (tmp_path / "out.yaml").read_text()
    assert [quantity_bytes(q) for q in ("16Gi", "512Mi", "2G", "1.5Ki", "100", "3k", "1.5G")] == [
        16 * 2**30, 512 * 2**20, 2e9, 1536, 100, 3000, 1.5e9]
    for bad in ("1e3", "96gi", "96m", "Gi"):
        with pytest.raises(ValueError, match="not a Kubernetes quantity"):
            quantity_bytes(bad)


def test_a_workers_cores_are_requested_and_limited(tmp_path, validator):
    cpu = FULL.replace("gpus_per_rank: 1\n", "") + "  cpu: 16\n  memory: 64Gi\n"  # `16`: a YAML number
    worker = pods(render(tmp_path, cpu))["Worker"]
    both = {"cpu": "16", "memory": "64Gi"}
    assert worker["containers"][0]["resources"] == {"requests": both, "limits": both}  # Guaranteed QoS
    kubernetes_validate.validate(as_pod_template(worker), K8S_VERSION, strict=True)
    worker = pods(render(tmp_path, FULL + "  cpu: 3500m\n"))["Worker"]
    assert worker["containers"][0]["resources"] == {"requests": {"cpu": "3500m"},
                                                    "limits": {"cpu": "3500m", "nvidia.com/gpu": 8}}
    assert "resources" not in pods(render(tmp_path, FULL.replace("gpus_per_rank: 1\n", "")))["Worker"]["containers"][0]


def render_text(tmp_path, text: str, remote_dir: str | None = None) -> tuple[str, list[str]]:
    """(the launcher's command, the header's Needs lines) of a spec written to tmp_path/job.yaml."""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    out = render_file("k8s", path, ClusterOptions(name="job", remote_dir=remote_dir), K8sOptions())
    command = yaml.safe_load(out)["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    return shlex.join(command), [line for line in out.splitlines() if line.startswith("# Needs: ")]


def test_a_shipped_recipe_runs_as_the_images_copy_and_every_path_the_pods_lack_is_listed_with_the_fix(tmp_path):
    # The spec names this machine's recipe: the pods run the image's copy, and need nothing more.
    local = FULL.replace("../recipes/pytorch_train.py", str(REPO / "recipes" / "pytorch_train.py"))
    command, needs = render_text(tmp_path, local)
    assert " /opt/hvdtrain/recipes/pytorch_train.py --dataset synthetic" in command and str(REPO) not in command
    assert needs == []
    assert render_text(tmp_path, (REPO / "jobs" / "k8s.yaml").read_text())[1] == []  # the shipped job: none either
    # A changed copy is a script of the user's (its flags are its own: a new one renders): listed, with what to do.
    (tmp_path / "pytorch_train.py").write_text((REPO / "recipes" / "pytorch_train.py").read_text() + "# mine\n")
    mine = FULL.replace("../recipes/pytorch_train.py", "pytorch_train.py").replace("runs/resnet", "runs/resnet, --mine")
    command, needs = render_text(tmp_path, mine + "  shm_size: 16Gi\n")
    assert " /opt/hvdtrain/jobs/pytorch_train.py --dataset synthetic" in command and command.endswith(" --mine")
    assert needs == ["# Needs: the script /opt/hvdtrain/jobs/pytorch_train.py, which the image built from "
                     "docker/Dockerfile does not hold (a pod sees none of this machine's files): bake it into an "
                     "image built FROM it (COPY ... /opt/hvdtrain/jobs/pytorch_train.py), or copy it to the run "
                     "volume hvdtrain-runs and name it under /runs."]
    with pytest.raises(SpecError, match=r"args\[10\]: pytorch_train.py refuses it: unrecognized argument: --mine"):
        render_text(tmp_path, local.replace("runs/resnet", "runs/resnet, --mine"))  # the shipped one's are known
    # A shipped recipe's dataset folder of this machine: listed, with what to do.
    command, needs = render_text(tmp_path, local.replace("--dataset, synthetic", "--dataset, /tmp/shards")
                                 + "  shm_size: 16Gi\n")
    assert " /opt/hvdtrain/recipes/pytorch_train.py --dataset /tmp/shards" in command and len(needs) == 1
    assert needs[0].startswith("# Needs: the dataset (--dataset) /tmp/shards, which the image built from ")
    assert needs[0].endswith("(or upload it to a bucket and pass s3://..., with credentials in "
                             "kubernetes.secret_env).")
    # On the run volume (relative to where the ranks start): to be copied there; from a bucket: nothing.
    on_volume = FULL.replace("--dataset, synthetic", "--dataset, data/shards") + "  shm_size: 16Gi\n"
    assert render_text(tmp_path, on_volume)[1] == [
        "# Needs: the dataset (--dataset) /runs/data/shards, on the run volume hvdtrain-runs: copy it there before "
        "the job starts."]
    bucket = FULL.replace("--dataset, synthetic", "--dataset, s3://bucket/shards")
    assert render_text(tmp_path, bucket + "  shm_size: 16Gi\n")[1] == []
    # Relative to the workdir where one is set; a script whose spec lives on the run volume; a file the image holds.
    in_workdir = on_volume.replace("np: 16", "np: 16\nworkdir: /runs/exp")
    assert render_text(tmp_path, in_workdir)[1] == [
        "# Needs: the dataset (--dataset) /runs/exp/data/shards, on the run volume hvdtrain-runs: copy it there "
        "before the job starts."]
    script = "script: train.py\nnp: 2\nkubernetes: {image: r.example/h:1, run_volume: runs, shm_size: 1Gi}\n"
    assert render_text(tmp_path, script, remote_dir="/runs/jobs")[1] == [
        "# Needs: the script /runs/jobs/train.py, on the run volume runs: copy it there before the job starts."]
    assert render_text(tmp_path, script.replace("train.py", "discover_hosts.sh"))[1] == []  # jobs/ of this checkout
    assert render_text(tmp_path, script)[1] == [
        "# Needs: the script /opt/hvdtrain/jobs/train.py, which the image built from docker/Dockerfile does not hold "
        "(a pod sees none of this machine's files): bake it into an image built FROM it (COPY ... "
        "/opt/hvdtrain/jobs/train.py), or copy it to the run volume runs and name it under /runs."]


def test_a_pods_time_to_stop_reaches_kubernetes_and_the_entrypoint(tmp_path):
    # Kubernetes kills a pod terminationGracePeriodSeconds after its SIGTERM (30 s unless set); the entrypoint's
    # wait for the ranks (NOTE [a worker pod's SIGTERM]) ends 10 s before that, on the workers and the launcher.
    entrypoint = (REPO / "docker" / "entrypoint.sh").read_text()
    assert "${HVDTRAIN_STOP_WAIT_S:-300}" in entrypoint
    for text, grace in ((FULL, 120), (FULL + "  termination_grace_s: 900\n", 900)):
        for role, pod in pods(render(tmp_path, text)).items():
            assert pod["terminationGracePeriodSeconds"] == grace, role
            assert pod["containers"][0]["env"][-1] == {"name": "HVDTRAIN_STOP_WAIT_S", "value": str(grace - 10)}, role
    # A rank's own grace is checked against it: 100 s fits in 120 - 10; the header says both.
    path = tmp_path / "job.yaml"
    path.write_text(FULL.replace("runs/resnet", "runs/resnet, --sigterm-grace, '100'"))
    assert main(["render", "k8s", str(path), "--output", str(tmp_path / "out.yaml")]) == 0
    header = (tmp_path / "out.yaml").read_text()
    assert "checkpoint come within --sigterm-grace 100 s (raise it for long steps or big checkpoints); Kubernetes " \
        "kills the pod 120 s after the SIGTERM at most (kubernetes.termination_grace_s).\n" in header
    # The elastic recipe's ranks do not stop on SIGTERM: its --sigterm-grace is not checked, and the header says so;
    # another script is told it must stop by itself.
    for script, said in (("pytorch_elastic.py", "the elastic recipe's ranks end at once (SIGUSR1 asks it to "
                                                "checkpoint)"),
                         ("my_train.py", "the ranks get it (the shipped recipes checkpoint at their next step "
                                         "boundary and exit 75; this script must do so itself)")):
        text = FULL.replace("pytorch_train.py", script).replace("runs/resnet", "runs/resnet, --sigterm-grace, '500'")
        path.write_text(text + "  shm_size: 16Gi\n")
        assert main(["render", "k8s", str(path), "--output", str(tmp_path / "out.yaml")]) == 0, script
        assert f"# A pod's SIGTERM (kubectl delete, a drain, preemption): {said}" in (tmp_path / "out.yaml").read_text()


@pytest.mark.parametrize(("value", "match"), [
    ({"secret_env": {"A": {"secret": "Bad_Name", "key": "k"}}}, r"kubernetes.secret_env.A.secret"),
    ({"run_mount": "runs"}, r"kubernetes.run_mount.*expected an absolute path"),
    ({"shm_size": "big"}, r"kubernetes.shm_size.*'auto' or a Kubernetes quantity"),
    ({"imag": "x"}, r"kubernetes.imag"),
    ({"termination_grace_s": 10}, r"kubernetes.termination_grace_s.*greater than or equal to 20"),
    ({"memory": "lots"}, r"kubernetes.memory.*a Kubernetes quantity such as 64Gi"),
    ({"cpu": "0"}, r"kubernetes.cpu.*cores > 0 .* 3500m"),
    ({"cpu": "4Gi"}, r"kubernetes.cpu.*cores > 0"),
])
def test_bad_kubernetes_section_names_the_key(tmp_path, value, match, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"script": "t.py", "np": 2, "kubernetes": value}))
    assert main(["validate", str(path)]) == 2
    assert re.search(match, capsys.readouterr().err, re.S)


def test_auto_shm_is_what_the_loaders_need(tmp_path):
    worker = pods(render(tmp_path, FULL))["Worker"]
    # 8 ranks x 2 x 4 workers x 3 slots x a 64-sample batch of 3x224x224 float32 + an int64 label, page-rounded:
    batch = math.ceil(64 * (3 * 224 * 224 * 4 + 8) / 4096) * 4096
    need_mib = 8 * 2 * 4 * 3 * batch / 2**20 + 256 + 1024  # + small segments + NCCL
    size = worker["volumes"][0]["emptyDir"]["sizeLimit"]
    assert size == f"{math.ceil(need_mib / 256) * 256}Mi" == "8448Mi"
    # A CPU job (no NCCL share), digits by default, 2 ranks per pod: the small floor.
    cpu = FULL.replace("gpus_per_rank: 1", "gpus_per_rank: 0").replace("np: 16\nhosts: a:8,b:8", "np: 2")
    cpu = cpu.replace('--dataset, synthetic, --synthetic-shape, "3,224,224", ', "")
    assert pods(render(tmp_path, cpu))["Worker"]["volumes"][0]["emptyDir"]["sizeLimit"] == "512Mi"
    # Abbreviated flags count, as the recipes' parser takes them: batches of 4096 samples, 55 GiB a rank.
    big = pods(render(tmp_path, FULL.replace('--batch-size, "64"', '--batch, "4096"')))["Worker"]
    batch = math.ceil(4096 * (3 * 224 * 224 * 4 + 8) / 4096) * 4096
    mib = math.ceil((8 * 2 * 4 * 3 * batch / 2**20 + 256 + 1024) / 256) * 256
    assert big["volumes"][0]["emptyDir"]["sizeLimit"] == f"{mib}Mi"


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.replace("--dataset, synthetic", "--dataset, s3://bucket/imagenet"),
     r"the size of a --dataset s3://bucket/imagenet sample is in its files on the cluster: set "
     r"kubernetes.shm_size .* \(here: 4 worker\(s\) x 3 slots x 64 samples per batch\)"),
    (lambda t: t.replace("pytorch_train.py", "my_train.py"), r"my_train.py is not a shipped recipe"),
])
def test_auto_shm_that_cannot_be_known_asks_for_a_size(tmp_path, edit, match):
    with pytest.raises(RenderError, match=match):
        render(tmp_path, edit(FULL))
    worker = pods(render(tmp_path, edit(FULL), overrides=["kubernetes.shm_size=24Gi"]))["Worker"]
    assert worker["volumes"][0]["emptyDir"]["sizeLimit"] == "24Gi"


def test_the_digits_sample_size_is_the_datasets():
    assert SAMPLE_BYTES["digits"] == digits().train.x[0].nbytes


# The recipe's loader (ShmLoader over arrays, fetch=arrays.take; batches of argv[1] samples) for 2 epochs, the last
# 2 batches held as the prefetcher holds them.
LOADER = textwrap.dedent("""
    import os, sys
    from hvdtrain.data import ShmLoader, SharedMemoryFullError
    from hvdtrain.formats import arrays
    splits = arrays.synthetic((3, 32, 32), 1024, seed=0)
    held = []
    try:
        with ShmLoader(splits.train, rank=0, size=1, batch_size=int(sys.argv[1]), num_workers=2, fetch=arrays.take,
                       epochs=2, timeout=60) as loader:
            for epoch in range(2):
                loader.set_epoch(epoch)
                for batch in loader:
                    held = [*held[-1:], batch]
        print("fits", flush=True)
    except SharedMemoryFullError as exc:
        print("full:", exc, flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a private /dev/shm")
def test_the_auto_size_holds_the_real_loader():
    need = per_rank_bytes(256, 3 * 32 * 32 * 4, 2)  # what auto counts for one such rank: 3 MiB batches

    def run(nbytes: int, batch: int = 256) -> str:
        inner = f"mount -t tmpfs -o size={nbytes} hvdtrain-test /dev/shm && exec \"$0\" -c \"$1\" {batch}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner, sys.executable,
                               LOADER], capture_output=True, text=True, timeout=120, env=env,
                              stdin=subprocess.DEVNULL).stdout
    assert run(need).strip() == "fits"
    # The check can fail: a third of it does not hold the slots' batches. (Half of it, the slots without the x2,
    # holds them or not by timing: a slot's first 1 MiB segment may still be there when it grows to a batch.)
    assert run(need // 3).startswith("full:")
    # Small batches: every slot still starts with a 1 MiB segment.
    small = per_rank_bytes(8, 3 * 32 * 32 * 4, 2)
    assert small == 2 * 2 * 3 * SLOT_BYTES
    assert run(small, batch=8).strip() == "fits"
