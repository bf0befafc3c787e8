"""Batch moments over the union of devices: local, stable, merged with one ``psum``.

Per channel and per device r the layer needs the valid-element count ``n_r``, the mean
``m_r`` and ``M2_r = sum (x - m_r)**2`` over the elements the mask keeps. They are
computed in two local passes (``float32`` at least):

1. ``m1 = sum(x) / n_r`` — a first guess, accurate to about ``eps * |mean|``, rounded
   to 20 mantissa bits so that every use sees the same center (see ``local_moments``);
2. ``a = sum(x - m1)`` and ``b = sum((x - m1)**2)`` in one fused pass; the corrected
   mean is ``m1 + a / n_r`` and ``M2_r = b - a**2 / n_r`` (the corrected two-pass
   algorithm: no cancellation, whatever ``|mean| / std``).

The correction is applied in ``float64``, and each device contributes the sums
``[n_r, n_r * m_r, M2_r + n_r * m_r**2]``, stacked in one ``float64`` array, to a
single ``psum``: the pack and merge of :mod:`syncbn.core.moments` with shift 0, where
their derivation and error analysis are. ``float64`` is enabled only for these O(C)
values, through the public ``jax.enable_x64`` context, whatever the process's
``jax_enable_x64`` says.

Without ``axis_name`` the arrays are global (``jit`` with a sharded batch) and XLA
decides where a reduction crosses devices: a sum over the sharded batch axis becomes a
local sum and an all-reduce. Summed over the whole batch, the second pass would wait for
the first pass's all-reduce (two dependent reductions per layer). So the first reduction
axis is split into equal groups (:class:`Groups`), both passes run per group, and only
the groups' ``float64`` sums cross devices. Under explicit sharding (``jax.make_mesh``'s
default) the array's type names the ``s`` shards of that axis and there are ``s``
groups, one per device. Otherwise (automatic sharding: XLA propagates it, the trace does
not see it) there are ``gcd(size, jax.device_count())``: a batch sharded ``s`` ways over
a mesh of all devices has ``s`` dividing both, hence the group count. Either way each
device holds whole groups, its passes need no communication, and the layer has one
all-reduce forward (and, in :mod:`syncbn.flax.normalize`, one backward). The split
changes where XLA communicates, not the accuracy: per-group moments merge exactly as
per-device ones do under ``pmap`` (a batch sharded otherwise, or not at all, is as
accurate; only the single all-reduce is not promised then).

A device whose elements are all masked contributes zeros and is exact. When no element
of a channel is valid anywhere (N = 0) its mean and variance are NaN, as in
``flax.linen.BatchNorm`` (the mean of nothing); N = 1 gives variance 0. A NaN among the
valid elements gives NaN statistics; an infinite one (or a float32 sum that overflows)
an infinite mean and a NaN variance, as Flax's.

Complex inputs are normalized as Flax does: the mean is complex and the variance real,
``mean(|x - mean|**2)`` (the variances of the real and imaginary parts added). Each
part's sum merges like a real moment and the centered squares add across the parts, so
the payload is ``[n_r, n_r * Re m_r, n_r * Im m_r, M2_r + n_r * |m_r|**2]`` with
``M2_r = sum |x - m_r|**2``: one ``psum`` still, of ``4C`` values instead of ``3C``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

AxisName = Any


class Moments(NamedTuple):
    """Union statistics per channel: count (``float32``), mean (in the statistics dtype,
    complex for a complex input) and biased variance (its real counterpart)."""

    count: jax.Array
    mean: jax.Array
    var: jax.Array


def stats_dtype(x_dtype, force_float32: bool = True):
    """The dtype of the batch mean, as Flax's ``_compute_stats`` has it: the input's (or
    the layer's ``dtype``) promoted to at least ``float32`` with ``force_float32`` (half
    precision becomes ``float32``; ``float64`` and complex stay), left as it is without;
    an integer dtype that remains gives the float dtype its mean has (``float32``, or
    ``float64`` under ``jax_enable_x64``). The variance has :func:`real_dtype` of it."""
    dtype = jnp.promote_types(x_dtype, jnp.float32) if force_float32 else jnp.dtype(x_dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jax.eval_shape(jnp.mean, jax.ShapeDtypeStruct((1,), dtype)).dtype
    return jax.dtypes.canonicalize_dtype(dtype)  # float64 is float32 without jax_enable_x64


def accum_dtype(dtype):
    """The dtype local sums are accumulated in: ``dtype`` promoted to at least ``float32``
    (``float16``/``bfloat16`` become ``float32``; ``float64`` and complex stay)."""
    return jnp.promote_types(dtype, jnp.float32)


def is_complex(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def real_dtype(dtype):
    """``float32`` for ``complex64``, ``float64`` for ``complex128``, a real dtype itself."""
    return jnp.finfo(dtype).dtype if is_complex(dtype) else jnp.dtype(dtype)


def cast(value, dtype):
    """``value`` as ``dtype``; a complex value cast to a real dtype keeps its real part
    (as a cast does, stated rather than warned about)."""
    if is_complex(value.dtype) and not is_complex(dtype):
        value = jnp.real(value)
    return value.astype(dtype)


def abs_sq(value):
    """``|value|**2`` elementwise, real (the square for a real value)."""
    if is_complex(value.dtype):
        return lax.square(jnp.real(value)) + lax.square(jnp.imag(value))
    return lax.square(value)


def parts(value):
    """The real components of ``value``: ``[value]``, or ``[Re value, Im value]``."""
    return [jnp.real(value), jnp.imag(value)] if is_complex(value.dtype) else [value]


def from_parts(components):
    return components[0] if len(components) == 1 else lax.complex(*components)


def varying_axes(value) -> frozenset:
    """The manual mesh axes a value varies over inside ``shard_map`` (empty elsewhere,
    for example under ``pmap``, which does not track them)."""
    aval = jax.typeof(value)
    kind = getattr(aval, "manual_axis_type", None)
    if kind is not None:
        return frozenset(kind.varying)
    return frozenset(getattr(aval, "vma", ()))


def axis_names(axis_name: AxisName) -> Tuple:
    if axis_name is None:
        return ()
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def is_tracked(x, axis_name: AxisName) -> bool:
    """True under ``shard_map`` with ``x`` varying over every sync axis: there values
    that do not vary over those axes are totals, not per-device parts."""
    names = axis_names(axis_name)
    return bool(names) and set(names) <= varying_axes(x)


def cross_device_sum(value, axis_name: AxisName, axis_index_groups=None, tracked: bool = False):
    """The layer's one collective: ``psum`` over ``axis_name`` (and its groups)."""
    if axis_name is None:
        return value
    if axis_index_groups is not None and tracked:
        raise ValueError(
            "syncbn.flax: axis_index_groups is not supported under shard_map (JAX's psum "
            "refuses it there). Give each synchronization group a mesh axis of its own and "
            "pass that axis as axis_name, e.g. mesh axes ('group', 'replica') with "
            "axis_name='replica'.")
    return lax.psum(value, axis_name, axis_index_groups=axis_index_groups)


