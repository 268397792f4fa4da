"""JobSpec -> a Kubeflow MPI Operator `MPIJob` (kubeflow.org/v2beta1) manifest. A pure function: spec in, YAML out.

The operator starts `nodes` worker pods and one launcher pod, puts an ssh key pair in /root/.ssh of each, and
writes the workers' `host slots=N` lines to /etc/mpi/hostfile on the launcher. The workers run the image's sshd
(`hvdtrain-entrypoint sshd`, port `--ssh-port`); the launcher runs the same horovodrun command `hvdtrain run`
would, with `--hostfile /etc/mpi/hostfile` in place of `-H`. Horovod forwards the launcher's environment (the
spec's `env`) to every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from hvdtrain.job.model import JobSpec
from hvdtrain.render.common import (
    IMAGE_PYTHON,
    IMAGE_SSH_PORT,
    ClusterOptions,
    Placement,
    RenderError,
    check_name,
    check_renderable,
    horovodrun_argv,
    ignored_keys,
    placement,
)

API_VERSION = "kubeflow.org/v2beta1"
OPERATOR_HOSTFILE = "/etc/mpi/hostfile"
ENTRYPOINT = "/usr/local/bin/hvdtrain-entrypoint"
# Kubernetes quantities, as the CRD's pattern allows (e.g. 16Gi, 500M).
QUANTITY = r"^[0-9]+(\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$"


@dataclass(frozen=True)
class K8sOptions:
    image: str = "hvdtrain:gpu"
    namespace: str | None = None
    image_pull_policy: str = "IfNotPresent"
    shm_size: str = "16Gi"
    ssh_port: int = IMAGE_SSH_PORT  # the image's sshd, where the spec's ssh.port is unset


def _check(opts: K8sOptions) -> None:
    if not opts.image or any(c.isspace() for c in opts.image):
        raise RenderError(f"--image {opts.image!r} is not an image reference; e.g. --image "
                          "registry.example.com/hvdtrain:gpu (build it from docker/Dockerfile)")
    if opts.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
        raise RenderError(f"--pull-policy {opts.image_pull_policy!r}: use Always, IfNotPresent or Never")
    if not re.fullmatch(QUANTITY, opts.shm_size):
        raise RenderError(f"--shm-size {opts.shm_size!r} is not a Kubernetes quantity; write e.g. 16Gi or 512Mi")
    if opts.namespace is not None and not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", opts.namespace):
        raise RenderError(f"--namespace {opts.namespace!r} is not a Kubernetes namespace name: 1-63 lowercase "
                          "letters, digits and '-', starting and ending with a letter or digit")


def _env(spec: JobSpec) -> list[dict[str, str]]:
    return [{"name": name, "value": value} for name, value in spec.env.items()]


def _container(name: str, image: str, pull: str, command: list[str], env: list[dict[str, str]]) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": image, "imagePullPolicy": pull, "command": command}
    if env:
        container["env"] = env
    return container


def _launcher(spec: JobSpec, cluster: ClusterOptions, opts: K8sOptions) -> dict[str, Any]:
    argv, hosts_at = horovodrun_argv(spec, cluster.python or IMAGE_PYTHON, opts.ssh_port, cluster.controller)
    argv[hosts_at - 1: hosts_at + 1] = ["--hostfile", OPERATOR_HOSTFILE]
    container = _container("launcher", opts.image, opts.image_pull_policy, argv, _env(spec))
    if spec.workdir:
        container["workingDir"] = spec.workdir  # horovodrun's ranks start in the same folder on the workers
    return {"replicas": 1, "restartPolicy": "Never", "template": {"spec": {"containers": [container]}}}


def _worker(spec: JobSpec, lay: Placement, opts: K8sOptions) -> dict[str, Any]:
    container = _container("worker", opts.image, opts.image_pull_policy, [ENTRYPOINT, "sshd"], _env(spec))
    if lay.gpus_per_node:
        container["resources"] = {"limits": {"nvidia.com/gpu": lay.gpus_per_node}}
    # /dev/shm is 64 MiB in a pod by default: too small for NCCL and hvdtrain's shared-memory loader.
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    pod = {"containers": [container],
           "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}}]}
    return {"replicas": lay.nodes, "restartPolicy": "Never", "template": {"spec": pod}}


def mpijob(spec: JobSpec, cluster: ClusterOptions, opts: K8sOptions | None = None) -> dict[str, Any]:
    """The MPIJob object for a loaded spec (see `render_k8s` for the YAML text)."""
    opts = opts or K8sOptions()
    check_renderable(spec)
    _check(opts)
    lay = placement(spec, cluster)
    metadata: dict[str, Any] = {"name": check_name(cluster.name), "labels": {"app.kubernetes.io/name": "hvdtrain"}}
    if opts.namespace:
        metadata["namespace"] = opts.namespace
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": metadata,
        "spec": {
            "slotsPerWorker": lay.slots_per_node,
            "mpiImplementation": "OpenMPI",
            "sshAuthMountPath": "/root/.ssh",
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0},
            "mpiReplicaSpecs": {"Launcher": _launcher(spec, cluster, opts), "Worker": _worker(spec, lay, opts)},
        },
    }


def render_k8s(spec: JobSpec, cluster: ClusterOptions, opts: K8sOptions | None = None, *,
               source: str = "JOB.yaml") -> str:
    """The MPIJob manifest as YAML text, with a header naming its source and what it leaves out."""
    obj = mpijob(spec, cluster, opts)
    lay = placement(spec, cluster)
    header = [f"# Rendered by `hvdtrain render k8s {source}`: edit the job spec and render again.",
              f"# {spec.np} ranks = {lay.nodes} worker pod(s) x {lay.slots_per_node} slots, "
              f"{lay.gpus_per_node} GPU(s) per worker. Needs the Kubeflow MPI Operator (v2beta1 API).",
              "# Submit: kubectl apply -f FILE; follow: kubectl logs -f job/<name>-launcher"]
    header += [f"# Not used here: {item}" for item in ignored_keys(spec)]
    return "\n".join(header) + "\n" + yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, width=1000)
