"""The layer of :mod:`syncbn.flax.nnx`: a drop-in ``flax.nnx.BatchNorm`` whose training
statistics are exact over the union of devices (public as ``syncbn.flax.nnx.BatchNorm``;
its conversions live in :mod:`syncbn.flax.convert`, beside linen's, because each reaches
the other through Flax's bridges)."""

from __future__ import annotations

from typing import Optional

import jax
from flax import nnx

from .linen import canonical_axes, make_config, stored_normalize
from .normalize import batch_norm

__all__ = ["BatchNorm"]


class BatchNorm(nnx.BatchNorm):
    """Synchronized ``flax.nnx.BatchNorm``; see :class:`syncbn.flax.BatchNorm` for the
    statistics, masks, groups and dtypes. The constructor is Flax's."""

    __module__ = "syncbn.flax.nnx"  # where users import it from (and pickles find it)

    def __call__(self, x, use_running_average: Optional[bool] = None, *, mask: Optional[jax.Array] = None):
        if use_running_average is None:
            use_running_average = self.use_running_average
        if use_running_average is None:
            raise ValueError(
                "No `use_running_average` argument was provided to BatchNorm: pass it to the "
                "constructor or to the call, or use `nnx.view` (as for flax.nnx.BatchNorm).")
        feature_axes = canonical_axes(x.ndim, self.axis)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, mean, var, scale, bias = self.promote_dtype((x, self.mean[...], self.var[...], scale, bias),
                                                       dtype=self.dtype)
        if use_running_average:
            return stored_normalize(x, mean, var, scale, bias, feature_axes, self.epsilon, self.dtype)
        config = make_config(x, feature_axes, self.epsilon, self.axis_name, self.axis_index_groups, self.dtype,
                             True, scale, bias)
        y, mean, var = batch_norm(x, scale, bias, mask, config)
        # as Flax's, the Variables keep their dtype (float32 as built): nnx casts what is assigned
        stop = jax.lax.stop_gradient if (self.mean._can_update or self.var._can_update) else (lambda v: v)
        m = self.momentum
        self.mean[...] = stop(m * self.mean[...] + (1 - m) * mean)
        self.var[...] = stop(m * self.var[...] + (1 - m) * var)
        return y
