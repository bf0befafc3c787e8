"""``syncbn.keras`` on the JAX backend under ``keras.distribution.DataParallel`` over 4
host devices. Every check runs in one worker process (``keras_jax_checks.py``, torch
blocked); each test below asserts one of them."""

import importlib.util

import pytest

import keras_harness as harness
from keras_jax_checks import CHECKS, DEVICES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")

TIMEOUT = 300


@pytest.fixture(scope="module")
def results():
    return harness.run_host_device_suite("keras/keras_jax_checks.py", list(CHECKS), DEVICES, TIMEOUT)


@pytest.mark.parametrize("name", list(CHECKS))
def test_jax(results, name):
    harness.print_check(results, name)
