"""Backend-independent checks of ``syncbn.keras`` that need no distribution: a frozen
layer (``trainable=False``) called with ``training=True`` normalizes with its moving
statistics, as Keras's own layer does; ``convert`` keeps every configuration field
and every weight of each BatchNormalization it replaces; ``revert(convert(model))``
is the original again, field by field, for every kind of model ``convert`` handles;
``model.summary()`` and a ``.keras`` file name the synchronized class.

Run by ``test_keras_roundtrip.py`` once per backend (torch blocked):
    KERAS_BACKEND=jax python tests/keras_roundtrip_checks.py --out R.json --checks NAME...
"""

from __future__ import annotations

import json

import numpy as np

from keras_harness import registry, worker_main
import nan_safe

CHECKS, check = registry()


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


# --------------------------------------------------------------------------- revert


def every_layer(root):
    """``root`` and every layer reachable from it, in a fixed order: through Keras's
    layer tracking and, independently of it, through public attributes, lists, tuples
    and dicts (so a layer left in an untracked attribute is found too)."""
    import keras

    found, seen = [], set()

    def visit(value):
        if isinstance(value, keras.layers.Layer):
            if id(value) in seen:
                return
            seen.add(id(value))
            found.append(value)
            for layer in value._flatten_layers(include_self=False, recursive=False):
                visit(layer)
            for name, item in vars(value).items():
                if not name.startswith("_"):  # Keras's own state (a Sequential's inner Functional)
                    visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    visit(root)
    return found


def kinds(model):
    """(plain BatchNormalization, SyncBatchNormalization) layers anywhere in ``model``."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    layers = every_layer(model)
    return (sum(type(layer) is keras.layers.BatchNormalization for layer in layers),
            sum(isinstance(layer, SyncBatchNormalization) for layer in layers))


def snapshot(model):
    """Everything ``revert(convert(model))`` must give back: per layer (in
    :func:`every_layer`'s order) its class, name, full ``get_config()``, built and
    trainable flags and its weights' paths; per weight its path, name, dtype,
    trainable flag and value."""
    layers = [(type(layer), layer.name, layer.get_config(), layer.built, layer.trainable,
               [w.path for w in layer.weights]) for layer in every_layer(model)]
    weights = [(w.path, w.name, str(w.dtype), w.trainable, np.array(w.numpy())) for w in model.weights]
    return layers, weights


def differences(a, b, path=""):
    """Where two configs differ: ``path: a != b`` for each differing leaf."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = list(a) + [k for k in b if k not in a]
        return [d for k in keys for d in differences(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        if type(a) is not type(b):
            return [f"{path or '.'}: {type(a).__name__} != {type(b).__name__}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path or '.'}: {a!r} != {b!r}"]


def as_saved(snap):
    """A snapshot with each config as a file holds it (JSON: tuples become lists)."""
    layers, weights = snap
    return [(*layer[:2], json.loads(json.dumps(layer[2])), *layer[3:]) for layer in layers], weights


def assert_same_snapshot(got, want, where):
    """Field by field; a weight must equal its original exactly and be finite
    (``assert_array_equal`` alone takes NaN for NaN)."""
    got_layers, got_weights = got
    want_layers, want_weights = want
    assert len(got_layers) == len(want_layers), (where, [l[:2] for l in got_layers], [l[:2] for l in want_layers])
    fields = ("class", "name", "get_config()", "built", "trainable", "weight paths")
    for a, b in zip(got_layers, want_layers):
        for field, x, y in zip(fields, a, b):
            assert x == y, f"{where}: layer {b[1]!r}: {field} differs (got != original): {differences(x, y)}"
    assert len(got_weights) == len(want_weights), (where, len(got_weights), len(want_weights))
    fields = ("path", "name", "dtype", "trainable")
    for a, b in zip(got_weights, want_weights):
        for field, x, y in zip(fields, a, b):
            assert x == y, f"{where}: weight {b[0]!r}: {field} is {x!r}, the original's {y!r}"
        assert np.all(np.isfinite(a[4])), f"{where}: weight {b[0]!r} is not finite"
        np.testing.assert_array_equal(a[4], b[4], err_msg=f"{where}: weight {b[0]!r}")


def assert_round_trip(model, where, bn_count, rng, synchronized=False):
    """``convert`` synchronizes all ``bn_count`` BatchNormalization layers (so the round
    trip is not vacuous) and keeps every weight's path, ``revert`` gives the original
    back field by field in new variables, neither changes its argument, and no
    SyncBatchNormalization is left. With ``synchronized``, ``model``'s layers are
    SyncBatchNormalization and the trip is ``convert(revert(model))``."""
    from syncbn.keras import convert, revert

    for layer in every_layer(model):
        if layer.built and layer.weights and not layer._layers:
            randomize(layer, rng)
    before = snapshot(model)
    plain, synced = (bn_count, 0), (0, bn_count)
    first, second = (revert, convert) if synchronized else (convert, revert)
    assert kinds(model) == (synced if synchronized else plain), (where, kinds(model))
    middle = first(model)
    assert kinds(middle) == (plain if synchronized else synced), (where, first.__name__, kinds(middle))
    assert [w.path for w in middle.weights] == [w.path for w in model.weights], (
        where, first.__name__, [w.path for w in middle.weights], [w.path for w in model.weights])
    back = second(middle)
    assert kinds(back) == kinds(model), (where, second.__name__, kinds(back))
    assert kinds(middle) == (plain if synchronized else synced), (where, f"{second.__name__} changed its argument")
    assert_same_snapshot(snapshot(back), before, where)
    assert_same_snapshot(snapshot(model), before, f"{where} (the original afterwards)")
    ids = {id(w) for w in model.weights}
    assert not any(id(w) in ids for w in back.weights), f"{where}: the copy shares a variable with the original"
    return back


def block_class():
    """A custom layer holding BatchNormalization layers in an attribute, a list and a
    dict (``units`` in its config), or SyncBatchNormalization ones with
    ``synchronized=True``."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    @keras.saving.register_keras_serializable(package="syncbn_roundtrip")
    class Block(keras.layers.Layer):
        def __init__(self, units, synchronized=False, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.synchronized = synchronized
            norm = SyncBatchNormalization if synchronized else keras.layers.BatchNormalization
            self.dense = keras.layers.Dense(units, name="dense")
            self.bn = norm(momentum=0.8, name="bn_attribute")
            self.in_list = [norm(epsilon=1e-2, name="bn_in_list")]
            self.in_dict = {"last": norm(center=False, name="bn_in_dict")}

        def call(self, x, training=None):
            h = self.bn(self.dense(x), training=training)
            return self.in_dict["last"](self.in_list[0](h, training=training), training=training)

        def get_config(self):
            return {**super().get_config(), "units": self.units, "synchronized": self.synchronized}

    return Block


def backbone_class():
    """A Functional subclass in the keras_hub ``Backbone`` pattern: it builds its own
    graph (every layer named) and serializes its constructor's arguments."""
    import keras

    @keras.saving.register_keras_serializable(package="syncbn_roundtrip")
    class Backbone(keras.Model):
        def __init__(self, width, **kwargs):
            inputs = keras.Input((4, 3), name="features")
            x = keras.layers.Dense(width, name="embed")(inputs)
            x = keras.layers.BatchNormalization(momentum=0.7, name="embed_norm")(x)
            x = keras.layers.BatchNormalization(axis=1, epsilon=1e-4, name="time_norm")(x)
            outputs = keras.layers.Dense(2, name="head")(x)
            super().__init__(inputs, outputs, **kwargs)
            self.width = width

        def get_config(self):
            return {"width": self.width, "name": self.name, "trainable": self.trainable}

    return Backbone


def unregistered_classes():
    """A subclassed model with its own ``call`` and a Functional subclass, neither
    registered with Keras (no file could name them, but ``convert`` copies them through
    their own ``from_config``). Each names its layers and saves its own name, so that a
    copy rebuilt through the constructor has the original's layer names and paths."""
    import keras

    class Tower(keras.Model):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.dense = keras.layers.Dense(units, name="dense")
            self.norm = keras.layers.BatchNormalization(momentum=0.6, name="norm")

        def call(self, x, training=None):
            return self.norm(self.dense(x), training=training)

        def get_config(self):
            return {"units": self.units, "name": self.name}

    class Trunk(keras.Model):
        def __init__(self, width, **kwargs):
            inputs = keras.Input((3,), name="features")
            x = keras.layers.Dense(width, name="trunk_dense")(inputs)
            outputs = keras.layers.BatchNormalization(epsilon=1e-2, name="trunk_norm")(x)
            super().__init__(inputs, outputs, **kwargs)
            self.width = width

        def get_config(self):
            return {"width": self.width, "name": self.name}

    return Tower, Trunk


@check
def revert_unregistered_subclasses():
    """``revert(convert(model))`` works wherever ``convert`` does: a converted subclass
    copies itself from the original class it was made from, not from a lookup of that
    class's name, so classes Keras cannot find by name come back field by field (and
    ``convert`` of the converted copy works too)."""
    from syncbn.keras import convert

    rng = np.random.default_rng(38)
    Tower, Trunk = unregistered_classes()
    tower = Tower(3, name="tower")
    tower(rng.standard_normal((5, 4)).astype(np.float32))
    back = assert_round_trip(tower, "unregistered subclassed model", 1, rng)
    assert type(back) is Tower and back.units == 3, type(back)
    trunk = Trunk(3, name="trunk")
    back = assert_round_trip(trunk, "unregistered Functional subclass", 1, rng)
    assert type(back) is Trunk and back.width == 3, type(back)
    for model in (tower, trunk):
        twice = convert(convert(model))
        assert kinds(twice) == (0, 1), (model.name, kinds(twice))
        assert [w.path for w in twice.weights] == [w.path for w in model.weights], model.name
    return {"models": 2}


@check
def clone_model_of_converted_unregistered_classes():
    """``keras.models.clone_model`` of a converted model works for classes Keras cannot
    find by name, as it does for the plain model, and the clone's batch norm layers are
    still SyncBatchNormalization with the converted layers' configs: a Functional model
    holding an unregistered custom layer, an unregistered Functional subclass (cloned
    into a plain Functional, as Keras clones one) and an unregistered subclassed model,
    built and unbuilt (cloned through its config: the file name ``syncbn>Synchronized``
    finds only the mixin, and the original class is the one the caller's class was made
    from)."""
    import keras

    from syncbn.keras import SyncBatchNormalization, convert

    class Stem(keras.layers.Layer):
        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.dense = keras.layers.Dense(units, name="dense")
            self.norm = keras.layers.BatchNormalization(momentum=0.8, center=False, name="stem_norm")

        def call(self, x, training=None):
            return self.norm(self.dense(x), training=training)

        def get_config(self):
            return {**super().get_config(), "units": self.units}

    rng = np.random.default_rng(39)
    Tower, Trunk = unregistered_classes()
    x = rng.normal(2.0, 3.0, (6, 3)).astype(np.float32)
    inputs = keras.Input((3,), name="x")
    built_tower = Tower(3, name="tower")
    built_tower(x)
    models = {
        "custom layer in a Functional model": keras.Model(inputs, Stem(3, name="stem")(inputs), name="net"),
        "Functional subclass": Trunk(3, name="trunk"),
        "subclassed model, built": built_tower,
        "subclassed model, unbuilt": Tower(3, name="tower"),
    }
    for where, model in models.items():
        synced = convert(model)
        clone = keras.models.clone_model(synced)
        want = {l.name: l.get_config() for l in every_layer(synced) if isinstance(l, SyncBatchNormalization)}
        got = {l.name: l.get_config() for l in every_layer(clone) if isinstance(l, SyncBatchNormalization)}
        assert kinds(clone) == (0, 1) and got == want, (where, kinds(clone), got, want)
        assert isinstance(clone, type(model)) or type(model) is Trunk, (where, type(clone))
        y = np.asarray(keras.ops.convert_to_numpy(clone(x, training=True)))
        assert np.all(np.isfinite(y)), where
    return {"models": len(models)}


def unbuilt_owner_classes():
    """A Functional subclass with a SyncBatchNormalization beside its graph that it
    never calls, and a Sequential subclass without an Input (so unbuilt) whose
    constructor makes one: ``revert`` rebuilds both through their constructors and
    makes their layers plain in place, before those are built."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    class Head(keras.Model):
        def __init__(self, units, **kwargs):
            inputs = keras.Input((4,), name="features")
            x = keras.layers.Dense(units, name="dense")(inputs)
            super().__init__(inputs, SyncBatchNormalization(momentum=0.5, name="head_norm")(x), **kwargs)
            self.units = units
            self.spare = SyncBatchNormalization(epsilon=0.1, center=False, name="spare")

        def get_config(self):
            return {"units": self.units, "name": self.name}

    class Stack(keras.Sequential):
        def __init__(self, units, **kwargs):
            super().__init__([keras.layers.Dense(units, name="dense"),
                              SyncBatchNormalization(momentum=0.6, name="stack_norm")], **kwargs)
            self.units = units

        def get_config(self):
            return {"units": self.units, "name": self.name}

        @classmethod
        def from_config(cls, config):
            return cls(**config)

    return Head, Stack


@check
def revert_unbuilt_synchronized_layers():
    """``revert`` of a SyncBatchNormalization never built gives an unbuilt
    BatchNormalization with its config, which builds and trains as Keras's own layer:
    bare (and built, beside it), and made plain in place inside a Functional subclass
    and a Sequential subclass, where Keras's build wrapper of the layer still calls
    SyncBatchNormalization's build. The original is left synchronized and usable."""
    import keras

    from syncbn.keras import SyncBatchNormalization, revert

    rng = np.random.default_rng(41)
    x = rng.normal(3.0, 2.0, (6, 4)).astype(np.float32)

    def assert_plain_like(layer, original, where):
        assert type(layer) is keras.layers.BatchNormalization, (where, type(layer))
        assert layer.get_config() == {**original.get_config(), "synchronized": False}, where
        assert layer.built is original.built, where
        reference = keras.layers.BatchNormalization.from_config(layer.get_config())
        got = keras.ops.convert_to_numpy(layer(x, training=True))
        want = keras.ops.convert_to_numpy(reference(x, training=True))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=where)
        assert [w.path for w in layer.weights] == [w.path for w in reference.weights], where
        assert layer.supports_jit, where

    for built in (False, True):
        bn = SyncBatchNormalization(momentum=0.7, epsilon=1e-2, scale=False, name="bn")
        if built:
            bn.build(x.shape)
        assert_plain_like(revert(bn), bn, f"bare, built={built}")
        assert type(bn) is SyncBatchNormalization and bn.built is built, built
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(bn(x, training=True))))

    Head, Stack = unbuilt_owner_classes()
    head = Head(4, name="head")
    plain = revert(head)
    assert type(plain) is Head and kinds(plain) == (2, 0), (type(plain), kinds(plain))
    assert_plain_like(plain.spare, head.spare, "Functional subclass, layer never called")
    stack = Stack(4, name="stack")
    plain = revert(stack)
    assert type(plain) is Stack and not plain.built and kinds(plain) == (1, 0), (type(plain), kinds(plain))
    y = keras.ops.convert_to_numpy(plain(x, training=True))
    assert np.all(np.isfinite(y)) and type(plain.layers[-1]) is keras.layers.BatchNormalization
    for original in (head.spare, stack.layers[-1]):
        assert type(original) is SyncBatchNormalization and not original.built, original.name
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(stack(x, training=True))))
    return {"owners": 2}


