"""Drop-in conformance of ``SyncBatchNormalization`` with ``keras.layers.BatchNormalization``
on one device, on whichever Keras backend ``KERAS_BACKEND`` names (TensorFlow, JAX or
PyTorch), in one process (torch blocked unless it is the backend).

Every behaviour that Keras's own test file for its layer checks has a check here,
written for this project: the layer contract (weights, regularizer losses, masking
support, config round trip, ``synchronized``), training values against Keras's layer
and the float64 oracle for masks with every channel axis, fully masked inputs and
batches of one value per channel, masked training through ``fit``, ``trainable=False``,
batch renormalization, dtype policies, compiled (XLA / ``jax.jit``) against eager, and
second-order and forward-mode derivatives.

    KERAS_BACKEND=jax python tests/keras_conformance_checks.py --out R.json --checks NAME...
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from keras_harness import block_torch, registry, worker_main
import keras_oracle as oracle

CHECKS, check = registry()


def setup():
    if os.environ.get("KERAS_BACKEND") != "torch":
        block_torch()


def backend():
    import keras

    return keras.backend.backend()


def to_numpy(value):
    import keras

    return np.asarray(keras.ops.convert_to_numpy(value))


def weights(layer):
    return {w.path.split("/")[-1]: to_numpy(w.value).astype(np.float64) for w in layer.weights}


def built(cls, shape, seed, **kwargs):
    """A layer built for ``shape`` with random gamma/beta and moving statistics (the
    same ones for the same seed and configuration, whatever the class)."""
    layer = cls(**kwargs)
    layer.build(shape)
    rng = np.random.default_rng(seed)
    values = []
    for w in layer.weights:
        low = 0.5 if w.path.split("/")[-1] in ("gamma", "moving_variance", "moving_stddev", "renorm_stddev") else -1.0
        values.append(rng.uniform(low, 2.0 if low > 0 else 1.0, w.shape).astype(w.dtype))
    layer.set_weights(values)
    return layer


def train_call(layer, x, dy, mask=None):
    """One training call: output, gradients of ``sum(y * dy)`` (``dx``, ``dgamma``,
    ``dbeta`` for the weights the layer has), as float64 numpy arrays; the layer's
    moving statistics are updated as by an eager call."""
    name = backend()
    names = ["d" + w.path.split("/")[-1] for w in layer.trainable_weights]
    if name == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True, mask=mask)
            loss = tf.reduce_sum(tf.cast(y, tf.float64) * tf.constant(dy, tf.float64))
        grads = tape.gradient(loss, [x] + [v.value for v in layer.trainable_weights])
    elif name == "jax":
        import jax
        import jax.numpy as jnp

        non_trainable = [v.value for v in layer.non_trainable_variables]

        def loss(trainable, x):
            y, updated = layer.stateless_call(trainable, non_trainable, x, training=True, mask=mask)
            return jnp.sum(y.astype(jnp.float64 if y.dtype == jnp.float64 else jnp.float32) * dy), (y, updated)

        (_, (y, updated)), (gw, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            [v.value for v in layer.trainable_variables], jnp.asarray(x))
        for v, value in zip(layer.non_trainable_variables, updated):
            v.assign(value)
        grads = [gx] + list(gw)
    else:
        import torch

        x = torch.tensor(x, requires_grad=True)
        for v in layer.trainable_weights:
            v.value.grad = None
        y = layer(x, training=True, mask=mask)
        (y.double() * torch.tensor(dy, dtype=torch.float64)).sum().backward()
        grads = [x.grad] + [v.value.grad for v in layer.trainable_weights]
    out = {"y": to_numpy(y).astype(np.float64)}
    for key, g in zip(["dx"] + names, grads):
        out[key] = to_numpy(g).astype(np.float64)
    return out


def assert_close(got, want, rtol, atol, what):
    """allclose that fails on NaN or inf in either side."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(want)), (what, got, want)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)
    return float(np.max(np.abs(got - want), initial=0.0))


def keras_mask(rng, shape, kind):
    """A Keras mask for an input of ``shape``: ``inputs.shape[:-1]`` (or broadcastable to
    it), of the kind named."""
    lead = shape[:-1]
    if kind == "random":
        return rng.uniform(size=lead) < 0.6
    if kind == "none kept":
        return np.zeros(lead, bool)
    if kind == "one kept":
        mask = np.zeros(lead, bool)
        mask[(0,) * len(lead)] = True
        return mask
    if kind == "broadcast":  # size 1 on every axis but the second
        return rng.uniform(size=(1, lead[1]) + (1,) * (len(lead) - 2)) < 0.6
    raise ValueError(kind)


