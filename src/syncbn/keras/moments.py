"""Per-channel batch statistics with ``keras.ops``: local moments, and the pack / merge
that turns every replica's moments into global ones with a single sum.

No communication happens here and nothing here depends on the Keras backend; the
cross-replica sum lives in :mod:`syncbn.keras.replicas`.

The pack and merge are those of :mod:`syncbn.core.moments` (the derivation and its
error analysis are there), with the layer's moving mean as the shift ``K`` that every
replica shares: a replica with ``n`` counted elements (all of them, or those its mask
keeps), mean ``m`` and ``M2 = sum (x - m)^2`` packs ``[n, n a, M2 + n a^2]``,
``a = m - K``, in the summing dtype (float64 where the devices have it; ``3C`` values
when a mask gives each channel its own count). ``M2`` comes from a corrected two-pass
reduction. The shift matters only where the sum must be float32 (no float64 on the
device): there the merge loses about ``6e-8 * ((mean - K) / std)^2``, small once the
moving mean tracks the data.
"""

from __future__ import annotations

import keras
from keras import ops

from ..core.moments import broadcast_shape, reduction_axes

__all__ = [
    "at_least",
    "reduction_axes",
    "broadcast_shape",
    "element_mask",
    "per_channel_counts",
    "count_shape",
    "safe_count",
    "element_count",
    "channel_sum",
    "centered_sums",
    "local_moments",
    "batch_moments",
    "pack",
    "merge",
    "train_normalize",
]


def at_least(x, floor: float):
    """``max(x, floor)`` in ``x``'s dtype (Keras's PyTorch backend computes
    ``ops.maximum`` of two float64 tensors in float32: there a select instead)."""
    if keras.backend.backend() == "torch":
        return ops.where(x < floor, ops.cast(floor, x.dtype), x)
    return ops.maximum(x, ops.cast(floor, x.dtype))


def element_mask(mask, inputs):
    """The Keras mask as a boolean tensor of shape ``inputs.shape[:-1] + (1,)``; None
    stays None.

    Keras's convention, whatever the channel axis: a mask covers the input's leading
    axes (``inputs.shape[:-1]``, typically samples and timesteps; any shape that
    broadcasts to them) and is broadcast over the last axis. With the channel on the
    last axis every channel counts the same elements; with the channel elsewhere the
    mask selects (sample, ..., channel) rows and each channel has its own count.
    """
    if mask is None:
        return None
    shape = list(ops.shape(inputs))[:-1] + [1]
    return ops.broadcast_to(ops.expand_dims(ops.cast(mask, "bool"), -1), shape)


def per_channel_counts(ndim: int, axis: int, mask) -> bool:
    """Whether the channels of an ``ndim``-dimensional input count different numbers of
    elements: only with a mask and the channel axis not last (see :func:`element_mask`)."""
    return mask is not None and axis % ndim != ndim - 1


def count_shape(ndim: int, axis: int) -> list:
    """Shape that broadcasts a count (0-d, or one value per channel) against the input."""
    return broadcast_shape(ndim, axis, -1)


def element_count(inputs, axis: int, mask, dtype):
    """Elements counted per channel, in ``dtype``: a 0-d tensor when every channel counts
    the same, else a length-C vector (:func:`per_channel_counts`).

    Counted directly in ``dtype`` (not in the input's float32), so that counts above
    2**24 stay exact when ``dtype`` is float64. ``mask`` is :func:`element_mask`'s.
    """
    ndim = len(inputs.shape)
    if mask is None:
        shape = ops.shape(inputs)
        count = 1
        for i in reduction_axes(ndim, axis):
            count = count * shape[i]
        return ops.cast(count, dtype)
    kept = ops.cast(mask, dtype)
    if not per_channel_counts(ndim, axis, mask):
        return ops.sum(kept)
    # The mask has size 1 on the last axis: sum over the others but the channel axis,
    # then count the last axis's length.
    axes = [i for i in range(ndim - 1) if i != axis % ndim]
    per_channel = ops.reshape(ops.sum(kept, axis=axes), (-1,))
    return per_channel * ops.cast(ops.shape(inputs)[-1], dtype)


def safe_count(count, ndim: int, axis: int):
    """``max(count, 1)`` shaped to broadcast against an ``ndim``-dimensional input: the
    divisor of per-channel sums (a channel that counts nothing divides zeros by 1)."""
    return ops.reshape(at_least(count, 1.0), count_shape(ndim, axis))


