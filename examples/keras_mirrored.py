"""Train a small convnet with synchronized batch normalization across logical CPU
devices: ``tf.distribute.MirroredStrategy`` + ``syncbn.keras.convert`` + ``fit``.

Each replica sees only a few images per step (the situation synchronized BN is for);
every BatchNormalization layer still normalizes with the statistics of the whole
global batch, so training behaves as on one device with the global batch.

    python examples/keras_mirrored.py                    # 4 logical CPUs, 2 images each
    python examples/keras_mirrored.py --replicas 2 --epochs 1

On a machine with several GPUs, drop ``--replicas`` handling and create the strategy
with ``tf.distribute.MirroredStrategy()``: the rest is unchanged.
"""

from __future__ import annotations

import argparse
import os


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4, help="logical CPU devices (replicas)")
    parser.add_argument("--per-replica-batch", type=int, default=2, help="images per replica per step")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512, help="training images")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in ("replicas", "per_replica_batch", "epochs", "samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def make_data(rng, samples, size=16, classes=3):
    """Noisy images whose class brightens a stripe of one channel."""
    import numpy as np

    labels = rng.integers(0, classes, samples)
    images = rng.normal(0.0, 1.0, (samples, size, size, 3)) + 3.0
    for c in range(classes):
        images[labels == c, :, 4 * c : 4 * c + 4, c] += 1.5
    return images.astype("float32"), labels


def build_model(classes=3):
    """An ordinary Keras model with ordinary BatchNormalization layers."""
    import keras

    inputs = keras.Input((16, 16, 3))
    x = inputs
    for filters in (16, 32):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization(momentum=0.9)(x)
        x = keras.layers.ReLU()(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(classes)(x)
    return keras.Model(inputs, outputs)


def main():
    args = parse_args()
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if os.environ["KERAS_BACKEND"] != "tensorflow":
        raise SystemExit("this example uses tf.distribute: run it with KERAS_BACKEND=tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import tensorflow as tf

    # Split the CPU into logical devices before TensorFlow initializes.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)

    import keras
    import numpy as np

    import syncbn.keras

    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    x_train, y_train = make_data(rng, args.samples)
    x_val, y_val = make_data(rng, 256)

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    global_batch = args.per_replica_batch * strategy.num_replicas_in_sync
    with strategy.scope():  # build, convert and compile inside the scope
        model = syncbn.keras.convert(build_model())
        model.compile(
            optimizer=keras.optimizers.SGD(0.02, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    sync_layers = [l for l in model.layers if isinstance(l, syncbn.keras.SyncBatchNormalization)]
    print(f"replicas: {strategy.num_replicas_in_sync}, images per replica per step: {args.per_replica_batch}, "
          f"global batch: {global_batch}, SyncBatchNormalization layers: {len(sync_layers)}")

    history = model.fit(x_train, y_train, batch_size=global_batch, epochs=args.epochs,
                        validation_data=(x_val, y_val), verbose=2)

    # The moving statistics are the same on every replica: they came from global statistics.
    for layer in sync_layers:
        copies = [v.numpy() for v in layer.moving_variance.value.values]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), layer.name
    print(f"final validation accuracy: {history.history['val_accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