# --------------------------------------------------------------------------- checks


@check
def layer_contract():
    """Weights (count, trainable split, with and without center/scale/renorm),
    regularizer losses, masking support, output shape, trainable=False, config round
    trip (our class and Keras's config, ``synchronized`` accepted), renorm argument
    validation and renorm initial standard deviations."""
    import keras

    from syncbn.keras import SyncBatchNormalization as Sync

    info = {}
    for kwargs, trainable, non_trainable, losses in (
        ({}, 2, 2, 0), ({"center": False, "scale": False}, 0, 2, 0), ({"center": False}, 1, 2, 0),
        ({"gamma_regularizer": "l2", "beta_regularizer": "l1"}, 2, 2, 2), ({"renorm": True}, 2, 5, 0),
    ):
        for shape in ((3, 4), (2, 5, 5, 4)):
            layer = Sync(**kwargs)
            y = layer(np.random.default_rng(0).standard_normal(shape).astype("float32") + 3, training=True)
            assert tuple(y.shape) == shape and tuple(layer.compute_output_shape(shape)) == shape
            assert layer.supports_masking
            assert (len(layer.trainable_weights), len(layer.non_trainable_weights)) == (trainable, non_trainable), \
                (kwargs, layer.trainable_weights, layer.non_trainable_weights)
            assert len(layer.losses) == losses, (kwargs, layer.losses)
    # trainable=False: no trainable weights, and training=True runs in inference mode.
    layer = built(Sync, (None, 4, 3), 1, momentum=0.5)
    layer.trainable = False
    assert (len(layer.weights), len(layer.trainable_weights)) == (4, 0)
    x = np.random.default_rng(1).standard_normal((6, 4, 3)).astype("float32") * 3 + 2
    before = weights(layer)
    np.testing.assert_array_equal(to_numpy(layer(x, training=True)), to_numpy(layer(x, training=False)))
    for key, value in weights(layer).items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    layer.trainable = True
    assert len(layer.trainable_weights) == 2
    # Config round trip; Keras's config (with `synchronized`, either value) builds ours.
    for kwargs in ({}, {"renorm": True, "renorm_clipping": {"rmax": 2.5, "rmin": 0.4, "dmax": 3.0},
                        "renorm_momentum": 0.9, "axis": 1, "epsilon": 1e-5, "gamma_regularizer": "l2"}):
        config = Sync(**kwargs).get_config()
        assert Sync.from_config(config).get_config() == config
        keras_config = keras.layers.BatchNormalization(**kwargs).get_config()
        for flag in (False, True):
            keras_config["synchronized"] = flag
            assert Sync.from_config(keras_config).get_config() == config | {"name": keras_config["name"]}
        restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(Sync(**kwargs)))
        assert type(restored) is Sync
    # Renorm arguments checked as Keras checks them.
    for clipping, text in (({"other": 1.0}, "invalid keys"), ({"rmax": 0.5, "rmin": 1.0}, "rmax should be"),
                           ({"dmax": -1.0}, "dmax should be non-negative")):
        try:
            Sync(renorm=True, renorm_clipping=clipping)
        except ValueError as err:
            assert text in str(err), str(err)
        else:
            raise AssertionError(f"no ValueError for renorm_clipping={clipping}")
    layer = Sync(renorm=True, moving_variance_initializer=keras.initializers.Constant(9.0))
    layer.build((None, 3))
    for name in ("moving_stddev", "renorm_stddev"):
        assert_close(weights(layer)[name], np.full(3, 3.0), 0, 1e-6, name)
    return info


