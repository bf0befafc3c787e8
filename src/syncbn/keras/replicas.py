"""Which replicas a layer call synchronizes with, and the synchronized moments with
exactly one collective forward and one backward, per Keras backend.

- TensorFlow: inside a ``tf.distribute`` replica context with more than one replica
  (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``, in ``fit``, in
  ``strategy.run``, traced or eager), summed with ``ReplicaContext.all_reduce`` under a
  ``tf.custom_gradient``.
- PyTorch: with ``torch.distributed`` initialized and more than one rank in the default
  group, summed with :func:`syncbn.torch.distributed.all_reduce_sum` (the library's one module
  that talks to ``torch.distributed``) under a ``torch.autograd.Function``. torch is
  imported only on this backend.
- JAX: nothing to do here. Under ``keras.distribution.DataParallel`` the layer sees the
  global batch as one sharded array and XLA inserts the cross-device sums itself.
  Inside a user's own ``jax.shard_map`` or ``jax.pmap`` (which JAX runs as a shard_map)
  the layer would see only its shard: :func:`jax_manual_axes` names those axes, and a
  training call there raises (see ``SyncBatchNormalization.call``).

Forward: every replica packs its local moments (:func:`syncbn.keras.moments.pack`,
``2C + 1`` values, ``3C`` when a mask gives each channel its own count), one all-reduce
sums the packs, every replica merges them alike. Backward, given the upstream gradients
``g_mean`` and ``g_var`` of the two outputs, one all-reduce of ``2C`` values sums them
over the replicas (each replica's loss depends on the shared statistics), and with
``w`` the 0/1 mask of counted elements:

    dx = w * (G_mean + 2 * G_var * (x - mean)) / max(N, 1).

Like Keras's own layer, nothing is checked about ``N``: a batch with one value per
channel gives variance 0, a fully masked one mean 0 and variance 0, on every replica
alike (they all merge the same sums), and no replica waits on another's error.

Disagreement detection (TensorFlow and PyTorch backends): both all-reduces also carry
the 18-value layer fingerprint of :mod:`syncbn.core.fingerprint` (the layer's name
and width, and the call's index), so replicas that are not in the same layer call
(another layer order, a skipped layer, a model built differently) raise
:class:`syncbn.core.fingerprint.LayerMismatchError` (eager, and the torch backend) or
a TensorFlow ``InvalidArgumentError`` with the same words (inside ``tf.function``, from
a ``tf.debugging.Assert`` that the statistics depend on) on every replica, before the
statistics are used. Under TensorFlow the call index counts the synchronized calls
traced so far in the same graph by the same replica (so it is the call's place in the
step); in eager execution it is 0 (name and width alone). Under XLA
(``jit_compile=True``) the assert is compiled away: there the verdict gates the moving
statistics and goes to the layer's record (:mod:`syncbn.keras.mismatch`).
"""

from __future__ import annotations

import weakref

from keras import ops

from syncbn.core import fingerprint as lf

from . import mismatch, moments

__all__ = [
    "jax_manual_axes",
    "tf_replica_context",
    "tf_sum_dtype",
    "tf_sync_moments",
    "tf_sync_train",
    "torch_world_size",
    "torch_sync_moments",
]


def _input_grad(x, axis, mask, mean, count, g_mean, g_var):
    """``dx`` of ``(mean, var)`` with the globally summed upstream gradients."""
    shape = moments.broadcast_shape(len(x.shape), axis, mean.shape[0])
    inv_n = ops.reshape(ops.cast(1.0 / moments.at_least(count, 1.0), x.dtype), moments.count_shape(len(x.shape), axis))
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


# --------------------------------------------------------------------------- JAX


def jax_manual_axes():
    """``{axis name: size}`` of the mesh axes that the current JAX trace is manual over:
    a ``jax.shard_map`` body (its ``axis_names``, all of the mesh's by default) or a
    ``jax.pmap`` body (JAX 0.10 runs pmap as a shard_map; an unnamed pmap's axis has a
    name of JAX's own). There every array is one device's shard, and reductions over
    it are per-shard (the same as global ones over axes of size 1). Empty elsewhere
    (eager, ``jax.jit``, ``keras.distribution``'s global arrays, auto axes of a partial
    shard_map), and where this JAX lacks the public ``jax.sharding.get_abstract_mesh``."""
    import jax

    get = getattr(jax.sharding, "get_abstract_mesh", None)
    if get is None:
        return {}
    mesh = get()
    manual = tuple(getattr(mesh, "manual_axes", ()) or ())
    if not manual:
        return {}
    sizes = dict(mesh.shape)
    return {name: int(sizes[name]) for name in manual}


# --------------------------------------------------------------------------- TensorFlow

_tf_calls = weakref.WeakKeyDictionary()  # traced graph -> {replica: calls counted}


