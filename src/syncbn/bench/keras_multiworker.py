"""The Keras peer at syncbn's topology: ``tf.distribute.MultiWorkerMirroredStrategy``
with 2 worker processes on 127.0.0.1 (one CPU replica each), beside syncbn's 2 gloo
processes. Each worker times ``keras.layers.BatchNormalization(synchronized=True)``
and ``syncbn.keras.SyncBatchNormalization`` interleaved, forward + backward of one
layer, on the plan's ``keras_multiworker`` points (indices into the grid).

    python -m syncbn.bench.keras_multiworker --plan PLAN.json --out RESULT.json

starts the two workers (``TF_CONFIG`` on two free loopback ports, ring all-reduce),
waits for them and writes worker 0's result; every step is a collective, so both
workers' blocks span the same steps. A worker is the same module with ``--worker I``.
Each worker gets the plan's threads per replica as TensorFlow intra-op threads; the two
are not pinned (two processes, like the torch peer's gloo ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback

from ..tools.usage import positive_float

WORLD = 2
LABEL = "2 worker processes, MultiWorkerMirroredStrategy"
IMPLS = ("keras_sync", "syncbn_keras")


def free_ports(count: int):
    """``count`` distinct free TCP ports on 127.0.0.1 (held together while chosen)."""
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(plan_path: str, out: str, timeout: float) -> int:
    ports = free_ports(WORLD)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    codes = []
    try:
        for index in range(WORLD):
            env = dict(os.environ, KERAS_BACKEND="tensorflow",
                       TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
            cmd = [sys.executable, "-m", "syncbn.bench.keras_multiworker", "--worker", str(index), "--plan",
                   plan_path, "--out", f"{out}.{index}"]
            procs.append(subprocess.Popen(cmd, env=env))  # in the launcher's process group: a kill of it ends them
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:  # a worker still running (left waiting in a collective, or the launcher raised): end it
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    result = None
    if os.path.exists(f"{out}.0"):
        with open(f"{out}.0") as fh:
            result = json.load(fh)
    if result is None:
        result = {"peer": "keras_multiworker", "world": WORLD, "times": {}, "errors": {}}
    bad = [(i, c) for i, c in enumerate(codes) if c != 0]
    if bad:
        result.setdefault("errors", {})["workers"] = "; ".join(
            f"worker {i}: {'timed out' if c is None else f'exit {c}'}" for i, c in bad)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    return 0 if not bad else 1


def worker(index: int, plan: dict, out: str) -> int:
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    import tensorflow as tf

    threads = plan["threads"]
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING, timeout_seconds=120)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    import keras

    from .keras_peer import candidate, make_layer, point_arrays
    from .timing import measure_interleaved

    result = {"peer": "keras_multiworker", "label": LABEL, "world": WORLD, "worker": index, "threads": threads,
              "replicas_in_sync": strategy.num_replicas_in_sync,
              "communication": "RING", "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
              "import_s": round(time.perf_counter() - start, 2), "points": [], "times": {k: [] for k in IMPLS},
              "errors": {}}

    def save():
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)

    summed = tf.function(lambda v: strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: v), axis=None))

    def agree(count: int) -> int:
        """One block length on both workers: the mean of what they ask for, rounded up."""
        total = int(round(float(summed(tf.constant(float(count))))))
        return max(1, -(-total // WORLD))

    save()
    try:
        if strategy.num_replicas_in_sync != WORLD:
            raise RuntimeError(f"expected {WORLD} replicas in sync, got {strategy.num_replicas_in_sync}")
        for i in plan["keras_multiworker"]["points"]:
            point = plan["points"][i]
            xs, dys, axis = point_arrays(point, WORLD, seed=i)  # the same draws on both workers
            x, dy = tf.constant(xs[index]), tf.constant(dys[index])
            candidates = {}
            for impl in IMPLS:
                with strategy.scope():
                    layer = make_layer(impl, axis)
                    layer.build(xs[0].shape)
                candidates[impl] = candidate(tf, strategy, layer, x, dy)
            times = measure_interleaved(candidates, plan["repeats"], plan["warmup"], plan["min_block_s"], agree=agree)
            result["points"].append(i)
            for impl in IMPLS:
                result["times"][impl].append(times[impl])
            save()
    except Exception:
        result["errors"]["timing"] = traceback.format_exc()
    save()
    return 0 if not result["errors"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncbn.bench.keras_multiworker",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--worker", type=int, default=None)
    # 0, a negative number or NaN gave each worker 1 s (the launcher's floor), then killed it
    parser.add_argument("--timeout", type=positive_float, default=600.0, metavar="SECONDS",
                        help="seconds for both workers (launcher; a finite positive number, default 600)")
    args = parser.parse_args(argv)
    if args.worker is None:
        return launch(args.plan, args.out, args.timeout)
    with open(args.plan) as fh:
        plan = json.load(fh)
    return worker(args.worker, plan, args.out)


if __name__ == "__main__":
    sys.exit(main())
