"""JobSpec -> an sbatch script. A pure function: spec in, bash text out; every spec value is `shlex.quote`d.

Two launchers:
- `horovodrun` (default): the script runs `hvdtrain run` on the spec file (with the render's overrides), which
  takes the hosts and slots from the allocation (`hvdtrain.job.allocation`) and starts horovodrun over ssh between
  the nodes: the same console, logs, rank records, verdict and exit codes as anywhere else. Needs ssh between the
  allocated nodes and hvdtrain, the spec and its files at the same paths on every node (a shared filesystem: by
  default the spec's own folder and interpreter here, or `--remote-dir`/`--python`).
- `srun`: the script runs `hvdtrain run --launcher srun`: Slurm starts the ranks (`srun --mpi=pmix`, under
  hvdtrain's supervisor) and Horovod initialises through MPI; no ssh. Horovod knobs and `extra_args` are
  horovodrun flags, so a spec that sets them must use the horovodrun launcher.
`#SBATCH` lines are read by sbatch, not by a shell, so values going there are checked, not quoted.

Time limits and preemption, both launchers: `#SBATCH --signal=B:USR1@N` has Slurm send SIGUSR1 to the batch shell,
which is `hvdtrain run` (exec), N seconds before the time limit; hvdtrain asks the ranks to checkpoint at their
next step boundary and stop (exit 75), and with `--requeue` (`#SBATCH --requeue`, and `--requeue` on its argv)
puts the job back in the queue to resume from the checkpoint, appending to its output file (`--open-mode=append`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from hvdtrain import exitcodes
from hvdtrain.job.model import JobSpec
from hvdtrain.job.plan import srun_problem
from hvdtrain.render.common import (
    ClusterOptions,
    Placement,
    RenderError,
    check_name,
    check_renderable,
    ignored_keys,
    job_python,
    placement,
)

LAUNCHERS = ("horovodrun", "srun")
SBATCH_VALUE = re.compile(r"[A-Za-z0-9_.:,=+%@/-]+")
TIME = re.compile(r"(\d+-)?\d+(:\d{1,2}){0,2}")
SIGNAL_BEFORE_S = 120  # default: enough for a checkpoint at the next step boundary on most jobs
MAX_SIGNAL_S = 65535  # the largest delay `--signal=...@N` takes
SIGNAL_EARLY_S = 60  # Slurm's signal thread runs once a minute: the signal may come up to this much early


@dataclass(frozen=True)
class SlurmOptions:
    launcher: str = "horovodrun"
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    output: str | None = None
    srun_mpi: str = "pmix"
    signal_before: int = SIGNAL_BEFORE_S  # SIGUSR1 this many seconds before the time limit; 0: none
    requeue: bool = True  # `#SBATCH --requeue` and `hvdtrain run --requeue`: a job stopped by it resumes


@dataclass(frozen=True)
class SpecOnCluster:
    """The spec as `hvdtrain run` reads it on the cluster: its path there, and the overrides given to render."""

    path: str
    overrides: tuple[str, ...] = ()


def _sbatch_value(value: str, flag: str, example: str) -> str:
    if not SBATCH_VALUE.fullmatch(value):
        raise RenderError(f"{flag} {value!r} cannot go on an #SBATCH line (sbatch does not unquote it): use letters, "
                          f"digits and _ . : , = + % @ / - only, e.g. {flag} {example}")
    return value


def signal_before_arg(text: str) -> int:
    """`--signal-before SECONDS` as the render CLI takes it."""
    if not text.strip().isdigit():
        raise RenderError(_signal_before_problem(text))
    return int(text)


def _signal_before_problem(value: object) -> str:
    return (f"--signal-before {value!r} is not allowed: use a whole number of seconds from 0 to {MAX_SIGNAL_S} (0: no "
            "signal before the time limit), e.g. --signal-before 300")


def _time_s(text: str) -> int:
    """A Slurm time (MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS[:MINUTES[:SECONDS]]) in seconds."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = (*parts, 0, 0)[:3]
    else:
        hours, minutes, seconds = (0, *parts, 0)[:3] if len(parts) < 3 else parts
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def _preemption(opts: SlurmOptions) -> list[str]:
    """`#SBATCH --signal` (SIGUSR1 before the time limit) and the requeue's lines."""
    before = opts.signal_before
    if isinstance(before, bool) or not isinstance(before, int) or not 0 <= before <= MAX_SIGNAL_S:
        raise RenderError(_signal_before_problem(before))
    limit = _time_s(opts.time) if opts.time is not None else 0  # 0: no time limit
    if before and limit and before + SIGNAL_EARLY_S >= limit:
        below = f"--signal-before below {limit - SIGNAL_EARLY_S}, " if limit > SIGNAL_EARLY_S + 1 else ""
        raise RenderError(f"--signal-before {before} with --time {opts.time} ({limit} s): Slurm may send SIGUSR1 up "
                          f"to {SIGNAL_EARLY_S} s early, so the job could be asked to stop as it starts, and requeued "
                          f"over and over; use {below}a longer --time, or --signal-before 0 (no signal)")
    lines = [f"#SBATCH --signal=B:USR1@{before}"] if before else []
    return lines + (["#SBATCH --requeue", "#SBATCH --open-mode=append"] if opts.requeue else [])


