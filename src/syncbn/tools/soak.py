"""``syncbn soak``: a long training run that must leave the processes as it found them.

W local gloo processes (default 2) train two small converted models side by side under
DDP, one with :class:`syncbn.SyncBatchNorm` layers (``convert_sync_batchnorm``) and one
with :class:`syncbn.SyncBatchNormAct` layers (``fuse_batchnorm_act``), for ``--steps``
steps (default 5,000), with an eval pass now and then. Every ``--every`` steps each rank
reports its resident memory (in MiB, 2**20 bytes), open file descriptors and threads
(from ``/proc/self``); the run passes when, after the ``--warmup`` steps, no rank's
resident memory grows by more than ``--max-growth-mb`` MiB (default 10) over its figure
at the end of the warm-up, and its descriptor and thread counts never change. Not part
of CI (CI runs 200 steps, see ``tests/tools/test_soak.py``). Linux only (``/proc``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, List

from .launch import WorkerError, failure_report
from .usage import torch_missing

HELP = "train small converted models for many steps on W local processes and check that memory, fds and threads stay flat"

DESCRIPTION = """\
W local gloo processes (--world-size, default 2) train two small converted models side by
side under DDP, one of syncbn.SyncBatchNorm layers and one of syncbn.SyncBatchNormAct
layers, for --steps steps with an eval pass now and then. Every --every steps each rank
reports its resident memory, open file descriptors and threads (from /proc/self). The run
passes (exit 0) when, after the --warmup steps, no rank's resident memory grows by more than
--max-growth-mb MiB over its figure at the end of the warm-up and its descriptor and thread
counts never change; else it fails (exit 1). Linux only."""

__all__ = ["process_figures", "soak_chunk", "soak", "add_arguments", "run"]

_STATE: Dict[str, object] = {}  # this worker's models, optimizers, data and step count


def process_figures() -> dict:
    """This process's resident memory (bytes), open file descriptors and OS threads."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    return {
        "rss": int(status["VmRSS"][0]) * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"][0]),
    }


def _build(world: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .. import torch as sbn

    group = None
    if dist.get_world_size() != world:  # a sub-group of the first ranks (collective: every rank)
        group = dist.new_group(list(range(world)))
    _STATE["member"] = dist.get_rank() < world
    if not _STATE["member"]:
        return

    def net():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.LeakyReLU(0.1),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.LeakyReLU(0.1),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
        )

    plain = sbn.convert_sync_batchnorm(net(), process_group=group)
    fused = sbn.fuse_batchnorm_act(net(), process_group=group)
    assert any(isinstance(m, sbn.SyncBatchNormAct) for m in fused.modules())
    models = [DDP(m, process_group=group) for m in (plain, fused)]
    _STATE.update(
        models=models,
        optimizers=[torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in models],
        generator=torch.Generator().manual_seed(1000 + dist.get_rank()),
        step=0,
    )


def soak_chunk(world: int, steps: int) -> dict:
    """Worker job: train ``steps`` more steps (building the models on the first call);
    returns this rank's figures afterwards (None on ranks outside the group)."""
    import torch
    import torch.nn.functional as F

    if "member" not in _STATE:
        _build(world)
    if not _STATE["member"]:
        return None
    gen = _STATE["generator"]
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, generator=gen) * 2 + 1
        target = torch.randint(0, 4, (4,), generator=gen)
        for model, opt in zip(_STATE["models"], _STATE["optimizers"]):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
        _STATE["step"] += 1
    for model in _STATE["models"]:  # an eval pass: no collective
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 3, 8, 8, generator=gen))
        model.train()
    return dict(process_figures(), step=_STATE["step"], loss=float(loss.detach()))


def soak_reset() -> None:
    """Worker job: drop the soak's state (the test pool is shared)."""
    _STATE.clear()


