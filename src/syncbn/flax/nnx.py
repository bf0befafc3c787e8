"""``syncbn.flax.nnx.BatchNorm``: a drop-in ``flax.nnx.BatchNorm`` (same constructor,
``.scale``/``.bias`` params and ``.mean``/``.var`` batch statistics, same update rule)
whose training statistics are exact over the union of devices; and :func:`convert`,
which switches every ``nnx.BatchNorm`` of an existing model in place.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import nnx

from .linen import canonical_axes, make_config, stored_normalize
from .normalize import batch_norm


class BatchNorm(nnx.BatchNorm):
    """Synchronized ``flax.nnx.BatchNorm``; see :class:`syncbn.flax.BatchNorm` for the
    statistics, masks, groups and dtypes. The constructor is Flax's."""

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
        stop = jax.lax.stop_gradient if (self.mean._can_update or self.var._can_update) else (lambda v: v)
        m = self.momentum
        self.mean[...] = stop(m * self.mean[...] + (1 - m) * mean)
        self.var[...] = stop(m * self.var[...] + (1 - m) * var)
        return y


_SHARED = ("mean", "var", "scale", "bias")
_CONFIG = ("num_features", "use_running_average", "axis", "momentum", "epsilon", "dtype", "param_dtype",
           "use_bias", "use_scale", "axis_name", "axis_index_groups", "use_fast_variance", "promote_dtype")


def _replacement(old: nnx.BatchNorm, sync: bool, axis_name: Any, axis_index_groups: Any) -> nnx.BatchNorm:
    cls = BatchNorm if sync else nnx.BatchNorm
    new = cls(old.num_features, use_scale=old.use_scale, use_bias=old.use_bias, rngs=nnx.Rngs(0))
    for name in _CONFIG:
        setattr(new, name, getattr(old, name))
    if sync and axis_name is not None:
        new.axis_name, new.axis_index_groups = axis_name, axis_index_groups
    for name in _SHARED:  # the very same Variable objects: optimizer state and sharing stay valid
        setattr(new, name, getattr(old, name))
    return new


def _swap(model, wanted, sync, axis_name, axis_index_groups):
    if type(model) is wanted:  # the model is itself one batch-norm layer
        return _replacement(model, sync, axis_name, axis_index_groups)
    found = [(path, node) for path, node in nnx.iter_graph(model) if type(node) is wanted]
    for path, node in found:
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) or not hasattr(parent, str(key)) else getattr(parent, key)
        new = _replacement(node, sync, axis_name, axis_index_groups)
        key = path[-1]
        if isinstance(key, int) or not hasattr(parent, str(key)):
            parent[key] = new
        else:
            setattr(parent, key, new)
    return model


def convert(model, *, axis_name: Any = None, axis_index_groups: Any = None):
    """Replace, in place, every ``flax.nnx.BatchNorm`` of ``model``'s graph by
    :class:`BatchNorm` sharing the same ``scale``/``bias``/``mean``/``var`` Variables
    (their values, sharding and any optimizer state referring to them stay valid). With
    ``axis_name``, the converted layers synchronize over it (and ``axis_index_groups``);
    otherwise each keeps its own. Returns ``model`` (or the new layer when ``model`` is
    itself a BatchNorm)."""
    return _swap(model, nnx.BatchNorm, True, axis_name, axis_index_groups)


def revert(model):
    """The inverse of :func:`convert`: plain ``flax.nnx.BatchNorm`` layers again, in place."""
    return _swap(model, BatchNorm, False, None, None)
