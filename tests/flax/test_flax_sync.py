"""``syncbn.flax`` on 4 host CPU devices (pmap, shard_map, jit with a sharded batch,
linen and nnx). Every check runs in one worker process (``flax_checks.py``: JAX must
see ``--xla_force_host_platform_device_count=4`` before it starts, and this pytest
process may have started it already); each test below asserts one of them."""

import importlib.util

import pytest

import keras_harness as harness
from flax_checks import CHECKS, DEVICES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax")

TIMEOUT = 600
SUITE = harness.Suite("flax/flax_checks.py", CHECKS, harness.host_device_env(DEVICES), TIMEOUT)
WORKER_SUITES = [SUITE]


@pytest.fixture(scope="module")
def results():
    return SUITE.results()


@pytest.mark.parametrize("name", list(CHECKS))
def test_flax(results, name):
    harness.print_check(results, name)
