"""Running the Keras checks in their own processes.

Keras picks its backend at import and TensorFlow fixes its logical devices when it
initializes, so every backend / device configuration runs in a fresh Python process:
a worker script (``keras_*_checks.py``) runs a list of named checks and writes one JSON
file of results; the pytest side starts it with a bounded timeout and asserts each
check. Nothing here imports a deep-learning framework.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# --------------------------------------------------------------------------- worker side


class _TorchBlocker:
    """A meta-path finder that refuses to import torch (as if it were not installed)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"import of {name!r} blocked: this process must run without torch")
        return None


def block_torch():
    """Make ``import torch`` fail in this process, as in an environment without torch."""
    sys.meta_path.insert(0, _TorchBlocker())


def registry():
    """``(CHECKS, check)``: an empty dict of named checks, and the decorator that adds a
    function to it under its own name (each worker script's list of checks)."""
    checks = {}

    def check(fn):
        checks[fn.__name__] = fn
        return fn

    return checks, check


def tensorflow_on_devices(count):
    """A worker's setup for TensorFlow-backend checks: torch blocked, Keras on TensorFlow,
    and the CPU split into ``count`` logical devices (before TensorFlow initializes)."""
    block_torch()
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)


def run_checks(checks, names, out_path):
    """Run the named checks in order; write ``{name: {ok, info | error}}`` as JSON.

    A check is a function of no arguments that returns a JSON-able dict of figures and
    raises (AssertionError or otherwise) when something is wrong.
    """
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            info = checks[name]() or {}
            results[name] = {"ok": True, "info": info}
        except BaseException:  # noqa: BLE001 - report every failure, keep going
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        Path(out_path).write_text(json.dumps(results, indent=1, default=float))
    return results


