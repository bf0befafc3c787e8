"""Ray Train: docs/torch.md's recipe (tests/torch/ray_worker.py), a ``TorchTrainer`` with 2
CPU workers (gloo on loopback, in a local Ray of its own started by a driver subprocess),
trains a converted model exactly like one process on the concatenated batch."""

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.train.torch", reason="ray[train] is not installed (requirements/dev.txt pins it)")

import recipe_job  # noqa: E402

HERE = Path(__file__).resolve().parent


def session_members(sid):
    """Pids of the live (not zombie) processes of session ``sid``."""
    found = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(path.split("/")[2]))
    return found


def ray_processes_left(sid):
    """The processes of the driver's session (Ray's, which ray.shutdown() should have ended)
    still running 20 s after the driver exited, killed (SIGKILL)."""
    deadline = time.monotonic() + 20
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = session_members(sid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def test_ray_train_two_cpu_workers_equal_one_big_batch(tmp_path):
    # Ray's files (and its sockets, whose paths must stay under ~107 characters) in a short
    # folder of this test's own, so that its processes can be told apart from any other Ray
    temp_dir = tempfile.mkdtemp(prefix="syncbn-ray-", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent / "src"), str(HERE), str(HERE.parent)]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", RAY_USAGE_STATS_ENABLED="0",
               # Ray's processes and gloo on loopback only: with this (default: on, but for
               # Windows and macOS), ray.util.get_node_ip_address() in a worker, which Ray Train
               # makes MASTER_ADDR, is 127.0.0.1 rather than the address that routes to 8.8.8.8
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo",
               # starting the 2 workers (each importing torch) takes 15-20 s on 2 busy cores;
               # Ray Train's default limit is 60 s
               RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="180",
               # token authentication (Ray's default) with a token of this run, instead of one
               # Ray would generate and save to ~/.ray/auth_token
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex)
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_ADDRESS", None)
    # the driver in a session of its own, which every process of its Ray joins (raylet, GCS,
    # agents, the controller and the workers): a session id, where Ray's process titles
    # name none of this test's paths
    driver = subprocess.Popen([sys.executable, str(HERE / "ray_worker.py"), str(tmp_path), temp_dir],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
                              start_new_session=True)
    try:
        output, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        left = ray_processes_left(driver.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert driver.returncode == 0, output[-6000:]
    assert not left, f"Ray processes left running after ray.shutdown(): {left}"
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(recipe_job.WORLD)]
    for r, result in enumerate(results):
        assert (result["rank"], result["world"], result["backend"], result["ddp"]) == (r, recipe_job.WORLD, "gloo", True)
        assert result["master_addr"] == "127.0.0.1"
        assert result["layers"] == ["SyncBatchNorm"]

    recipe_job.assert_equal_to_one_process([result["state"] for result in results])
