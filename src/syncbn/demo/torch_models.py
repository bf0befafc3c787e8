"""Small models with many BatchNorm layers, shared by ``syncbn demo``, ``bench`` and ``verify``.

:class:`TinyUNet` is a fully-convolutional encoder-decoder for semantic segmentation in
the spirit of U-Net: every convolution is followed by a plain ``torch.nn.BatchNorm2d``
and an activation, so the model is what a user has *before* calling
:func:`syncbn.convert_sync_batchnorm`. With the defaults (3 down-sampling levels) it has
14 BatchNorm layers, and the statistics of the deepest ones come from very few elements
per channel (batch x 4 x 4 for a 32x32 input): exactly where a small per-device batch
hurts.

The network is smooth by default (SiLU activations, average-pool down-sampling), so
the training trajectory is a smooth function of the weights and two runs that differ
only by float rounding (synchronized BN across ranks vs one big batch) stay together.
With ReLU and max-pooling the kinks amplify rounding: in float64, a relative
perturbation of 1e-7 of the initial weights grew past 1e-1 within 24 SGD steps on the
demo's data, while with SiLU and average pooling it stayed near 1e-5 after 300 steps.
``activation="relu", pool="max"`` gives the classic layout.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["ConvBNAct", "TinyUNet", "build_segmentation_model", "count_batchnorm"]

ACTIVATIONS: Dict[str, Callable[[], nn.Module]] = {
    "silu": lambda: nn.SiLU(inplace=True),
    "relu": lambda: nn.ReLU(inplace=True),
    "gelu": nn.GELU,
}
POOLS: Dict[str, Callable] = {"avg": F.avg_pool2d, "max": F.max_pool2d}


class ConvBNAct(nn.Sequential):
    """3x3 convolution (no bias: the BatchNorm's shift replaces it), BatchNorm2d, activation."""

    def __init__(self, in_channels: int, out_channels: int, activation: str = "silu"):
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            ACTIVATIONS[activation](),
        )


class _Stage(nn.Sequential):
    """Two ConvBNAct blocks at one resolution."""

    def __init__(self, in_channels: int, out_channels: int, mid_channels: int | None = None, activation: str = "silu"):
        mid = out_channels if mid_channels is None else mid_channels
        super().__init__(ConvBNAct(in_channels, mid, activation), ConvBNAct(mid, out_channels, activation))


class TinyUNet(nn.Module):
    """U-Net-style segmentation network.

    ``depth`` 2x2 pooling levels on the way down (``pool``: "avg" or "max"), as many
    bilinear up-samplings on the way up, each joined with the encoder features of the
    same resolution (skip connection). Channels double at every level, starting at
    ``width``, unless ``channels`` lists them (``depth + 1`` numbers, the last one
    for the bottleneck). Every stage is two ConvBNAct blocks (``activation``: "silu", "relu" or
    "gelu"), so the model has ``4 * depth + 2`` BatchNorm layers (14 with the default
    ``depth=3``). The input's height and width must be divisible by ``2 ** depth``.

    Input (N, in_channels, H, W); output the class logits (N, num_classes, H, W).
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 11,
        width: int = 16,
        depth: int = 3,
        activation: str = "silu",
        pool: str = "avg",
        channels: Optional[Sequence[int]] = None,
    ):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {sorted(POOLS)}, got {pool!r}")
        if channels is None:
            channels = [width * 2**level for level in range(depth + 1)]
        elif len(channels) != depth + 1:
            raise ValueError(f"channels must list depth + 1 = {depth + 1} numbers, got {list(channels)}")
        channels = [int(c) for c in channels]
        self.depth = depth
        self.pool = pool
        self.encoders = nn.ModuleList()
        previous = in_channels
        for level in range(depth):
            self.encoders.append(_Stage(previous, channels[level], activation=activation))
            previous = channels[level]
        self.bottleneck = _Stage(previous, channels[depth - 1], channels[depth], activation)
        self.decoders = nn.ModuleList()
        for level in reversed(range(depth)):
            out = channels[max(level - 1, 0)]
            self.decoders.append(_Stage(2 * channels[level], out, channels[level], activation))
        self.head = nn.Conv2d(channels[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = POOLS[self.pool]
        skips: List[torch.Tensor] = []
        for encoder in self.encoders:
            x = encoder(x)
            skips.append(x)
            x = down(x, 2)
        x = self.bottleneck(x)
        for decoder, skip in zip(self.decoders, reversed(skips)):
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = decoder(torch.cat([x, skip], dim=1))
        return self.head(x)


def build_segmentation_model(seed: int, **kwargs) -> TinyUNet:
    """A :class:`TinyUNet` (``kwargs`` are its arguments) whose initial weights depend
    only on ``seed`` and the arguments: every process that calls this alike gets the
    same model. The global torch random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyUNet(**kwargs)


def count_batchnorm(model: nn.Module) -> int:
    """Number of BatchNorm layers (plain or synchronized) in ``model``."""
    return sum(isinstance(m, _BatchNorm) for m in model.modules())
