"""``syncbn.flax.BatchNorm``: a drop-in ``flax.linen.BatchNorm`` with exact statistics
over the union of devices.

It subclasses ``flax.linen.BatchNorm``: the same fields, call signature
``__call__(x, use_running_average=None, *, mask=None)``, class name (so auto-named
submodules keep their names), variables (``params/scale``, ``params/bias``,
``batch_stats/mean``, ``batch_stats/var``: same shapes, dtypes, initial values) and
running-average rule (``ra = momentum * ra + (1 - momentum) * batch_stat``, biased
variance). A checkpoint of a model built with ``flax.linen.BatchNorm`` loads and
continues. What differs is how the statistics are computed (see
:mod:`syncbn.flax.moments` and :mod:`syncbn.flax.normalize`): weighted by valid
elements across devices, stable far from zero, one ``psum`` forward and one backward.
``use_fast_variance`` is accepted and ignored: there is one variance algorithm, as
fast as Flax's one-pass form in communication and as stable as its two-pass one.

Dtypes are Flax's: statistics in the input's dtype (or ``dtype``) promoted to at least
``float32`` (unless ``force_float32_reductions=False``), an integer input computed as
that float dtype, a complex input normalized with a complex mean and a real variance, the
output in ``dtype`` or the promotion of the input's and the parameters' dtypes. The
running statistics are updated as ``momentum * ra + (1 - momentum) * batch_stat`` with
JAX's promotion, so after an update they have the dtypes Flax's have (``float64`` for a
``float64`` input under ``jax_enable_x64``, a complex mean for a complex input).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes

from .moments import stats_dtype
from .normalize import Config, batch_norm, freeze_groups


def canonical_axes(ndim: int, axes) -> tuple:
    """Sorted, deduplicated, non-negative axes. ``axes`` is one axis or any iterable of
    them (a tuple, list, ``range``, NumPy array), as Flax's layers take it."""
    if not isinstance(axes, Iterable):
        axes = (axes,)
    return tuple(sorted({int(ax) + ndim if ax < 0 else int(ax) for ax in axes}))


def make_config(x, feature_axes, epsilon, axis_name, axis_index_groups, dtype, force_float32,
                scale, bias) -> Config:
    """The call's :class:`Config`: statistics and output dtypes as Flax derives them from
    ``x`` (as given: an integer input too), ``dtype`` and the parameters."""
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    args = [x] + [p for p in (scale, bias) if p is not None]
    out_dtype = dtypes.canonicalize_dtype(*args, dtype=dtype)
    return Config(reduction_axes, feature_axes, float(epsilon), axis_name, freeze_groups(axis_index_groups),
                  stats_dtype(jnp.result_type(x) if dtype is None else dtype, force_float32),
                  out_dtype)


def linen_forward(module: nn.BatchNorm, x, use_running_average: Optional[bool] = None, *, mask=None,
                  axis_name: Any = None, axis_index_groups: Any = None):
    """The body of ``syncbn.flax.BatchNorm.__call__``, written against any bound
    ``flax.linen.BatchNorm`` (so :func:`syncbn.flax.convert` can run it for Flax's own
    modules). ``axis_name``/``axis_index_groups`` override the module's when given."""
    use_running_average = nn.merge_param("use_running_average", module.use_running_average,
                                         use_running_average)
    x = jnp.asarray(x)
    feature_axes = canonical_axes(x.ndim, module.axis)
    feature_shape = [x.shape[ax] for ax in feature_axes]
    force32 = module.force_float32_reductions
    stat_dtype = jnp.float32 if force32 else module.param_dtype
    ra_mean = module.variable("batch_stats", "mean", lambda s: jnp.zeros(s, stat_dtype), feature_shape)
    ra_var = module.variable("batch_stats", "var", lambda s: jnp.ones(s, stat_dtype), feature_shape)
    scale = module.param("scale", module.scale_init, feature_shape, module.param_dtype) if module.use_scale else None
    bias = module.param("bias", module.bias_init, feature_shape, module.param_dtype) if module.use_bias else None
    if not force32:
        scale = None if scale is None else jnp.asarray(scale, module.param_dtype)
        bias = None if bias is None else jnp.asarray(bias, module.param_dtype)

    if axis_name is None:
        axis_name, axis_index_groups = module.axis_name, module.axis_index_groups
    if module.is_initializing():
        axis_name, axis_index_groups = None, None  # as Flax: the axis need not exist at init

    if use_running_average:
        # no statistics, no communication: the stored ones, as Flax normalizes
        mean = ra_mean.value if force32 else jnp.asarray(ra_mean.value, module.param_dtype)
        var = ra_var.value if force32 else jnp.asarray(ra_var.value, module.param_dtype)
        return stored_normalize(x, mean, var, scale, bias, feature_axes, module.epsilon, module.dtype)

    config = make_config(x, feature_axes, module.epsilon, axis_name, axis_index_groups, module.dtype, force32,
                         scale, bias)
    y, mean, var = batch_norm(x, scale, bias, mask, config)
    if not module.is_initializing():
        # Flax's rule and promotion: a float32 running mean becomes float64 (x64) or complex
        m = module.momentum
        ra_mean.value = m * ra_mean.value + (1 - m) * mean
        ra_var.value = m * ra_var.value + (1 - m) * var
    return y


def stored_normalize(x, mean, var, scale, bias, feature_axes, epsilon, dtype):
    """Evaluation mode: normalize with given statistics, purely local."""
    shape = tuple(x.shape[ax] if ax in feature_axes else 1 for ax in range(x.ndim))
    mul = jax.lax.rsqrt(var + epsilon).reshape(shape)
    if scale is not None:
        mul = mul * scale.reshape(shape)
    y = (x - mean.reshape(shape)) * mul
    if bias is not None:
        y = y + bias.reshape(shape)
    args = [x] + [p for p in (scale, bias) if p is not None]
    return jnp.asarray(y, dtypes.canonicalize_dtype(*args, dtype=dtype))


class BatchNorm(nn.BatchNorm):
    """Synchronized ``flax.linen.BatchNorm``: statistics over every device of
    ``axis_name`` (optionally within ``axis_index_groups`` under ``pmap``; under
    ``shard_map`` give a group its own mesh axis instead), or over the whole sharded
    batch under ``jit`` without ``axis_name``.

    With ``mask``, every valid element counts once whichever device holds it: uneven
    counts are weighted exactly and a device with no valid element is exact too. A
    channel with no valid element anywhere gets NaN statistics, as in Flax.
    ``use_running_average=True`` communicates nothing. Statistics are ``float32`` (at
    least) for ``bfloat16``/``float16`` inputs; integer inputs are promoted and complex
    inputs normalized (complex mean, real variance) as Flax does, and the running
    statistics take the dtypes Flax's take. ``use_fast_variance`` is ignored (one stable
    algorithm for both settings).
    """

    @nn.compact
    def __call__(self, x, use_running_average: Optional[bool] = None, *, mask: Optional[jax.Array] = None):
        return linen_forward(self, x, use_running_average, mask=mask)
