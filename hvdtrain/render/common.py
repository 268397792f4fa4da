"""What the Kubernetes and Slurm renderers share: cluster options, the placement on nodes, and the horovodrun argv.

A job spec's relative paths are relative to the spec file *on the cluster* (`remote_dir`): for Slurm, by default,
the spec's own folder here (a cluster's login node and compute nodes share a filesystem); for Kubernetes, the
image's jobs/ folder. The sbatch script runs `hvdtrain run` on the spec there; the MPIJob's launcher runs the
horovodrun argv of `hvdtrain.job.plan.build_plan`. Nothing here reads files (but the spec and its hostfile),
starts a process or touches the network.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hvdtrain.job.hosts import parse_hosts
from hvdtrain.job.load import load_spec
from hvdtrain.job.model import JobSpec
from hvdtrain.job.plan import build_plan
from hvdtrain.job.recipe import settings_of
from hvdtrain.settings.parse import ArgsError
from hvdtrain.settings.recipes import RecipeConfig
from hvdtrain.textfile import read_text

# Where the images in docker/ keep the checkout and its venv, and the sshd port they listen on (Kubernetes).
IMAGE_ROOT = "/opt/hvdtrain"
IMAGE_REMOTE_DIR = f"{IMAGE_ROOT}/jobs"
IMAGE_PYTHON = f"{IMAGE_ROOT}/.venv/bin/python"
IMAGE_SSH_PORT = 2222
DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?")


class RenderError(ValueError):
    """A spec or an option that cannot be rendered for the cluster; the message names the value and the fix."""


@dataclass(frozen=True)
class ClusterOptions:
    """How the job maps onto the cluster. None means: derive it (see `placement`), or the target's default
    (remote_dir, python: the spec's own folder and interpreter for Slurm, the image's for Kubernetes)."""

    name: str = "hvdtrain"
    remote_dir: str | None = None
    python: str | None = None
    nodes: int | None = None
    slots_per_node: int | None = None
    gpus_per_node: int | None = None
    controller: str | None = None


@dataclass(frozen=True)
class Placement:
    nodes: int
    slots_per_node: int
    gpus_per_node: int


def job_name(text: str) -> str:
    """A Kubernetes/Slurm-safe job name from a file stem: lowercase, [a-z0-9-], at most 40 characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40].strip("-")
    return name or "hvdtrain"


def check_name(name: str) -> str:
    if not DNS_LABEL.fullmatch(name):
        raise RenderError(f"job name {name!r} is not usable: it names the MPIJob, its pods and the Slurm job; "
                          "use 1-40 lowercase letters, digits and '-', starting and ending with a letter or digit "
                          "(e.g. --name resnet-8gpu)")
    return name


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise RenderError(f"{flag} {value} is not allowed: it must be an integer >= 1")


