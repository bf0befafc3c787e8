"""JAX-backend checks of ``syncbn.keras``, in one process with 4 host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``) and torch blocked.

Under ``keras.distribution.DataParallel`` the batch is one array sharded over the
devices, so the layer's reductions are global and XLA inserts the cross-device sums.
These checks verify that rather than assume it: the input really is split over the
devices, the compiled step really contains all-reduces, and the results equal the
float64 oracle on the whole batch.

    python tests/keras_jax_checks.py --out R.json --checks NAME...
"""

from __future__ import annotations

import os
import re

import numpy as np

from keras_harness import block_torch, registry, worker_main
import keras_oracle as oracle
import nan_safe

DEVICES = 4
CHECKS, check = registry()


def setup():
    block_torch()
    os.environ["KERAS_BACKEND"] = "jax"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    import jax

    assert len(jax.devices()) >= DEVICES, jax.devices()


def data_parallel(devices):
    import jax
    import keras

    return keras.distribution.DataParallel(devices=jax.devices()[:devices])


@check
def dataparallel_layer_matches_oracle():
    """One training call under DataParallel over 2 and 4 devices, with per-device data
    of different means and a mask that keeps a different number of elements on each
    device: outputs, input and gamma/beta gradients and moving statistics equal the
    float64 oracle on the whole batch."""
    import jax
    import jax.numpy as jnp
    import keras

    from syncbn.keras import SyncBatchNormalization

    info = {}
    for devices in (2, 4):
        rng = np.random.default_rng(devices)
        distribution = data_parallel(devices)
        per_device = 3
        channels = 3
        # variant -> (channel axis, masked); a Keras mask covers inputs.shape[:-1]
        for variant, (axis, use_mask) in {"plain": (-1, False), "masked": (-1, True),
                                          "masked, channels first": (1, True)}.items():
            tail = (4, channels) if axis == -1 else (channels, 4)
            # Each device's slice has its own offset: local statistics would be far off.
            xs, dys = [], []
            for d in range(devices):
                x, dy = oracle.make_inputs(rng, [per_device], tail, channels, axis,
                                           offset=rng.uniform(-10, 10, channels))
                xs += x
                dys += dy
            masks = [oracle.make_masks(rng, [x], keep=0.25 + 0.2 * d)[0] for d, x in enumerate(xs)]
            masks[0][:] = False  # a device that keeps nothing
            if axis == 1:
                for m in masks:
                    m[:, 1] = False  # a channel that no device counts
            with distribution.scope():
                layer = SyncBatchNormalization(axis=axis, momentum=0.9)
                layer.build((None,) + tail)
                layer.set_weights([rng.uniform(0.5, 2, channels), rng.uniform(-1, 1, channels),
                                   rng.uniform(-1, 1, channels), rng.uniform(0.5, 2, channels)])
            initial = [np.asarray(w) for w in layer.get_weights()]
            layout = distribution.get_data_layout((devices * per_device,) + tail).backend_layout
            x = jax.device_put(np.concatenate(xs), layout)
            dy = jax.device_put(np.concatenate(dys), layout)
            mask_layout = distribution.get_data_layout((devices * per_device, tail[0])).backend_layout
            mask = jax.device_put(np.concatenate(masks), mask_layout) if use_mask else None
            assert len(x.sharding.device_set) == devices, x.sharding

            def loss(trainable, x, dy, mask, non_trainable):
                y, non_trainable = layer.stateless_call(trainable, non_trainable, x, training=True, mask=mask)
                return jnp.sum(y * dy), (y, non_trainable)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
            args = ([v.value for v in layer.trainable_variables], x, dy, mask,
                    [v.value for v in layer.non_trainable_variables])
            hlo = step.lower(*args).compile().as_text()
            all_reduces = len(re.findall(r"\ball-reduce(?:-start)?\(", hlo))
            assert all_reduces >= 1, "no cross-device reduction in the compiled step"
            (_, (y, moving)), (grads, dx) = step(*args)

            ref = oracle.batch_norm(
                xs, dys, axis=axis, gamma=initial[0], beta=initial[1], momentum=0.9, moving_mean=initial[2],
                moving_var=initial[3], masks=masks if use_mask else None)
            for got, want, tol, what in (
                (y, np.concatenate(ref["y"]), 2e-5, "y"), (dx, np.concatenate(ref["dx"]), 2e-5, "dx"),
                (grads[0], ref["dgamma"], 2e-5, "dgamma"), (grads[1], ref["dbeta"], 2e-5, "dbeta"),
                (moving[0], ref["moving_mean"], 1e-5, "moving_mean"), (moving[1], ref["moving_var"], 1e-5, "moving_var"),
            ):
                got = np.asarray(got, np.float64)
                assert np.all(np.isfinite(got)), (variant, what)
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{devices} {variant} {what}")
            # Each device alone would have seen very different statistics.
            local_mean = np.asarray(xs[1], np.float64).reshape(-1, channels).mean(0) if axis == -1 else \
                np.moveaxis(np.asarray(xs[1], np.float64), 1, -1).reshape(-1, channels).mean(0)
            assert np.max(np.abs(local_mean - ref["mean"])) > 0.1
            info[f"{devices} devices, {variant}"] = {"all_reduce_ops_in_compiled_step": all_reduces}
    return info


