"""The worker-suite runner of ``keras_harness`` (``Suite``): suites run in the background
beside the tests and beside the awaited one, the modules that use them run last, a worker
that dies or hangs fails its checks (never hangs the run), and one that writes more than
a pipe holds while nobody reads still finishes."""

import os
import signal
import threading
import time

import pytest

import keras_harness as harness

WORKER = '''
import sys, time
from keras_harness import registry, worker_main

CHECKS, check = registry()


@check
def quick():
    return {"pid": __import__("os").getpid()}


def held(name):  # runs until the test makes the file ``name`` beside this script
    flag = __import__("pathlib").Path(__file__).with_name(name)
    while not flag.exists():
        time.sleep(0.05)
    return {"pid": __import__("os").getpid()}


@check
def held_a():
    return held("a")


@check
def held_b():
    return held("b")


@check
def chatty():
    sys.stdout.write("x" * 1_000_000)  # far more than a pipe's buffer (64 KiB on Linux)
    sys.stdout.flush()
    return {}


@check
def hangs():
    time.sleep(600)


@check
def dies():
    sys.stdout.write("about to die\\n")
    sys.stdout.flush()
    __import__("os")._exit(3)


@check
def fails():
    assert 1 + 1 == 3, "arithmetic"


if __name__ == "__main__":
    worker_main(CHECKS, setup=lambda: None)
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.fixture
def planned():
    """An empty plan for the test, and the session's plan back afterwards."""
    saved = list(harness._PLANNED)
    harness._PLANNED.clear()
    yield harness._PLANNED
    harness.stop_all()
    harness._PLANNED.extend(saved)


def suite(script, checks, timeout=120):
    return harness.Suite(script, checks, harness.worker_env("jax"), timeout)


def release_when(flag, condition, within=60.0):
    """Make the file ``flag`` once ``condition()`` holds (or after ``within`` seconds, so
    that a suite held by it never outlives a failing test), from a thread."""
    def run():
        deadline = time.monotonic() + within
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        flag.touch()

    threading.Thread(target=run, daemon=True).start()


def test_the_next_planned_suite_starts_while_one_is_awaited(script, planned, monkeypatch):
    """JOBS = 2: while the first suite is awaited the second starts beside it, and the
    third waits while the second runs. The first two are held by files, so the order
    does not depend on which worker a loaded machine finishes first (both quick, the
    second could end before the first, and the third then rightly started)."""
    monkeypatch.setattr(harness, "JOBS", 2)
    first, second, third = suite(script, ["held_a"]), suite(script, ["held_b"]), suite(script, ["quick"])
    planned.extend([first, second, third])
    release_when(script.with_name("a"), lambda: second.proc is not None)
    assert harness.assert_check(*first.results(), "held_a")["pid"] > 0
    assert second.proc is not None, "the second suite did not start while the first was awaited"
    assert second.running and third.proc is None, "more than JOBS suites started"
    script.with_name("b").touch()
    assert harness.assert_check(*second.results(), "held_b")["pid"] > 0
    assert harness.assert_check(*third.results(), "quick")["pid"] > 0


def test_one_job_runs_the_suites_one_after_another(script, planned, monkeypatch):
    monkeypatch.setattr(harness, "JOBS", 1)
    first, second = suite(script, ["quick"]), suite(script, ["quick"])
    planned.extend([first, second])
    first.results()
    assert second.proc is None


def test_a_suite_started_ahead_and_never_awaited_is_killed_at_the_end(script, planned, monkeypatch):
    monkeypatch.setattr(harness, "JOBS", 2)
    first, ahead = suite(script, ["quick"]), suite(script, ["hangs"])
    planned.extend([first, ahead])
    first.results()
    assert ahead.running
    harness.stop_all()
    assert ahead.proc.returncode is not None and not ahead.running


def test_suites_run_in_the_background_while_no_test_waits_for_one(script, planned, monkeypatch):
    monkeypatch.setattr(harness, "JOBS", 2)
    first, second = suite(script, ["quick"]), suite(script, ["quick"])
    planned.extend([first, second])
    harness.keep_busy()  # what conftest does before each test
    assert first.running and second.proc is None, "not one suite in the background (JOBS - 1)"
    first.proc.wait()
    harness.keep_busy()  # the first one ended: the next starts
    assert second.proc is not None
    assert harness.assert_check(*first.results(), "quick")["pid"] != harness.assert_check(*second.results(), "quick")["pid"]
    monkeypatch.setattr(harness, "JOBS", 1)
    third = suite(script, ["quick"])
    planned.append(third)
    harness.keep_busy()
    assert third.proc is None, "JOBS = 1 started a suite in the background"


def test_a_background_suite_is_timed_from_when_a_test_waits_for_it(script, planned, monkeypatch):
    monkeypatch.setattr(harness, "JOBS", 2)
    hanging = suite(script, ["hangs"], timeout=1)
    planned.append(hanging)
    harness.keep_busy()
    time.sleep(1.5)  # past its timeout since it started, but nobody has waited for it
    assert not hanging.poll() and hanging.running, "killed before any test waited for it"
    waited = time.monotonic()
    results = hanging.results()
    assert hanging.proc.returncode == -signal.SIGKILL and time.monotonic() - waited >= 1, hanging.proc.returncode
    assert results[1].endswith("[killed: still running 1 s after a test began to wait for it]"), results[1][-200:]


def test_the_modules_that_use_suites_run_last_in_their_order():
    class Module:
        def __init__(self, uses):
            self.WORKER_SUITES = [object()] if uses else []

    class Item:
        def __init__(self, name, module):
            self.name, self.module = name, module

    a, b, c = Module(True), Module(False), Module(True)
    items = [Item("a1", a), Item("a2", a), Item("b1", b), Item("c1", c), Item("b2", b), Item("c2", c)]
    assert [i.name for i in harness.suites_last(items)] == ["b1", "b2", "a1", "a2", "c1", "c2"]


def test_output_beyond_a_pipe_buffer_does_not_stop_a_worker(script, planned):
    chatty = suite(script, ["chatty", "quick"], timeout=60)
    results, output = chatty.results()
    harness.assert_check(results, output, "quick")
    # it ended by itself, all it wrote kept: a worker stopped on a full pipe would have
    # been killed at its deadline instead
    assert chatty.proc.returncode == 0 and "[killed" not in output, (chatty.proc.returncode, output[-200:])
    assert "x" * 1_000_000 in output


def test_a_hanging_worker_is_killed_at_its_timeout(script, planned):
    hanging = suite(script, ["quick", "hangs"], timeout=5)
    results = hanging.results()
    # killed (SIGKILL, not ended by itself) once its deadline had passed, its process group gone
    assert hanging.proc.returncode == -signal.SIGKILL, hanging.proc.returncode
    assert time.monotonic() >= hanging.deadline
    with pytest.raises(ProcessLookupError):
        os.killpg(hanging.proc.pid, 0)
    assert results[1].endswith("[killed: still running 5 s after a test began to wait for it]"), results[1][-200:]
    harness.assert_check(*results, "quick")  # finished before the hang: kept
    with pytest.raises(AssertionError, match=r"(?s)'hangs' did not run.*killed: still running 5 s"):
        harness.assert_check(*results, "hangs")


def test_a_dying_worker_fails_the_checks_it_did_not_run(script, planned):
    results = suite(script, ["quick", "dies", "fails"]).results()
    harness.assert_check(*results, "quick")
    with pytest.raises(AssertionError, match=r"(?s)'dies' did not run.*about to die"):
        harness.assert_check(*results, "dies")
    with pytest.raises(AssertionError, match="'fails' did not run"):
        harness.assert_check(*results, "fails")


def test_a_failing_check_reports_its_traceback(script, planned):
    with pytest.raises(AssertionError, match=r"(?s)'fails' failed in the worker.*arithmetic"):
        harness.assert_check(*suite(script, ["fails"]).results(), "fails")
