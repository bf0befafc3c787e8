"""Per-channel batch statistics with ``keras.ops``: local moments, and the pack / merge
that turns every replica's moments into global ones with a single sum.

No communication happens here and nothing here depends on the Keras backend; the
cross-replica sum lives in :mod:`syncbn.keras.replicas`.

Notation (per channel, see ``shared/DESIGN.md``): a replica holds ``n`` counted
elements (all of them, or those its mask keeps) with mean ``m`` and
``M2 = sum (x - m)^2``. Around a shift ``K`` that every replica shares (the layer's
moving mean), it packs

    [n,  n * a,  M2 + n * a^2]        with a = m - K,

``2C + 1`` values in the summing dtype (float64 where the devices have it). Summed over
the replicas, with ``A = sum n a / N``:

    N = sum n,   mean = K + A,   var = sum (M2 + n a^2) / N - A^2   (biased).

``M2`` comes from a corrected two-pass reduction, so the only cancellation left is the
last subtraction, done in the summing dtype: in float64 its relative error is about
``1e-16 * ((mean - K) / std)^2``, 1e-10 at ``|mean - K| / std = 1e3``. The shift only
matters where the sum must be float32 (no float64 on the device): there the error is
about ``6e-8 * ((mean - K) / std)^2``, small once the moving mean tracks the data.
"""

from __future__ import annotations

from keras import ops

__all__ = [
    "reduction_axes",
    "broadcast_shape",
    "element_mask",
    "static_count",
    "element_count",
    "local_moments",
    "batch_moments",
    "pack",
    "merge",
]


def reduction_axes(ndim: int, axis: int) -> list:
    """Every axis of an ``ndim``-dimensional input except the channel ``axis``."""
    axis = axis % ndim
    return [i for i in range(ndim) if i != axis]


def broadcast_shape(ndim: int, axis: int, channels: int) -> list:
    """Shape that broadcasts a per-channel vector against the input: 1 except at ``axis``."""
    shape = [1] * ndim
    shape[axis % ndim] = channels
    return shape


def element_mask(mask, inputs, axis: int):
    """The Keras mask (input shape without the channel axis) as a boolean tensor with a
    size-1 channel axis, broadcast over every other axis of ``inputs``; None stays None."""
    if mask is None:
        return None
    mask = ops.expand_dims(ops.cast(mask, "bool"), axis % len(inputs.shape))
    shape = list(ops.shape(inputs))
    shape[axis % len(inputs.shape)] = 1
    return ops.broadcast_to(mask, shape)


def static_count(inputs, axis: int):
    """Elements per channel that the static shape of ``inputs`` holds (a mask may keep
    fewer), or None when a dimension other than the channel axis is unknown."""
    count = 1
    for i in reduction_axes(len(inputs.shape), axis):
        size = inputs.shape[i]
        if size is None:
            return None
        count = count * size
    return count


def element_count(inputs, axis: int, mask, dtype):
    """Elements counted per channel (the same for every channel), as a 0-d ``dtype`` tensor.

    Counted directly in ``dtype`` (not in the input's float32), so that counts above
    2**24 stay exact when ``dtype`` is float64.
    """
    if mask is not None:
        return ops.sum(ops.cast(mask, dtype))
    shape = ops.shape(inputs)
    count = 1
    for i in reduction_axes(len(inputs.shape), axis):
        count = count * shape[i]
    return ops.cast(count, dtype)


def local_moments(x, axis: int, mask, count):
    """This replica's per-channel ``(mean, M2)``, shaped to broadcast against ``x``.

    Corrected two-pass: ``m0 = sum x / n``, then ``s = sum (x - m0)`` and
    ``q = sum (x - m0)^2`` give ``mean = m0 + s / n`` and ``M2 = q - s^2 / n``. The
    correction removes the rounding error of ``m0`` to first order, so ``M2`` keeps
    full relative precision whatever ``|mean| / std``. ``count`` is a 0-d tensor in
    ``x``'s dtype; with ``n = 0`` the result is zeros. Masked-out elements never enter
    a sum (not even as ``0 * inf``).
    """
    axes = reduction_axes(len(x.shape), axis)
    safe = ops.maximum(count, 1.0)
    kept = x if mask is None else ops.where(mask, x, ops.zeros_like(x))
    m0 = ops.sum(kept, axis=axes, keepdims=True) / safe
    d = x - m0
    if mask is not None:
        d = ops.where(mask, d, ops.zeros_like(d))
    s = ops.sum(d, axis=axes, keepdims=True)
    q = ops.sum(ops.square(d), axis=axes, keepdims=True)
    mean = m0 + s / safe
    m2 = ops.maximum(q - ops.square(s) / safe, 0.0)
    return mean, m2


def batch_moments(x, axis: int, mask):
    """Per-channel ``(mean, biased var)`` of ``x`` alone, as vectors, differentiable.

    This is the statistic of one replica; it is also the global one wherever the
    backend presents the whole batch as one (sharded) array, as JAX does under
    ``keras.distribution.DataParallel``.
    """
    channels = x.shape[axis]
    count = element_count(x, axis, mask, x.dtype)
    mean, m2 = local_moments(x, axis, mask, count)
    var = m2 / ops.maximum(count, 1.0)
    return ops.reshape(mean, (channels,)), ops.reshape(var, (channels,))


def pack(count, mean, m2, shift, dtype):
    """``[n, n * a, M2 + n * a^2]`` (a = mean - shift) as one flat ``dtype`` vector.

    ``count`` is a 0-d ``dtype`` tensor; ``mean`` and ``m2`` are this replica's local
    moments (any shape holding C values); ``shift`` is a length-C vector that every
    replica holds identically.
    """
    channels = shift.shape[0]
    n = ops.reshape(count, (1,))
    a = ops.reshape(ops.cast(mean, dtype), (channels,)) - ops.cast(shift, dtype)
    m2 = ops.reshape(ops.cast(m2, dtype), (channels,))
    na = n * a
    return ops.concatenate([n, na, m2 + na * a], axis=0)


def merge(total, shift):
    """Global ``(count, mean, biased var)`` from the replicas' summed packs.

    Everything stays in the packed dtype. The variance is clamped at zero, so rounding
    can never make it negative; a global count of zero gives ``mean = shift, var = 0``.
    """
    channels = shift.shape[0]
    count = total[0]
    safe = ops.maximum(count, 1.0)
    offset = total[1 : channels + 1] / safe
    mean = ops.cast(shift, total.dtype) + offset
    var = ops.maximum(total[channels + 1 :] / safe - ops.square(offset), 0.0)
    return count, mean, var