@check
def training_matches_keras_and_oracle():
    """Training calls with channel axes -1, 1 and 2, masks of Keras's shape
    (``inputs.shape[:-1]``: random, broadcast, keeping one element or none), batches of
    one sample, center/scale off and renorm: output, input and weight gradients and
    moving statistics equal those of ``keras.layers.BatchNormalization`` with the same
    weights, and (without renorm) the float64 oracle. (Against Keras the tolerance is
    1e-3: on the JAX and torch backends Keras computes the variance as
    ``E[x^2] - E[x]^2`` in float32, whose error reaches 1e-4 relative on three values
    per channel; against the oracle it is the usual 2e-5.)"""
    import keras

    from syncbn.keras import SyncBatchNormalization as Sync

    rng = np.random.default_rng(2)
    cases = [((5, 2, 3), -1, mask, {}) for mask in (None, "random", "none kept")]
    cases += [((5, 2, 3), 1, mask, {}) for mask in ("random", "one kept", "none kept")]
    cases += [((5, 3, 3, 2), 1, "random", {}), ((5, 3, 3, 2), 2, "broadcast", {}), ((5, 3, 3, 2), -1, "broadcast", {})]
    cases += [((1, 3), -1, None, {}), ((1, 4, 3), 1, None, {}), ((4, 3, 2), 1, "random", {"center": False}),
              ((4, 3, 2), -1, None, {"scale": False, "center": False}), ((7, 3), -1, None, {"renorm": True}),
              ((4, 3, 2), 1, "random", {"renorm": True, "renorm_clipping": {"rmax": 1.2, "dmax": 0.3}})]
    worst = {"keras": 0.0, "oracle": 0.0}
    for i, (shape, axis, mask_kind, kwargs) in enumerate(cases):
        channels = shape[axis]
        x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        mask = None if mask_kind is None else keras_mask(rng, shape, mask_kind)
        results = []
        for cls in (keras.layers.BatchNormalization, Sync):
            layer = built(cls, tuple(None if d != axis % len(shape) else channels for d in range(len(shape))),
                          i, axis=axis, momentum=0.7, **kwargs)
            initial = weights(layer)
            results.append((train_call(layer, x, dy, mask), weights(layer)))
        (theirs, theirs_w), (ours, ours_w) = results
        what = f"shape {shape} axis {axis} mask {mask_kind} {kwargs}"
        for key in theirs:
            worst["keras"] = max(worst["keras"], assert_close(ours[key], theirs[key], 1e-3, 1e-3, f"{what} {key}"))
        for key in theirs_w:
            assert_close(ours_w[key], theirs_w[key], 1e-4, 1e-4, f"{what} {key}")
        if kwargs.get("renorm"):
            continue
        full_mask = None if mask is None else np.broadcast_to(mask, shape[:-1])
        ref = oracle.batch_norm([x], [dy], axis=axis, gamma=initial.get("gamma"), beta=initial.get("beta"),
                                momentum=0.7, moving_mean=initial["moving_mean"],
                                moving_var=initial["moving_variance"],
                                masks=None if full_mask is None else [full_mask])
        for key in ("y", "dx", "dgamma", "dbeta"):
            if key in ours:
                want = ref[key][0] if key in ("y", "dx") else ref[key]
                worst["oracle"] = max(worst["oracle"], assert_close(ours[key], want, 2e-5, 2e-5, f"{what} {key}"))
        assert_close(ours_w["moving_mean"], ref["moving_mean"], 1e-5, 1e-6, f"{what} moving_mean")
        assert_close(ours_w["moving_variance"], ref["moving_var"], 1e-5, 1e-6, f"{what} moving_variance")
    return {"cases": len(cases), "max_abs_difference": worst}


@check
def fully_masked_input():
    """A fully masked input in training gives what Keras gives: no error, mean 0 and
    variance 0 for the statistics (so a zero input stays zero, any other is scaled by
    1 / sqrt(eps)), moving statistics pulled toward them."""
    from syncbn.keras import SyncBatchNormalization as Sync

    layer = Sync(center=False, scale=False, momentum=0.5)
    y = layer(np.zeros((4, 5), np.float32), mask=np.zeros(4, np.float32), training=True)
    np.testing.assert_array_equal(to_numpy(y), np.zeros((4, 5)))
    assert_close(weights(layer)["moving_mean"], np.zeros(5), 0, 0, "moving_mean")
    assert_close(weights(layer)["moving_variance"], np.full(5, 0.5), 0, 1e-7, "moving_variance")
    x = np.full((3, 2, 4), 2.0, np.float32)
    y = Sync(center=False, scale=False)(x, mask=np.zeros((3, 2)), training=True)
    assert_close(to_numpy(y), x / np.sqrt(1e-3), 1e-6, 0, "scaled")
    return {}


