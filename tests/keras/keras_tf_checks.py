"""TensorFlow-backend checks of ``syncbn.keras``, in one process with 4 logical CPU
devices and torch blocked (the layer must work without it).

Run by ``test_keras_tf.py``:  python tests/keras_tf_checks.py --out R.json --checks NAME...
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from keras_harness import registry, tensorflow_on_devices, worker_main
import keras_oracle as oracle
import nan_safe

DEVICES = 4
CHECKS, check = registry()


def setup():
    tensorflow_on_devices(DEVICES)


# --------------------------------------------------------------------------- helpers

_STRATEGIES = {}


def mirrored(replicas):
    import tensorflow as tf

    if replicas not in _STRATEGIES:
        # Strategies in one process must not share collective group keys (TensorFlow's
        # own tests do the same); a real program has one strategy and never needs this.
        tf.distribute.MirroredStrategy._collective_key_base += 100000
        _STRATEGIES[replicas] = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    return _STRATEGIES[replicas]


def per_replica(strategy, arrays):
    """A distributed value holding ``arrays[i]`` on replica i (any shapes, even empty)."""
    import tensorflow as tf

    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(arrays[ctx.replica_id_in_sync_group])
    )


def local(strategy, value):
    return [v.numpy() for v in strategy.experimental_local_results(value)]


# The functions given to tf.function and strategy.run below are defs, not lambdas: AutoGraph
# converts a def from its own source lines, but for a lambda it parses this whole file, at
# every trace (~0.2 s each, ~60 traces), and then gives up when a line holds two lambdas of
# the same signature, running the lambda as written. The layer calls inside run alike either
# way (Keras's Layer.__call__ is never converted; the replica function is converted in both).


def replicated(strategy, fn):
    """``x, ... -> strategy.run(fn, args=(x, ...))``, to trace with tf.function."""

    def run(*args):
        return strategy.run(fn, args=args)

    return run


def replicated_call(strategy, layer, training):
    """A tf.function of ``layer(x, training=training)`` on every replica."""
    import tensorflow as tf

    def call(x):
        return layer(x, training=training)

    return tf.function(replicated(strategy, call))


def make_layer(cls, channels, ndim, rng, **kwargs):
    """A built layer with random gamma/beta and random moving statistics."""
    layer = cls(**kwargs)
    shape = [None] * ndim
    shape[layer.axis] = channels
    layer.build(tuple(shape))
    weights = []
    for w in layer.weights:
        name = w.path.split("/")[-1]
        if name in ("gamma", "moving_variance", "moving_stddev", "renorm_stddev"):
            weights.append(rng.uniform(0.5, 2.0, channels).astype(np.float32))
        else:
            weights.append(rng.uniform(-1.0, 1.0, channels).astype(np.float32))
    layer.set_weights(weights)
    return layer


def named_weights(layer):
    return {w.path.split("/")[-1]: np.array(w.numpy(), np.float64) for w in layer.weights}


def train_step(strategy, layer, xs, dys, masks=None, eager=False):
    """One training call of ``layer`` on every replica, with gradients of sum(y * dy).

    Returns per-replica ``y``/``dx`` and the replicas' summed gamma/beta gradients.
    """
    import tensorflow as tf

    args = [per_replica(strategy, xs), per_replica(strategy, dys)]
    if masks is not None:
        args.append(per_replica(strategy, masks))

    def step(x, dy, mask=None):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=mask)
            wide = tf.float64 if y.dtype == tf.float64 else tf.float32
            loss = tf.reduce_sum(tf.cast(y, wide) * tf.cast(dy, wide))
        sources = [x] + [v.value for v in layer.trainable_weights]
        grads = tape.gradient(loss, sources)
        return [y] + grads

    run = replicated(strategy, step) if eager else tf.function(replicated(strategy, step))
    outs = run(*args)
    result = {"y": local(strategy, outs[0]), "dx": local(strategy, outs[1])}
    names = [w.path.split("/")[-1] for w in layer.trainable_weights]
    for name, grad in zip(names, outs[2:]):
        result["d" + name] = sum(np.asarray(g, np.float64) for g in local(strategy, grad))
    return result


def compare(got, ref, layer, keys=("y", "dx", "dgamma", "dbeta"), rtol=2e-5, atol=2e-5, stats_rtol=1e-5):
    """Assert ``got`` (and the layer's weights) match the oracle; return the max errors."""
    errors = {}
    for key in keys:
        if key not in got:
            continue
        a, b = got[key], ref[key]
        if isinstance(a, list):
            for i, (ai, bi) in enumerate(zip(a, b)):
                assert ai.shape == bi.shape, (key, i, ai.shape, bi.shape)
                np.testing.assert_allclose(ai, bi, rtol=rtol, atol=atol, err_msg=f"{key}[{i}]")
            errors[key] = nan_safe.worst(nan_safe.max_abs_diff(ai, bi) for ai, bi in zip(a, b))
        else:
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=key)
            errors[key] = nan_safe.max_abs_diff(a, b)
    weights = named_weights(layer)
    for key, name in (("moving_mean", "moving_mean"), ("moving_var", "moving_variance"),
                      ("renorm_mean", "renorm_mean"), ("renorm_std", "renorm_stddev"),
                      ("moving_std", "moving_stddev")):
        if key in ref and name in weights:
            np.testing.assert_allclose(weights[name], ref[key], rtol=stats_rtol, atol=1e-6, err_msg=name)
            errors[name] = nan_safe.max_abs_diff(weights[name], ref[key])
    return errors


def oracle_for(layer, xs, dys, masks=None, renorm=None):
    w = named_weights(layer)
    return oracle.batch_norm(
        xs, dys, axis=layer.axis, gamma=w.get("gamma"), beta=w.get("beta"), eps=layer.epsilon,
        momentum=layer.momentum, moving_mean=w["moving_mean"], moving_var=w["moving_variance"],
        masks=masks, renorm=renorm,
    )


# Input tails per rank (without the batch axis); the channel axis is added at `axis`.
TAILS = {2: (), 3: (5,), 4: (3, 4), 5: (2, 3, 2)}


def input_tail(rank, axis, channels):
    """The per-sample shape for a rank-``rank`` input with ``channels`` at ``axis``."""
    tail = list(TAILS[rank])
    if axis == -1:
        return tuple(tail + [channels])
    return tuple([channels] + tail)  # axis == 1


# --------------------------------------------------------------------------- checks


@check
def oracle_mirrored():
    """2, 3 and 4 replicas, uneven and empty batches, ranks 2-5, channels last and first."""
    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(1)
    cases = {2: [5, 3], 3: [4, 0, 7], 4: [1, 6, 0, 3]}
    errors = {}
    for replicas, sizes in cases.items():
        strategy = mirrored(replicas)
        for rank in (2, 3, 4, 5):
            axis = -1 if (rank + replicas) % 2 else 1
            channels = 3
            xs, dys = oracle.make_inputs(rng, sizes, input_tail(rank, axis, channels), channels, axis)
            with strategy.scope():
                layer = make_layer(SyncBatchNormalization, channels, rank, rng, axis=axis, momentum=0.9)
            ref = oracle_for(layer, xs, dys)
            got = train_step(strategy, layer, xs, dys)
            err = compare(got, ref, layer)
            errors[f"R{replicas}_rank{rank}_axis{axis}"] = nan_safe.worst(err.values())
    return {"max_abs_error": errors}


def penalty_gradient_step(layer, mask=None):
    """``x -> `` the gradient of a gradient penalty through a training call of ``layer``:
    ``sum(g^2)`` with ``g`` the gradient of ``sum(y^3)`` (a second derivative)."""
    import tensorflow as tf

    def step(x):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = tf.reduce_sum(layer(x, training=True, mask=mask) ** 3)
            penalty = tf.reduce_sum(inner.gradient(loss, x) ** 2)
        return outer.gradient(penalty, x)

    return step


@check
def second_order_mirrored():
    """A gradient penalty through a synchronized training call (2 and 3 replicas,
    uneven and empty batches, traced and eager): each replica's second derivative is
    its slice of the one Keras's own layer gives on the concatenated batch on one
    device (each replica's gradients are those of the sum of the replicas' losses).
    Float64 layers and inputs (TensorFlow then computes in float64): rounding alone,
    1e-9 of the largest value."""
    import keras
    import tensorflow as tf

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(11)
    info = {}
    for sizes, axis, eager in (([4, 3], -1, False), ([3, 0, 5], 1, False), ([2, 4], -1, True)):
        strategy = mirrored(len(sizes))
        shape = (3, 2, 4) if axis == -1 else (4, 3, 2)
        xs = [rng.standard_normal((n,) + shape) * 2 + 1 for n in sizes]
        with strategy.scope():
            layer = make_layer(SyncBatchNormalization, 4, 4, rng, axis=axis, dtype="float64")
        plain = keras.layers.BatchNormalization(axis=axis, dtype="float64")
        plain.build((None,) + shape)
        plain.set_weights(layer.get_weights())
        want = penalty_gradient_step(plain)(tf.constant(np.concatenate(xs))).numpy()
        step = penalty_gradient_step(layer)
        run = replicated(strategy, step) if eager else tf.function(replicated(strategy, step))
        got = np.concatenate(local(strategy, run(per_replica(strategy, xs))))
        what = f"{sizes} axis {axis} {'eager' if eager else 'traced'}"
        assert np.max(np.abs(want)) > 1e-3, (what, "a penalty gradient this small proves nothing")
        assert np.all(np.isfinite(got)) and np.all(np.isfinite(want)), what
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * np.max(np.abs(want)), err_msg=what)
        info[what] = float(np.max(np.abs(got - want)))
    return info


