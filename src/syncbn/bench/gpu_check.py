"""The prepared GPU check behind ``scripts/gpu-check``: run it whenever a CUDA machine is
at hand. Two ranks on the GPU(s) (NCCL with two or more GPUs, else gloo with both ranks
sharing GPU 0) check the CUDA path of ``syncbn.SyncBatchNorm``:

- **oracle**: output, input/weight/bias gradients and running buffers against float64
  batch norm on the concatenated batch, uneven and empty ranks, both layouts, float32
  and float64 (bounds: those of ``tests/bn_oracle.py``, 1e-4 and 1e-10 relative);
- **numerics**: merged variance at |mean|/std = 1e3 and 1e4 on (2, 16, 256, 256) per
  rank, float32, against float64 (the issue's CUDA bars: 1e-5 and 1e-4);
- **counts**: passes, launches and host syncs per call on the real device (no stand-ins);
- **timing**: forward + backward of syncbn.SyncBatchNorm, torch.nn.SyncBatchNorm and
  torch.nn.BatchNorm2d on the same GPU, median of CUDA-event timings.

``--device cpu`` runs the same on the CPU with the CUDA path forced (torch's
SyncBatchNorm refuses CPU tensors and is left out): a dry run of this script. Writes
``report.json`` and ``report.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SHAPES = [[8, 64, 56, 56], [2, 256, 128, 128]]


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

    from .. import stats

    return stats._forced_cuda_path() if device == "cpu" else contextlib.nullcontext()


def oracle_job(device: str) -> list:
    """Every rank: its results beside the float64 oracle's; rank 0 returns the errors."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import syncbn

    dev = _setup(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for dtype in (torch.float32, torch.float64):
        for layout in ("contiguous", "channels_last"):
            for sizes in ((3, 2), (4, 0)):
                gen = torch.Generator().manual_seed(11)
                xs = [torch.randn(n, 5, 6, 7, generator=gen, dtype=torch.float64) * 2 + 3 for n in sizes]
                dys = [torch.randn(n, 5, 6, 7, generator=gen, dtype=torch.float64) for n in sizes]
                w = torch.linspace(0.5, 2, 5, dtype=torch.float64)
                b = torch.linspace(-1, 1, 5, dtype=torch.float64)
                fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
                x = xs[rank].to(dev, dtype).clone(memory_format=fmt).requires_grad_()
                layer = syncbn.SyncBatchNorm(5, momentum=1.0).to(dev, dtype)
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
                bound = 1e-4 if dtype == torch.float32 else 1e-10
                rows.append({"dtype": str(dtype), "layout": layout, "sizes": list(sizes), "bound": bound,
                             "errors": dict(zip(errs, worst.tolist())), "passed": bool((worst < bound).all())})
    return rows if rank == 0 else None


def numerics_job(device: str) -> list:
    import torch
    import torch.distributed as dist

    import syncbn

    dev = _setup(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for ratio, bar in ((1e3, 1e-5), (1e4, 1e-4)):
        gen = torch.Generator().manual_seed(100 + rank)
        x = (torch.randn(2, 16, 256, 256, generator=gen, dtype=torch.float64) + ratio).float()
        layer = syncbn.SyncBatchNorm(16, momentum=1.0).to(dev)
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

    import syncbn

    from . import cuda_counts

    dev = _setup(device)
    rows = []
    for layout in ("contiguous", "channels_last"):
        fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
        x = torch.randn(8, 64, 56, 56, device=dev).contiguous(memory_format=fmt).requires_grad_()
        dy = torch.randn_like(x)
        counts = cuda_counts.count_call(syncbn.SyncBatchNorm(64).to(dev), x, dy)
        rows.append({"layout": layout, **{w: {k: v for k, v in counts[w].items() if k != "ops"} for w in counts},
                     "ops": {w: [o["op"] for o in counts[w]["ops"]] for w in counts}})
    return rows if dist.get_rank() == 0 else None


def timing_job(device: str, repeats: int) -> list:
    import torch
    import torch.distributed as dist

    import syncbn

    dev = _setup(device)
    rows = []
    impls = {"syncbn.SyncBatchNorm": lambda c: syncbn.SyncBatchNorm(c),
             "torch.nn.BatchNorm2d": lambda c: torch.nn.BatchNorm2d(c)}
    if device == "cuda":
        impls["torch.nn.SyncBatchNorm"] = lambda c: torch.nn.SyncBatchNorm(c)
    for shape in SHAPES:
        x = torch.randn(shape, device=dev).requires_grad_()
        dy = torch.randn_like(x)
        for name, make in impls.items():
            layer = make(shape[1]).to(dev)
            times = []
            with _forcing(device):
                for i in range(repeats + 5):
                    dist.barrier()
                    start = time.perf_counter()
                    layer(x).backward(dy)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    if i >= 5:
                        times.append(time.perf_counter() - start)
            per_rank = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
            dist.all_reduce(per_rank, op=dist.ReduceOp.MAX)  # the slower rank
            rows.append({"shape": shape, "impl": name, "median_ms": 1e3 * float(per_rank)})
    return rows if dist.get_rank() == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="syncbn-out/gpu-check")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    import torch

    from ..launch import WorkerPool

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU on this machine; nothing to check")
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": args.device, "gpus": gpus, "backend": backend, "world": 2,
              "gpu_name": torch.cuda.get_device_name(0) if gpus else None, "torch": torch.__version__}
    started = time.time()
    with WorkerPool(2, backend=backend, timeout=300) as pool:
        for name, job, extra in (("oracle", oracle_job, ()), ("numerics", numerics_job, ()),
                                 ("counts", counts_job, ()), ("timing", timing_job, (args.repeats,))):
            try:
                report[name] = pool.run(job, args.device, *extra)[0]
            except Exception as exc:  # keep the other sections
                report[name] = {"error": repr(exc)}
            (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    report["seconds"] = round(time.time() - started, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(_markdown(report))
    print(_markdown(report))
    failed = [r for section in ("oracle", "numerics") for r in (report[section] if isinstance(report[section], list)
                                                                else [{"passed": False}]) if not r["passed"]]
    return 1 if failed else 0


def _markdown(report: dict) -> str:
    lines = [f"# syncbn gpu-check ({report['device']}, {report.get('gpu_name') or 'no GPU'}, "
             f"{report['backend']}, W = 2, torch {report['torch']})", ""]
    for section in ("oracle", "numerics", "counts", "timing"):
        lines += [f"## {section}", ""]
        rows = report.get(section)
        if not isinstance(rows, list):
            lines += [f"error: {rows}", ""]
            continue
        lines += [f"- {json.dumps(r, default=str)}" for r in rows] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