def worker_main(checks, setup=block_torch):
    """A worker script's entry point: ``--out R.json --checks NAME...`` (default all),
    ``setup()`` first, then :func:`run_checks`."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", nargs="+", default=list(checks))
    args = parser.parse_args()
    setup()
    return run_checks(checks, args.checks, args.out)


# --------------------------------------------------------------------------- pytest side


def free_ports(count):
    """``count`` distinct free TCP ports on 127.0.0.1."""
    socks, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def worker_env(backend, **extra):
    """Environment of a worker process: the Keras backend, quiet TensorFlow logs, no GPU."""
    env = dict(os.environ)
    env.update(
        KERAS_BACKEND=backend,
        TF_CPP_MIN_LOG_LEVEL="2",
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")])),
    )
    env.pop("TF_CONFIG", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(script, args, env, stdout=subprocess.PIPE):
    """Start ``python tests/<script> <args>`` in its own process group (``script``: a path
    under tests/, e.g. ``keras/keras_tf_checks.py``), its stderr in its ``stdout`` (a pipe,
    or a file for a process that may run while nobody reads it)."""
    return subprocess.Popen(
        [sys.executable, str(TESTS / script), *map(str, args)],
        cwd=str(ROOT),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(procs, timeout):
    """Wait for every process, killing all of them (and their children) on timeout.

    Returns each process's ``(returncode, output)``; a returncode of None means killed
    after the timeout.
    """
    deadline = time.monotonic() + timeout
    outputs = [None] * len(procs)
    timed_out = False
    for i, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs[i] = (proc.returncode, out)
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for i, proc in enumerate(procs):
            if outputs[i] is None:
                _kill_group(proc)
                out, _ = proc.communicate()
                outputs[i] = (None, out)
    return outputs


# A worker suite's process reads nothing from us and writes its output to a file (not a
# pipe: a suite started ahead runs while nobody reads, and a full pipe would stop it).
# At most JOBS suites run at once: JOBS - 1 in the background while the pytest process runs
# its own tests (:func:`keep_busy`, before each test), one more while it waits for one. The
# tests that use suites run last (:func:`suites_last`), so the suites run beside the others.
JOBS = max(1, int(os.environ.get("SYNCBN_TEST_SUITE_JOBS", "2")))
_PLANNED: list = []  # suites the selected tests need, in the order they first need them


class Suite:
    """One worker process running a list of checks: ``python tests/<script> --out R.json
    <extra_args> --checks NAME...`` with ``env``, killed if it still runs ``timeout``
    seconds after a test first waits for it (a suite started in the background, beside
    other tests, is not timed before that: the run never waits longer).

    A test module lists its suites in ``WORKER_SUITES``; each is used by the tests that
    request ``fixture`` (with ``param``, for a parametrized fixture). ``conftest.py``
    runs those modules last (:func:`suites_last`), plans the suites of the selected tests
    (:func:`plan`) and starts them in the background, in order, before each test
    (:func:`keep_busy`); :meth:`results` starts this one if it has not started, and,
    while it waits, the next planned ones (see ``JOBS``).
    """

    def __init__(self, script, checks, env, timeout, extra_args=(), fixture="results", param=None):
        self.script, self.checks, self.env, self.timeout = script, list(checks), env, timeout
        self.extra_args, self.fixture, self.param = list(extra_args), fixture, param
        self.proc = self.tmp = None
        self.deadline = None  # set when a test first waits for it
        self.done = None  # (results, output) once finished

    def used_by(self, item) -> bool:
        if self.fixture not in getattr(item, "fixturenames", ()):
            return False
        callspec = getattr(item, "callspec", None)
        return self.param is None or (callspec is not None and callspec.params.get(self.fixture) == self.param)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.done is None

    def start(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="syncbn-suite-"))
        with open(self.tmp / "output.txt", "w") as log:
            args = ["--out", self.tmp / "results.json", *self.extra_args, "--checks", *self.checks]
            self.proc = start(self.script, args, self.env, stdout=log)

    def poll(self) -> bool:
        """Collect the results if the process has ended or is past its deadline (then
        kill it and its children); True once finished."""
        if self.done is None and self.proc is not None:
            killed = False
            if self.proc.poll() is None:
                if self.deadline is None or time.monotonic() < self.deadline:
                    return False
                _kill_group(self.proc)
                killed = True
            self._collect(killed)
        return self.done is not None

    def stop(self):
        """Kill the process (and its children) if it still runs; drop its files."""
        if self.running:
            _kill_group(self.proc)
            self._collect(True)

    def _collect(self, killed):
        self.proc.wait()
        out_path = self.tmp / "results.json"
        try:
            results = json.loads(out_path.read_text()) if out_path.exists() else {}
        except ValueError:  # killed while writing
            results = {}
        output = (self.tmp / "output.txt").read_text(errors="replace")
        if killed:
            output += f"\n[killed: still running {self.timeout} s after a test began to wait for it]"
        self.done = (results, output)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def results(self):
        """``(results, output)`` of the worker (see :func:`assert_check`)."""
        if self.proc is None:
            self.start()
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout
        while not self.poll():
            _start_planned(awaited=self)
            time.sleep(0.2)
        if self in _PLANNED:
            _PLANNED.remove(self)
        return self.done


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def keep_busy():
    """Start planned suites, in order, while fewer than ``JOBS - 1`` run (before each test:
    they run beside the tests that need none)."""
    _start_planned(awaited=None)


def _start_planned(awaited):
    """Start planned suites, in order, while fewer than ``JOBS - 1`` run besides
    ``awaited`` (None: a test runs, awaiting none)."""
    for suite in _PLANNED:
        if suite is awaited or suite.poll() or suite.running:
            continue
        if sum(s.running for s in _PLANNED if s is not awaited) >= JOBS - 1:
            return
        suite.start()


def suites_last(items):
    """``items`` (pytest's collected tests) with the test modules that use worker suites
    (``WORKER_SUITES``) moved after all others, each module's tests kept together and in
    order: their suites run in the background meanwhile (:func:`keep_busy`)."""
    return sorted(items, key=lambda item: bool(getattr(getattr(item, "module", None), "WORKER_SUITES", ())))


def plan(items):
    """Plan the suites of the test modules of ``items`` (pytest's selected tests, in run
    order) that those tests use; nothing starts yet."""
    stop_all()
    seen = set()
    for item in items:
        if _skipped(item):
            continue
        for suite in getattr(getattr(item, "module", None), "WORKER_SUITES", ()):
            if id(suite) not in seen and suite.used_by(item):
                seen.add(id(suite))
                _PLANNED.append(suite)


def _skipped(item) -> bool:
    """Whether a ``skip`` mark, or a ``skipif`` mark whose condition is True, skips ``item``."""
    for mark in item.iter_markers():
        if mark.name == "skip" or (mark.name == "skipif" and mark.args and all(a is True for a in mark.args)):
            return True
    return False


def stop_all():
    """Kill every planned suite that still runs (end of the session)."""
    for suite in _PLANNED:
        suite.stop()
    _PLANNED.clear()


def host_device_env(devices):
    """Environment of a JAX worker with ``devices`` host CPU devices (XLA fixes that count
    when JAX starts, so it cannot be the pytest process)."""
    return worker_env("jax", JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def print_check(results, name):
    """Assert check ``name`` (see :func:`assert_check`) and print its figures."""
    info = assert_check(*results, name)
    if info:
        print(f"{name}: {json.dumps(info, default=float)}")


def assert_check(results, output, name):
    """Fail with the worker's traceback (or its output, if it died) for check ``name``."""
    result = results.get(name)
    if result is None:
        raise AssertionError(f"check {name!r} did not run; worker output:\n{output[-6000:]}")
    if not result["ok"]:
        raise AssertionError(f"check {name!r} failed in the worker:\n{result['error']}")
    return result.get("info", {})