@check
def fit_ignores_masked_values():
    """Padded sequences behind ``keras.layers.Masking`` train the statistics of the kept
    steps only, through ``fit`` (compiled and eager), whatever the padding value."""
    import keras

    from syncbn.keras import SyncBatchNormalization as Sync

    info = {}
    for run_eagerly in (False, True):
        for pad in (0.0, 0.5, 3.0):
            data = np.array([[[2.0, -1.0], [4.0, -1.0], [pad, pad], [pad, pad], [pad, pad]]] * 8, np.float32)
            inputs = keras.Input((None, 2))
            outputs = Sync(momentum=0.0)(keras.layers.Masking(mask_value=pad)(inputs))
            model = keras.Model(inputs, outputs)
            model.compile("rmsprop", loss="mse", run_eagerly=run_eagerly)
            model.fit(data, data, batch_size=8, epochs=3, verbose=0)
            w = weights(model.layers[2])
            assert_close(w["moving_mean"], [3.0, -1.0], 0, 1e-5, "moving_mean")
            assert_close(w["moving_variance"], [1.0, 0.0], 0, 1e-5, "moving_variance")
            info[f"eager={run_eagerly} pad={pad}"] = w["moving_variance"].tolist()
    return info


@check
def masked_broadcast_and_degenerate():
    """A mask of shape (1, 2, 1) on a (1, 2, 3, 4) input broadcasts as in Keras; a
    constant batch normalizes to beta with variance 0; a batch of one sample trains
    (variance 0, output beta)."""
    from syncbn.keras import SyncBatchNormalization as Sync

    layer = Sync(momentum=0.0)
    y = layer(np.full((1, 2, 3, 4), 7.0, np.float32), mask=np.ones((1, 2, 1)), training=True)
    np.testing.assert_array_equal(to_numpy(y), np.zeros((1, 2, 3, 4)))
    assert_close(weights(layer)["moving_mean"], np.full(4, 7.0), 0, 0, "moving_mean")
    assert_close(weights(layer)["moving_variance"], np.zeros(4), 0, 0, "moving_variance")
    layer = built(Sync, (None, 3), 4)
    beta = weights(layer)["beta"]
    y = layer(np.array([[1.5, -20.0, 300.0]], np.float32), training=True)
    assert_close(to_numpy(y)[0], beta, 0, 1e-6, "batch of one")
    return {}


@check
def trainable_false_then_true():
    """Frozen, training=True returns the input unchanged for default weights; unfrozen,
    repeated training calls normalize to mean 0, std 1 per channel."""
    from syncbn.keras import SyncBatchNormalization as Sync

    layer = Sync(momentum=0.8, epsilon=1e-7)
    layer.build((None, 4, 4, 3))
    layer.trainable = False
    x = (np.random.default_rng(5).standard_normal((64, 4, 4, 3)) * 4 - 3).astype(np.float32)
    assert_close(to_numpy(layer(x, training=True)), x, 0, 1e-5, "frozen")
    layer.trainable = True
    for _ in range(3):
        y = to_numpy(layer(x, training=True)).astype(np.float64)
    assert_close(y.mean((0, 1, 2)), np.zeros(3), 0, 1e-4, "mean")
    assert_close(y.std((0, 1, 2)), np.ones(3), 0, 1e-4, "std")
    return {}


@check
def integer_and_boolean_inputs():
    """Integer and boolean inputs (uint8 pixels, 0/1 flags) are accepted as Keras's
    layer accepts them: normalized in float32, in training and in inference, with the
    output and moving statistics of ``keras.layers.BatchNormalization`` on the same
    values; a complex input is refused with a TypeError naming its dtype."""
    import keras

    from syncbn.keras import SyncBatchNormalization as Sync

    rng = np.random.default_rng(11)
    info = {}
    for dtype in ("uint8", "int32", "int64", "bool"):
        x = rng.integers(0, 2 if dtype == "bool" else 200, (6, 4, 3)).astype(dtype)
        outs = []
        for cls in (keras.layers.BatchNormalization, Sync):
            layer = built(cls, (None, 4, 3), 12, momentum=0.6)
            trained = layer(x, training=True)
            inferred = layer(x, training=False)
            dtypes = {keras.backend.standardize_dtype(y.dtype) for y in (trained, inferred)}
            assert dtypes == {"float32"}, (cls.__name__, dtype, dtypes)
            outs.append((to_numpy(trained), to_numpy(inferred), weights(layer)))
        (keras_train, keras_infer, keras_w), (train, infer, w) = outs
        info[dtype] = assert_close(train, keras_train, 1e-4, 1e-4, f"{dtype} training")
        assert_close(infer, keras_infer, 1e-5, 1e-5, f"{dtype} inference")
        for key in keras_w:
            assert_close(w[key], keras_w[key], 1e-5, 1e-5, f"{dtype} {key}")
    try:
        Sync()(np.ones((2, 3), np.complex64), training=True)
    except TypeError as err:
        assert "complex64" in str(err), str(err)
    else:
        raise AssertionError("a complex input was accepted")
    return info


