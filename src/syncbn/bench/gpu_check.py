"""The prepared GPU check behind ``scripts/gpu-check``: run it whenever a CUDA machine is
at hand. Two ranks on the GPU(s) (NCCL with two or more GPUs, else gloo with both ranks
sharing GPU 0) check the CUDA path of ``syncbn.SyncBatchNorm``:

- **oracle**: output, input/weight/bias gradients and running buffers of
  ``SyncBatchNorm`` and ``SyncBatchNormAct`` (leaky_relu) against float64 batch norm on
  the concatenated batch, uneven and empty ranks, both layouts, float32 and float64
  (bounds: those of ``tests/bn_oracle.py``, 1e-4 and 1e-10 relative), and float16 and
  bfloat16 inputs beside float32 parameters, as under autocast (:func:`_oracle_bounds`);
- **numerics**: merged variance at |mean|/std = 1e3 and 1e4 on (2, 16, 256, 256) per
  rank, float32, against float64 (the issue's CUDA bars: 1e-5 and 1e-4);
- **counts**: passes, launches and host syncs per call on the real device (no stand-ins),
  of ``SyncBatchNorm`` and ``SyncBatchNormAct``, with the path taken (the Triton kernels
  of :mod:`syncbn.torch.kernels` where Triton is installed, else torch's ops);
- **timing**: forward + backward of syncbn.SyncBatchNorm (on the kernels, and on the
  torch-op path: ``syncbn.SyncBatchNorm (torch ops)``), SyncBatchNormAct,
  torch.nn.SyncBatchNorm and torch.nn.BatchNorm2d on the same GPU, wall clock of a step
  ended by ``torch.cuda.synchronize()``, median over repeats, the slower rank; also
  syncbn's step minus its all-reduces beside BatchNorm2d's step with the same two
  all-reduces minus them (the W = 2 bar of the CPU bench), and each layer alone on
  rank 0 in a group of one (the no-group bar);
- **deeplab**: one training step of torchvision's DeepLabV3-ResNet50 (2 x 3 x 512 x 512 per
  rank, bf16 autocast, channels_last, a group of two emulated in one process) converted by
  syncbn, by ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, and left unsynchronized
  (:func:`deeplab_job`);
- **compile**: ``torch.compile(fullgraph=True)`` of a small converted model on the
  device, two training steps against eager (float64, bound 1e-9).

``--device cpu`` runs the same on the CPU with the CUDA path forced (torch's
SyncBatchNorm refuses CPU tensors and is left out): a dry run of this script. Writes
``report.json`` and ``report.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from ..tools.usage import positive_int

# the CPU bench's grid of per-rank inputs, and two segmentation-sized ones
SHAPES = [[n, c, hw, hw] for n in (2, 8) for c in (64, 256) for hw in (28, 56)] + [[2, 64, 256, 256],
                                                                                  [2, 256, 128, 128]]
LAYOUTS = ("contiguous", "channels_last")
BIG = [2, 64, 512, 1024]  # a Cityscapes crop's first-stage plane, for the single-process sections
SLOPE = 0.01  # SyncBatchNormAct's leaky_relu


def _setup(device: str):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _forcing(device: str):
    import contextlib

    from ..torch import stats

    return stats._forced_cuda_path() if device == "cpu" else contextlib.nullcontext()


def _makers(device: str, fused: bool = True) -> dict:
    """The timed layers by name, each made from ``(channels, process group)``:
    torch.nn.SyncBatchNorm on CUDA only (it refuses CPU tensors)."""
    import torch

    from .. import torch as sbn

    makers = {"syncbn.SyncBatchNorm": lambda c, g: sbn.SyncBatchNorm(c, process_group=g)}
    if device == "cuda":  # the torch-op CUDA path beside the Triton kernels (when these run)
        makers["syncbn.SyncBatchNorm (torch ops)"] = lambda c, g: _TorchOps(sbn.SyncBatchNorm(c, process_group=g))
    if fused:
        makers["syncbn.SyncBatchNormAct"] = lambda c, g: sbn.SyncBatchNormAct(c, process_group=g)
    makers["torch.nn.BatchNorm2d"] = lambda c, g: torch.nn.BatchNorm2d(c)
    if device == "cuda":
        makers["torch.nn.SyncBatchNorm"] = lambda c, g: torch.nn.SyncBatchNorm(c, process_group=g)
    return makers


def _torch_ops_class():
    import torch

    class TorchOps(torch.nn.Module):
        """A syncbn layer whose forward keeps the Triton kernels off (``SYNCBN_TRITON=0``
        for this layer alone: the torch-op CUDA path); its backward follows its forward."""

        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            from ..torch import stats

            before, stats._TRITON_ENABLED = stats._TRITON_ENABLED, False
            try:
                return self.layer(x)
            finally:
                stats._TRITON_ENABLED = before

    return TorchOps


def _TorchOps(layer):  # noqa: N802 - a class made on first use (torch imported lazily here)
    return _torch_ops_class()(layer)


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _kernels_on(device: str) -> bool:
    """Whether the layers take the Triton kernels on ``device`` (CUDA: Triton installed
    and not switched off with ``SYNCBN_TRITON=0``)."""
    import torch

    from ..torch import stats

    if device != "cuda":
        return False
    return stats.triton_path(torch.empty(2, 3, device="cuda"))


def _grid(dev, shapes):
    """``(shape, layout, x, dy)`` for each shape in both layouts, float32, ``x``
    requiring its gradient."""
    import torch

    for shape, layout in itertools.product(shapes, LAYOUTS):
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = torch.randn(shape, device=dev).contiguous(memory_format=fmt).requires_grad_()
        yield shape, layout, x, torch.randn_like(x)


def _oracle_bounds() -> dict:
    """Relative error bounds of the oracle section by input dtype and layer.

    float32 and float64: those of ``tests/bn_oracle.py``. Half inputs (float32 weights,
    as under autocast) are normalized in float32 and rounded once to the input dtype, an
    error of u (the unit roundoff, 2^-11 for float16, 2^-8 for bfloat16) relative to the
    largest value: bound 4u. SyncBatchNormAct recovers x-hat from its half output, within
    its amplification budget B times u (B = 2^3 float16, 2^2 bfloat16; see
    :mod:`syncbn.torch.batchnorm_act`), which enters the gradients once: bound 4Bu."""
    import torch

    from ..torch.batchnorm_act import AMPLIFICATION_BUDGET

    bounds = {
        torch.float32: {"SyncBatchNorm": 1e-4, "SyncBatchNormAct": 1e-4},
        torch.float64: {"SyncBatchNorm": 1e-10, "SyncBatchNormAct": 1e-10},
    }
    for dtype, u in ((torch.float16, 2.0**-11), (torch.bfloat16, 2.0**-8)):
        bounds[dtype] = {"SyncBatchNorm": 4 * u, "SyncBatchNormAct": 4 * AMPLIFICATION_BUDGET[dtype] * u}
    return bounds


def oracle_job(device: str) -> list:
    """Every rank: its results beside the float64 oracle's; rank 0 returns the errors."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from .. import torch as sbn

    dev = _setup(device)
    rank = dist.get_rank()
    bounds = _oracle_bounds()
    rows = []
    for impl, dtype, layout, sizes in itertools.product(
        ("SyncBatchNorm", "SyncBatchNormAct"), tuple(bounds),
        ("contiguous", "channels_last"), ((3, 2), (4, 0)),
    ):
        pdtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # as under autocast
        gen = torch.Generator().manual_seed(11)
        xs = [torch.randn(n, 5, 6, 7, generator=gen, dtype=torch.float64) * 2 + 3 for n in sizes]
        dys = [torch.randn(n, 5, 6, 7, generator=gen, dtype=torch.float64) for n in sizes]
        w = torch.linspace(0.5, 2, 5, dtype=torch.float64)
        b = torch.linspace(-1, 1, 5, dtype=torch.float64)
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = xs[rank].to(dev, dtype).clone(memory_format=fmt).requires_grad_()
        layer = (sbn.SyncBatchNorm(5, momentum=1.0) if impl == "SyncBatchNorm" else
                 sbn.SyncBatchNormAct(5, momentum=1.0, activation="leaky_relu",
                                         activation_param=SLOPE)).to(dev, pdtype)
        with torch.no_grad():
            layer.weight.copy_(w)
            layer.bias.copy_(b)
        with _forcing(device):
            y = layer(x)
            y.backward(dys[rank].to(dev, dtype).contiguous(memory_format=fmt))
        grads = torch.stack([layer.weight.grad, layer.bias.grad]).double()
        dist.all_reduce(grads)
        # the oracle: float64 on the concatenation of the same (rounded) values
        xr = torch.cat([t.to(dtype).double() for t in xs]).requires_grad_()
        wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
        rm, rv = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
        yr = F.batch_norm(xr, rm, rv, wr, br, True, 1.0, layer.eps)
        if impl == "SyncBatchNormAct":
            yr = F.leaky_relu(yr, SLOPE)
        yr.backward(torch.cat([t.to(dtype).double() for t in dys]))
        lo = sum(sizes[:rank])
        mine = slice(lo, lo + sizes[rank])

        def rel(a, r):
            a, r = a.detach().double().cpu(), r.detach()
            return float((a - r).abs().max() / max(float(r.abs().max()), 1.0)) if r.numel() else 0.0

        errs = {"y": rel(y, yr[mine]), "dx": rel(x.grad, xr.grad[mine]),
                "dparams": rel(grads, torch.stack([wr.grad, br.grad])),
                "buffers": rel(torch.stack([layer.running_mean, layer.running_var]), torch.stack([rm, rv]))}
        worst = torch.tensor(list(errs.values()), dtype=torch.float64, device=dev)  # NCCL: on the GPU
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        bound = bounds[dtype][impl]
        rows.append({"impl": impl, "dtype": str(dtype), "layout": layout, "sizes": list(sizes), "bound": bound,
                     "errors": dict(zip(errs, worst.tolist())), "passed": bool((worst < bound).all())})
    return rows if rank == 0 else None


