"""The example ``examples/keras_mirrored.py`` runs (2 logical CPUs, one short epoch)."""

import importlib.util
import subprocess
import sys

import pytest

import keras_harness as harness

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")


def test_keras_mirrored_example():
    cmd = [sys.executable, str(harness.ROOT / "examples" / "keras_mirrored.py"),
           "--replicas", "2", "--epochs", "1", "--samples", "128"]
    proc = subprocess.run(cmd, env=harness.worker_env("tensorflow"), cwd=str(harness.ROOT),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "replicas: 2" in proc.stdout and "SyncBatchNormalization layers: 2" in proc.stdout
    assert "final validation accuracy" in proc.stdout


@pytest.mark.parametrize("option", ["--replicas", "--per-replica-batch", "--epochs", "--samples"])
def test_a_count_below_one_is_named(option):
    """--replicas 0 reached TensorFlow, which failed with "No CPU devices are available in
    this process"; the example names the option and the value."""
    cmd = [sys.executable, str(harness.ROOT / "examples" / "keras_mirrored.py"), option, "0"]
    proc = subprocess.run(cmd, cwd=str(harness.ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"{option} must be at least 1, got 0" in proc.stderr, proc.stderr[-3000:]
