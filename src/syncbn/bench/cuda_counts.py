"""Cost of one layer call on the CUDA code path, as counts that do not depend on hardware.

No GPU is needed: the layer runs on the CPU with its device-dependent choices forced to
the CUDA ones (``syncbn.torch.stats._forced_cuda_path``), and every operation that reaches
the dispatcher is recorded with its tensors' shapes (a ``TorchDispatchMode``, which sees
the forward and the autograd engine's backward alike). Per call, forward and backward:

- **passes**: reads plus writes of tensors as large as the input (an operation that reads
  x and writes y counts 2). Every such operation on this path is a single pass of its
  kernel, so counting tensors at the operation boundary counts the kernels' passes;
- **launches**: operations that would launch a device kernel (views, allocations and
  collectives excluded; collectives are counted on their own);
- **host syncs**: operations that make the host wait for the device (``.item()``,
  ``bool(tensor)``, ``nonzero``, a boolean-mask index).

Where Triton is installed, the path counted is the one CUDA tensors take: the Triton
kernels of :mod:`syncbn.torch.kernels`, run on the CPU by Triton's interpreter (the
counting process sets ``TRITON_INTERPRET=1`` before Triton is first imported; the rows
say ``"path": "triton"``). Each kernel launch is a custom operator ``syncbn::triton_*``,
recorded as one launch. Without Triton (or in a process that imported it compiling, or with
``SYNCBN_TRITON=0``, which keeps CUDA tensors off the kernels), the torch-op path is counted (``"path": "torch ops"``): three of its CUDA kernels
(``batch_norm_elemt``, ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``) do
not exist on the CPU; there the path calls stand-in operators with the same inputs and
outputs, recorded as one operation each, the way the CUDA kernel is one launch.

Both layers are counted: ``syncbn.SyncBatchNorm`` (rows under ``"syncbn"``) and
``syncbn.SyncBatchNormAct`` with leaky_relu (rows under ``"syncbn_act"``) and with ELU
(``"syncbn_act_elu"``: float32, its kept-channel choice from each rank's minimum and
maximum, found in the moments' pass).

The layer fingerprint's verdicts (:mod:`syncbn.torch.fingerprint`) are read once per step, when
the backward pass ends, in a ``syncbn.check_agreement`` profiler range: its operations
(2 launches, 1 host sync, whatever the number of layers) are counted apart, under
``per_step``, not in the layer call's counts.

``torch.nn.SyncBatchNorm`` refuses CPU tensors, so its counts are read off its source
(``torch/nn/modules/_functions.py``, torch 2.13, NCCL path) and given beside ours as
data, not measured; ``torch.nn.BatchNorm2d``'s are read off its CUDA kernels too.
"""

from __future__ import annotations

from typing import Dict, List

__all__ = ["count_call", "layer_counts", "interpret_triton_in_workers", "main", "TORCH_SYNCBN", "BATCHNORM2D", "STANDINS", "BARS"]

# The bars per layer call (issue 34), collectives apart: launches, activation-sized
# passes, host synchronisations.
BARS = {"forward": {"launches": 5, "passes": 3, "host_syncs": 0},
        "backward": {"launches": 3, "passes": 5, "host_syncs": 0}}

# The stand-ins of the forced CPU path and the CUDA kernel each one stands for.
STANDINS = {
    "syncbn::batch_norm_elemt_standin": "aten::batch_norm_elemt",
    "syncbn::batch_norm_backward_elemt_standin": "aten::batch_norm_backward_elemt",
    "syncbn::batch_norm_backward_reduce_standin": "aten::batch_norm_backward_reduce",
}

# torch.nn.SyncBatchNorm's CUDA algorithm per training call (read, not run), module
# included (num_batches_tracked += 1). Forward: batch_norm_stats (read x), full (the
# count), cat, [all_gather], then, unless a CUDA graph is being captured, the mask of
# ranks with elements (ge) and three boolean-mask indexings (each a nonzero, which
# reads the mask back to the host, and an index kernel), batch_norm_gather_stats_with_counts
# (merge and running buffers), count_all.to(int32), batch_norm_elemt (read x, write y).
# Backward: batch_norm_backward_reduce (read dy and x), cat, [all_reduce],
# batch_norm_backward_elemt (read dy and x, write dx).
TORCH_SYNCBN = {
    "source": "read off torch/nn/modules/_functions.py (torch 2.13), not run: it refuses CPU tensors",
    "forward": {"passes": 3, "launches": 14, "host_syncs": 3, "collectives": 1,
                "launches_under_graph_capture": 7, "host_syncs_under_graph_capture": 0},
    "backward": {"passes": 5, "launches": 3, "host_syncs": 0, "collectives": 1},
}

