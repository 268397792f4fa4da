"""How big a worker pod's /dev/shm must be (`kubernetes.shm_size: auto`): what the shipped recipes' loaders need.

A rank's ShmLoader keeps `num_workers` producer processes, each with `prefetch + 1` batch slots in shared memory,
every slot a segment the size of a batch (page-rounded) and at least 1 MiB (the slots' first segments) — what a
rank that runs out is told, by `hvdtrain.data.shm.full_message`. A batch the trainer still holds keeps its segment
while its slot takes a new one, so the need is doubled. Every rank of a worker pod shares its /dev/shm; NCCL's
shared-memory transport between the GPUs of one pod takes its own share. The sizes come from the recipe's own
flags in the spec's args (their defaults, where the args leave them out); a dataset whose sample size is only
known from its files on the cluster cannot be sized here, and the error says what to set instead.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import PurePosixPath

from hvdtrain.job.model import JobSpec
from hvdtrain.render.common import RenderError

PAGE = 4096
PREFETCH = 2  # ShmLoader's default, which the recipes use: prefetch + 1 slots per producer
SLOT_BYTES = 1 << 20  # a slot's first segment (hvdtrain.data.loader.SLOT_BYTES), reserved before the first batch
HEADROOM = 2  # a lent batch's segment plus its slot's new one
BASE_MIB = 256  # small segments (rings, epoch orders), Python's multiprocessing, the rest of the pod's /dev/shm users
NCCL_MIB = 1024  # NCCL's shared-memory transport within a pod with GPUs
LABEL_BYTES = 8  # int64


@dataclass(frozen=True)
class RecipeFlags:
    """A shipped recipe's loader flags and their defaults (tests/render/test_k8s.py checks them against the
    recipes' Config classes)."""

    batch_size: int = 32
    num_workers: int = 1
    accumulates: bool = True  # a batch holds --backward-passes-per-step chunks
    sigterm_grace: float = 4.0  # seconds from a SIGTERM to the stop's checkpoint (hvdtrain.train.preempt)
    stops_on_sigterm: bool = True  # False: SIGTERM ends a rank at once (the elastic recipe: it drops that rank)


RECIPES = {"pytorch_train.py": RecipeFlags(), "pytorch_elastic.py": RecipeFlags(stops_on_sigterm=False),
           "keras_train.py": RecipeFlags(accumulates=False)}
SAMPLE_BYTES = {"digits": 1 * 8 * 8 * 4}  # float32 1×8×8 (hvdtrain.datasets.arrays.digits)


@dataclass(frozen=True)
class ShmSize:
    quantity: str  # what the emptyDir's sizeLimit says
    why: str  # one line for the manifest's header


def _flags(args: list[str], recipe: RecipeFlags) -> argparse.Namespace:
    # Abbreviations allowed, as the recipes' own parser allows them (--batch 64).
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--batch-size", type=int, default=recipe.batch_size)
    parser.add_argument("--num-workers", type=int, default=recipe.num_workers)
    parser.add_argument("--backward-passes-per-step", type=int, default=1)
    parser.add_argument("--synthetic-shape", default="3,32,32")
    try:
        flags, _ = parser.parse_known_args(args)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise RenderError(f"kubernetes.shm_size is 'auto', but the recipe's args do not parse: {exc}; fix args, or "
                          "set kubernetes.shm_size (e.g. -o kubernetes.shm_size=16Gi)") from None
    return flags


def _sample_bytes(flags: argparse.Namespace) -> int | None:
    if flags.dataset == "synthetic":
        try:
            dims = [int(d) for d in flags.synthetic_shape.split(",")]
        except ValueError:
            dims = []
        if not dims or min(dims) < 1:
            raise RenderError(f"--synthetic-shape {flags.synthetic_shape!r} in args is not a sample shape: write "
                              "positive integers C,H,W, e.g. 3,224,224")
        return math.prod(dims) * 4  # float32 (hvdtrain.datasets.arrays.synthetic)
    return SAMPLE_BYTES.get(flags.dataset)


def _mib(nbytes: int) -> float:
    return nbytes / 2**20


def _quantity(mib: int) -> str:
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def per_rank_bytes(batch_samples: int, sample_bytes: int, workers: int) -> int:
    """A rank's loader need: workers × (prefetch + 1) slots × a page-rounded batch (at least SLOT_BYTES), ×
    HEADROOM."""
    batch = max(SLOT_BYTES, -(-batch_samples * (sample_bytes + LABEL_BYTES) // PAGE) * PAGE)
    return HEADROOM * workers * (PREFETCH + 1) * batch


def shm_size(spec: JobSpec, ranks_per_pod: int, gpus_per_pod: int) -> ShmSize:
    """The worker pods' /dev/shm size: the spec's `kubernetes.shm_size`, or (auto) what its loaders need."""
    if spec.kubernetes.shm_size != "auto":
        return ShmSize(spec.kubernetes.shm_size, "kubernetes.shm_size")
    script = PurePosixPath(spec.script).name
    recipe = RECIPES.get(script)
    fix = ("set kubernetes.shm_size (e.g. -o kubernetes.shm_size=16Gi): each rank's ShmLoader needs num_workers x "
           f"{PREFETCH + 1} slots (prefetch + 1) x one batch's bytes, x{HEADROOM} for batches the trainer still holds, "
           f"for each of the {ranks_per_pod} rank(s) of a worker pod")
    if recipe is None:
        raise RenderError(f"kubernetes.shm_size is 'auto', but {script} is not a shipped recipe "
                          f"({', '.join(sorted(RECIPES))}), whose loaders hvdtrain knows: {fix}")
    flags = _flags(spec.args, recipe)
    batch = flags.batch_size * (flags.backward_passes_per_step if recipe.accumulates else 1)
    sample = _sample_bytes(flags)
    if sample is None:
        raise RenderError(f"kubernetes.shm_size is 'auto', but the size of a --dataset {flags.dataset} sample is in "
                          f"its files on the cluster: {fix} (here: {flags.num_workers} worker(s) x {PREFETCH + 1} "
                          f"slots x {batch} samples per batch)")
    if min(batch, flags.num_workers) < 1:
        raise RenderError(f"kubernetes.shm_size is 'auto', but the args give {batch} samples per batch (--batch-size "
                          f"x --backward-passes-per-step) and {flags.num_workers} worker(s) (--num-workers): each must "
                          "be at least 1; fix args, or set kubernetes.shm_size")
    loaders = ranks_per_pod * per_rank_bytes(batch, sample, flags.num_workers)
    extra = BASE_MIB + (NCCL_MIB if gpus_per_pod else 0)
    mib = -(-(math.ceil(_mib(loaders)) + extra) // 256) * 256
    why = (f"auto: {ranks_per_pod} rank(s) x {HEADROOM} x {flags.num_workers} worker(s) x {PREFETCH + 1} slots x "
           f"{batch} samples of {sample + LABEL_BYTES} B (at least 1 MiB) = {_mib(loaders):.1f} MiB, + {BASE_MIB} MiB"
           + (f" + {NCCL_MIB} MiB for NCCL" if gpus_per_pod else "") + ", rounded up")
    return ShmSize(_quantity(mib), why)
