"""Data-parallel input pipeline, format-blind: sharding, shared-memory producer processes, device prefetch, stall
metrics.

- `sharding`: `ShardSampler`, each rank's shard of an index space (deterministic, even, resumable).
- `loader`: `ShmLoader`, persistent producer processes handing batches over in shared memory; `receiver`: its end
  of the wire and an epoch's receive state (NOTE [one receiver]).
- `protocol`: the typed messages between the trainer and a producer; `channel`: their socket; `ring`: batch
  announcements in shared memory.
- `workers`: the producer process; `boot`: a producer in a fresh interpreter; `forked`: one forked from the
  trainer (the default on Linux).
- `shm`: shared-memory segments and the batch layout; `lending`: batches lent to the user (NOTE [batch
  lifetime]); `resources`: the processes' and segments' lifetimes (NOTE [loader shutdown]).
- `prefetch`: `DevicePrefetcher`, host -> GPU on a side stream; `pinning`: page-locked slots.
- `stall`, `idle`: how long a step waited for its batch, and the GPU idle between steps.
- `torch_adapter`, `tf_adapter`: the loader's batches as torch tensors, or as a tf.data dataset.
- `errors`: `DataError` (the data is at fault) and the loader's errors.

Nothing here imports horovod: loaders take `rank` and `size` as arguments. Every name is imported when first used
(`from hvdtrain.data import ShmLoader` imports the loader then), so a producer process importing its own modules
(boot, workers) does not import the trainer's, and torch and TensorFlow are imported only when
`TorchLoader`/`DevicePrefetcher`/`to_torch` or `to_tf_dataset` are first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hvdtrain.data.errors import (
        LoaderError,
        LoaderTimeoutError,
        SamplerMismatch,
        SharedMemoryFullError,
        WorkerDiedError,
        WorkerError,
    )
    from hvdtrain.data.idle import GpuIdleMeter
    from hvdtrain.data.loader import ShmLoader
    from hvdtrain.data.prefetch import DevicePrefetcher
    from hvdtrain.data.sharding import ShardSampler, expected_batches
    from hvdtrain.data.shm import sweep_stale_segments
    from hvdtrain.data.stall import StallMeter
    from hvdtrain.data.tf_adapter import to_tf_dataset
    from hvdtrain.data.torch_adapter import TorchLoader, to_torch
    from hvdtrain.data.workers import WorkerInfo, default_collate, derive_seed, worker_info

_LAZY = {
    **dict.fromkeys(("LoaderError", "LoaderTimeoutError", "SamplerMismatch", "SharedMemoryFullError",
                     "WorkerDiedError", "WorkerError"), "hvdtrain.data.errors"),
    "ShmLoader": "hvdtrain.data.loader",
    "ShardSampler": "hvdtrain.data.sharding",
    "expected_batches": "hvdtrain.data.sharding",
    "sweep_stale_segments": "hvdtrain.data.shm",
    "StallMeter": "hvdtrain.data.stall",
    "GpuIdleMeter": "hvdtrain.data.idle",
    **dict.fromkeys(("WorkerInfo", "default_collate", "derive_seed", "worker_info"), "hvdtrain.data.workers"),
    "TorchLoader": "hvdtrain.data.torch_adapter",
    "to_torch": "hvdtrain.data.torch_adapter",
    "DevicePrefetcher": "hvdtrain.data.prefetch",
    "to_tf_dataset": "hvdtrain.data.tf_adapter",
}

__all__ = [
    "DevicePrefetcher",
    "GpuIdleMeter",
    "LoaderError",
    "LoaderTimeoutError",
    "SamplerMismatch",
    "ShardSampler",
    "SharedMemoryFullError",
    "ShmLoader",
    "StallMeter",
    "TorchLoader",
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "default_collate",
    "derive_seed",
    "expected_batches",
    "sweep_stale_segments",
    "to_tf_dataset",
    "to_torch",
    "worker_info",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hvdtrain.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
