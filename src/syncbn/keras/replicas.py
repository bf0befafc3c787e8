"""Which replicas a layer call synchronizes with, and the synchronized moments with
exactly one collective forward and one backward, per Keras backend.

- TensorFlow: inside a ``tf.distribute`` replica context with more than one replica
  (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``, in ``fit``, in
  ``strategy.run``, traced or eager), summed with ``ReplicaContext.all_reduce`` under a
  ``tf.custom_gradient``.
- PyTorch: with ``torch.distributed`` initialized and more than one rank in the default
  group, summed with :func:`syncbn.distributed.all_reduce_sum` (the library's one module
  that talks to ``torch.distributed``) under a ``torch.autograd.Function``. torch is
  imported only on this backend.
- JAX: nothing to do here. Under ``keras.distribution.DataParallel`` the layer sees the
  global batch as one sharded array and XLA inserts the cross-device sums itself.

Forward: every replica packs its local moments (:func:`syncbn.keras.moments.pack`,
``2C + 1`` values), one all-reduce sums the packs, every replica merges them alike.
Backward, given the upstream gradients ``g_mean`` and ``g_var`` of the two outputs,
one all-reduce of ``2C`` values sums them over the replicas (each replica's loss
depends on the shared statistics), and with ``w`` the 0/1 mask of counted elements:

    dx = w * (G_mean + 2 * G_var * (x - mean)) / N.

Too few values: training needs ``N > 1``, and ``N`` is known only after the
all-reduce, so the check comes after it, on the summed count, the same on every
replica. A replica whose own count is above 1 (no mask) knows that ``N`` is too and
skips it; every replica that can be in the error case checks, so when ``N <= 1`` all
of them raise, before the backward collective, and none is left waiting. TensorFlow
checks in the graph (an assertion the outputs depend on, gated on the local count so
that the common case never reads the device); torch reads the count on the host, as
:mod:`syncbn.functional` does.
"""

from __future__ import annotations

from keras import ops

from . import moments

__all__ = [
    "tf_replica_context",
    "tf_sum_dtype",
    "tf_sync_moments",
    "tf_require_count",
    "torch_world_size",
    "torch_sync_moments",
    "torch_require_count",
]


def _input_grad(x, axis, mask, mean, count, g_mean, g_var):
    """``dx`` of ``(mean, var)`` with the globally summed upstream gradients."""
    shape = moments.broadcast_shape(len(x.shape), axis, mean.shape[0])
    inv_n = ops.cast(1.0 / ops.maximum(count, 1.0), x.dtype)
    g_mean = ops.reshape(g_mean, shape)
    g_var = ops.reshape(g_var, shape)
    dx = (g_mean + 2.0 * g_var * (x - ops.reshape(mean, shape))) * inv_n
    if mask is not None:
        dx = ops.where(mask, dx, ops.zeros_like(dx))
    return dx


def _forward(x, axis, mask, shift, dtype, all_reduce):
    """Local moments, one all-reduce of the pack, the merge; returns (count, mean, var)
    with count in ``dtype`` and mean / var in ``x``'s dtype."""
    count = moments.element_count(x, axis, mask, dtype)
    mean, m2 = moments.local_moments(x, axis, mask, ops.cast(count, x.dtype))
    total = all_reduce(moments.pack(count, mean, m2, shift, dtype))
    count, mean, var = moments.merge(total, shift)
    return count, ops.cast(mean, x.dtype), ops.cast(var, x.dtype)


# --------------------------------------------------------------------------- TensorFlow


def tf_replica_context():
    """The current ``tf.distribute`` replica context when it spans more than one replica,
    else None (no strategy, one replica, or cross-replica context)."""
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync <= 1:
        return None
    return ctx


def tf_sum_dtype(ctx):
    """float64 for the packed sums, except on TPU, whose all-reduce has no float64:
    there the sums are float32 around the shared shift (see ``moments``)."""
    strategy = ctx.strategy
    return "float32" if "TPU" in type(strategy).__name__ else "float64"


