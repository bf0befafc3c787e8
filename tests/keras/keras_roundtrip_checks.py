"""Backend-independent checks of ``syncbn.keras`` that need no distribution: a frozen
layer (``trainable=False``) called with ``training=True`` normalizes with its moving
statistics, as Keras's own layer does; and ``convert`` keeps every configuration field
and every weight of each BatchNormalization it replaces.

Run by ``test_keras_roundtrip.py`` once per backend (torch blocked):
    KERAS_BACKEND=jax python tests/keras_roundtrip_checks.py --out R.json --checks NAME...
"""

from __future__ import annotations

import numpy as np

from keras_harness import worker_main
import nan_safe

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def randomize(layer, rng):
    """Every weight of a built layer away from its initial value (variances positive)."""
    values = []
    for w in layer.weights:
        name = w.path.split("/")[-1]
        shape = tuple(w.shape)
        if name in ("gamma", "moving_variance", "moving_stddev", "renorm_stddev"):
            values.append(rng.uniform(0.5, 2.0, shape))
        else:
            values.append(rng.uniform(-1.0, 1.0, shape))
    layer.set_weights([v.astype(np.dtype(w.dtype)) for v, w in zip(values, layer.weights)])


def inference_oracle(x, layer, axis):
    """float64 (x - moving_mean) / sqrt(moving_var + eps) * gamma + beta."""
    weights = {w.path.split("/")[-1]: np.asarray(w.numpy(), np.float64) for w in layer.weights}
    shape = [1] * x.ndim
    shape[axis] = -1
    mean = weights["moving_mean"].reshape(shape)
    var = weights["moving_variance"].reshape(shape)
    y = (np.asarray(x, np.float64) - mean) / np.sqrt(var + layer.epsilon)
    if "gamma" in weights:
        y = y * weights["gamma"].reshape(shape)
    if "beta" in weights:
        y = y + weights["beta"].reshape(shape)
    return y


