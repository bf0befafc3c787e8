"""Small Keras models with many BatchNormalization layers, for ``syncbn demo --framework keras``.

:func:`tiny_unet` is the Keras twin of :class:`syncbn.demo.torch_models.TinyUNet`: the same
fully-convolutional encoder-decoder (two 3x3 convolution + BatchNormalization + SiLU
blocks per stage, average-pool down-sampling, bilinear up-sampling joined with the
encoder features of the same resolution, a 1x1 head), channels-last, built from plain
``keras.layers.BatchNormalization`` layers: the model a user has *before* calling
:func:`syncbn.keras.convert`. With the defaults it has 14 BatchNormalization layers.

The BatchNormalization settings are torch's defaults written the Keras way
(``momentum=0.9`` is torch's 0.1, ``epsilon=1e-5``), and the initial weights follow
torch's default initialization (convolution kernels and the head's bias uniform with
bound ``1 / sqrt(fan_in)``, BN scale 1 and shift 0), drawn with numpy from the seed:
the same ``seed`` gives the same weights in every process and on every Keras backend.
Every layer has a fixed name, so two models built alike have the same weight paths.
"""

from __future__ import annotations

from typing import List

import keras
import numpy as np

__all__ = ["tiny_unet", "count_batchnorm"]


def _conv(filters: int, kernel: int, name: str, bias: bool = False):
    return keras.layers.Conv2D(filters, kernel, padding="same", use_bias=bias, name=name)


def _conv_bn_act(x, filters: int, name: str):
    x = _conv(filters, 3, f"{name}_conv")(x)
    x = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=f"{name}_bn")(x)
    return keras.layers.Activation("silu", name=f"{name}_act")(x)


def _stage(x, mid: int, out: int, name: str):
    x = _conv_bn_act(x, mid, f"{name}a")
    return _conv_bn_act(x, out, f"{name}b")


def _initialize(model: keras.Model, seed: int) -> None:
    """torch's default initialization, from numpy: every convolution's kernel (and the
    head's bias) uniform in +-1 / sqrt(fan_in), drawn in layer order from one stream."""
    rng = np.random.default_rng([int(seed), 4])
    for layer in model.layers:
        if isinstance(layer, keras.layers.Conv2D):
            kernel = layer.kernel
            bound = 1.0 / np.sqrt(np.prod(kernel.shape[:-1]))  # fan_in = kh * kw * in_channels
            kernel.assign(rng.uniform(-bound, bound, kernel.shape).astype("float32"))
            if layer.use_bias:
                layer.bias.assign(rng.uniform(-bound, bound, layer.bias.shape).astype("float32"))


def tiny_unet(seed: int = 0, image_size: int = 32, in_channels: int = 1, num_classes: int = 11,
              width: int = 16, depth: int = 3) -> keras.Model:
    """A U-Net-style functional model, input (N, S, S, in_channels), output the class
    logits (N, S, S, num_classes); ``image_size`` must be divisible by ``2 ** depth``.

    Channels double at every level from ``width``; ``4 * depth + 2`` BatchNormalization
    layers. The initial weights depend only on ``seed`` and the arguments.
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    if image_size % 2**depth:
        raise ValueError(f"image_size must be divisible by 2 ** depth = {2**depth}, got {image_size}")
    channels = [width * 2**level for level in range(depth + 1)]
    inputs = keras.Input((image_size, image_size, in_channels), name="image")
    x = inputs
    skips: List = []
    for level in range(depth):
        x = _stage(x, channels[level], channels[level], f"enc{level}")
        skips.append(x)
        x = keras.layers.AveragePooling2D(2, name=f"pool{level}")(x)
    x = _stage(x, channels[depth], channels[depth - 1], "mid")
    for level in reversed(range(depth)):
        x = keras.layers.UpSampling2D(2, interpolation="bilinear", name=f"up{level}")(x)
        x = keras.layers.Concatenate(name=f"cat{level}")([x, skips[level]])
        x = _stage(x, channels[level], channels[max(level - 1, 0)], f"dec{level}")
    logits = _conv(num_classes, 1, "head", bias=True)(x)
    model = keras.Model(inputs, logits, name="tiny_unet")
    _initialize(model, seed)
    return model


def count_batchnorm(model) -> int:
    """Number of BatchNormalization layers (plain or synchronized) in ``model``."""
    return sum(isinstance(layer, keras.layers.BatchNormalization) for layer in model.layers)
