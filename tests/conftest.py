"""Shared fixtures: one pool of gloo worker processes for the whole session.

The pool has 4 ranks; jobs that need a smaller world use the process groups of ranks
[0, .., W-1] made by ``tests/workers.py``, so W = 1..4 all run on the same processes.
"""

import pytest

import keras_harness
import torchvision_shim
from syncbn.tools.launch import WorkerPool

# PyPI's CUDA-built torchvision beside CPU torch: define the operator schemas its import
# needs (a no-op where torchvision is absent or its extension loads); see torchvision_shim
torchvision_shim.install()

POOL_SIZE = 4


def pytest_collection_modifyitems(session, config, items):
    """The test modules that use worker suites run last, their suites beside the others."""
    items[:] = keras_harness.suites_last(items)


def pytest_collection_finish(session):
    """Plan the worker suites (``keras_harness.Suite``) the selected tests use: they start
    in the background, beside the tests (``keras_harness.JOBS``)."""
    keras_harness.plan(session.items)


def pytest_runtest_setup(item):
    keras_harness.keep_busy()  # a background suite that finished: the next planned one starts


def pytest_sessionfinish(session):
    keras_harness.stop_all()  # a suite started ahead whose tests never ran (-x, Ctrl-C)


class _Pools:
    def __init__(self):
        self._pool = None

    def get(self) -> WorkerPool:
        if self._pool is None or not self._pool.alive:  # a failed test may have shut it down
            self._pool = WorkerPool(POOL_SIZE, backend="gloo", timeout=60)
        return self._pool

    def close(self):
        if self._pool is not None:
            self._pool.close()


@pytest.fixture(scope="session")
def _pools():
    pools = _Pools()
    yield pools
    pools.close()


@pytest.fixture
def pool(_pools) -> WorkerPool:
    """The session's 4-rank gloo worker pool (restarted if a test broke it)."""
    return _pools.get()


@pytest.fixture
def one_thread():
    """One intra-op thread in the test process, as in the pool's workers: on 2 busy cores
    more threads only wait for each other (float64 depthwise convolutions of timm's and
    torchvision's mobile networks ran 50x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