def small_convnet(seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3)(x)
    return keras.Model(inputs, outputs)


@check
def fit_dataparallel_matches_single_device():
    """model.fit with convert() under DataParallel over 4 devices ends with the weights
    of the same model trained without distribution on the same batches."""
    import keras

    from syncbn.keras import convert

    rng = np.random.default_rng(20)
    # Sorted by offset, so each device's shard of a batch has its own statistics.
    x = (rng.standard_normal((64, 8, 8, 3)) + np.repeat(np.arange(4.0), 16)[:, None, None, None] * 2)
    x = x.astype(np.float32)
    y = rng.integers(0, 3, 64)
    initial = small_convnet().get_weights()

    def train(distribution):
        keras.distribution.set_distribution(distribution)
        try:
            model = convert(small_convnet())
            model.set_weights(initial)
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
            return [np.asarray(w) for w in model.get_weights()]
        finally:
            keras.distribution.set_distribution(None)

    single = train(None)
    parallel = train(data_parallel(4))
    diff = nan_safe.worst(nan_safe.max_abs_diff(a, b) for a, b in zip(single, parallel))
    assert diff < 1e-4, diff
    return {"steps": 8, "max_weight_difference": diff}


@check
def numerics():
    """Variance at |mean| / std = 1e3 on the JAX backend (ours; Keras's BN alongside)."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(21)
    x = (rng.standard_normal((256, 16, 4)) + 1000.0).astype(np.float32)
    reference = x.astype(np.float64).reshape(-1, 4).var(0)
    info = {}
    for name, cls in (("syncbn", SyncBatchNormalization), ("keras", keras.layers.BatchNormalization)):
        layer = cls(momentum=0.0)
        layer(x, training=True)
        info[name] = oracle.variance_relative_error(np.asarray(layer.moving_variance.value), reference)
    assert info["syncbn"] <= 1e-5, info
    return {"variance_relative_error_at_ratio_1e3": info}


@check
def degenerate_batches():
    """At most one value per channel, or none, in training: no error, eagerly and under
    jit, and the values of Keras's layer (variance 0, output beta; a fully masked batch
    has mean 0 and variance 0), against the float64 oracle, counts included."""
    import jax
    import jax.numpy as jnp

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(22)
    info = {}
    for name, shape, mask in (("batch 1", (1, 3), None), ("mask keeps 1", (4, 2, 3), "one"),
                              ("mask keeps 0", (4, 2, 3), "none"), ("batch 0", (0, 3), None)):
        x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)
        dy = rng.standard_normal(shape).astype(np.float32)
        m = None
        if mask is not None:
            m = np.zeros(shape[:-1], bool)
            if mask == "one":
                m[2, 1] = True
        layer = SyncBatchNormalization(momentum=0.5)
        layer.build((None,) + shape[1:])
        layer.set_weights([rng.uniform(0.5, 2, 3), rng.uniform(-1, 1, 3), rng.uniform(-1, 1, 3),
                           rng.uniform(0.5, 2, 3)])
        initial = [np.asarray(w, np.float64) for w in layer.get_weights()]

        def loss(trainable, non_trainable, x):
            y, non_trainable = layer.stateless_call(trainable, non_trainable, x, training=True, mask=m)
            return jnp.sum(y * dy), (y, non_trainable)

        grad = jax.value_and_grad(loss, argnums=(0, 2), has_aux=True)
        args = ([v.value for v in layer.trainable_variables], [v.value for v in layer.non_trainable_variables], x)
        ref = oracle.batch_norm([x], [dy], gamma=initial[0], beta=initial[1], momentum=0.5,
                                moving_mean=initial[2], moving_var=initial[3], masks=None if m is None else [m])
        for how, fn in (("eager", grad), ("jit", jax.jit(grad))):
            (_, (y, moving)), (grads, dx) = fn(*args)
            for got, want, what in ((y, ref["y"][0], "y"), (dx, ref["dx"][0], "dx"),
                                    (grads[0], ref["dgamma"], "dgamma"), (grads[1], ref["dbeta"], "dbeta"),
                                    (moving[0], ref["moving_mean"], "moving_mean"),
                                    (moving[1], ref["moving_var"], "moving_var")):
                got = np.asarray(got, np.float64)
                assert np.all(np.isfinite(got)), (name, how, what, got)
                np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{name} {how} {what}")
        info[name] = "as Keras"
    return info


@check
def manual_shard_map_and_pmap_training_raises():
    """Inside a user's own ``jax.shard_map`` or ``jax.pmap`` (manual mesh axes) the layer
    sees one device's shard, so a training call there would give per-shard statistics
    (Keras's own layer does): ours raises while tracing, naming the problem and
    keras.distribution.DataParallel. Inference inside shard_map is the whole-batch
    inference call's output; manual axes of size 1 (a shard_map over a one-device axis,
    or one that is manual only over such an axis and auto over the data axis) change
    nothing: no error, and the float64 oracle's values on the whole batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(23)
    channels = 3
    # One offset per device: per-shard moving means would be far from the global one.
    xs, dys = [], []
    for d in range(DEVICES):
        x, dy = oracle.make_inputs(rng, [2], (5, channels), channels, offset=np.full(channels, 5.0 * d))
        xs += x
        dys += dy
    x, dy = np.concatenate(xs), np.concatenate(dys)
    layer = SyncBatchNormalization(momentum=0.5)
    layer.build((None, 5, channels))
    layer.set_weights([rng.uniform(0.5, 2, channels), rng.uniform(-1, 1, channels),
                       rng.uniform(-1, 1, channels), rng.uniform(0.5, 2, channels)])
    initial = [np.asarray(w, np.float64) for w in layer.get_weights()]
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def call(x, training):
        y, moving = layer.stateless_call(trainable, non_trainable, x, training=training)
        return y, moving[0][None], moving[1][None]

    def expect_error(what, fn, *args, axis):
        try:
            fn(*args)
        except RuntimeError as e:
            text = str(e)
            for words in ("shard_map", "pmap", "each shard's own statistics",
                          "keras.distribution.DataParallel", "syncbn.flax", repr(axis)):
                assert words in text, (what, words, text)
            return
        raise AssertionError(f"{what}: a training call computed per-shard statistics without an error")

    info = {}
    mesh = jax.make_mesh((DEVICES,), ("data",))
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    specs = dict(mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data"), P("data")))
    train = jax.jit(jax.shard_map(lambda x: call(x, True), **specs))
    expect_error("shard_map", train, sharded, axis="data")
    expect_error("shard_map, check_vma=False",
                 jax.jit(jax.shard_map(lambda x: call(x, True), check_vma=False, **specs)), sharded, axis="data")
    info["shard_map over 4 devices, training"] = "raises"

    mesh2 = jax.make_mesh((2, 2), ("batch", "other"))
    partial = jax.jit(jax.shard_map(lambda x: call(x, True), mesh=mesh2, in_specs=P("batch"),
                                    out_specs=(P("batch"), P("batch"), P("batch")), axis_names={"batch"}))
    expect_error("shard_map manual over one of two axes", partial,
                 jax.device_put(x, NamedSharding(mesh2, P("batch"))), axis="batch")
    info["shard_map manual over 'batch' (2) of a 2x2 mesh, training"] = "raises"

    local = x.reshape((DEVICES, -1) + x.shape[1:])
    expect_error("pmap", jax.pmap(lambda x: call(x, True), axis_name="i"), local, axis="i")
    try:
        jax.pmap(lambda x: call(x, True))(local)
    except RuntimeError as e:
        assert "keras.distribution.DataParallel" in str(e), str(e)
    else:
        raise AssertionError("pmap without axis_name: a training call computed per-shard statistics")
    info["pmap over 4 devices (named and unnamed axis), training"] = "raises"

    # Inference uses the moving statistics: the whole-batch call's output, up to a few
    # float32 roundings (another fusion) of terms of magnitude |x| * gamma / std < 100.
    want, _, _ = call(x, False)
    got, _, _ = jax.jit(jax.shard_map(lambda x: call(x, False), **specs))(sharded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    got, _, _ = jax.pmap(lambda x: call(x, False), axis_name="i")(local)
    np.testing.assert_allclose(np.asarray(got).reshape(x.shape), np.asarray(want), rtol=2e-5, atol=2e-5)
    info["inference in shard_map and pmap"] = "whole-batch inference output"

    # Manual axes of one device: the whole batch, the oracle's statistics and gradients.
    ref = oracle.batch_norm([x], [dy], gamma=initial[0], beta=initial[1], momentum=0.5,
                            moving_mean=initial[2], moving_var=initial[3])

    def loss(trainable, x, dy):
        y, moving = layer.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(y * dy), (y, moving[0][None], moving[1][None])

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    one = jax.make_mesh((1,), ("one",), devices=jax.devices()[:1])
    one_auto = jax.make_mesh((1, DEVICES), ("one", "data"))
    for name, mesh_, spec, placed, axes in (
            ("shard_map over a 1-device axis", one, P("one"), P("one"), None),
            ("shard_map manual over a 1-device axis, auto over 'data' (4)", one_auto, P("one"),
             P(("one", "data")), {"one"})):
        out = (P(), P("one"), P("one"), P("one"), P("one"))
        extra = {} if axes is None else {"axis_names": axes}

        def body(trainable, x, dy):
            (_, (y, mm, mv)), (grads, dx) = grad(trainable, x, dy)
            return grads, y, mm, mv, dx

        fn = jax.jit(jax.shard_map(body, mesh=mesh_, in_specs=(P(), spec, spec), out_specs=out, **extra))
        xin = jax.device_put(x, NamedSharding(mesh_, placed))
        dyin = jax.device_put(dy, NamedSharding(mesh_, placed))
        assert len(xin.sharding.device_set) == mesh_.size, xin.sharding
        grads, y, mm, mv, dx = fn(trainable, xin, dyin)
        for got, want_, tol, what in ((y, ref["y"][0], 2e-5, "y"), (dx, ref["dx"][0], 2e-5, "dx"),
                                      (grads[0], ref["dgamma"], 2e-5, "dgamma"),
                                      (grads[1], ref["dbeta"], 2e-5, "dbeta"),
                                      (mm[0], ref["moving_mean"], 1e-5, "moving_mean"),
                                      (mv[0], ref["moving_var"], 1e-5, "moving_var")):
            got = np.asarray(got, np.float64)
            assert np.all(np.isfinite(got)), (name, what)
            np.testing.assert_allclose(got, want_, rtol=tol, atol=tol, err_msg=f"{name} {what}")
        info[name] = "no error, global statistics"
    # The per-shard means really differ from the global one.
    assert np.max(np.abs(x[:2].reshape(-1, channels).mean(0) - ref["mean"])) > 1.0
    return info


if __name__ == "__main__":
    worker_main(CHECKS, setup)
