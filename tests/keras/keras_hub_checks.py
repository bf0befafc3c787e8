"""keras-hub models with ``syncbn.keras``, on the TensorFlow backend with 2 logical CPU
devices and torch blocked: a DeepLabV3 segmenter built from its constructors (no
download) keeps its synchronized layers through a ``.keras`` file, in this process and
in a fresh one, and trains under ``MirroredStrategy`` exactly as one device on the
concatenated batch.

Run by ``test_keras_hub.py``:  python tests/keras/keras_hub_checks.py --out R.json --checks NAME...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from keras_harness import registry, tensorflow_on_devices, worker_main
import nan_safe

DEVICES = 2
# Images per replica in the training check. With 1, the ASPP's image-pooling branch
# normalizes one value per channel per replica, 2 in all: its output is +-1 whatever its
# input, and every gradient through it is rounding noise (1e-7 of the gradients in
# float64, on either side), which no comparison can hold to more than that noise.
PER_REPLICA = 2
CHECKS, check = registry()


def setup():
    tensorflow_on_devices(DEVICES)


# A fresh process builds the same model with this code (and the worker with exec of it).
BUILD = """
import keras, keras_hub
def build(dtype=None):
    encoder = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 8, 16],
        stackwise_num_blocks=[1, 1, 1], stackwise_num_strides=[1, 2, 2], block_type="basic_block",
        image_shape=(None, None, 3), dtype=dtype)
    backbone = keras_hub.models.DeepLabV3Backbone(
        image_encoder=encoder, spatial_pyramid_pooling_key="P4", upsampling_size=4, dilation_rates=[2, 4],
        low_level_feature_key="P2", projection_filters=8, image_shape=(32, 32, 3), dtype=dtype)
    return keras_hub.models.DeepLabV3ImageSegmenter(backbone=backbone, num_classes=3, dtype=dtype)
"""
BN_LAYERS = 16  # in the model BUILD makes: 9 in the ResNet, 7 in the DeepLabV3 head


def build(dtype=None):
    scope = {}
    exec(BUILD, scope)
    return scope["build"](dtype)


def bn_kinds(model):
    """(plain BatchNormalization, SyncBatchNormalization) layers anywhere in ``model``."""
    import keras

    from syncbn.keras import SyncBatchNormalization

    layers = [layer for layer in model._flatten_layers(include_self=False, recursive=True)
              if isinstance(layer, keras.layers.BatchNormalization)]
    return (sum(type(layer) is keras.layers.BatchNormalization for layer in layers),
            sum(type(layer) is SyncBatchNormalization for layer in layers))


def randomize(model, rng):
    """Every batch norm weight away from its initial value (so a lost weight shows)."""
    import keras

    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.set_weights([rng.uniform(0.5, 1.5, w.shape).astype(w.dtype) for w in layer.get_weights()])


def fresh_process(code):
    """Run ``code`` in a new Python (TensorFlow backend); its last stdout line, as JSON."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@check
def keras_file_keeps_synchronized_layers():
    """Converted, the segmenter (a keras_hub ``Task`` holding a ``Backbone``, both
    saving only their constructors' arguments) saves to ``.keras`` and loads back with
    all 16 layers synchronized and the same predictions, here and in a fresh process
    that imports ``syncbn.keras``; a fresh process that does not import it raises,
    naming ``syncbn>Synchronized``. Reverted, it saves and loads as keras_hub's class
    with plain layers."""
    import keras
    import keras_hub

    from syncbn.keras import convert, revert

    rng = np.random.default_rng(35)
    model = build()
    data = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)
    model(data)
    randomize(model, rng)
    synced = convert(model)
    assert bn_kinds(synced) == (0, BN_LAYERS), bn_kinds(synced)
    assert isinstance(synced, keras_hub.models.DeepLabV3ImageSegmenter), type(synced)
    want = np.asarray(synced(data, training=False))
    assert np.all(np.isfinite(want))
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "synced.keras")
        synced.save(path)
        np.save(os.path.join(tmp, "x.npy"), data)
        np.save(os.path.join(tmp, "y.npy"), want)

        loaded = keras.models.load_model(path)
        assert bn_kinds(loaded) == (0, BN_LAYERS), bn_kinds(loaded)
        assert bn_kinds(loaded.backbone) == (0, BN_LAYERS), bn_kinds(loaded.backbone)
        assert isinstance(loaded, keras_hub.models.DeepLabV3ImageSegmenter), type(loaded)
        np.testing.assert_array_equal(np.asarray(loaded(data, training=False)), want)

        load = f"""
import json, numpy as np, keras
import syncbn.keras
m = keras.models.load_model({path!r})
x, y = np.load({os.path.join(tmp, "x.npy")!r}), np.load({os.path.join(tmp, "y.npy")!r})
kinds = sorted(type(l).__name__ for l in m._flatten_layers(include_self=False, recursive=True)
               if isinstance(l, keras.layers.BatchNormalization))
d = float(np.max(np.abs(np.asarray(m(x, training=False)) - y)))
print(json.dumps({{"kinds": kinds, "max_abs_diff": d}}))
"""
        fresh = fresh_process(load)
        assert fresh["kinds"] == ["SyncBatchNormalization"] * BN_LAYERS, fresh["kinds"]
        assert fresh["max_abs_diff"] == 0.0, fresh
        figures["fresh_process_max_abs_diff"] = fresh["max_abs_diff"]

        without = f"""
import json, keras
try:
    keras.models.load_model({path!r})
    print(json.dumps({{"raised": None}}))
except Exception as err:
    print(json.dumps({{"raised": type(err).__name__, "message": str(err)}}))
"""
        refused = fresh_process(without)
        assert refused["raised"] is not None, "loaded a synchronized file without syncbn.keras"
        assert "syncbn>Synchronized" in refused["message"], refused["message"][:2000]
        figures["without_syncbn"] = refused["raised"]

        path = os.path.join(tmp, "plain.keras")
        revert(loaded).save(path)
        plain = keras.models.load_model(path)
        assert type(plain) is keras_hub.models.DeepLabV3ImageSegmenter, type(plain)
        assert bn_kinds(plain) == (BN_LAYERS, 0), bn_kinds(plain)
        np.testing.assert_array_equal(np.asarray(plain(data, training=False)), want)
    return {"bn_layers": BN_LAYERS, **figures}


