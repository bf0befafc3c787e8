"""``SyncBatchNormalization``: ``keras.layers.BatchNormalization`` with statistics over
every replica's batch."""

from __future__ import annotations

import keras
from keras import ops

from syncbn.core import fingerprint as layer_fingerprint

from . import mismatch, moments, replicas

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="syncbn", name="SyncBatchNormalization")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    r"""Batch normalization whose training statistics span every replica's batch.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    A drop-in for ``keras.layers.BatchNormalization``: the same constructor arguments
    (``synchronized`` is accepted and ignored: this layer always synchronizes), the same
    weights in the same order (``gamma``, ``beta``, ``moving_mean``,
    ``moving_variance``, then the renorm ones), the same ``get_config`` less
    ``synchronized``, and the same moving averages (``moving = moving * momentum +
    batch * (1 - momentum)``, with the biased batch variance, as Keras does). It is a
    subclass, so code that looks for BatchNormalization layers (to freeze them, say)
    still finds it.

    In training (``training=True`` and ``trainable``), mean and biased variance are
    taken per channel over the counted elements of every replica, weighted by element
    counts: uneven and empty replica batches are exact, and a mask counts per
    element. Where that needs communication, each call issues exactly one all-reduce of
    ``2C + 1`` values in forward (float64 sums of the replicas' stable local moments)
    and one of ``2C`` values in backward, in a custom gradient, each with 18 more: the
    layer fingerprint (the layer's name and width, and the call's index in the traced
    step), so that replicas in different layer calls fail alike instead of mixing
    statistics (see :mod:`syncbn.keras.replicas` and docs/disagreement.md, "When ranks disagree"):

    - TensorFlow: inside a ``tf.distribute`` replica context of more than one replica
      (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``; ``fit``, custom loops with
      ``strategy.run``, traced or eager).
    - PyTorch: with ``torch.distributed`` initialized and more than one rank.
    - JAX: under ``keras.distribution.DataParallel`` the batch is one sharded array,
      so the layer's reductions are global already (XLA adds the cross-device sums).

    Everywhere else (no distribution, one replica, cross-replica context) it computes
    the same local statistics as ``keras.layers.BatchNormalization``. Inference uses the
    moving statistics through Keras's own op (so a converted model predicts exactly what
    the original did) and never communicates; training normalizes as
    ``(x - mean) * s + beta`` (on TensorFlow and JAX as ``(x - m0) * s + (beta - (mean -
    m0) * s)`` around this replica's own mean ``m0``, see
    :func:`syncbn.keras.moments.train_normalize`), which keeps full precision for
    inputs far from zero.
    Half-precision, integer and boolean inputs are normalized in float32 (output in the
    layer's compute dtype, as Keras's); statistics and moving averages are float32.
    ``gamma``/``beta`` gradients are this replica's own sums, which the strategy
    aggregates as for any weight.

    With ``renorm=True`` (batch renormalization), the corrections ``r`` and ``d`` and
    the renorm moving statistics are computed from the synchronized batch statistics.

    Masks follow Keras: a mask covers the input's leading axes (``inputs.shape[:-1]``,
    or a shape that broadcasts to it) whatever ``axis`` is, and is broadcast over the
    last axis; only the elements it keeps are counted, per element across replicas
    (with the channel axis not last, each channel has its own count and the forward
    all-reduce carries ``3C`` values). Degenerate batches give what Keras's layer gives
    on the whole batch, with no error: one value per channel has variance 0 (output
    ``beta``), and a channel with no counted value at all (fully masked, or an empty
    global batch) has mean 0 and variance 0, which the moving averages then follow.
    (Keras's own layer returns NaN statistics for an empty unmasked batch; this one
    treats it as fully masked.) No step depends on a check of the count, so nothing
    is read back to the host for it and nothing is lost under XLA (``jit_compile=True``,
    ``jax.jit``). (The fingerprint's verdict is read on the host in eager execution
    only; under XLA its assert is compiled away: a disagreeing call's sums are NaN, its
    moving statistics stay as they were and its verdict is kept for
    :class:`syncbn.keras.SkipMismatchedSteps` and :func:`syncbn.keras.check_agreement`;
    see :mod:`syncbn.keras.mismatch`.)

    Higher-order gradients (the gradient of a gradient through a training call, e.g.
    a gradient penalty) are exact on TensorFlow (one replica and ``tf.distribute``
    strategies: the closed-form backward is written in differentiable ops of tensors
    computed from the input, and the all-reduce's gradient is an all-reduce, so the
    second-order backward adds collectives) and on JAX, as on PyTorch in one process
    (plain autograd). On one device forward-mode derivatives (``jax.jvp``,
    ``jax.hessian``, TensorFlow's ``ForwardAccumulator``) are exact too, as with Keras's
    layer. Across ``torch.distributed`` ranks they raise ``RuntimeError``
    (autograd cannot see the sums): a silently incomplete second derivative would be
    worse than none.

    The batch variance never goes negative and has no cancellation error: float32
    inputs with ``|mean| / std = 1e3`` give a variance within 1e-5 relative of a float64
    reference (Keras's ``synchronized=True`` computes ``E[x^2] - E[x]^2`` in float32).

    Keras shows the class as ``SyncBatchNormalization`` (``model.summary()``), names
    the layer ``sync_batch_normalization_N`` by default, and names its group in a
    weights file (``.weights.h5``, and inside ``.keras``) after the class where it sits
    in a list (a Functional or Sequential model's layers), so there a weights file
    moves between a plain model and its synchronized copy through
    :func:`syncbn.keras.convert` and :func:`syncbn.keras.revert` (load into the model
    of its own kind, then convert or revert), not directly (Keras raises). A layer held
    in an attribute of a subclassed model is keyed by the attribute's name, and its
    file loads across either way, into the same layers.

    Args: those of ``keras.layers.BatchNormalization``; ``axis`` is a single integer,
    the channel axis (``-1`` for channels_last, ``1`` for channels_first), not the
    batch axis.
    """

    def __init__(
        self,
        axis=-1,
        momentum=0.99,
        epsilon=1e-3,
        center=True,
        scale=True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        moving_mean_initializer="zeros",
        moving_variance_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        renorm=False,
        renorm_clipping=None,
        renorm_momentum=0.99,
        **kwargs,
    ):
        kwargs.pop("synchronized", None)
        if isinstance(axis, bool) or not isinstance(axis, int):
            try:
                axis = int(axis)
            except (TypeError, ValueError):
                raise TypeError(
                    f"SyncBatchNormalization: axis must be one integer, the channel axis "
                    f"(-1 for channels_last, 1 for channels_first), got axis={axis!r}"
                ) from None
        super().__init__(
            axis=axis,
            momentum=momentum,
            epsilon=epsilon,
            center=center,
            scale=scale,
            beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            moving_mean_initializer=moving_mean_initializer,
            moving_variance_initializer=moving_variance_initializer,
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
            renorm=renorm,
            renorm_clipping=renorm_clipping,
            renorm_momentum=renorm_momentum,
            synchronized=False,
            **kwargs,
        )
        if keras.backend.backend() == "tensorflow":
            mismatch.keep_fit_off_xla(self)

    # ------------------------------------------------------------------ build / config

    def build(self, input_shape):
        if not isinstance(self, SyncBatchNormalization):
            # Made a plain BatchNormalization in place before it was built
            # (plain_in_place): Keras's per-object build wrapper, made with the object,
            # still calls this method. Build it as what it now is.
            keras.layers.BatchNormalization.build(self, input_shape)
            return
        input_shape = tuple(input_shape)
        self._check_build_shape(input_shape)
        super().build(input_shape)
        self._register(input_shape[self.axis])

    def _check_build_shape(self, input_shape):
        """The errors of :meth:`build` that Keras's layer does not raise itself."""
        rank = len(input_shape)
        if rank < 2:
            raise ValueError(
                f"{self.name}: expected an input with a batch axis and a channel axis "
                f"(rank >= 2), got shape {input_shape}"
            )
        if not -rank <= self.axis < rank:
            raise ValueError(
                f"{self.name}: axis={self.axis} is out of range for an input of rank {rank} "
                f"(shape {input_shape}); the channel axis is -1 for channels_last, 1 for "
                f"channels_first"
            )
        if self.axis % rank == 0:
            raise ValueError(
                f"{self.name}: axis={self.axis} is the batch axis of an input of shape "
                f"{input_shape}; batch normalization needs the channel axis (-1 for "
                f"channels_last, 1 for channels_first)"
            )
        if input_shape[self.axis] is None:
            raise ValueError(
                f"{self.name}: the channel axis (axis={self.axis}) of the input must have "
                f"a known size, got shape {input_shape}"
            )

    def _register(self, channels):
        """What a built layer has beside its weights, once: its name known to this
        process's disagreement messages (whether called or not) and, on TensorFlow, its
        verdict record (where XLA drops the check's assert, see :mod:`mismatch`)."""
        layer_fingerprint.remember(self.name, int(channels))
        if keras.backend.backend() == "tensorflow":
            mismatch.create(self, channels)
            mismatch.keep_fit_off_xla(self)

    def get_config(self):
        config = super().get_config()
        config.pop("synchronized", None)
        return config

    # ------------------------------------------------------------------ forward

    def call(self, inputs, training=None, mask=None):
        self._check_call_input(inputs, mask)
        # Half, integer and boolean inputs are normalized in float32, float64 ones in
        # float64 (as Keras does).
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        x = ops.cast(inputs, dtype)
        gamma = ops.cast(self.gamma, dtype) if self.scale else None
        beta = ops.cast(self.beta, dtype) if self.center else None

        if not (training and self.trainable):
            # Inference: the moving statistics, through the very op Keras's layer uses, so
            # that a converted model predicts exactly what the original predicted.
            y = ops.batch_normalization(
                x,
                ops.cast(self.moving_mean, dtype),
                ops.cast(self.moving_variance, dtype),
                axis=self.axis,
                offset=beta,
                scale=gamma,
                epsilon=self.epsilon,
            )
            return ops.cast(y, self.compute_dtype)

        self._check_not_per_shard()
        x = self._with_static_channels(x)
        mask = moments.element_mask(mask, x)
        if not self.renorm:
            if self._local_fast_path():
                return ops.cast(self._train_local(x, mask, gamma, beta), self.compute_dtype)
            ctx = replicas.tf_replica_context() if keras.backend.backend() == "tensorflow" else None
            if ctx is not None:
                shift = ops.stop_gradient(ops.cast(self.moving_mean, dtype))
                y, mean, var, ok = replicas.tf_sync_train(
                    x, self.axis, mask, shift, ctx, gamma, beta, self.epsilon, name=self.name, layer=self)
                self._update_moving_statistics(mean, var, ok)
                return ops.cast(y, self.compute_dtype)
        mean, var, ok = self._batch_statistics(x, mask)
        if self.renorm:
            gamma, beta = self._renorm_transform(mean, var, gamma, beta, dtype, ok)
        else:
            self._update_moving_statistics(mean, var, ok)
        return ops.cast(self._normalize(x, mean, var, gamma, beta), self.compute_dtype)

    def _check_call_input(self, inputs, mask):
        """Errors that depend only on shapes and dtypes, so every replica raises alike.

        Integer and boolean inputs are accepted, as Keras's layer accepts them (it
        normalizes them in float32); a dtype that does not promote to a float with
        float32 (complex) is refused rather than cast."""
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        if "float" not in keras.backend.result_type(dtype, "float32"):
            raise TypeError(
                f"{self.name}: expected a real (floating-point, integer or boolean) "
                f"input, got dtype {dtype} (shape {tuple(inputs.shape)}); cast it first, "
                f"e.g. keras.ops.cast(keras.ops.real(x), 'float32')"
            )
        rank = len(inputs.shape)
        channels = self.moving_mean.shape[0]
        spec = self.input_spec
        if spec is not None and spec.ndim is not None and rank != spec.ndim:
            raise ValueError(
                f"{self.name}: was built for inputs of rank {spec.ndim}, got an "
                f"input of shape {tuple(inputs.shape)}"
            )
        if inputs.shape[self.axis] is not None and inputs.shape[self.axis] != channels:
            raise ValueError(
                f"{self.name}: was built for {channels} channels on axis {self.axis}, got "
                f"an input of shape {tuple(inputs.shape)} with {inputs.shape[self.axis]}"
            )
        if mask is not None and len(mask.shape) != rank - 1:
            raise ValueError(
                f"{self.name}: the mask must have the input's shape without the channel "
                f"axis (one dimension less), got mask shape {tuple(mask.shape)} for "
                f"input shape {tuple(inputs.shape)}"
            )

    def _check_not_per_shard(self):
        """A training call traced inside a user's own ``jax.shard_map`` or ``jax.pmap``
        body (manual mesh axes of more than one device) raises: there the layer sees
        only its device's shard, and its statistics would silently be per-shard ones.
        Raised while tracing, so every device and process raises alike. Inference uses
        the moving statistics and needs no synchronization, so it is not checked."""
        if keras.backend.backend() != "jax":
            return
        axes = {name: size for name, size in replicas.jax_manual_axes().items() if size > 1}
        if not axes:
            return
        named = ", ".join(f"{name!r} ({size} devices)" for name, size in axes.items())
        raise RuntimeError(
            f"{self.name}: a training call of SyncBatchNormalization inside jax.shard_map "
            f"or jax.pmap (manual mesh axes {named}) would compute each shard's own "
            f"statistics, not the synchronized ones: the Keras layer synchronizes on the "
            f"JAX backend only through keras.distribution, where it sees the global batch. "
            f"Train under keras.distribution.set_distribution("
            f"keras.distribution.DataParallel()) (or jax.jit over arrays sharded that way) "
            f"instead, or, in hand-written shard_map/pmap code, use syncbn.flax's layers "
            f"with axis_name set to the batch axes. Inference calls (training=False) are "
            f"not affected."
        )

    def _with_static_channels(self, x):
        """``x`` with its channel axis's static size set to the layer's channel count.

        A TensorFlow graph traced with that size unknown (``tf.function`` with an
        ``input_signature`` of ``None`` dimensions, ``model.export`` with such a
        signature) reaches :meth:`call` with ``x.shape[axis] is None``, which Keras's
        layer trains on; the statistics here need the size to shape their per-channel
        vectors. ``tf.ensure_shape`` sets it and checks it when the graph runs (an
        input of another size fails there with an error naming both shapes, as it
        would in Keras's layer). Other backends call the layer with concrete shapes."""
        if x.shape[self.axis] is not None or keras.backend.backend() != "tensorflow":
            return x
        import tensorflow as tf

        shape = list(x.shape)
        shape[self.axis] = self.moving_mean.shape[0]
        return tf.ensure_shape(x, shape)

    def _local_fast_path(self):
        """Whether this training call needs no communication and the backend has
        ``keras.ops.custom_gradient`` (TensorFlow, JAX): then the closed-form batch-norm
        gradient replaces automatic differentiation through the statistics."""
        backend = keras.backend.backend()
        if backend == "tensorflow":
            return replicas.tf_replica_context() is None
        # Inside shard_map/pmap (manual axes, here all of size 1: larger ones raised) the
        # custom gradient's cotangents of replicated gamma / beta would vary over the
        # manual axes, which JAX refuses; automatic differentiation handles that.
        return backend == "jax" and not replicas.jax_manual_axes()

    def _train_local(self, x, mask, gamma, beta):
        """Training output from this batch's own statistics, with the closed-form
        backward of :func:`moments.train_normalize` (two reductions and one elementwise
        pass instead of automatic differentiation's chain of generic ones; exact
        second-order gradients too). The statistics are those of
        :func:`moments.centered_sums` (stable far from zero)."""
        y, mean, var = moments.train_normalize(x, self.axis, mask, gamma, beta, self.epsilon)
        self._update_moving_statistics(mean, var)
        return y

    def _batch_statistics(self, x, mask):
        """Per-channel ``(mean, biased var, ok)`` of this training batch, over every
        replica where a distribution is active; one all-reduce each way when it needs
        one. ``mask`` is :func:`moments.element_mask`'s. Channels that count no element
        get ``(0, 0)`` and one element ``(x, 0)``, as in Keras's layer. ``ok`` is the
        replicas' agreement on this call (TensorFlow strategies; else None), on which
        the moving statistics' update is gated."""
        # The moving mean is the same on every replica: the shift for the packed sums.
        backend = keras.backend.backend()
        if backend == "tensorflow":
            ctx = replicas.tf_replica_context()
            if ctx is not None:
                shift = ops.stop_gradient(ops.cast(self.moving_mean, x.dtype))
                _, mean, var, ok = replicas.tf_sync_moments(
                    x, self.axis, mask, shift, ctx, name=self.name, layer=self)
                return mean, var, ok
        elif backend == "torch" and replicas.torch_world_size() > 1:
            shift = ops.stop_gradient(ops.cast(self.moving_mean, x.dtype))
            _, mean, var = replicas.torch_sync_moments(x, self.axis, mask, shift, name=self.name)
            return mean, var, None  # the torch check raises before this returns
        # One replica, or a backend that presents the whole batch as one array (JAX):
        # the local statistics are the global ones.
        mean, var = moments.batch_moments(x, self.axis, mask)
        return mean, var, None

    def _normalize(self, x, mean, var, gamma, beta):
        """``(x - mean) * (gamma / sqrt(var + eps)) + beta``, subtracting the mean first
        so that an input far from zero loses no precision (Keras's op computes
        ``x * s + (beta - mean * s)``, whose rounding error grows with ``|mean| / std``)."""
        shape = moments.broadcast_shape(len(x.shape), self.axis, mean.shape[0])
        scale = ops.rsqrt(var + self.epsilon)
        if gamma is not None:
            scale = scale * gamma
        y = (x - ops.reshape(mean, shape)) * ops.reshape(scale, shape)
        if beta is not None:
            y = y + ops.reshape(beta, shape)
        return y

    def _update_moving_statistics(self, mean, var, ok=None):
        m = self.momentum
        moving_mean = ops.cast(self.moving_mean, mean.dtype)
        moving_var = ops.cast(self.moving_variance, var.dtype)
        _assign_if(self.moving_mean, moving_mean * m + mean * (1.0 - m), moving_mean, ok)
        _assign_if(self.moving_variance, moving_var * m + var * (1.0 - m), moving_var, ok)

    def _renorm_transform(self, mean, var, gamma, beta, dtype, ok=None):
        """Batch renormalization (Ioffe 2017) on the synchronized statistics, with Keras's
        conventions: returns the effective ``(gamma, beta)`` and updates the moving and
        renorm statistics.

        ``r = std / renorm_std`` and ``d = (mean - renorm_mean) / renorm_std`` (the renorm
        std floored at ``sqrt(eps)``), clipped by ``renorm_clipping``, without gradient;
        ``y = (xhat * r + d) * gamma + beta``. The moving std is tracked and the moving
        variance derived from it.
        """
        std = ops.sqrt(var + self.epsilon)
        renorm_mean = ops.cast(self.renorm_mean, dtype)
        renorm_std = ops.cast(self.renorm_stddev, dtype)
        floor = ops.maximum(renorm_std, ops.sqrt(ops.cast(self.epsilon, dtype)))
        r = std / floor
        d = (mean - renorm_mean) / floor
        clipping = self.renorm_clipping or {}
        if clipping.get("rmin") is not None:
            r = ops.maximum(r, ops.cast(clipping["rmin"], dtype))
        if clipping.get("rmax") is not None:
            r = ops.minimum(r, ops.cast(clipping["rmax"], dtype))
        if clipping.get("dmax") is not None:
            d = ops.clip(d, ops.cast(-clipping["dmax"], dtype), ops.cast(clipping["dmax"], dtype))
        r = ops.stop_gradient(r)
        d = ops.stop_gradient(d)

        rm, m = self.renorm_momentum, self.momentum
        moving_mean = ops.cast(self.moving_mean, dtype)
        moving_std = ops.cast(self.moving_stddev, dtype)
        moving_var = ops.cast(self.moving_variance, dtype)
        _assign_if(self.renorm_mean, renorm_mean * rm + mean * (1.0 - rm), renorm_mean, ok)
        _assign_if(self.renorm_stddev, renorm_std * rm + std * (1.0 - rm), renorm_std, ok)
        _assign_if(self.moving_mean, moving_mean * m + mean * (1.0 - m), moving_mean, ok)
        new_std = moving_std * m + std * (1.0 - m)
        _assign_if(self.moving_stddev, new_std, moving_std, ok)
        _assign_if(self.moving_variance, ops.relu(new_std * new_std - self.epsilon), moving_var, ok)

        new_gamma = r if gamma is None else r * gamma
        new_beta = d if gamma is None else d * gamma
        if beta is not None:
            new_beta = new_beta + beta
        return new_gamma, new_beta


