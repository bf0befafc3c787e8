"""torch.autocast (bfloat16 on CPU): a converted model trains under DDP, W = 2, with its
BN layers fed bfloat16 activations, while their statistics, weights, gradients and
running buffers stay float32. Every BN call is checked against the float64 oracle on
the concatenation of both ranks' (bfloat16) inputs: outputs within bfloat16 rounding,
running buffers within float32 rounding."""

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import syncbn
from nan_safe import as_error
from workers import group_of, in_group

WORLD, PER_RANK, STEPS = 2, 3, 3
BN_NAMES = ("1", "4")
DDP_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def net():
    torch.manual_seed(2)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=None),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def batch(step, rank):
    gen = torch.Generator().manual_seed(40 + 10 * step + rank)
    x = torch.randn(PER_RANK, 3, 6, 6, generator=gen) * 3 + 2
    y = torch.randint(0, 3, (PER_RANK,), generator=gen)
    return x, y


def amp_job():
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    rank = dist.get_rank()
    model = syncbn.convert_sync_batchnorm(net(), process_group=group)
    seen = {name: [] for name in BN_NAMES}

    def record(name):
        def hook(module, args, out):
            seen[name].append(
                {
                    "x": args[0].detach().double(),
                    "y": out.detach().double(),
                    "dtypes": (args[0].dtype, out.dtype),
                    "weight": module.weight.detach().double().clone(),
                    "bias": module.bias.detach().double().clone(),
                }
            )

        return hook

    for name in BN_NAMES:
        model.get_submodule(name).register_forward_hook(record(name))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **DDP_NO_BUFFER_SYNC)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grad_dtypes = set()
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        grad_dtypes |= {p.grad.dtype for p in model.parameters()}
        opt.step()
    buffers = {k: v.detach().clone() for k, v in model.state_dict().items() if "running" in k}
    return {
        "seen": seen,
        "buffers": buffers,
        "grad_dtypes": grad_dtypes,
        "param_dtypes": {p.dtype for p in model.parameters()},
    }


def rel(actual, expected):
    """Relative error; inf for a non-finite result (NaN-safe, see nan_safe)."""
    if not torch.isfinite(actual).all():
        return float("inf")
    return as_error((actual - expected).abs().max() / expected.abs().max())


def test_autocast_bf16_trains_with_float32_statistics(pool):
    results = pool.run(amp_job)[:WORLD]
    for r in results:
        assert r["param_dtypes"] == {torch.float32} and r["grad_dtypes"] == {torch.float32}
        assert all(v.dtype == torch.float32 for v in r["buffers"].values())
    worst_y, worst_buf = 0.0, 0.0
    for name in BN_NAMES:
        bn = net().get_submodule(name)
        mean = torch.zeros(bn.num_features, dtype=torch.float64)
        var = torch.ones(bn.num_features, dtype=torch.float64)
        for step in range(STEPS):
            calls = [r["seen"][name][step] for r in results]
            assert all(c["dtypes"] == (torch.bfloat16, torch.bfloat16) for c in calls)
            assert torch.equal(calls[0]["weight"], calls[1]["weight"])
            x = torch.cat([c["x"] for c in calls])
            momentum = bn.momentum if bn.momentum is not None else 1.0 / (step + 1)
            y = F.batch_norm(x, mean, var, calls[0]["weight"], calls[0]["bias"], True, momentum, bn.eps)
            worst_y = max(worst_y, rel(torch.cat([c["y"] for c in calls]), y))
        for r in results:
            worst_buf = max(worst_buf, rel(r["buffers"][f"{name}.running_mean"].double(), mean))
            worst_buf = max(worst_buf, rel(r["buffers"][f"{name}.running_var"].double(), var))
        for key in (f"{name}.running_mean", f"{name}.running_var"):
            assert torch.equal(results[0]["buffers"][key], results[1]["buffers"][key])
    # outputs are bfloat16 (8 significant bits): both sides round a float32 result that agrees
    # to ~1e-6 to the nearest bfloat16, so they differ by at most one bfloat16 ulp of the largest
    # value, 2^-7 = 7.8e-3 relative to it, plus ~1e-6: bound 8e-3 (holds on any CPU: it is the
    # rounding itself). The statistics never went through bfloat16: float64 sums of the
    # bfloat16 values, float32 buffers rounded at u/2 = 3e-8 per update over 3 EMA steps: bound 1e-6.
    assert worst_y < 8e-3, worst_y
    assert worst_buf < 1e-6, worst_buf
