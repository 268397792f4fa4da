"""JobSpec -> a Kubeflow MPI Operator `MPIJob` (kubeflow.org/v2beta1) manifest. A pure function: spec in, YAML out.

The operator starts `nodes` worker pods and one launcher pod, puts an ssh key pair in /root/.ssh of each, and
writes the workers' `host slots=N` lines to /etc/mpi/hostfile on the launcher. The workers run the image's sshd
(`hvdtrain-entrypoint sshd`, port `--ssh-port`; a worker pod's SIGTERM goes to its ranks, which checkpoint at a
step boundary: NOTE [a worker pod's SIGTERM] in docker/entrypoint.sh); the launcher runs the same horovodrun
command `hvdtrain run` would (through `hvdtrain-horovodrun`), with `--hostfile /etc/mpi/hostfile` in place of `-H`.

What the spec's `kubernetes` section gives (the render's --image, --namespace, --pull-policy and --shm-size override
it): the image, which must be set; the PersistentVolumeClaim of the run directory, mounted on every worker pod
where the ranks start, which must be set too, so that checkpoints outlive the pods; credentials, as
`valueFrom.secretKeyRef` on the launcher (an env value that looks like a credential is refused); each worker's
/dev/shm, a memory-backed emptyDir sized from what its ranks' loaders need (`shmsize.py`); the pods'
terminationGracePeriodSeconds, which bounds how long a stop may take (the entrypoint's HVDTRAIN_STOP_WAIT_S is set
STOP_MARGIN_S under it, and a recipe's --sigterm-grace must fit under that). Horovod forwards the
launcher's environment (the spec's `env` and those Secrets' values) to every rank: over ssh on the command line
with Gloo, by name (`mpirun -x`) with MPI.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml
from pydantic import ValidationError

from hvdtrain.job.model import JobSpec, Kubernetes, quantity_bytes
from hvdtrain.job.recipe import shipped_settings
from hvdtrain.render.common import (
    IMAGE_PYTHON,
    IMAGE_ROOT,
    IMAGE_SSH_PORT,
    ClusterOptions,
    Placement,
    RenderError,
    check_name,
    check_renderable,
    horovodrun_argv,
    ignored_keys,
    placement,
    recipe_settings,
)
from hvdtrain.render.credentials import credential_problem
from hvdtrain.render.podpaths import pod_needs
from hvdtrain.render.shmsize import ShmSize, shm_size

API_VERSION = "kubeflow.org/v2beta1"
OPERATOR_HOSTFILE = "/etc/mpi/hostfile"
ENTRYPOINT = "/usr/local/bin/hvdtrain-entrypoint"
RUN_VOLUME = "runs"
HVDTRAIN_HOROVODRUN = "hvdtrain-horovodrun"  # the image's hvdtrain console script (pyproject.toml)
STOP_WAIT_ENV = "HVDTRAIN_STOP_WAIT_S"  # how long the entrypoint waits for the ranks after a SIGTERM
STOP_MARGIN_S = 10  # the entrypoint gives up this long before Kubernetes' SIGKILL, so the pod still ends by itself
WORKER_WAIT_S = 900  # how long the launcher waits for every worker's sshd (pulling a GPU image takes minutes)
# Paths a run volume may not be mounted at or over: the image's venv, the operator's ssh keys and hostfile, devices.
RESERVED = (IMAGE_ROOT, "/root/.ssh", "/etc/mpi", "/dev", "/proc", "/sys", "/usr", "/bin", "/lib")


@dataclass(frozen=True)
class K8sOptions:
    """The render command's flags; None: the spec's `kubernetes` section (`--image X` is `-o kubernetes.image=X`)."""

    image: str | None = None
    namespace: str | None = None
    image_pull_policy: str | None = None
    shm_size: str | None = None
    ssh_port: int = IMAGE_SSH_PORT  # the image's sshd, where the spec's ssh.port is unset


def _check(spec: JobSpec, controller: str) -> Kubernetes:
    k8s = spec.kubernetes
    if k8s.image is None:
        raise RenderError("kubernetes.image is not set: the pods need an image the cluster can pull. Build "
                          "docker/Dockerfile, push it to your registry and name it in the spec (kubernetes: {image: "
                          "registry.example.com/team/hvdtrain:gpu}) or with --image")
    if k8s.run_volume is None:
        raise RenderError("kubernetes.run_volume is not set: without a PersistentVolumeClaim the run directory "
                          "(checkpoints, summary.json) lives in a pod and is lost with it. Create a claim "
                          "(ReadWriteMany when there are several workers) and name it (kubernetes: {run_volume: "
                          f"hvdtrain-runs}}, mounted at kubernetes.run_mount, {k8s.run_mount})")
    mount = k8s.run_mount.rstrip("/") or "/"
    covers = "the whole image" if mount == "/" else \
        next((p for p in RESERVED if p == mount or p.startswith(mount + "/")), None)
    inside = next((p for p in RESERVED if mount.startswith(p + "/")), None)
    if covers or inside:
        where = f"would cover {covers}" if covers else f"is inside {inside}"
        raise RenderError(f"kubernetes.run_mount {k8s.run_mount!r} {where} in the pods (the image's venv, the "
                          "operator's ssh keys and hostfile, system folders): mount the run volume at a folder of its "
                          "own, e.g. /runs (the default)")
    if STOP_WAIT_ENV in spec.env or STOP_WAIT_ENV in k8s.secret_env:
        where = "env" if STOP_WAIT_ENV in spec.env else "kubernetes.secret_env"
        raise RenderError(f"{where} {STOP_WAIT_ENV} is set by the render from kubernetes.termination_grace_s "
                          f"({k8s.termination_grace_s} s, less {STOP_MARGIN_S} s): remove it from {where} and set "
                          "kubernetes.termination_grace_s instead")
    problem = credential_problem(spec, controller)
    if problem:
        raise RenderError(problem)
    return k8s


def _run_dir_problem(spec: JobSpec, given: str, cwd: str, mount: str) -> str | None:
    """Why the recipe's --run-dir would not be on the run volume, or None."""
    run_dir = posixpath.normpath(posixpath.join(cwd, given))
    if run_dir == mount or run_dir.startswith(mount.rstrip("/") + "/"):
        return None
    return (f"the run directory {run_dir} is not on the run volume (kubernetes.run_mount {mount}), so its "
            f"checkpoints would be lost with the pod: use a relative --run-dir, or one under {mount}"
            + (", and a workdir under it (or none)" if spec.workdir else ""))


