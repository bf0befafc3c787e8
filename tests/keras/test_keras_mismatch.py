"""Workers that disagree about the synchronized layers under ``MultiWorkerMirroredStrategy``
(two worker processes on 127.0.0.1, one CPU replica each, torch blocked): every worker
ends the step with an error, none completes it silently, none waits past the
collectives' timeout. See ``keras_mismatch_worker.py`` for the scenarios; the check
itself in one process (eager, tf.function, XLA) is in ``keras_tf_checks.py``
(``fingerprint_*``)."""

import importlib.util
import json
import tempfile
from pathlib import Path

import pytest

import keras_harness as harness

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs tensorflow")

TIMEOUT = 240
COLLECTIVE_TIMEOUT = 4  # CommunicationOptions(timeout_seconds=...) in the workers

# Each group runs in its own pair of processes: a step that failed in a collective
# leaves TensorFlow's collectives unusable ("Restart your program to reset"), and after
# a failed assert the next step may not match up either, so each group ends with the
# scenario that fails that way.
GROUPS = [
    ["agree", "agree_guarded", "swapped_eager", "swapped", "skip_middle"],
    ["skip_last"],
    ["absent"],
    ["swapped_xla"],
]


@pytest.fixture(scope="module")
def outcomes():
    """{scenario: [worker 0's outcome, worker 1's]}, all groups run at once."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for group in GROUPS:
            cluster = {"worker": [f"127.0.0.1:{p}" for p in harness.free_ports(2)]}
            for index in range(2):
                tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
                env = harness.worker_env("tensorflow", TF_CONFIG=tf_config)
                procs.append(harness.start(
                    "keras/keras_mismatch_worker.py",
                    ["--index", index, "--out", tmp, "--timeout", COLLECTIVE_TIMEOUT, "--scenarios", *group], env))
        results = harness.finish(procs, TIMEOUT)
        members = [(group, index) for group in GROUPS for index in range(2)]
        crashed = {}
        for (group, index), (code, output) in zip(members, results):
            written = all((Path(tmp) / f"{name}-{index}.json").exists() for name in group)
            # Every group ends with a step whose collectives failed; TensorFlow, aborting
            # them, can itself die of a signal before the worker's os._exit (SIGSEGV after
            # "Aborting RingReduce with DEADLINE_EXCEEDED", 1 of 12 runs of this file with two
            # CPU-bound jobs beside it). Once every outcome is written, the tests below judge them.
            # The worker waiting on an absent peer can die so inside the step, before it writes
            # its outcome (SIGSEGV, a busy loop beside the suite): its death by a signal (None is
            # the harness's kill after TIMEOUT, a hang) and output go to that test to judge.
            if group == ["absent"] and index == 0 and code is not None and code < 0 and not written:
                crashed[("absent", index)] = {"ok": False, "signal": -code, "output": output[-6000:]}
                continue
            assert code == 0 or (code is not None and code < 0 and written), \
                f"worker {index} of {group} exited with {code} (outcomes written: {written}):\n{output[-6000:]}"
        yield {name: [crashed.get((name, i)) or json.loads((Path(tmp) / f"{name}-{i}.json").read_text())
                      for i in range(2)]
               for group in GROUPS for name in group}


def test_agreeing_workers_train(outcomes):
    for outcome in outcomes["agree"]:
        assert outcome["ok"] and outcome["finite"] and all(outcome["moved"]), outcome


def test_guarded_optimizer_trains_agreeing_workers(outcomes):
    """SkipMismatchedSteps under MultiWorkerMirroredStrategy (on CPU its updates merge
    in a cross-replica call, so the tf.cond on the step's verdict is taken there, around
    the inner optimizer): an agreeing step applies it once, alike on both workers."""
    first, second = outcomes["agree_guarded"]
    for outcome in (first, second):
        assert outcome["ok"] and outcome["finite"] and all(outcome["moved"]), outcome
        assert outcome["iterations"] == 1, outcome
        # gamma starts at 1; the loss (sum of the last layer's output squared) moves the
        # last layer's gamma by 0.1 * 2 * (elements) per channel, the others' barely.
        assert all(abs(g - 1.0) > 0.1 for g in outcome["gamma"][2]), outcome
    assert first["gamma"] == second["gamma"], (first, second)


def test_swapped_layers_raise_on_both_workers_eager(outcomes):
    """Same-width layers in another order: before, both completed silently."""
    for index, outcome in enumerate(outcomes["swapped_eager"]):
        assert not outcome["ok"] and outcome["type"] == "LayerMismatchError", outcome
        assert "replica 0 called layer 'bn0' (4 channels), call 0" in outcome["message"], outcome
        assert "replica 1 called layer 'bn1' (4 channels), call 0" in outcome["message"], outcome
        assert outcome["moved"] == [False, False, False], outcome


def test_swapped_layers_raise_on_both_workers_traced(outcomes):
    for index, outcome in enumerate(outcomes["swapped"]):
        assert not outcome["ok"] and outcome["type"] == "InvalidArgumentError", outcome
        assert "syncbn: the replicas are in different synchronized layer calls (forward)" in outcome["message"]
        assert f"called layer \\'bn{index}\\' (4 channels), call 0 of the step" in outcome["message"], outcome
        assert outcome["moved"] == [False, False, False], outcome


def test_skipped_middle_layer_raises_on_both_workers(outcomes):
    """Worker 1 skips bn1: its call 1 is bn2 where worker 0's is bn1. Before, worker 1
    completed the step and worker 0 failed."""
    for index, outcome in enumerate(outcomes["skip_middle"]):
        assert not outcome["ok"] and outcome["type"] == "InvalidArgumentError", outcome
        assert f"called layer \\'bn{index + 1}\\' (4 channels), call 1 of the step" in outcome["message"], outcome
        assert outcome["moved"] == [True, False, False], outcome  # bn0's call agreed


def test_skipped_last_layer_fails_on_both_workers(outcomes):
    """Worker 1 skips bn2, so its backward meets worker 0's forward: TensorFlow's
    collectives see two payloads of different types and fail on both workers."""
    for outcome in outcomes["skip_last"]:
        assert not outcome["ok"] and outcome["type"] == "InternalError", outcome
        assert "Collective" in outcome["message"], outcome
        assert outcome["seconds"] < COLLECTIVE_TIMEOUT + 30, outcome


# What a collective that a peer never joins can end with on TensorFlow: its own timeout
# (DeadlineExceeded), or, once the peer has exited or stopped answering (the absent
# worker leaves a few seconds after the timeout; MultiWorkerMirroredStrategy's health
# check aborts the collectives as Unavailable), a peer-loss error; collectives aborted
# while pending end Cancelled or Aborted. Which one comes first depends on the load.
PEER_LOSS_ERRORS = {"DeadlineExceededError", "UnavailableError", "CancelledError", "AbortedError"}


def test_absent_worker_times_out(outcomes):
    """Worker 1 stays alive but runs no step: worker 0's step ends with a TensorFlow
    error of a timeout or a lost peer within a bounded time (it does not wait forever),
    and nothing moved on either worker."""
    waiting, absent = outcomes["absent"]
    assert absent.get("absent") and absent["moved"] == [False, False, False], absent
    if "signal" in waiting:  # TensorFlow died aborting the timed-out collective: it ended, no hang
        assert "Collective has timed out" in waiting["output"], waiting["output"]
        return
    assert not waiting["ok"] and waiting["tf_error"] and waiting["type"] in PEER_LOSS_ERRORS, waiting
    assert waiting["seconds"] < COLLECTIVE_TIMEOUT + 30, waiting
    assert waiting["moved"] == [False, False, False], waiting


def test_xla_step_fails_to_compile_on_both_workers(outcomes):
    """jit_compile=True on CPU: TensorFlow cannot compile the RING collectives, so both
    workers fail before any collective runs and nothing moves. (Where XLA can compile
    them, on GPUs with NCCL or on TPUs, see keras_tf_checks.py's fingerprint_xla_step.)"""
    for outcome in outcomes["swapped_xla"]:
        assert not outcome["ok"] and outcome["type"] == "InvalidArgumentError", outcome
        assert "Only compiling NCCL/auto collective is supported" in outcome["message"], outcome
        assert outcome["moved"] == [False, False, False], outcome