def preset_files(model, directory):
    """Save ``model`` with keras_hub's ``save_to_preset``: {file name: its JSON (None for
    weights files)}, and the warnings from syncbn it gave (h5py and numpy give others)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_to_preset(directory)
    files = {path.name: json.loads(path.read_text()) if path.suffix == ".json" else None
             for path in sorted(Path(directory).iterdir())}
    files.pop("metadata.json")  # the date and versions of the save
    return files, [str(w.message) for w in caught if str(w.message).startswith("syncbn")]


@check
def preset_holds_the_plain_model_and_says_so():
    """keras_hub's ``save_to_preset`` of a converted segmenter (and of its backbone)
    writes the preset of the model before the conversion (the same files, the same JSON)
    and warns, naming ``syncbn.keras.convert``; the model stays converted. The preset
    loads through ``from_preset`` of the segmenter's class, of ``ImageSegmenter`` and of
    ``Backbone`` with the same predictions, and ``convert`` synchronizes all 16 layers of
    what it returns again. (A preset of the converted classes would not load at all:
    ``from_preset`` refuses ``syncbn>Synchronized``, which no keras_hub class is.)"""
    import keras_hub

    from syncbn.keras import convert

    rng = np.random.default_rng(37)
    model = build()
    model.preprocessor = keras_hub.models.DeepLabV3ImageSegmenterPreprocessor(
        image_converter=keras_hub.layers.DeepLabV3ImageConverter(image_size=(32, 32)))
    data = rng.standard_normal((2, 32, 32, 3)).astype(np.float32)
    model(data)
    randomize(model, rng)
    want = np.asarray(model(data, training=False))
    synced = convert(model)
    with tempfile.TemporaryDirectory() as tmp:
        plain_files, plain_warnings = preset_files(model, os.path.join(tmp, "plain"))
        assert plain_warnings == [], plain_warnings
        synced_files, said = preset_files(synced, os.path.join(tmp, "synced"))
        backbone_files, said_too = preset_files(synced.backbone, os.path.join(tmp, "backbone"))
        for warned in (said, said_too):
            assert len(warned) == 1 and "syncbn.keras.convert()" in warned[0], warned
        assert synced_files == plain_files, sorted(synced_files)
        assert backbone_files["config.json"] == plain_files["config.json"], backbone_files["config.json"]
        assert bn_kinds(synced) == (0, BN_LAYERS), bn_kinds(synced)

        loaders = (keras_hub.models.DeepLabV3ImageSegmenter, keras_hub.models.ImageSegmenter)
        for loader in loaders:
            loaded = loader.from_preset(os.path.join(tmp, "synced"))
            assert type(loaded) is keras_hub.models.DeepLabV3ImageSegmenter, type(loaded)
            assert loaded.preprocessor is not None
            assert bn_kinds(loaded) == (BN_LAYERS, 0), bn_kinds(loaded)
            np.testing.assert_array_equal(np.asarray(loaded(data, training=False)), want)
        again = convert(loaded)
        assert bn_kinds(again) == (0, BN_LAYERS), bn_kinds(again)
        np.testing.assert_array_equal(np.asarray(again(data, training=False)), want)
        backbone = keras_hub.models.Backbone.from_preset(os.path.join(tmp, "backbone"))
        assert type(backbone) is keras_hub.models.DeepLabV3Backbone and bn_kinds(backbone) == (BN_LAYERS, 0)
    return {"preset_files": sorted(plain_files), "loaded_through": [c.__name__ for c in loaders] + ["Backbone"]}


@check
def trains_as_one_device_under_mirrored_strategy():
    """2 replicas, 2 images each, float64: one training call of the converted segmenter
    under ``MirroredStrategy`` gives the outputs, the summed gradients of every weight
    and the moving statistics that the plain model gives on one device with both images.
    The plain model under the same strategy does not (so the check can tell)."""
    import keras
    import tensorflow as tf

    from syncbn.keras import convert

    keras.config.set_dtype_policy("float64")  # keras_hub's heads take their dtype from it
    rng = np.random.default_rng(36)
    xs = [(rng.standard_normal((PER_REPLICA, 32, 32, 3)) * 2 + 1).astype(np.float64) for _ in range(DEVICES)]
    gs = [rng.standard_normal((PER_REPLICA, 32, 32, 3)).astype(np.float64) for _ in range(DEVICES)]
    model = build("float64")
    model(np.concatenate(xs))
    randomize(model, rng)
    initial = model.get_weights()

    def loss_of(net, x, g):
        return tf.reduce_sum(net(x, training=True) * g)

    # weights by position: each build numbers its auto-named layers afresh
    def state(net):
        return {i: np.array(w.numpy()) for i, w in enumerate(net.weights)}

    # one device, both images
    reference = build("float64")
    reference(np.concatenate(xs))
    reference.set_weights(initial)
    x, g = tf.constant(np.concatenate(xs)), tf.constant(np.concatenate(gs))
    with tf.GradientTape() as tape:
        loss = loss_of(reference, x, g)
    want_y = np.asarray(reference(x, training=False))  # after the moving statistics moved
    want_grads = dict(enumerate(np.asarray(d) for d in tape.gradient(loss, reference.trainable_weights)))
    want_state = state(reference)

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(DEVICES)])

    def run(sync):
        with strategy.scope():
            plain = build("float64")
            plain(np.concatenate(xs))
            plain.set_weights(initial)
            net = convert(plain) if sync else plain
        inputs = [strategy.experimental_distribute_values_from_function(
            lambda ctx, arrays=arrays: tf.constant(arrays[ctx.replica_id_in_sync_group])) for arrays in (xs, gs)]

        @tf.function
        def step(x, g):
            def replica(x, g):
                with tf.GradientTape() as tape:
                    loss = loss_of(net, x, g)
                return tape.gradient(loss, net.trainable_weights)
            return strategy.run(replica, args=(x, g))

        grads = step(*inputs)
        summed = {i: sum(np.asarray(v) for v in strategy.experimental_local_results(d))
                  for i, d in enumerate(grads)}
        return net, summed

    net, grads = run(sync=True)
    got_y = np.asarray(net(np.concatenate(xs), training=False))
    scale = {key: max(float(np.max(np.abs(v))), 1e-300) for key, v in want_grads.items()}
    # float64 throughout but for the bilinear upsamplings, which TensorFlow computes in
    # float32 (tf.image.resize, forward and gradient). Two summation orders of float64 values
    # a few ulp apart round to the same float32 value except near a rounding boundary, where
    # they differ by one float32 ulp (6e-8 relative): the outputs (the last upsampling's) by
    # up to that, the gradients by a few of those amplified through the layers below
    # (measured 2e-7 to 4e-7), so both are bounded by 1e-5. The moving statistics of the
    # decoder's batch norms, after the first upsampling, see such a flip averaged over the
    # batch (a one-ulp change of one of >= 1024 values per channel): 1e-7 leaves room for
    # channels whose mean is small next to the largest one. Measured here: outputs 0.0,
    # statistics 4e-16.
    err_y = nan_safe.max_abs_diff(got_y, want_y) / float(np.max(np.abs(want_y)))
    err_g = nan_safe.worst(nan_safe.max_abs_diff(grads[k], want_grads[k]) / scale[k] for k in want_grads)
    got_state = state(net)
    err_s = nan_safe.worst(nan_safe.max_abs_diff(got_state[k], want_state[k]) / max(float(np.max(np.abs(v))), 1e-300)
                           for k, v in want_state.items())
    assert set(grads) == set(want_grads) and set(got_state) == set(want_state)
    assert err_y <= 1e-5 and err_g <= 1e-5 and err_s <= 1e-7, (err_y, err_g, err_s)

    plain, plain_grads = run(sync=False)
    err_plain = nan_safe.worst(nan_safe.max_abs_diff(plain_grads[k], want_grads[k]) / scale[k] for k in want_grads)
    assert err_plain > 100 * 1e-5, err_plain
    keras.config.set_dtype_policy("float32")
    return {"replicas": DEVICES, "images_per_replica": PER_REPLICA, "bn_layers": BN_LAYERS,
            "relative_error_outputs": err_y, "relative_error_gradients": err_g,
            "relative_error_weights_and_moving_statistics": err_s,
            "relative_error_gradients_keras_unsynchronized": err_plain}


if __name__ == "__main__":
    worker_main(CHECKS, setup)