@check
def revert_sequential():
    """A Sequential model, built (with an Input) and unbuilt (no Input, never called),
    every BatchNormalization argument away from its default once."""
    import keras

    rng = np.random.default_rng(30)
    for built in (True, False):
        layers = [keras.layers.Dense(3, name="dense")]
        layers += [keras.layers.BatchNormalization(**config) for config in bn_configs()]
        model = keras.Sequential(([keras.Input((4, 3))] if built else []) + layers, name="seq")
        assert model.built is built
        reverted = assert_round_trip(model, f"sequential built={built}", len(bn_configs()), rng)
        assert reverted.built is built
    return {"bn_layers": len(bn_configs())}


@check
def revert_functional_nested():
    """A Functional model holding a nested Sequential model, a nested Functional model
    (channels-first BN) and a BN called twice, its inputs unnamed: layer names
    (``input_layer``) come back too."""
    import keras

    rng = np.random.default_rng(31)
    inner_seq = keras.Sequential([keras.layers.Dense(3, name="inner_dense"),
                                  keras.layers.BatchNormalization(momentum=0.5, name="inner_bn")], name="inner_seq")
    sub_in = keras.Input((4, 3))
    sub_out = keras.layers.BatchNormalization(axis=1, scale=False, name="sub_bn")(sub_in)
    sub_model = keras.Model(sub_in, sub_out, name="sub_model")

    inputs = keras.Input((4, 3))
    x = keras.layers.BatchNormalization(name="top_bn")(inputs)
    x = inner_seq(x)
    x = sub_model(x)
    shared = keras.layers.BatchNormalization(renorm=True, name="shared_bn")
    x = shared(shared(x))
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(x), name="outer")
    reverted = assert_round_trip(model, "functional with nested models", 4, rng)
    x = rng.standard_normal((5, 4, 3)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(reverted(x, training=False)), np.asarray(model(x, training=False)))
    return {"bn_layers": 4}


@check
def functional_with_operations_on_keras_tensors():
    """A Functional model written with operators on KerasTensors (``h * h``, ``h + y``,
    ``keras.ops.tanh``: keras.ops Operations in the graph, not layers) converts and
    reverts, its outputs unchanged in inference and synchronized layers in place."""
    import keras

    rng = np.random.default_rng(37)
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    h = keras.layers.BatchNormalization(name="bn0")(h)
    h = h * h + keras.ops.tanh(h)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling2D(name="pool")(h), name="ops_graph")
    reverted = assert_round_trip(model, "functional with keras.ops operations", 2, rng)
    x = rng.standard_normal((3, 6, 6, 3)).astype(np.float32)
    want = np.asarray(model(x, training=False))
    np.testing.assert_array_equal(np.asarray(reverted(x, training=False)), want)
    from syncbn.keras import convert

    np.testing.assert_array_equal(np.asarray(convert(model)(x, training=False)), want)
    return {"bn_layers": 2}


@check
def revert_functional_subclass():
    """A Functional subclass (keras_hub ``Backbone`` pattern) comes back as its own
    class, rebuilt through its ``from_config``, with its attributes."""
    rng = np.random.default_rng(32)
    Backbone = backbone_class()
    model = Backbone(3, name="backbone")
    reverted = assert_round_trip(model, "functional subclass", 2, rng)
    assert type(reverted) is Backbone and reverted.width == 3
    return {"bn_layers": 2}


@check
def revert_custom_layer():
    """BatchNormalization layers held by a custom layer (an attribute, a list, a dict),
    the custom layer bare (built by a call, and unbuilt) and inside a Functional model;
    and a custom layer holding SyncBatchNormalization layers of its own, reverted."""
    import keras

    rng = np.random.default_rng(33)
    Block = block_class()
    block = Block(3, name="block")
    assert_round_trip(block, "custom layer unbuilt", 3, rng)
    block(rng.standard_normal((5, 3)).astype(np.float32))
    assert_round_trip(block, "custom layer built", 3, rng)
    inputs = keras.Input((3,), name="x")
    model = keras.Model(inputs, Block(3, name="block")(keras.layers.BatchNormalization(name="bn")(inputs)))
    assert_round_trip(model, "custom layer in a Functional model", 4, rng)
    # A custom layer that makes SyncBatchNormalization layers itself: revert replaces
    # them (they are not rebuilt from the config), under the same weight paths.
    block = Block(3, synchronized=True, name="block")
    block(rng.standard_normal((5, 3)).astype(np.float32))
    assert_round_trip(block, "custom layer of SyncBatchNormalization", 3, rng, synchronized=True)
    return {"bn_layers": 4}


@check
def revert_bare_layer():
    """A bare SyncBatchNormalization gives a BatchNormalization, built and unbuilt,
    for every configuration of ``bn_configs``; a plain one is copied as it is."""
    import keras

    from syncbn.keras import SyncBatchNormalization, revert

    rng = np.random.default_rng(34)
    for config in bn_configs():
        bn = keras.layers.BatchNormalization(**config)
        assert_round_trip(bn, f"{config['name']} unbuilt", 1, rng)
        bn.build((None, 4, 3))
        assert_round_trip(bn, f"{config['name']} built", 1, rng)
    plain = revert(bn)
    assert type(plain) is keras.layers.BatchNormalization and not isinstance(plain, SyncBatchNormalization)
    return {"configs": len(bn_configs())}


@check
def revert_runs_as_plain_batch_norm():
    """The reverted model has no SyncBatchNormalization left: in training, with a
    batch far from the moving statistics, its output and its moving statistics after
    one step are exactly those of the original plain model (the same layer code)."""
    import keras

    from syncbn.keras import convert, revert

    rng = np.random.default_rng(35)
    Block = block_class()
    inputs = keras.Input((3,))
    model = keras.Model(inputs, Block(3)(keras.layers.BatchNormalization()(inputs)))
    for layer in every_layer(model):
        if layer.weights and not layer._layers:
            randomize(layer, rng)
    reverted = revert(convert(model))
    assert kinds(reverted) == (4, 0), kinds(reverted)
    x = (rng.standard_normal((8, 3)) * 2 + 3).astype(np.float32)
    got = np.asarray(keras.ops.convert_to_numpy(reverted(x, training=True)))
    want = np.asarray(keras.ops.convert_to_numpy(model(x, training=True)))
    assert np.all(np.isfinite(want))
    np.testing.assert_array_equal(got, want)
    for a, b in zip(reverted.weights, model.weights):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()), err_msg=a.path)
    return {}


@check
def summary_names_the_synchronized_class():
    """``model.summary()`` shows a converted layer as ``SyncBatchNormalization`` (nested
    ones too) and a reverted one as ``BatchNormalization``."""
    import keras

    from syncbn.keras import convert, revert

    inner = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(name="inner_bn")], name="inner")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, inner(keras.layers.BatchNormalization(name="top_bn")(inputs)))

    def summary(m):
        lines = []
        m.summary(expand_nested=True, line_length=120, print_fn=lambda text, **kwargs: lines.append(text))
        return "\n".join(lines)

    def row(text, name):
        rows = [line for line in text.splitlines() if f"{name} (" in line]
        assert len(rows) == 1, (name, text)
        return rows[0]

    synced, plain = summary(convert(model)), summary(revert(convert(model)))
    for name in ("top_bn", "inner_bn"):
        assert f"{name} (SyncBatchNormalization)" in row(synced, name), row(synced, name)
        assert f"{name} (BatchNormalization)" in row(plain, name), row(plain, name)
    return {"row": row(synced, "top_bn").strip()}


