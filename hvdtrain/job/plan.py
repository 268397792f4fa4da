"""JobSpec -> LaunchPlan(argv, env): the exact horovodrun command a job runs. A pure function: no I/O.

Every rank runs as `python -m hvdtrain.rank SCRIPT ARGS...`: a supervisor that runs the script as `python SCRIPT
ARGS...` would, through hvdtrain.rank_main, and records how it ended (hvdtrain.records).
Hosts always reach horovodrun as `-H a:4,b:4` (the spec's hostfile was parsed by hvdtrain: horovodrun's own
hostfile parser crashes on blank and `#` lines). `env` is what hvdtrain adds to its own environment when starting
horovodrun, which forwards it to every rank (Gloo: the rank's environment; MPI: `mpirun -x NAME`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from hvdtrain.job.flags import model_flags
from hvdtrain.job.hosts import hosts_arg, is_loopback, parse_hosts, rank_hosts, total_slots
from hvdtrain.job.model import HorovodKnobs, JobSpec

CONTROLLERS = ("gloo", "mpi")
SRUN_MPI = re.compile(r"[A-Za-z0-9_]{1,32}")
RANK_MODULE = "hvdtrain.rank"
# Open MPI's out-of-band TCP keepalive, for MPI jobs with remote hosts. With Open MPI's defaults a host whose link
# is cut leaves mpirun waiting for many minutes, every process still alive; with these it aborts
# the job ~16 s after the host stops answering. horovodrun passes OMPI_MCA_* to mpirun and every orted; a value
# set in the spec's env wins.
MPI_REMOTE_ENV = {"OMPI_MCA_oob_tcp_keepalive_time": "10", "OMPI_MCA_oob_tcp_keepalive_intvl": "2",
                  "OMPI_MCA_oob_tcp_keepalive_probes": "3"}


@dataclass(frozen=True)
class LaunchPlan:
    """What `hvdtrain run` starts: argv (never through a shell) and the variables it adds to the environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    rank_hosts: tuple[str, ...] = ()  # host of each rank (Horovod fills hosts' slots in order); () when elastic
    elastic: bool = False
    hosts_at: int | None = None  # index in argv of the -H value (renderers put the cluster's hosts there)
    cwd: str | None = None  # folder horovodrun (and so every rank) starts in; None: hvdtrain's own
    launcher: str = "horovodrun"  # or "srun": Slurm starts the ranks, each line labelled `N: ` (srun --label)

    def describe(self) -> str:
        """Dry-run text: the command (shell-quoted for display only) and the environment it adds."""
        lines = ["# working directory", shlex.quote(self.cwd)] if self.cwd else []
        lines += ["# command", shlex.join(self.argv), "# environment added (forwarded to every rank)"]
        lines += [f"{name}={shlex.quote(value)}" for name, value in sorted(self.env.items())] or ["(none)"]
        return "\n".join(lines)


def _flag_args(model: BaseModel, **values: Any) -> list[str]:
    """The flags of `model`'s keys, in declaration order (hvdtrain.job.flags); `values` replace keys' values."""
    args: list[str] = []
    for key, flag in model_flags(type(model)).items():
        args += flag.args(values[key] if key in values else getattr(model, key))
    return args


def elastic_args(spec: JobSpec) -> list[str]:
    el = spec.elastic
    if el is None:
        return []
    return _flag_args(el, min_np=el.min_np or spec.np, max_np=el.max_np or spec.np)


