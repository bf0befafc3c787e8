"""``syncbn.keras`` without distribution, on the TensorFlow and JAX backends: a frozen
layer uses its moving statistics, ``convert`` keeps every config field and weight,
``revert(convert(model))`` is the original field by field, and ``model.summary()`` and
``.keras`` files name the synchronized class.
The checks run in one worker process per backend (``keras_roundtrip_checks.py``, torch
blocked); each test below asserts one of them."""

import importlib.util
import json

import pytest

import keras_harness as harness
from keras_roundtrip_checks import CHECKS

TIMEOUT = 240
BACKENDS = [b for b in ("tensorflow", "jax") if importlib.util.find_spec(b) is not None]


SUITES = {backend: harness.Suite("keras/keras_roundtrip_checks.py", CHECKS,
                                 harness.worker_env(backend, JAX_PLATFORMS="cpu"), TIMEOUT, param=backend)
          for backend in BACKENDS}
WORKER_SUITES = list(SUITES.values())


@pytest.fixture(scope="module", params=BACKENDS)
def results(request):
    return SUITES[request.param].results()


@pytest.mark.skipif(not BACKENDS, reason="needs tensorflow or jax")
@pytest.mark.parametrize("name", list(CHECKS))
def test_keras_without_distribution(results, name):
    info = harness.assert_check(*results, name)
    if info:
        print(f"{name}: {json.dumps(info, default=float)}")