@check
def keras_file_keeps_the_synchronized_class():
    """A converted model saved to ``.keras`` loads back with SyncBatchNormalization
    layers (its registered name, ``syncbn>SyncBatchNormalization``), the same configs
    and weights, and predicts the same; a ``.weights.h5`` file moves between the plain
    model and the converted one through ``revert`` and ``convert``."""
    import os
    import tempfile

    import keras

    from syncbn.keras import SyncBatchNormalization, convert, revert

    rng = np.random.default_rng(36)

    def build():
        inputs = keras.Input((4, 3), name="x")
        x = keras.layers.BatchNormalization(momentum=0.5, name="bn_a")(keras.layers.Dense(3, name="dense")(inputs))
        return keras.Model(inputs, keras.layers.BatchNormalization(axis=1, renorm=True, name="bn_b")(x), name="net")

    plain = build()
    for layer in plain.layers:
        if layer.weights:
            randomize(layer, rng)
    synced = convert(plain)
    data = rng.standard_normal((5, 4, 3)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        synced.save(path)
        loaded = keras.models.load_model(path)
        for name in ("bn_a", "bn_b"):
            assert type(loaded.get_layer(name)) is SyncBatchNormalization, type(loaded.get_layer(name))
        assert_same_snapshot(as_saved(snapshot(loaded)), as_saved(snapshot(synced)), ".keras file")
        np.testing.assert_array_equal(np.asarray(loaded(data, training=False)), np.asarray(synced(data, training=False)))

        # a plain checkpoint into a synchronized model and back, through convert / revert
        weights = os.path.join(tmp, "w.weights.h5")
        plain.save_weights(weights)
        fresh = build()
        fresh.load_weights(weights)
        assert_same_snapshot(snapshot(convert(fresh)), snapshot(synced), "plain weights file, converted")
        revert(loaded).save_weights(weights)
        fresh = build()
        fresh.load_weights(weights)
        assert_same_snapshot(snapshot(fresh), snapshot(plain), "weights file of the reverted model")
    return {}


@check
def keras_file_keeps_layers_their_owners_make():
    """A custom layer and a Functional subclass (the keras_hub pattern) make their
    BatchNormalization layers in their constructors and save only its arguments.
    Converted, they save as ``syncbn>Synchronized`` and load back synchronized, with the
    same configs, weights and predictions; reverted, they save and load as their own
    classes with plain layers."""
    import os
    import tempfile

    import keras

    from syncbn.keras import convert, revert

    rng = np.random.default_rng(37)
    Block, Backbone = block_class(), backbone_class()
    inputs = keras.Input((4, 3), name="x")
    net = keras.Model(inputs, Block(3, name="block")(inputs), name="net")
    data = rng.standard_normal((5, 4, 3)).astype(np.float32)
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for where, model, count in (("custom layer", net, 3), ("functional subclass", Backbone(3, name="bb"), 2)):
            for layer in every_layer(model):
                if layer.built and layer.weights and not layer._layers:
                    randomize(layer, rng)
            synced = convert(model)
            path = os.path.join(tmp, "synced.keras")
            synced.save(path)
            loaded = keras.models.load_model(path)
            assert kinds(loaded) == (0, count), (where, kinds(loaded))
            assert_same_snapshot(as_saved(snapshot(loaded)), as_saved(snapshot(synced)), f"{where}, .keras file")
            want = np.asarray(synced(data, training=False))
            assert np.all(np.isfinite(want)), where
            np.testing.assert_array_equal(np.asarray(loaded(data, training=False)), want, err_msg=where)

            path = os.path.join(tmp, "plain.keras")
            revert(loaded).save(path)
            plain = keras.models.load_model(path)
            assert kinds(plain) == (count, 0), (where, kinds(plain))
            assert_same_snapshot(as_saved(snapshot(plain)), as_saved(snapshot(model)), f"{where}, reverted file")
            counts[where] = count
    return {"bn_layers": counts}


def lazy_classes():
    """A custom layer that makes its Dense and BatchNormalization layers in ``build()``,
    a layer that makes one of those in its constructor, and a subclassed model that
    makes its BatchNormalization in ``build()``."""
    import keras

    @keras.saving.register_keras_serializable(package="syncbn_roundtrip")
    class LazyBlock(keras.layers.Layer):
        def build(self, input_shape):
            self.dense = keras.layers.Dense(input_shape[-1], name="dense")
            self.dense.build(input_shape)
            self.bn = keras.layers.BatchNormalization(momentum=0.5, name="bn")
            self.bn.build(input_shape)

        def call(self, x, training=None):
            return self.bn(self.dense(x), training=training)

    @keras.saving.register_keras_serializable(package="syncbn_roundtrip")
    class LazyOwner(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = LazyBlock(name="block")

        def build(self, input_shape):
            self.block.build(input_shape)

        def call(self, x, training=None):
            return self.block(x, training=training)

    @keras.saving.register_keras_serializable(package="syncbn_roundtrip")
    class LazyNet(keras.Model):
        def build(self, input_shape):
            self.bn = keras.layers.BatchNormalization(momentum=0.5, name="bn")
            self.bn.build(input_shape)

        def call(self, x, training=None):
            return self.bn(x, training=training)

    return LazyBlock, LazyOwner, LazyNet


@check
def convert_synchronizes_layers_made_in_build():
    """A layer that makes its BatchNormalization layers in its own ``build()`` holds
    none before it is built, and its copy from its config none until it is built (nor
    while a ``.keras`` file loads). Converted, unbuilt or built, every such layer is
    synchronized once built: it trains synchronized, and its ``.keras`` file loads back
    synchronized with the same weights and predictions (before the fix both came out
    plain, without a word)."""
    import os
    import tempfile

    import keras

    from syncbn.keras import convert, revert

    rng = np.random.default_rng(41)
    LazyBlock, LazyOwner, LazyNet = lazy_classes()
    data = (rng.standard_normal((6, 3)) * 2 + 1).astype(np.float32)
    # a Sequential with an Input is built as it is made; without one, when first called
    cases = {
        "layer in a Sequential": lambda: keras.Sequential([LazyBlock(name="lazy")]),
        "layer held by a layer": lambda: keras.Sequential([LazyOwner(name="owner")]),
        "subclassed model": lambda: LazyNet(name="net"),
        "bare layer": lambda: LazyBlock(name="lazy"),
    }
    done = []
    with tempfile.TemporaryDirectory() as tmp:
        for where, make in cases.items():
            for built in (False, True):
                what = f"{where}, {'built' if built else 'unbuilt'} when converted"
                model = make()
                assert not model.built, what
                if built:
                    model(data)
                    assert kinds(model) == (1, 0), (what, kinds(model))
                synced = convert(model)
                synced(data)  # builds an unbuilt copy
                assert kinds(synced) == (0, 1), (what, kinds(synced))
                synced(data, training=True)  # moving statistics away from their start
                path = os.path.join(tmp, "synced.keras")
                holder = synced if isinstance(synced, keras.Model) else keras.Sequential(
                    [keras.Input((3,)), synced])
                holder.save(path)
                loaded = keras.models.load_model(path)
                assert kinds(loaded) == (0, 1), (what, kinds(loaded))
                want = np.asarray(holder(data, training=False))
                assert np.all(np.isfinite(want)), what
                np.testing.assert_array_equal(np.asarray(loaded(data, training=False)), want, err_msg=what)
                for a, b in zip(holder.get_weights(), loaded.get_weights()):
                    np.testing.assert_array_equal(b, a, err_msg=what)
                plain = revert(loaded)
                assert kinds(plain) == (1, 0), (what, kinds(plain))
                np.testing.assert_array_equal(np.asarray(plain(data, training=False)), want, err_msg=what)
                done.append(what)
    return {"cases": len(done)}


def saved_classes(path):
    """The registered names under which the ``.keras`` file at ``path`` saves its objects
    (not those inside ``syncbn>Synchronized``'s ``original`` entry, the class it rebuilds)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    found = []

    def visit(value):
        if isinstance(value, dict):
            if "registered_name" in value:
                found.append(value["registered_name"])
            for key, item in value.items():
                if key != "original":  # the class that syncbn>Synchronized rebuilds
                    visit(item)
        elif isinstance(value, list):
            for item in value:
                visit(item)

    visit(config)
    return found


@check
def unbuilt_copy_saved_loads_synchronized():
    """A converted copy not yet built, whose batch norm layers a custom layer makes in its
    own ``build()``, saved to a ``.keras`` file before its first call (Keras only warns):
    the file names the converted class for that layer (a process without ``syncbn.keras``
    cannot load it plain), and loaded and built, its batch norm layers are synchronized and
    a training call matches the float64 oracle. Before the fix the copy, holding no batch
    norm yet, kept its own class, and the file loaded back plain, without a word. A custom
    layer that makes none has its own class back once built (weights paths as the plain
    model's), and ``revert`` of such an unbuilt copy builds plain."""
    import os
    import tempfile
    import warnings

    import keras

    import keras_oracle as oracle
    from syncbn.keras import SyncBatchNormalization, convert, revert

    rng = np.random.default_rng(43)
    LazyBlock, LazyOwner, LazyNet = lazy_classes()

    @keras.saving.register_keras_serializable(package="syncbn_roundtrip")
    class LazyHolder(keras.layers.Layer):  # Keras's own build(): the block builds when called
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = LazyBlock(name="block")

        def call(self, x, training=None):
            return self.block(x, training=training)

    @keras.saving.register_keras_serializable(package="syncbn_roundtrip")
    class DenseInBuild(keras.layers.Layer):  # makes no batch norm
        def build(self, input_shape):
            self.dense = keras.layers.Dense(input_shape[-1], name="dense")
            self.dense.build(input_shape)

        def call(self, x):
            return self.dense(x)

    data = (rng.standard_normal((6, 3)) * 2 + 1).astype(np.float32)
    cases = {  # the model, and the classes of the custom layers in it
        "layer in a Sequential": (lambda: keras.Sequential([LazyBlock(name="lazy")]), [LazyBlock]),
        "layer held by a layer": (
            lambda: keras.Sequential([LazyOwner(name="owner")]), [LazyOwner, LazyBlock]),
        "layer held by a layer with Keras's build": (
            lambda: keras.Sequential([LazyHolder(name="holder")]), [LazyHolder, LazyBlock]),
        "subclassed model": (lambda: LazyNet(name="net"), [LazyNet]),
    }

    def custom(model):
        return [layer for layer in every_layer(model) if type(layer).__module__ == __name__
                or getattr(type(layer), "__qualname__", "").startswith("Synchronized")]

    done = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not yet been built")  # Keras's, saving unbuilt
        for where, (make, classes) in cases.items():
            synced = convert(make())
            assert not synced.built and kinds(synced) == (0, 0), where
            unbuilt_names = [type(layer).__name__ for layer in custom(synced)]
            path = os.path.join(tmp, "unbuilt.keras")
            synced.save(path)
            for what, model in (("loaded", keras.models.load_model(path)), ("copy", synced),
                                ("clone_model", keras.models.clone_model(synced))):
                label = f"{where}, {what}"
                model(data)  # builds it
                assert kinds(model) == (0, 1), (label, kinds(model))
                bn = [layer for layer in every_layer(model) if isinstance(layer, SyncBatchNormalization)][0]
                owner = [layer for layer in every_layer(model) if getattr(layer, "bn", None) is bn][0]
                x = np.asarray(owner.dense(data)) if hasattr(owner, "dense") else data
                before = {w.path.split("/")[-1]: np.asarray(w.numpy(), np.float64) for w in bn.weights}
                y = np.asarray(model(data, training=True))
                after = {w.path.split("/")[-1]: np.asarray(w.numpy()) for w in bn.weights}
                ref = oracle.batch_norm([x], [np.zeros_like(x)], gamma=before["gamma"],
                                        beta=before["beta"], eps=bn.epsilon, momentum=bn.momentum,
                                        moving_mean=before["moving_mean"], moving_var=before["moving_variance"])
                # float32 over 6 rows with |x| <= 20 and |mean| < 3 std (asserted): the mean is off
                # by about 6 roundings (u = 6e-8) of |x|, the variance by as many relative to
                # (1 + (mean/std)^2), so xhat (|xhat| < sqrt(5) over 6 rows, gamma 1, beta 0) by
                # well under 1e-5; the moving statistics, blends of those, by 1e-5 relative
                assert np.max(np.abs(x)) <= 20 and np.all(np.abs(x.mean(0)) < 3 * x.std(0)), label
                assert np.all(np.isfinite(y)), label
                np.testing.assert_allclose(y, ref["y"][0], rtol=2e-5, atol=2e-5, err_msg=label)
                for name, key in (("moving_mean", "moving_mean"), ("moving_variance", "moving_var")):
                    np.testing.assert_allclose(after[name], ref[key], rtol=1e-5, atol=1e-6, err_msg=label)
            # the file names the converted class, never the custom layer's own: without
            # syncbn.keras, Keras's "Could not locate class" rather than a plain model
            assert unbuilt_names == [f"Synchronized{cls.__name__}" for cls in classes], (where, unbuilt_names)
            assert "syncbn>Synchronized" in saved_classes(path), (where, saved_classes(path))
            assert not any(str(name).startswith("syncbn_roundtrip>") for name in saved_classes(path)), where
            plain = revert(synced)
            assert kinds(plain) == (1, 0) and [type(layer) for layer in custom(plain)] == classes, where
            unbuilt = revert(convert(make()))  # an unbuilt copy's revert: built later, plain
            unbuilt(data)
            assert kinds(unbuilt) == (1, 0) and [type(layer) for layer in custom(unbuilt)] == classes, where
            done.append(where)

        # a custom layer that makes no batch norm: the converted class only until built
        def make():
            return keras.Sequential([DenseInBuild(name="custom"), keras.layers.Dense(2, name="head")],
                                    name="model")

        synced = convert(make())
        path = os.path.join(tmp, "unbuilt.keras")
        synced.save(path)
        reference = make()
        reference(data)
        for what, model in (("loaded", keras.models.load_model(path)), ("copy", synced)):
            assert type(model.layers[0]).__name__ == "SynchronizedDenseInBuild", (what, type(model.layers[0]))
            model(data)
            assert type(model.layers[0]) is DenseInBuild, (what, type(model.layers[0]))
            assert [w.path for w in model.weights] == [w.path for w in reference.weights], what
            weights = os.path.join(tmp, f"{what}.weights.h5")
            model.save_weights(weights)
            reference.load_weights(weights)  # group names by class, as the plain model's
            for a, b in zip(model.get_weights(), reference.get_weights()):
                np.testing.assert_array_equal(b, a, err_msg=what)
        done.append("no batch norm")
    return {"cases": len(done)}


@check
def built_owner_of_an_unbuilt_layer_saves_synchronized():
    """A converted model that is built but holds a custom layer not yet built that makes
    its batch norm layer in its own ``build()`` (a block that its owner runs only in
    training, so that the owner is built by an inference call, or by the symbolic call of a
    Functional model, and the block is not): saved to a ``.keras`` file before the block is
    built, the file names the converted class for the block and its built owner, and loaded
    (and the copy, ``clone_model`` of it and ``from_config`` of its config) a training call
    synchronizes its batch norm and the next one matches the float64 oracle; the loaded
    owner has the saved weights. Before the fix a built owner kept its own class, and the
    file loaded back plain without a word (converting an unbuilt model and calling it in
    inference gave the converted class, as it does now). A block that makes no batch norm
    gives its owner and itself their own classes back once built, and a ``.weights.h5`` file
    saved then loads into the plain model; ``revert`` of the copy is plain. A keras_hub task
    without batch norm keeps its class and its preprocessor's (which runs on the data and
    stays unbuilt): without that exception both took the converted class."""
    import os
    import tempfile
    import warnings

    import keras

    import keras_oracle as oracle
    from syncbn.keras import SyncBatchNormalization, convert, revert

    rng = np.random.default_rng(47)
    LazyBlock = lazy_classes()[0]
    register = keras.saving.register_keras_serializable(package="syncbn_roundtrip")

    @register
    class DenseOnlyInBuild(keras.layers.Layer):  # makes no batch norm
        def build(self, input_shape):
            self.dense = keras.layers.Dense(input_shape[-1], name="dense")
            self.dense.build(input_shape)

        def call(self, x, training=None):
            return self.dense(x)

    def block_of(kind):
        return LazyBlock(name="block") if kind == "batch norm" else DenseOnlyInBuild(name="block")

    def forward(owner, x, training):
        y = x * owner.scale
        if training:  # the block runs in training only: an inference call leaves it unbuilt
            y = y + owner.block(y, training=training)
        return y

    @register
    class TrainingOnlyBlock(keras.layers.Layer):  # builds its own weight, not the block
        def __init__(self, kind="batch norm", **kwargs):
            super().__init__(**kwargs)
            self.kind = kind
            self.block = block_of(kind)

        def build(self, input_shape):
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

        def call(self, x, training=None):
            return forward(self, x, training)

        def get_config(self):
            return {**super().get_config(), "kind": self.kind}

    @register
    class TrainingOnlyNet(keras.Model):
        def __init__(self, kind="batch norm", **kwargs):
            super().__init__(**kwargs)
            self.kind = kind
            self.block = block_of(kind)

        def build(self, input_shape):
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

        def call(self, x, training=None):
            return forward(self, x, training)

        def get_config(self):
            return {**super().get_config(), "kind": self.kind}

    data = (rng.standard_normal((6, 3)) * 2 + 1).astype(np.float32)

    def functional(kind="batch norm"):  # built as it is made (the symbolic call: inference)
        return keras.Sequential([keras.Input((3,)), TrainingOnlyBlock(kind, name="owner")], name="model")

    def subclassed(kind="batch norm"):  # built by a call in inference
        net = TrainingOnlyNet(kind, name="net")
        net(data)
        return net

    cases = {"layer in a Functional model": (functional, TrainingOnlyBlock),
             "subclassed model called in inference": (subclassed, TrainingOnlyNet)}
    done = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not yet been built")  # Keras's, of the block
        for where, (make, owner_class) in cases.items():
            model = make()
            randomize(model, rng)  # the owner's scale away from ones
            synced = convert(model)
            owner = [layer for layer in every_layer(synced) if isinstance(layer, owner_class)][0]
            assert synced.built and owner.built and not owner.block.built, where
            names = [type(layer).__name__ for layer in (owner, owner.block)]
            path = os.path.join(tmp, "built.keras")
            synced.save(path)
            plain = revert(synced)  # before the block is built: built later, plain
            assert [type(layer) for layer in every_layer(plain) if type(layer).__module__ == __name__] == [
                owner_class, LazyBlock], where
            plain(data, training=True)
            assert kinds(plain) == (1, 0), (where, kinds(plain))
            copies = (("loaded", keras.models.load_model(path)), ("copy", synced),
                      ("clone_model", keras.models.clone_model(synced)),
                      ("from_config", type(synced).from_config(synced.get_config())))
            for what, copy in copies:
                label = f"{where}, {what}"
                if what == "loaded":  # the owner's weights as saved (the block's are made when built)
                    for a, b in zip(synced.get_weights(), copy.get_weights()):
                        np.testing.assert_array_equal(b, a, err_msg=label)
                copy(data, training=True)  # builds the block
                assert kinds(copy) == (0, 1), (label, kinds(copy))
                held = [layer for layer in every_layer(copy) if isinstance(layer, owner_class)][0]
                bn = held.block.bn
                assert isinstance(bn, SyncBatchNormalization), label
                scaled = data * np.asarray(held.scale.numpy())  # float32, as the backend rounds it
                x = np.asarray(held.block.dense(scaled))
                before = {w.path.split("/")[-1]: np.asarray(w.numpy(), np.float64) for w in bn.weights}
                y = np.asarray(copy(data, training=True))
                after = {w.path.split("/")[-1]: np.asarray(w.numpy()) for w in bn.weights}
                ref = oracle.batch_norm([x], [np.zeros_like(x)], gamma=before["gamma"],
                                        beta=before["beta"], eps=bn.epsilon, momentum=bn.momentum,
                                        moving_mean=before["moving_mean"], moving_var=before["moving_variance"])
                # the batch norm's output as in unbuilt_copy_saved_loads_synchronized (well under
                # 1e-5 off), plus ``scaled`` (|scaled| < 20, asserted) in float32: one more rounding
                # of the sum, under 20 * 6e-8 = 1.2e-6
                assert np.max(np.abs(x)) <= 20 and np.max(np.abs(scaled)) <= 20, label
                assert np.all(np.abs(x.mean(0)) < 3 * x.std(0)), label
                assert np.all(np.isfinite(y)), label
                np.testing.assert_allclose(y, scaled + ref["y"][0], rtol=2e-5, atol=2e-5, err_msg=label)
                for name, key in (("moving_mean", "moving_mean"), ("moving_variance", "moving_var")):
                    np.testing.assert_allclose(after[name], ref[key], rtol=1e-5, atol=1e-6, err_msg=label)
            # the file names the converted class for the block and its built owner: without
            # syncbn.keras, Keras's "Could not locate class" rather than a plain model
            assert names == [f"Synchronized{owner_class.__name__}", "SynchronizedLazyBlock"], (where, names)
            assert "syncbn>Synchronized" in saved_classes(path), (where, saved_classes(path))
            assert not any(str(name).startswith("syncbn_roundtrip>") for name in saved_classes(path)), where
            done.append(where)

        # a block that makes no batch norm: the converted classes only until it is built
        for where, (make, owner_class) in cases.items():
            reference = make("no batch norm")
            synced = convert(reference)
            path = os.path.join(tmp, "built.keras")
            synced.save(path)
            reference(data, training=True)
            for what, copy in (("loaded", keras.models.load_model(path)), ("copy", synced)):
                label = f"{where}, no batch norm, {what}"
                owner = [layer for layer in every_layer(copy) if isinstance(layer, owner_class)][0]
                assert type(owner).__name__ == f"Synchronized{owner_class.__name__}", (label, type(owner))
                copy(data, training=True)
                assert [type(owner), type(owner.block)] == [owner_class, DenseOnlyInBuild], label
                # paths follow layer names, never the class (Keras names a copy built in a
                # Functional model's call otherwise than the original, with or without syncbn)
                assert [w.path.split("/")[-1] for w in copy.weights] == [
                    w.path.split("/")[-1] for w in reference.weights], label
                assert not any("synchronized" in w.path.lower() for w in copy.weights), label
                weights = os.path.join(tmp, f"{what}.weights.h5")
                copy.save_weights(weights)
                reference.load_weights(weights)  # group names by class, as the plain model's
                for a, b in zip(copy.get_weights(), reference.get_weights()):
                    np.testing.assert_array_equal(b, a, err_msg=label)
            done.append(f"{where}, no batch norm")

    # a keras_hub task's preprocessor, which runs on the data, not in the model's call, and
    # is never built by it: a task without batch norm keeps its class (its preset, its file)
    import importlib.util

    if importlib.util.find_spec("keras_hub") is not None:
        import keras_hub

        vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "fox"]
        preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
            keras_hub.models.BertTokenizer(vocabulary=vocabulary), sequence_length=8)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=len(vocabulary), num_layers=1, num_heads=2, hidden_dim=8,
            intermediate_dim=16, max_sequence_length=8)
        task = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=preprocessor)
        synced = convert(task)
        assert not synced.preprocessor.built, "keras_hub task"
        assert [type(layer) for layer in (synced, synced.preprocessor, synced.backbone)] == [
            type(layer) for layer in (task, task.preprocessor, task.backbone)], (
            type(synced), type(synced.preprocessor), type(synced.backbone))
        done.append("keras_hub task without batch norm")
    return {"cases": len(done)}


