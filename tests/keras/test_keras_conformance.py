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


SUITES = {backend: harness.Suite("keras/keras_conformance_checks.py", CHECKS,
                                 harness.worker_env(backend, JAX_PLATFORMS="cpu"), TIMEOUT, param=backend)
          for backend, module in BACKENDS.items() if importlib.util.find_spec(module) is not None}
WORKER_SUITES = list(SUITES.values())


@pytest.fixture(scope="module", params=list(BACKENDS))
def results(request):
    backend = request.param
    if backend not in SUITES:
        pytest.skip(f"needs {backend}")
    return SUITES[backend].results()


@pytest.mark.parametrize("name", list(CHECKS))
def test_conformance(results, name):
    harness.print_check(results, name)
