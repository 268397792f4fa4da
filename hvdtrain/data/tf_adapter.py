"""tf.data view of an ShmLoader for the Keras recipe. TensorFlow is imported only when this is used."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from hvdtrain.data.shm import flatten


def _tf() -> Any:
    try:
        import tensorflow as tf
    except ImportError as exc:
        raise RuntimeError("to_tf_dataset needs TensorFlow: install the 'tensorflow' extra "
                           "(tensorflow-cpu and tf-keras, see scripts/setup.sh)") from exc
    return tf


def signature_of(batch: Any) -> Any:
    """A `tf.TensorSpec` structure for batches shaped like `batch`, with the batch dimension left open."""
    tf = _tf()
    kind, keys, arrays = flatten(batch)
    specs = [tf.TensorSpec(shape=(None, *a.shape[1:]) if a.ndim else (), dtype=tf.as_dtype(a.dtype))
             for a in arrays]
    if kind == "dict":
        return dict(zip(keys, specs, strict=True))
    return specs[0] if kind == "array" else tuple(specs)


def to_tf_dataset(loader: Any, output_signature: Any = None, *, example: Any = None) -> Any:
    """`tf.data.Dataset.from_generator` over `loader` (an ShmLoader or any iterable of numpy batches).

    The signature is `output_signature`, or derived from `example` (one batch), or — for a dataset-mode ShmLoader —
    from its first sample batch computed here in the trainer (give a signature for a streamed dataset: that batch
    would be read here, not in a producer). Each pass over the returned dataset is one `iter(loader)`: call
    `loader.set_epoch(epoch)` before each pass. Keras `fit` with `steps_per_epoch` makes one pass for all its
    epochs (tf_keras re-creates its iterator per epoch only when the dataset's cardinality equals steps_per_epoch,
    and then before `on_epoch_begin`; Keras 3 only when it knows the length and has read it all): give it an
    iterable that sets each epoch and iterates the loader, as `hvdtrain.train.keraskit.LoaderEpochs` does for the
    Keras recipe.
    Each batch is copied out of its shared-memory slot before it is handed to TF (one memcpy per batch): TF may
    wrap numpy memory without copying, and tf.data asks for the next element — releasing the slot — before the
    model has read the current one, so a zero-copy batch could be overwritten while in use. Lists are yielded as
    tuples.
    """
    tf = _tf()
    if output_signature is None:
        if example is None:
            example = _example_batch(loader)
        output_signature = signature_of(example)

    def batches() -> Iterator[Any]:
        for batch in loader:
            kind, keys, arrays = flatten(batch)
            owned = [np.array(a, copy=True) for a in arrays]
            if kind == "dict":
                yield dict(zip(keys, owned, strict=True))
            else:
                yield owned[0] if kind == "array" else tuple(owned)

    return tf.data.Dataset.from_generator(batches, output_signature=output_signature)


def _example_batch(loader: Any) -> Any:
    """Two samples of a dataset-mode ShmLoader collated in this process (only their shapes and dtypes are used)."""
    cfg_dataset = getattr(loader, "dataset", None)
    if cfg_dataset is None or len(cfg_dataset) == 0:
        raise ValueError("to_tf_dataset needs output_signature= or example= for a generator loader or an empty "
                         "dataset (the batch structure is not known before the first batch)")
    n = min(2, len(cfg_dataset))
    fetch, collate = getattr(loader, "fetch", None), getattr(loader, "collate", None)
    if fetch is not None:
        return fetch(cfg_dataset, np.arange(n))
    from hvdtrain.data.workers import default_collate

    return (collate or default_collate)([cfg_dataset[i] for i in range(n)])
