"""Render a job spec for a cluster: a Kubeflow MPIJob or an sbatch script.

- `common`: what both renderers share: cluster options, the placement on nodes, the horovodrun argv.
- `k8s`: JobSpec -> a Kubeflow MPI Operator `MPIJob` manifest; `credentials`: which env values it must not write;
  `podpaths`: which of the job's files a pod has; `shmsize`: how big a worker pod's /dev/shm must be.
- `sbatch`: JobSpec -> an sbatch script for Slurm.
- `cmd_render`: `hvdtrain render k8s|slurm JOB.yaml` (its argparse wiring).

Both are pure functions (spec + options -> text) over the same loaded `JobSpec`: the sbatch script runs `hvdtrain
run` on the spec (or srun on its script), the MPIJob the horovodrun argv `hvdtrain run` would
(`hvdtrain.job.plan.build_plan`); `render_file` is the one entry point that reads the spec file.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from pathlib import Path

from hvdtrain.render.common import IMAGE_REMOTE_DIR, ClusterOptions, RenderError, job_name, load_for_cluster
from hvdtrain.render.k8s import K8sOptions, render_k8s
from hvdtrain.render.podpaths import script_in_image
from hvdtrain.render.sbatch import SlurmOptions, SpecOnCluster, render_slurm

TARGETS = ("k8s", "slurm")

__all__ = ["TARGETS", "ClusterOptions", "K8sOptions", "RenderError", "SlurmOptions", "SpecOnCluster", "default_name",
           "render_file", "render_k8s", "render_slurm"]


def render_file(target: str, path: str | Path, cluster: ClusterOptions, target_opts: K8sOptions | SlurmOptions,
                overrides: Sequence[str] = ()) -> str:
    """Load the spec at `path` (relative paths against `cluster.remote_dir`: by default the image's jobs/ for k8s,
    the spec's own folder for Slurm) and render it for `target`."""
    if target == "k8s" and isinstance(target_opts, K8sOptions):
        remote_dir = cluster.remote_dir or IMAGE_REMOTE_DIR
        spec = load_for_cluster(path, remote_dir, overrides)
        spec = script_in_image(spec, Path(path).resolve().parent, remote_dir)  # a shipped recipe: the image's copy
        return render_k8s(spec, cluster, target_opts, source=str(path))
    if target == "slurm" and isinstance(target_opts, SlurmOptions):
        here = Path(path).resolve()  # by default the cluster reads the spec where it is (a shared filesystem)
        remote_dir = cluster.remote_dir or str(here.parent)
        spec = load_for_cluster(path, remote_dir, overrides)
        on_cluster = posixpath.join(remote_dir, Path(path).name) if cluster.remote_dir else str(here)
        run = SpecOnCluster(path=on_cluster, overrides=tuple(overrides))
        return render_slurm(spec, cluster, target_opts, source=str(path), run=run)
    raise RenderError(f"unknown render target {target!r} with {type(target_opts).__name__}: use one of "
                      f"{', '.join(TARGETS)}")


def default_name(path: str | Path) -> str:
    """The job name a spec file gets unless --name is given: its file stem, made DNS-safe."""
    return job_name(Path(path).stem)