@check
def oracle_eager():
    """``strategy.run`` without tf.function (replica threads, eager ops)."""
    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(2)
    strategy = mirrored(3)
    xs, dys = oracle.make_inputs(rng, [3, 6, 0], (4, 2, 3), 3)
    with strategy.scope():
        layer = make_layer(SyncBatchNormalization, 3, 4, rng)
    ref = oracle_for(layer, xs, dys)
    return compare(train_step(strategy, layer, xs, dys, eager=True), ref, layer)


@check
def oracle_mask():
    """Masks count per element: the statistics are those of the kept elements of all
    replicas together; uneven replicas and a replica that keeps nothing; channels last,
    first and in the middle (a Keras mask covers ``inputs.shape[:-1]`` whatever the
    channel axis, so channels not last count different numbers of elements)."""
    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(3)
    strategy = mirrored(3)
    errors = {}
    for axis, tail in ((-1, (6, 3)), (1, (3, 2, 4)), (1, (3, 5)), (2, (4, 3, 2))):
        xs, dys = oracle.make_inputs(rng, [4, 1, 5], tail, 3, axis)
        masks = oracle.make_masks(rng, xs)
        masks[1][:] = False  # a replica that keeps nothing still takes part
        with strategy.scope():
            layer = make_layer(SyncBatchNormalization, 3, len(tail) + 1, rng, axis=axis)
        ref = oracle_for(layer, xs, dys, masks=masks)
        errors[f"axis{axis}"] = compare(train_step(strategy, layer, xs, dys, masks), ref, layer)
    return errors


@check
def oracle_renorm():
    """Batch renormalization from the synchronized statistics, clipped and not."""
    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(4)
    strategy = mirrored(2)
    errors = {}
    for clipping in ({}, {"rmin": 0.8, "rmax": 1.25, "dmax": 0.5}):
        xs, dys = oracle.make_inputs(rng, [6, 3], (5, 3), 3, offset=np.array([0.5, -0.3, 0.2]),
                                     scale=np.array([0.9, 1.6, 0.6]))
        with strategy.scope():
            layer = make_layer(SyncBatchNormalization, 3, 3, rng, renorm=True, renorm_clipping=clipping,
                               renorm_momentum=0.8, momentum=0.9)
        w = named_weights(layer)
        renorm = dict(renorm_mean=w["renorm_mean"], renorm_std=w["renorm_stddev"], moving_std=w["moving_stddev"],
                      renorm_momentum=0.8, **clipping)
        ref = oracle_for(layer, xs, dys, renorm=renorm)
        errors[str(clipping)] = compare(train_step(strategy, layer, xs, dys), ref, layer)
    return errors


@check
def one_replica_matches_keras():
    """No strategy, and a one-replica MirroredStrategy: the same outputs, gradients and
    moving statistics as keras.layers.BatchNormalization (plain, masked, renorm)."""
    import keras
    import tensorflow as tf

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(5)
    diffs = {}
    for where in ("no strategy", "1 replica"):
        strategy = tf.distribute.get_strategy() if where == "no strategy" else mirrored(1)
        for kind in ("plain", "mask", "renorm"):
            kwargs = {"renorm": True} if kind == "renorm" else {}
            xs, dys = oracle.make_inputs(rng, [7], (4, 3), 3)
            masks = oracle.make_masks(rng, xs) if kind == "mask" else None
            results, layers = [], []
            for cls in (keras.layers.BatchNormalization, SyncBatchNormalization):
                layer_rng = np.random.default_rng(50)
                with strategy.scope():
                    layer = make_layer(cls, 3, 3, layer_rng, momentum=0.8, **kwargs)
                initial = named_weights(layer)
                if where == "no strategy":
                    x, dy = tf.constant(xs[0]), tf.constant(dys[0])
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        y = layer(x, training=True, mask=None if masks is None else tf.constant(masks[0]))
                        loss = tf.reduce_sum(y * dy)
                    grads = tape.gradient(loss, [x] + [v.value for v in layer.trainable_weights])
                    out = {"y": y.numpy(), "dx": grads[0].numpy(), "dgamma": grads[1].numpy(),
                           "dbeta": grads[2].numpy()}
                else:
                    out = train_step(strategy, layer, xs, dys, masks)
                    out = {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}
                out.update(named_weights(layer))
                results.append(out)
                layers.append(layer)
            keras_out, ours = results
            # Inference with equal weights: bitwise the same outputs.
            layers[1].set_weights(layers[0].get_weights())
            inference = [np.asarray(l(tf.constant(xs[0]), training=False)) for l in layers]
            np.testing.assert_array_equal(inference[1], inference[0])
            worst = {}
            for key, value in keras_out.items():
                np.testing.assert_allclose(ours[key], value, rtol=1e-4, atol=1e-4, err_msg=f"{where} {kind} {key}")
                worst[key] = nan_safe.max_abs_diff(ours[key], value)
            diffs[f"{where}/{kind}"] = worst
            if kind != "renorm":  # and ours matches the float64 oracle at the usual tolerance
                w = named_weights(layer)
                ref = oracle.batch_norm(xs, dys, gamma=w["gamma"], beta=w["beta"], momentum=0.8,
                                        moving_mean=initial["moving_mean"], moving_var=initial["moving_variance"],
                                        masks=masks)
                for key in ("y", "dx", "dgamma", "dbeta"):
                    np.testing.assert_allclose(ours[key], ref[key][0] if key in ("y", "dx") else ref[key],
                                               rtol=2e-5, atol=2e-5, err_msg=f"{where} {kind} {key} vs oracle")
    return {"max_abs_difference_to_keras": diffs}


@check
def dtypes():
    """float64, mixed_float16 and mixed_bfloat16 policies: outputs in the compute dtype,
    statistics and moving averages in float32 for the half policies, matching the
    oracle on the inputs as the layer sees them (cast to the compute dtype)."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(6)
    strategy = mirrored(2)
    info = {}
    for policy, tol, variables in (("float64", 1e-10, "float64"), ("mixed_float16", 5e-3, "float32"),
                                   ("mixed_bfloat16", 4e-2, "float32")):
        keras.config.set_dtype_policy(policy)
        try:
            xs, dys = oracle.make_inputs(rng, [5, 3], (4, 3), 3, offset=np.array([3.0, -2.0, 1.0]),
                                         scale=np.array([1.0, 0.5, 2.0]))
            with strategy.scope():
                layer = make_layer(SyncBatchNormalization, 3, 3, rng, momentum=0.5)
            assert all(w.dtype == variables for w in layer.weights), [w.dtype for w in layer.weights]
            seen = [np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, layer.compute_dtype)), np.float64)
                    for x in xs]
            if policy == "float64":
                dys = [d.astype(np.float64) for d in dys]
            ref = oracle_for(layer, seen, dys)
            got = train_step(strategy, layer, [x.astype(layer.compute_dtype) for x in xs]
                             if policy == "float64" else xs, dys)
            assert str(got["y"][0].dtype) == layer.compute_dtype, (got["y"][0].dtype, layer.compute_dtype)
            got["y"] = [np.asarray(y, np.float64) for y in got["y"]]
            got["dx"] = [np.asarray(d, np.float64) for d in got["dx"]]
            errors = compare(got, ref, layer, keys=("y", "dgamma", "dbeta"), rtol=tol, atol=tol,
                             stats_rtol=min(1e-5, tol))
            errors.update(compare(got, ref, layer, keys=("dx",), rtol=tol, atol=tol * 10,
                                  stats_rtol=min(1e-5, tol)))
            info[policy] = errors
        finally:
            keras.config.set_dtype_policy("float32")
    return info


@check
def integer_inputs_mirrored():
    """Integer and boolean inputs split unevenly over 2 replicas (one empty) train as
    Keras's layer does on the whole batch cast to float32: float32 output, the same
    values and moving statistics."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(21)
    strategy = mirrored(2)
    info = {}
    for dtype, split in (("uint8", 4), ("int64", 6), ("bool", 2)):
        x = rng.integers(0, 2 if dtype == "bool" else 250, (6, 5, 3)).astype(dtype)
        with strategy.scope():
            layer = make_layer(SyncBatchNormalization, 3, 3, np.random.default_rng(22), momentum=0.5)
        keras_layer = make_layer(keras.layers.BatchNormalization, 3, 3, np.random.default_rng(22), momentum=0.5)
        want = keras_layer(x, training=True).numpy()
        step = replicated_call(strategy, layer, training=True)
        got = local(strategy, step(per_replica(strategy, [x[:split], x[split:]])))
        assert {str(y.dtype) for y in got} == {"float32"}, [y.dtype for y in got]
        info[dtype] = float(np.max(np.abs(np.concatenate(got) - want)))
        np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-5, atol=1e-5, err_msg=dtype)
        for ours, theirs in zip(layer.weights, keras_layer.weights):
            np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{dtype} {ours.path}")
    return info


