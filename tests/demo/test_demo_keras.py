"""``syncbn demo --framework keras``: the command end to end, in a process where torch
cannot be imported (the Keras demo must not need it)."""

import importlib.util
import sys

import pytest

import keras_harness as harness
from demo_checks import Started, check_report

# the command as a user runs it, with ``import torch`` made to fail first
MAIN = ("import sys, keras_harness; keras_harness.block_torch(); "
        "from syncbn.cli import main; sys.exit(main(sys.argv[1:]))")


# The two demos are independent processes of about one core each: both start when the
# first test needs one (the module's fixture), so on 2 cores they run side by side.
DEMOS = {
    "tensorflow": ["--quick"],
    # a few steps only: on JAX each of the three runs compiles its own step
    "jax": ["--quick", "--steps", "4", "--eval-every", "2"],
}
TESTS = {"test_quick_keras_demo_mirrored": "tensorflow", "test_short_keras_demo_on_jax": "jax"}


@pytest.fixture(scope="module")
def demos(request, tmp_path_factory):
    """{backend: (out_dir, Started)}: the demos of the selected tests, all started at once;
    killed at the end of the module if still running."""
    selected = {TESTS[item.name] for item in request.session.items if item.module is request.module}
    started = {}
    for backend in sorted(selected):
        if importlib.util.find_spec(backend) is None:
            continue  # its test is skipped
        tmp = tmp_path_factory.mktemp(f"demo-{backend}")
        env = harness.worker_env(backend, CI="true")
        args = [sys.executable, "-c", MAIN, "demo", "--framework", "keras", "--backend", backend,
                "--out", str(tmp / "demo"), *DEMOS[backend]]
        started[backend] = (tmp / "demo", Started(args, tmp, env=env))
    yield started
    for _, command in started.values():
        command.kill()


def run_demo(demos, backend):
    """Wait for ``backend``'s demo; its output dir and stdout."""
    out_dir, command = demos[backend]
    out, _ = command.finish()
    return out_dir, out


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")
def test_quick_keras_demo_mirrored(demos):
    out_dir, out = run_demo(demos, "tensorflow")
    report = check_report(out_dir, 4, "MirroredStrategy")
    assert report["framework"] == "keras" and report["keras_backend"] == "tensorflow"
    assert report["devices"] == [f"/cpu:{i}" for i in range(4)]
    assert "syncbn matches the big batch" in out
    for title in ("per-replica BN, MirroredStrategy", "syncbn, MirroredStrategy", "one replica, batch 8"):
        assert title in out


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_short_keras_demo_on_jax(demos):
    out_dir, out = run_demo(demos, "jax")
    report = check_report(out_dir, 4, "DataParallel")
    assert report["keras_backend"] == "jax" and report["devices"] == [f"cpu:{i}" for i in range(4)]
    for title in ("per-device BN, shard_map", "syncbn, DataParallel", "one device, batch 8"):
        assert title in out
