"""`hvdtrain run JOB.yaml`: spec -> LaunchPlan -> run it (or print it with --dry-run); hvdtrain/cli.py adds it with
one call. Inside a Slurm allocation a spec without hosts runs on the allocation's nodes (hvdtrain.job.slurm), started
by horovodrun or, with `--launcher srun`, by srun.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hvdtrain.job.model import JobSpec
    from hvdtrain.job.plan import LaunchPlan


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               add_job_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `run` to hvdtrain's subcommands (`add_job_args`: the JOB.yaml and -o arguments `validate` shares)."""
    p = sub.add_parser("run", help="launch a job spec with horovodrun, or srun in a Slurm allocation (--dry-run: "
                                   "print the command only)")
    add_job_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the exact argv and added env; start nothing")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop the whole job after this long (exit code 124)")
    p.add_argument("--launcher", choices=("horovodrun", "srun"), default="horovodrun",
                   help="what starts the ranks: horovodrun (default; over ssh on other hosts) or, inside a Slurm "
                        "allocation, srun (Horovod through MPI)")
    p.add_argument("--srun-mpi", default="pmix", metavar="PLUGIN", help="srun --mpi plugin (default pmix)")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from hvdtrain.job.load import load_spec_file
    from hvdtrain.job.slurm import Allocation, allocation_from_env, srun_task_problem
    from hvdtrain.launch.runner import LaunchError, check_rank_module, run_plan

    problem = srun_task_problem(os.environ)
    if problem:
        raise LaunchError(problem)
    found: list[Allocation | None] = []  # asked only for a spec that names no hosts

    def allocation() -> Allocation | None:
        found.append(allocation_from_env(os.environ))
        return found[-1]

    spec = load_spec_file(args.job, args.override, check_files=True, allocation=allocation)
    slurm = found[0].describe() if found and found[0] is not None else None
    plan = _plan(args, spec, slurm is not None)
    if args.dry_run:
        print((f"# {slurm}\n" if slurm else "") + plan.describe())
        return 0
    if slurm:
        print(f"hvdtrain: {slurm}", file=sys.stderr)
    check_rank_module(spec.python)
    check_run_dir(spec.args)
    return run_plan(plan, spec.logs, timeout_s=args.timeout, ssh=spec.ssh)


def _plan(args: argparse.Namespace, spec: JobSpec, in_allocation: bool) -> LaunchPlan:
    """horovodrun's plan, or srun's (`--launcher srun`: only inside the allocation the spec's hosts came from)."""
    from hvdtrain.job.plan import build_plan, build_srun_plan
    from hvdtrain.launch.runner import LaunchError, default_controller, find_horovodrun

    if args.launcher == "srun":
        if not in_allocation:
            raise LaunchError("--launcher srun starts the ranks on a Slurm allocation's nodes: run it in an sbatch "
                              "script or a salloc shell, for a spec that sets no hosts or hostfile (the allocation "
                              "gives them)")
        try:
            cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
            return build_srun_plan(spec, mpi=args.srun_mpi, cpus_per_task=cpus if cpus.isdigit() else None)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    controller = spec.controller or default_controller(spec.python, save=not args.dry_run)  # a dry run writes nothing
    return build_plan(spec, controller=controller, horovodrun=find_horovodrun())


def check_run_dir(script_args: list[str]) -> None:
    """Refuse at once, before any process starts, when another job on this machine holds the run directory."""
    from hvdtrain.launch.runner import LaunchError
    from hvdtrain.rundir import busy_message, held_here, run_dir_arg

    run_dir = run_dir_arg(script_args)
    if not run_dir:
        return
    holder = held_here(run_dir)
    if holder is not None:
        raise LaunchError(busy_message(run_dir, holder))