@check
def renorm_matches_formula_and_inference():
    """Batch renormalization: output and every moving statistic follow Ioffe's formulas
    with Keras's conventions (float64 oracle); inference equals the plain layer's."""
    from syncbn.keras import SyncBatchNormalization as Sync

    rng = np.random.default_rng(6)
    layer = built(Sync, (None, 3), 6, renorm=True, momentum=0.9, renorm_momentum=0.8)
    w = weights(layer)
    x = (rng.standard_normal((5, 3)) * 2 + 1).astype(np.float32)
    dy = rng.standard_normal((5, 3)).astype(np.float32)
    got = train_call(layer, x, dy)
    ref = oracle.batch_norm([x], [dy], gamma=w["gamma"], beta=w["beta"], momentum=0.9,
                            moving_mean=w["moving_mean"], moving_var=w["moving_variance"],
                            renorm=dict(renorm_mean=w["renorm_mean"], renorm_std=w["renorm_stddev"],
                                        moving_std=w["moving_stddev"], renorm_momentum=0.8))
    assert_close(got["y"], ref["y"][0], 2e-5, 2e-5, "y")
    after = weights(layer)
    for key, name in (("moving_mean", "moving_mean"), ("moving_var", "moving_variance"),
                      ("renorm_mean", "renorm_mean"), ("renorm_std", "renorm_stddev"), ("moving_std", "moving_stddev")):
        assert_close(after[name], ref[key], 1e-5, 1e-6, name)
    plain = Sync()
    plain.build((None, 3))
    plain.set_weights([layer.get_weights()[i] for i in range(4)])
    np.testing.assert_allclose(to_numpy(plain(x, training=False)), to_numpy(layer(x, training=False)),
                               rtol=1e-6, atol=1e-6)
    return {}


@check
def dtype_policies():
    """mixed_float16 and mixed_bfloat16: float32 variables, output in the compute dtype,
    the same values as Keras's layer under the same policy; a moving variance of 70000
    stays exact inside a float16 autocast scope."""
    import keras

    from syncbn.keras import SyncBatchNormalization as Sync

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 5, 3)) * 2 + 4).astype(np.float32)
    dy = rng.standard_normal((6, 5, 3)).astype(np.float32)
    mask = rng.uniform(size=(6, 5)) < 0.7
    info = {}
    for policy, tol in (("mixed_float16", 1e-2), ("mixed_bfloat16", 5e-2)):
        keras.config.set_dtype_policy(policy)
        try:
            outs = []
            for cls in (keras.layers.BatchNormalization, Sync):
                layer = built(cls, (None, 5, 3), 7, momentum=0.5)
                assert all(w.dtype == "float32" for w in layer.weights)
                out = train_call(layer, x, dy, mask)
                assert keras.backend.standardize_dtype(layer(x, training=True).dtype) == policy[6:]
                outs.append((out, weights(layer)))
        finally:
            keras.config.set_dtype_policy("float32")
        (theirs, theirs_w), (ours, ours_w) = outs
        info[policy] = {key: assert_close(ours[key], theirs[key], tol, tol, f"{policy} {key}") for key in theirs}
        for key in theirs_w:
            assert_close(ours_w[key], theirs_w[key], tol, tol, f"{policy} {key}")
    layer = Sync()
    layer.build((1, 4, 4, 3))
    with keras.src.backend.AutocastScope("float16"):
        layer.moving_variance.assign(keras.ops.full((3,), 70000.0))
        assert_close(to_numpy(layer.moving_variance.value), np.full(3, 70000.0), 0, 0, "autocast")
    return info


