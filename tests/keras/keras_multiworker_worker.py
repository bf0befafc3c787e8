"""One worker of a 2-process ``MultiWorkerMirroredStrategy`` run on 127.0.0.1 (CPU,
one replica per worker, torch blocked). ``TF_CONFIG`` comes from the parent test.

For every case it runs one training call of ``SyncBatchNormalization`` on its own
part of the batch and saves its input, ``dy``, mask, output, input gradient, gamma/beta
gradients, initial and final weights to ``<out>/<case>-<index>.npz``; the test joins
the two workers' files and compares them with the float64 oracle. It also counts the
``CollectiveReduceV2`` ops in the traced forward+backward graph of one layer call, for
this layer and for Keras's ``BatchNormalization(synchronized=True)``, trains on one
value per channel in all and then on two, and last tries Keras's ``fit``.

    python tests/keras_multiworker_worker.py --index I --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from keras_harness import block_torch
import keras_oracle as oracle

# case -> (per-worker batch sizes, per-sample shape, channel axis, masked)
CASES = {
    "uneven": ([5, 3], (4, 3, 3), -1, False),
    "empty": ([4, 0], (3, 6), 1, False),
    "masked": ([3, 6], (5, 3), -1, True),
}


def collective_ops(concrete):
    """CollectiveReduceV2 ops in a concrete function's graph and the functions it calls."""
    count = 0
    graphs = [concrete.graph]
    seen = set()
    while graphs:
        graph = graphs.pop()
        for op in graph.get_operations():
            if op.type == "CollectiveReduceV2":
                count += 1
        for name, fn in getattr(graph, "_functions", {}).items():
            if name not in seen and hasattr(fn, "graph"):
                seen.add(name)
                graphs.append(fn.graph)
    return count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    block_torch()
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING, timeout_seconds=120)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync

    import keras

    from syncbn.keras import SyncBatchNormalization

    out = Path(args.out)
    for case, (sizes, tail, axis, masked) in CASES.items():
        rng = np.random.default_rng(sum(map(ord, case)))  # the same draws on both workers
        channels = ((None,) + tail)[axis]
        xs, dys = oracle.make_inputs(rng, sizes, tail, channels, axis)
        masks = oracle.make_masks(rng, xs) if masked else None
        with strategy.scope():
            layer = SyncBatchNormalization(axis=axis, momentum=0.9)
            layer.build((None,) + tail)
        layer.set_weights([rng.uniform(0.5, 2.0, channels).astype(np.float32) if i in (0, 3)
                           else rng.uniform(-1, 1, channels).astype(np.float32) for i in range(4)])
        initial = layer.get_weights()
        me = args.index
        x, dy = tf.constant(xs[me]), tf.constant(dys[me])
        mask = None if masks is None else tf.constant(masks[me])

        @tf.function
        def step(x, dy, mask):
            def replica(x, dy, mask):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = layer(x, training=True, mask=mask)
                    loss = tf.reduce_sum(y * dy)
                dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma.value, layer.beta.value])
                return y, dx, dgamma, dbeta

            return strategy.run(replica, args=(x, dy, mask))

        y, dx, dgamma, dbeta = step(x, dy, mask)
        final = layer.get_weights()
        np.savez(
            out / f"{case}-{me}.npz", x=xs[me], dy=dys[me], mask=np.array([]) if masks is None else masks[me],
            y=y.numpy(), dx=dx.numpy(), dgamma=dgamma.numpy(), dbeta=dbeta.numpy(),
            gamma=initial[0], beta=initial[1], moving_mean0=initial[2], moving_var0=initial[3],
            moving_mean=final[2], moving_var=final[3],
        )

    # Collective ops in the graph of one forward + backward layer call.
    counts = {}
    x = tf.constant(np.ones((4, 3), np.float32) * np.arange(4, dtype=np.float32)[:, None])
    for name, make in (("syncbn", lambda: SyncBatchNormalization()),
                       ("keras_synchronized", lambda: keras.layers.BatchNormalization(synchronized=True))):
        with strategy.scope():
            layer = make()
            layer.build((None, 3))

        def grad_step(x, layer=layer):
            def replica(x):
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    loss = tf.reduce_sum(layer(x, training=True))
                return tape.gradient(loss, x)

            return strategy.run(replica, args=(x,))

        def forward_step(x, layer=layer):
            return strategy.run(lambda x: layer(x, training=True), args=(x,))

        both = tf.function(grad_step).get_concrete_function(x)
        forward = tf.function(forward_step).get_concrete_function(x)
        counts[name] = {"forward": collective_ops(forward), "forward_and_backward": collective_ops(both)}
        tf.function(grad_step)(x)  # and it runs
    (out / f"collectives-{args.index}.json").write_text(json.dumps(counts))

    # Degenerate batches: 1 and 0 samples (one value per channel in all) train as Keras's
    # layer would on the whole batch (variance 0: output beta = 0, gradient 0) on both
    # workers; then 1 and 1 samples train, so no worker was left behind in a collective.
    with strategy.scope():
        layer = SyncBatchNormalization()
        layer.build((None, 3))
    step = tf.function(lambda x: strategy.run(
        lambda x: tf.gradients(tf.reduce_sum(layer(x, training=True) ** 2), x)[0], args=(x,)))
    outcome = {"layer": layer.name}
    outcome["1, 0"] = np.asarray(step(tf.ones((1 - args.index, 3)) * 5.0)).tolist()
    outcome["1, 1"] = np.asarray(step(tf.constant([[1.0, 2.0, 3.0]]) * (args.index + 1))).tolist()
    (out / f"degenerate-{args.index}.json").write_text(json.dumps(outcome))

    # Keras 3's fit under this strategy (docs/keras.md: it fails before the first step,
    # with any model; keras-team/keras#20585). Last: its error comes on both workers
    # before any collective.
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), SyncBatchNormalization()])
        model.compile(optimizer="sgd", loss="mse")
    try:
        model.fit(np.ones((4, 3), np.float32), np.ones((4, 3), np.float32), batch_size=4, verbose=0)
        fit = "ok"
    except Exception as err:  # noqa: BLE001 - recorded for the test
        fit = f"{type(err).__name__}: {str(err)[:300]}"
    (out / f"fit-{args.index}.json").write_text(json.dumps(fit))


if __name__ == "__main__":
    main()
