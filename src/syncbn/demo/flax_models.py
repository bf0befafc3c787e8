"""A small linen model with many BatchNorm layers, for ``syncbn demo --framework flax``.

:class:`TinyUNet` is the Flax twin of :func:`syncbn.demo.keras_models.tiny_unet` (itself the
twin of :class:`syncbn.demo.torch_models.TinyUNet`): the same channels-last encoder-decoder (two 3x3
convolution + BatchNorm + SiLU blocks per stage, 2x2 average pooling down, bilinear
up-sampling joined with the encoder features of the same resolution, a 1x1 head),
built from plain ``flax.linen.BatchNorm`` layers (``momentum=0.9``, ``epsilon=1e-5``:
torch's defaults written the Flax way), so it is the model a user has *before*
``syncbn.flax.convert``. With the defaults it has 14 BatchNorm layers.

:func:`init_variables` gives the Keras twin's initial weights: the convolution kernels
(and the head's bias) uniform in +-1 / sqrt(fan_in), drawn with numpy from the seed in
the same order and from the same stream as the Keras model draws them (kernels have the
same (kh, kw, in, out) layout in both), BN scale 1 and shift 0.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TinyUNet", "init_variables", "count_batchnorm"]


class TinyUNet(nn.Module):
    """Input (N, S, S, in_channels), output the class logits (N, S, S, num_classes);
    ``S`` divisible by ``2 ** depth``; ``4 * depth + 2`` BatchNorm layers whose
    ``axis_name`` is ``bn_axis_name`` (None: each device its own statistics)."""

    width: int = 16
    depth: int = 3
    num_classes: int = 11
    bn_axis_name: Any = None

    def _block(self, x, filters: int, name: str, train: bool):
        x = nn.Conv(filters, (3, 3), padding="SAME", use_bias=False, name=f"{name}_conv")(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                         axis_name=self.bn_axis_name, name=f"{name}_bn")(x)
        return nn.silu(x)

    def _stage(self, x, mid: int, out: int, name: str, train: bool):
        return self._block(self._block(x, mid, f"{name}a", train), out, f"{name}b", train)

    @nn.compact
    def __call__(self, x, train: bool):
        channels = [self.width * 2**level for level in range(self.depth + 1)]
        skips: List = []
        for level in range(self.depth):
            x = self._stage(x, channels[level], channels[level], f"enc{level}", train)
            skips.append(x)
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = self._stage(x, channels[self.depth], channels[self.depth - 1], "mid", train)
        for level in reversed(range(self.depth)):
            n, h, w, c = x.shape
            x = jax.image.resize(x, (n, 2 * h, 2 * w, c), method="bilinear")
            x = jnp.concatenate([x, skips[level]], axis=-1)
            x = self._stage(x, channels[level], channels[max(level - 1, 0)], f"dec{level}", train)
        return nn.Conv(self.num_classes, (1, 1), use_bias=True, name="head")(x)


def _conv_names(depth: int) -> Tuple[str, ...]:
    """The convolutions in the order the Keras twin creates (and initializes) them."""
    stages = [f"enc{level}" for level in range(depth)] + ["mid"] + [f"dec{level}" for level in reversed(range(depth))]
    return tuple(f"{stage}{half}_conv" for stage in stages for half in "ab") + ("head",)


def init_variables(model: TinyUNet, seed: int, image_size: int, in_channels: int = 1) -> Dict[str, Any]:
    """``{"params", "batch_stats"}`` of ``model`` (numpy float32), holding the Keras
    twin's initial weights for ``seed``."""
    if image_size % 2**model.depth:
        raise ValueError(f"image_size must be divisible by 2 ** depth = {2**model.depth}, got {image_size}")
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, image_size, image_size,
                                                                                  in_channels)), train=False))
    variables = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
    variables = {name: dict(tree) for name, tree in variables.items()}  # writable top levels
    params, stats = variables["params"], variables["batch_stats"]
    for name in params:
        if name.endswith("_bn"):
            params[name] = {"scale": np.ones_like(params[name]["scale"]), "bias": params[name]["bias"]}
            stats[name] = {"mean": stats[name]["mean"], "var": np.ones_like(stats[name]["var"])}
    rng = np.random.default_rng([int(seed), 4])  # the Keras twin's stream
    for name in _conv_names(model.depth):
        kernel = params[name]["kernel"]
        bound = 1.0 / np.sqrt(np.prod(kernel.shape[:-1]))  # fan_in = kh * kw * in_channels
        drawn = {"kernel": rng.uniform(-bound, bound, kernel.shape).astype(np.float32)}
        if "bias" in params[name]:
            drawn["bias"] = rng.uniform(-bound, bound, params[name]["bias"].shape).astype(np.float32)
        params[name] = drawn
    return {"params": params, "batch_stats": stats}


def count_batchnorm(variables) -> int:
    """Number of BatchNorm layers (their running statistics) in ``variables``."""
    return len(variables["batch_stats"])
