"""``syncbn demo --framework keras``: the command end to end, in a process where torch
cannot be imported (the Keras demo must not need it)."""

import importlib.util
import sys

import pytest

import keras_harness as harness
from demo_checks import check_report, run_command

# the command as a user runs it, with ``import torch`` made to fail first
MAIN = ("import sys, keras_harness; keras_harness.block_torch(); "
        "from syncbn.cli import main; sys.exit(main(sys.argv[1:]))")


def run_demo(tmp_path, backend, *extra):
    out_dir = tmp_path / "demo"
    env = harness.worker_env(backend, CI="true")
    out, err = run_command([sys.executable, "-c", MAIN, "demo", "--framework", "keras", "--backend", backend,
                            "--out", str(out_dir), *extra], tmp_path, env=env)
    return out_dir, out


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")
def test_quick_keras_demo_mirrored(tmp_path):
    out_dir, out = run_demo(tmp_path, "tensorflow", "--quick")
    report = check_report(out_dir, 4, "MirroredStrategy")
    assert report["framework"] == "keras" and report["keras_backend"] == "tensorflow"
    assert report["devices"] == [f"/cpu:{i}" for i in range(4)]
    assert "syncbn matches the big batch" in out
    for title in ("per-replica BN, MirroredStrategy", "syncbn, MirroredStrategy", "one replica, batch 8"):
        assert title in out


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_short_keras_demo_on_jax(tmp_path):
    # a few steps only: on JAX each of the three runs compiles its own step
    out_dir, out = run_demo(tmp_path, "jax", "--quick", "--steps", "4", "--eval-every", "2")
    report = check_report(out_dir, 4, "DataParallel")
    assert report["keras_backend"] == "jax" and report["devices"] == [f"cpu:{i}" for i in range(4)]
    for title in ("per-device BN, shard_map", "syncbn, DataParallel", "one device, batch 8"):
        assert title in out