@check
def numerics_vs_keras():
    """Variance at |mean| / std = 1e3 (and 1e4) against a float64 reference, ours next to
    Keras's BatchNormalization(synchronized=True), on the same data over 2 replicas (and
    Keras's unsynchronized layer on one device with the whole batch, for reference)."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    strategy = mirrored(2)
    rng = np.random.default_rng(7)
    info = {}
    for label, mean, std in (("ratio 1e3 (mean 1000, std 1)", 1000.0, 1.0),
                             ("ratio 1e4 (mean 1000, std 0.1)", 1000.0, 0.1)):
        channels = 4
        xs = [(rng.standard_normal((n, 16, channels)) * std + mean).astype(np.float32) for n in (96, 160)]
        dys = [np.ones_like(x) for x in xs]
        reference = np.concatenate(xs).astype(np.float64).reshape(-1, channels).var(0)
        row = {}
        for name, make in (
            ("syncbn", lambda: SyncBatchNormalization(momentum=0.0)),
            ("keras_synchronized", lambda: keras.layers.BatchNormalization(momentum=0.0, synchronized=True)),
        ):
            with strategy.scope():
                layer = make()
                layer.build((None, 16, channels))
            train_step(strategy, layer, xs, dys)
            var = layer.moving_variance.numpy()
            row[name] = {"variance": var.tolist(), "relative_error": oracle.variance_relative_error(var, reference)}
        local = keras.layers.BatchNormalization(momentum=0.0)  # one device, whole batch
        local(np.concatenate(xs), training=True)
        var = local.moving_variance.numpy()
        row["keras_one_device"] = {"variance": var.tolist(),
                                   "relative_error": oracle.variance_relative_error(var, reference)}
        row["reference_variance"] = reference.tolist()
        info[label] = row
    ours = info["ratio 1e3 (mean 1000, std 1)"]["syncbn"]["relative_error"]
    assert ours <= 1e-5, f"variance relative error {ours} at ratio 1e3"

    # Constant channels: variance exactly >= 0, never NaN, y = beta.
    with strategy.scope():
        layer = SyncBatchNormalization(momentum=0.0)
        layer.build((None, 3))
    xs = [np.full((4, 3), 1234.5, np.float32), np.full((2, 3), 1234.5, np.float32)]
    got = train_step(strategy, layer, xs, [np.ones_like(x) for x in xs])
    var = layer.moving_variance.numpy()
    assert np.all(var >= 0) and not np.any(np.isnan(var)), var
    assert all(np.all(np.isfinite(y)) for y in got["y"] + got["dx"])
    info["constant_input_variance"] = var.tolist()
    return info


@check
def float32_sums():
    """Where float64 sums are unavailable (TPU), the packs are float32 around the moving
    mean: exact once the moving mean is near the batch mean, not before. Measured here
    on CPU by forcing float32 sums."""
    from syncbn.keras import SyncBatchNormalization, replicas

    strategy = mirrored(2)
    rng = np.random.default_rng(14)
    xs = [(rng.standard_normal((n, 16, 2)) + 1000.0).astype(np.float32) for n in (64, 96)]
    reference = np.concatenate(xs).astype(np.float64).reshape(-1, 2).var(0)
    original = replicas.tf_sum_dtype
    info = {}
    try:
        for sums in ("float64", "float32"):
            replicas.tf_sum_dtype = lambda ctx, sums=sums: sums
            for start in (0.0, 999.5):
                with strategy.scope():
                    layer = SyncBatchNormalization(momentum=0.0, moving_mean_initializer=keras_constant(start))
                    layer.build((None, 16, 2))
                train_step(strategy, layer, xs, [np.ones_like(x) for x in xs])
                error = oracle.variance_relative_error(layer.moving_variance.numpy(), reference)
                info[f"{sums} sums, moving mean {start}"] = error
    finally:
        replicas.tf_sum_dtype = original
    assert info["float64 sums, moving mean 0.0"] <= 1e-5, info
    assert info["float32 sums, moving mean 999.5"] <= 1e-5, info
    return {"variance_relative_error_at_ratio_1e3": info}


def keras_constant(value):
    import keras

    return keras.initializers.Constant(value)


@check
def collective_counts():
    """All-reduce calls per replica for one layer call: ours vs Keras synchronized BN."""
    import keras
    import tensorflow as tf

    from syncbn.keras import SyncBatchNormalization

    strategy = mirrored(2)
    calls = []
    original = tf.distribute.ReplicaContext.all_reduce

    def counting(self, reduce_op, value, options=None):
        calls.append(1)
        return original(self, reduce_op, value, options)

    rng = np.random.default_rng(8)
    xs, dys = oracle.make_inputs(rng, [4, 3], (5, 3), 3)
    counts = {}
    tf.distribute.ReplicaContext.all_reduce = counting
    try:
        for name, make in (("syncbn", lambda: SyncBatchNormalization()),
                           ("keras_synchronized", lambda: keras.layers.BatchNormalization(synchronized=True))):
            with strategy.scope():
                layer = make()
                layer.build((None, 5, 3))
            X = per_replica(strategy, xs)

            calls.clear()
            replicated_call(strategy, layer, training=True)(X)
            forward = len(calls) / 2
            calls.clear()
            train_step(strategy, layer, xs, dys)
            both = len(calls) / 2
            calls.clear()
            replicated_call(strategy, layer, training=False)(X)
            counts[name] = {"forward": forward, "backward": both - forward, "inference": len(calls) / 2}
    finally:
        tf.distribute.ReplicaContext.all_reduce = original
    assert counts["syncbn"] == {"forward": 1, "backward": 1, "inference": 0}, counts
    return {"all_reduce_calls_per_replica_per_layer_call": counts}


def small_convnet(bn, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same")(inputs)
    x = bn()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(6, 3, strides=2)(x)
    x = bn()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3)(x)
    return keras.Model(inputs, outputs)


_CONVNET_FITS = {}


def convnet_fit(kind):
    """The weights of :func:`small_convnet` after ``model.fit`` (SGD 0.1, 2 epochs of 4
    batches of 16, in order), from the same weights on the same data: ``"single"``, Keras's
    layer on one device (no strategy); under MirroredStrategy(2), ``"plain"`` (Keras's
    layer), ``"converted"`` (``convert(model)``) or ``"reverted"``
    (``revert(convert(model))``, checked to hold no SyncBatchNormalization). Each is
    trained once per process: fit_matches_single_device and revert_trains_per_replica
    both compare with the plain and converted runs."""
    import keras
    import tensorflow as tf

    from syncbn.keras import SyncBatchNormalization, convert, revert

    if kind not in _CONVNET_FITS:
        rng = np.random.default_rng(9)
        x = (rng.standard_normal((64, 8, 8, 3)) * [1.0, 2.0, 0.5] + [3.0, -1.0, 5.0]).astype(np.float32)
        y = rng.integers(0, 3, 64)
        initial = small_convnet(keras.layers.BatchNormalization).get_weights()
        strategy = tf.distribute.get_strategy() if kind == "single" else mirrored(2)
        with strategy.scope():
            model = small_convnet(keras.layers.BatchNormalization)
            model.set_weights(initial)
            if kind in ("converted", "reverted"):
                model = convert(model)
            if kind == "reverted":
                model = revert(model)
                left = [layer.name for layer in all_layers(model) if isinstance(layer, SyncBatchNormalization)]
                assert not left, left
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        _CONVNET_FITS[kind] = model.get_weights()
    return _CONVNET_FITS[kind]


@check
def fit_matches_single_device():
    """model.fit under MirroredStrategy(2) with convert(): the weights after several
    steps equal those of one device trained on the concatenated batches. The same model
    with Keras's unsynchronized BN does not (so the check can tell them apart)."""
    single, synced, unsynced = convnet_fit("single"), convnet_fit("converted"), convnet_fit("plain")
    diff_synced = nan_safe.worst(nan_safe.max_abs_diff(a, b) for a, b in zip(single, synced))
    diff_unsynced = nan_safe.worst(nan_safe.max_abs_diff(a, b) for a, b in zip(single, unsynced))
    assert diff_synced < 1e-4, diff_synced
    assert diff_unsynced > 100 * diff_synced, (diff_unsynced, diff_synced)
    return {"steps": 8, "max_weight_difference_syncbn": diff_synced,
            "max_weight_difference_keras_unsynchronized": diff_unsynced}