@check
def compiled_matches_eager():
    """Training compiled by XLA (TensorFlow ``jit_compile=True``, ``jax.jit``) gives the
    eager values, masked and unmasked, including a batch of one sample and a fully
    masked batch; ``fit`` with ``jit_compile=True`` trains as eager ``fit`` does."""
    import keras

    from syncbn.keras import SyncBatchNormalization as Sync

    name = backend()
    if name == "torch":
        return {"skipped": "no XLA on the torch backend"}
    rng = np.random.default_rng(8)
    info = {}
    for shape, axis, mask_kind in (((6, 4, 3), -1, None), ((6, 4, 3), 1, "random"), ((1, 3), -1, None),
                                   ((5, 4, 3), -1, "none kept"), ((5, 4, 3), -1, "one kept")):
        x = (rng.standard_normal(shape) * 3 + 100).astype(np.float32)
        mask = None if mask_kind is None else keras_mask(rng, shape, mask_kind)
        eager = built(Sync, shape, 9, axis=axis, momentum=0.5)
        compiled = built(Sync, shape, 9, axis=axis, momentum=0.5)
        y_eager = to_numpy(eager(x, training=True, mask=mask))
        if name == "tensorflow":
            import tensorflow as tf

            step = tf.function(lambda x, m: compiled(x, training=True, mask=m), jit_compile=True)
            y = to_numpy(step(tf.constant(x), None if mask is None else tf.constant(mask)))
        else:
            import jax

            def step(trainable, non_trainable, x, m):
                return compiled.stateless_call(trainable, non_trainable, x, training=True, mask=m)

            y, updated = jax.jit(step)([v.value for v in compiled.trainable_variables],
                                       [v.value for v in compiled.non_trainable_variables], x, mask)
            for v, value in zip(compiled.non_trainable_variables, updated):
                v.assign(value)
            y = to_numpy(y)
        what = f"{shape} axis {axis} mask {mask_kind}"
        info[what] = assert_close(y, y_eager, 1e-5, 1e-5, what)
        for key, value in weights(eager).items():
            assert_close(weights(compiled)[key], value, 1e-6, 1e-6, f"{what} {key}")
    # fit with jit_compile=True, last batch of one sample.
    data = (rng.standard_normal((9, 4)) + 2).astype(np.float32)
    target = rng.standard_normal((9, 2)).astype(np.float32)
    results = []
    for jit in (True, False):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), Sync(), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.05), "mse", jit_compile=jit, run_eagerly=not jit)
        history = model.fit(data, target, batch_size=4, epochs=2, shuffle=False, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))
        results.append(model.get_weights())
    info["fit jit vs eager"] = max(assert_close(a, b, 1e-4, 1e-5, "fit weights") for a, b in zip(*results))
    return info


def penalty_gradient(forward, x, jit=False):
    """The gradient with respect to ``x`` of a gradient penalty through ``forward`` (a
    training call), ``sum(g^2)`` with ``g`` the gradient of ``sum(y^3)``: a second
    derivative, as float64 numpy; ``jit``: traced (``tf.function``) / ``jax.jit``."""
    name = backend()
    if name == "tensorflow":
        import tensorflow as tf

        def run(x):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    loss = tf.reduce_sum(forward(x) ** 3)
                penalty = tf.reduce_sum(inner.gradient(loss, x) ** 2)
            return outer.gradient(penalty, x)

        return to_numpy((tf.function(run) if jit else run)(tf.constant(x)))
    if name == "jax":
        import jax
        import jax.numpy as jnp

        def loss(x):
            return jnp.sum(forward(x) ** 3)

        penalty = jax.grad(lambda x: jnp.sum(jax.grad(loss)(x) ** 2))
        return to_numpy((jax.jit(penalty) if jit else penalty)(jnp.asarray(x)))
    import torch

    xt = torch.tensor(x, requires_grad=True)
    (g,) = torch.autograd.grad((forward(xt) ** 3).sum(), xt, create_graph=True)
    (h,) = torch.autograd.grad((g ** 2).sum(), xt)
    return to_numpy(h)


def training_forward(layer, mask):
    """``x -> y`` of a training call of ``layer``, differentiable on every backend (on
    JAX a stateless call with the layer's current weights)."""
    if backend() != "jax":
        return lambda x: layer(x, training=True, mask=mask)
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]
    return lambda x: layer.stateless_call(trainable, non_trainable, x, training=True, mask=mask)[0]


def formula_forward(layer, mask):
    """``x -> y`` of batch norm in training written out in ``keras.ops`` (masked mean and
    biased variance over the counted elements, no epsilon added to the counts, as
    Keras's own layer adds), differentiated by the backend's own autodiff: the oracle
    for second derivatives."""
    import keras
    from keras import ops

    gamma, beta = (ops.convert_to_tensor(w.value) for w in (layer.gamma, layer.beta))

    def forward(x):
        ndim, axis = len(x.shape), layer.axis % len(x.shape)
        axes = [i for i in range(ndim) if i != axis]
        shape = [1] * ndim
        shape[axis] = x.shape[axis]
        w = ops.ones_like(x) if mask is None else ops.broadcast_to(
            ops.expand_dims(ops.cast(mask, x.dtype), -1), ops.shape(x))
        n = ops.sum(w, axis=axes, keepdims=True)
        mean = ops.sum(w * x, axis=axes, keepdims=True) / n
        var = ops.sum(w * ops.square(x - mean), axis=axes, keepdims=True) / n
        return (x - mean) / ops.sqrt(var + layer.epsilon) * ops.reshape(gamma, shape) + ops.reshape(beta, shape)

    del keras
    return forward


