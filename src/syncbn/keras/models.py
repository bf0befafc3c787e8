"""Small Keras models with many BatchNormalization layers, for ``syncbn demo --framework keras``.

:func:`tiny_unet` is the Keras twin of :class:`syncbn.models.TinyUNet`: the same
fully-convolutional encoder-decoder (two 3x3 convolution + BatchNormalization + SiLU
blocks per stage, average-pool down-sampling, bilinear up-sampling joined with the
encoder features of the same resolution, a 1x1 head), channels-last, built from plain
``keras.layers.BatchNormalization`` layers: the model a user has *before* calling
:func:`syncbn.keras.convert`. With the defaults it has 14 BatchNormalization layers.

The BatchNormalization settings are torch's defaults written the Keras way
(``momentum=0.9`` is torch's 0.1, ``epsilon=1e-5``), and the initial weights follow
torch's default initialization (uniform, bound ``1 / sqrt(fan_in)``), drawn from
seeded initializers: the same ``seed`` gives the same weights in every process.
Every layer has a fixed name, so two models built alike have the same weight paths.
"""

from __future__ import annotations

from typing import List

import keras

__all__ = ["tiny_unet", "count_batchnorm"]


class _Seeds:
    """Distinct initializer seeds derived from one seed, in layer-creation order."""

    def __init__(self, seed: int):
        self.base = int(seed) * 1000
        self.count = 0

    def __call__(self) -> int:
        self.count += 1
        return self.base + self.count


def _conv(filters: int, kernel: int, name: str, seeds: _Seeds, bias_bound: float = 0.0):
    """A convolution initialized as torch's: kaiming_uniform(a=sqrt(5)), i.e. uniform with
    bound 1 / sqrt(fan_in); a bias (uniform within ``bias_bound``) only if that is positive."""
    init = keras.initializers.VarianceScaling(1.0 / 3.0, "fan_in", "uniform", seed=seeds())
    bias_init = keras.initializers.RandomUniform(-bias_bound, bias_bound, seed=seeds()) if bias_bound else "zeros"
    return keras.layers.Conv2D(filters, kernel, padding="same", use_bias=bias_bound > 0, kernel_initializer=init,
                               bias_initializer=bias_init, name=name)


def _conv_bn_act(x, filters: int, name: str, seeds: _Seeds):
    x = _conv(filters, 3, f"{name}_conv", seeds)(x)
    x = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5, name=f"{name}_bn")(x)
    return keras.layers.Activation("silu", name=f"{name}_act")(x)


def _stage(x, mid: int, out: int, name: str, seeds: _Seeds):
    x = _conv_bn_act(x, mid, f"{name}a", seeds)
    return _conv_bn_act(x, out, f"{name}b", seeds)


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
    seeds = _Seeds(seed)
    channels = [width * 2**level for level in range(depth + 1)]
    inputs = keras.Input((image_size, image_size, in_channels), name="image")
    x = inputs
    skips: List = []
    for level in range(depth):
        x = _stage(x, channels[level], channels[level], f"enc{level}", seeds)
        skips.append(x)
        x = keras.layers.AveragePooling2D(2, name=f"pool{level}")(x)
    x = _stage(x, channels[depth], channels[depth - 1], "mid", seeds)
    for level in reversed(range(depth)):
        x = keras.layers.UpSampling2D(2, interpolation="bilinear", name=f"up{level}")(x)
        x = keras.layers.Concatenate(name=f"cat{level}")([x, skips[level]])
        x = _stage(x, channels[level], channels[max(level - 1, 0)], f"dec{level}", seeds)
    logits = _conv(num_classes, 1, "head", seeds, bias_bound=1.0 / channels[0] ** 0.5)(x)
    return keras.Model(inputs, logits, name="tiny_unet")


def count_batchnorm(model) -> int:
    """Number of BatchNormalization layers (plain or synchronized) in ``model``."""
    return sum(isinstance(layer, keras.layers.BatchNormalization) for layer in model.layers)
