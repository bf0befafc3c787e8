"""One worker of a 2-process ``MultiWorkerMirroredStrategy`` run on 127.0.0.1 (CPU, one
replica per worker, torch blocked) in which worker 1 disagrees with worker 0 about the
synchronized layers it calls. ``TF_CONFIG`` comes from the parent test.

Both workers build the same three ``SyncBatchNormalization(4)`` layers (so the same
names); in the ``*_guarded`` scenarios their weights are trained by
``SkipMismatchedSteps(SGD)`` in the same step. Worker 0 calls them in order in one training step (forward and backward); worker
1 does what the scenario says. The outcome (``ok``, or the exception's class and
message, and whether it is a TensorFlow ``OpError``), the seconds it took and which
layers' weights moved go to ``<out>/<scenario>-<index>.json``; in ``absent``, worker
1 reports that it ran no step and what moved.

    python tests/keras_mismatch_worker.py --index I --out DIR --scenario NAME --timeout S
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from keras_harness import block_torch

# scenario -> (order of the layers worker 1 calls, how the step runs)
SCENARIOS = {
    "agree": ([0, 1, 2], "function"),
    "agree_guarded": ([0, 1, 2], "function"),  # and the layers' weights trained by SkipMismatchedSteps
    "swapped": ([1, 0, 2], "function"),
    "swapped_eager": ([1, 0, 2], "eager"),
    "swapped_xla": ([1, 0, 2], "xla"),
    "skip_middle": ([0, 2], "function"),
    "skip_last": ([0, 1], "function"),
    "agree_after": ([0, 1, 2], "function"),
    "absent": (None, "function"),  # worker 1 stays alive but runs no step
}


def run_scenario(tf, strategy, scenario, index, out, timeout):
    """One training step of three fresh layers as ``scenario`` says; the outcome to
    ``<out>/<scenario>-<index>.json``."""
    import keras

    from syncbn.keras import SkipMismatchedSteps, SyncBatchNormalization, check_agreement

    order, mode = SCENARIOS[scenario]
    order = order if index == 1 else [0, 1, 2]
    guarded = scenario.endswith("_guarded")
    with strategy.scope():
        layers = [SyncBatchNormalization(momentum=0.5, name=f"bn{i}") for i in range(3)]
        for layer in layers:
            layer.build((None, 4))
        weights = [w for layer in layers for w in layer.trainable_weights]
        optimizer = SkipMismatchedSteps(keras.optimizers.SGD(0.1, momentum=0.9)) if guarded else None
        if optimizer is not None:
            optimizer.build(weights)
    before = [[w.copy() for w in layer.get_weights()] for layer in layers]

    def moved():
        """Per layer: whether any of its weights (gamma, beta, moving statistics) changed."""
        return [any(bool(np.any(w != b)) for w, b in zip(layer.get_weights(), old))
                for layer, old in zip(layers, before)]

    if order is None and index == 1:
        time.sleep(timeout + 5)  # busy in its own code past the collectives' timeout
        (out / f"{scenario}-{index}.json").write_text(json.dumps({"ok": True, "absent": True, "moved": moved()}))
        return
    x = tf.constant(np.random.default_rng(index).normal(size=(6, 4)).astype(np.float32))

    def replica(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x
            for i in order:
                y = layers[i](y, training=True)
            loss = tf.reduce_sum(y * y)
        if optimizer is None:
            return tape.gradient(loss, x)
        grads = tape.gradient(loss, [x] + weights)
        optimizer.apply_gradients(zip(grads[1:], weights))
        return grads[0]

    def step(x):
        return strategy.run(replica, args=(x,))

    start = time.monotonic()
    try:
        run = {"eager": step, "function": tf.function(step), "xla": tf.function(step, jit_compile=True)}[mode]
        grad = run(x)
        outcome = {"ok": True, "finite": bool(np.all(np.isfinite(np.asarray(grad))))}
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        outcome = {"ok": False, "type": type(exc).__name__, "message": str(exc)[:3000],
                   "tf_error": isinstance(exc, tf.errors.OpError)}
    outcome["seconds"] = round(time.monotonic() - start, 2)
    outcome["moved"] = moved()
    if guarded:
        outcome["gamma"] = [layer.get_weights()[0].tolist() for layer in layers]
        outcome["iterations"] = int(optimizer.iterations.numpy())
        check_agreement()  # nothing on record after an agreeing step
    (out / f"{scenario}-{index}.json").write_text(json.dumps(outcome))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", nargs="+", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--timeout", type=float, default=20)
    args = parser.parse_args()
    block_torch()
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=args.timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync

    for scenario in args.scenarios:
        run_scenario(tf, strategy, scenario, args.index, Path(args.out), args.timeout)
    os._exit(0)  # do not wait on collectives a failed step left behind


if __name__ == "__main__":
    main()