def _grace_problem(grace: float, k8s: Kubernetes) -> str | None:
    """Why a rank's --sigterm-grace would not fit in the pods' time to stop, or None."""
    if grace < k8s.termination_grace_s - STOP_MARGIN_S:
        return None
    return (f"args --sigterm-grace {grace:g} does not fit in the pods' time to stop: kubernetes.termination_grace_s "
            f"{k8s.termination_grace_s} s, less the entrypoint's {STOP_MARGIN_S} s, so a pod would be killed while its "
            "ranks still wait to checkpoint. Raise kubernetes.termination_grace_s (e.g. -o "
            f"kubernetes.termination_grace_s={int(grace) + 2 * STOP_MARGIN_S}) or lower --sigterm-grace")


def _env(spec: JobSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": name, "value": value} for name, value in spec.env.items()]
    env += [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}}
            for name, ref in spec.kubernetes.secret_env.items()]
    return env


def _stop_wait(k8s: Kubernetes) -> dict[str, Any]:
    """The entrypoint's wait for the ranks after a SIGTERM (NOTE [a worker pod's SIGTERM] in docker/entrypoint.sh)."""
    return {"name": STOP_WAIT_ENV, "value": str(k8s.termination_grace_s - STOP_MARGIN_S)}


def _container(name: str, k8s: Kubernetes, command: list[str], env: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": k8s.image, "imagePullPolicy": k8s.pull_policy,
                                 "command": command}
    if env:
        container["env"] = env
    return container


def _run_volume(k8s: Kubernetes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the pod's volume, the container's mount) of the run directory's claim."""
    return ({"name": RUN_VOLUME, "persistentVolumeClaim": {"claimName": k8s.run_volume}},
            {"name": RUN_VOLUME, "mountPath": k8s.run_mount})


def ssh_port(spec: JobSpec, opts: K8sOptions) -> int:
    """Where the workers' sshd listens and horovodrun connects: the spec's ssh.port, else --ssh-port (2222)."""
    return spec.ssh.port or opts.ssh_port


