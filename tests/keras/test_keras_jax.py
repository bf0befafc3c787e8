"""``syncbn.keras`` on the JAX backend under ``keras.distribution.DataParallel`` over 4
host devices. Every check runs in one worker process (``keras_jax_checks.py``, torch
blocked); each test below asserts one of them."""

import importlib.util

import pytest

import keras_harness as harness
from keras_jax_checks import CHECKS, DEVICES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")

TIMEOUT = 300
SUITE = harness.Suite("keras/keras_jax_checks.py", CHECKS, harness.host_device_env(DEVICES), TIMEOUT)
WORKER_SUITES = [SUITE]


@pytest.fixture(scope="module")
def results():
    return SUITE.results()


@pytest.mark.parametrize("name", list(CHECKS))
def test_jax(results, name):
    harness.print_check(results, name)
