"""The Flax peer: ``flax.linen.BatchNorm(axis_name=...)`` (both variance modes) and
``syncbn.flax.BatchNorm(axis_name=...)`` under ``jax.pmap`` on W host devices, in a
process of its own for each W, timed interleaved in that process.

    python -m syncbn.bench.flax_peer --world W --plan PLAN.json --out RESULT.json

XLA fixes the host device count when JAX initializes, so the flags are set here
before JAX is imported: W host devices, single-threaded Eigen kernels when T = 1, and
the process pinned to ``min(W x T, cores)`` cores (JAX has no documented thread-count
setting). A step is one ``pmap``-ed forward + backward (``jax.vjp``: input, scale and
bias gradients for a given dy, with the batch statistics update), every replica
holding the plan's per-replica batch, each step waited for (``block_until_ready``). Numerics: the
variance each merges across the W devices: Flax by default (``use_fast_variance=True``,
one-pass), Flax with ``use_fast_variance=False``, and syncbn.flax.
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

AXIS = "replicas"
# implementation key -> (use_fast_variance for Flax's module, or None for syncbn.flax)
IMPLS = {"flax": True, "flax_two_pass": False, "syncbn_flax": None}


def make_model(impl: str, **fields):
    """The module an implementation key names, with the given dataclass fields."""
    import flax.linen as nn

    if IMPLS[impl] is None:
        import syncbn.flax

        return syncbn.flax.BatchNorm(**fields)
    return nn.BatchNorm(use_fast_variance=IMPLS[impl], **fields)


def setup(world: int, threads: int):
    flags = [f"--xla_force_host_platform_device_count={world}"]
    if threads == 1:
        flags.append("--xla_cpu_multi_thread_eigen=false")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    cpus = limit_cpus(world * threads)
    import jax

    return jax, jax.devices()[:world], cpus


def stack_on_devices(jax, devices, arrays):
    """One array per device, as a device-resident sharded array (leading axis: device)."""
    return jax.pmap(lambda a: a, devices=devices)(np.stack(arrays))


def time_point(jax, devices, point, world, plan, seed, impls):
    rng = np.random.default_rng(seed)
    shape = (point["N"], point["C"], point["H"], point["W"])
    axis = 1
    if point["layout"] == "channels_last":
        shape, axis = (point["N"], point["H"], point["W"], point["C"]), -1
    x = stack_on_devices(jax, devices, [(rng.standard_normal(shape) + 0.5).astype(np.float32) for _ in range(world)])
    dy = stack_on_devices(jax, devices, [rng.standard_normal(shape).astype(np.float32) for _ in range(world)])
    runs = {impl: (step_runner(jax, devices, make_model(impl, use_running_average=False, axis=axis, axis_name=AXIS),
                               x, dy), lambda: None) for impl in impls}
    return measure_interleaved(runs, plan["repeats"], plan["warmup"], plan["min_block_s"])


def step_runner(jax, devices, model, x, dy):
    """A function running one waited-for pmap-ed training step of ``model``."""
    variables = jax.pmap(lambda a: model.init(jax.random.PRNGKey(0), a), axis_name=AXIS, devices=devices)(x)

    def replica_step(variables, x, dy):
        def forward(x, params):
            return model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                               mutable=["batch_stats"])

        _, pullback, updates = jax.vjp(forward, x, variables["params"], has_aux=True)
        dx, dparams = pullback(dy)
        return dx, dparams, updates

    step = jax.pmap(replica_step, axis_name=AXIS, devices=devices)

    def run():
        # each step waits for the previous one, as the torch and Keras steps do; queuing
        # many asynchronous pmap steps also deadlocked XLA's CPU collectives here (a
        # replica's all-reduce never joined when the process had 2 cores for 2 devices)
        jax.block_until_ready(step(variables, x, dy))

    return run


def merged_variances(jax, devices, spec, world, impl: str) -> dict:
    model = make_model(impl, use_running_average=False, axis=1, axis_name=AXIS, momentum=0.0)
    errors = {}
    for offset in spec["offsets"]:
        parts = numerics.shards(offset, world, spec["batch"], spec["channels"], spec["size"])
        ref = numerics.reference_variance(parts)
        x = stack_on_devices(jax, devices, parts)
        variables = jax.pmap(lambda a: model.init(jax.random.PRNGKey(0), a), axis_name=AXIS, devices=devices)(x)

        def forward(variables, x):
            return model.apply(variables, x, mutable=["batch_stats"])[1]

        updates = jax.pmap(forward, axis_name=AXIS, devices=devices)(variables, x)
        var = np.asarray(updates["batch_stats"]["var"])[0]
        errors[str(offset)] = numerics.relative_error(var, ref)
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    plan = json.loads(open(args.plan).read())
    threads = plan["threads"]
    start = time.perf_counter()
    jax, devices, cpus = setup(args.world, threads)
    import flax

    impls = [k for k in IMPLS if k in plan.get("peers", IMPLS)]
    result = {"peer": "flax", "world": args.world, "threads": threads, "cpus": cpus, "impls": impls,
              "versions": {"jax": jax.__version__, "flax": flax.__version__}, "xla_flags": os.environ["XLA_FLAGS"],
              "import_s": round(time.perf_counter() - start, 2), "times_by_impl": {k: [] for k in impls},
              "errors": {}}

    def save():
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    save()
    if len(devices) < args.world:
        result["errors"]["setup"] = f"asked for {args.world} host devices, JAX has {len(devices)}"
        save()
        return 0
    try:
        for i, point in enumerate(plan["points"]):
            for impl, times in time_point(jax, devices, point, args.world, plan, i, impls).items():
                result["times_by_impl"][impl].append(times)
            save()
    except Exception:
        result["errors"]["timing"] = traceback.format_exc()
    if args.world in plan["numerics"]["worlds"]:
        try:
            result["numerics"] = {impl: merged_variances(jax, devices, plan["numerics"], args.world, impl)
                                  for impl in impls}
        except Exception:
            result["errors"]["numerics"] = traceback.format_exc()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