# torch.nn.BatchNorm2d on CUDA (cuDNN or the native kernels): statistics (read x) and
# normalization (read x, write y) forward, reduction (read dy and x) and input gradient
# (read dy and x, write dx) backward; one library call each way plus the module's
# num_batches_tracked += 1 (read, not run).
BATCHNORM2D = {
    "source": "read off torch's CUDA batch-norm kernels, not run",
    "forward": {"passes": 3, "launches": 2, "host_syncs": 0, "collectives": 0},
    "backward": {"passes": 5, "launches": 1, "host_syncs": 0, "collectives": 0},
}

_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "set_", "resize_"}
_SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal"}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}
_MARKERS = {"profiler"}  # profiler ranges: host-side bookkeeping, no kernel


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _record(func, args, kwargs, out, numel: int) -> dict:
    name = func.name()
    base = name.split("::", 1)[-1].split(".", 1)[0]
    if func.namespace in _COLLECTIVE_NAMESPACES:
        kind = "collective"
    elif func.namespace in _MARKERS:
        kind = "marker"
    elif base in _SYNCS:
        kind = "host_sync"
    elif func.is_view or base in _NO_KERNEL:
        kind = "view"
    else:
        kind = "launch"
    schema = func._schema.arguments
    values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
    reads = written = 0
    mutated = []
    for arg, value in zip(schema, values):
        big = [t for t in _tensors(value) if t.numel() == numel]
        if not arg.is_out:
            reads += len(big)
        if arg.alias_info is not None and arg.alias_info.is_write:
            mutated += big
    outs = [t for t in _tensors(out) if t.numel() == numel]
    # each activation-sized tensor written once, whether returned, mutated or both
    written = len({t.data_ptr() for t in outs + mutated})
    return {"op": STANDINS.get(name, name), "kind": kind,
            "passes": 0 if kind in ("view", "collective", "marker") else reads + written,
            "shapes": [list(t.shape) for t in _tensors(values)]}


def count_call(layer, x, dy) -> Dict[str, dict]:
    """Forward and backward counts of ``layer(x)`` with output gradient ``dy``, on the
    CUDA path (the caller's layer must take it: see :mod:`syncbn.torch.stats`), in the steady
    state: one step (forward and backward) runs first, uncounted, so the small constants
    the path keeps on the device exist already (on CUDA their first copy is a host sync,
    once per layer and process).

    The operations inside the ``syncbn.check_agreement`` profiler range (the layer
    fingerprint's verdicts of the whole step read at once when the backward pass ends,
    :mod:`syncbn.torch.fingerprint`) are counted apart, under ``per_step``: they are paid once
    per backward pass whatever the number of layers, not per layer call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ..torch import fingerprint, stats

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: List[dict] = []
            self.step: List[dict] = []
            self.in_step = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.name() == "profiler::_record_function_enter_new" and args and args[0] == fingerprint.STEP_CHECK:
                self.in_step = True
            elif func.name().startswith("profiler::_record_function_exit"):
                self.in_step = False
            (self.step if self.in_step else self.ops).append(_record(func, args, kwargs, out, x.numel()))
            return out

    from ..torch import kernels

    result = {}
    # the path CUDA tensors would take here: the kernels, unless SYNCBN_TRITON=0 keeps them off
    triton = stats._TRITON_ENABLED and kernels.enable_interpreter()
    with stats._forced_triton_path() if triton else stats._forced_cuda_path():
        layer(x).backward(dy)  # warm-up
        for t in [x, *layer.parameters()]:
            t.grad = None  # the counted backward writes its gradients, as a first one would
        forward = Recorder()
        with forward:
            y = layer(x)
        backward = Recorder()
        with backward:
            y.backward(dy)
        result["path"] = "triton" if stats.triton_path(x) else "torch ops"
    for name, rec in (("forward", forward), ("backward", backward)):
        result[name] = {**_totals(rec.ops), "ops": [o for o in rec.ops if o["kind"] not in ("view", "marker")],
                        "per_step": {**_totals(rec.step),
                                     "ops": [o for o in rec.step if o["kind"] not in ("view", "marker")]}}
    return result


def _totals(ops: List[dict]) -> dict:
    return {"passes": sum(o["passes"] for o in ops),
            "launches": sum(o["kind"] == "launch" for o in ops),
            "host_syncs": sum(o["kind"] == "host_sync" for o in ops),
            "collectives": sum(o["kind"] == "collective" for o in ops)}


def interpret_triton_in_workers() -> None:
    """Where Triton is installed, worker processes started after this call run its kernels
    in the interpreter (``TRITON_INTERPRET=1``, read when Triton is first imported), so that
    the counts are those of the Triton path. Call it before the pool starts."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is not None:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def layer_counts(spec: dict, group=None) -> dict:
    """Run on every rank of ``group`` (W >= 2): syncbn.SyncBatchNorm's counts on the CUDA
    path for each per-rank shape and layout of ``spec``, beside torch.nn.SyncBatchNorm's
    and BatchNorm2d's (read off their sources). Rank 0 returns the report."""
    import torch
    import torch.distributed as dist

    from ..torch.batchnorm import SyncBatchNorm
    from ..torch.batchnorm_act import SyncBatchNormAct

    layers = {"syncbn": lambda c: SyncBatchNorm(c, process_group=group),
              "syncbn_act": lambda c: SyncBatchNormAct(c, "leaky_relu", 0.01, process_group=group),
              "syncbn_act_elu": lambda c: SyncBatchNormAct(c, "elu", 1.0, process_group=group)}
    rows = {key: [] for key in layers}
    for key, build in layers.items():
        for shape in spec["shapes"]:
            for layout in spec["layouts"]:
                gen = torch.Generator().manual_seed(5 + dist.get_rank(group))
                x = torch.randn(shape, generator=gen) * 2 + 3
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                x = x.contiguous(memory_format=fmt).requires_grad_()
                dy = torch.randn(x.shape, generator=gen).contiguous(memory_format=fmt)
                counts = count_call(build(shape[1]), x, dy)
                rows[key].append({"shape": list(shape), "layout": layout, **counts})
    return {**rows, "torch_syncbn": TORCH_SYNCBN, "batchnorm2d": BATCHNORM2D,
            "bars": _bars(rows["syncbn"] + rows["syncbn_act"] + rows["syncbn_act_elu"])} if dist.get_rank(group) == 0 else None