def dense_bn_model(bn, seed=0):
    """Dense layers with batch norm on rank-3 (tokens) and rank-2 inputs: unlike
    TensorFlow's CPU Conv2D (which returns its input's shape for an empty batch, so
    ``fit`` fails on a replica with no sample, with or without batch norm), every op here
    takes an empty replica batch."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4, 5))
    x = keras.layers.Dense(6)(inputs)
    x = bn()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(6)(x)
    x = bn()(x)
    outputs = keras.layers.Dense(3)(keras.layers.ReLU()(x))
    return keras.Model(inputs, outputs)


@check
def fit_uneven_last_batch_moving_statistics():
    """model.fit under MirroredStrategy(2) on a dataset batched with
    ``drop_remainder=False``, whose last global batch the replicas share unevenly (3
    samples as 2 + 1; then 1 sample as 1 + 0, one replica empty): the moving statistics
    equal those of Keras's BatchNormalization fitted on one device on the same global
    batches.

    The learning rate is zero, so every weight stays at its initial value and the moving
    statistics depend on the batches alone: Keras's ``fit`` weighs each replica's mean
    loss equally, so on an uneven step the gradients (hence the weights after it) are
    not one device's, whatever the batch norm (docs/keras.md); with the weights frozen
    the comparison is exact up to float32 rounding, at every step, uneven ones included.

    Tolerance, float32 (u = 2**-24): per step the two sides differ by the rounding of the
    Dense layers (at most 24 products per output, summed in a backend-chosen order:
    <= 24 u relative to the activations' amplitude A = max |mean| + 4 std, passed on
    through the first batch norm's output) and of the per-channel sums (Keras's
    single-device reductions, syncbn's replica-local float32 sums before the float64
    all-reduce: at most 16 * 4 = 64 terms, <= 64 u), under 100 u * A for a mean
    (6e-6 A); a variance moves by about 2 std times that. A moving average is a convex
    combination of such per-step values plus one rounding per update, so the bound holds
    at the end: 1e-5 * A for moving means, 2e-5 * A * std for moving variances.
    Weighting the non-empty replicas equally instead (the mean of per-replica means)
    misses by 0.13 on the 2 + 1 split, where samples carry their own offsets; weighting
    every replica equally, the empty one included, misses by 2.8 on the 1 + 0 split."""
    import keras
    import tensorflow as tf

    from syncbn.keras import convert

    rng = np.random.default_rng(21)

    def data(count):
        # a per-sample offset as well as per-feature ones, so that a 2 + 1 split of the
        # last batch has replica means far from each other
        x = rng.standard_normal((count, 4, 5)) + rng.standard_normal((count, 1, 5)) * 2.0
        x = (x * [1.0, 2.0, 0.5, 1.0, 3.0] + [3.0, -1.0, 5.0, 0.0, 2.0]).astype(np.float32)
        return tf.data.Dataset.from_tensor_slices((x, rng.integers(0, 3, count))).batch(16, drop_remainder=False)

    datasets = [data(51), data(49)]  # 16, 16, 16, then 3 (2 + 1), and 1 (1 + 0)

    def bn():
        return keras.layers.BatchNormalization(momentum=0.5)  # the last (uneven) step weighs half

    initial = dense_bn_model(bn).get_weights()

    def fits(strategy, sync):
        with strategy.scope():
            model = dense_bn_model(bn)
            model.set_weights(initial)
            if sync:
                model = convert(model)
                assert sum(type(layer).__name__ == "SyncBatchNormalization" for layer in model.layers) == 2
            model.compile(optimizer=keras.optimizers.SGD(0.0),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        start = model.get_weights()
        layers = [layer for layer in model.layers if "BatchNormalization" in type(layer).__name__]
        out = []
        for dataset in datasets:
            # every weight (moving statistics included) back at its start: each uneven split
            # is checked on its own, as with a fresh model, and one traced step serves both
            model.set_weights(start)
            model.fit(dataset, epochs=1, verbose=0, shuffle=False)
            out.append([(np.array(layer.moving_mean), np.array(layer.moving_variance)) for layer in layers])
        return out

    reference = fits(tf.distribute.get_strategy(), sync=False)
    synced = fits(mirrored(2), sync=True)
    info, over = {}, []
    for step, (ref_layers, got_layers) in enumerate(zip(reference, synced)):
        for i, ((ref_mean, ref_var), (mean, var)) in enumerate(zip(ref_layers, got_layers)):
            std = float(np.sqrt(np.max(ref_var)))
            amplitude = float(np.max(np.abs(ref_mean))) + 4.0 * std
            figures = {"mean_error": nan_safe.max_abs_diff(mean, ref_mean), "mean_bound": 1e-5 * amplitude,
                       "var_error": nan_safe.max_abs_diff(var, ref_var), "var_bound": 2e-5 * amplitude * std}
            info[f"fit{step}_bn{i}"] = figures
            # nan_safe's errors are inf where a value is not finite: never within a bound
            if not (figures["mean_error"] <= figures["mean_bound"] and figures["var_error"] <= figures["var_bound"]):
                over.append(f"fit{step}_bn{i}")
    assert not over, (over, info)
    return info


@check
def revert_trains_per_replica():
    """``revert(convert(model))`` under MirroredStrategy(2) has no SyncBatchNormalization
    left and trains as Keras's plain layer (each replica normalizes with its own
    batch): after ``fit`` its weights are those of the plain model trained alike, and
    far from those of the converted model trained alike (so the check tells the two
    apart)."""
    plain, reverted, converted = convnet_fit("plain"), convnet_fit("reverted"), convnet_fit("converted")
    diff_reverted = nan_safe.worst(nan_safe.max_abs_diff(a, b) for a, b in zip(plain, reverted))
    diff_converted = nan_safe.worst(nan_safe.max_abs_diff(a, b) for a, b in zip(plain, converted))
    # The same layer code on the same replica batches: equal up to the order of sums.
    assert diff_reverted <= 1e-6, diff_reverted
    assert diff_converted > 1e-3, diff_converted
    return {"max_weight_difference_reverted_vs_plain": diff_reverted,
            "max_weight_difference_converted_vs_plain": diff_converted}


@check
def bad_input_errors():
    """Wrong axis, channel mismatch, complex input, wrong mask: clear errors, raised
    the same way on every replica (they depend only on shapes and dtypes)."""
    import tensorflow as tf

    from syncbn.keras import SyncBatchNormalization

    messages = {}

    def expect(exc_type, words, fn):
        try:
            fn()
        except exc_type as err:
            text = str(err)
            for word in words:
                assert word in text, f"{word!r} not in {text!r}"
            return text
        raise AssertionError(f"no {exc_type.__name__} raised (expected {words})")

    messages["axis out of range"] = expect(
        ValueError, ["axis=3", "out of range", "rank 3"], lambda: SyncBatchNormalization(axis=3).build((None, 4, 3)))
    messages["batch axis"] = expect(
        ValueError, ["batch axis"], lambda: SyncBatchNormalization(axis=0).build((None, 4, 3)))
    messages["axis list"] = expect(TypeError, ["one integer"], lambda: SyncBatchNormalization(axis=[1, 2]))
    messages["unknown channels"] = expect(
        ValueError, ["known size"], lambda: SyncBatchNormalization().build((None, None)))

    layer = SyncBatchNormalization()
    layer(tf.zeros((2, 5, 3)), training=True)
    messages["channel mismatch"] = expect(ValueError, ["3", "4"], lambda: layer(tf.zeros((2, 5, 4)), training=True))
    messages["complex"] = expect(
        TypeError, ["real", "complex64"], lambda: layer(tf.zeros((2, 5, 3), tf.complex64), training=True))
    messages["mask rank"] = expect(
        ValueError, ["mask"], lambda: layer(tf.zeros((2, 5, 3)), training=True, mask=tf.ones((2,), tf.bool)))

    # Inside a 2-replica step the same errors come out (one per replica, all alike).
    strategy = mirrored(2)
    with strategy.scope():
        synced = SyncBatchNormalization()
        synced.build((None, 3))
    step = replicated_call(strategy, synced, training=True)
    complexes = per_replica(strategy, [np.ones((2, 3), np.complex64), np.ones((0, 3), np.complex64)])
    messages["complex, 2 replicas"] = expect(TypeError, ["real", "complex64"], lambda: step(complexes))
    wrong = per_replica(strategy, [np.ones((2, 4), np.float32), np.ones((1, 4), np.float32)])
    messages["channel mismatch, 2 replicas"] = expect(ValueError, ["3", "4"], lambda: step(wrong))
    return messages


@check
def traced_without_a_static_channel_size():
    """A built layer traced by ``tf.function`` with ``None`` for every input dimension
    (an ``input_signature``, as ``model.export`` and SavedModel serving use) trains as
    Keras's layer does: the same output and moving statistics as the layer traced with
    the full shape and as Keras's layer on the whole batch, for channels last and
    first, masked, renorm, under XLA and over 2 replicas (4 and 2 rows); an input
    with another channel count then fails when the graph runs, with the shapes named. (The channel size was read from the traced shape: ``None`` made
    the training call raise a TypeError while building the graph.)"""
    import keras
    import tensorflow as tf

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(31)
    info = {}
    for axis, kwargs, masked, jit, replicas in ((-1, {}, False, False, 1), (1, {}, True, False, 1),
                                                (-1, {"renorm": True}, True, False, 1), (-1, {}, True, True, 1),
                                                (1, {}, False, False, 2), (-1, {"renorm": True}, True, False, 2)):
        what = f"axis {axis} {kwargs} mask {masked} jit {jit} replicas {replicas}"
        x = (rng.standard_normal((6, 3, 4) if axis == -1 else (6, 4, 3)) * 2 + 5).astype(np.float32)
        mask = rng.uniform(size=x.shape[:-1]) < 0.6 if masked else None
        outs = []
        for signature in ([None, None, None], list(x.shape)):
            strategy = mirrored(replicas) if replicas > 1 else tf.distribute.get_strategy()
            with strategy.scope():
                layer = make_layer(SyncBatchNormalization, 4, 3, np.random.default_rng(32), axis=axis,
                                   momentum=0.5, **kwargs)
            specs = [tf.TensorSpec([None] * 3 if signature[0] is None else [None] + signature[1:], tf.float32)]
            if masked:
                specs.append(tf.TensorSpec([None, None], tf.bool))

            def call(x, m=None):
                if replicas > 1:  # this replica's rows: 4 on the first, 2 on the second
                    rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                    start, end = tf.gather([0, 4], rid), tf.gather([4, 6], rid)
                    x = x[start:end]
                    m = None if m is None else m[start:end]
                return layer(x, training=True, mask=m)

            if replicas > 1:
                def run(x, m=None):
                    return strategy.run(call, args=(x,) if m is None else (x, m))
                step = tf.function(run, input_signature=specs, jit_compile=jit)
                y = step(*([tf.constant(x)] + ([tf.constant(mask)] if masked else [])))
                y = np.concatenate(local(strategy, y))
            else:
                step = tf.function(call, input_signature=specs, jit_compile=jit)
                y = step(*([tf.constant(x)] + ([tf.constant(mask)] if masked else []))).numpy()
            outs.append((y, named_weights(layer), layer, step))
        (y, w, layer, step), (y_known, w_known, _, _) = outs
        assert np.all(np.isfinite(y)), what
        np.testing.assert_allclose(y, y_known, rtol=1e-6, atol=1e-6, err_msg=what)
        for key, value in w_known.items():
            np.testing.assert_allclose(w[key], value, rtol=1e-6, atol=1e-7, err_msg=f"{what} {key}")
        # Keras's layer on the whole batch, eagerly (the synchronized statistics are the
        # whole batch's; float32 rounding of the two formulas: 1e-5).
        keras_layer = make_layer(keras.layers.BatchNormalization, 4, 3, np.random.default_rng(32), axis=axis,
                                 momentum=0.5, **kwargs)
        want = keras_layer(tf.constant(x), training=True, mask=None if mask is None else tf.constant(mask)).numpy()
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=f"{what} keras")
        for key, value in named_weights(keras_layer).items():
            np.testing.assert_allclose(w[key], value, rtol=1e-5, atol=1e-6, err_msg=f"{what} keras {key}")
        info[what] = float(np.max(np.abs(y - y_known)))
        if replicas == 1 and not jit:
            wrong = np.ones((2, 3, 5) if axis == -1 else (2, 5, 3), np.float32)
            try:
                step(*([tf.constant(wrong)] + ([tf.ones((2, 3) if axis == -1 else (2, 5), tf.bool)] if masked else [])))
            except tf.errors.InvalidArgumentError as err:
                assert "5" in str(err) and "4" in str(err), str(err)
            else:
                raise AssertionError(f"{what}: an input with 5 channels trained a 4-channel layer")
    return info


@check
def config_and_weights():
    """Constructor arguments, weights (names, shapes, order) and get_config of
    keras.layers.BatchNormalization; set_weights both ways."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(10)
    for kwargs in ({}, {"renorm": True, "renorm_clipping": {"rmax": 2.0}, "center": False},
                   {"axis": 1, "scale": False, "momentum": 0.5, "epsilon": 1e-5}):
        ours = make_layer(SyncBatchNormalization, 4, 4, rng, **kwargs)
        theirs = make_layer(keras.layers.BatchNormalization, 4, 4, rng, **kwargs)
        assert [(w.path.split("/")[-1], tuple(w.shape)) for w in ours.weights] == \
               [(w.path.split("/")[-1], tuple(w.shape)) for w in theirs.weights]
        config, keras_config = ours.get_config(), theirs.get_config()
        assert "synchronized" not in config
        keras_config.pop("synchronized")
        keras_config.pop("name"), config.pop("name")
        assert config == keras_config, (config, keras_config)
        ours.set_weights(theirs.get_weights())
        theirs.set_weights([w * 2 for w in ours.get_weights()])
        ours.set_weights(theirs.get_weights())
        for a, b in zip(ours.get_weights(), theirs.get_weights()):
            np.testing.assert_array_equal(a, b)
        # A keras config (with `synchronized`) builds our layer.
        SyncBatchNormalization.from_config(theirs.get_config())
    return {}