def exported_pair(build, rng):
    """A plain model of ``build()`` with every weight redrawn, and its converted copy."""
    from syncbn.keras import convert

    plain = build()
    for layer in plain.layers:
        if layer.weights:
            randomize(layer, rng)
    return plain, convert(plain)


@check
def export_serves_keras_predictions():
    """Deployment of a converted model in one process. ``model.export`` (a TensorFlow
    SavedModel; through jax2tf on JAX) serves exactly what the plain model's export
    serves (inference uses the moving statistics through Keras's own op). A training
    endpoint (``keras.export.ExportArchive``, ``training=True``) traced with no
    distribution is one replica's batch norm with its gradient kept: output and input
    gradient of the reloaded artifact match Keras's layer's exported the same way. On
    TensorFlow, ``TFLiteConverter.from_keras_model`` gives exactly the plain model's
    TFLite output."""
    import os
    import tempfile

    import keras
    import tensorflow as tf

    rng = np.random.default_rng(38)

    def build():
        inputs = keras.Input((4, 3), name="x")
        h = keras.layers.BatchNormalization(momentum=0.5, name="bn_a")(keras.layers.Dense(3, name="dense")(inputs))
        return keras.Model(inputs, keras.layers.BatchNormalization(axis=1, name="bn_b")(keras.layers.Multiply(name="square")([h, h])), name="net")

    plain, synced = exported_pair(build, rng)
    x = (rng.standard_normal((6, 4, 3)) * 2 + 3).astype(np.float32)
    dy = rng.standard_normal((6, 4, 3)).astype(np.float32)
    spec = [tf.TensorSpec((None, 4, 3), tf.float32)]

    def training_call(model):
        return lambda v: model(v, training=True)

    info = {}
    with tempfile.TemporaryDirectory() as tmp:
        served, trained = {}, {}
        for name, model in (("plain", plain), ("synced", synced)):
            path = os.path.join(tmp, f"{name}_serve")
            model.export(path)
            artifact = tf.saved_model.load(path)
            served[name] = artifact.serve(tf.constant(x)).numpy()

            archive = keras.export.ExportArchive()
            archive.track(model)
            archive.add_endpoint("train", training_call(model), input_signature=spec)
            path = os.path.join(tmp, f"{name}_train")
            archive.write_out(path, verbose=False)
            artifact = tf.saved_model.load(path)
            xt = tf.constant(x)
            with tf.GradientTape() as tape:
                tape.watch(xt)
                y = artifact.train(xt)
            dx = tape.gradient(y, xt, output_gradients=tf.constant(dy))
            assert dx is not None, f"{name}: the exported training endpoint has no gradient"
            trained[name] = (y.numpy(), dx.numpy())
    assert np.all(np.isfinite(served["synced"])), "exported inference is not finite"
    np.testing.assert_array_equal(served["synced"], served["plain"], err_msg="model.export")
    here = np.asarray(synced(x, training=False))
    assert nan_safe.max_abs_diff(served["synced"], here) <= 1e-5 * max(1.0, float(np.max(np.abs(here))))
    for i, key in enumerate(("y", "dx")):
        ours, keras_ = trained["synced"][i], trained["plain"][i]
        info[f"train endpoint {key}"] = err = nan_safe.max_abs_diff(ours, keras_)
        assert err <= 1e-4 * max(1.0, float(np.max(np.abs(keras_)))), (key, err)

    if keras.backend.backend() == "tensorflow":
        tflite = {}
        for name, model in (("plain", plain), ("synced", synced)):
            interpreter = tf.lite.Interpreter(model_content=tf.lite.TFLiteConverter.from_keras_model(model).convert())
            index = interpreter.get_input_details()[0]["index"]
            interpreter.resize_tensor_input(index, x.shape)
            interpreter.allocate_tensors()
            interpreter.set_tensor(index, x)
            interpreter.invoke()
            tflite[name] = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
        assert np.all(np.isfinite(tflite["synced"])), "TFLite inference is not finite"
        np.testing.assert_array_equal(tflite["synced"], tflite["plain"], err_msg="TFLite")
        info["tflite"] = "equal"
    return info