def _bars(rows: list) -> dict:
    """The issue's bars (:data:`BARS`), for both layers: forward at most 5 launches and 3
    activation-sized passes, backward 3 and 5, no host synchronisation in a call."""
    ok = {}
    for way, bar in BARS.items():
        worst = {k: max(r[way][k] for r in rows) for k in ("passes", "launches", "host_syncs")}
        ok[way] = {"worst": worst,
                   "passes_ok": worst["passes"] <= bar["passes"],
                   "launches_ok": worst["launches"] <= bar["launches"],
                   "no_host_sync": worst["host_syncs"] == 0}
    return ok


def _job(spec: dict):
    return layer_counts(spec)


def main(argv=None) -> int:
    """``python -m syncbn.bench.cuda_counts [--shape N C H W] [-v]``: the counts alone (2 gloo
    processes on this machine, both layouts), without the rest of ``syncbn bench``."""
    import argparse

    from ..tools.launch import WorkerPool

    parser = argparse.ArgumentParser(prog="python -m syncbn.bench.cuda_counts",
                                     description="syncbn's CUDA path counted on the CPU, per layer call")
    parser.add_argument("--shape", type=int, nargs=4, default=[2, 64, 28, 28], metavar=("N", "C", "H", "W"),
                        help="one rank's input (default 2 64 28 28)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list the recorded operations")
    args = parser.parse_args(argv)
    if any(size < 1 for size in args.shape):  # before the workers start, not their tracebacks
        parser.error(f"--shape must be four positive sizes, got {' '.join(map(str, args.shape))}")
    interpret_triton_in_workers()
    with WorkerPool(2) as pool:
        rep = pool.run(_job, {"shapes": [args.shape], "layouts": ["contiguous", "channels_last"]})[0]
    cell = lambda c: f"{c['passes']} / {c['launches']} / {c['host_syncs']}"  # noqa: E731
    print("per layer call: forward, backward passes / launches / host syncs (collectives apart)")
    for key, label in (("syncbn", "syncbn.SyncBatchNorm"), ("syncbn_act", "syncbn.SyncBatchNormAct"),
                       ("syncbn_act_elu", "syncbn.SyncBatchNormAct(elu)")):
        for row in rep[key]:
            print(f"  {label} {tuple(row['shape'])} {row['layout']} ({row['path']}): {cell(row['forward'])}, "
                  f"{cell(row['backward'])}; once per step: {cell(row['backward']['per_step'])}")
            for way in ("forward", "backward") if args.verbose else ():
                for op in row[way]["ops"] + row[way]["per_step"]["ops"]:
                    print(f"      {way} {op['kind']} {op['op']} passes={op['passes']} {op['shapes']}")
    for key, label in (("torch_syncbn", "torch.nn.SyncBatchNorm (read)"), ("batchnorm2d", "torch.nn.BatchNorm2d (read)")):
        print(f"  {label}: {cell(rep[key]['forward'])}, {cell(rep[key]['backward'])}")
    for way, bar in rep["bars"].items():
        print(f"  bars {way} (at most {BARS[way]['launches']} launches, {BARS[way]['passes']} passes): "
              f"passes {'ok' if bar['passes_ok'] else 'FAIL'}, launches {'ok' if bar['launches_ok'] else 'FAIL'}, "
              f"host syncs {'ok' if bar['no_host_sync'] else 'FAIL'}")
    return 0 if all(b["passes_ok"] and b["launches_ok"] and b["no_host_sync"] for b in rep["bars"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