def numerics_job(device: str) -> list:
    import torch
    import torch.distributed as dist

    from .. import torch as sbn

    dev = _setup(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for ratio, bar in ((1e3, 1e-5), (1e4, 1e-4)):
        gen = torch.Generator().manual_seed(100 + rank)
        x = (torch.randn(2, 16, 256, 256, generator=gen, dtype=torch.float64) + ratio).float()
        layer = sbn.SyncBatchNorm(16, momentum=1.0).to(dev)
        with _forcing(device):
            layer(x.to(dev))
        xd = x.double().to(dev)
        count = world * (x.numel() // 16)
        parts = [torch.empty_like(xd) for _ in range(world)]
        dist.all_gather(parts, xd)
        whole = torch.cat([p.cpu() for p in parts])
        ref = whole.var(dim=(0, 2, 3), correction=1)
        rel = float(((layer.running_var.double().cpu() - ref).abs() / ref).max())
        rows.append({"ratio": ratio, "bar": bar, "merged_variance_rel": rel, "passed": rel <= bar, "count": count})
    return rows if rank == 0 else None


def counts_job(device: str) -> list:
    import torch
    import torch.distributed as dist

    from .. import torch as sbn

    from . import cuda_counts

    dev = _setup(device)
    rows = []
    for layout in ("contiguous", "channels_last"):
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = torch.randn(8, 64, 56, 56, device=dev).contiguous(memory_format=fmt).requires_grad_()
        dy = torch.randn_like(x)
        for name, layer in (("syncbn.SyncBatchNorm", sbn.SyncBatchNorm(64)),
                            ("syncbn.SyncBatchNormAct", sbn.SyncBatchNormAct(64))):
            counts = cuda_counts.count_call(layer.to(dev), x, dy)
            path = counts.pop("path")
            rows.append({"layer": name, "layout": layout, "path": path,
                         **{w: {k: v for k, v in counts[w].items() if k != "ops"} for w in counts},
                         "ops": {w: [o["op"] for o in counts[w]["ops"]] for w in counts}})
    return rows if dist.get_rank() == 0 else None


class _Clock:
    """Wall-clock seconds of a step on ``device`` (the step ends when the device is
    done) and, separately, of the all-reduces inside it: each is timed from a finished
    device queue to a finished all-reduce, so the work queued before it counts in the
    step, not in the all-reduce."""

    def __init__(self, device: str):
        import torch

        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.in_reduces = 0.0

    def reduce(self, fn, *args, **kwargs):
        self.sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        self.in_reduces += time.perf_counter() - start
        return out

    def step(self, fn) -> tuple:
        """(seconds of ``fn()``, seconds of that inside :meth:`reduce`)."""
        self.in_reduces = 0.0
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start, self.in_reduces


def _median_ms(clock: "_Clock", step, repeats: int, barrier=None) -> tuple:
    """Median step time and median step time minus its all-reduces, in ms, after five
    warm-up steps (``barrier`` before each step lines the ranks up)."""
    whole, rest = [], []
    for i in range(repeats + 5):
        if barrier is not None:
            barrier()
        total, reduces = clock.step(step)
        if i >= 5:
            whole.append(total)
            rest.append(total - reduces)
    return 1e3 * statistics.median(whole), 1e3 * statistics.median(rest)


def timing_job(device: str, repeats: int) -> list:
    """Rank 0's rows. W = 2 rows: the slower rank's median; "minus all-reduces" rows
    take out the time of syncbn's two all-reduces (patched in at
    ``syncbn.torch.distributed.all_reduce_sum``), and BatchNorm2d "with all-reduces" makes two
    all-reduces of the same sizes and dtypes where syncbn makes them. No-group rows: rank
    0 alone (rank 1 waits), syncbn in a group of one."""
    import torch
    import torch.distributed as dist

    from ..torch import distributed

    dev = _setup(device)
    rank = dist.get_rank()
    alone = dist.new_group([0])  # every rank takes part in making it
    clock = _Clock(device)
    payloads = []  # (numel, dtype) of syncbn's all-reduces in one step
    reduce = distributed.all_reduce_sum

    def timed_reduce(tensor, group=None):
        payloads.append((tensor.numel(), tensor.dtype))
        return clock.reduce(reduce, tensor, group)

    makers = _makers(device)
    rows = []

    def add(shape, layout, name, world, whole, rest=None):
        if world == 2:  # the slower rank
            both = torch.tensor([whole, -1.0 if rest is None else rest], dtype=torch.float64, device=dev)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            whole, rest = both.tolist()
            rest = None if rest < 0 else rest
        row = {"shape": shape, "layout": layout, "impl": name, "world": world, "median_ms": whole}
        if rest is not None:
            row["minus_all_reduces_ms"] = rest
        rows.append(row)

    for shape, layout, x, dy in _grid(dev, SHAPES):
        with _forcing(device):
            # W = 2, syncbn's all-reduces timed inside the step
            for name, make in makers.items():
                layer = make(shape[1], None).to(dev)
                distributed.all_reduce_sum = timed_reduce
                try:
                    payloads.clear()
                    whole, rest = _median_ms(clock, lambda: layer(x).backward(dy), repeats, dist.barrier)
                finally:
                    distributed.all_reduce_sum = reduce
                add(shape, layout, name, 2, whole, rest if name.startswith("syncbn") else None)
                if name == "syncbn.SyncBatchNorm":
                    step_payloads = payloads[: len(payloads) // (repeats + 5)]
            # BatchNorm2d with syncbn's all-reduces where syncbn makes them
            layer = torch.nn.BatchNorm2d(shape[1]).to(dev)
            inputs = (x, *layer.parameters())
            buffers = [torch.zeros(n, dtype=dt, device=dev) for n, dt in step_payloads]

            def bn_with_reduces():
                y = layer(x)
                for buf in buffers[:-1]:
                    clock.reduce(dist.all_reduce, buf)
                torch.autograd.grad(y, inputs, dy)
                clock.reduce(dist.all_reduce, buffers[-1])

            whole, rest = _median_ms(clock, bn_with_reduces, repeats, dist.barrier)
            add(shape, layout, "torch.nn.BatchNorm2d with syncbn's all-reduces", 2, whole, rest)
            # no group: rank 0 alone
            for name, make in makers.items():
                if rank == 0:
                    layer = make(shape[1], alone).to(dev)
                    whole, _ = _median_ms(clock, lambda: layer(x).backward(dy), repeats)
                    add(shape, layout, name, 1, whole)
                dist.barrier()
    return rows if rank == 0 else None


class _NoCommunication:
    """Within the block, this process acts as one of two ranks that hold the same
    data: every all-reduce doubles its tensor in place and every all-gather copies it,
    with no communication (syncbn's ``all_reduce_sum`` and ``group_size``, and
    ``torch.distributed``'s ``all_reduce`` and ``all_gather`` that torch.nn.SyncBatchNorm
    calls over gloo). What is left of a synchronized step is the layer's own work.
    ``all_reduces`` counts syncbn's all-reduces made in the block."""

    def __enter__(self):
        import torch.distributed as dist

        from ..torch import distributed

        self.saved = [(distributed, "all_reduce_sum"), (distributed, "group_size"), (dist, "all_reduce"),
                      (dist, "all_gather")]
        self.saved = [(mod, name, getattr(mod, name)) for mod, name in self.saved]
        self.all_reduces = 0

        def all_reduce_sum(tensor, group=None):
            self.all_reduces += 1
            return tensor.mul_(2)

        distributed.all_reduce_sum = all_reduce_sum
        distributed.group_size = lambda group=None: 2

        def all_reduce(tensor, *args, **kwargs):
            tensor.mul_(2)

        def all_gather(parts, tensor, *args, **kwargs):
            for part in parts:
                part.copy_(tensor)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        for mod, name, value in self.saved:
            setattr(mod, name, value)


def emulated_job(device: str, repeats: int) -> list:
    """Rank 0 alone (rank 1 waits): each layer's synchronized training step in a group
    of two emulated without communication (:class:`_NoCommunication`), so neither a
    second process on the same GPU nor gloo's copies through the host take part;
    BatchNorm2d beside it. Shapes: the timing grid and a 512 x 1024 plane."""
    import torch.distributed as dist

    dev = _setup(device)
    rows = []
    if dist.get_rank() == 0:
        clock = _Clock(device)
        makers = _makers(device)
        for shape, layout, x, dy in _grid(dev, SHAPES + [BIG]):
            for name, make in makers.items():
                layer = make(shape[1], None).to(dev)
                try:
                    with _forcing(device), _NoCommunication():
                        whole, _ = _median_ms(clock, lambda: layer(x).backward(dy), repeats)
                    rows.append({"shape": shape, "layout": layout, "impl": name, "world": "2, emulated",
                                 "median_ms": whole})
                except Exception as exc:  # rank 0 alone: nothing waits on it
                    rows.append({"shape": shape, "layout": layout, "impl": name, "error": repr(exc)})
            del x, dy
    dist.barrier()
    return rows if dist.get_rank() == 0 else None


# The real step of issue 34: torchvision's DeepLabV3-ResNet50, 2 x 3 x 512 x 512 per rank,
# bf16 autocast, channels_last, a group of two emulated in one process; on the CPU (the
# dry run and the suite) a 2 x 3 x 64 x 64 batch.
DEEPLAB_SHAPE = {"cuda": (2, 3, 512, 512), "cpu": (2, 3, 64, 64)}


def deeplab_job(device: str, repeats: int) -> list:
    """Rank 0 alone: one training step (forward under bf16 autocast, cross-entropy, backward;
    no optimizer) of torchvision's DeepLabV3-ResNet50 (random init, 21 classes) with its
    batch norms converted by syncbn, by ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``
    (CUDA only) and left as BatchNorm2d (the unsynchronized floor), each in a group of two
    emulated without communication (:class:`_NoCommunication`); the median step time."""
    import torch
    import torch.distributed as dist

    dev = _setup(device)
    rows = []
    if dist.get_rank() == 0:
        import torchvision

        from .. import torch as sbn

        shape = DEEPLAB_SHAPE[device]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=gen).to(dev).contiguous(memory_format=torch.channels_last)
        target = torch.randint(0, 21, (shape[0], shape[2], shape[3]), generator=gen).to(dev)
        converters = {"syncbn.convert_sync_batchnorm": sbn.convert_sync_batchnorm,
                      "torch.nn.BatchNorm2d (not synchronized)": lambda m: m}
        if device == "cuda":
            converters["torch.nn.SyncBatchNorm.convert_sync_batchnorm"] = torch.nn.SyncBatchNorm.convert_sync_batchnorm
        clock = _Clock(device)
        for name, convert in converters.items():
            torch.manual_seed(0)
            model = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None,
                                                                       num_classes=21, aux_loss=False)
            model = convert(model).to(dev).to(memory_format=torch.channels_last).train()

            def step():
                with torch.autocast(device_type=device, dtype=torch.bfloat16):
                    out = model(x)["out"]
                torch.nn.functional.cross_entropy(out.float(), target).backward()

            try:
                with _forcing(device), _NoCommunication():
                    whole, _ = _median_ms(clock, step, repeats)
                rows.append({"model": "deeplabv3_resnet50", "shape": list(shape), "impl": name,
                             "world": "2, emulated", "median_ms": whole})
            except Exception as exc:  # rank 0 alone: nothing waits on it
                rows.append({"model": "deeplabv3_resnet50", "shape": list(shape), "impl": name, "error": repr(exc)})
            del model
    dist.barrier()
    return rows if dist.get_rank() == 0 else None


def _replayable(device: str, step):
    """``step`` captured once in a CUDA graph after three warm-up calls on a side stream
    (torch's recipe), returned as the graph's replay; on the CPU, ``step`` itself."""
    import torch

    if device != "cuda":
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def graphs_job(device: str, repeats: int) -> list:
    """Rank 0 alone: the device-side time of each layer's synchronized training step
    (forward and input/parameter gradients) in a group of two emulated without
    communication (:class:`_NoCommunication`), captured in a CUDA graph and replayed, so
    no host work is timed: what the kernels themselves take. Each row is the median over
    ``repeats`` blocks of 20 replays (1 on the CPU), after five, timed by the wall clock
    between synchronizations (:func:`_median_ms`), per replay."""
    import torch
    import torch.distributed as dist

    dev = _setup(device)
    rows = []
    if dist.get_rank() == 0:
        clock = _Clock(device)
        makers = _makers(device, fused=False)
        block = 20 if device == "cuda" else 1  # the CPU dry run only checks the code
        for shape, layout, x, dy in _grid(dev, SHAPES + [BIG]):
            for name, make in makers.items():
                layer = make(shape[1], None).to(dev)
                inputs = (x, *layer.parameters())
                row = {"shape": shape, "layout": layout, "impl": name, "world": "2, emulated, graph"}
                try:
                    with _forcing(device), _NoCommunication():
                        replay = _replayable(device, lambda: torch.autograd.grad(layer(x), inputs, dy))
                        whole, _ = _median_ms(clock, lambda: [replay() for _ in range(block)], repeats)
                    row["median_ms"] = whole / block
                except Exception as exc:  # rank 0 alone: nothing waits on it
                    row["error"] = repr(exc)
                rows.append(row)
            del x, dy
    dist.barrier()
    return rows if dist.get_rank() == 0 else None


def compile_job(device: str) -> list:
    """``torch.compile(fullgraph=True)`` of a converted Conv-BN-ReLU-Linear model on
    ``device``, two SGD steps on uneven float64 batches, against the same model eager."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from .. import torch as sbn

    dev = _setup(device)
    rank = dist.get_rank()

    def model():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.Flatten(), nn.Linear(8 * 6 * 6, 3))
        return sbn.convert_sync_batchnorm(net).to(dev, torch.float64)

    def train(net, fn):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        outs = []
        for step in range(2):
            gen = torch.Generator().manual_seed(17 * step + rank)
            x = torch.randn((3, 2)[rank], 3, 6, 6, generator=gen, dtype=torch.float64).to(dev) * 2 + 1
            dy = torch.randn((3, 2)[rank], 3, generator=gen, dtype=torch.float64).to(dev)
            opt.zero_grad()
            y = fn(x)
            y.backward(dy)
            opt.step()
            outs.append(y.detach())
        return torch.cat([torch.cat(outs).flatten()] + [t.detach().flatten() for t in net.state_dict().values()
                                                         if t.is_floating_point()])

    import torch._dynamo

    torch._dynamo.reset()
    started = time.time()
    net = model()
    eager = train(net, net)
    compiled_net = model()
    compiled = train(compiled_net, torch.compile(compiled_net, fullgraph=True))
    err = float((compiled - eager).abs().max() / eager.abs().max().clamp_min(1.0))
    worst = torch.tensor([err], dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    err = float(worst)
    return [{"rel_error": err, "bound": 1e-9, "passed": bool(err <= 1e-9),
             "seconds": round(time.time() - started, 1)}] if rank == 0 else None


# the sections, in the order they run
SECTIONS = ("oracle", "numerics", "counts", "timing", "emulated", "graphs", "deeplab", "compile")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncbn.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="syncbn-out/gpu-check")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repeats", type=positive_int, default=30,
                        help="timed steps per point of the timing sections, after 5 warm-up steps (default 30)")
    # named choices: a misspelt section ran nothing and exited 0 (a GPU machine's time spent)
    parser.add_argument("--sections", nargs="*", choices=SECTIONS, metavar="SECTION",
                        help=f"run only these ({', '.join(SECTIONS)}; default: all)")
    args = parser.parse_args(argv)
    from ..tools.output import unusable_output

    problem = unusable_output(args.out)  # before torch loads or any section runs; leaves nothing behind
    if problem:
        print(f"gpu-check: {problem}", file=sys.stderr)
        return 2
    import torch

    from ..tools.launch import WorkerPool

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine; nothing to check")
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": args.device, "gpus": gpus, "backend": backend, "world": 2,
              "gpu_name": torch.cuda.get_device_name(0) if gpus else None, "torch": torch.__version__,
              "triton": _triton_version(), "kernels": _kernels_on(args.device)}
    started = time.time()
    with WorkerPool(2, backend=backend, timeout=150) as pool:
        for name, job, extra in (("oracle", oracle_job, ()), ("numerics", numerics_job, ()),
                                 ("counts", counts_job, ()), ("timing", timing_job, (args.repeats,)),
                                 ("emulated", emulated_job, (args.repeats,)),
                                 ("graphs", graphs_job, (args.repeats,)),
                                 ("deeplab", deeplab_job, (max(3, args.repeats // 3),)), ("compile", compile_job, ())):
            if args.sections and name not in args.sections:
                continue
            try:
                report[name] = pool.run(job, args.device, *extra)[0]
            except Exception as exc:  # keep the other sections
                report[name] = {"error": repr(exc)}
            (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    report["seconds"] = round(time.time() - started, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(_markdown(report))
    print(_markdown(report))
    failed = [r for section in ("oracle", "numerics", "compile") if section in report
              for r in (report[section] if isinstance(report[section], list) else [{"passed": False}])
              if not r["passed"]]
    return 1 if failed else 0


def timing_summary(rows: list) -> dict:
    """Medians over the timing grid (with the worst point) of the ratios that the CPU
    bench's bars use: syncbn over BatchNorm2d alone (W = 1), syncbn minus its all-reduces
    over BatchNorm2d (W = 2), the same for BatchNorm2d with syncbn's all-reduces (the
    control), and syncbn over torch.nn.SyncBatchNorm (W = 2, whole steps); the same
    for the steps of a group of two emulated in one process (``emulated_job``) and for
    their CUDA-graph replays (``graphs_job``)."""
    em, gr = "2, emulated", "2, emulated, graph"
    at = {(tuple(r["shape"]), r["layout"], r["impl"], r["world"]): r for r in rows if "error" not in r}
    points = sorted({(k[0], k[1]) for k in at})

    def ratios(num, den):
        out = []
        for p in points:
            a, b = at.get(p + num[:2]), at.get(p + den[:2])
            if a is not None and b is not None:
                out.append(a[num[2]] / b[den[2]])
        if not out:
            return None
        return {"median": statistics.median(out), "worst": max(out), "best": min(out), "points": len(out)}

    sb, bn, tsb = "syncbn.SyncBatchNorm", "torch.nn.BatchNorm2d", "torch.nn.SyncBatchNorm"
    ctl = "torch.nn.BatchNorm2d with syncbn's all-reduces"
    return {
        "W1 syncbn / BatchNorm2d": ratios((sb, 1, "median_ms"), (bn, 1, "median_ms")),
        "W2 syncbn minus all-reduces / BatchNorm2d": ratios((sb, 2, "minus_all_reduces_ms"), (bn, 2, "median_ms")),
        "W2 BatchNorm2d with the all-reduces, minus them / BatchNorm2d": ratios(
            (ctl, 2, "minus_all_reduces_ms"), (bn, 2, "median_ms")),
        "W2 syncbn / torch.nn.SyncBatchNorm": ratios((sb, 2, "median_ms"), (tsb, 2, "median_ms")),
        "W2 SyncBatchNormAct / torch.nn.SyncBatchNorm": ratios(
            ("syncbn.SyncBatchNormAct", 2, "median_ms"), (tsb, 2, "median_ms")),
        "W2 emulated syncbn / BatchNorm2d": ratios((sb, em, "median_ms"), (bn, em, "median_ms")),
        "W2 emulated syncbn / torch.nn.SyncBatchNorm": ratios((sb, em, "median_ms"), (tsb, em, "median_ms")),
        "W2 emulated torch.nn.SyncBatchNorm / BatchNorm2d": ratios((tsb, em, "median_ms"), (bn, em, "median_ms")),
        "W2 graph syncbn / BatchNorm2d": ratios((sb, gr, "median_ms"), (bn, gr, "median_ms")),
        "W2 graph syncbn / torch.nn.SyncBatchNorm": ratios((sb, gr, "median_ms"), (tsb, gr, "median_ms")),
        "W2 graph torch.nn.SyncBatchNorm / BatchNorm2d": ratios((tsb, gr, "median_ms"), (bn, gr, "median_ms")),
        "W2 emulated SyncBatchNormAct / torch.nn.SyncBatchNorm": ratios(
            ("syncbn.SyncBatchNormAct", em, "median_ms"), (tsb, em, "median_ms")),
    }


def _markdown(report: dict) -> str:
    lines = [f"# syncbn gpu-check ({report['device']}, {report.get('gpu_name') or 'no GPU'}, "
             f"{report['backend']}, W = 2, torch {report['torch']})", ""]
    for section in ("timing", "emulated", "graphs"):
        if isinstance(report.get(section), list):
            lines += [f"## {section} summary (ratios over the grid)", ""]
            lines += [f"- {k}: {json.dumps(v)}" for k, v in timing_summary(report[section]).items() if v] + [""]
    for section in ("oracle", "numerics", "counts", "timing", "emulated", "graphs", "deeplab", "compile"):
        if section not in report:
            continue
        lines += [f"## {section}", ""]
        rows = report[section]
        if not isinstance(rows, list):
            lines += [f"error: {rows}", ""]
            continue
        lines += [f"- {json.dumps(r, default=str)}" for r in rows] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
