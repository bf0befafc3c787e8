"""When ranks fail or disagree in size: every rank ends with an error, never a hang.

- a rank that raises in its own code, or is killed, mid-step: the other rank's next
  synchronized layer call ends with the process group's error within its timeout
  (syncbn neither retries nor swallows it); under torchrun the job exits non-zero;
- ranks whose payloads differ in size (another channel count): with
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch's collective check names the mismatch on every
  rank (syncbn's fingerprint only covers calls of equal size).

Each test starts its own 2 processes (a killed or stuck rank must not take the shared
pool with it); timeouts are small.
"""

import multiprocessing as mp
import os
import queue
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import syncbn
from syncbn.torch import fingerprint
from syncbn.tools.launch import WorkerError, WorkerPool, free_port

PG_TIMEOUT = 10  # seconds: the process group's timeout in these tests
HERE = Path(__file__).resolve().parent


def spawn_failing_job(mode):
    """Both ranks' outcome lines, with torch.multiprocessing's spawn context."""
    import torch.multiprocessing as tmp

    from failing_rank_worker import spawned

    ctx = tmp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=spawned, args=(r, port, mode, PG_TIMEOUT, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    lines = {}
    try:
        for _ in range(2 if mode == "raise" else 1):
            rank, code, text = results.get(timeout=PG_TIMEOUT + 120)  # bounded: never wait forever
            lines[rank] = (code, text)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return lines, [p.exitcode for p in procs]


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_failing_rank_ends_the_other_with_an_error(mode):
    lines, codes = spawn_failing_job(mode)
    print(lines, codes)
    code, text = lines[0]
    assert code == 1 and text.startswith("rank 0: ") and "finished" not in text, text
    assert "LayerMismatchError" not in text  # the peer's failure, not a disagreement
    seconds = float(text.split(" after ")[1].split(" s:")[0])
    assert seconds < PG_TIMEOUT + 60, text  # the process group's timeout bounds it (margin: a loaded CI)
    if mode == "raise":
        assert lines[1] == (1, lines[1][1]) and "rank 1 fails in its own code" in lines[1][1]
    else:
        assert codes[1] == -9  # SIGKILL


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_failing_rank_fails_the_torchrun_job(mode, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent / "src"), str(HERE), str(HERE.parent)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(HERE / "failing_rank_worker.py"), mode, str(PG_TIMEOUT)],
        capture_output=True, text=True, timeout=PG_TIMEOUT + 240, env=env, cwd=tmp_path,
    )
    output = proc.stdout + proc.stderr
    print(output[-4000:])
    assert proc.returncode != 0, output
    assert "rank 0: finished" not in output and "rank 1: finished" not in output
    if mode == "raise":
        assert "rank 1: RuntimeError" in output and "rank 1 fails in its own code" in output
    else:
        assert "Signals.SIGKILL" in output or "SIGKILL" in output, output[-3000:]


# ---- size disagreements under TORCH_DISTRIBUTED_DEBUG=DETAIL ---------------------------


def widths_job(widths):
    """Rank r runs three converted layers of widths ``widths[r]``; returns the error."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = syncbn.convert_sync_batchnorm(nn.Sequential(*[nn.BatchNorm2d(c) for c in widths[rank]]))
    try:
        for layer in model:
            layer(torch.randn(2, layer.num_features, 3, 3))
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return "ok"


def test_size_disagreement_is_named_by_torch_on_every_rank(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    with WorkerPool(2, timeout=PG_TIMEOUT + 50) as detail:
        try:
            results = detail.run(widths_job, [[8, 8, 8], [8, 8, 4]], timeout=120)
        except WorkerError as exc:  # pragma: no cover - shows what happened
            pytest.fail(str(exc))
    for rank, (name, message) in enumerate(results):
        assert name == "RuntimeError"
        assert "Detected mismatch between collectives on ranks" in message, message
        # both ranks' payload shapes are named: 2C+1 values plus the fingerprint
        f = fingerprint.SIZE
        assert f"TensorShape=[{2 * 8 + 1 + f}]" in message and f"TensorShape=[{2 * 4 + 1 + f}]" in message, message
