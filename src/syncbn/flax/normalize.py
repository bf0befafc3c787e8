"""The synchronized batch-norm transform with its own backward (``jax.custom_vjp``).

    y = (x - mean) * rsqrt(var + eps) * scale + bias

with ``mean`` and ``var`` the union statistics of :mod:`syncbn.flax.moments` (one
``psum`` forward). The backward needs, per channel, the totals over every device of
``S1 = sum(scale * dy)`` and ``S2 = sum(scale * dy * xhat)``; they travel in one
concatenated ``psum``, and with ``r = rsqrt(var + eps)``, the valid-element mask ``m``
and the union's count ``N``:

    dx = r * (scale * dy - m * (S1 + xhat * S2) / N) + m * (G_mean + 2 * xhat * G_var / r) / N

where ``G_mean`` and ``G_var`` are the totals of the cotangents of the returned mean and
variance (zero unless something differentiates through the running statistics; they
ride in the same ``psum``). ``dscale = sum(dy * xhat)`` and ``dbias = sum(dy)`` stay
per device under ``pmap`` (its transpose of a replicated argument sums them); under
``shard_map`` a parameter that does not vary over the sync axes receives the total,
taken from the same ``psum``, so ``jax.grad`` from outside ``pmap``/``shard_map``/``jit``
is exact with one collective backward per layer.

Complex inputs (Flax normalizes them: complex mean, real variance ``mean(|x - mean|**2)``)
use the same formulas in JAX's convention for complex cotangents: the cotangent of
``z = u + i v`` is ``dL/du - i dL/dv``, so a linear map such as ``z -> scale * z``
transposes to ``ct -> scale * ct``, without a conjugate. With ``G = scale * dy``:

    dx = r * (G - m * (S1 + conj(xhat) * S2) / N) + m * (G_mean + 2 * conj(xhat) * G_var / r) / N

where ``S1 = sum(G)`` (complex) and ``S2 = Re sum(G * xhat)`` (real: the variance is a
real function of the real and imaginary parts). ``dscale = sum(dy * xhat)`` and
``dbias = sum(dy)``, their real parts for real parameters (the transpose of a real value
used as a complex one). For a real input every ``conj`` and ``Re`` is the identity and
this is the formula above. The output is computed in the statistics dtype promoted with
the parameters' and the input's (as Flax's ``(x - mean) * (rsqrt(var + eps) * scale) + bias``
promotes: the statistics are of the input rounded to their dtype, the input normalized is
the one given) and cast to ``Config.out_dtype``; a complex value cast to a real dtype keeps
its real part.
The backward runs in that dtype promoted to at least ``float32`` (its sums and ``1 / N``
too, as the forward's: see :func:`syncbn.flax.moments.local_moments`), and ``dx`` is
rounded once to the input's dtype.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

from .moments import (Groups, Moments, accum_dtype, axis_names, cast, cross_device_sum, is_complex, is_tracked,
                      real_dtype, union_moments, valid_mask, varying_axes)


class Config(NamedTuple):
    """Static description of one call (hashable: it is a ``nondiff`` argument)."""

    reduction_axes: Tuple[int, ...]
    feature_axes: Tuple[int, ...]
    epsilon: float
    axis_name: Any
    axis_index_groups: Optional[Tuple[Tuple[int, ...], ...]]
    stats_dtype: Any
    out_dtype: Any


def freeze_groups(groups):
    """``axis_index_groups`` as nested tuples (hashable), or None."""
    return None if groups is None else tuple(tuple(int(i) for i in g) for g in groups)


def _feature_shape(x, config: Config):
    return tuple(x.shape[ax] if ax in config.feature_axes else 1 for ax in range(x.ndim))


def _work_dtype(config: Config, scale, bias):
    """The dtype the output is computed in: the statistics dtype promoted with the
    parameters' (complex when any of them is)."""
    return jnp.result_type(config.stats_dtype, *[p.dtype for p in (scale, bias) if p is not None])


def _params(x, scale, bias, config: Config, dtype):
    shape = _feature_shape(x, config)
    one = jnp.ones((), dtype)
    gamma = one if scale is None else scale.astype(dtype).reshape(shape)
    beta = None if bias is None else bias.astype(dtype).reshape(shape)
    return gamma, beta


def _real(value):
    return jnp.real(value) if is_complex(value.dtype) else value


