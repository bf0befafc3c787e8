"""The Keras peers, one process per implementation and replica count:
``keras.layers.BatchNormalization(synchronized=True)`` and
``syncbn.keras.SyncBatchNormalization``, both on the TensorFlow backend under
``tf.distribute.MirroredStrategy`` over W logical CPU devices, and at W = 1 Keras's
unsynchronized ``keras.layers.BatchNormalization`` (the one-replica reference).

    python -m syncbn.bench.keras_peer --impl keras_bn|keras_sync|syncbn_keras --world W \\
        --plan PLAN.json --out RESULT.json

TensorFlow fixes its logical devices and thread pools when it initializes, so each
(implementation, W) gets a fresh process: W logical CPUs, ``W x T`` intra-op threads,
W inter-op threads, pinned to ``min(W x T, cores)`` cores. A step is one compiled
``strategy.run`` of forward + backward (input, gamma and beta gradients for a given
dy) on every replica, each replica holding the plan's per-replica batch; "contiguous"
is NCHW with ``axis=1``, "channels_last" NHWC with ``axis=-1``. With W in the plan's
numerics worlds, it also reads back the variance the layer merged across the replicas
(``momentum=0``: the moving variance is the batch variance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

from . import numerics
from .peers import limit_cpus
from .timing import measure_interleaved

IMPLS = ("keras_bn", "keras_sync", "syncbn_keras")


def setup(world: int, threads: int):
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cpus = limit_cpus(world * threads)
    import tensorflow as tf

    physical = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(physical[0], [tf.config.LogicalDeviceConfiguration()] * world)
    tf.config.threading.set_intra_op_parallelism_threads(world * threads)
    tf.config.threading.set_inter_op_parallelism_threads(world)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(world)])
    return tf, strategy, cpus


def make_layer(impl: str, axis: int, momentum: float = 0.99):
    import keras

    if impl in ("keras_bn", "keras_sync"):
        return keras.layers.BatchNormalization(axis=axis, momentum=momentum, synchronized=impl == "keras_sync")
    from ..keras import SyncBatchNormalization

    return SyncBatchNormalization(axis=axis, momentum=momentum)


def per_replica(tf, strategy, arrays):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(arrays[ctx.replica_id_in_sync_group]))


def point_arrays(point: dict, world: int, seed: int):
    rng = np.random.default_rng(seed)
    shape = (point["N"], point["C"], point["H"], point["W"])
    if point["layout"] == "channels_last":
        shape = (point["N"], point["H"], point["W"], point["C"])
    xs = [(rng.standard_normal(shape) + 0.5).astype(np.float32) for _ in range(world)]
    dys = [rng.standard_normal(shape).astype(np.float32) for _ in range(world)]
    return xs, dys, (1 if point["layout"] == "contiguous" else -1)


def candidate(tf, strategy, layer, x, dy):
    """(step, sync) for the timing: one compiled ``strategy.run`` of forward + backward
    (input, gamma and beta gradients for ``dy``) on every replica."""

    @tf.function
    def step(x, dy):
        def replica(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
            return tape.gradient(y, [x] + list(layer.trainable_variables), output_gradients=dy)

        return strategy.run(replica, args=(x, dy))

    last = []

    def run():
        last[:] = [step(x, dy)]

    def sync():
        if last:
            strategy.experimental_local_results(last[0][1])[0].numpy()

    return run, sync


def time_point(tf, strategy, impl, point, world, plan, seed):
    xs, dys, axis = point_arrays(point, world, seed)
    with strategy.scope():
        layer = make_layer(impl, axis)
        layer.build(xs[0].shape)
    x, dy = per_replica(tf, strategy, xs), per_replica(tf, strategy, dys)
    return measure_interleaved({impl: candidate(tf, strategy, layer, x, dy)}, plan["repeats"], plan["warmup"],
                               plan["min_block_s"])[impl]


def merged_variances(tf, strategy, impl, spec, world) -> dict:
    errors = {}
    for offset in spec["offsets"]:
        parts = numerics.shards(offset, world, spec["batch"], spec["channels"], spec["size"])
        ref = numerics.reference_variance(parts)
        with strategy.scope():
            layer = make_layer(impl, axis=1, momentum=0.0)
            layer.build(parts[0].shape)
        x = per_replica(tf, strategy, parts)

        @tf.function
        def forward(x):
            return strategy.run(lambda x: layer(x, training=True), args=(x,))

        forward(x)
        errors[str(offset)] = numerics.relative_error(np.asarray(layer.moving_variance.numpy()), ref)
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=IMPLS, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    plan = json.loads(open(args.plan).read())
    threads = plan["threads"]
    start = time.perf_counter()
    tf, strategy, cpus = setup(args.world, threads)
    import keras

    result = {"peer": args.impl, "world": args.world, "threads": threads, "cpus": cpus,
              "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
              "tf_threads": {"intra_op": args.world * threads, "inter_op": args.world},
              "import_s": round(time.perf_counter() - start, 2), "times": [], "errors": {}}

    def save():
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    save()
    try:
        for i, point in enumerate(plan["points"]):
            result["times"].append(time_point(tf, strategy, args.impl, point, args.world, plan, seed=i))
            save()
    except Exception:
        result["errors"]["timing"] = traceback.format_exc()
    if args.world in plan["numerics"]["worlds"]:
        try:
            result["numerics"] = merged_variances(tf, strategy, args.impl, plan["numerics"], args.world)
        except Exception:
            result["errors"]["numerics"] = traceback.format_exc()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