def synchronize_in_place(layer):
    """Make ``layer``, a ``keras.layers.BatchNormalization`` that nothing else references,
    a :class:`SyncBatchNormalization` without replacing the object (its variables, name
    and place in a graph stay), with what this class's constructor and :meth:`build`
    add: ``synchronized`` off, fit kept off XLA under a strategy, the build-time checks
    and the verdict record (now if it is built, else when it is built). This class adds
    no instance state of its own, so the object is then what its constructor makes."""
    shape = _built_input_shape(layer) if layer.built else None
    if shape is not None:
        SyncBatchNormalization._check_build_shape(layer, shape)  # before anything changes
    layer.__class__ = SyncBatchNormalization
    layer.synchronized = False
    if keras.backend.backend() == "tensorflow":
        mismatch.keep_fit_off_xla(layer)
    if layer.built:
        layer._register(layer.moving_mean.shape[0])
        return
    # Keras wraps ``build`` once per object, when it is made (``Layer.__new__``), around
    # the build method of its class at that time (BatchNormalization's): put this
    # class's checks and record around that wrapper, as SyncBatchNormalization.build does.
    keras_build = layer.build

    def build(input_shape):
        input_shape = tuple(input_shape)
        layer._check_build_shape(input_shape)
        keras_build(input_shape)
        layer._register(input_shape[layer.axis])

    build.keras_build = keras_build  # for plain_in_place
    layer.build = build