def placement(spec: JobSpec, opts: ClusterOptions) -> Placement:
    """Nodes x slots for `spec.np` ranks. Slots per node: the option, else the spec's hosts when they all have the
    same slots, else np (one node). GPUs per node: the option, else the spec's gpus_per_rank x slots (0: none)."""
    _positive(opts.nodes, "--nodes")
    _positive(opts.slots_per_node, "--slots-per-node")
    if opts.gpus_per_node is not None and opts.gpus_per_node < 0:
        raise RenderError(f"--gpus-per-node {opts.gpus_per_node} is not allowed: use 0 (CPU job) or more")
    slots = opts.slots_per_node
    if slots is None and opts.nodes is not None:
        slots = -(-spec.np // opts.nodes)
    if slots is None:
        counts = {h.slots for h in parse_hosts(spec.hosts)} if spec.hosts else set()
        slots = counts.pop() if len(counts) == 1 else spec.np
        slots = min(slots, spec.np)
    if spec.np % slots:
        raise RenderError(f"np = {spec.np} does not fill nodes of {slots} slots evenly; every node runs the same "
                          f"number of ranks: set np to a multiple of {slots} (-o np=...) or --slots-per-node to a "
                          f"divisor of {spec.np}")
    nodes = spec.np // slots
    if opts.nodes is not None and opts.nodes != nodes:
        raise RenderError(f"--nodes {opts.nodes} with {slots} slots per node gives {opts.nodes * slots} ranks, "
                          f"but np = {spec.np}: set np to {opts.nodes * slots} (-o np=...) or change --nodes")
    gpus = spec.gpus_per_rank * slots if opts.gpus_per_node is None else opts.gpus_per_node
    return Placement(nodes=nodes, slots_per_node=slots, gpus_per_node=gpus)


def check_renderable(spec: JobSpec) -> None:
    if spec.elastic is not None:
        raise RenderError("elastic jobs cannot be rendered: the MPI Operator and Slurm start a fixed set of nodes "
                          "and the discovery script would run on the cluster; remove the elastic section "
                          "(with -o elastic=null) or launch it with `hvdtrain run`")


def horovodrun_argv(spec: JobSpec, python: str, ssh_port: int, controller: str | None) -> tuple[list[str], int]:
    """build_plan's argv for the cluster, and the index of the `-H` value the renderer replaces. `python`,
    `ssh_port` and `controller` apply where the spec sets none."""
    if not 1 <= ssh_port <= 65535:
        raise RenderError(f"--ssh-port {ssh_port} is not a port: use 1..65535 (the images' sshd listens on "
                          f"{IMAGE_SSH_PORT})")
    ssh = spec.ssh if spec.ssh.port is not None else spec.ssh.model_copy(update={"port": ssh_port})
    # Any host will do for -H: the renderer replaces its value (at plan.hosts_at) with the cluster's hosts. One
    # slot, so that no np is too large for it.
    cluster = spec.model_copy(update={"hosts": "cluster-hosts:1", "hostfile": None, "python": job_python(spec, python),
                                      "ssh": ssh, "elastic": None})
    # The same default as `hvdtrain run` where Horovod has Gloo (the images' build has both).
    plan = build_plan(cluster, controller=spec.controller or controller or "gloo",
                      horovodrun=horovodrun_path(spec, python))
    assert plan.hosts_at is not None  # build_plan's invariant (not input): a plan that is not elastic has -H
    return plan.argv, plan.hosts_at


def job_python(spec: JobSpec, default: str) -> str:
    """The spec's interpreter when it sets one, else `default` (the cluster's)."""
    return spec.python if "python" in spec.model_fields_set else default


def horovodrun_path(spec: JobSpec, python: str) -> str:
    """horovodrun beside the job's interpreter (a venv's bin/) when that is a path, else from PATH."""
    python = job_python(spec, python)
    return str(PurePosixPath(python).parent / "horovodrun") if "/" in python else "horovodrun"


def ignored_keys(spec: JobSpec, *, logs: bool = True) -> list[str]:
    """Spec keys the rendered job does not honour: named in the rendered file's header so nobody expects them."""
    ignored = []
    if logs and (spec.logs.dir or spec.logs.timestamp or spec.logs.console_ranks is not None):
        ignored.append("logs (rank output goes to the launcher's output)")
    if spec.hosts and spec.hosts != f"localhost:{spec.np}":
        ignored.append(f"hosts/hostfile ({spec.hosts}: the cluster picks the nodes)")
    return ignored


def _local_file(local_dir: Path, remote_dir: str) -> Callable[[str], Path]:
    """Where this machine has a path resolved against remote_dir: in the spec's folder here, else the path itself
    (an absolute path in the spec)."""
    def find(path: str) -> Path:
        local = local_dir / posixpath.relpath(path, remote_dir)
        return local if local.is_file() else Path(path)
    return find


def load_for_cluster(path: str | Path, remote_dir: str, overrides: Sequence[str] = ()) -> JobSpec:
    """Load a spec file with its relative paths resolved against `remote_dir` (the spec's folder on the cluster).

    Files are not checked here: they live on the cluster. The hostfile, if any, is read from this machine.
    """
    from hvdtrain.job.load import read_spec_text

    if not remote_dir.startswith("/"):
        raise RenderError(f"--remote-dir {remote_dir!r} must be an absolute path on the cluster (the folder that "
                          "holds the job spec there)")
    text = read_spec_text(path)
    find = _local_file(Path(path).resolve().parent, remote_dir)
    return load_spec(text, str(path), base_dir=remote_dir, overrides=overrides, read_text=lambda p: read_text(find(p)),
                     check_files=False, local_file=find)


def recipe_settings(spec: JobSpec) -> RecipeConfig | None:
    """A shipped recipe's settings (`hvdtrain.job.recipe.settings_of`: NOTE [one reader of recipe settings]); a spec
    that did not come through load_spec may still hold arguments the recipe refuses: a RenderError."""
    try:
        return settings_of(spec)
    except ArgsError as exc:
        raise RenderError(f"{spec.script}: its arguments are refused by the recipe: {exc}; `hvdtrain validate` "
                          "shows the spec entry") from None
