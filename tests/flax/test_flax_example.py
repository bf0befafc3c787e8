"""The example ``examples/flax_pmap.py`` runs (2 logical CPU devices, a few steps)."""

import importlib.util
import subprocess
import sys

import pytest

import keras_harness as harness

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax")


def test_flax_pmap_example():
    cmd = [sys.executable, str(harness.ROOT / "examples" / "flax_pmap.py"), "--devices", "2", "--steps", "10"]
    env = harness.worker_env("jax", JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(cmd, env=env, cwd=str(harness.ROOT), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "devices: 2, per-device batch: 4" in proc.stdout
    assert "final evaluation accuracy" in proc.stdout


@pytest.mark.parametrize("option", ["--devices", "--per-device-batch", "--steps"])
def test_a_count_below_one_is_named(option):
    """--devices 0 reached JAX, which failed with "Unable to initialize backend 'cpu'";
    the example names the option and the value."""
    cmd = [sys.executable, str(harness.ROOT / "examples" / "flax_pmap.py"), option, "0"]
    proc = subprocess.run(cmd, cwd=str(harness.ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"{option} must be at least 1, got 0" in proc.stderr, proc.stderr[-3000:]