def _rstd(mom: Moments, config: Config):
    """``rsqrt(var + eps)``, real."""
    return lax.rsqrt(mom.var + jnp.asarray(config.epsilon, mom.var.dtype))


def _centered_dtype(x, config: Config):
    """The dtype ``x - mean`` is taken in: the input's promoted with the statistics' dtype,
    as Flax subtracts the mean from the input as given. The statistics are of the input
    rounded to their dtype, but with ``dtype`` (or, under ``jax_enable_x64``, float32
    statistics of a float64 input) narrower than the input, Flax does not round the input
    it normalizes: a float32 input at mean 300 and std 1 with ``dtype=float16`` and
    ``force_float32_reductions=False`` would lose up to 0.125 standard deviations per
    element (half a float16 spacing there) were it rounded first."""
    return jnp.promote_types(x.dtype, config.stats_dtype)


def _forward(x, scale, bias, mask, config: Config):
    dtype = config.stats_dtype
    mom = union_moments(x, mask, config.reduction_axes, dtype, config.axis_name, config.axis_index_groups)
    axes = config.reduction_axes
    mean = jnp.expand_dims(mom.mean, axes)
    rstd = jnp.expand_dims(_rstd(mom, config), axes)
    gamma, beta = _params(x, scale, bias, config, _work_dtype(config, scale, bias))
    y = (cast(x, _centered_dtype(x, config)) - mean) * (rstd * gamma)
    if beta is not None:
        y = y + beta
    return cast(y, config.out_dtype), mom


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def batch_norm(x, scale, bias, mask, config: Config):
    """Normalize ``x`` with the union's statistics; returns ``(y, mean, var)``.

    ``scale``/``bias`` have the reduced feature shape or are None; ``mask`` is a boolean
    array broadcastable to ``x`` or None. ``mean`` and ``var`` (biased) are what the
    running averages are updated with.
    """
    y, mom = _forward(x, scale, bias, mask, config)
    return y, mom.mean, mom.var


def _batch_norm_fwd(x, scale, bias, mask, config):
    y, mom = _forward(x, scale, bias, mask, config)
    return (y, mom.mean, mom.var), (x, scale, bias, mask, mom)


def _takes_total(param, tracked: bool, names) -> bool:
    """Whether a parameter's cotangent is the sum over the sync axes (it does not vary
    over them inside ``shard_map``) rather than this device's part."""
    return tracked and not (set(names) & varying_axes(param))