def centered_sums(x, axis: int, mask, count):
    """This replica's per-channel ``(m0, d, s, M2)``, each shaped to broadcast against ``x``.

    Corrected two-pass: ``m0 = sum x / n``, ``d = x - m0`` (every element, counted or
    not), then over the counted elements ``s = sum d`` and ``q = sum d^2`` give the
    local mean ``m0 + s / n`` and ``M2 = q - s^2 / n``. The correction removes the
    rounding error of ``m0`` to first order, so ``M2`` keeps full relative precision
    whatever ``|mean| / std``. ``count`` is :func:`element_count`'s, in ``x``'s dtype; a
    channel with ``n = 0`` gets zeros (as Keras's layer gives a fully masked channel).
    Masked-out elements never enter a sum (not even as ``0 * inf``). Every step is a
    differentiable op of ``x``.
    """
    safe = safe_count(count, len(x.shape), axis)
    kept = x if mask is None else ops.where(mask, x, ops.zeros_like(x))
    m0 = channel_sum(kept, axis) / safe
    d = x - m0
    counted = d if mask is None else ops.where(mask, d, ops.zeros_like(d))
    s = channel_sum(counted, axis)
    q = channel_sum(ops.square(counted), axis)
    m2 = at_least(q - ops.square(s) / safe, 0.0)
    return m0, d, s, m2


def _full_precision_matmul() -> bool:
    """Whether TensorFlow's float32 matrix products are exact float32 here: no GPU with
    TensorFloat-32 enabled and no TPU among the logical devices."""
    import tensorflow as tf

    if tf.config.list_logical_devices("TPU"):
        return False
    return not (tf.config.experimental.tensor_float_32_execution_enabled() and tf.config.list_logical_devices("GPU"))


def channel_sum(x, axis: int):
    """``sum(x)`` over every axis but the channel ``axis`` (kept, size 1), differentiable
    to every order.

    On TensorFlow as matrix products with a vector of ones, ``(P*C, R) @ 1`` (unless
    the channel axis is last) then ``1 @ (P, C)`` (``P``, ``R``: the sizes before and
    after the channel axis): its
    CPU reductions over a non-innermost axis read the data at a fraction of memory
    speed (2 to 5 times slower than the product, measured on this project's CPU VM).
    The sums are the same up to the order of float32 additions, which nothing here
    relies on (the moments correct the mean's rounding, see :func:`centered_sums`).
    Only where TensorFlow multiplies float32 matrices in full precision: not with a GPU
    while TensorFloat-32 is enabled (its default; 10-bit mantissas), nor with a TPU
    (bfloat16 passes by default). Elsewhere ``ops.sum``."""
    ndim = len(x.shape)
    axis = axis % ndim
    if keras.backend.backend() != "tensorflow" or not _full_precision_matmul():
        return ops.sum(x, axis=reduction_axes(ndim, axis), keepdims=True)
    import tensorflow as tf

    channels = x.shape[axis]
    planes = x
    if axis != ndim - 1:
        rest = tf.reduce_prod(tf.shape(x)[axis + 1 :])
        planes = tf.matmul(tf.reshape(x, [-1, rest]), tf.ones(tf.stack([rest, 1]), x.dtype))  # (P*C, 1)
    planes = tf.reshape(planes, [-1, channels])  # (P, C)
    total = tf.matmul(tf.ones(tf.stack([1, tf.shape(planes)[0]]), x.dtype), planes)  # (1, C)
    return tf.reshape(total, broadcast_shape(ndim, axis, channels))


def local_moments(x, axis: int, mask, count):
    """This replica's per-channel ``(mean, M2)``, shaped to broadcast against ``x``: those
    of :func:`centered_sums`, ``mean = m0 + s / n``."""
    m0, _, s, m2 = centered_sums(x, axis, mask, count)
    safe = safe_count(count, len(x.shape), axis)
    return m0 + s / safe, m2


def batch_moments(x, axis: int, mask):
    """Per-channel ``(mean, biased var)`` of ``x`` alone, as vectors, differentiable.

    This is the statistic of one replica; it is also the global one wherever the
    backend presents the whole batch as one (sharded) array, as JAX does under
    ``keras.distribution.DataParallel``.
    """
    channels = x.shape[axis]
    count = element_count(x, axis, mask, x.dtype)
    mean, m2 = local_moments(x, axis, mask, count)
    var = m2 / safe_count(count, len(x.shape), axis)
    return ops.reshape(mean, (channels,)), ops.reshape(var, (channels,))


def pack(count, mean, m2, shift, dtype):
    """``[n, n * a, M2 + n * a^2]`` (a = mean - shift) as one flat ``dtype`` vector:
    ``2C + 1`` values, or ``3C`` when ``count`` has one value per channel.

    ``count`` is :func:`element_count`'s, in ``dtype``; ``mean`` and ``m2`` are this
    replica's local moments (any shape holding C values); ``shift`` is a length-C
    vector that every replica holds identically.
    """
    channels = shift.shape[0]
    n = ops.reshape(count, (-1,))
    a = ops.reshape(ops.cast(mean, dtype), (channels,)) - ops.cast(shift, dtype)
    m2 = ops.reshape(ops.cast(m2, dtype), (channels,))
    na = n * a
    return ops.concatenate([n, na, m2 + na * a], axis=0)


