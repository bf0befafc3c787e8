"""``syncbn demo --framework keras``: prepare the process, then train the three runs of
:mod:`syncbn.demo.keras_runs` and write the report.

Keras picks its backend when it is imported, TensorFlow fixes its logical devices when
it initializes, and JAX its host device count when it is imported, so all three must
be set before any of them is imported: this module imports none of them at module
level. When one is already imported (``syncbn.demo.run`` called from a program that
uses Keras), the demo runs in a fresh ``python -m syncbn demo`` process instead.

Devices, ``W`` = ``--world-size`` replicas:

- TensorFlow: the local GPUs when TensorFlow sees at least ``W`` (``--device auto``,
  the default for Keras, or ``cuda``), else ``W`` logical CPU devices made with
  ``tf.config.set_logical_device_configuration``.
- JAX: ``W`` host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=W``),
  or the first ``W`` GPUs with ``--device cuda``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import List

from .config import DemoConfig, to_argv

__all__ = ["run"]

_FRAMEWORK_MODULES = ("keras", "tensorflow", "jax")


def run(config: DemoConfig) -> int:
    if any(name in sys.modules for name in _FRAMEWORK_MODULES):
        return _run_in_fresh_process(config)
    start = time.perf_counter()
    devices = _prepare(config)
    from . import report as demo_report
    from .keras_runs import train_three_ways

    progress = sys.stderr.isatty() if config.progress is None else config.progress
    report = train_three_ways(config, devices, progress)
    report["elapsed_s"] = time.perf_counter() - start
    demo_report.write_report(report, config.out)
    return 0


def _run_in_fresh_process(config: DemoConfig) -> int:
    cmd = [sys.executable, "-m", "syncbn", "demo", *to_argv(config)]
    print(f"syncbn demo: a deep-learning framework is already imported here; running {' '.join(cmd)}",
          flush=True)
    return subprocess.call(cmd)


def _prepare(config: DemoConfig) -> List[str]:
    """Choose the Keras backend and the devices before anything imports them; returns
    the device of each replica (TensorFlow device names, or JAX platform:index)."""
    os.environ["KERAS_BACKEND"] = config.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if config.backend == "tensorflow":
        return _tf_devices(config)
    return _jax_devices(config)


def _replicas_need(world: int, what: str, where: str = "") -> str:
    """ "2 replicas on GPUs need 2 GPUs", "1 replica on GPUs needs 1 GPU"."""
    from .report import counted

    return f"{counted(world, 'replica')}{where} {'needs' if world == 1 else 'need'} {counted(world, what)}"


def _tf_devices(config: DemoConfig) -> List[str]:
    import tensorflow as tf

    world = config.world_size
    gpus = tf.config.list_physical_devices("GPU")
    if config.device == "cuda" or (config.device == "auto" and len(gpus) >= world):
        if len(gpus) < world:
            raise SystemExit(f"syncbn demo: {_replicas_need(world, 'GPU', ' on GPUs')}, TensorFlow sees {len(gpus)}")
        return [f"/gpu:{i}" for i in range(world)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * world)
    return [f"/cpu:{i}" for i in range(world)]


def _jax_devices(config: DemoConfig) -> List[str]:
    world = config.world_size
    if config.device != "cuda":
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={world}"])
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    if config.device == "cuda":  # GPUs only: jax.devices() falls back to the CPU without one
        try:
            found = jax.devices("gpu")
        except RuntimeError:  # no GPU backend at all
            found = []
        if len(found) < world:
            raise SystemExit(f"syncbn demo: --device cuda: {_replicas_need(world, 'GPU', ' on GPUs')}, "
                             f"JAX sees {len(found)}")
    else:
        found = jax.devices()
        if len(found) < world:
            raise SystemExit(f"syncbn demo: {_replicas_need(world, 'JAX device')}, JAX sees {len(found)}")
    return [f"{d.platform}:{d.id}" for d in found[:world]]
