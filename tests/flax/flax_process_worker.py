"""One of several processes that train ``syncbn.flax.BatchNorm`` together under
``jax.distributed`` (CPU, gloo collectives), each with 2 host devices, the ``pmap`` axis
spanning every device of every process.

    python tests/flax/flax_process_worker.py PROCESS_ID PROCESSES PORT OUT.npz

Every process draws the same global batch (seeded) and takes its devices' rows; it
saves its rows of ``y`` and ``dx``, the ``scale``/``bias`` gradients summed over its
devices, and the updated running statistics (identical on every device), for the test
to compare with the float64 oracle on the whole batch.
"""

from __future__ import annotations

import os
import sys

import numpy as np

LOCAL_DEVICES = 2
SHAPE = (3, 5, 4)  # per device: 3 samples of 5 positions, 4 channels (last axis)
MOMENTUM, EPS = 0.9, 1e-5


def global_data(processes):
    """The whole batch over every device, the cotangent, and the layer's state."""
    rng = np.random.default_rng(20261205)
    devices = processes * LOCAL_DEVICES
    channels = SHAPE[-1]
    x = (rng.standard_normal((devices, *SHAPE)) * rng.uniform(0.5, 2, channels) + 50).astype(np.float32)
    dy = rng.standard_normal((devices, *SHAPE)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, channels).astype(np.float32)
    bias = rng.uniform(-1, 1, channels).astype(np.float32)
    ra_mean = rng.uniform(45, 55, channels).astype(np.float32)
    ra_var = rng.uniform(0.5, 2, channels).astype(np.float32)
    return x, dy, scale, bias, ra_mean, ra_var


def main(process_id, processes, port, out):
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=process_id, initialization_timeout=120)
    import jax.numpy as jnp

    import syncbn.flax

    assert jax.device_count() == processes * LOCAL_DEVICES, jax.devices()
    x, dy, scale, bias, ra_mean, ra_var = global_data(processes)
    rows = slice(process_id * LOCAL_DEVICES, (process_id + 1) * LOCAL_DEVICES)
    layer = syncbn.flax.BatchNorm(use_running_average=False, axis_name="batch", momentum=MOMENTUM, epsilon=EPS)
    variables = {"params": {"scale": jnp.asarray(scale), "bias": jnp.asarray(bias)},
                 "batch_stats": {"mean": jnp.asarray(ra_mean), "var": jnp.asarray(ra_var)}}

    def step(variables, x, dy):
        def f(x, params):
            return layer.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                               mutable=["batch_stats"])
        (y, updates), vjp = jax.vjp(lambda x, p: f(x, p), x, variables["params"])
        dx, dparams = vjp((dy, jax.tree.map(jnp.zeros_like, updates)))
        return y, dx, dparams, updates["batch_stats"]

    run = jax.pmap(step, axis_name="batch", in_axes=(None, 0, 0))
    y, dx, dparams, stats = run(variables, jnp.asarray(x[rows]), jnp.asarray(dy[rows]))
    np.savez(out, y=np.asarray(y), dx=np.asarray(dx),
             dscale=np.asarray(dparams["scale"]).sum(0), dbias=np.asarray(dparams["bias"]).sum(0),
             mean=np.asarray(stats["mean"]), var=np.asarray(stats["var"]))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
