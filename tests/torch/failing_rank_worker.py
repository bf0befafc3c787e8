"""A 2-rank training job in which one rank fails mid-step (tests/test_failures.py).

Run under torchrun (``python -m torch.distributed.run ... tests/failing_rank_worker.py
MODE TIMEOUT``) or through :func:`spawned`, one process per rank. Rank 1 trains one good
step, then, in the middle of the second (after the first layer's forward, before the
second's), ``raise``s in its own code or is ``kill``ed (SIGKILL). Rank 0 goes on into the
second layer's all-reduce and must end with an error of its own: the process group's,
within its timeout (TIMEOUT seconds: the layers' group), never a hang. Each rank prints
one line ``rank R: ...``.
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


# the default group's timeout: only its rendezvous, which waits for the slower rank to start
# (on a loaded machine 10 s were too few: a rank's store wait timed out before the test began)
RENDEZVOUS = datetime.timedelta(seconds=300)


def train(mode: str, group) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.BatchNorm2d(4)),
                                          process_group=group)
    for step in range(2):
        x = torch.randn(2, 4, 3, 3, requires_grad=True)
        y = model[0](x)
        if step == 1 and rank == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("rank 1 fails in its own code")
        y = model[2](model[1](y))
        y.sum().backward()


def run(mode: str, timeout: float) -> int:
    """Train in a group of both ranks whose timeout is ``timeout`` (made once both have
    started: the default group's rendezvous waits for the slower one)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout))
    start = time.monotonic()
    try:
        train(mode, group)
    except Exception as exc:  # noqa: BLE001 - reported, then the process fails
        print(f"rank {rank}: {type(exc).__name__} after {time.monotonic() - start:.1f} s: "
              f"{str(exc).splitlines()[0][:300]}", flush=True)
        return 1
    print(f"rank {rank}: finished", flush=True)
    return 0


def spawned(rank: int, port: int, mode: str, timeout: float, results) -> None:
    """torch.multiprocessing entry point: the outcome line goes to ``results``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=RENDEZVOUS)
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run(mode, timeout)
    results.put((rank, code, out.getvalue().strip()))


if __name__ == "__main__":
    mode, timeout = sys.argv[1], float(sys.argv[2])
    dist.init_process_group("gloo", timeout=RENDEZVOUS)
    sys.exit(run(mode, timeout))
