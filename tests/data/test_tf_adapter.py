"""The tf.data adapter: the real test needs TensorFlow (optional extra); without it, the error must say so."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from hvdtrain.data import ShmLoader, to_tf_dataset
from tests.support import loaders as fx

pytestmark = pytest.mark.timeout(180)
HAS_TF = importlib.util.find_spec("tensorflow") is not None


@pytest.mark.skipif(HAS_TF, reason="TensorFlow is installed: the real adapter test runs instead")
def test_tf_adapter_says_what_is_missing() -> None:
    with pytest.raises(RuntimeError, match="needs TensorFlow"):
        to_tf_dataset([np.zeros((2, 3))], example=np.zeros((2, 3)))


@pytest.mark.skipif(not HAS_TF, reason="TensorFlow is not installed (optional 'tensorflow' extra)")
def test_tf_adapter_yields_the_loader_batches() -> None:
    import tensorflow as tf

    with ShmLoader(fx.IndexDataset(7), rank=0, size=1, batch_size=3, num_workers=1, shuffle=False) as ld:
        ds = to_tf_dataset(ld)
        assert ds.element_spec[0].shape.as_list() == [None, 3] and ds.element_spec[1].dtype == tf.int64
        for _ in range(2):
            assert [y.numpy().tolist() for _, y in ds] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.skipif(not HAS_TF, reason="TensorFlow is not installed (optional 'tensorflow' extra)")
def test_tf_adapter_generator_mode_with_an_example_batch() -> None:
    with ShmLoader.from_generator(fx.tagged_batches, rank=0, size=1, num_workers=2) as ld:
        ds = to_tf_dataset(ld, example=next(fx.tagged_batches(0, 1, 0, 0)))
        assert sorted(ds.element_spec) == ["draw", "local", "tag"]
        tags = [b["tag"].numpy()[[0, 4]].tolist() for b in ds]
        assert tags == [[w, j] for j in range(3) for w in (0, 1)]
    with pytest.raises(ValueError, match="output_signature"):
        to_tf_dataset([])
