"""Which of a job's files a Kubernetes pod has: the image built from docker/Dockerfile holds this checkout's
recipes/, jobs/, hostfiles/, docker/, scripts/ and hvdtrain/ under IMAGE_ROOT, the run volume holds what was put
on it, and nothing else of this machine reaches a pod.

NOTE [paths in the pod]: a spec written for `hvdtrain run` names files on this machine. The render maps the one
path it can: a script that is a shipped recipe (same name, same bytes as this checkout's recipes/) runs as the
image's copy. The script and a shipped recipe's --dataset, where the stock image does not hold them, are listed in
the manifest's header under "Needs" with what to do (bake it into an image built FROM it, put it on the run
volume, or use a bucket): a pod started without it fails only when the rank opens it. Listed, not refused: an
image of the user's own may hold it. Paths on the run volume are listed too (they must be copied there). A URL
(s3://, gs://, http(s)://) is read by the ranks themselves.
"""

from __future__ import annotations

import posixpath
from pathlib import Path, PurePosixPath

from hvdtrain.job.model import JobSpec
from hvdtrain.job.recipe import checkout, same_as_shipped
from hvdtrain.render.common import IMAGE_ROOT

IMAGE_DIRS = ("recipes", "jobs", "hostfiles", "docker", "scripts", "hvdtrain")
IMAGE_RECIPES = f"{IMAGE_ROOT}/recipes"
BUILTIN_DATASETS = ("digits", "synthetic")  # hvdtrain.train.recipe_data: made in memory, no files


def shipped_recipe(local: Path) -> str | None:
    """The image's path of the shipped recipe that the file `local` on this machine is (same name and bytes)."""
    return f"{IMAGE_RECIPES}/{local.name}" if local.is_file() and same_as_shipped(local) else None


def script_in_image(spec: JobSpec, local_dir: Path, remote_dir: str) -> JobSpec:
    """The spec with its script mapped to the image's copy when the file it names here is a shipped recipe
    (NOTE [paths in the pod]). `local_dir`: the spec's folder here; relative paths were resolved against
    `remote_dir`."""
    script = spec.script
    beside = local_dir / posixpath.relpath(script, remote_dir)  # a relative path, as the spec here names it
    image_path = shipped_recipe(beside if beside.is_file() else Path(script))
    if image_path is None or image_path == script:
        return spec
    return spec.model_copy(update={"script": image_path})


def _in_image(path: str) -> bool:
    """A path under IMAGE_ROOT that the image built from this checkout holds (no checkout here, an installed wheel:
    the recipes are taken as held, nothing else)."""
    inside = PurePosixPath(path).relative_to(IMAGE_ROOT).parts
    if not inside or inside[0] not in IMAGE_DIRS:
        return False
    root = checkout()
    return inside[0] == "recipes" if root is None else root.joinpath(*inside).exists()


def _on_volume(path: str, mount: str) -> bool:
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def _need(what: str, path: str, run_volume: str, mount: str) -> str | None:
    """The header's line for one path in the pods, or None when the image holds it."""
    if _on_volume(path, mount):
        return f"{what} {path}, on the run volume {run_volume}: copy it there before the job starts"
    if path.startswith(IMAGE_ROOT + "/") and _in_image(path):
        return None
    return (f"{what} {path}, which the image built from docker/Dockerfile does not hold (a pod sees none of this "
            f"machine's files): bake it into an image built FROM it (COPY ... {path}), or copy it to the run volume "
            f"{run_volume} and name it under {mount}")


def pod_needs(spec: JobSpec, dataset: str | None, cwd: str, run_volume: str, mount: str) -> list[str]:
    """What the pods need beyond the image and the run volume's claim, one line each (NOTE [paths in the pod]).
    `dataset`: a shipped recipe's --dataset (None: another script, whose args hvdtrain cannot read); `cwd`: where the
    ranks start."""
    needs = [_need("the script", spec.script, run_volume, mount)]
    remote = dataset is not None and "://" in dataset  # the ranks read it from its store
    if dataset is not None and dataset not in BUILTIN_DATASETS and not remote:
        path = posixpath.normpath(posixpath.join(cwd, dataset))
        line = _need("the dataset (--dataset)", path, run_volume, mount)
        if line and not _on_volume(path, mount):
            line += " (or upload it to a bucket and pass s3://..., with credentials in kubernetes.secret_env)"
        needs.append(line)
    return [line for line in needs if line]
