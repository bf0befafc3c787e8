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
    env = harness.worker_env(
        "jax", JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
    return harness.run_suite("keras_jax_checks.py", list(CHECKS), env, TIMEOUT)


@pytest.mark.parametrize("name", list(CHECKS))
def test_jax(results, name):
    harness.print_check(results, name)
