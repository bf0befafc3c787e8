"""keras-hub with ``syncbn.keras``: a DeepLabV3 segmenter built from its constructors
keeps its synchronized layers through ``.keras`` files and trains under
``MirroredStrategy`` exactly as one device. The checks run in one worker process
(``keras_hub_checks.py``: 2 logical CPUs, torch blocked); each test asserts one."""

import importlib.util
import json

import pytest

import keras_harness as harness
from keras_hub_checks import CHECKS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras_hub") is None,
    reason="needs tensorflow and keras-hub")

TIMEOUT = 420


SUITE = harness.Suite("keras/keras_hub_checks.py", CHECKS, harness.worker_env("tensorflow"), TIMEOUT)
WORKER_SUITES = [SUITE]


@pytest.fixture(scope="module")
def results():
    return SUITE.results()


@pytest.mark.parametrize("name", list(CHECKS))
def test_keras_hub(results, name):
    info = harness.assert_check(*results, name)
    if info:
        print(f"{name}: {json.dumps(info, default=float)}")
