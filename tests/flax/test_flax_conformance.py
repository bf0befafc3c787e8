"""``syncbn.flax`` against Flax's own BatchNorm (dtypes, integer and complex inputs,
``jax_enable_x64``, and what Flax's BatchNorm tests check): every check of
``flax_conformance_checks.py`` in one worker process with ``jax_enable_x64`` off and
those marked for it in a second one with it on (it must be set before anything is
traced), each on 2 host CPU devices."""

import importlib.util

import pytest

import keras_harness as harness
from flax_conformance_checks import CHECKS, DEVICES, X64_CHECKS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax")

TIMEOUT = 600


def suite(checks, fixture, *args):
    env = harness.host_device_env(DEVICES)
    env.pop("JAX_ENABLE_X64", None)
    return harness.Suite("flax/flax_conformance_checks.py", checks, env, TIMEOUT, extra_args=args, fixture=fixture)


WORKER_SUITES = [suite(CHECKS, "results"), suite(X64_CHECKS, "results_x64", "--x64")]


@pytest.fixture(scope="module")
def results():
    return WORKER_SUITES[0].results()


@pytest.fixture(scope="module")
def results_x64():
    return WORKER_SUITES[1].results()


@pytest.mark.parametrize("name", list(CHECKS))
def test_conformance(results, name):
    harness.print_check(results, name)


@pytest.mark.parametrize("name", list(X64_CHECKS))
def test_conformance_x64(results_x64, name):
    harness.print_check(results_x64, name)