def merge(total, shift):
    """Global ``(count, mean, biased var)`` from the replicas' summed packs.

    Everything stays in the packed dtype; ``count`` has 1 or C values, as packed. The
    variance is clamped at zero, so rounding can never make it negative. A channel
    that no replica counts (fully masked) gets ``mean = 0, var = 0``, what Keras's
    layer computes for it on one device.
    """
    channels = shift.shape[0]
    counts = total.shape[0] - 2 * channels
    count = total[:counts]
    safe = at_least(count, 1.0)
    offset = total[counts : counts + channels] / safe
    mean = ops.where(count > 0, ops.cast(shift, total.dtype) + offset, ops.zeros_like(offset))
    var = at_least(total[counts + channels :] / safe - ops.square(offset), 0.0)
    return count, mean, var


def train_normalize(x, axis: int, mask, gamma, beta, epsilon, combine=None, all_reduce=None, count_dtype=None):
    """A training call's ``(y, mean, biased var)`` with a closed-form backward; ``mean``
    and ``var`` (vectors, in ``x``'s dtype) are for the moving averages and carry no
    gradient.

    Per channel, with this replica's :func:`centered_sums` ``(m0, d, s, M2)``:

    - statistics: this batch's own (``mean = m0 + s / n``, ``var = M2 / n``), or, with
      ``combine(count, local mean, M2) -> (N, mean, var)``, those over every replica
      (``count`` in ``count_dtype``, the result in the summing dtype);
    - forward, with ``delta = mean - m0`` (taken in the summing dtype, small: at most
      a few global standard deviations) and ``scale = gamma / sqrt(var + eps)``:
      ``y = d * scale + (beta - delta * scale)``, which is ``(x - mean) * scale + beta``
      without a second subtraction over the data and without the rounding of a
      float32 ``mean`` far from zero;
    - backward, from ``s1 = sum dy`` and ``t = sum dy * d`` (``sum dy * xhat`` is
      ``(t - delta * s1) / sqrt(var + eps)``), summed over the replicas by
      ``all_reduce`` (one call, ``2C`` values) when given, and with ``w`` the 0/1
      weights of counted elements (every element is normalized with the batch
      statistics, counted or not; only counted ones move them):
      ``dx = dy * scale - w * scale * (S1 + (d - delta) * S2 / sqrt(var + eps)) / N``,
      ``dgamma = sum dy * xhat``, ``dbeta = sum dy`` (this replica's sums).

    Two passes fewer than normalizing ``x - mean`` again, one fewer backward. Every
    quantity the backward uses is computed from ``x`` by differentiable ops inside the
    function (``combine`` and ``all_reduce`` must be differentiable too), so
    differentiating the backward again (a gradient penalty) gives the exact second
    derivative: TensorFlow records the forward's ops on every active tape.

    On JAX (always local here: ``combine`` and ``all_reduce`` are TensorFlow's) the
    same closed form is a JVP rule instead (:func:`_jax_train_local`), which JAX
    transposes for reverse mode: a custom VJP would refuse forward-mode derivatives
    (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``, Hessian-vector products), which
    Keras's own layer gives.
    """
    if keras.backend.backend() == "jax" and combine is None and all_reduce is None:
        return _jax_train_local(x, axis, mask, gamma, beta, epsilon)
    ndim = len(x.shape)
    channels = x.shape[axis]
    shape = broadcast_shape(ndim, axis, channels)
    cshape = count_shape(ndim, axis)
    gamma = ops.ones((channels,), x.dtype) if gamma is None else gamma
    beta = ops.zeros((channels,), x.dtype) if beta is None else beta
    weights = None if mask is None else ops.cast(mask, x.dtype)

    @ops.custom_gradient
    def train(x, gamma, beta):
        count = element_count(x, axis, mask, count_dtype or x.dtype)
        local_count = ops.cast(count, x.dtype)
        m0, d, s, m2 = centered_sums(x, axis, mask, local_count)
        safe = safe_count(local_count, ndim, axis)
        if combine is None:
            n, delta = safe, s / safe
            mean, var = m0 + delta, m2 / safe
        else:
            total, mean, var = combine(count, m0 + s / safe, m2)
            n = ops.reshape(ops.cast(at_least(total, 1.0), x.dtype), cshape)
            delta = ops.cast(ops.reshape(mean, shape) - ops.cast(m0, mean.dtype), x.dtype)
            mean, var = ops.cast(mean, x.dtype), ops.cast(ops.reshape(var, shape), x.dtype)
        y, inv, scale = _normalized(d, delta, var, gamma, beta, shape, epsilon)

        def grad(*args, upstream=None):
            dy = args[0] if upstream is None else upstream
            if isinstance(dy, (tuple, list)):  # JAX: one cotangent for the output tuple
                dy = dy[0]
            s1 = channel_sum(dy, axis)
            s2 = (channel_sum(dy * d, axis) - delta * s1) * inv
            big_s1, big_s2 = s1, s2
            if all_reduce is not None:
                summed = all_reduce(ops.concatenate([ops.reshape(s1, (-1,)), ops.reshape(s2, (-1,))], axis=0))
                big_s1 = ops.reshape(summed[:channels], shape)
                big_s2 = ops.reshape(summed[channels:], shape)
            slope = scale * inv * big_s2 / n
            correction = d * slope + (scale * big_s1 / n - delta * slope)
            if weights is not None:
                correction = correction * weights
            dx = dy * scale - correction
            return dx, ops.reshape(s2, (channels,)), ops.reshape(s1, (channels,))

        stats = (ops.stop_gradient(ops.reshape(mean, (channels,))), ops.stop_gradient(ops.reshape(var, (channels,))))
        return (y,) + stats, grad

    return train(x, gamma, beta)