@check
def save_load_roundtrip():
    """A model with the layer saves to .keras and loads back with identical outputs."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(11)
    inputs = keras.Input((6, 3))
    x = SyncBatchNormalization(momentum=0.5)(inputs)
    x = keras.layers.Dense(4)(x)
    x = SyncBatchNormalization(axis=1, renorm=True, renorm_clipping={"rmax": 3.0, "dmax": 1.0})(x)
    model = keras.Model(inputs, x)
    data = rng.standard_normal((8, 6, 3)).astype(np.float32) * 2 + 1
    model.compile(optimizer="sgd", loss="mse")
    model.fit(data, rng.standard_normal((8, 6, 4)).astype(np.float32), epochs=2, verbose=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    assert [type(l).__name__ for l in loaded.layers] == [type(l).__name__ for l in model.layers]
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), model.predict(data, verbose=0))
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    return {}


def residual_model():
    """A ResNet-style model: BNs in a custom residual layer (attribute, list, and a
    Sequential shortcut), a nested Sequential, a nested Functional model (channels_first BN), shared layers."""
    import keras

    @keras.saving.register_keras_serializable(package="syncbn_tests")
    class ResidualBlock(keras.layers.Layer):
        def __init__(self, filters, **kwargs):
            super().__init__(**kwargs)
            self.filters = filters
            self.conv1 = keras.layers.Conv2D(filters, 3, padding="same")
            self.bn1 = keras.layers.BatchNormalization()
            self.conv2 = keras.layers.Conv2D(filters, 3, padding="same")
            self.extra = [keras.layers.BatchNormalization(momentum=0.9)]
            self.shortcut = keras.Sequential([keras.layers.Conv2D(filters, 1), keras.layers.BatchNormalization()])

        def call(self, x, training=None):
            h = keras.ops.relu(self.bn1(self.conv1(x), training=training))
            h = self.extra[0](self.conv2(h), training=training)
            return keras.ops.relu(h + self.shortcut(x, training=training))

        def get_config(self):
            return {**super().get_config(), "filters": self.filters}

    inner_seq = keras.Sequential(
        [keras.layers.Conv2D(8, 1), keras.layers.BatchNormalization(), keras.layers.ReLU()], name="seq")
    sub_in = keras.Input((4, 4, 8))
    sub = keras.layers.Permute((3, 1, 2))(sub_in)
    sub = keras.layers.BatchNormalization(axis=1)(sub)
    sub = keras.layers.Permute((2, 3, 1))(sub)
    sub_model = keras.Model(sub_in, sub, name="channels_first_block")

    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = ResidualBlock(8)(x)
    x = inner_seq(x)
    x = keras.layers.MaxPooling2D()(x)
    x = sub_model(x)
    shared = keras.layers.BatchNormalization(name="shared_bn")
    x = shared(x)
    x = shared(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(5)(x)
    return keras.Model(inputs, outputs), ResidualBlock


def all_layers(layer, seen=None):
    """Every layer reachable from ``layer`` through Keras's layer tracking."""
    seen = set() if seen is None else seen
    found = []
    for sub in layer._flatten_layers(include_self=False, recursive=True):
        if id(sub) not in seen:
            seen.add(id(sub))
            found.append(sub)
    return found


@check
def convert_in_a_strategy_scope_warns_nothing():
    """``convert`` and ``revert`` inside a 2-replica ``MirroredStrategy`` scope, as the
    guide shows, warn about nothing: the attributes that the swap itself decides
    (``supports_jit``, False for a synchronized layer made under the strategy, and
    ``synchronized``, False in every copy) are not attributes the copy lost. For a
    Sequential and a Functional model, a custom layer holding batch norm layers and a
    subclassed model; an attribute the user set outside the config is still named.
    (Both were named in a warning telling the user to put them in ``get_config()``.)"""
    import warnings

    import keras

    from syncbn.keras import SyncBatchNormalization, convert, revert

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(3)
            self.norm = keras.layers.BatchNormalization(synchronized=True)

        def call(self, x, training=None):
            return self.norm(self.dense(x), training=training)

    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = Block()
            self.norm = keras.layers.BatchNormalization()

        def call(self, x, training=None):
            return self.norm(self.block(x, training=training), training=training)

    def syncbn_warnings(fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fn()
        return result, [str(w.message) for w in caught if "syncbn" in str(w.message)]

    strategy = mirrored(2)
    info = {}
    with strategy.scope():
        inputs = keras.Input((4,))
        models = {
            "sequential": keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                            keras.layers.BatchNormalization(synchronized=True)]),
            "functional, custom block": keras.Model(inputs, keras.layers.BatchNormalization()(Block()(inputs))),
            "subclassed": Net(),
        }
        models["subclassed"](np.ones((2, 4), np.float32))
        for name, model in models.items():
            converted, caught = syncbn_warnings(lambda: convert(model))
            assert not caught, (name, "convert", caught)
            synced = [l for l in all_layers(converted) if isinstance(l, SyncBatchNormalization)]
            assert len(synced) == (1 if name == "sequential" else 2), (name, synced)
            assert all(l.supports_jit is False and l.synchronized is False for l in synced), name
            reverted, caught = syncbn_warnings(lambda: revert(converted))
            assert not caught, (name, "revert", caught)
            plain = [l for l in all_layers(reverted) if type(l) is keras.layers.BatchNormalization]
            assert len(plain) == len(synced) and all(l.supports_jit is True for l in plain), name
            info[name] = "no warning"
        # An attribute set outside the config is still named.
        model = models["sequential"]
        model.layers[-1].user_flag = 3
        _, caught = syncbn_warnings(lambda: convert(model))
        assert len(caught) == 1 and "user_flag (3" in caught[0] and "supports_jit" not in caught[0] \
            and "synchronized" not in caught[0], caught
        info["user attribute"] = caught[0]
    return info


@check
def convert_resnet_style():
    """convert() replaces every BatchNormalization (nested models and custom layers),
    copies the weights, keeps inference outputs, leaves the original untouched."""
    import keras

    from syncbn.keras import SyncBatchNormalization, convert

    rng = np.random.default_rng(12)
    model, _ = residual_model()
    data = (rng.standard_normal((6, 8, 8, 3)) * 2 + 1).astype(np.float32)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(data, rng.standard_normal((6, 5)).astype(np.float32), epochs=2, verbose=0)  # move BN statistics
    before = [w.copy() for w in model.get_weights()]

    def count(m):
        layers = all_layers(m)
        plain = sum(type(l) is keras.layers.BatchNormalization for l in layers)
        sync = sum(isinstance(l, SyncBatchNormalization) for l in layers)
        return plain, sync

    plain_before, _ = count(model)
    converted = convert(model)
    plain_after, sync_after = count(converted)
    assert plain_before == 7, plain_before
    assert (plain_after, sync_after) == (0, plain_before), (plain_after, sync_after)
    assert count(model) == (plain_before, 0), "the original model changed"
    expected = model.predict(data, verbose=0)
    got = converted.predict(data, verbose=0)
    np.testing.assert_array_equal(got, expected)
    assert len(converted.get_weights()) == len(before)
    for a, b in zip(converted.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    # Independent copies: training the converted model leaves the original as it was.
    converted.compile(optimizer="sgd", loss="mse")
    converted.fit(data, rng.standard_normal((6, 5)).astype(np.float32), epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)

    # A bare layer and a subclassed model.
    bn = keras.layers.BatchNormalization(axis=1)
    bn.build((None, 4, 2))
    sbn = convert(bn)
    assert isinstance(sbn, SyncBatchNormalization) and sbn.axis == 1
    for a, b in zip(sbn.get_weights(), bn.get_weights()):
        np.testing.assert_array_equal(a, b)

    @keras.saving.register_keras_serializable(package="syncbn_tests")
    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4)
            self.norm = keras.layers.BatchNormalization()

        def call(self, x, training=None):
            return self.norm(self.dense(x), training=training)

    net = Net()
    small = rng.standard_normal((5, 3)).astype(np.float32)
    net(small, training=True)
    net_converted = convert(net)
    assert isinstance(net_converted.norm, SyncBatchNormalization)
    assert not isinstance(net.norm, SyncBatchNormalization)
    np.testing.assert_array_equal(net_converted(small), net(small))
    return {"bn_layers": plain_before}


