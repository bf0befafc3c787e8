"""``syncbn.keras`` on the TensorFlow backend with ``MirroredStrategy`` over logical CPU
devices. Every check runs in one worker process (``keras_tf_checks.py``: 4 logical
CPUs, torch blocked); each test below asserts one of them."""

import importlib.util

import pytest

import keras_harness as harness
from keras_tf_checks import CHECKS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")

TIMEOUT = 420


SUITE = harness.Suite("keras/keras_tf_checks.py", CHECKS, harness.worker_env("tensorflow"), TIMEOUT)
WORKER_SUITES = [SUITE]


@pytest.fixture(scope="module")
def results():
    return SUITE.results()


@pytest.mark.parametrize("name", list(CHECKS))
def test_tensorflow(results, name):
    harness.print_check(results, name)
