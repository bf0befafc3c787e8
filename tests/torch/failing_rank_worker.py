"""A 2-rank training job in which one rank fails mid-step (tests/test_failures.py).

Run under torchrun (``python -m torch.distributed.run ... tests/failing_rank_worker.py
MODE TIMEOUT``) or through :func:`spawned`, one process per rank. Rank 1 trains one good
step, then, in the middle of the second (after the first layer's forward, before the
second's), ``raise``s in its own code or is ``kill``ed (SIGKILL). Rank 0 goes on into the
second layer's all-reduce and must end with an error of its own: the process group's,
within its timeout, never a hang. Each rank prints one line ``rank R: ...``.
"""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import syncbn


def train(mode: str) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.BatchNorm2d(4)))
    for step in range(2):
        x = torch.randn(2, 4, 3, 3, requires_grad=True)
        y = model[0](x)
        if step == 1 and rank == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank 1 fails in its own code")
        y = model[2](model[1](y))
        y.sum().backward()


def run(mode: str) -> int:
    rank = dist.get_rank()
    start = time.monotonic()
    try:
        train(mode)
    except Exception as exc:  # noqa: BLE001 - reported, then the process fails
        print(f"rank {rank}: {type(exc).__name__} after {time.monotonic() - start:.1f} s: "
              f"{str(exc).splitlines()[0][:300]}", flush=True)
        return 1
    print(f"rank {rank}: finished", flush=True)
    return 0


def spawned(rank: int, port: int, mode: str, timeout: float, results) -> None:
    """torch.multiprocessing entry point: the outcome line goes to ``results``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run(mode)
    results.put((rank, code, out.getvalue().strip()))


if __name__ == "__main__":
    mode, timeout = sys.argv[1], float(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    sys.exit(run(mode))