# ------------------------------------------------------- state outside configs and weights


def assert_same_inference(copies, model, x, where):
    """Each copy's inference output is exactly ``model``'s."""
    import keras

    want = np.asarray(keras.ops.convert_to_numpy(model(x, training=False)))
    for label, copy in copies.items():
        got = np.asarray(keras.ops.convert_to_numpy(copy(x, training=False)))
        assert np.all(np.isfinite(got)), f"{where}, {label}: not finite"
        np.testing.assert_array_equal(got, want, err_msg=f"{where}, {label}")


@check
def convert_keeps_adapted_preprocessing_state():
    """Preprocessing layers after ``adapt``: a Normalization's mean and variance (its
    weights, from which it derives what it computes with only when it loads) and an
    IntegerLookup's vocabulary (no weight at all) carry over to ``convert(model)`` and
    ``revert(convert(model))``, whose outputs are exactly the original's. A copy from
    configs and ``set_weights`` normalized with mean 0, variance 1 (silently), and its
    lookup raised "Table not initialized"."""
    import keras

    from syncbn.keras import convert, revert

    rng = np.random.default_rng(40)
    x = (rng.standard_normal((8, 4)) * 3 + 2).astype(np.float32)
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(x)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(norm(inputs)))
    randomize(model.get_layer("bn"), rng)
    synced = convert(model)
    assert_same_inference({"convert": synced, "revert(convert)": revert(synced)}, model, x, "adapted Normalization")

    lookup = keras.layers.IntegerLookup(name="lookup")
    lookup.adapt(np.array([[5, 7, 9, 5, 5, 11]]))
    ids = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(8, 2, name="embed")(lookup(ids))
    model = keras.Model(ids, keras.layers.BatchNormalization(name="bn")(h))
    randomize(model.get_layer("bn"), rng)
    synced = convert(model)
    tokens = np.array([[5, 9, 3], [7, 11, 5]], np.int32)
    assert_same_inference({"convert": synced, "revert(convert)": revert(synced)}, model, tokens, "adapted IntegerLookup")
    return {"vocabulary": len(synced.get_layer("lookup").get_vocabulary())}


@check
def convert_keeps_lora_adapters_as_they_are():
    """A Dense and an Embedding with LoRA enabled part way through fine-tuning: the copies
    hold the same frozen kernel and the same adapter factors. Copied through a layer's
    save/load (as a ``.keras`` file is) the kernel came with the adapter merged in and both
    factors zero: the same outputs, but no gradient ever reaches a zero pair of factors,
    so fine-tuning the copy changed nothing."""
    import keras

    from syncbn.keras import convert, revert

    rng = np.random.default_rng(41)
    ids = keras.Input((3,), dtype="int32")
    h = keras.layers.Embedding(10, 4, name="embed")(ids)
    h = keras.layers.Dense(4, name="dense")(h)
    model = keras.Model(ids, keras.layers.BatchNormalization(name="bn")(h))
    randomize(model.get_layer("bn"), rng)
    for name in ("embed", "dense"):
        layer = model.get_layer(name)
        layer.enable_lora(2)
        for w in (layer.lora_embeddings_b if name == "embed" else layer.lora_kernel_b,):
            w.assign(rng.uniform(-1.0, 1.0, tuple(w.shape)).astype(np.float32))
    expected = {w.path: keras.ops.convert_to_numpy(w) for w in model.weights}
    synced = convert(model)
    for where, copy in (("convert", synced), ("revert(convert)", revert(synced))):
        got = {w.path: keras.ops.convert_to_numpy(w) for w in copy.weights}
        assert sorted(got) == sorted(expected), (where, sorted(got))
        for path, value in expected.items():
            np.testing.assert_array_equal(got[path], value, err_msg=f"{where}: {path}")
    return {"lora variables": sum("lora" in path for path in expected)}


@check
def convert_keeps_stateful_rnn_states():
    """A stateful GRU part way through its sequences: the copies hold its current states
    (which neither ``clone_model`` nor a ``.keras`` file keeps), so they go on exactly as
    the original does."""
    import keras

    from syncbn.keras import convert, revert

    rng = np.random.default_rng(41)
    inputs = keras.Input(batch_shape=(2, 3, 4))
    h = keras.layers.BatchNormalization(name="bn")(inputs)
    model = keras.Model(inputs, keras.layers.GRU(3, stateful=True, name="gru")(h))
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    model(x)
    model(x)  # states away from zero
    states = [np.array(keras.ops.convert_to_numpy(s)) for s in model.get_layer("gru").states]
    assert any(np.abs(s).max() > 0.01 for s in states), "vacuous: the states did not move"
    synced = convert(model)
    back = revert(synced)
    for label, copy in (("convert", synced), ("revert(convert)", back)):
        got = [np.array(keras.ops.convert_to_numpy(s)) for s in copy.get_layer("gru").states]
        for a, b in zip(got, states):
            np.testing.assert_array_equal(a, b, err_msg=f"{label}: stateful GRU's states")
    # each call moves the states, so each model is called once, from the same states
    assert_same_inference({"convert": synced, "revert(convert)": back}, model, x, "stateful GRU")
    return {}


@check
def convert_keeps_trainable_flags_of_models():
    """A frozen Functional model (``model.trainable = False``) and a frozen nested model:
    every layer's ``trainable`` flag in the copies is the original's, the models' and
    their input layers' included (``clone_model`` sets them back to True)."""
    import keras

    from syncbn.keras import convert, revert

    def flags(model):
        return [(layer.name, layer.trainable) for layer in model._flatten_layers()]

    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.BatchNormalization()], name="inner")
    inner.trainable = False
    inputs = keras.Input((4,))
    nested = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(inner(inputs)), name="nested")
    inputs = keras.Input((4,))
    frozen = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(4)(inputs)), name="frozen")
    frozen.trainable = False
    info = {}
    for model in (nested, frozen):
        synced = convert(model)
        for label, copy in (("convert", synced), ("revert(convert)", revert(synced))):
            assert flags(copy) == flags(model), (model.name, label, flags(copy), flags(model))
            assert [w.path for w in copy.trainable_weights] == [w.path for w in model.trainable_weights], (model.name, label)
        info[model.name] = sum(not t for _, t in flags(model))
    return {"frozen layers": info}