@check
def frozen_layer_uses_moving_statistics():
    """``trainable=False`` + ``training=True`` (the fine-tuning pattern): the moving
    statistics normalize, nothing is updated, and the output is Keras's frozen layer's;
    unfrozen, the same call uses the batch statistics (so the check is not vacuous)."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(20)
    info = {}
    for axis, shape, kwargs in [(-1, (6, 3, 2, 4), {}), (1, (5, 4, 3), {"center": False}),
                                (-1, (7, 4), {"renorm": True})]:
        layers = []
        for cls in (SyncBatchNormalization, keras.layers.BatchNormalization):
            layer = cls(axis=axis, momentum=0.5, epsilon=1e-3, **kwargs)
            build_shape = [None] * len(shape)
            build_shape[axis] = shape[axis]
            layer.build(tuple(build_shape))
            layers.append(layer)
        randomize(layers[0], rng)
        layers[1].set_weights(layers[0].get_weights())
        ours, theirs = layers
        x = (rng.standard_normal(shape) * 3 + 5).astype(np.float32)  # far from the moving mean
        before = [w.copy() for w in ours.get_weights()]

        ours.trainable = False
        theirs.trainable = False
        assert ours.trainable_weights == []
        y = np.asarray(keras.ops.convert_to_numpy(ours(x, training=True)), np.float64)
        y_keras = np.asarray(keras.ops.convert_to_numpy(theirs(x, training=True)), np.float64)
        expected = inference_oracle(x, ours, axis)
        err = nan_safe.max_abs_diff(y, expected) / max(1.0, float(np.max(np.abs(expected))))
        assert err <= 1e-5, f"axis {axis} {kwargs}: frozen output vs moving statistics, relative error {err}"
        assert nan_safe.max_abs_diff(y, y_keras) <= 1e-5 * max(1.0, float(np.max(np.abs(y_keras)))), (
            "frozen output differs from keras.layers.BatchNormalization's")
        for a, b in zip(ours.get_weights(), before):
            np.testing.assert_array_equal(a, b, err_msg="a frozen layer's weights moved")

        ours.trainable = True
        y_train = np.asarray(keras.ops.convert_to_numpy(ours(x, training=True)), np.float64)
        assert nan_safe.max_abs_diff(y_train, expected) > 0.1, "unfrozen training call used the moving statistics"
        info[f"axis {axis} {kwargs}"] = err
    return {"frozen_relative_error": info}


def bn_configs():
    """BatchNormalization arguments, each field away from its default at least once."""
    import keras

    return [
        dict(axis=-1, momentum=0.9, epsilon=1e-2, name="bn_a"),
        dict(axis=1, momentum=0.5, epsilon=2e-4, center=False, beta_initializer="ones",
             gamma_initializer="zeros", moving_mean_initializer="ones",
             moving_variance_initializer=keras.initializers.Constant(2.0), name="bn_b"),
        dict(axis=-1, scale=False, beta_regularizer=keras.regularizers.L2(0.01),
             gamma_regularizer=keras.regularizers.L1(0.02), beta_constraint=keras.constraints.NonNeg(),
             gamma_constraint=keras.constraints.MaxNorm(2.0), trainable=False, name="bn_c"),
        dict(axis=-1, renorm=True, renorm_clipping={"rmax": 2.0, "rmin": 0.5, "dmax": 1.0},
             renorm_momentum=0.8, momentum=0.7, name="bn_d"),
        dict(axis=-1, dtype="float64", epsilon=1e-5, name="bn_e"),
    ]


def comparable(config):
    config = dict(config)
    config.pop("synchronized", None)
    return config


def assert_same_layer(new, old, where):
    from syncbn.keras import SyncBatchNormalization

    assert isinstance(new, SyncBatchNormalization), (where, type(new))
    assert comparable(new.get_config()) == comparable(old.get_config()), (
        where, comparable(new.get_config()), comparable(old.get_config()))
    assert new.trainable == old.trainable, where
    assert new.built == old.built, where
    assert [w.path.split("/")[-1] for w in new.weights] == [w.path.split("/")[-1] for w in old.weights], where
    assert [w.trainable for w in new.weights] == [w.trainable for w in old.weights], where
    for a, b in zip(new.weights, old.weights):
        assert a is not b, f"{where}: the copy shares a variable with the original"
        assert np.dtype(a.dtype) == np.dtype(b.dtype), where
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()), err_msg=f"{where} {a.path}")


@check
def convert_keeps_every_config_field_and_weight():
    """Each BatchNormalization of a Functional model (one of them inside a nested
    Sequential) and a bare layer: the converted layer's ``get_config`` equals the
    original's (less ``synchronized``), with the same weights in the same order and
    the same values, in new variables; the config also survives ``from_config``."""
    import keras

    from syncbn.keras import SyncBatchNormalization, convert

    rng = np.random.default_rng(21)
    configs = bn_configs()
    info = {}

    # a Functional model: (N, 4, 3) features, channels on axis -1 (and 1 for bn_b)
    inputs = keras.Input((4, 3))
    h = keras.layers.BatchNormalization(**configs[0])(keras.layers.Dense(3)(inputs))
    h = keras.layers.BatchNormalization(**configs[1])(h)
    nested = keras.Sequential([keras.Input((4, 3)), keras.layers.BatchNormalization(**configs[2])], name="inner")
    h = nested(h)
    h = keras.layers.BatchNormalization(**configs[3])(h)
    model = keras.Model(inputs, h)
    originals = [model.get_layer(c["name"]) for c in configs[:2]] + [nested.get_layer("bn_c"), model.get_layer("bn_d")]
    for layer in originals:
        randomize(layer, rng)
    converted = convert(model)
    for layer in originals:
        new = (converted.get_layer("inner").get_layer(layer.name) if layer.name == "bn_c"
               else converted.get_layer(layer.name))
        assert_same_layer(new, layer, layer.name)
        assert type(layer) is keras.layers.BatchNormalization  # the original is untouched
    x = rng.standard_normal((5, 4, 3)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(converted(x, training=False)), np.asarray(model(x, training=False)))
    info["functional"] = len(originals)

    # bare layers, built and unbuilt (the float64 one included)
    for config in configs:
        bn = keras.layers.BatchNormalization(**config)
        assert_same_layer(convert(bn), bn, f"{config['name']} unbuilt")
        shape = [None, 4, 3]
        bn.build(tuple(shape))
        randomize(bn, rng)
        new = convert(bn)
        assert_same_layer(new, bn, f"{config['name']} built")
        again = SyncBatchNormalization.from_config(new.get_config())
        assert comparable(again.get_config()) == comparable(new.get_config()), config["name"]
    info["bare"] = len(configs)
    return info


if __name__ == "__main__":
    worker_main(CHECKS)