def _match_varying(ct, like):
    """Sum a cotangent over the mesh axes it varies over and its primal does not
    (parameters replicated across groups that are not synchronized: their gradient is
    that sum by definition)."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(like)))
    return lax.psum(ct, extra) if extra else ct


def _match_sharding(ct, like):
    """A cotangent with its primal's explicit sharding, which ``custom_vjp`` requires:
    with the channels sharded over an explicit mesh axis the per-channel sums are too,
    and a parameter that is not gets them gathered (as Flax's autodiff gathers them).
    Automatic sharding, ``pmap`` and ``shard_map`` are left to JAX as they were."""
    have, want = getattr(jax.typeof(ct), "sharding", None), getattr(jax.typeof(like), "sharding", None)
    if have is None or want is None or AxisType.Explicit not in getattr(have.mesh, "axis_types", ()):
        return ct
    # the primal's spec on the cotangent's mesh (a parameter may live outside any mesh)
    return ct if have.spec == want.spec else jax.sharding.reshard(ct, jax.sharding.NamedSharding(have.mesh, want.spec))


def _batch_norm_bwd(config, residuals, cotangents):
    x, scale, bias, mask, mom = residuals
    dy, g_mean, g_var = cotangents
    dtype = config.stats_dtype
    # at least float32, as the forward's sums (moments.local_moments): with half-precision
    # statistics (force_float32_reductions=False) a float16 count is inf past 65504
    # elements and a float16 sum of dy overflows alike
    work = accum_dtype(_work_dtype(config, scale, bias))
    axes = config.reduction_axes
    names = axis_names(config.axis_name)
    tracked = is_tracked(x, config.axis_name)
    synced = bool(names)
    valid = valid_mask(x, mask)

    wide = accum_dtype(dtype)
    mean = jnp.expand_dims(mom.mean.astype(wide), axes)
    rstd = _rstd(mom._replace(var=mom.var.astype(real_dtype(wide))), config)
    rstd_b = jnp.expand_dims(rstd, axes)
    gamma, _ = _params(x, scale, None, config, work)
    # xhat of the values the statistics are of (the input rounded to their dtype): what the
    # mean and variance pass their cotangents back through
    xhat = (cast(cast(x, dtype), wide) - mean) * rstd_b
    # xhat of what the forward normalized (see _centered_dtype): the same values unless
    # the input is wider than the statistics: dscale, and the variance's share of dx, sum it
    centered = _centered_dtype(x, config)
    if centered == jnp.dtype(dtype):
        xhat_y = xhat
    else:
        xhat_y = (cast(x, jnp.promote_types(centered, wide)) - mean) * rstd_b
    dy = cast(dy, work)
    # per-group sums (one group per device with axis_name; see moments.Groups), summed below
    groups = Groups.of(x, axes, config.axis_name)
    s1 = groups.sum(groups.split(dy))
    s2 = groups.sum(groups.split(dy * xhat_y))

    # without a sync axis the arrays are global (jit): every total is the parameter's gradient
    scale_total = not synced or scale is None or _takes_total(scale, tracked, names)
    bias_total = bias is not None and (not synced or _takes_total(bias, tracked, names))
    # (name, local value) pieces of the one backward psum
    pieces = []
    if scale_total:  # the same scale everywhere: send the unscaled sums
        pieces += [("s1", s1), ("s2", s2)]
    else:
        gamma_c = scale.astype(work)
        pieces += [("gs1", gamma_c * s1), ("gs2", _real(gamma_c * s2))]
        if bias_total:
            pieces.append(("s1", s1))
    local_g = {}
    for name, g in (("g_mean", g_mean), ("g_var", g_var)):
        g = cast(g, mom.mean.dtype if name == "g_mean" else mom.var.dtype)
        if synced and (not tracked or set(names) & varying_axes(g)):
            pieces.append((name, g[None]))  # per-device parts (one group): they must be summed
        else:
            local_g[name] = g  # already the total (or no sync axis at all)

    # (group, piece, *features), complex if any piece is; stacked on a new axis as the
    # forward's payload (moments.union_moments: no feature axis may exist, or it may be sharded)
    flat = jnp.stack([v for _, v in pieces], axis=1)
    flat = cross_device_sum(jnp.sum(flat, axis=0), config.axis_name, config.axis_index_groups, tracked)
    totals = {name: cast(flat[i], piece.dtype) for i, (name, piece) in enumerate(pieces)}
    totals.update(local_g)
    s1, s2 = jnp.sum(s1, axis=0), jnp.sum(s2, axis=0)  # this device's (pmap, shard_map: one group)

    if scale_total:
        g = 1.0 if scale is None else scale.astype(work)
        g1, g2 = totals["s1"] * g, _real(totals["s2"] * g)
    else:
        g1, g2 = totals["gs1"], totals["gs2"]
    inv_n = 1.0 / mom.count.astype(rstd.dtype)
    expand = functools.partial(jnp.expand_dims, axis=axes)
    xc = jnp.conj(xhat) if is_complex(xhat.dtype) else xhat  # the gradient of |xhat|**2 / 2
    dx = rstd_b * (gamma * dy)
    stat = (expand(g1 * inv_n) + xc * expand(g2 * inv_n)) * rstd_b
    stat = stat - expand(totals["g_mean"] * inv_n) - xc * expand(2.0 * totals["g_var"] * inv_n / rstd)
    if is_complex(x.dtype) and not is_complex(xhat.dtype):
        # real statistics of a complex input (a real `dtype`: they are of its real part):
        # they pass back a real cotangent, the real part of what complex parameters give
        stat = jnp.real(stat)
    dx = dx - (stat if valid is None else jnp.where(valid, stat, 0))
    # x's own explicit sharding: scale/bias sharded over a mesh axis that x's channels are
    # not (parameters sharded P('m') beside a batch sharded P('d')) shard the products
    dx = _match_sharding(cast(dx, x.dtype), x)

    dscale = dbias = None
    if scale is not None:
        dscale = _match_sharding(_match_varying(cast(totals["s2"] if scale_total else s2, scale.dtype), scale), scale)
    if bias is not None:
        dbias = _match_sharding(_match_varying(cast(totals["s1"] if bias_total else s1, bias.dtype), bias), bias)
    return dx, dscale, dbias, None


batch_norm.defvjp(_batch_norm_fwd, _batch_norm_bwd)
