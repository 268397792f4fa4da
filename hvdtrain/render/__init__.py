"""Render a job spec for a cluster: a Kubeflow MPIJob (`k8s.py`) or an sbatch script (`slurm.py`).

Both are pure functions (spec + options -> text) over the same loaded `JobSpec` and the same horovodrun argv as
`hvdtrain run` (`hvdtrain.job.plan.build_plan`); `render_file` is the one entry point that reads the spec file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hvdtrain.render.common import ClusterOptions, RenderError, job_name, load_for_cluster
from hvdtrain.render.k8s import K8sOptions, render_k8s
from hvdtrain.render.slurm import SlurmOptions, render_slurm

TARGETS = ("k8s", "slurm")

__all__ = ["TARGETS", "ClusterOptions", "K8sOptions", "RenderError", "SlurmOptions", "default_name", "render_file",
           "render_k8s", "render_slurm"]


def render_file(target: str, path: str | Path, cluster: ClusterOptions, target_opts: K8sOptions | SlurmOptions,
                overrides: Sequence[str] = ()) -> str:
    """Load the spec at `path` (relative paths against `cluster.remote_dir`) and render it for `target`."""
    spec = load_for_cluster(path, cluster.remote_dir, overrides)
    if target == "k8s" and isinstance(target_opts, K8sOptions):
        return render_k8s(spec, cluster, target_opts, source=str(path))
    if target == "slurm" and isinstance(target_opts, SlurmOptions):
        return render_slurm(spec, cluster, target_opts, source=str(path))
    raise RenderError(f"unknown render target {target!r} with {type(target_opts).__name__}: use one of "
                      f"{', '.join(TARGETS)}")


def default_name(path: str | Path) -> str:
    """The job name a spec file gets unless --name is given: its file stem, made DNS-safe."""
    return job_name(Path(path).stem)
