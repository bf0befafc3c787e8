"""accelerate: the README's recipe (tests/accelerate_worker.py) on 2 CPU processes
(accelerate's MULTI_CPU, gloo on loopback, started by torchrun) trains a converted model
exactly like one process on the concatenated batch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import recipe_job  # noqa: E402

HERE = Path(__file__).resolve().parent


def test_accelerate_multi_cpu_equals_one_big_batch(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent / "src"), str(HERE), str(HERE.parent)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(recipe_job.WORLD),
         str(HERE / "accelerate_worker.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(recipe_job.WORLD)]
    for r in results:
        assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["backend"] == "gloo"
        assert r["layers"] == ["SyncBatchNorm"]

    recipe_job.assert_equal_to_one_process([r["state"] for r in results])