def tf_tag(name, channels, ctx):
    """The fingerprint tag of a synchronized call of the layer ``name`` with ``channels``
    channels: the call index is the number of synchronized calls this replica made
    before it in the graph being traced (a step's trace), 0 in eager execution."""
    import tensorflow as tf

    ident = lf.remember(name, channels)
    if tf.executing_eagerly():
        return lf.Tag(ident, 0)
    graph = tf.compat.v1.get_default_graph()
    replica = getattr(ctx, "_replica_id_in_sync_group", None)
    counts = _tf_calls.setdefault(graph, {})
    key = replica if isinstance(replica, int) else None
    index = counts.get(key, 0)
    counts[key] = index + 1
    return lf.Tag(ident, index & ((1 << lf.INDEX_BITS) - 1))


def _tf_replica_rank(ctx):
    replica = getattr(ctx, "_replica_id_in_sync_group", None)
    return replica if isinstance(replica, int) else None


def tf_checked_all_reduce(ctx, tag, backward, layer=None):
    """A function summing a 1-D tensor over the replicas of ``ctx`` in one all-reduce
    that also carries ``tag``'s fingerprint, and failing on every replica alike when
    the replicas sent different tags: eagerly with
    :class:`~syncbn.core.fingerprint.LayerMismatchError`, in a graph through a
    ``tf.debugging.Assert`` that the returned sum depends on. After a call, its ``ok``
    attribute is the verdict (a boolean tensor, the same on every replica). In a graph
    the verdict also goes to ``layer``'s record (:mod:`syncbn.keras.mismatch`), for
    XLA, which compiles the assert away."""
    import tensorflow as tf

    world = ctx.num_replicas_in_sync
    if world > lf.MAX_WORLD:
        raise ValueError(f"syncbn's layer fingerprint is exact up to {lf.MAX_WORLD} replicas, got {world}")

    def all_reduce(value):
        size = value.shape[0]
        payload = tf.concat([value, tf.constant(lf.values(tag), value.dtype)], axis=0)
        total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, payload)
        summed, sums = total[:size], total[size:]
        # Sums of small integers (below world * 225): in float64, they and t * t and
        # q * world are exact whatever the summation order, so they are compared as
        # they are; float32 sums (TPU) are compared as integers.
        exact = sums if sums.dtype == tf.float64 else tf.cast(tf.round(sums), tf.int64)
        t, q = exact[: lf.DIGITS], exact[lf.DIGITS :]
        ok = all_reduce.ok = tf.reduce_all(tf.equal(t * t, q * world))
        rank = _tf_replica_rank(ctx)
        if tf.executing_eagerly():
            if not bool(ok):
                raise lf.LayerMismatchError(lf.mismatch_message(
                    tag, sums.numpy().tolist(), world, rank, backward, who="replica",
                    group="the replicas", what="layer", features="channels"))
            return summed
        message = lf.mismatch_message(tag, None, world, None, backward, who="replica",
                                      group="the replicas", what="layer", features="channels")
        # tf.raw_ops.Assert rather than tf.debugging.Assert, which wraps it in a cond
        # (a functional If op run on every step) only to skip formatting the message.
        checks = [tf.raw_ops.Assert(condition=ok, data=["LayerMismatchError: " + message, "summed fingerprint:", sums],
                                    summarize=lf.SIZE)]
        if layer is not None:
            checks.append(mismatch.write(layer, ok, sums, tag, world, rank, backward))
        with tf.control_dependencies([c for c in checks if c is not None]):
            # XLA compiles the assert away: there the sums of a disagreeing call become
            # NaN (a loud loss, never plausible mixed statistics) and the verdict is
            # on record; elsewhere the assert has already failed.
            return tf.where(ok, summed, tf.constant(float("nan"), summed.dtype))

    all_reduce.ok = None
    return all_reduce


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


def tf_sync_moments(x, axis, mask, shift, ctx, name="SyncBatchNormalization", layer=None):
    """Global ``(count, mean, biased var, ok)`` over every replica of ``ctx``, with one
    all-reduce in forward and one in backward; ``count`` (elements per channel, in the
    summing dtype) has no gradient; ``ok`` is the forward's fingerprint verdict (for
    updates that must not happen when it is False). ``name`` identifies the layer in
    the fingerprint; ``layer`` (optional) holds the verdict record."""
    import tensorflow as tf

    dtype = tf_sum_dtype(ctx)
    tag = tf_tag(name, shift.shape[0], ctx)
    forward = tf_checked_all_reduce(ctx, tag, False, layer)

    @tf.custom_gradient
    def sync_moments(x):
        count, mean, var = _forward(x, axis, mask, shift, dtype, forward)

        def grad(g_count, g_mean, g_var):
            del g_count  # a count has no gradient
            g_mean = tf.zeros_like(mean) if g_mean is None else g_mean
            g_var = tf.zeros_like(var) if g_var is None else g_var
            summed = tf_checked_all_reduce(ctx, tag, True, layer)(tf.concat([g_mean, g_var], axis=0))
            channels = mean.shape[0]
            dx = _input_grad(x, axis, mask, mean, count, summed[:channels], summed[channels:])
            return dx

        return (count, mean, var), grad

    count, mean, var = sync_moments(x)
    return count, mean, var, forward.ok