@check
def converted_copy_is_not_compiled():
    """``convert`` and ``revert`` never compile their copy, as documented (compile it in
    the strategy's scope): a compiled Functional model gave a compiled copy (through
    ``clone_model``, with a fresh optimizer) where a subclass gave an uncompiled one. The
    original stays compiled."""
    import keras

    from syncbn.keras import convert, revert

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(4)(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    synced = convert(model)
    assert not synced.compiled and getattr(synced, "optimizer", None) is None, "convert compiled its copy"
    assert not revert(synced).compiled, "revert compiled its copy"
    assert model.compiled and model.optimizer is not None, "the original lost its compile state"
    return {}


@check
def convert_refuses_what_is_no_keras_layer():
    """``convert`` and ``revert`` of something that is no Keras layer or model (None, a
    list of layers, a string) raise a ``TypeError`` naming what they were given: the
    walk over the model's attributes ran first and raised Python's "vars() argument must
    have __dict__ attribute", which said nothing of the mistake."""
    import keras

    from syncbn.keras import convert, revert

    for swap in (convert, revert):
        for value, kind in ((None, "NoneType"), ([keras.layers.BatchNormalization()], "list"), ("net", "str")):
            try:
                swap(value)
            except TypeError as err:
                message = str(err)
                assert f"syncbn.keras.{swap.__name__}: expected a Keras model or layer" in message, message
                assert kind in message, message
            else:
                raise AssertionError(f"{swap.__name__}({value!r}) raised nothing")
    return {}


@check
def convert_finds_layers_in_nested_containers_and_sets():
    """A batch norm layer that a custom layer or subclassed model holds in a set, or in
    containers nested in each other (a list of dicts of tuples), is one Keras tracks
    (its weights are the model's), and ``convert`` synchronizes it: the walk looked one
    container deep and skipped sets, so the copy kept a plain BatchNormalization, which
    trained on each replica's batch alone, with no warning. ``revert`` makes it plain
    again; inference outputs are the original's exactly (the same weights, the same op)."""
    import keras

    from syncbn.keras import SyncBatchNormalization, convert, revert

    class Nested(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [{"a": (keras.layers.BatchNormalization(), keras.layers.Dense(4))}]
            self.norms = {keras.layers.BatchNormalization(momentum=0.5)}

        def call(self, x):
            for norm in self.norms:
                x = norm(x)
            block = self.blocks[0]["a"]
            return block[1](block[0](x))

    class NestedModel(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.pairs = ((keras.layers.BatchNormalization(),),)

        def call(self, x):
            return self.pairs[0][0](x)

    rng = np.random.default_rng(11)
    x = rng.normal(size=(5, 4)).astype("float32")
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, Nested()(inputs))
    subclassed = NestedModel()
    subclassed(x)
    for model in (functional, subclassed):
        randomize(model, rng)
        norms = [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
        synced = convert(model)
        kinds = [type(layer) for layer in synced._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
        assert kinds == [SyncBatchNormalization] * len(norms), f"{model.name}: {kinds}"
        back = revert(synced)
        kinds = [type(layer) for layer in back._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
        assert kinds == [keras.layers.BatchNormalization] * len(norms), f"{model.name}: reverted {kinds}"
        want = keras.ops.convert_to_numpy(model(x))
        for copy in (synced, back):
            err = nan_safe.max_abs_diff(keras.ops.convert_to_numpy(copy(x)), want)
            assert err == 0.0, f"{model.name}: inference outputs differ by {err}"
    return {}


@check
def convert_warns_of_attributes_outside_the_config():
    """A custom layer's attribute set after construction (not in its config) cannot be
    copied from configs: ``convert`` warns, naming the layer and the attribute (as a copy
    by ``clone_model`` or a ``.keras`` file, the copy has the constructor's value). An
    attribute the copy has alike gives no warning."""
    import warnings

    import keras

    from syncbn.keras import convert

    @keras.saving.register_keras_serializable(package="syncbn_state")
    class Scale(keras.layers.Layer):
        def __init__(self, name=None, **kwargs):
            super().__init__(name=name, **kwargs)
            self.factor = 1.0

        def call(self, x):
            return x * self.factor

    def converted(layer, bn=None):
        inputs = keras.Input((4,))
        bn = bn or keras.layers.BatchNormalization(name="bn")
        model = keras.Model(inputs, bn(layer(inputs)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            convert(model)
        return [str(w.message) for w in caught if "attributes" in str(w.message)]

    assert converted(Scale(name="scale")) == [], "warned of an attribute the copy has alike"
    layer = Scale(name="scale")
    layer.factor = 5.0
    messages = converted(layer)
    assert len(messages) == 1 and "scale.factor (5.0; the copy has 1.0)" in messages[0], messages
    # on a batch norm itself, which convert swaps for a SyncBatchNormalization (it was dropped
    # without a word)
    bn = keras.layers.BatchNormalization(name="bn")
    bn.frozen_by = "user"
    messages = converted(Scale(name="scale"), bn)
    assert len(messages) == 1 and "bn.frozen_by ('user'; the copy has 'no such attribute')" in messages[0], messages
    return {}



def restructured_classes():
    """Custom layers whose copy from their config has other sub-layers than they: ``Block``
    (an adapted Normalization, a Dense and a BatchNormalization) makes a Dropout when its
    ``rate`` is not 0 but its get_config() leaves ``rate`` out; ``Normed`` makes a
    LayerNormalization or a GroupNormalization (variables of the same shapes) by ``kind``,
    which its get_config() leaves out; ``Gated`` makes its ``gate`` Dense in the call that
    builds it, only when that call trains; ``Net``, a subclassed model, has its ``head``
    assigned again before it is built."""
    import keras

    layers = keras.layers
    register = keras.saving.register_keras_serializable(package="syncbn_restructured")

    @register
    class Block(layers.Layer):
        def __init__(self, units=4, rate=0.0, **kwargs):
            super().__init__(**kwargs)
            self.units, self.rate = units, rate
            self.norm = layers.Normalization()
            self.dense = layers.Dense(units)
            if rate:
                self.drop = layers.Dropout(rate)
            self.bn = layers.BatchNormalization()

        def build(self, shape):
            self.norm.build(shape)
            self.dense.build(shape)
            self.bn.build(tuple(shape[:-1]) + (self.units,))

        def call(self, x, training=None):
            h = self.dense(self.norm(x))
            if self.rate:
                h = self.drop(h, training=training)
            return self.bn(h, training=training)

        def get_config(self):
            return {**super().get_config(), "units": self.units}  # ``rate`` forgotten

    @register
    class Normed(layers.Layer):
        def __init__(self, kind="group", **kwargs):
            super().__init__(**kwargs)
            self.kind = kind
            self.norm = layers.LayerNormalization() if kind == "layer" else layers.GroupNormalization(groups=2)

        def build(self, shape):
            self.norm.build(shape)

        def call(self, x):
            return self.norm(x)

        def get_config(self):
            return super().get_config()  # ``kind`` forgotten

    @register
    class Gated(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.gate = None
            self.bn = layers.BatchNormalization()

        def call(self, x, training=None):
            if training and self.gate is None:
                self.gate = layers.Dense(x.shape[-1])
            h = self.bn(x, training=training)
            return h if self.gate is None else h * self.gate(x)

    @register
    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.body = layers.Dense(3)
            self.bn = layers.BatchNormalization()
            self.head = layers.Dense(2)

        def call(self, x, training=None):
            return self.head(self.bn(self.body(x), training=training))

    return Block, Normed, Gated, Net


@check
def convert_pairs_sub_layers_where_the_copy_differs():
    """A layer whose copy from its config has other sub-layers than it (a constructor
    argument missing from get_config(), a sub-layer made by a training call or assigned
    again before building): its copy gets the state of every sub-layer it has alike,
    paired by where it is held, and a warning names each stateless sub-layer that differs;
    where state would be lost (a sub-layer holding variables without a counterpart of its
    class and shapes) ``convert`` raises, naming it and the fix. The copy was given
    ``set_weights`` alone there, without a word: an adapted Normalization's mean and
    variance went back to 0 and 1 (outputs off by about 3 here), a LayerNormalization's
    weights went into a GroupNormalization, and the other cases raised Keras's errors
    naming weight counts or shapes."""
    import warnings

    import keras

    from syncbn.keras import SyncBatchNormalization, convert

    Block, Normed, Gated, Net = restructured_classes()
    rng = np.random.default_rng(44)
    x = (rng.standard_normal((16, 3)) * 3 + 2).astype(np.float32)

    def converted(model):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            synced = convert(model)
        return synced, [str(w.message) for w in caught if "syncbn.keras.convert" in str(w.message)]

    def block_in_model():
        block = Block(rate=0.5, name="block")
        inputs = keras.Input((3,))
        return keras.Model(inputs, block(inputs)), block

    def block_alone():
        block = Block(rate=0.5, name="block")
        block(x)
        return block, block

    info = {}
    for label, make in (("in a Functional model", block_in_model), ("alone", block_alone)):
        model, block = make()
        block.norm.adapt(x)
        randomize(block.bn, rng)
        synced, messages = converted(model)
        copy = synced if synced.name == "block" else synced.get_layer("block")
        assert type(copy.bn) is SyncBatchNormalization, (label, type(copy.bn))
        assert not hasattr(copy, "drop"), (label, "vacuous: the copy has the Dropout")
        assert_same_inference({"convert": synced}, model, x, f"Block {label}")
        assert len(messages) == 2, (label, messages)
        assert "block.rate (0.5; the copy has 0.0)" in messages[0], (label, messages)
        assert "block/drop (Dropout; the copy has no layer)" in messages[1] and "get_config()" in messages[1], (
            label, messages)
        info[f"Block {label}"] = messages[1].split("otherwise in it: ")[1].split(". ")[0]

    def raises(model, *needles):
        try:
            convert(model)
        except ValueError as err:
            message = str(err)
        else:
            raise AssertionError(f"convert copied {model.name!r} without a word")
        for needle in needles + ("get_config()", "__init__() or build()"):
            assert needle in message, (needle, message)
        return message.split("made afresh: ")[1].split(". Make")[0]

    normed = Normed(kind="layer", name="normed")
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(normed(inputs)))
    randomize(normed, rng)
    info["Normed"] = raises(model, "normed/norm (LayerNormalization; the copy has GroupNormalization), holding 2 "
                            "variables in the original and 2 variables in the copy")

    gated = Gated(name="gated")
    gated(x, training=True)
    assert gated.gate is not None, "vacuous: the training call made no gate"
    info["Gated"] = raises(gated, "gated/gate (Dense; the copy has no layer), holding 2 variables in the original")

    net = Net(name="net")
    net.head = keras.layers.Dense(5)
    net(x)
    info["Net"] = raises(net, "net/head (Dense): variables of shapes [(3, 5), (5,)]; the copy's are [(3, 2), (2,)]")
    return {"named": info}


def converted_or_raised(model):
    """``(copy, None)`` from ``convert(model)``, or ``(None, message)`` of its ValueError."""
    from syncbn.keras import convert

    try:
        return convert(model), None
    except ValueError as err:
        return None, str(err)


@check
def convert_raises_where_a_sub_layer_is_configured_otherwise():
    """A custom layer whose sub-layer was replaced before building by one of the same
    class and weight shapes but other arguments (``Dense(2, activation="softmax")`` for
    the constructor's ``Dense(2)``), or changed after construction: its copy from its
    config has the constructor's sub-layer, which computes something else. ``convert``
    copied it without a word (outputs off by about 1.5, the softmax gone); it raises now,
    naming the sub-layer, the config entry and the fix, built or not, alone or in a
    Functional model. The same layer left alone converts exactly, and so does one holding
    an adapted IntegerLookup, whose config names its vocabulary's size only once adapted
    (or, in the copy, once its vocabulary is loaded: compared before, it raised)."""
    import keras

    from syncbn.keras import convert, revert

    layers = keras.layers

    @keras.saving.register_keras_serializable(package="syncbn_reconfigured")
    class Headed(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.body = layers.Dense(3)
            self.bn = layers.BatchNormalization()
            self.head = layers.Dense(2)

        def call(self, x, training=None):
            return self.head(self.bn(self.body(x), training=training))

    rng = np.random.default_rng(45)
    x = rng.standard_normal((8, 5)).astype(np.float32)

    def in_model(layer):
        inputs = keras.Input((5,))
        return keras.Model(inputs, layer(inputs))

    plain = Headed(name="headed")
    plain(x)
    randomize(plain.bn, rng)
    assert_same_inference({"convert": convert(plain)}, plain, x, "Headed left alone")

    @keras.saving.register_keras_serializable(package="syncbn_reconfigured")
    class Indexed(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.lookup = layers.IntegerLookup()
            self.bn = layers.BatchNormalization()

        def build(self, shape):
            self.bn.build(shape)

        def compute_output_shape(self, shape):  # the lookup cannot be traced on jax
            return shape

        def call(self, ids, training=None):
            return self.bn(keras.ops.cast(self.lookup(ids), "float32"), training=training)

    indexed = Indexed(name="indexed")
    indexed.lookup.adapt(np.array([[5, 7, 9, 5, 5, 11]]))
    inputs = keras.Input((3,), dtype="int32")
    model = keras.Model(inputs, indexed(inputs))
    randomize(indexed.bn, rng)
    synced = convert(model)
    ids = np.array([[5, 7, 9], [5, 11, 3]], np.int32)
    assert_same_inference({"convert": synced, "revert(convert)": revert(synced)}, model, ids, "Indexed")

    named = {}
    for label, change in (
            ("reassigned", lambda layer: setattr(layer, "head", layers.Dense(2, activation="softmax"))),
            ("changed", lambda layer: setattr(layer.head, "activation", keras.activations.softmax))):
        for where, wrap in (("alone, built", lambda layer: (layer(x), layer)[1]), ("in a model", in_model),
                            ("alone, not built", lambda layer: layer)):
            layer = Headed(name="headed")
            change(layer)
            _, message = converted_or_raised(wrap(layer))
            assert message is not None, f"{label}, {where}: converted without a word"
            for needle in ("headed/head (Dense): activation ('softmax'; the copy has 'linear')",
                           "get_config()", "after construction"):
                assert needle in message, (label, where, needle, message)
            named[f"{label}, {where}"] = message.split("something else: ")[1].split(". Make")[0]
    return {"named": named}


@check
def convert_gives_sub_layers_their_frozen_flags_and_lora():
    """What a sub-layer was given after construction that the copy can be given exactly:
    ``trainable=False`` on a sub-layer of a custom layer, of a MultiHeadAttention or of a
    Functional subclass (the keras-hub ``Backbone`` pattern), or on such a subclass nested
    in a model (``task.backbone.trainable = False``, as keras-hub's fine-tuning guides
    freeze a backbone), and LoRA enabled on the attention's projections as keras-hub's
    ``enable_lora`` does. The copies' frozen sub-layers were trainable again (a frozen
    backbone's 8 weights trained in the copy, a frozen batch norm inside a custom layer
    trained), and the LoRA one raised Keras's weight-count error. The copies have the
    original's trainable weights, by path, and its outputs."""
    import keras

    from syncbn.keras import SyncBatchNormalization, convert, revert

    Block = block_class()
    rng = np.random.default_rng(46)
    seq = rng.standard_normal((2, 5, 6)).astype(np.float32)

    def trainable_paths(model):
        return sorted(w.path for w in model.trainable_weights)

    inputs = keras.Input((5, 6))
    mha = keras.layers.MultiHeadAttention(2, 4, name="mha")
    model = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(mha(inputs, inputs)))
    mha._key_dense.trainable = False
    mha._query_dense.enable_lora(2)
    mha._value_dense.enable_lora(2)
    for layer in (mha._query_dense, mha._value_dense):  # adapters away from their initial zeros
        layer.lora_kernel_b.assign(rng.standard_normal(tuple(layer.lora_kernel_b.shape)).astype(np.float32))
    assert len(model.trainable_weights) == 10, ("vacuous", len(model.trainable_weights))
    synced = convert(model)
    copies = {"convert": synced, "revert(convert)": revert(synced)}
    for label, copy in copies.items():
        assert trainable_paths(copy) == trainable_paths(model), (label, trainable_paths(copy), trainable_paths(model))
        for ours, theirs in zip(copy.weights, model.weights):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs),
                                          err_msg=f"{label}: {theirs.path}")
    assert_same_inference(copies, model, seq, "MultiHeadAttention with a frozen and LoRA projections")
    counts = {"mha": len(model.trainable_weights)}

    block = Block(4, name="block")
    x = rng.standard_normal((4, 4)).astype(np.float32)
    block(x)
    block.bn.trainable = False
    block.dense.trainable = False
    synced = convert(block)
    assert type(synced.bn) is SyncBatchNormalization and synced.bn.trainable is False, synced.bn.trainable
    for label, copy in (("convert", synced), ("revert(convert)", revert(synced))):
        assert trainable_paths(copy) == trainable_paths(block), (label, trainable_paths(copy), trainable_paths(block))

    Backbone = backbone_class()
    features = rng.standard_normal((3, 4, 3)).astype(np.float32)
    partly = Backbone(5, name="partly")
    partly.get_layer("embed").trainable = False
    partly.get_layer("embed_norm").trainable = False
    frozen = Backbone(5, name="frozen")
    frozen.trainable = False
    inputs = keras.Input((4, 3))
    task = keras.Model(inputs, keras.layers.Dense(2, name="top")(frozen(inputs)), name="task")
    for model in (partly, task):
        synced = convert(model)
        for label, copy in (("convert", synced), ("revert(convert)", revert(synced))):
            assert trainable_paths(copy) == trainable_paths(model), (model.name, label, trainable_paths(copy))
        assert_same_inference({"convert": synced}, model, features, model.name)
        counts[model.name] = len(model.trainable_weights)
    return {"trainable weights": counts}


def tied_classes():
    """``Tied``, a custom layer that projects onto the embedding matrix of an Embedding it
    is given (weight tying), saving it in its config as Keras asks; ``Untied``, one that
    makes its own Embedding from its arguments, to which another is assigned."""
    import keras

    register = keras.saving.register_keras_serializable(package="syncbn_tied")

    @register
    class Tied(keras.layers.Layer):
        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def build(self, shape):
            if not self.embedding.built:  # called before the embedding is
                self.embedding.build((None,))

        def call(self, x):
            return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))

        def get_config(self):
            return {**super().get_config(), "embedding": keras.saving.serialize_keras_object(self.embedding)}

        @classmethod
        def from_config(cls, config):
            config = dict(config)
            config["embedding"] = keras.saving.deserialize_keras_object(config["embedding"])
            return cls(**config)

    @register
    class Untied(keras.layers.Layer):
        def __init__(self, vocabulary=10, width=4, **kwargs):
            super().__init__(**kwargs)
            self.vocabulary, self.width = vocabulary, width
            self.embedding = keras.layers.Embedding(vocabulary, width)

        def build(self, shape):
            self.embedding.build((None,))

        def call(self, x):
            return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))

        def get_config(self):
            return {**super().get_config(), "vocabulary": self.vocabulary, "width": self.width}

    return Tied, Untied


@check
def convert_keeps_layers_tied_as_a_keras_file_does():
    """An Embedding that a Functional model calls and that a custom layer holds to project
    onto its matrix (weight tying, the custom layer serializing it in its config): a
    ``.keras`` file keeps one Embedding for both, ``clone_model`` two. ``convert`` made two
    without a word (one variable more, which training moves apart); now the copy (and
    ``revert`` of it) holds one Embedding in both places, whichever of the two layers the
    model copies first. A tie that no config says (another Embedding assigned to a layer
    that makes its own) raises ValueError, naming the layer and the fix."""
    import keras

    from syncbn.keras import SyncBatchNormalization, convert, revert

    Tied, Untied = tied_classes()
    layers = keras.layers
    rng = np.random.default_rng(47)
    tokens = rng.integers(0, 10, (4, 3))

    def head_first():  # the head further from the outputs than the embedding: copied first
        embedding = layers.Embedding(10, 4, name="embedding")
        vectors, ids = keras.Input((4,), name="vectors"), keras.Input((3,), dtype="int32", name="ids")
        logits = layers.BatchNormalization(name="bn")(layers.Dense(4, name="mid")(Tied(embedding, name="tied")(vectors)))
        return keras.Model([vectors, ids], [logits, embedding(ids)]), [rng.standard_normal((4, 4)).astype(np.float32), tokens]

    def embedding_first():
        embedding = layers.Embedding(10, 4, name="embedding")
        ids = keras.Input((3,), dtype="int32")
        h = layers.BatchNormalization(name="bn")(layers.Dense(4, name="mid")(embedding(ids)))
        return keras.Model(ids, Tied(embedding, name="tied")(h)), tokens

    info = {}
    for make in (head_first, embedding_first):
        model, x = make()
        randomize(model.get_layer("bn"), rng)
        unique = len(model.weights)
        assert model.get_layer("tied").embedding is model.get_layer("embedding"), "vacuous: not tied"
        assert len(keras.models.clone_model(model).weights) == unique + 1, "vacuous: clone_model keeps the tie"
        synced = convert(model)
        assert type(synced.get_layer("bn")) is SyncBatchNormalization
        for label, copy in (("convert", synced), ("revert(convert)", revert(synced))):
            assert copy.get_layer("tied").embedding is copy.get_layer("embedding"), (make.__name__, label, "untied")
            assert len(copy.weights) == unique, (make.__name__, label, [w.path for w in copy.weights])
            for ours, theirs in zip(keras.tree.flatten(copy(x)), keras.tree.flatten(model(x))):
                np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs),
                                              err_msg=f"{make.__name__}, {label}")
        info[make.__name__] = unique

    embedding = layers.Embedding(10, 4, name="embedding")
    untied = Untied(name="untied")
    untied.embedding = embedding
    ids = keras.Input((3,), dtype="int32")
    model = keras.Model(ids, untied(layers.Dense(4, name="mid")(embedding(ids))), name="model")
    _, message = converted_or_raised(model)
    assert message is not None, "converted an untied copy without a word"
    for needle in ("layer 'embedding' (Embedding) is 2 layers in the copy", "held by 'untied'",
                   "serialize_keras_object()", "deserialize_keras_object()"):
        assert needle in message, (needle, message)
    info["untied"] = message.split("apart): ")[1].split(". A layer")[0]
    return {"weights": info}