def _launcher(spec: JobSpec, cluster: ClusterOptions, opts: K8sOptions) -> dict[str, Any]:
    python = cluster.python or IMAGE_PYTHON
    argv, hosts_at = horovodrun_argv(spec, python, opts.ssh_port, cluster.controller)
    # hvdtrain's horovodrun (the same code without its framework probe: hvdtrain/launch/hvdrun.py), in the image.
    argv[0] = str(PurePosixPath(argv[0]).with_name(HVDTRAIN_HOROVODRUN))
    argv[hosts_at - 1: hosts_at + 1] = ["--hostfile", OPERATOR_HOSTFILE]
    # The operator starts the launcher with the workers: it waits until every worker's sshd takes connections
    # (horovodrun's own ssh check tries 5 times at once, and the launcher runs once).
    command = [ENTRYPOINT, "wait-ssh", OPERATOR_HOSTFILE, str(ssh_port(spec, opts)), str(WORKER_WAIT_S), "--", *argv]
    k8s = spec.kubernetes
    container = _container("launcher", k8s, command, [*_env(spec), _stop_wait(k8s)])
    # horovodrun starts the ranks in its own folder on the workers: the run volume there, unless the spec says
    # otherwise. The launcher itself writes nothing there, so it does not mount the claim (one worker: ReadWriteOnce).
    container["workingDir"] = spec.workdir or k8s.run_mount
    pod = {"containers": [container], "terminationGracePeriodSeconds": k8s.termination_grace_s}
    return {"replicas": 1, "restartPolicy": "Never", "template": {"spec": pod}}


def _worker(spec: JobSpec, lay: Placement, shm: ShmSize, port: int) -> dict[str, Any]:
    k8s = spec.kubernetes
    container = _container("worker", k8s, [ENTRYPOINT, "sshd", "-p", str(port)],  # -p: over the image's Port
                           [_stop_wait(k8s)])
    # requests = limits: a worker evicted for memory under load would stop the whole job; with both set the pods are
    # Guaranteed, the last evicted (and, for a whole number of cores, pinned ones under the static CPU manager policy)
    requests = {key: value for key, value in (("cpu", k8s.cpu), ("memory", k8s.memory)) if value}
    limits: dict[str, Any] = {"nvidia.com/gpu": lay.gpus_per_node} if lay.gpus_per_node else {}
    if requests or limits:
        container["resources"] = {**({"requests": requests} if requests else {}), "limits": {**requests, **limits}}
    # /dev/shm is 64 MiB in a pod by default: too small for NCCL and hvdtrain's shared-memory loader.
    volume, mount = _run_volume(k8s)
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}, mount]
    pod = {"containers": [container], "terminationGracePeriodSeconds": k8s.termination_grace_s,
           "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm.quantity}}, volume]}
    return {"replicas": lay.nodes, "restartPolicy": "Never", "template": {"spec": pod}}


FLAGS = {"image": "--image", "namespace": "--namespace", "pull_policy": "--pull-policy", "shm_size": "--shm-size"}


def with_flags(spec: JobSpec, opts: K8sOptions) -> JobSpec:
    """The spec with the render command's --image, --namespace, --pull-policy and --shm-size in its `kubernetes`
    section (checked as the spec's own values are)."""
    given = {"image": opts.image, "namespace": opts.namespace, "pull_policy": opts.image_pull_policy,
             "shm_size": opts.shm_size}
    given = {key: value for key, value in given.items() if value is not None}
    if not given:
        return spec
    try:
        k8s = Kubernetes.model_validate({**spec.kubernetes.model_dump(), **given})
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = FLAGS.get(str(err["loc"][0]), str(err["loc"][0]))
        raise RenderError(f"{flag} {given.get(str(err['loc'][0]))!r}: {err['msg'].removeprefix('Value error, ')}"
                          ) from None
    return spec.model_copy(update={"kubernetes": k8s})


@dataclass(frozen=True)
class Rendered:
    """The MPIJob and what its header says: the spec with the render's flags in, its placement, its /dev/shm."""

    obj: dict[str, Any]
    spec: JobSpec
    lay: Placement
    shm: ShmSize
    sigterm_grace: float | None  # a shipped recipe's --sigterm-grace; None: another script, or the elastic recipe
    needs: list[str]  # what the pods need beyond the image and the run volume's claim (podpaths.pod_needs)


def _render(spec: JobSpec, cluster: ClusterOptions, opts: K8sOptions) -> Rendered:
    spec = with_flags(spec, opts)
    check_renderable(spec)
    lay = placement(spec, cluster)
    name = check_name(cluster.name)
    k8s = _check(spec, spec.controller or cluster.controller or "gloo")  # horovodrun_argv's controller
    grace, dataset = None, None
    settings = recipe_settings(spec)  # NOTE [one reader of recipe settings]
    if settings is not None:
        grace, dataset = (settings.sigterm_grace if settings.stops_on_sigterm else None), settings.dataset
        problem = _run_dir_problem(spec, settings.run_dir, spec.workdir or k8s.run_mount, k8s.run_mount) \
            or (_grace_problem(grace, k8s) if grace is not None else None)
        if problem:
            raise RenderError(problem)
    needs = pod_needs(spec, dataset, spec.workdir or k8s.run_mount, str(k8s.run_volume), k8s.run_mount)
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "hvdtrain"}}
    if k8s.namespace:
        metadata["namespace"] = k8s.namespace
    shm = shm_size(spec, lay.slots_per_node, lay.gpus_per_node)
    if k8s.memory and quantity_bytes(shm.quantity) >= quantity_bytes(k8s.memory):
        raise RenderError(f"kubernetes.memory {k8s.memory} is not more than the workers' /dev/shm ({shm.quantity}, "
                          f"{shm.why}), which counts against it: nothing would be left for the ranks. Raise "
                          "kubernetes.memory (to /dev/shm plus what the ranks and their producers need) or lower "
                          "kubernetes.shm_size")
    obj = {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": metadata,
        "spec": {
            "slotsPerWorker": lay.slots_per_node,
            "mpiImplementation": "OpenMPI",
            "sshAuthMountPath": "/root/.ssh",
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0},
            "mpiReplicaSpecs": {"Launcher": _launcher(spec, cluster, opts),
                                "Worker": _worker(spec, lay, shm, ssh_port(spec, opts))},
        },
    }
    return Rendered(obj, spec, lay, shm, grace, needs)


