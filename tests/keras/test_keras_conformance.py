"""``SyncBatchNormalization`` as a drop-in for ``keras.layers.BatchNormalization`` on one
device, on the TensorFlow, JAX and PyTorch backends: every check of
``keras_conformance_checks.py`` runs once per backend, each backend in one worker
process."""

import importlib.util

import pytest

import keras_harness as harness
from keras_conformance_checks import CHECKS

BACKENDS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
TIMEOUT = 300


@pytest.fixture(scope="module", params=list(BACKENDS))
def results(request):
    backend = request.param
    if importlib.util.find_spec(BACKENDS[backend]) is None:
        pytest.skip(f"needs {backend}")
    env = harness.worker_env(backend, JAX_PLATFORMS="cpu")
    return harness.run_suite("keras/keras_conformance_checks.py", list(CHECKS), env, TIMEOUT)


@pytest.mark.parametrize("name", list(CHECKS))
def test_conformance(results, name):
    harness.print_check(results, name)