@check
def convert_weights_files_and_classes():
    """``.weights.h5`` files move both ways between a model and ``convert(model)``
    through ``convert`` and ``revert`` (a checkpoint from before the conversion loaded,
    then converted; a synchronized model trained, then reverted and saved for plain
    deployment), and loading one directly into the other kind fails loudly (the file
    names a layer's group after its class); a Functional subclass keeps its class,
    attributes and overridden methods; only exact BatchNormalization layers are
    replaced, subclasses (a frozen BN, one with an extra constructor argument) are kept
    and named in a warning."""
    import warnings

    import keras
    import tensorflow as tf

    from syncbn.keras import SyncBatchNormalization, convert, revert
    from syncbn.keras.convert import Synchronized

    rng = np.random.default_rng(15)
    data = (rng.standard_normal((8, 8, 8, 3)) * 2 + 1).astype(np.float32)
    info = {}

    def trained(model):
        """The model with every weight set to fresh random values."""
        model.set_weights([rng.standard_normal(w.shape).astype(w.dtype) if "variance" not in w.path
                           else rng.uniform(0.5, 2.0, w.shape).astype(w.dtype) for w in model.weights])
        return model

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.weights.h5")
        for direction in ("plain to synchronized", "synchronized to plain"):
            plain = trained(small_convnet(keras.layers.BatchNormalization, seed=1))
            synced = trained(convert(plain))
            source, target = (plain, synced) if direction.startswith("plain") else (synced, plain)
            source.save_weights(path)
            try:
                target.load_weights(path)
            except ValueError as err:
                assert "could not be loaded" in str(err), err
            else:
                raise AssertionError(f"{direction}: a weights file loaded directly into the other kind")
            if direction.startswith("plain"):
                plain.save_weights(path)
                loaded = small_convnet(keras.layers.BatchNormalization, seed=2)
                loaded.load_weights(path)
                source, target = plain, convert(loaded)
            else:
                revert(synced).save_weights(path)
                plain.load_weights(path)
                source, target = synced, plain
            assert isinstance(target.layers[2], SyncBatchNormalization) is direction.startswith("plain")
            for a, b in zip(source.get_weights(), target.get_weights()):
                np.testing.assert_array_equal(a, b, err_msg=direction)
            np.testing.assert_array_equal(source.predict(data, verbose=0), target.predict(data, verbose=0))
            info[direction] = "loaded through " + ("convert" if direction.startswith("plain") else "revert")

    class FrozenBN(keras.layers.BatchNormalization):
        def call(self, inputs, training=None, mask=None):
            return super().call(inputs, training=False, mask=mask)

    class ScaledBN(keras.layers.BatchNormalization):
        def __init__(self, factor, **kwargs):
            super().__init__(**kwargs)
            self.factor = factor

        def call(self, inputs, training=None, mask=None):
            return super().call(inputs, training=training, mask=mask) * self.factor

        def get_config(self):
            return {**super().get_config(), "factor": self.factor}

    class Classifier(keras.Model):
        """A Functional subclass that builds its own graph and post-processes predictions."""

        def __init__(self, classes, **kwargs):
            inputs = keras.Input((4,))
            x = keras.layers.Dense(5)(inputs)
            x = keras.layers.BatchNormalization()(x)
            x = FrozenBN()(x)
            x = ScaledBN(2.0)(x)
            outputs = keras.layers.Dense(classes)(x)
            super().__init__(inputs, outputs, **kwargs)
            self.classes = classes
            self.tag = "kept"

        def get_config(self):
            return {"classes": self.classes, "name": self.name}

        def predict_step(self, data):
            return tf.argmax(super().predict_step(data), axis=-1)

    keras.saving.get_custom_objects().update({"FrozenBN": FrozenBN, "ScaledBN": ScaledBN})
    model = Classifier(3)
    trained(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = convert(model)
    messages = [str(w.message) for w in caught if "syncbn.keras.convert" in str(w.message)]
    assert len(messages) == 1 and "FrozenBN" in messages[0] and "ScaledBN" in messages[0], messages
    # its class, made to save as converted (syncbn.keras.convert.synchronized_class)
    assert type(new).__bases__ == (Synchronized, Classifier), type(new).__mro__
    assert new.tag == "kept" and new.classes == 3, vars(new).get("tag")
    kinds = [type(layer) for layer in new.layers]
    assert kinds[2] is SyncBatchNormalization and kinds[3] is FrozenBN and kinds[4] is ScaledBN, kinds
    x = rng.standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_array_equal(new.predict(x, verbose=0), model.predict(x, verbose=0))
    assert new.predict(x, verbose=0).ndim == 1  # the overridden predict_step runs
    for a, b in zip(new.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # The frozen subclass still ignores training=True after conversion.
    frozen = new.layers[3]
    before = frozen.get_weights()
    new(x, training=True)
    for a, b in zip(frozen.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    # A plain model holding the subclasses converts without error, and warns.
    inputs = keras.Input((4,))
    plain = keras.Model(inputs, ScaledBN(3.0)(keras.layers.BatchNormalization()(inputs)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = convert(plain)
    assert any("ScaledBN" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert [type(layer) for layer in converted.layers[1:]] == [SyncBatchNormalization, ScaledBN]
    info["warning"] = messages[0]
    return info


@check
def custom_loop_example():
    """The README's custom-training-loop pattern runs and keeps replicas in sync."""
    import keras
    import tensorflow as tf

    import syncbn.keras

    strategy = mirrored(2)
    with strategy.scope():
        model = syncbn.keras.convert(small_convnet(keras.layers.BatchNormalization))
        optimizer = keras.optimizers.SGD(0.05)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum")

    global_batch = 16
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((32, 8, 8, 3)) + 2).astype(np.float32)
    y = rng.integers(0, 3, 32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def train_step(batch):
        def step(images, labels):
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                loss = loss_fn(labels, logits) / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(step, args=batch)
        return strategy.reduce("SUM", losses, axis=None)

    losses = [float(train_step(batch)) for batch in dist_dataset]
    bn = [l for l in model.layers if isinstance(l, syncbn.keras.SyncBatchNormalization)][0]
    copies = [v.numpy() for v in bn.moving_mean.value.values]
    np.testing.assert_array_equal(copies[0], copies[1])
    assert all(np.isfinite(losses))
    return {"losses": losses}


@check
def degenerate_batches():
    """At most one value per channel in the whole batch, or none (a batch of one sample
    over two replicas, a replica with nothing, masks that keep one element or none, a
    channel that no replica counts): no error, and the values of Keras's layer on the
    whole batch (variance 0; mean 0 where nothing counts), against the float64 oracle;
    eager and traced. ``fit`` whose last batch holds one sample for two replicas trains."""
    import keras

    from syncbn.keras import SyncBatchNormalization, convert

    rng = np.random.default_rng(14)
    strategy = mirrored(2)
    info = {}
    cases = {
        "(1, 0)": ([1, 0], (3,), -1, None),
        "(1, 1)": ([1, 1], (3,), -1, None),
        "mask keeps 1": ([3, 2], (3,), -1, [np.array([False, True, False]), np.zeros(2, bool)]),
        "mask keeps 0": ([3, 2], (4, 3), -1, [np.zeros((3, 4), bool), np.zeros((2, 4), bool)]),
        "channel 0 kept nowhere": ([2, 3], (3, 4), 1, "channel 0 empty"),
    }
    for name, (sizes, tail, axis, masks) in cases.items():
        xs, dys = oracle.make_inputs(rng, sizes, tail, 3, axis)
        if isinstance(masks, str):
            masks = oracle.make_masks(rng, xs)
            for m in masks:
                m[:, 0] = False
        for eager in (False, True):
            with strategy.scope():
                layer = make_layer(SyncBatchNormalization, 3, len(tail) + 1, rng, axis=axis, momentum=0.6)
            ref = oracle_for(layer, xs, dys, masks=masks)
            got = train_step(strategy, layer, xs, dys, masks, eager=eager)
            info[f"{name}{' eager' if eager else ''}"] = compare(got, ref, layer)

    # fit: the last batch holds one sample for two replicas (1 and 0). It trains; the
    # weights are not compared with one device's, since Keras weighs the replicas'
    # mean losses equally whatever their batch sizes.
    x = rng.standard_normal((9, 4)).astype(np.float32) + 1
    y = rng.standard_normal((9, 1)).astype(np.float32)
    with strategy.scope():
        model = convert(keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                                          keras.layers.Dense(1)]))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["loss"])), history.history
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    info["fit, last batch 1, losses"] = history.history["loss"]
    return info


# --------------------------------------------------------------------------- layer fingerprint


class TwoReplicas:
    """A replica context of 2 replicas in which the other replica sends ``other``'s
    fingerprint and zeros for the values."""

    num_replicas_in_sync = 2
    _replica_id_in_sync_group = 0

    def __init__(self, other):
        self.other = other

    def all_reduce(self, op, value):
        import tensorflow as tf

        from syncbn.core import fingerprint as lf

        size = int(value.shape[0]) - lf.SIZE
        return value + tf.concat([tf.zeros((size,), value.dtype), tf.constant(lf.values(self.other), value.dtype)], 0)


@check
def fingerprint_verdicts():
    """Agreeing tags return the sum; disagreeing ones raise LayerMismatchError eagerly
    (naming both layers), an InvalidArgumentError with the same words in tf.function,
    and under XLA (which compiles the assert away) the sums are all NaN: never finite
    values from a disagreeing call."""
    import tensorflow as tf

    from syncbn.core import fingerprint as lf
    from syncbn.keras import replicas

    mine = lf.Tag(lf.remember("mine", 3), 2)
    theirs = lf.Tag(lf.remember("theirs", 3), 2)
    value = tf.constant([1.0, 2.0, 3.0], tf.float64)
    info = {}
    same = replicas.tf_checked_all_reduce(TwoReplicas(mine), mine, False)
    assert np.array_equal(same(value).numpy(), value.numpy())
    assert np.array_equal(tf.function(same)(value).numpy(), value.numpy())
    assert np.array_equal(tf.function(same, jit_compile=True)(value).numpy(), value.numpy())
    other = replicas.tf_checked_all_reduce(TwoReplicas(theirs), mine, True)
    try:
        other(value)
        raise AssertionError("eager: no error")
    except lf.LayerMismatchError as err:
        info["eager"] = str(err)
    assert "(backward)" in info["eager"], info
    assert "replica 0 called layer 'mine' (3 channels), call 2" in info["eager"], info
    assert "replica 1 called layer 'theirs' (3 channels), call 2" in info["eager"], info
    try:
        tf.function(other)(value)
        raise AssertionError("tf.function: no error")
    except tf.errors.InvalidArgumentError as err:
        info["function"] = str(err).split("\n")[-3:]
    assert "this replica called layer" in " ".join(info["function"]), info
    try:
        got = tf.function(other, jit_compile=True)(value).numpy()
        assert np.all(np.isnan(got)), got
        info["xla"] = "assert compiled away; sums NaN"
    except tf.errors.InvalidArgumentError as err:
        info["xla"] = "raised: " + str(err)[-200:]
    return info


@check
def fingerprint_call_index():
    """In a traced graph the index counts this replica's synchronized calls so far; a new
    graph starts again at 0; eager calls have index 0."""
    import tensorflow as tf

    from syncbn.keras import replicas

    ctx = TwoReplicas(None)
    seen = []

    @tf.function
    def traced():
        seen.append([replicas.tf_tag("a", 3, ctx).index for _ in range(3)])
        return tf.constant(0)

    traced()
    tf.function(lambda: traced.python_function())()
    eager = replicas.tf_tag("a", 3, ctx).index
    assert seen == [[0, 1, 2], [0, 1, 2]] and eager == 0, (seen, eager)
    return {"traced": seen, "eager": eager}



class PairedReplica(TwoReplicas):
    """A replica context of 2 replicas in which the other replica sends the same values
    as this one and, for its fingerprint, this one's (``other`` None: they agree) or
    ``other``'s; the sums are what two such replicas would all-reduce."""

    class strategy:  # tf_sum_dtype looks at the strategy's class name
        pass

    def all_reduce(self, op, value):
        import tensorflow as tf

        from syncbn.core import fingerprint as lf

        if self.other is None:
            return value + value
        size = int(value.shape[0]) - lf.SIZE
        theirs = tf.concat([value[:size], tf.constant(lf.values(self.other), value.dtype)], 0)
        return value + theirs


def xla_run(other, optimizer, steps=1, nested=False):
    """Steps of a Dense + SyncBatchNormalization model compiled by XLA, in the 2-replica
    context of ``PairedReplica(other)`` (``nested``: the layers called in a
    ``tf.function`` of their own inside the step); returns (losses, the state before,
    after, the layer). The state is every weight, optimizer variable and moving
    statistic."""
    import keras
    import tensorflow as tf

    from syncbn.keras import SyncBatchNormalization, replicas

    rng = np.random.default_rng(7)
    keras.utils.set_random_seed(7)
    dense = keras.layers.Dense(3)
    bn = SyncBatchNormalization(momentum=0.5)
    dense.build((None, 4))
    bn.build((None, 3))
    optimizer.build(dense.trainable_variables + bn.trainable_variables)
    x = tf.constant(rng.normal(2.0, 1.5, (6, 4)).astype(np.float32))
    ctx = PairedReplica(other)

    def forward(x):
        return bn(dense(x), training=True)

    forward = tf.function(forward) if nested else forward

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(forward(x) - 1.0))
        weights = dense.trainable_variables + bn.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, weights), weights))
        return loss

    def state():
        return [np.array(v.numpy()) for v in dense.weights + bn.weights + optimizer.variables]

    original = replicas.tf_replica_context
    replicas.tf_replica_context = lambda: ctx
    try:
        before = state()
        losses = [float(step(x)) for _ in range(steps)]
        return losses, before, state(), bn
    finally:
        replicas.tf_replica_context = original


