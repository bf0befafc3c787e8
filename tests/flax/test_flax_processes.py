"""``syncbn.flax`` across processes: 2 processes under ``jax.distributed`` (gloo on
127.0.0.1), 2 host devices each, one ``pmap`` axis over all 4 devices. Outputs, input
gradients, summed scale/bias gradients and running statistics match the float64 oracle
on the whole batch (float32 inputs with |mean| / std up to 100)."""

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

import keras_harness as harness
from flax_oracle import assert_close, reference_vjp
from flax_process_worker import EPS, LOCAL_DEVICES, MOMENTUM, global_data

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax")

WORKER = Path(__file__).with_name("flax_process_worker.py")
PROCESSES = 2
TOL = 2e-5  # float32 inputs, as tests/flax/flax_checks.py's TOL (error analysis there)


def run_processes(tmp_path):
    """Run the processes to the end (killed with their children after 240 s) and show
    every failed one's output, in the order they ended: a failure that one process alone
    sees is shown beside the other's timeout in the coordination service (only the first
    process's output was, and a hung process's children were left running)."""
    port = harness.free_ports(1)[0]
    outs = [tmp_path / f"p{i}.npz" for i in range(PROCESSES)]
    logs = [tmp_path / f"p{i}.log" for i in range(PROCESSES)]
    env = harness.worker_env("jax")
    procs = []
    for i in range(PROCESSES):
        with open(logs[i], "w") as log:  # a file: nobody reads while the processes run
            procs.append(harness.start(WORKER.relative_to(WORKER.parent.parent), [i, PROCESSES, port, outs[i]], env,
                                       stdout=log))
    ended, deadline = [], time.monotonic() + 240
    try:
        while len(ended) < PROCESSES and time.monotonic() < deadline:
            ended += [i for i, proc in enumerate(procs) if i not in ended and proc.poll() is not None]
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                harness._kill_group(proc)
            proc.wait()
    order = ended + [i for i in range(PROCESSES) if i not in ended]
    failed = [i for i in order if procs[i].returncode != 0]
    assert not failed, "\n".join(
        f"--- process {i}: {'killed after 240 s' if i not in ended else f'exit {procs[i].returncode}'} ---\n"
        f"{logs[i].read_text()[-3000:]}" for i in failed)
    return [dict(np.load(out)) for out in outs]


def test_processes_match_one_device(tmp_path):
    results = run_processes(tmp_path)
    x, dy, scale, bias, ra_mean, ra_var = global_data(PROCESSES)
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # (devices, batch, ...) -> (all samples, ...)
    (y, mean, var), (dx, dscale, dbias) = reference_vjp(
        flat(x), scale, bias, None, -1, EPS, MOMENTUM, ra_mean, ra_var,
        (flat(dy), np.zeros_like(ra_mean), np.zeros_like(ra_var)))
    got = {key: np.concatenate([r[key] for r in results]) for key in ("y", "dx")}
    errors = {
        "y": assert_close("y", flat(got["y"]), y, TOL),
        "dx": assert_close("dx", flat(got["dx"]), dx, TOL),
        "dscale": assert_close("dscale", sum(r["dscale"] for r in results), dscale, TOL),
        "dbias": assert_close("dbias", sum(r["dbias"] for r in results), dbias, TOL),
    }
    for i, r in enumerate(results):
        for d in range(LOCAL_DEVICES):
            errors[f"mean p{i}"] = assert_close(f"running mean, process {i}", r["mean"][d], mean, TOL)
            errors[f"var p{i}"] = assert_close(f"running var, process {i}", r["var"][d], var, TOL)
    print(errors)