def _normalized(d, delta, var, gamma, beta, shape, epsilon):
    """``(y, 1 / sqrt(var + eps), scale)`` of :func:`train_normalize`'s forward: ``y = d *
    scale + (beta - delta * scale)`` with ``scale = gamma / sqrt(var + eps)``."""
    inv = ops.rsqrt(var + epsilon)
    scale = ops.reshape(gamma, shape) * inv
    return d * scale + (ops.reshape(beta, shape) - delta * scale), inv, scale


def _jax_train_local(x, axis: int, mask, gamma, beta, epsilon):
    """:func:`train_normalize` on JAX, one batch's own statistics, as a ``jax.custom_jvp``.

    With ``xhat = (x - mean) / sqrt(var + eps)``, ``scale = gamma / sqrt(var + eps)``,
    ``w`` the 0/1 weights of counted elements and ``n`` their count, a tangent ``tx``
    (``tgamma``, ``tbeta``) moves the output by

    ``ty = scale * (tx - sum(w tx) / n - xhat * sum(w xhat tx) / n) + xhat * tgamma + tbeta``

    (the mean moves by ``sum(w tx) / n``, the variance by ``2 sum(w (x - mean) tx) / n``),
    linear in the tangents, so JAX's transpose of it is the closed-form backward of
    :func:`train_normalize` (two sums and one elementwise pass, holding ``d = x - m0``
    alone, as its custom VJP does), and the rule, plain JAX
    of the primal values, differentiates again to every order in either mode. ``mean``
    and ``var`` carry no derivative, as :func:`train_normalize`'s."""
    import jax

    ndim = len(x.shape)
    channels = x.shape[axis]
    shape = broadcast_shape(ndim, axis, channels)
    weights = None if mask is None else ops.cast(mask, x.dtype)
    gamma = ops.ones((channels,), x.dtype) if gamma is None else gamma
    beta = ops.zeros((channels,), x.dtype) if beta is None else beta

    def forward(x, gamma, beta):
        count = element_count(x, axis, mask, x.dtype)
        m0, d, s, m2 = centered_sums(x, axis, mask, count)
        n = safe_count(count, ndim, axis)
        delta = s / n
        y, inv, scale = _normalized(d, delta, m2 / n, gamma, beta, shape, epsilon)
        stats = (ops.reshape(m0 + delta, (channels,)), ops.reshape(m2 / n, (channels,)))
        return (y,) + stats, (d, delta, inv, scale, n)

    @jax.custom_jvp
    def train(x, gamma, beta):
        return forward(x, gamma, beta)[0]

    @train.defjvp
    def train_jvp(primals, tangents):
        outputs, (d, delta, inv, scale, n) = forward(*primals)
        tx, tgamma, tbeta = tangents
        counted = tx if weights is None else tx * weights
        t_sum = channel_sum(counted, axis)
        t_spread = (channel_sum(counted * d, axis) - delta * t_sum) * inv / n  # sum(w xhat tx) / n
        # xhat = (d - delta) * inv written out, so that d is the one activation-sized primal
        # the linear map holds: reverse mode keeps d alone, as the custom VJP of
        # train_normalize does (an xhat of its own was a second one: 2x the memory, 1.6x
        # the time of a jitted gradient on the CPU)
        slope = inv * (ops.reshape(tgamma, shape) - scale * t_spread)
        ty = tx * scale + d * slope + (ops.reshape(tbeta, shape) - scale * t_sum / n - delta * slope)
        return outputs, (ty, ops.zeros_like(outputs[1]), ops.zeros_like(outputs[2]))

    return train(x, gamma, beta)
