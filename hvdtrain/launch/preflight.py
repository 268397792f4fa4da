"""What this machine must have before a job starts, checked before anything starts (`hvdtrain run`, cmd_run.py):
an interpreter for the ranks that imports Horovod (the default controller comes from its build) and hvdtrain's rank
module, a horovodrun to start them, a shipped recipe's run directory no other job here holds, and for `--requeue` a
Slurm job to requeue. Each failure is a LaunchError (exit 2) that says what to change; runner.py, which runs the
plan, raises it too when a start fails.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hvdtrain import exitcodes
from hvdtrain.doctor import probe
from hvdtrain.job.plan import RANK_MODULE

if TYPE_CHECKING:
    from hvdtrain.job.model import JobSpec

HVDRUN = "hvdtrain-horovodrun"  # console script of hvdtrain.launch.hvdrun


class LaunchError(RuntimeError):
    """The job cannot be started on this machine (no horovodrun, Horovod not importable); exit code 2."""


def default_controller(python: str, *, save: bool = True) -> str:
    """Gloo when `python`'s Horovod has it (it also runs elastic jobs), else MPI (hvdtrain.doctor.probe; `save=False`
    writes no cache)."""
    build = probe.horovod_build(python, save=save)
    built = build.controllers()
    if built.get("gloo"):
        return "gloo"
    if built.get("mpi"):
        return "mpi"
    if not build.built:
        why = "; ".join(f"{part}: {error}" for part, error in build.errors.items()) or "no framework's ops are built"
        raise LaunchError(no_horovod(python, why))
    raise LaunchError(f"Horovod under {python} was built with neither Gloo nor MPI; rerun scripts/setup.sh")


def no_horovod(python: str, why: str) -> str:
    """The interpreter the ranks would run cannot import Horovod: which one was probed, and the two fixes."""
    path = python if "/" in python else (shutil.which(python) or python)  # a bare name is looked up on PATH
    other = "" if os.path.abspath(path) == os.path.abspath(sys.executable) else (
        f" (e.g. {sys.executable}, the one running hvdtrain, if it has Horovod)")
    venv = Path(path).absolute().parent.parent
    install = (f"`HVDTRAIN_VENV={venv} bash scripts/setup.sh` installs Horovod into that venv"
               if (venv / "pyvenv.cfg").is_file() else
               "`bash scripts/setup.sh` makes .venv with Horovod in it: point `python:` at its bin/python")
    return (f"the job's interpreter {python} cannot import Horovod ({why}); it is the spec's `python:` key (default: "
            f"the Python running hvdtrain): set `python:` to an interpreter that has Horovod{other}; or, from the "
            f"hvdtrain checkout, {install}")


def check_rank_module(python: str) -> None:
    """Every rank runs `python -m hvdtrain.rank`: say so before starting anything if `python` lacks hvdtrain (not
    asked of the interpreter running this, which has it: the same file in the same folder, a venv's included)."""
    here = Path(sys.executable).absolute()
    if "/" in python and Path(python).parent == here.parent and os.path.realpath(python) == os.path.realpath(here):
        return
    try:
        proc = subprocess.run([python, "-c", f"import {RANK_MODULE}"], capture_output=True, text=True,
                              timeout=probe.PROBE_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"cannot run the job's interpreter {python}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise LaunchError(f"{python} cannot import {RANK_MODULE}, which starts every rank ({last}); install "
                          f"hvdtrain into that interpreter (pip install -e <hvdtrain checkout>) or set `python:` "
                          f"in the spec to one that has it")


def find_horovodrun() -> str:
    """What starts the ranks: hvdtrain-horovodrun next to this interpreter when it has Horovod (horovodrun without
    its build probe: hvdtrain.launch.hvdrun), else horovodrun next to it (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent
    if os.access(here / HVDRUN, os.X_OK) and importlib.util.find_spec("horovod") is not None:
        return str(here / HVDRUN)
    sibling = here / "horovodrun"
    if os.access(sibling, os.X_OK):
        return str(sibling)
    found = shutil.which("horovodrun")
    if found is None:
        raise LaunchError("horovodrun not found next to this Python or on PATH; run scripts/setup.sh")
    return found



def check_run_dir(spec: JobSpec) -> None:
    """Refuse at once, before any process starts, when another job on this machine holds a shipped recipe's run
    directory (its --run-dir, default included, where the ranks start: NOTE [one reader of recipe settings])."""
    from hvdtrain.job.recipe import settings_of
    from hvdtrain.rundir import busy_message, held_here

    settings = settings_of(spec)
    if settings is None:
        return
    run_dir = os.path.join(spec.workdir or os.getcwd(), settings.run_dir)
    holder = held_here(run_dir)
    if holder is not None:
        raise LaunchError(busy_message(run_dir, holder))


def requeue_problem(env: Mapping[str, str]) -> str | None:
    """Why `--requeue` cannot work here (no Slurm job to requeue); None when it can."""
    if env.get("SLURM_JOB_ID"):
        return None
    return ("--requeue puts this Slurm job back in the queue when it stops to be resumed (exit "
            f"{exitcodes.PREEMPTED}), but SLURM_JOB_ID is not set: this is not running in a Slurm job. Use --requeue "
            "in an sbatch script (`hvdtrain render slurm JOB.yaml` adds it), or leave it out")