def closed_form_forward(layer, mask):
    """``x -> y`` of the closed form that a training call of ``layer`` runs on one device
    (:func:`syncbn.keras.moments.train_normalize`), with the layer's gamma and beta, in
    ``x``'s own dtype. Keras normalizes float64 inputs in float32 on the JAX backend (its
    ``result_type`` maps 64-bit dtypes to 32-bit ones there whatever ``jax_enable_x64``
    says), so the layer, as Keras's, never computes in float64 there: this runs the same
    closed form (and its JVP rule) in float64."""
    from keras import ops

    from syncbn.keras import moments

    gamma, beta = (ops.convert_to_tensor(w.value) for w in (layer.gamma, layer.beta))

    def forward(x):
        kept = moments.element_mask(None if mask is None else ops.convert_to_tensor(mask), x)
        return moments.train_normalize(x, layer.axis, kept, gamma, beta, layer.epsilon)[0]

    return forward


def layer_computes_float64():
    """Whether Keras normalizes float64 inputs in float64 on this backend (TensorFlow):
    on JAX and PyTorch its ``result_type`` maps them to float32."""
    import keras

    return keras.backend.result_type("float64", "float32") == "float64"


@contextlib.contextmanager
def float64_enabled():
    """JAX computes in float32 unless x64 is enabled: enabled for the block only."""
    if backend() != "jax":
        yield
        return
    import jax

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


@check
def second_order_gradients():
    """A gradient of a gradient through a training call (a gradient penalty) is exact on
    every backend, eager and compiled, masked and not: it equals that of Keras's own
    layer (unmasked; masked, Keras adds 1e-7 to its counts) and that of the batch-norm
    formula differentiated by the backend's autodiff (in float64). Float64 layers and
    inputs: where Keras computes them in float64 (TensorFlow), the values differ by
    rounding alone (about 1e-16 relative per operation, a few hundred operations,
    amplified at most 1e3 by cancellation): 1e-9 of the largest value. Where Keras
    normalizes float64 inputs in float32 (its JAX backend, even with x64, and its PyTorch
    backend), 6e-8 per operation, so 1e-4; on JAX the same closed form and JVP rule, run
    in float64 outside the layer (:func:`closed_form_forward`), must then match the
    formula to 1e-9. A second derivative that misses a term is off by O(1), one that
    adds 1e-7 to a count (as Keras's layer does) by about 1e-7."""
    import keras

    from syncbn.keras import SyncBatchNormalization as Sync

    rng = np.random.default_rng(9)
    info = {}
    with float64_enabled():
        rtol = 1e-9 if layer_computes_float64() else 1e-4
        info["rtol"] = rtol
        for shape, axis, mask_kind in (((6, 3), -1, None), ((5, 4, 3), 1, "random"), ((3, 4, 2, 3), -1, None),
                                       ((4, 5, 3), -1, "random")):
            x = rng.standard_normal(shape) * 2 + 1
            mask = None if mask_kind is None else keras_mask(rng, shape, mask_kind)
            for jit in ((False,) if backend() == "torch" else (False, True)):
                what = f"{shape} axis {axis} mask {mask_kind} {'compiled' if jit else 'eager'}"
                layers = {cls: built(cls, shape, 9, axis=axis, dtype="float64")
                          for cls in (Sync, keras.layers.BatchNormalization)}
                got = penalty_gradient(training_forward(layers[Sync], mask), x, jit)
                wants = {"formula": penalty_gradient(formula_forward(layers[Sync], mask), x, jit)}
                if mask is None:
                    wants["keras"] = penalty_gradient(training_forward(layers[keras.layers.BatchNormalization], mask),
                                                      x, jit)
                for who, want in wants.items():
                    assert np.max(np.abs(want)) > 1e-3, (what, "a penalty gradient this small proves nothing")
                    info[f"{what} vs {who}"] = assert_close(got, want, rtol, rtol * np.max(np.abs(want)), what)
                if backend() == "jax" and not layer_computes_float64():
                    want = wants["formula"]
                    closed = penalty_gradient(closed_form_forward(layers[Sync], mask), x, jit)
                    info[f"{what} float64 closed form vs formula"] = assert_close(
                        closed, want, 1e-9, 1e-9 * np.max(np.abs(want)), f"{what} float64 closed form")
    return info


