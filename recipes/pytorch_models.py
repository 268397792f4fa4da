"""Models for recipes/pytorch_train.py: a small CNN and an MLP for digits, a ResNet-style net for throughput.

Imported by the recipe as a sibling module (`from pytorch_models import make_model`), as nanoGPT's train.py
imports model.py.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODELS = ("cnn", "mlp", "resnet")


class SmallCNN(nn.Module):
    """Two 3x3 convolutions (each with BatchNorm) and a max pooling, one more convolution and pooling per halving
    while the map is larger than 4x4, then two linear layers with a LayerNorm between: ~99% on 8x8 digits in a few
    epochs, ~100% on 5 classes of small (16x16, 32x32) colour squares and 4 classes of 32x32 shapes in random
    colours (scripts/make_shapes.py) in 10 epochs (tests/recipes/test_models.py).

    - Depth grows with the image: a shape is told apart by its outline, which the 5x5 receptive field of two
      convolutions does not see in a 32x32 image (the two-convolution model sat at 25-43% on the shapes).
    - What reaches the flatten is at most 4x4 (adaptive average pooling), so the first linear layer has at most
      2 × width × 16 inputs at any image size: its updates grow with its number of inputs, and a 16x16 or 32x32 map
      flattened whole made the recipe's default LR kill most ReLUs in the first epochs.
    - BatchNorm keeps the convolutions' outputs at one scale whatever the input's range; the LayerNorm does so for
      the head's hidden layer: without it, at the recipe's constant LR, bursts of large gradients moved the
      convolutions faster than BatchNorm's running statistics follow, and validation (eval mode) dropped for an
      epoch or two. LayerNorm, unlike BatchNorm1d, also takes a last batch of one sample.
    """

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, width: int = 32) -> None:
        super().__init__()
        channels, height, width_px = in_shape
        layers: list[nn.Module] = [
            nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            *_conv_pool(width, 2 * width)]
        size = (height // 2, width_px // 2)
        while min(size) > 4:
            layers += _conv_pool(2 * width, 2 * width)
            size = (size[0] // 2, size[1] // 2)
        grid = (min(4, size[0]), min(4, size[1]))
        if grid != size:
            layers.append(nn.AdaptiveAvgPool2d(grid))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * grid[0] * grid[1], 128), nn.LayerNorm(128),
                                  nn.ReLU(inplace=True), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _conv_pool(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
            nn.MaxPool2d(2)]


class MLP(nn.Module):
    def __init__(self, in_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), hidden), nn.ReLU(inplace=True),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicBlock(nn.Module):
    """He et al. 2016 basic residual block: two 3x3 conv + BN, identity or 1x1-conv shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet: a 3x3 stem, three stages (width, 2×, 4×; stride 1, 2, 2), global pool, linear."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, width: int = 16, blocks: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(in_shape[0], width, 3, padding=1, bias=False),
                                   nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        cin = width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, stride=2 if i > 0 and b == 0 else 1))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_model(name: str, in_shape: tuple[int, ...], num_classes: int, width: int | None = None) -> nn.Module:
    """`name` is one of MODELS; cnn and resnet want (channels, height, width) samples."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {name!r}")
    if name in ("cnn", "resnet") and len(in_shape) != 3:
        raise ValueError(f"model {name!r} needs samples shaped (channels, height, width); got {in_shape}; "
                         f"use --model mlp for other shapes")
    if name == "cnn":
        return SmallCNN(in_shape, num_classes, **({"width": width} if width else {}))
    if name == "mlp":
        return MLP(in_shape, num_classes, **({"hidden": width} if width else {}))
    return ResNet(in_shape, num_classes, **({"width": width} if width else {}))