@check
def fingerprint_xla_step():
    """Under XLA (the assert compiled away) a disagreeing step, with the optimizer
    wrapped in SkipMismatchedSteps, changes nothing: every weight, optimizer variable
    (iterations, momentum) and moving statistic keeps its bits; its loss is NaN;
    check_agreement() and the MismatchCheck callback then raise LayerMismatchError
    naming both replicas' layers. An agreeing step trains as without the wrapper."""
    import keras

    from syncbn.core import fingerprint as lf
    from syncbn.keras import MismatchCheck, SkipMismatchedSteps, check_agreement

    info = {}
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    losses, before, after, agreed = xla_run(None, SkipMismatchedSteps(sgd()), steps=2)
    plain_losses, plain_before, plain_after, _ = xla_run(None, sgd(), steps=2)
    assert np.all(np.isfinite(losses)) and losses == plain_losses, (losses, plain_losses)
    for got, ref, start in zip(after, plain_after, before):
        assert np.array_equal(got, ref), (got, ref)
    assert sum(not np.array_equal(a, b) for a, b in zip(after, before)) >= 6, "the agreeing steps moved too little"
    check_agreement(agreed)  # agreeing steps leave no verdict
    info["agree, losses"] = losses

    other = lf.Tag(lf.remember("some_other_layer", 3), 0)
    names = []
    for nested in (True, False):
        losses, before, after, bn = xla_run(other, SkipMismatchedSteps(sgd()), nested=nested)
        names.append(bn.name)
        assert np.isnan(losses[0]), losses
        changed = [i for i, (a, b) in enumerate(zip(after, before)) if not np.array_equal(a, b, equal_nan=False)]
        assert not changed, f"state changed by a disagreeing XLA step (nested={nested}): {changed}"
    callback = MismatchCheck()
    callback.set_model(bn)
    for raise_it in (lambda: check_agreement(bn), lambda: callback.on_train_batch_end(0), check_agreement):
        try:
            raise_it()
            raise AssertionError("no LayerMismatchError after a disagreeing XLA step")
        except lf.LayerMismatchError as err:
            message = str(err)
    assert "(forward)" in message and "(2 disagreeing call(s)" in message, message
    assert any(f"replica 0 called layer '{name}' (3 channels), call 0" in message for name in names), message
    assert "replica 1 called layer 'some_other_layer' (3 channels), call 0" in message, message
    info["disagree, message"] = message
    check_agreement(agreed)  # the verdicts of other layers are not this one's

    # Without the wrapper the moving statistics still keep their bits; the weights do not.
    losses, before, after, bn = xla_run(other, sgd())
    moving = [i for i, w in enumerate(bn.weights) if not w.trainable]
    offset = 2  # the Dense kernel and bias come first
    assert all(np.array_equal(after[offset + i], before[offset + i]) for i in moving), "moving statistics moved"
    assert np.all(np.isnan(after[0])), "the NaN gradients no longer reach a plain optimizer: update the README"
    info["no wrapper"] = "moving statistics unchanged, weights NaN"
    return info


