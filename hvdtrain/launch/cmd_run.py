"""`hvdtrain run JOB.yaml`: spec -> LaunchPlan -> the checks this machine must pass (preflight.py) -> run it
(runner.py), or print it with --dry-run; hvdtrain/cli.py adds it with one call. Inside a Slurm allocation a spec
without hosts runs on the allocation's nodes (hvdtrain.job.allocation), started by horovodrun or, with `--launcher
srun`, by srun; with `--requeue` a job that stopped to be resumed (exit 75, after SIGUSR1: NOTE [job shutdown] in
runner.py) is put back in Slurm's queue.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from hvdtrain import exitcodes

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
    p.add_argument("--requeue", action="store_true",
                   help=f"in a Slurm batch job: when the job stops to be resumed (exit {exitcodes.PREEMPTED}, after "
                        "SIGUSR1), requeue it with `scontrol requeue` so that it resumes from the checkpoint "
                        "(`hvdtrain render slurm` adds this)")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from hvdtrain.job.allocation import Allocation, allocation_from_env, srun_task_problem
    from hvdtrain.job.load import load_spec_file
    from hvdtrain.launch.preflight import LaunchError, check_rank_module, check_run_dir, requeue_problem
    from hvdtrain.launch.runner import run_plan
    from hvdtrain.launch.stops import StopRequests

    if args.requeue and (problem := requeue_problem(os.environ)):
        raise LaunchError(problem)
    # From here on SIGUSR1 asks the ranks to stop and never kills hvdtrain (not for --dry-run: nothing runs).
    stops = None if args.dry_run else StopRequests().install()
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
    check_run_dir(spec)
    code = run_plan(plan, spec.logs, timeout_s=args.timeout, ssh=spec.ssh, stops=stops)
    if args.requeue and code == exitcodes.PREEMPTED:
        requeue_slurm_job(os.environ["SLURM_JOB_ID"])
    return code


def _plan(args: argparse.Namespace, spec: JobSpec, in_allocation: bool) -> LaunchPlan:
    """horovodrun's plan, or srun's (`--launcher srun`: only inside the allocation the spec's hosts came from)."""
    from hvdtrain.job.plan import build_plan, build_srun_plan
    from hvdtrain.launch.preflight import LaunchError, default_controller, find_horovodrun

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


REQUEUE_TIMEOUT_S = 30.0


def requeue_slurm_job(job_id: str) -> bool:
    """`scontrol requeue JOB_ID` once the job stopped to be resumed: Slurm runs the batch script again and the ranks
    resume from their checkpoint. What happened is printed; a failure is not an error (hvdtrain still exits 75).

    Requeueing a running job makes Slurm end its batch step, hvdtrain included, with SIGTERM: the job has ended,
    so from here on SIGTERM is ignored, and hvdtrain says what it did and exits 75."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    argv = ["scontrol", "requeue", job_id]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=REQUEUE_TIMEOUT_S, check=False,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        why = "scontrol is not on PATH"
    except subprocess.TimeoutExpired:
        why = f"scontrol did not answer within {REQUEUE_TIMEOUT_S:g} s"
    except OSError as exc:
        why = f"cannot run scontrol: {exc.strerror or exc}"
    else:
        if proc.returncode == 0:
            print(f"hvdtrain: requeued Slurm job {job_id}: it runs again and resumes from the checkpoint",
                  file=sys.stderr, flush=True)
            return True
        said = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        why = f"it exited with code {proc.returncode}: {said}"
    print(f"hvdtrain: could not requeue Slurm job {job_id} ({shlex.join(argv)}: {why}); submit the job again to "
          "resume from the checkpoint", file=sys.stderr, flush=True)
    return False