def mpijob(spec: JobSpec, cluster: ClusterOptions, opts: K8sOptions | None = None) -> dict[str, Any]:
    """The MPIJob object for a loaded spec (see `render_k8s` for the YAML text)."""
    return _render(spec, cluster, opts or K8sOptions()).obj


def _sigterm_words(spec: JobSpec, grace: float | None) -> str:
    """What a worker pod's SIGTERM does to the ranks, for the manifest's header."""
    if grace is not None:
        return ("the ranks checkpoint at their next step boundary and exit 75 if that boundary and the checkpoint "
                f"come within --sigterm-grace {grace:g} s (raise it for long steps or big checkpoints)")
    if shipped_settings(spec) is not None:  # the elastic recipe: SIGTERM drops a rank
        return ("the elastic recipe's ranks end at once (SIGUSR1 asks it to checkpoint); the job resumes from its "
                "last checkpoint")
    return ("the ranks get it (the shipped recipes checkpoint at their next step boundary and exit 75; this script "
            "must do so itself)")


def render_k8s(spec: JobSpec, cluster: ClusterOptions, opts: K8sOptions | None = None, *,
               source: str = "JOB.yaml") -> str:
    """The MPIJob manifest as YAML text, with a header naming its source, what it needs and what it leaves out."""
    out = _render(spec, cluster, opts or K8sOptions())
    spec, lay, k8s = out.spec, out.lay, out.spec.kubernetes
    secrets = "".join(f", the Secret {name}" for name in sorted({r.secret for r in k8s.secret_env.values()}))
    header = [f"# Rendered by `hvdtrain render k8s {source}`: edit the job spec and render again.",
              f"# {spec.np} ranks = {lay.nodes} worker pod(s) x {lay.slots_per_node} slots, "
              f"{lay.gpus_per_node} GPU(s) per worker. Needs the Kubeflow MPI Operator (v2beta1 API).",
              f"# Needs, in the job's namespace: the PersistentVolumeClaim {k8s.run_volume} (mounted on the workers "
              f"at {k8s.run_mount}){secrets}.",
              *[f"# Needs: {line}." for line in out.needs],
              f"# /dev/shm per worker: {out.shm.quantity} ({out.shm.why}); it counts against the pod's memory"
              + (f" ({k8s.memory}: kubernetes.memory)." if k8s.memory else " (no limit set: kubernetes.memory)."),
              f"# A pod's SIGTERM (kubectl delete, a drain, preemption): {_sigterm_words(spec, out.sigterm_grace)}; "
              f"Kubernetes kills the pod {k8s.termination_grace_s} s after the SIGTERM at most "
              "(kubernetes.termination_grace_s).",
              "# Submit: kubectl apply -f FILE; follow: kubectl logs -f job/<name>-launcher"]
    header += [f"# Not used here: {item}" for item in ignored_keys(spec)]
    return "\n".join(header) + "\n" + yaml.safe_dump(out.obj, sort_keys=False, default_flow_style=False, width=1000)
