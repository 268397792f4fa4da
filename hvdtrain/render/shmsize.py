"""How big a worker pod's /dev/shm must be (`kubernetes.shm_size: auto`): what the shipped recipes' loaders need.

A rank's ShmLoader keeps `num_workers` producer processes, each with `prefetch + 1` batch slots in shared memory,
every slot a segment the size of a batch (page-rounded) and at least 1 MiB (the slots' first segments) — what a
rank that runs out is told, by `hvdtrain.data.shm.full_message`. A batch the trainer still holds keeps its segment
while its slot takes a new one, so the need is doubled. Every rank of a worker pod shares its /dev/shm; NCCL's
shared-memory transport between the GPUs of one pod takes its own share. The sizes come from the recipe's own
settings in the spec (`recipe:` and `args:`, read by hvdtrain.job.recipe.settings_of: their defaults where
the spec leaves them out); a dataset whose sample size is only
known from its files on the cluster cannot be sized here, and the error says what to set instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvdtrain.job.model import JobSpec
from hvdtrain.render.common import RenderError, recipe_settings
from hvdtrain.settings.loader import PREFETCH, SLOT_BYTES
from hvdtrain.settings.recipes import SHIPPED, RecipeConfig

PAGE = 4096
HEADROOM = 2  # a lent batch's segment plus its slot's new one
BASE_MIB = 256  # small segments (rings, epoch orders), Python's multiprocessing, the rest of the pod's /dev/shm users
NCCL_MIB = 1024  # NCCL's shared-memory transport within a pod with GPUs
LABEL_BYTES = 8  # int64
SAMPLE_BYTES = {"digits": 1 * 8 * 8 * 4}  # float32 1×8×8 (hvdtrain.formats.arrays.digits)


@dataclass(frozen=True)
class ShmSize:
    quantity: str  # what the emptyDir's sizeLimit says
    why: str  # one line for the manifest's header


def _sample_bytes(settings: RecipeConfig) -> int | None:
    if settings.dataset == "synthetic":
        return math.prod(settings.synthetic_shape) * 4  # float32 (hvdtrain.formats.arrays.synthetic)
    return SAMPLE_BYTES.get(settings.dataset)


def _batch_samples(settings: RecipeConfig) -> int:
    """Samples in one loader batch: --batch-size, x --backward-passes-per-step where a batch holds its chunks."""
    passes = getattr(settings, "backward_passes_per_step", 1) if settings.accumulates else 1
    return settings.batch_size * passes


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
    settings = recipe_settings(spec)  # NOTE [one reader of recipe settings]
    fix = ("set kubernetes.shm_size (e.g. -o kubernetes.shm_size=16Gi): each rank's ShmLoader needs num_workers x "
           f"{PREFETCH + 1} slots (prefetch + 1) x one batch's bytes, x{HEADROOM} for batches the trainer still holds, "
           f"for each of the {ranks_per_pod} rank(s) of a worker pod")
    if settings is None:
        raise RenderError(f"kubernetes.shm_size is 'auto', but {spec.script} is not a shipped recipe "
                          f"({', '.join(sorted(SHIPPED))}), whose loaders hvdtrain knows: {fix}")
    batch, workers = _batch_samples(settings), settings.num_workers
    sample = _sample_bytes(settings)
    if sample is None:
        raise RenderError(f"kubernetes.shm_size is 'auto', but the size of a --dataset {settings.dataset} sample is "
                          f"in its files on the cluster: {fix} (here: {workers} worker(s) x {PREFETCH + 1} slots x "
                          f"{batch} samples per batch)")
    loaders = ranks_per_pod * per_rank_bytes(batch, sample, workers)
    extra = BASE_MIB + (NCCL_MIB if gpus_per_pod else 0)
    mib = -(-(math.ceil(_mib(loaders)) + extra) // 256) * 256
    why = (f"auto: {ranks_per_pod} rank(s) x {HEADROOM} x {workers} worker(s) x {PREFETCH + 1} slots x "
           f"{batch} samples of {sample + LABEL_BYTES} B (at least 1 MiB) = {_mib(loaders):.1f} MiB, + {BASE_MIB} MiB"
           + (f" + {NCCL_MIB} MiB for NCCL" if gpus_per_pod else "") + ", rounded up")
    return ShmSize(_quantity(mib), why)