def plain_in_place(layer):
    """The inverse of :func:`synchronize_in_place`: make ``layer``, a
    :class:`SyncBatchNormalization` that nothing else references, a
    ``keras.layers.BatchNormalization`` without its verdict record, fit no longer kept
    off XLA. Unbuilt, it then builds as Keras's layer: Keras's per-object build wrapper
    calls the build method of the class the object was constructed as, so a layer that
    :func:`synchronize_in_place` made ours gets that wrapper back, and one constructed as
    :class:`SyncBatchNormalization` builds through its :meth:`~SyncBatchNormalization.build`,
    which defers to Keras's once the object is no longer ours."""
    layer.__class__ = keras.layers.BatchNormalization
    layer.synchronized = False
    layer.supports_jit = True
    mismatch.forget(layer)
    keras_build = getattr(vars(layer).get("build"), "keras_build", None)
    if keras_build is not None:  # retyped before it was built: Keras's wrapper alone again
        layer.build = keras_build


def _built_input_shape(layer):
    """The input shape a built batch norm layer was built for: the one Keras recorded,
    else its rank with only the channel axis known."""
    build_config = layer.get_build_config()
    if build_config and "input_shape" in build_config:
        return tuple(build_config["input_shape"])
    shape = [None] * layer.input_spec.ndim
    shape[layer.axis] = layer.moving_mean.shape[0]
    return tuple(shape)


def _assign_if(variable, new, old, ok):
    """``variable.assign(new)``, or, with a verdict ``ok`` (a boolean tensor), of ``new``
    where it holds and of ``old`` (the variable's value, cast as ``new``: exact back)
    where it does not: a selection, so a NaN in ``new`` never leaks through."""
    variable.assign(new if ok is None else ops.where(ok, new, old))