def hand_built_classes():
    """A custom layer that makes a Dense and (``norm=True``) a BatchNormalization in its
    constructor and builds them, with a weight of its own, in its ``build()``; a custom
    layer without a ``build()`` of its own (a call builds the sub-layers it reaches, one only
    in training); a subclassed model making a Dense and a BatchNormalization."""
    import keras

    register = keras.saving.register_keras_serializable(package="syncbn_by_hand")

    @register
    class HandBlock(keras.layers.Layer):
        def __init__(self, units, norm=True, **kwargs):
            super().__init__(**kwargs)
            self.units, self.norm = units, norm
            self.dense = keras.layers.Dense(units, name="dense")
            self.bn = keras.layers.BatchNormalization(momentum=0.7, name="bn") if norm else None

        def build(self, input_shape):
            self.dense.build(input_shape)
            self.scale = self.add_weight(shape=(self.units,), initializer="ones", name="scale")
            if self.bn is not None:
                self.bn.build((*input_shape[:-1], self.units))

        def call(self, x, training=None):
            h = self.dense(x) * self.scale
            return h if self.bn is None else self.bn(h, training=training)

        def get_config(self):
            return {**super().get_config(), "units": self.units, "norm": self.norm}

    @register
    class CalledBlock(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4, name="dense")
            self.bn = keras.layers.BatchNormalization(name="bn")
            self.extra = keras.layers.Dense(4, name="extra")

        def call(self, x, training=None):
            h = self.bn(self.dense(x), training=training)
            return self.extra(h) if training else h

        def get_config(self):
            return {**super().get_config(), "name": self.name}

    @register
    class HandNet(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(4, name="dense")
            self.bn = keras.layers.BatchNormalization(name="bn")

        def call(self, x, training=None):
            return self.bn(self.dense(x), training=training)

    return HandBlock, CalledBlock, HandNet


@check
def convert_keeps_weights_of_layers_built_by_hand():
    """Layers built by hand (``layer.build(shape)``) or by an earlier call, held by a model
    that is not built (a Sequential without an ``Input``, a subclassed model not yet called):
    ``convert`` gives each copy the original's weights before the copy is ever called (every
    path and value, the batch norm moving statistics included), its inference outputs are the
    original's, and ``revert`` of it holds them too. Copied from its config and left unbuilt,
    such a layer made fresh weights at the copy's first call, without a word (as
    ``keras.models.clone_model``, which copies no weights, does); a Functional model holding a
    layer whose training-only sub-layer an earlier training call built raised Keras's "was
    never built" error. A layer marked built by hand whose weights no ``build()`` makes (so no
    copy can make them) raises a ``ValueError`` naming it."""
    import keras

    from syncbn.keras import SyncBatchNormalization, convert, revert

    rng = np.random.default_rng(43)
    HandBlock, CalledBlock, HandNet = hand_built_classes()
    x = rng.standard_normal((5, 3)).astype(np.float32)

    def block_built_by_hand(norm):
        block = HandBlock(4, norm=norm, name="block")
        block.build((None, 3))
        return block

    def called_block():
        block = CalledBlock(name="called")
        block(x, training=True)  # builds its training-only sub-layer too
        return block

    def dense_and_bn():
        dense, bn = keras.layers.Dense(4, name="dense"), keras.layers.BatchNormalization(name="bn")
        dense.build((None, 3))
        bn.build((None, 4))
        return keras.Sequential([dense, bn], name="model")

    def hand_net():
        net = HandNet(name="net")
        net.dense.build((None, 3))
        net.bn.build((None, 4))
        return net

    def functional():
        inputs = keras.Input((3,))
        return keras.Model(inputs, called_block()(inputs), name="model")

    cases = {  # what each model holds, and its batch norm layers
        "custom layer with batch norm built by hand": (
            lambda: keras.Sequential([block_built_by_hand(True)], name="model"), 1),
        "custom layer without batch norm built by hand": (
            lambda: keras.Sequential([block_built_by_hand(False), keras.layers.BatchNormalization(name="bn")],
                                     name="model"), 1),
        "custom layer built by an earlier call": (lambda: keras.Sequential([called_block()], name="model"), 1),
        "Dense and BatchNormalization built by hand": (dense_and_bn, 1),
        "Sequential in a Sequential": (
            lambda: keras.Sequential([keras.Sequential([block_built_by_hand(True)], name="inner")], name="model"), 1),
        "subclassed model, its layers built by hand": (hand_net, 1),
        "Functional model, a training-only sub-layer built": (functional, 1),
    }
    info = {}
    for where, (make, bn_count) in cases.items():
        model = make()
        for layer in every_layer(model):
            if layer.built and layer.weights:
                randomize(layer, rng)
        want = [(w.path, np.array(keras.ops.convert_to_numpy(w))) for w in model.weights]
        assert want, f"{where}: vacuous, no weight built"
        synced = convert(model)
        assert kinds(synced) == (0, bn_count), (where, kinds(synced))
        back = revert(synced)
        for label, copy in (("convert", synced), ("revert(convert)", back)):
            got = [(w.path, np.array(keras.ops.convert_to_numpy(w))) for w in copy.weights]
            assert [p for p, _ in got] == [p for p, _ in want], (where, label, [p for p, _ in got], [p for p, _ in want])
            for (path, a), (_, b) in zip(got, want):
                assert np.all(np.isfinite(a)), f"{where}, {label}: {path} is not finite"
                np.testing.assert_array_equal(a, b, err_msg=f"{where}, {label}: {path}")
        # called after the copies were made: the original's first call builds what it builds
        assert_same_inference({"convert": synced, "revert(convert)": back}, model, x, where)
        if type(model) is keras.Sequential:  # Keras's own copy makes them afresh
            cloned = keras.models.clone_model(model)
            cloned(x)
            info[where] = "clone_model keeps them" if all(np.array_equal(keras.ops.convert_to_numpy(a), b)
                                                        for a, (_, b) in zip(cloned.weights, want)) else "clone_model does not"
        else:
            info[where] = len(want)
        assert isinstance(synced, keras.Model) and any(
            isinstance(layer, SyncBatchNormalization) for layer in every_layer(synced)), where

    class Manual(keras.layers.Layer):  # its weight made outside build(): no copy can make it
        def make(self):
            self.w = self.add_weight(shape=(3,), name="w")
            self.built = True

        def call(self, x):
            return x * self.w

    manual = Manual(name="manual")
    manual.make()
    _, message = converted_or_raised(keras.Sequential([manual, keras.layers.BatchNormalization(name="bn")]))
    assert message is not None, "a copy that would start from fresh weights converted without a word"
    for needle in ("'manual' (Manual)", "fresh weights", "Make its weights in its build()"):
        assert needle in message, (needle, message)
    info["marked built by hand"] = message.split(": ")[1].split(", and")[0]
    return info


def train_only_classes():
    """Custom layers that a subclassed model calls only in training (or always, ``always``),
    each making or holding a Conv2D and a BatchNormalization, named where ``named`` (else
    Keras numbers them), for :func:`convert_keeps_weight_paths_of_blocks_built_in_training`."""
    import keras

    register = keras.saving.register_keras_serializable(package="syncbn_train_only")

    def name(named, text):
        return text if named else None

    @register
    class MadeInBuild(keras.layers.Layer):  # makes its layers in build(), builds them there or not
        def __init__(self, built_there=False, named=True, **kwargs):
            super().__init__(**kwargs)
            self.built_there, self.named = built_there, named

        def build(self, input_shape):
            self.conv = keras.layers.Conv2D(4, 3, padding="same", name=name(self.named, "conv"))
            self.bn = keras.layers.BatchNormalization(name=name(self.named, "bn"))
            if self.built_there:
                self.conv.build(input_shape)
                self.bn.build((*input_shape[:-1], 4))

        def call(self, x, training=None):
            return self.bn(self.conv(x), training=training)

        def get_config(self):
            return {**super().get_config(), "built_there": self.built_there, "named": self.named}

    @register
    class Container(keras.layers.Layer):  # holds sub-layers only, no weight of its own
        def __init__(self, named=True, **kwargs):
            super().__init__(**kwargs)
            self.named = named
            self.conv = keras.layers.Conv2D(4, 3, padding="same", name=name(named, "conv"))
            self.bn = keras.layers.BatchNormalization(name=name(named, "bn"))

        def call(self, x, training=None):
            return self.bn(self.conv(x), training=training)

        def get_config(self):
            return {**super().get_config(), "named": self.named}

    @register
    class SequentialHolder(keras.layers.Layer):  # a Sequential (no Input) held by a custom layer
        def __init__(self, named=True, **kwargs):
            super().__init__(**kwargs)
            self.named = named
            self.seq = keras.Sequential([keras.layers.Conv2D(4, 3, padding="same", name=name(named, "conv")),
                                         keras.layers.BatchNormalization(name=name(named, "bn"))],
                                        name=name(named, "seq"))

        def call(self, x, training=None):
            return self.seq(x, training=training)

        def get_config(self):
            return {**super().get_config(), "named": self.named}

    @register
    class TwoDeep(keras.layers.Layer):  # a block holding a block that makes its layers in build()
        def __init__(self, named=True, **kwargs):
            super().__init__(**kwargs)
            self.named = named
            self.inner = MadeInBuild(named=named, name=name(named, "inner"))

        def call(self, x, training=None):
            return self.inner(x, training=training)

        def get_config(self):
            return {**super().get_config(), "named": self.named}

    blocks = {"made in build": MadeInBuild,
              "built in build": lambda **kwargs: MadeInBuild(built_there=True, **kwargs),
              "container": Container, "sequential": SequentialHolder, "two deep": TwoDeep}

    @register
    class TrainOnlyNet(keras.Model):
        def __init__(self, block="made in build", named=True, always=False, **kwargs):
            super().__init__(**kwargs)
            self.block_kind, self.named, self.always = block, named, always
            self.stem = keras.layers.Conv2D(4, 1, name=name(named, "stem"))
            self.block = blocks[block](named=named, name=name(named, "block"))

        def call(self, x, training=None):
            h = self.stem(x)
            return self.block(h, training=training) if training or self.always else h

        def get_config(self):
            return {**super().get_config(), "block": self.block_kind, "named": self.named, "always": self.always}

    return TrainOnlyNet, list(blocks)


@check
def convert_keeps_weight_paths_of_blocks_built_in_training():
    """A block that a subclassed model builds only in a training call (its Conv2D and
    BatchNormalization made in its ``build()`` and built there or by its call, held from its
    constructor, in a Sequential it holds, or a block deeper), a Sequential that a custom
    layer or a Sequential built from an ``Input`` holds, and a block of a built model
    converted alone: ``convert`` and ``revert(convert)`` keep every weight path and value.
    Where every layer is named, the paths are the
    original's; where Keras numbers the layers that a constructor or ``build()`` does not
    name (afresh in the copy, as loading a ``.keras`` file does), each path is the
    original's with each layer's name replaced by its copy's, the base names alike, as a
    call of the copy would make them. The copy's later training call makes no new weight.

    Before, a block holding no weight of its own was built in no outer name scope
    (``lazy_block_1/conv2d_3/kernel`` for ``net/lazy_block/conv2d_1/kernel``); a layer built
    later in it took the original's names (``net/lazy_block/conv2d_3`` under ``lazy_block_1``);
    a Sequential held by a custom layer, or by a Sequential built from an ``Input``, was
    copied outside the scopes it was built in, its batch norm inside them
    (``sequential_1/conv2d`` beside ``net/block/sequential_1/bn``); and a block converted alone
    lost the scopes of the model it was built in (``block/seq/conv`` for ``net/block/seq/conv``)."""
    import re

    import keras

    from syncbn.keras import convert, revert

    rng = np.random.default_rng(44)
    TrainOnlyNet, blocks = train_only_classes()

    def plain(layer):  # its class without convert's: Synchronized<class>, SyncBatchNormalization
        return re.sub(r"^Synchronized|^Sync", "", type(layer).__name__)

    x = rng.standard_normal((2, 5, 5, 3)).astype(np.float32)

    def trained(model):  # called once, in training
        model(x, training=True)
        return model

    def nested_sequential():
        inner = keras.Sequential([keras.layers.Conv2D(4, 3, padding="same", name="conv"),
                                  keras.layers.BatchNormalization(name="bn")], name="inner")
        return trained(keras.Sequential([keras.Input((5, 5, 3)), inner], name="outer"))

    # each case: the model, whether it names every layer, its weights (the stem's 2, the block's
    # 6), an input (the stem's output for the block alone)
    cases = {f"{block}, named": (lambda block=block: trained(TrainOnlyNet(block, name="net")), True, 8, x)
             for block in blocks}
    cases.update({f"{block}, numbered by Keras": (lambda block=block: trained(TrainOnlyNet(block, named=False)),
                                                  False, 8, x) for block in blocks})
    cases["sequential, named, called in inference too"] = (
        lambda: trained(TrainOnlyNet("sequential", always=True, name="net")), True, 8, x)
    cases["the block holding a Sequential, converted alone"] = (
        lambda: trained(TrainOnlyNet("sequential", name="net")).block, True, 6, x[..., [0, 1, 2, 0]])
    cases["Sequential in a Sequential built from an Input"] = (nested_sequential, True, 6, x)
    info = {}
    for where, (make, named, count, inputs) in cases.items():
        model = make()
        for layer in every_layer(model):
            if layer.built and layer.weights:
                randomize(layer, rng)
        want = [(w.path, np.array(keras.ops.convert_to_numpy(w))) for w in model.weights]
        assert len(want) == count, (where, [p for p, _ in want])  # vacuous without the block's
        synced = convert(model)
        assert kinds(synced) == (0, 1), (where, kinds(synced))
        back = revert(synced)
        for label, copy in (("convert", synced), ("revert(convert)", back)):
            olds, news = every_layer(model), every_layer(copy)
            assert [plain(a) for a in olds] == [plain(b) for b in news], (where, label)
            # each layer's name in the copy (an InputLayer, no weights, Keras names afresh)
            renamed = {a.name: b.name for a, b in zip(olds, news) if not isinstance(a, keras.layers.InputLayer)}
            if named:
                assert all(a == b for a, b in renamed.items()), (where, label, renamed)
            else:  # Keras's numbering only: conv2d_3 for conv2d_1, the base names alike
                assert all(re.sub(r"_\d+$", "", a) == re.sub(r"_\d+$", "", b) for a, b in renamed.items()), (
                    where, label, renamed)
            expected = ["/".join([renamed.get(part, part) for part in path.split("/")[:-1]] + [path.split("/")[-1]])
                        for path, _ in want]
            got = [(w.path, np.array(keras.ops.convert_to_numpy(w))) for w in copy.weights]
            assert [p for p, _ in got] == expected, (where, label, [p for p, _ in got], expected)
            for (path, a), (_, b) in zip(got, want):
                assert np.all(np.isfinite(a)), f"{where}, {label}: {path} is not finite"
                np.testing.assert_array_equal(a, b, err_msg=f"{where}, {label}: {path}")
            copy(inputs, training=True)  # built already: makes nothing, anywhere
            assert [w.path for w in copy.weights] == expected, (where, label, [w.path for w in copy.weights])
        info[where] = f"{want[-1][0]} -> {synced.weights[-1].path}"
    return info


if __name__ == "__main__":
    worker_main(CHECKS)
