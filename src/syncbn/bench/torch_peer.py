"""The PyTorch peers, in their own processes: ``torch.nn.BatchNorm2d``,
``syncbn.SyncBatchNorm`` and ``torch.nn.SyncBatchNorm``.

    python -m syncbn.bench.torch_peer --plan PLAN.json --out RESULT.json

This process (never joined to a process group) measures, with the plan's threads:
the copy bandwidth (the floor), and the per-layer time of BatchNorm2d, SyncBatchNorm
with no process group and torch.nn.SyncBatchNorm with none, interleaved. It then
starts a :class:`syncbn.tools.launch.WorkerPool` of gloo processes (same threads each) and,
for every W of the plan, on the process group of ranks 0..W-1: SyncBatchNorm
interleaved with BatchNorm2d on the same per-rank batch, the attempt at
torch.nn.SyncBatchNorm (a refusal is a result), the collectives of one layer call,
the merged variance's error and the memory figures. The result JSON is rewritten
after every section, so a timeout still leaves what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch
import torch.distributed as dist

from . import communication, cuda_counts, floor, memory, numerics
from .timing import measure_interleaved

_GROUPS = {}


# --------------------------------------------------------------------------- steps


def make_input(point: dict, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (point["N"], point["C"], point["H"], point["W"])
    x = torch.randn(shape, generator=gen).add_(0.5)
    dy = torch.randn(shape, generator=gen)
    if point["layout"] == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
        dy = dy.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(), dy


def layer_step(layer, x, dy):
    """One forward and backward of ``layer`` (input and parameter gradients)."""
    inputs = (x, *layer.parameters())

    def step():
        torch.autograd.grad(layer(x), inputs, dy)

    return step, (lambda: None)  # eager CPU torch: done when the call returns


class _ReduceClock:
    """Seconds spent in all-reduces over a block of steps: :meth:`timed` runs and times
    one, :meth:`sync` (a block's end) appends ``(seconds in all-reduces, steps)`` to
    ``blocks`` and starts the next block."""

    def __init__(self, blocks: list):
        self.blocks, self.spent, self.steps = blocks, 0.0, 0

    def timed(self, reduce, *args, **kwargs):
        start = time.perf_counter()
        out = reduce(*args, **kwargs)
        self.spent += time.perf_counter() - start
        return out

    def sync(self):
        self.blocks.append((self.spent, self.steps))
        self.spent, self.steps = 0.0, 0


def timed_layer_step(layer, x, dy, blocks: list):
    """:func:`layer_step` that also times syncbn's all-reduces inside the call (per
    block, in ``blocks``: see :class:`_ReduceClock`)."""
    from ..torch import distributed

    step, _ = layer_step(layer, x, dy)
    clock = _ReduceClock(blocks)
    reduce = distributed.all_reduce_sum

    def timed_step():
        distributed.all_reduce_sum = lambda tensor, group=None: clock.timed(reduce, tensor, group)
        try:
            step()
        finally:
            distributed.all_reduce_sum = reduce
        clock.steps += 1

    return timed_step, clock.sync


def emulated_step(channels: int, x, dy):
    """syncbn.SyncBatchNorm's synchronized training step in a group of two emulated in
    this process (:class:`syncbn.bench.gpu_check._NoCommunication`: each all-reduce
    doubles its tensor, no process group, no second process): the layer's own work on
    the CPU path, with neither gloo nor a second process on the VM's cores. Checked
    once before it is returned: the call makes its two all-reduces, so it really takes
    the synchronized path."""
    from .gpu_check import _NoCommunication

    step, sync = layer_step(build("syncbn", channels), x, dy)
    with _NoCommunication() as emulation:
        step()
    if emulation.all_reduces != 2:
        raise RuntimeError(f"the emulated group of two made {emulation.all_reduces} all-reduce(s) in a training "
                           "step, not 2")

    def emulated():
        with _NoCommunication():
            step()

    return emulated, sync


def bn_collectives_step(channels: int, x, dy, group, blocks: list):
    """torch.nn.BatchNorm2d with syncbn's two all-reduces (their sizes and dtypes, the
    fingerprint included) made where a synchronized layer makes them, one after the
    forward and one after the backward, timed as :func:`timed_layer_step` times syncbn's:
    what a step with two blocking collectives costs BatchNorm2d's own work in the same
    processes (the reference that the all-reduces' side effects, not their duration,
    would also burden)."""
    from ..torch import fingerprint

    layer = torch.nn.BatchNorm2d(channels)
    inputs = (x, *layer.parameters())
    forward = torch.zeros(2 * channels + 1 + fingerprint.SIZE, dtype=torch.float64)
    backward = torch.zeros(2 * channels + fingerprint.SIZE, dtype=torch.float32)
    clock = _ReduceClock(blocks)

    def step():
        y = layer(x)
        clock.timed(dist.all_reduce, forward, group=group)
        torch.autograd.grad(y, inputs, dy)
        clock.timed(dist.all_reduce, backward, group=group)
        clock.steps += 1

    return step, clock.sync


def collectives_step(channels: int, group):
    """syncbn's communication alone: the forward and the backward all-reduce of one
    layer call, with their sizes and dtypes, and nothing else."""
    forward = torch.zeros(2 * channels + 1, dtype=torch.float64)
    backward = torch.zeros(2 * channels, dtype=torch.float32)

    def step():
        dist.all_reduce(forward, group=group)
        dist.all_reduce(backward, group=group)

    return step, (lambda: None)


LEAKY_SLOPE = 0.01  # the fused layer needs an invertible activation: LeakyReLU(0.01)


def fused_available():
    """None when ``syncbn.SyncBatchNormAct`` can be imported, else why not."""
    try:
        from ..torch.batchnorm_act import SyncBatchNormAct  # noqa: F401
    except ImportError as exc:
        return f"syncbn.SyncBatchNormAct is not available: {exc}"
    return None


def build(key: str, channels: int, group=None):
    from ..torch.batchnorm import SyncBatchNorm

    if key == "torch_bn":
        return torch.nn.BatchNorm2d(channels)
    if key == "syncbn":
        return SyncBatchNorm(channels, process_group=group)
    if key == "torch_syncbn":
        return torch.nn.SyncBatchNorm(channels, process_group=group)
    if key == "syncbn_leaky":  # the unfused block the fused layer replaces
        return torch.nn.Sequential(SyncBatchNorm(channels, process_group=group), torch.nn.LeakyReLU(LEAKY_SLOPE))
    if key == "syncbn_act":
        from ..torch.batchnorm_act import SyncBatchNormAct

        return SyncBatchNormAct(channels, "leaky_relu", LEAKY_SLOPE, process_group=group)
    raise KeyError(key)


def _block_keys(plan: dict, unavailable: dict) -> list:
    """The fused and unfused BN + activation blocks, when syncbn is measured."""
    if "syncbn" not in plan["peers"]:
        return []
    reason = fused_available()
    if reason:
        unavailable["syncbn_act"] = reason
        return []
    return ["syncbn_leaky", "syncbn_act"]


def try_layer(key: str, point: dict, group=None):
    """Run one training call; None if it works, else the refusal as text."""
    layer = build(key, point["C"], group)
    x, dy = make_input(point, 0)
    try:
        layer(x).backward(dy)
        return None
    except Exception as exc:  # the refusal is the result
        return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- this process


def local_timing(plan: dict) -> dict:
    """No process group: BatchNorm2d, SyncBatchNorm, torch.nn.SyncBatchNorm, and
    SyncBatchNorm's synchronized step in an emulated group of two (:func:`emulated_step`),
    interleaved."""
    refusals = {}
    keys = [k for k in ("torch_bn", "syncbn", "torch_syncbn") if k in plan["peers"] or k == "torch_bn"]
    keys += _block_keys(plan, refusals)
    points = []
    for i, point in enumerate(plan["points"]):
        candidates = {}
        for key in keys:
            refusal = try_layer(key, point)
            if refusal is not None:
                refusals[key] = refusal
                continue
            x, dy = make_input(point, i)
            candidates[key] = layer_step(build(key, point["C"]), x, dy)
        if "syncbn" in keys:
            x, dy = make_input(point, i)
            candidates["syncbn_emulated"] = emulated_step(point["C"], x, dy)
        times = measure_interleaved(candidates, plan["repeats"], plan["warmup"], plan["min_block_s"])
        points.append(times)
    return {"world": None, "times": points, "refusals": refusals}


# --------------------------------------------------------------------------- pool jobs


def make_groups(sizes):
    """Process groups of ranks 0..W-1 for every W (collective: every rank, same order)."""
    for size in sorted(set(sizes)):
        if size not in _GROUPS:
            _GROUPS[size] = dist.new_group(list(range(size)))
    return dist.get_rank()


def pool_timing(plan: dict, world: int):
    """SyncBatchNorm on the group of W ranks, interleaved with BatchNorm2d on the same
    per-rank batch; the attempt at torch.nn.SyncBatchNorm."""
    if dist.get_rank() >= world:
        return None
    group = _GROUPS[world]

    def agree(n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def barrier():
        dist.barrier(group=group)

    refusals = {}
    if "torch_syncbn" in plan["peers"]:
        refusal = try_layer("torch_syncbn", plan["points"][0], group)
        if refusal is not None:
            refusals["torch_syncbn"] = refusal
    keys = ["torch_bn", "syncbn"] + ([] if refusals or "torch_syncbn" not in plan["peers"] else ["torch_syncbn"])
    keys += _block_keys(plan, refusals)
    points = []
    for i, point in enumerate(plan["points"]):
        candidates = {}
        blocks: list = []
        bn_blocks: list = []
        for key in keys:
            x, dy = make_input(point, 1000 * dist.get_rank() + i)
            if key == "syncbn" and world > 1:
                candidates[key] = timed_layer_step(build(key, point["C"], group), x, dy, blocks)
            else:
                candidates[key] = layer_step(build(key, point["C"], group), x, dy)
        if world > 1:
            candidates["collectives"] = collectives_step(point["C"], group)
            x, dy = make_input(point, 1000 * dist.get_rank() + i)
            candidates["bn_collectives"] = bn_collectives_step(point["C"], x, dy, group, bn_blocks)
        times = measure_interleaved(candidates, plan["repeats"], plan["warmup"], plan["min_block_s"], agree, barrier)
        # the timed blocks are the last ones; subtract their all-reduces per step
        for key, recorded, name in (("syncbn", blocks, "syncbn_compute"),
                                    ("bn_collectives", bn_blocks, "bn_collectives_compute")):
            if recorded:
                timed = recorded[-len(times[key]):]
                times[name] = [t - spent / max(steps, 1) for t, (spent, steps) in zip(times[key], timed)]
        times.pop("bn_collectives", None)
        points.append(times)
    return {"world": world, "times": points, "refusals": refusals}


def pool_collectives(channels: int, world: int):
    if dist.get_rank() >= world:
        return None
    return communication.count_layer_collectives(channels, _GROUPS[world])


def pool_numerics(spec: dict, world: int):
    if dist.get_rank() >= world:
        return None
    return numerics.torch_variances(spec, world, _GROUPS[world])


def pool_large_planes(spec: dict, world: int):
    if dist.get_rank() >= world:
        return None
    return numerics.large_plane_errors(spec, world, _GROUPS[world])


def pool_cuda_counts(spec: dict):
    if dist.get_rank() >= 2:
        return None
    return cuda_counts.layer_counts(spec, _GROUPS[2])


def pool_memory(spec: dict, world: int):
    if dist.get_rank() >= world:
        return None
    group = _GROUPS[world]
    blocks = memory.block_rows(spec, group)
    peaks = memory.peak_step_rows(spec, group)
    return {"world": world, "blocks": blocks, "peak_step": peaks} if dist.get_rank() == 0 else None


# --------------------------------------------------------------------------- driver


def _max_over_ranks(per_rank: list) -> list:
    """Per point and candidate: the slowest rank's time of every repeat."""
    ranks = [r for r in per_rank if r is not None]
    merged = []
    for i, point in enumerate(ranks[0]["times"]):
        merged.append({key: [max(r["times"][i][key][k] for r in ranks) for k in range(len(values))]
                       for key, values in point.items()})
    return merged


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    plan = json.loads(open(args.plan).read())
    threads = plan["threads"]
    torch.set_num_threads(threads)

    result = {"peer": "torch", "versions": {"torch": torch.__version__, "python": platform.python_version()},
              "threads": threads, "sections": {}, "errors": {}}

    def save():
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    def section(name, fn):
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception:
            result["errors"][name] = traceback.format_exc()
        result["sections"][name] = round(time.perf_counter() - start, 2)
        save()

    section("floor", lambda: floor.copy_bandwidth(plan["copy_mib"], repeats=max(3, plan["repeats"])))
    section("local", lambda: local_timing(plan))

    worlds = sorted(set(plan["worlds"]["torch"]) | set(plan["numerics"]["worlds"])
                    | set(plan["large_planes"]["worlds"]) | {2})
    from ..tools.launch import WorkerPool
    # the jobs must pickle by their importable name, not as ``__main__.<job>``
    from . import torch_peer as jobs

    pool = None
    try:
        section("pool_start", lambda: {"size": max(worlds)})
        cuda_counts.interpret_triton_in_workers()  # counts of the Triton path (the CPU tensors' path is unchanged)
        pool = WorkerPool(max(worlds), backend="gloo", timeout=600, threads=threads)
        pool.run(jobs.make_groups, worlds)

        def timings():
            out = []
            for w in plan["worlds"]["torch"]:
                per_rank = pool.run(jobs.pool_timing, plan, w)
                out.append({"world": w, "times": _max_over_ranks(per_rank), "refusals": per_rank[0]["refusals"]})
            return out

        section("pool", timings)
        section("collectives", lambda: [
            pool.run(jobs.pool_collectives, c, w)[0]
            for w in worlds if w >= 2 for c in plan["comm_channels"]])
        section("numerics", lambda: [
            {"world": w, "errors": pool.run(jobs.pool_numerics, plan["numerics"], w)[0]} for w in plan["numerics"]["worlds"]])
        section("large_planes", lambda: [
            row for w in plan["large_planes"]["worlds"]
            for row in pool.run(jobs.pool_large_planes, plan["large_planes"], w)[0]])
        section("cuda_counts", lambda: pool.run(jobs.pool_cuda_counts, plan["cuda_counts"])[0])
    finally:
        if pool is not None:
            pool.close()

    # Memory in a fresh pair of processes whose allocator returns every large block to
    # the system when it is freed (a fixed mmap threshold), so that the resident set
    # follows the live tensors and one model's freed memory is not reused by the next.
    timing_allocator = {key: os.environ.get(key) for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072")
    pool = None
    try:
        pool = WorkerPool(2, backend="gloo", timeout=600, threads=threads)
        pool.run(jobs.make_groups, [2])
        section("memory", lambda: pool.run(jobs.pool_memory, plan["memory"], 2)[0])
    finally:
        if pool is not None:
            pool.close()
        for key, value in timing_allocator.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
