"""``import syncbn.keras`` works without torch and never imports it on the TensorFlow
and JAX backends: checked in a fresh process per backend, with ``import torch`` made to
fail (as in an environment where torch is not installed)."""

import importlib.util
import subprocess
import sys

import pytest

import keras_harness as harness

SCRIPT = """
import sys
from keras_harness import block_torch
block_torch()
import numpy as np
import keras
import syncbn.keras
layer = syncbn.keras.SyncBatchNormalization()
x = np.arange(12, dtype="float32").reshape(4, 3)
y = layer(x, training=True)
model = syncbn.keras.convert(keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()]))
model(x)
assert keras.backend.backend() == sys.argv[1], keras.backend.backend()
assert "torch" not in sys.modules, "torch was imported"
print("ok without torch on", keras.backend.backend())
"""


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_import_without_torch(backend):
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"needs {backend}")
    env = harness.worker_env(backend, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, backend], env=env, cwd=str(harness.ROOT),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert f"ok without torch on {backend}" in proc.stdout