def explicit_shards(x, axis: int) -> int:
    """How many ways ``x``'s ``axis`` is split over explicit mesh axes (``jax.typeof(x)``
    names them under explicit sharding), or 0 when it is not."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None or axis >= len(spec) or spec[axis] is None:
        return 0
    names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
    return math.prod(mesh.shape[name] for name in names)


class Groups(NamedTuple):
    """Where one call's local sums are taken: ``x``'s reduction axis ``axis`` split into
    ``count`` equal groups, each summed on its own (``count`` is 1 with an ``axis_name``:
    there each device is one group). See the module docstring for why. ``axis`` is the
    first reduction axis (those before it are feature axes), so it is also where the
    group axis lands in a per-group sum."""

    axis: int
    count: int
    inner: Tuple[int, ...]  # the reduction axes of the split array, within one group

    @classmethod
    def of(cls, x, reduction_axes: Sequence[int], axis_name: AxisName) -> "Groups":
        axes = tuple(sorted(reduction_axes))
        if not axes:
            return cls(0, 1, ())
        axis = axes[0]
        count = 1
        if axis_name is None:  # explicit sharding names the split; else any divisor will do
            count = explicit_shards(x, axis) or math.gcd(x.shape[axis], jax.device_count())
        inner = tuple(ax + 1 for ax in axes)
        return cls(axis, count, inner)

    def split(self, v):
        """``v`` (of ``x``'s shape) with ``axis`` split into (``count``, size / ``count``),
        a free reshape; with no reduction axis at all, a leading group axis of size 1."""
        if not self.inner:
            return v[None]
        shape = v.shape[:self.axis] + (self.count, v.shape[self.axis] // self.count)
        return v.reshape(shape + v.shape[self.axis + 1:])

    def sum(self, v, dtype=None):
        """Per-group sums of an array of the split shape, group axis first."""
        return jnp.moveaxis(jnp.sum(v, axis=self.inner, dtype=dtype), self.axis, 0)


def valid_mask(x, mask):
    """The mask broadcast to ``x``'s shape as booleans, or None."""
    if mask is None:
        return None
    return jnp.broadcast_to(jnp.asarray(mask, dtype=bool), x.shape)


def _masked(values, mask):
    return values if mask is None else jnp.where(mask, values, 0)


def local_moments(x, mask, groups: Groups, dtype):
    """Per group, group axis first: ``(n, first guess m1, a = sum(x - m1), b = sum((x - m1)**2))``
    for ``x`` and ``mask`` of the split shape (:meth:`Groups.split`).

    ``x`` is rounded to the statistics dtype ``dtype`` (the values Flax takes the
    statistics of), then every sum and the count are accumulated in :func:`accum_dtype`,
    at least ``float32`` whatever ``dtype`` is: a ``float16`` sum would overflow past
    65504 (``b`` for a few hundred elements of std 30; the count past 65504 elements)
    and a ``bfloat16`` one keeps 8 bits. In ``float32`` the sums of ``n`` terms carry a
    relative error of at most about ``n * 2**-24`` of the sum of magnitudes (sequential
    bound; XLA's tree reductions give ``log2(n) * 2**-24``), which for ``b`` (all terms
    positive) is relative to ``M2`` itself, and the count is exact below ``2**24``
    elements per group. The statistics are then rounded once to ``dtype`` (half a
    unit in its last place: ``2**-11`` for ``float16``, ``2**-8`` for ``bfloat16``), so
    with ``force_float32_reductions=False`` the half-precision mean and variance are the
    exactly computed statistics of the half-precision input, rounded once."""
    axes = groups.inner
    acc = accum_dtype(dtype)
    xs = cast(cast(x, dtype), acc)
    total = jnp.sum(_masked(xs, mask), axis=axes)
    # The count takes the sums' sharding (``full_like``; ones where ``xs`` is), so that the
    # payload's pieces can be stacked under explicit sharding, which requires one sharding:
    # with the channels sharded, ``jnp.full`` would be replicated and a mask's sum would
    # have the mask's sharding, not the sums'.
    if mask is None:
        n = jnp.full_like(total, math.prod(x.shape[ax] for ax in axes), dtype=jnp.int32)
    else:
        n = jnp.sum(_masked(jnp.ones_like(xs, dtype=jnp.int32), mask), axis=axes)
    # The correction m1 + a / n needs a = sum(x - m1) taken around the very m1 it adds
    # back. XLA may recompute m1 = total * (1 / n) inside the subtraction's fusion and
    # contract x - total * (1 / n) into a fused multiply-add, the product unrounded: a
    # center up to half a rounding away from the m1 stored (measured under jit with a
    # sharded, masked batch: variance relative error 5e-5 at |mean|/std = 1e4, 5e-6 at
    # 1e3). Rounding m1 to 20 mantissa bits makes the center an explicit value every
    # use computes alike (nothing is left to contract; a reduce_precision that keeps all
    # 23 bits would be dropped by XLA as a no-op). The center only needs to be near the
    # mean: 2**-21 * |mean| is 5e-3 std at |mean|/std = 1e4, which costs M2 = b - a**2 / n
    # a factor 1 + 3e-5 of its float32 rounding. A complex center: each part alike.
    info = jnp.finfo(acc)  # 20 of float32's 23 bits (float64: 49 of 52), its full range
    m1 = from_parts([lax.reduce_precision(p, exponent_bits=info.nexp, mantissa_bits=info.nmant - 3)
                     for p in parts(total / jnp.maximum(n, 1).astype(real_dtype(acc)))])
    d = _masked(xs - jnp.expand_dims(m1, axes), mask)
    a = jnp.sum(d, axis=axes)
    b = jnp.sum(abs_sq(d), axis=axes)
    return tuple(jnp.moveaxis(v, groups.axis, 0) for v in (n, m1, a, b))


def union_moments(x, mask, reduction_axes: Sequence[int], dtype, axis_name: AxisName = None,
                  axis_index_groups=None) -> Moments:
    """Count, mean and biased variance per channel over every device of ``axis_name``
    (or over the whole, possibly sharded, array without it). One cross-device sum.
    ``dtype`` is the statistics dtype (:func:`stats_dtype`); a complex one gives a complex
    mean and a real variance, ``mean(|x - mean|**2)``."""
    mask = valid_mask(x, mask)
    groups = Groups.of(x, reduction_axes, axis_name)
    n, m1, a, b = local_moments(groups.split(x), None if mask is None else groups.split(mask), groups, dtype)
    tracked = is_tracked(x, axis_name)
    with jax.enable_x64(True):
        wide = jnp.float64
        n64 = n.astype(wide)
        safe = jnp.maximum(n64, 1.0)
        # per part (real; or real and imaginary): corrected mean; M2 of all parts together
        a64 = [p.astype(wide) for p in parts(a)]
        # an infinite first guess (an infinite element, or a sum past the dtype's range) is
        # the mean, as Flax's sum / n gives it: its correction would be inf - inf = NaN
        mean_r = [jnp.where(jnp.isinf(c), c, c.astype(wide) + s / safe).astype(wide)
                  for c, s in zip(parts(m1), a64)]
        m2_r = jnp.maximum(b.astype(wide) - sum(s * s for s in a64) / safe, 0.0)
        # (group, piece, *features): the sum over groups is the only reduction that may cross
        # devices. Stacked on a new axis, not concatenated along a feature axis: there may be
        # none (axis=()), and a sharded one would have to move between devices.
        payload = jnp.stack([n64] + [n64 * m for m in mean_r] + [m2_r + n64 * sum(m * m for m in mean_r)],
                            axis=1)
        total = cross_device_sum(jnp.sum(payload, axis=0), axis_name, axis_index_groups, tracked)
        count, *sums, q = (total[i] for i in range(2 + len(mean_r)))
        mean = [s / count for s in sums]
        var = jnp.maximum(q / count - sum(m * m for m in mean), 0.0)
        # N = 0: 0/0 is NaN for the mean; keep the variance NaN too, as Flax's is
        var = jnp.where(count > 0, var, jnp.nan)
        out = Moments(count.astype(jnp.float32), from_parts(mean).astype(dtype), var.astype(real_dtype(dtype)))
    return out