class ApplyInCond:
    """An optimizer's ``apply_gradients`` called inside a ``tf.cond`` branch of the step,
    as hand-written gradient accumulation (``tf.cond(step % k == 0, apply, ...)``) or
    Keras's ``LossScaleOptimizer`` calls its inner optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def build(self, var_list):
        self.optimizer.build(var_list)

    @property
    def variables(self):
        return self.optimizer.variables

    def apply_gradients(self, grads_and_vars):
        import tensorflow as tf

        grads_and_vars = list(grads_and_vars)

        def apply():
            self.optimizer.apply_gradients(grads_and_vars)
            return tf.constant(True)

        tf.cond(tf.constant(True), apply, lambda: tf.constant(False))


@check
def fingerprint_xla_step_applied_in_a_cond():
    """SkipMismatchedSteps applied inside a ``tf.cond`` branch of the XLA step (the
    branch is a graph of its own, nested in the step's, where the verdicts were
    written) still skips a disagreeing step: every weight, optimizer variable and
    moving statistic keeps its bits (its gradients are NaN: applied, they would make
    the weights NaN). An agreeing step trains as without the branch."""
    import keras

    from syncbn.core import fingerprint as lf
    from syncbn.keras import SkipMismatchedSteps, mismatch

    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    losses, before, after, _ = xla_run(None, ApplyInCond(SkipMismatchedSteps(sgd())), steps=2)
    plain_losses, _, plain_after, _ = xla_run(None, sgd(), steps=2)
    assert np.all(np.isfinite(losses)) and losses == plain_losses, (losses, plain_losses)
    for got, ref in zip(after, plain_after):
        assert np.array_equal(got, ref), (got, ref)

    other = lf.Tag(lf.remember("some_other_layer", 3), 0)
    losses, before, after, bn = xla_run(other, ApplyInCond(SkipMismatchedSteps(sgd())))
    mismatch.forget(bn)  # its verdict is not for the checks that read every layer's
    assert np.isnan(losses[0]), losses
    changed = [i for i, (a, b) in enumerate(zip(after, before)) if not np.array_equal(a, b)]
    assert not changed, f"state changed by a disagreeing XLA step applied in a tf.cond: {changed}"
    return {"agree, losses": plain_losses, "disagree": "nothing changed"}


def convnet_training_data(seed):
    """Inputs, labels and the initial weights of :func:`small_convnet` for the fit checks."""
    import keras

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((32, 8, 8, 3)) + [3.0, -1.0, 5.0]).astype(np.float32)
    y = rng.integers(0, 3, 32)
    return x, y, small_convnet(keras.layers.BatchNormalization).get_weights()


def converted_convnet(initial):
    """:func:`small_convnet` with ``initial`` weights, converted (call inside a scope)."""
    import keras

    from syncbn.keras import convert

    model = small_convnet(keras.layers.BatchNormalization)
    model.set_weights(initial)
    return convert(model)


@check
def fingerprint_guard_in_fit():
    """SkipMismatchedSteps and MismatchCheck in model.fit under MirroredStrategy(2)
    (whose optimizer merges in a cross-replica call): the weights and optimizer state
    after agreeing steps are bit for bit those of the plain optimizer, and every
    layer's record holds no disagreement (MismatchCheck reads them after every batch)."""
    import keras

    from syncbn.keras import MismatchCheck, SkipMismatchedSteps

    x, y, initial = convnet_training_data(11)

    def train(guard):
        with mirrored(2).scope():
            model = converted_convnet(initial)
            optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
            model.compile(optimizer=SkipMismatchedSteps(optimizer) if guard else optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[MismatchCheck()] if guard else [])
        return model.get_weights() + [v.numpy() for v in model.optimizer.variables]

    guarded, plain = train(True), train(False)
    assert len(guarded) == len(plain)
    for a, b in zip(guarded, plain):
        assert np.array_equal(a, b), nan_safe.max_abs_diff(a, b)
    iterations = [int(v) for v in guarded if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.integer)]
    assert 4 in iterations, iterations
    return {"steps": 4, "values compared": int(sum(np.size(v) for v in plain))}


@check
def fit_under_a_strategy_keeps_off_xla():
    """Under MirroredStrategy(2), synchronized layers say they do not support XLA, so
    compile(jit_compile=True) falls back to a plain tf.function (where the fingerprint's
    assert stops a disagreeing step) and fit trains exactly as with jit_compile=False;
    outside a strategy the layer keeps Keras's default, and a program can opt in."""
    import warnings

    import keras

    from syncbn.keras import SyncBatchNormalization, allow_xla, convert

    x, y, initial = convnet_training_data(12)

    def train(jit):
        with mirrored(2).scope():
            model = converted_convnet(initial)
            synced = [l for l in all_layers(model) if isinstance(l, SyncBatchNormalization)]
            assert synced and all(l.supports_jit is False for l in synced), synced
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), jit_compile=jit,
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            assert model.jit_compile is False, model.jit_compile
            if jit:
                assert any("jit_compile" in str(w.message) for w in caught), [str(w.message) for w in caught]
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model.get_weights()

    for a, b in zip(train(True), train(False)):
        assert np.array_equal(a, b), nan_safe.max_abs_diff(a, b)

    alone = small_convnet(SyncBatchNormalization)
    assert all(l.supports_jit for l in all_layers(alone))
    alone.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert alone.jit_compile is True
    with mirrored(2).scope():
        opted = convert(small_convnet(keras.layers.BatchNormalization))
        assert allow_xla(opted) == 2
        opted.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert opted.jit_compile is True
    return {"steps": 2}


def record_classes():
    """A Functional subclass (the keras_hub pattern, whose layers ``convert`` retypes in
    place), a subclassed model with its own ``call`` (whose layers a loaded file
    retypes before they are built) and a Functional subclass that normalizes the batch
    axis (which Keras's layer accepts for a fixed batch size and ours refuses)."""
    import keras

    @keras.saving.register_keras_serializable(package="syncbn_tf_records")
    class Trunk(keras.Model):
        def __init__(self, width, **kwargs):
            inputs = keras.Input((4, 3), name="features")
            x = keras.layers.Dense(width, name="dense")(inputs)
            x = keras.layers.BatchNormalization(name="norm_a")(x)
            outputs = keras.layers.BatchNormalization(axis=1, name="norm_b")(x)
            super().__init__(inputs, outputs, **kwargs)
            self.width = width

        def get_config(self):
            return {"width": self.width, "name": self.name}

    @keras.saving.register_keras_serializable(package="syncbn_tf_records")
    class Tower(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(3, name="dense")
            self.norm = keras.layers.BatchNormalization(name="norm")

        def call(self, x, training=None):
            return self.norm(self.dense(x), training=training)

    class BatchAxis(keras.Model):
        def __init__(self, **kwargs):
            inputs = keras.Input(batch_shape=(2, 4, 3))
            super().__init__(inputs, keras.layers.BatchNormalization(axis=0)(inputs), **kwargs)

        def get_config(self):
            return {"name": self.name}

    return Trunk, Tower, BatchAxis


@check
def every_synchronized_layer_keeps_a_verdict_record():
    """Under MirroredStrategy(2), every built SyncBatchNormalization has its verdict
    record (allow_xla and check_agreement find it) and keeps fit off XLA, registered
    exactly once, however it came to be: constructed, swapped in by convert, retyped
    in place by convert (a Functional subclass), and loaded from a .keras file of a
    converted model (a Functional subclass; a subclassed model, whose layers are
    retyped before they are built). A layer retyped in place goes through the build
    checks: a batch norm of the batch axis is refused as SyncBatchNormalization
    refuses it when built."""
    import keras

    from syncbn.keras import SyncBatchNormalization, allow_xla, check_agreement, convert
    from syncbn.keras import layer as layer_module

    Trunk, Tower, BatchAxis = record_classes()
    registered = []  # every layer each time it registers (strong references: ids stay unique)
    original = layer_module.SyncBatchNormalization._register

    def register(self, channels):
        registered.append(self)
        return original(self, channels)

    layer_module.SyncBatchNormalization._register = register
    try:
        rng = np.random.default_rng(40)
        x = rng.normal(1.0, 2.0, (4, 3)).astype(np.float32)
        with mirrored(2).scope(), tempfile.TemporaryDirectory() as tmp:
            models = {
                "constructed": keras.Sequential([keras.Input((3,)), SyncBatchNormalization()]),
                "convert, swapped": convert(keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])),
                "convert, retyped": convert(Trunk(3, name="trunk")),
            }
            tower = Tower(name="tower")
            tower(x)
            models["convert, subclassed"] = convert(tower)
            for where in ("convert, retyped", "convert, subclassed"):
                path = os.path.join(tmp, "model.keras")
                models[where].save(path)
                models[f"loaded, {where}"] = keras.models.load_model(path)
            counts = {}
            for where, model in models.items():
                synced = [l for l in all_layers(model) if isinstance(l, SyncBatchNormalization)]
                assert synced, where
                assert all(l.built and l.supports_jit is False for l in synced), (
                    where, [(l.name, l.built, l.supports_jit) for l in synced])
                times = [sum(r is l for r in registered) for l in synced]
                assert times == [1] * len(synced), f"{where}: registered {times} times"
                assert allow_xla(model) == len(synced), where
                assert all(l.supports_jit is True for l in synced), where
                check_agreement(model)
                counts[where] = len(synced)
    finally:
        layer_module.SyncBatchNormalization._register = original

    try:
        convert(BatchAxis())
        raise AssertionError("convert kept a batch norm of the batch axis")
    except ValueError as err:
        assert "is the batch axis" in str(err), err
    return counts


@check
def fingerprint_guard_saves():
    """A model compiled with SkipMismatchedSteps saves and loads as a .keras file: the
    wrapper and its inner optimizer come back, with the inner optimizer's state (the
    wrapper's saved state is exactly the inner optimizer's)."""
    import keras

    from syncbn.keras import SkipMismatchedSteps, SyncBatchNormalization

    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(SyncBatchNormalization()(inputs)))
    model.compile(optimizer=SkipMismatchedSteps(keras.optimizers.Adam(0.01)), loss="mse")
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "guarded.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is SkipMismatchedSteps, type(loaded.optimizer)
    assert type(loaded.optimizer.inner_optimizer) is keras.optimizers.Adam
    assert [v.path for v in model.optimizer.variables] == [v.path for v in model.optimizer.inner_optimizer.variables]
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert np.array_equal(a.numpy(), b.numpy()), a.path
    assert int(loaded.optimizer.iterations.numpy()) == 2
    return {"optimizer variables": len(model.optimizer.variables)}


if __name__ == "__main__":
    worker_main(CHECKS, setup)
