"""``syncbn demo --framework keras``: the command end to end, in a process where torch
cannot be imported (the Keras demo must not need it)."""

import importlib.util
import sys

import pytest

import keras_harness as harness
from demo_checks import DEADLINE_S, check_report, start_together

# the command as a user runs it, with ``import torch`` made to fail first
MAIN = ("import sys, keras_harness; keras_harness.block_torch(); "
        "from syncbn.cli import main; sys.exit(main(sys.argv[1:]))")


def demo_command(backend, *extra):
    """``(skipped, make_args, env, timeout)`` of ``backend``'s demo (see ``start_together``)."""
    def make_args(tmp):
        return [sys.executable, "-c", MAIN, "demo", "--framework", "keras", "--backend", backend,
                "--out", str(tmp / "demo"), *extra]
    return importlib.util.find_spec(backend) is None, make_args, harness.worker_env(backend, CI="true"), DEADLINE_S


# The two demos are independent processes of about one core each: both start when the
# first test needs one, so on 2 cores they run side by side.
COMMANDS = {
    # two replicas: MirroredStrategy traces the step once per replica, so four took twice
    # the time (70 s against 38 s alone on two cores) for the same code paths; the replica
    # count is the suite's to vary (tests/keras/test_keras_tf.py runs 2, 3 and 4)
    "test_quick_keras_demo_mirrored": demo_command("tensorflow", "--quick", "--world-size", "2"),
    # a few steps only: on JAX each of the three runs compiles its own step
    "test_short_keras_demo_on_jax": demo_command("jax", "--quick", "--steps", "4", "--eval-every", "2"),
}


@pytest.fixture(scope="module")
def demos(request, tmp_path_factory):
    yield from start_together(request, tmp_path_factory, COMMANDS)


def run_demo(demos, name):
    """Wait for test ``name``'s demo; its output dir and stdout."""
    tmp, command = demos[name]
    out, _ = command.finish()
    return tmp / "demo", out


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")
def test_quick_keras_demo_mirrored(demos):
    out_dir, out = run_demo(demos, "test_quick_keras_demo_mirrored")
    report = check_report(out_dir, 2, "MirroredStrategy")
    assert report["framework"] == "keras" and report["keras_backend"] == "tensorflow"
    assert report["devices"] == [f"/cpu:{i}" for i in range(2)]
    assert "syncbn matches the big batch" in out
    for title in ("per-replica BN, MirroredStrategy", "syncbn, MirroredStrategy", "one replica, batch 4"):
        assert title in out


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_short_keras_demo_on_jax(demos):
    out_dir, out = run_demo(demos, "test_short_keras_demo_on_jax")
    report = check_report(out_dir, 4, "DataParallel")
    assert report["keras_backend"] == "jax" and report["devices"] == [f"cpu:{i}" for i in range(4)]
    for title in ("per-device BN, shard_map", "syncbn, DataParallel", "one device, batch 8"):
        assert title in out