def soak(run_job: Callable, world: int, steps: int, every: int, warmup: int, max_growth_mb: float,
         say: Callable[[str], None] = print) -> dict:
    """Drive the chunks through ``run_job(fn, *args)`` (a pool's ``run``), print the figures
    and return ``{"samples": [...], "passed": bool, "verdict": str}``."""
    samples: List[list] = []
    done = 0
    start = time.monotonic()
    say(f"soak: W={world}, {steps} steps, SyncBatchNorm and SyncBatchNormAct models under DDP")
    say(f"{'step':>6} {'seconds':>8} " + " ".join(f"{'rank' + str(r) + ' RSS MiB':>13} {'fds':>4} {'thr':>4}"
                                            for r in range(world)))
    while done < steps:
        chunk = min(every, steps - done)
        if done < warmup < done + chunk:  # a sample exactly at the end of the warm-up
            chunk = warmup - done
        try:
            figures = [f for f in run_job(soak_chunk, world, chunk)[:world]]
        except WorkerError as exc:  # a rank raised: its error, as verify shows it
            verdict = failure_report(exc.errors, exc.stuck)
        except TimeoutError as exc:
            verdict = f"FAIL: {exc} (a collective or a step did not finish within the timeouts)"
        else:
            verdict = None
        if verdict is not None:
            say(verdict)
            return {"samples": samples, "passed": False, "verdict": verdict, "summary": []}
        done = figures[0]["step"]
        samples.append(figures)
        say(f"{done:>6} {time.monotonic() - start:>8.1f} " + " ".join(
            f"{f['rss'] / 2**20:>13.1f} {f['fds']:>4} {f['threads']:>4}" for f in figures))
    base = next((s for s in samples if s[0]["step"] >= warmup), samples[0])
    after = [s for s in samples if s[0]["step"] >= base[0]["step"]]
    problems, lines = [], []
    if len(after) < 2 or base[0]["step"] < warmup:  # nothing measured after the warm-up
        problems.append(f"no sample after the warm-up of {warmup} steps to compare with (more steps needed)")
    for rank in range(world):
        growth = max(s[rank]["rss"] for s in after) - base[rank]["rss"]
        fds = {s[rank]["fds"] for s in after}
        threads = {s[rank]["threads"] for s in after}
        lines.append(f"rank {rank}: RSS growth after step {base[0]['step']}: {growth / 2**20:+.2f} MiB "
                     f"(last {(after[-1][rank]['rss'] - base[rank]['rss']) / 2**20:+.2f} MiB); "
                     f"fds {sorted(fds)}; threads {sorted(threads)}")
        if growth > max_growth_mb * 2**20:
            problems.append(f"rank {rank} grew {growth / 2**20:.2f} MiB")
        if len(fds) > 1 or len(threads) > 1:
            problems.append(f"rank {rank}'s descriptors or threads changed")
    passed = not problems and done >= steps
    verdict = "PASS" if passed else "FAIL: " + "; ".join(problems)
    for line in lines:
        say(line)
    say(verdict)
    return {"samples": samples, "passed": passed, "verdict": verdict, "summary": lines}


def add_arguments(parser) -> None:
    import argparse

    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--steps", type=int, default=5000, help="training steps (default 5000)")
    parser.add_argument("--world-size", type=int, default=2, help="local gloo processes (default 2)")
    parser.add_argument("--every", type=int, default=250, help="report every this many steps (default 250)")
    parser.add_argument("--warmup", type=int, default=500, help="steps before growth is counted (default 500)")
    parser.add_argument("--max-growth-mb", type=float, default=10.0, help="allowed RSS growth per rank, in MiB (default 10)")
    parser.add_argument("--timeout", type=float, default=120.0, help="process-group timeout in seconds (default 120)")


def run(args) -> int:
    import math

    if torch_missing("soak"):  # the workers train torch models: say so before starting them
        return 2
    from .launch import MAX_TIMEOUT_S, WorkerPool

    wrong = [f"{option} must be {rule}, got {value}" for option, value, bad, rule in (
        ("--steps", args.steps, args.steps < 1, "at least 1"),
        ("--every", args.every, args.every < 1, "at least 1"),
        ("--warmup", args.warmup, args.warmup < 0, "0 or more"),
        ("--world-size", args.world_size, args.world_size < 2, "at least 2"),
        ("--max-growth-mb", args.max_growth_mb, not (args.max_growth_mb >= 0 and math.isfinite(args.max_growth_mb)),
         "a finite number >= 0"),
        ("--timeout", args.timeout, not 0.0 < args.timeout < math.inf, "a finite positive number"),
        # torch's deadlines overflow beyond it (see MAX_TIMEOUT_S)
        ("--timeout", args.timeout, MAX_TIMEOUT_S < args.timeout < math.inf, "at most 1e9 seconds (about 31 years)"),
    ) if bad]
    if wrong:
        print("syncbn soak: " + "; ".join(wrong), file=sys.stderr)
        return 2
    first = args.warmup if args.warmup > 0 else args.every  # the step growth is measured from
    if args.steps <= first:
        print(f"syncbn soak: --steps ({args.steps}) must be more than {first} (--warmup, or --every without "
              "one): growth is measured from there on", file=sys.stderr)
        return 2
    with WorkerPool(args.world_size, backend="gloo", timeout=args.timeout) as pool:
        result = soak(pool.run, args.world_size, args.steps, args.every, args.warmup, args.max_growth_mb)
    return 0 if result["passed"] else 1