def _preemption_comment(opts: SlurmOptions) -> list[str]:
    """What the script's header says about --signal and --requeue."""
    again = (["# `hvdtrain run --requeue` then requeues the job (scontrol requeue): it resumes from the checkpoint",
              "# and appends to its output file (--open-mode=append)."] if opts.requeue else
             ["# Submit it again to resume from the checkpoint."])
    code = exitcodes.PREEMPTED
    if opts.signal_before:
        return [f"# Slurm sends SIGUSR1 {opts.signal_before} s before the time limit (it may be up to "
                f"{SIGNAL_EARLY_S} s early) to the batch shell (B:), which",
                "# is hvdtrain run: it asks the ranks to checkpoint at their next step boundary and stop "
                f"(exit {code}).",
                *again]
    if opts.requeue:
        return ["# No signal before the time limit (--signal-before 0); a job asked to stop with `scancel --batch "
                "--signal=USR1 JOBID`", f"# exits {code} and is requeued."]
    return []


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
    return lines + _preemption(opts)


def _run_argv(spec: JobSpec, cluster: ClusterOptions, run: SpecOnCluster) -> list[str]:
    """`hvdtrain run` on the spec file as the cluster sees it, with the render's overrides (the launcher's flags
    and `--requeue` follow)."""
    argv = [job_python(spec, cluster.python or spec.python), "-m", "hvdtrain.cli", "run", run.path]
    for override in run.overrides:
        argv += ["-o", override]
    argv += ["-o", "hosts=null", "-o", "hostfile=null"]  # the allocation's nodes, whatever the spec names
    if cluster.controller and not spec.controller:
        argv += ["-o", f"controller={cluster.controller}"]
    return argv


def _hvdtrain_lines(spec: JobSpec, lay: Placement, cluster: ClusterOptions, opts: SlurmOptions,
                    run: SpecOnCluster) -> list[str]:
    argv = [*_run_argv(spec, cluster, run), *(["--requeue"] if opts.requeue else [])]
    return [f"# hvdtrain run: {lay.nodes} host(s) x {lay.slots_per_node} slots from the allocation "
            "(SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE), then horovodrun (Gloo: ssh to the other nodes).",
            "exec " + shlex.join(argv)]


def _srun_lines(spec: JobSpec, cluster: ClusterOptions, opts: SlurmOptions, run: SpecOnCluster) -> list[str]:
    controller = spec.controller or cluster.controller
    problem = srun_problem(spec.model_copy(update={"controller": controller}))
    if problem:
        raise RenderError(f"--launcher srun: {problem.removeprefix('the srun launcher ')}")
    _sbatch_value(opts.srun_mpi, "--srun-mpi", "pmix")
    argv = [*_run_argv(spec, cluster, run), "--launcher", "srun", "--srun-mpi", opts.srun_mpi,
            *(["--requeue"] if opts.requeue else [])]
    return ["# hvdtrain run: srun starts the ranks on the allocation (output labelled by rank); Horovod initialises "
            "through MPI.", "exec " + shlex.join(argv)]


def render_slurm(spec: JobSpec, cluster: ClusterOptions, opts: SlurmOptions | None = None, *,
                 source: str = "JOB.yaml", run: SpecOnCluster | None = None) -> str:
    """The sbatch script for a loaded spec; `run` is the spec file on the cluster (default: `source`)."""
    opts = opts or SlurmOptions()
    if opts.launcher not in LAUNCHERS:
        raise RenderError(f"--launcher {opts.launcher!r}: use one of {', '.join(LAUNCHERS)}")
    check_renderable(spec)
    lay = placement(spec, cluster)
    srun = opts.launcher == "srun"
    lines = ["#!/usr/bin/env bash", *_directives(lay, cluster, opts),
             f"# Rendered by `hvdtrain render slurm {source}`: edit the job spec and render again.",
             f"# {spec.np} ranks = {lay.nodes} node(s) x {lay.slots_per_node} tasks, {lay.gpus_per_node} GPU(s) per "
             f"node, launcher: {opts.launcher}. Submit: sbatch FILE"]
    lines += [f"# Not used here: {item}" for item in ignored_keys(spec, logs=False)]
    lines += [*_preemption_comment(opts), "set -euo pipefail"]
    run = run or SpecOnCluster(source)
    body = _srun_lines(spec, cluster, opts, run) if srun else _hvdtrain_lines(spec, lay, cluster, opts, run)
    return "\n".join(lines + body) + "\n"
