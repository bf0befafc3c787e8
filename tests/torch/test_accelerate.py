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

import accelerate_worker as job  # noqa: E402

HERE = Path(__file__).resolve().parent


def test_accelerate_multi_cpu_equals_one_big_batch(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent.parent / "src"), str(HERE), str(HERE.parent)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.WORLD),
         str(HERE / "accelerate_worker.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(job.WORLD)]
    for r in results:
        assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["backend"] == "gloo"
        assert r["layers"] == ["SyncBatchNorm"]

    model = job.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=job.LR)
    data = job.dataset()
    rows = job.BATCH * job.WORLD
    for step in range(job.STEPS):
        x, g = data[step * rows : (step + 1) * rows]
        opt.zero_grad()
        (model(x) * g).mean().backward()  # the ranks' mean losses, averaged by DDP
        opt.step()
    for key, ref in model.state_dict().items():
        for r in results:
            # float64, 2 steps of a 6-BN-layer net: a few ulp of summation order, amplified
            # by the 1/std factors of the BN layers; NaN/inf fail assert_close
            torch.testing.assert_close(r["state"][key], ref, rtol=1e-10, atol=1e-12, msg=key)
