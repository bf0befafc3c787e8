"""``syncbn demo --framework flax``: prepare the process, then train the three runs of
:mod:`syncbn.demo.flax_runs` and write the report.

JAX fixes its host device count when it is imported, so ``W`` = ``--world-size`` host
CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=W``; the first ``W``
GPUs with ``--device cuda``) are set up before JAX is imported: this module imports
neither JAX nor Flax at module level, and when one is already imported the demo runs
in a fresh ``python -m syncbn demo`` process instead. Neither torch nor TensorFlow is
imported.
"""

from __future__ import annotations

import os
import sys
import time

from .config import DemoConfig
from .keras import _jax_devices, _run_in_fresh_process

__all__ = ["run"]


def run(config: DemoConfig) -> int:
    if any(name in sys.modules for name in ("jax", "flax")):
        return _run_in_fresh_process(config)
    start = time.perf_counter()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    _jax_devices(config)  # sets the device count, imports JAX, checks there are W devices
    import jax

    from . import report as demo_report
    from .flax_runs import train_three_ways

    progress = sys.stderr.isatty() if config.progress is None else config.progress
    report = train_three_ways(config, jax.devices()[: config.world_size], progress)
    report["elapsed_s"] = time.perf_counter() - start
    demo_report.write_report(report, config.out)
    return 0