def tf_sync_train(x, axis, mask, shift, ctx, gamma, beta, epsilon, name="SyncBatchNormalization", layer=None):
    """A training call's ``(output, mean, biased var, ok)`` with statistics over every
    replica of ``ctx``: :func:`syncbn.keras.moments.train_normalize` with one
    all-reduce in forward (the packed moments, as in :func:`tf_sync_moments`) and one
    of ``2C`` values in backward (``sum dy`` and ``sum dy * xhat``), both carrying the
    fingerprint. ``gamma`` / ``beta`` (None: absent) get this replica's own sums as
    gradients, which the strategy aggregates; ``mean`` and ``var`` are for the moving
    averages and carry no gradient; ``ok`` is the forward's fingerprint verdict, which
    gates them. Both all-reduces are differentiable (the gradient of a sum over
    replicas is the sum of the gradients), so second-order gradients are exact, at the
    price of further all-reduces in the second-order backward. ``name`` identifies the
    layer in the fingerprint; ``layer`` (optional) holds the verdict record."""
    dtype = tf_sum_dtype(ctx)
    tag = tf_tag(name, shift.shape[0], ctx)
    forward = tf_checked_all_reduce(ctx, tag, False, layer)

    def combine(count, mean, m2):
        total = forward(moments.pack(count, mean, m2, shift, dtype))
        return moments.merge(total, shift)

    y, mean, var = moments.train_normalize(x, axis, mask, gamma, beta, epsilon, combine=combine,
                                           all_reduce=tf_checked_all_reduce(ctx, tag, True, layer),
                                           count_dtype=dtype)
    return y, mean, var, forward.ok


# --------------------------------------------------------------------------- PyTorch


def torch_world_size():
    """Ranks in torch's default process group; 1 when not distributed."""
    from syncbn.torch import distributed

    return distributed.group_size()


def torch_sync_moments(x, axis, mask, shift, name="SyncBatchNormalization"):
    """Global ``(count, mean, biased var)`` over every rank of the default process group,
    with one all-reduce in forward and one in backward; ``count`` (elements per channel,
    in the summing dtype) has no gradient. Both carry the layer fingerprint
    (:func:`syncbn.torch.fingerprint.all_reduce_checked`; ``name`` identifies the layer), read
    at once (off the CPU too: one host read per call), so that a disagreement raises
    :class:`~syncbn.core.fingerprint.LayerMismatchError` on every rank before the
    moving statistics move. The fingerprint also says whether this call records an
    autograd graph (grad mode on and ``x`` requiring grad), as the torch layers' does: a
    rank whose call records none makes no backward all-reduce, so a training call under
    ``torch.no_grad`` on one rank alone raises there instead of leaving the others' backward
    waiting."""
    from syncbn.torch import fingerprint

    return _torch_function().apply(x, axis, mask, shift, name, fingerprint.records_graph(x))


_TORCH_FUNCTION = None


def _torch_function():
    """The ``torch.autograd.Function``, defined on first use so that no other backend
    ever imports torch."""
    global _TORCH_FUNCTION
    if _TORCH_FUNCTION is not None:
        return _TORCH_FUNCTION

    import torch

    from syncbn.torch import distributed, fingerprint, stats

    def checked(tag, backward):
        def all_reduce(value):
            summed, ok = fingerprint.all_reduce_checked(value, None, tag, distributed.group_size(), backward)
            if ok is not None:
                fingerprint.check_agreement()
            return summed

        return all_reduce

    class SyncMoments(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, axis, mask, shift, name, graph):
            dtype = str(stats.accumulate_dtype(x.device)).replace("torch.", "")
            tag = fingerprint.forward_tag(None, shift.shape[0], None, name=name, graph=graph)
            count, mean, var = _forward(x, axis, mask, shift, dtype, checked(tag, False))
            ctx.save_for_backward(x, mean, count)
            ctx.axis, ctx.mask, ctx.tag = axis, mask, tag
            ctx.mark_non_differentiable(count)
            return count, mean, var

        @staticmethod
        def backward(ctx, g_count, g_mean, g_var):
            if torch.is_grad_enabled():
                # create_graph=True: the all-reduces are invisible to autograd, so the
                # second-order terms through the other ranks would silently be missing.
                raise RuntimeError(
                    "SyncBatchNormalization (Keras, torch backend): higher-order gradients "
                    "(backward with create_graph=True, e.g. a gradient penalty) are not "
                    "supported across torch.distributed ranks; the cross-rank sums are not "
                    "differentiable. Compute the penalty without create_graph, or on a "
                    "layer that is not synchronized")
            x, mean, count = ctx.saved_tensors
            summed = checked(ctx.tag, True)(torch.cat([g_mean, g_var]))
            fingerprint.end_step(None)
            channels = mean.shape[0]
            dx = _input_grad(x, ctx.axis, ctx.mask, mean, count, summed[:channels], summed[channels:])
            return dx, None, None, None, None, None

    _TORCH_FUNCTION = SyncMoments
    return SyncMoments