def tf_sync_moments(x, axis, mask, shift, ctx):
    """Global ``(count, mean, biased var)`` over every replica of ``ctx``, with one
    all-reduce in forward and one in backward; ``count`` (elements per channel, in the
    summing dtype) has no gradient."""
    import tensorflow as tf

    dtype = tf_sum_dtype(ctx)

    def all_reduce(value):
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)

    @tf.custom_gradient
    def sync_moments(x):
        count, mean, var = _forward(x, axis, mask, shift, dtype, all_reduce)

        def grad(g_count, g_mean, g_var):
            del g_count  # a count has no gradient
            g_mean = tf.zeros_like(mean) if g_mean is None else g_mean
            g_var = tf.zeros_like(var) if g_var is None else g_var
            summed = all_reduce(tf.concat([g_mean, g_var], axis=0))
            channels = mean.shape[0]
            return _input_grad(x, axis, mask, mean, count, summed[:channels], summed[channels:])

        return (count, mean, var), grad

    return sync_moments(x)


def tf_require_count(count, message, outputs, local=None):
    """``outputs`` made to depend on a check that ``count > 1``; it fails with
    ``tf.errors.InvalidArgumentError`` (``message``: the text before and after the count).

    Eagerly it raises at once; in a graph the outputs carry a control dependency on the
    assertion. ``local`` is this replica's own count when it has no mask (a Python int
    or an int tensor): above 1, the global count is too and nothing is read, so the
    check costs a device read only where it may fail (or with a mask). Under XLA
    (``jit_compile``) TensorFlow compiles assertions to nothing: the check is skipped.
    """
    import tensorflow as tf

    if isinstance(local, int) and local > 1:
        return outputs
    before, after = message

    def check():
        ok = tf.debugging.Assert(count > 1, [before, tf.cast(count, tf.int64), after], summarize=1)
        with tf.control_dependencies([ok] if ok is not None else []):
            return tf.constant(True)

    if local is None or isinstance(local, int):
        done = check()
    else:
        done = tf.cond(local > 1, lambda: tf.constant(True), check)
    with tf.control_dependencies([done]):
        return tuple(tf.identity(t) for t in outputs)


# --------------------------------------------------------------------------- PyTorch


def torch_world_size():
    """Ranks in torch's default process group; 1 when not distributed."""
    from syncbn import distributed

    return distributed.group_size()


def torch_sync_moments(x, axis, mask, shift):
    """Global ``(count, mean, biased var)`` over every rank of the default process group,
    with one all-reduce in forward and one in backward; ``count`` (elements per channel,
    in the summing dtype) has no gradient."""
    return _torch_function().apply(x, axis, mask, shift)


def torch_require_count(count, message, local=None):
    """Raise ``ValueError`` (``message``: the text before and after the count) unless
    ``count > 1``.

    ``local`` is this rank's own count when it has no mask: above 1, the global count
    is too and nothing is read. Otherwise the count is read on the host (the same rule
    as :mod:`syncbn.functional`); under ``torch.compile`` the check is an asynchronous
    assertion in the graph instead.
    """
    if local is not None and local > 1:
        return
    import torch

    from syncbn import distributed

    before, after = message
    if distributed.compiling():
        torch._assert_async(count > 1, f"{before} at most 1 {after}")
        return
    total = int(count.item())
    if total <= 1:
        raise ValueError(f"{before} {total} {after}")


_TORCH_FUNCTION = None


def _torch_function():
    """The ``torch.autograd.Function``, defined on first use so that no other backend
    ever imports torch."""
    global _TORCH_FUNCTION
    if _TORCH_FUNCTION is not None:
        return _TORCH_FUNCTION

    import torch

    from syncbn import distributed, stats

    class SyncMoments(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, axis, mask, shift):
            dtype = str(stats.accumulate_dtype(x.device)).replace("torch.", "")
            count, mean, var = _forward(x, axis, mask, shift, dtype, distributed.all_reduce_sum)
            ctx.save_for_backward(x, mean, count)
            ctx.axis, ctx.mask = axis, mask
            ctx.mark_non_differentiable(count)
            return count, mean, var

        @staticmethod
        def backward(ctx, g_count, g_mean, g_var):
            x, mean, count = ctx.saved_tensors
            summed = distributed.all_reduce_sum(torch.cat([g_mean, g_var]))
            channels = mean.shape[0]
            dx = _input_grad(x, ctx.axis, ctx.mask, mean, count, summed[:channels], summed[channels:])
            return dx, None, None, None

    _TORCH_FUNCTION = SyncMoments
    return SyncMoments

