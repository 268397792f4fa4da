"""Batches in Keras's layout, made where each batch is read: hvdtrain's datasets hold images as N×C×H×W (PyTorch's
layout), Keras convolutions on CPU need N×H×W×C.

Nothing here imports TensorFlow: `take_channels_last` is the Keras recipe's ShmLoader `fetch`, which runs in the
loader's producer processes (they unpickle it by reference, importing this module only). It uses only a split's
`take(indices)`, so in-memory, memory-mapped and streamed (MDS, URL) splits are moved batch by batch, and no whole
array is ever copied.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def channels_last_shape(sample_shape: tuple[int, ...]) -> tuple[int, ...]:
    """C×H×W -> H×W×C; other sample shapes (vectors, ...) as they are."""
    shape = tuple(sample_shape)
    return (*shape[1:], shape[0]) if len(shape) == 3 else shape


def take_channels_last(ds: Any, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ds.take(indices)` as (float32 x, int64 y), images moved to N×H×W×C.

    In a producer the moved axes stay a view: the one copy is the loader's write into shared memory."""
    x, y = ds.take(indices)
    if x.dtype == np.uint8 and x.ndim == 4:  # decoded images, already N×H×W×C (hvdtrain.stream.images)
        return (x * np.float32(1 / 255)), np.asarray(y).astype(np.int64, copy=False).reshape(len(x))
    if x.ndim == 4:
        x = np.moveaxis(x, 1, -1)
    return x.astype(np.float32, copy=False), np.asarray(y).astype(np.int64, copy=False).reshape(len(x))
