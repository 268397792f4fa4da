"""recipes/pytorch_models.py's default model learns small colour images, not only the digits (issue 37: SmallCNN
sat at 40% on 5 colour classes of 16x16 images, 2 classes of 5, where an MLP reached 100%)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tests.support.harness import REPO

COLOURS = np.array([[220, 40, 40], [40, 200, 40], [40, 60, 230], [230, 210, 40], [200, 40, 200]], np.float32)


def colour_squares(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """5 classes: a noisy square of the class's colour at a random place on a noisy grey background, pixels / 255
    as the recipes read converted images."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, len(COLOURS), n)
    x = rng.normal(110, 40, (n, 3, size, size)).astype(np.float32)
    side = size // 2
    for i in range(n):
        r, c = rng.integers(0, size - side, 2)
        x[i, :, r:r + side, c:c + side] = COLOURS[y[i]][:, None, None] + rng.normal(0, 20, (3, side, side))
    return np.clip(x, 0, 255) / 255, y


@pytest.fixture(scope="module")
def models():
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        import pytorch_models
    finally:
        sys.path.remove(str(REPO / "recipes"))
    return pytorch_models


def shapes(per_class: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """scripts/make_shapes.py's images (4 shapes in random colours on noisy backgrounds), pixels / 255."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_shapes
    finally:
        sys.path.remove(str(REPO / "scripts"))
    rng = np.random.default_rng(seed)
    x = [np.asarray(make_shapes.draw(kind, size, rng)).transpose(2, 0, 1) for kind in make_shapes.CLASSES
         for _ in range(per_class)]
    return np.stack(x).astype(np.float32) / 255, np.repeat(np.arange(len(make_shapes.CLASSES)), per_class)


def accuracy_after(models, train: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray],
                   epochs: int) -> float:
    """The recipe's defaults on one process (SGD, LR 0.05 without warmup, momentum 0.9, batches of 32)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    try:
        torch.manual_seed(0)
        x, y = (torch.tensor(a) for a in train)
        model = models.make_model("cnn", tuple(x.shape[1:]), int(y.max()) + 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for _ in range(epochs):
            model.train()
            for batch in torch.randperm(len(x)).split(32):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            return float((model(torch.tensor(val[0])).argmax(1).numpy() == val[1]).mean())
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_small_cnn_learns_colour_images_at_the_recipes_defaults(models) -> None:
    """8 epochs: the first SmallCNN (no BatchNorm, 16x16 flattened whole) ends at 23% here, and below 90% for 8 of
    seeds 0-9; the two-convolution one with BatchNorm dipped to 44-60% in some epochs; this one is at 100% from the
    2nd epoch on for seeds 0 and 1."""
    accuracy = accuracy_after(models, colour_squares(400, 16, seed=0), colour_squares(200, 16, seed=1), epochs=8)
    assert accuracy > 0.9, accuracy


@pytest.mark.slow
def test_small_cnn_learns_shapes_whatever_their_colour(models) -> None:
    """The class is the outline: the two-convolution SmallCNN (5x5 receptive field, then pooled to 4x4) sat at
    25-43% on 32x32 shapes for 10 epochs; with a convolution per halving it reaches 99-100% (seeds 0-2)."""
    accuracy = accuracy_after(models, shapes(200, 32, seed=0), shapes(50, 32, seed=1), epochs=10)
    assert accuracy > 0.9, accuracy


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 16, 16), (3, 32, 32), (3, 64, 48)])
def test_small_cnn_head_stays_small_at_any_image_size(models, shape) -> None:
    model = models.make_model("cnn", shape, 10)
    first_linear = next(m for m in model.head if isinstance(m, torch.nn.Linear))
    assert first_linear.in_features <= 2 * 32 * 16
    assert model(torch.zeros(2, *shape)).shape == (2, 10)