def forward_derivative(forward, x, t, jit=False, hvp=False):
    """The forward-mode derivative of a training call ``forward`` at ``x`` along ``t``,
    as float64 numpy: the output's tangent (TensorFlow's ``ForwardAccumulator``, JAX's
    ``jax.jvp``, PyTorch's dual tensors); with ``hvp`` (JAX), the Hessian-vector product
    of ``sum(y^3)``, ``jax.jvp`` of ``jax.grad`` (forward over reverse). ``jit``: traced
    (``tf.function``) / ``jax.jit``."""
    name = backend()
    if name == "tensorflow":
        import tensorflow as tf

        def run(x, t):
            with tf.autodiff.ForwardAccumulator(x, t) as acc:
                y = forward(x)
            return acc.jvp(y)

        return to_numpy((tf.function(run) if jit else run)(tf.constant(x), tf.constant(t)))
    if name == "jax":
        import jax
        import jax.numpy as jnp

        f = jax.grad(lambda x: jnp.sum(forward(x) ** 3)) if hvp else forward
        run = lambda x, t: jax.jvp(f, (x,), (t,))[1]  # noqa: E731
        return to_numpy((jax.jit(run) if jit else run)(jnp.asarray(x), jnp.asarray(t)))
    import torch
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        y = forward(fwAD.make_dual(torch.tensor(x), torch.tensor(t)))
        return to_numpy(fwAD.unpack_dual(y).tangent)


@check
def forward_mode_derivatives():
    """Forward-mode derivatives of a training call exist and are exact on every backend,
    as with Keras's own layer (on JAX a custom VJP would refuse them: ``jax.jvp``,
    ``jax.jacfwd``, ``jax.hessian``): the output's tangent, eager and compiled, masked
    and not, and on JAX a Hessian-vector product (``jax.jvp`` of ``jax.grad``), equal
    those of Keras's layer (unmasked; masked, Keras adds 1e-7 to its counts) and of the
    batch-norm formula differentiated by the backend (in float64). Tolerances as in
    :func:`second_order_gradients` (a first derivative and a Hessian-vector product take
    fewer operations than a penalty's gradient), on JAX with the float64 closed form and
    JVP rule held to 1e-9 besides; a derivative that misses a term (the statistics' own)
    is off by O(1)."""
    import keras

    from syncbn.keras import SyncBatchNormalization as Sync

    rng = np.random.default_rng(13)
    info = {}
    with float64_enabled():
        rtol = 1e-9 if layer_computes_float64() else 1e-4
        info["rtol"] = rtol
        for shape, axis, mask_kind in (((6, 3), -1, None), ((5, 4, 3), 1, "random"), ((4, 5, 3), -1, "random")):
            x = rng.standard_normal(shape) * 2 + 1
            t = rng.standard_normal(shape)
            mask = None if mask_kind is None else keras_mask(rng, shape, mask_kind)
            layers = {cls: built(cls, shape, 13, axis=axis, dtype="float64")
                      for cls in (Sync, keras.layers.BatchNormalization)}
            for jit in ((False,) if backend() == "torch" else (False, True)):
                for hvp in ((False, True) if backend() == "jax" else (False,)):
                    what = (f"{shape} axis {axis} mask {mask_kind} {'compiled' if jit else 'eager'}"
                            f"{' hvp' if hvp else ''}")
                    got = forward_derivative(training_forward(layers[Sync], mask), x, t, jit, hvp)
                    wants = {"formula": forward_derivative(formula_forward(layers[Sync], mask), x, t, jit, hvp)}
                    if mask is None:
                        keras_forward = training_forward(layers[keras.layers.BatchNormalization], mask)
                        wants["keras"] = forward_derivative(keras_forward, x, t, jit, hvp)
                    for who, want in wants.items():
                        assert np.max(np.abs(want)) > 1e-3, (what, "a derivative this small proves nothing")
                        info[f"{what} vs {who}"] = assert_close(got, want, rtol, rtol * np.max(np.abs(want)), what)
                    if backend() == "jax" and not layer_computes_float64():
                        want = wants["formula"]
                        closed = forward_derivative(closed_form_forward(layers[Sync], mask), x, t, jit, hvp)
                        info[f"{what} float64 closed form vs formula"] = assert_close(
                            closed, want, 1e-9, 1e-9 * np.max(np.abs(want)), f"{what} float64 closed form")
    return info


if __name__ == "__main__":
    worker_main(CHECKS, setup)
