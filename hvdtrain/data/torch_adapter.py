"""PyTorch view of an ShmLoader: the same batches as torch tensors that share the slot's memory (no copy)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch


def map_leaves(fn: Callable[[Any], Any], batch: Any) -> Any:
    """Apply `fn` to every leaf of a batch: an array/tensor, or tuples/lists/dicts of them nested to any depth
    (named tuples keep their type); leaves are visited depth first, in order."""
    if isinstance(batch, Mapping):
        return {k: map_leaves(fn, v) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_leaves(fn, v) for v in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(map_leaves(fn, v) for v in batch)
    return fn(batch)


def to_torch(batch: Any, *, copy: bool = False) -> Any:
    """numpy leaves -> `torch.from_numpy` views (or copies with `copy=True`); other leaves are left alone."""
    if type(batch) is tuple and not copy:  # the common (x, y) batch, once per step: no recursion
        out = []
        for leaf in batch:
            if type(leaf) is not np.ndarray:
                break
            out.append(torch.from_numpy(leaf))
        else:
            return tuple(out)

    def convert(leaf: Any) -> Any:
        if isinstance(leaf, np.ndarray):
            tensor = torch.from_numpy(leaf)
            return tensor.clone() if copy else tensor
        return leaf

    return map_leaves(convert, batch)


class TorchLoader:
    """Iterate an ShmLoader (or anything yielding numpy batches) as torch tensors.

    With `copy=False` (default) each tensor views the shared-memory slot, which stays the tensor's until the last
    tensor/view of the batch is released (NOTE [batch lifetime] in lending.py). `copy=True` gives tensors that own
    their memory (one memcpy per batch): holding one label tensor then does not hold the whole slot.
    `set_epoch`, `state_dict`, `load_state_dict`, `close`, `len()` and `with` pass through to the wrapped loader.
    """

    def __init__(self, loader: Any, *, copy: bool = False) -> None:
        self.loader, self.copy = loader, copy

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield to_torch(batch, copy=self.copy)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self, unconsumed: int = 0) -> dict[str, Any]:
        """The wrapped loader's state; `unconsumed=k` as in `ShmLoader.state_dict` (passed on only when k > 0)."""
        if unconsumed == 0:
            return self.loader.state_dict()
        return self.loader.state_dict(unconsumed=unconsumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()

    def __enter__(self) -> TorchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
