"""JobSpec -> an sbatch script. A pure function: spec in, bash text out; every spec value is `shlex.quote`d.

Two launchers:
- `horovodrun` (default): the same command `hvdtrain run` would start, with `-H` built at run time from
  `$SLURM_JOB_NODELIST` (`scontrol show hostnames`). Needs ssh between the allocated nodes (the images' sshd, or
  the cluster's) and hvdtrain at the same path on every node (a shared filesystem or the same image).
- `srun`: Slurm starts the ranks itself (`srun --mpi=pmix`) and Horovod initialises through MPI; no ssh. Horovod
  knobs and `extra_args` are horovodrun flags, so a spec that sets them must use the horovodrun launcher.
`#SBATCH` lines are read by sbatch, not by a shell, so values going there are checked, not quoted.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from hvdtrain.job.model import HorovodKnobs, JobSpec
from hvdtrain.render.common import (
    ClusterOptions,
    Placement,
    RenderError,
    check_name,
    check_renderable,
    horovodrun_argv,
    horovodrun_path,
    ignored_keys,
    placement,
)

LAUNCHERS = ("horovodrun", "srun")
SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.:,=+%@/-]+")
TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}")


@dataclass(frozen=True)
class SlurmOptions:
    launcher: str = "horovodrun"
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    output: str | None = None
    srun_mpi: str = "pmix"


def _sbatch_value(value: str, flag: str, example: str) -> str:
    if not SBATCH_VALUE.fullmatch(value):
        raise RenderError(f"{flag} {value!r} cannot go on an #SBATCH line (sbatch does not unquote it): use letters, "
                          f"digits and _ . : , = + % @ / - only, e.g. {flag} {example}")
    return value


def _directives(lay: Placement, cluster: ClusterOptions, opts: SlurmOptions) -> list[str]:
    lines = [f"#SBATCH --job-name={check_name(cluster.name)}", f"#SBATCH --nodes={lay.nodes}",
             f"#SBATCH --ntasks-per-node={lay.slots_per_node}"]
    if lay.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={lay.gpus_per_node}")
    if opts.cpus_per_task is not None:
        if opts.cpus_per_task < 1:
            raise RenderError(f"--cpus-per-task {opts.cpus_per_task} is not allowed: use an integer >= 1")
        lines.append(f"#SBATCH --cpus-per-task={opts.cpus_per_task}")
    if opts.time is not None:
        if not TIME.fullmatch(opts.time):
            raise RenderError(f"--time {opts.time!r} is not a Slurm time: write MINUTES, HH:MM:SS or D-HH:MM:SS")
        lines.append(f"#SBATCH --time={opts.time}")
    for value, flag, example in ((opts.partition, "--partition", "gpu"), (opts.account, "--account", "proj42")):
        if value is not None:
            lines.append(f"#SBATCH {flag}={_sbatch_value(value, flag, example)}")
    output = opts.output or f"{cluster.name}-%j.out"
    lines.append(f"#SBATCH --output={_sbatch_value(output, '--output', 'logs/%x-%j.out')}")
    return lines


def _horovodrun_lines(spec: JobSpec, lay: Placement, cluster: ClusterOptions) -> list[str]:
    argv, hosts_at = horovodrun_argv(spec, cluster, horovodrun_path(spec, cluster))
    words = [shlex.quote(a) for a in argv]
    words[hosts_at] = '"$HVDTRAIN_HOSTS"'
    return [
        "# -H from the allocation: every node with the same slots.",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"if (( ${{#nodes[@]}} != {lay.nodes} )); then",
        f'  echo "hvdtrain: expected {lay.nodes} node(s), Slurm gave ${{#nodes[@]}}: ${{nodes[*]}}" >&2',
        "  exit 2",
        "fi",
        f"HVDTRAIN_HOSTS=$(printf '%s:{lay.slots_per_node},' \"${{nodes[@]}}\")",
        'HVDTRAIN_HOSTS=${HVDTRAIN_HOSTS%,}',
        "exec " + " ".join(words),
    ]


def _srun_lines(spec: JobSpec, lay: Placement, cluster: ClusterOptions, opts: SlurmOptions) -> list[str]:
    set_knobs = [k for k, v in spec.horovod if v != HorovodKnobs.model_fields[k].default]
    if set_knobs or spec.extra_args or spec.controller == "gloo" or spec.network_interfaces:
        what = ", ".join([f"horovod.{k}" for k in set_knobs] + ["extra_args"] * bool(spec.extra_args)
                         + ["controller: gloo"] * (spec.controller == "gloo")
                         + ["network_interfaces"] * bool(spec.network_interfaces))
        raise RenderError(f"--launcher srun cannot apply {what}: they are horovodrun flags; use --launcher "
                          "horovodrun, or remove them and set the matching HOROVOD_* variables in env:")
    _sbatch_value(opts.srun_mpi, "--srun-mpi", "pmix")
    python = spec.python if "python" in spec.model_fields_set else cluster.python
    argv = ["srun", f"--ntasks={spec.np}", f"--ntasks-per-node={lay.slots_per_node}", f"--mpi={opts.srun_mpi}",
            "--kill-on-bad-exit=1", python, spec.script, *spec.args]
    return ["# Slurm starts the ranks; Horovod initialises through MPI (PMIx).", "exec " + shlex.join(argv)]


def render_slurm(spec: JobSpec, cluster: ClusterOptions, opts: SlurmOptions | None = None, *,
                 source: str = "JOB.yaml") -> str:
    """The sbatch script for a loaded spec."""
    opts = opts or SlurmOptions()
    if opts.launcher not in LAUNCHERS:
        raise RenderError(f"--launcher {opts.launcher!r}: use one of {', '.join(LAUNCHERS)}")
    check_renderable(spec)
    lay = placement(spec, cluster)
    lines = ["#!/usr/bin/env bash", *_directives(lay, cluster, opts),
             f"# Rendered by `hvdtrain render slurm {source}`: edit the job spec and render again.",
             f"# {spec.np} ranks = {lay.nodes} node(s) x {lay.slots_per_node} tasks, {lay.gpus_per_node} GPU(s) per "
             f"node, launcher: {opts.launcher}. Submit: sbatch FILE"]
    lines += [f"# Not used here: {item}" for item in ignored_keys(spec)]
    lines.append("set -euo pipefail")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in spec.env.items()]
    if spec.workdir:
        lines.append(f"cd -- {shlex.quote(spec.workdir)}  # workdir: the ranks start here")
    body = _srun_lines(spec, lay, cluster, opts) if opts.launcher == "srun" else _horovodrun_lines(spec, lay, cluster)
    return "\n".join(lines + body) + "\n"