def build_plan(spec: JobSpec, *, controller: str, horovodrun: str = "horovodrun") -> LaunchPlan:
    """The horovodrun argv and env for a loaded spec. `controller` is spec.controller or the detected default."""
    if controller not in CONTROLLERS:
        raise ValueError(f"controller must be one of {CONTROLLERS}, got {controller!r}")
    top = model_flags(JobSpec)
    argv = [horovodrun, *top["np"].args(spec.np)]
    ranks: tuple[str, ...] = ()
    hosts_at = None
    if spec.elastic is None:
        hosts = spec.hosts or f"localhost:{spec.np}"
        argv += top["hosts"].args(hosts)
        hosts_at = len(argv) - 1
        ranks = tuple(rank_hosts(parse_hosts(hosts), spec.np))
    argv.append(f"--{controller}")
    if spec.network_interfaces:
        argv += top["network_interfaces"].args(",".join(spec.network_interfaces))
    argv += _flag_args(spec.ssh) + _flag_args(spec.horovod) + elastic_args(spec) + list(spec.extra_args)
    # Each rank runs under hvdtrain's supervisor (NOTE [no orphans] in hvdtrain/rank.py): it ends the rank when
    # the job's launcher side is gone, which nothing else does for a Gloo rank on another host.
    argv += [spec.python, "-m", RANK_MODULE, spec.script, *spec.script_args]
    env = dict(spec.env)
    if controller == "mpi" and any(not is_loopback(h) for h in ranks):
        env = {**MPI_REMOTE_ENV, **env}
    return LaunchPlan(argv=argv, env=env, rank_hosts=ranks, elastic=spec.elastic is not None, hosts_at=hosts_at,
                      cwd=spec.workdir)


def srun_problem(spec: JobSpec) -> str | None:
    """Why srun cannot start this spec's ranks (horovodrun-only settings), or None."""
    knobs = [f"horovod.{k}" for k, v in spec.horovod if v != HorovodKnobs.model_fields[k].default]
    what = [*knobs, *["extra_args"] * bool(spec.extra_args), *["controller: gloo"] * (spec.controller == "gloo"),
            *["network_interfaces"] * bool(spec.network_interfaces), *["elastic"] * (spec.elastic is not None)]
    if not what:
        return None
    return (f"the srun launcher cannot apply {', '.join(what)}: they are horovodrun settings (srun starts the ranks "
            "and Horovod initialises through MPI); use the horovodrun launcher, or remove them and set the matching "
            "HOROVOD_* variables in env:")


def build_srun_plan(spec: JobSpec, *, mpi: str = "pmix", cpus_per_task: str | None = None,
                    srun: str = "srun") -> LaunchPlan:
    """Slurm starts the ranks (`srun --mpi=MPI`) on the allocation that `spec.hosts` came from, each under hvdtrain's
    supervisor, and Horovod initialises through MPI. `--kill-on-bad-exit` ends the others when a rank fails (they
    would wait in a collective); the job's exit code then comes from the ranks' records, as with horovodrun.
    `cpus_per_task`: the job's SLURM_CPUS_PER_TASK (Slurm 22.05's srun does not inherit --cpus-per-task)."""
    problem = srun_problem(spec)
    if problem:
        raise ValueError(problem)
    if not SRUN_MPI.fullmatch(mpi):
        raise ValueError(f"srun --mpi {mpi!r} is not a plugin name (letters, digits, _): e.g. pmix, pmi2")
    hosts = parse_hosts(spec.hosts or f"localhost:{spec.np}")
    if spec.np != total_slots(hosts):  # srun would spread fewer ranks its own way, not as the verdict's hosts say
        raise ValueError(f"the srun launcher runs one rank per task of the allocation: np = {spec.np} but it has "
                         f"{total_slots(hosts)} task(s) ({hosts_arg(hosts)}); set np to {total_slots(hosts)} "
                         f"(-o np={total_slots(hosts)}), ask Slurm for {spec.np} tasks, or use the horovodrun launcher")
    # --disable-status: SIGINT goes to the tasks (NOTE [srun signals] in hvdtrain/launch/runner.py)
    # --export=ALL: the ranks need this environment (records, the spec's env) even under sbatch --export=NONE.
    argv = [srun, "--label", "--disable-status", "--export=ALL", f"--ntasks={spec.np}", f"--mpi={mpi}",
            "--kill-on-bad-exit=1", *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else []),
            spec.python, "-m", RANK_MODULE, spec.script, *spec.script_args]
    # Slurm signals every process of the step: the supervisors must not pass a second copy on (hvdtrain/rank.py).
    env = {**spec.env, "HVDTRAIN_SLURM_SIGNALS": "1"}
    return LaunchPlan(argv=argv, env=env, rank_hosts=tuple(rank_hosts(hosts, spec.np)), cwd=spec.workdir,
                      launcher="srun")
