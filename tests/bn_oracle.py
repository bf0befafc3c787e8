"""The test oracle: plain float64 batch norm on the concatenation of every rank's input,
with the concatenation of their output gradients (see shared/DESIGN.md).

A :class:`Case` describes one distributed run; :func:`make_data` draws its data
(identically in the test process and in every worker), :func:`run_case` runs it on one
rank of the worker pool, and :func:`check_case` compares the ranks' results with the
oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

import syncbn
from nan_safe import as_error
from workers import group_of, in_group

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# relative tolerance (to the largest reference value) of outputs and gradients per input dtype.
# Data: |mean| / std <= 4 / 0.5 = 8, at most a few hundred elements per channel. float32 and
# float64: a few roundings of u (2^-24, 2^-53) times the condition 8 and the few-step error
# growth, ~1e-6 / ~1e-14; bounds 1e-4 / 1e-10 leave 100x. Half inputs: outputs and gradients
# are rounded to the input dtype (2^-8 relative for bfloat16, 2^-11 for float16, each side) from
# float32 arithmetic, and an input gradient sums such values once: bounds of about 5 units
# of the last place of the largest value, 4e-2 (bfloat16) and 8e-3 (float16).
TOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 4e-2, "float16": 8e-3}
# statistics accumulate in at least float32 whatever the input dtype: float32 buffers rounded
# at u/2 = 3e-8 per update over a few EMA steps, ~1e-7; bound 1e-5
BUFFER_TOL = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 1e-5, "float16": 1e-5}


@dataclass(frozen=True)
class Case:
    world: int
    sizes: tuple  # local batch size of each rank (0 allowed)
    tail: tuple = (5, 4)  # dims after (N, C)
    channels: int = 3
    dtype: str = "float32"
    param_dtype: Optional[str] = None  # dtype of weights and buffers; None: the input's
    channels_last: bool = False
    affine: bool = True
    bias: bool = True
    momentum: Optional[float] = 0.1
    track: bool = True
    steps: int = 3
    eps: float = 1e-5
    seed: int = 0
    eval_size: int = 2
    input_grad: bool = True
    frozen_inputs: tuple = ()  # ranks whose input needs no gradient (with input_grad)
    # strides of the inputs given to the layer (values unchanged): "dense" (the format above),
    # "channels_inner" (channels fastest in memory, the spatial dims still merging into one),
    # "spatial_reversed" (spatial dims reversed in memory: they no longer merge without a copy)
    strides: str = "dense"
    tags: tuple = field(default=(), compare=False)

    @property
    def ndim(self):
        return 2 + len(self.tail)

    def input_grad_on(self, rank: int) -> bool:
        """Whether ``rank``'s input needs a gradient."""
        return self.input_grad and rank not in self.frozen_inputs


def make_data(case: Case):
    """Inputs with a non-zero per-channel mean, output gradients, weights: all float64,
    already rounded through the case's dtype so the oracle sees exactly what ranks see."""
    gen = torch.Generator().manual_seed(1000 + case.seed)
    dtype = DTYPES[case.dtype]
    c = case.channels
    shape_c = [1, c] + [1] * len(case.tail)
    center = (torch.rand(c, generator=gen, dtype=torch.float64) * 8 - 4).view(shape_c)
    spread = (torch.rand(c, generator=gen, dtype=torch.float64) * 1.5 + 0.5).view(shape_c)

    def draw(n, with_center=True):
        x = torch.randn((n, c) + tuple(case.tail), generator=gen, dtype=torch.float64)
        if with_center:
            x = x * spread + center
        return x.to(dtype).to(torch.float64)

    steps = []
    for _ in range(case.steps):
        xs = [draw(n) for n in case.sizes]
        dys = [draw(n, with_center=False) for n in case.sizes]
        steps.append((xs, dys))
    eval_xs = [draw(case.eval_size) for _ in case.sizes]
    pdtype = DTYPES[case.param_dtype or case.dtype]
    weight = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5).to(pdtype).to(torch.float64)
    bias = torch.randn(c, generator=gen, dtype=torch.float64).to(pdtype).to(torch.float64)
    return {"steps": steps, "eval": eval_xs, "weight": weight, "bias": bias}


def _memory_format(case: Case):
    if case.channels_last and case.ndim == 4:
        return torch.channels_last
    if case.channels_last and case.ndim == 5:
        return torch.channels_last_3d
    return torch.contiguous_format


def lay_out(x: torch.Tensor, case: Case, fmt) -> torch.Tensor:
    """``x`` (same values) in the case's memory format and strides."""
    if case.strides == "channels_inner":
        return x.movedim(1, -1).contiguous().movedim(-1, 1)
    if case.strides == "spatial_reversed":
        order = [0, 1] + list(range(x.dim() - 1, 1, -1))
        return x.permute(order).contiguous().permute(order)
    assert case.strides == "dense", case.strides
    return x.contiguous(memory_format=fmt)


def build_module(case: Case, data, group):
    module = syncbn.SyncBatchNorm(
        case.channels,
        eps=case.eps,
        momentum=case.momentum,
        affine=case.affine,
        track_running_stats=case.track,
        process_group=group,
        bias=case.bias,
    )
    module = module.to(DTYPES[case.param_dtype or case.dtype])
    with torch.no_grad():
        if module.weight is not None:
            module.weight.copy_(data["weight"])
        if module.bias is not None:
            module.bias.copy_(data["bias"])
    return module


def backward_and_record(result, module, x, y, dy, fmt, input_grad, through_product=False) -> None:
    """Run one step's backward with a contiguous ``dy`` (whatever x's format) and append
    the output, the gradients (weight and bias grads then cleared) and the format and
    dtype checks to ``result``. ``through_product``: backward from ``(y * dy).sum()``,
    so that the layer gets the same values as a fresh gradient that nothing else holds
    (``y.backward(dy)`` hands it the caller's tensor)."""
    if fmt is not torch.contiguous_format and x.numel():
        result["formats_kept"] &= y.is_contiguous(memory_format=fmt)
    if through_product:
        (y * dy).sum().backward()
    else:
        y.backward(dy)
    step = {"y": y.detach().double(), "dx": None if x.grad is None else x.grad.detach().double()}
    if input_grad and x.numel() and fmt is not torch.contiguous_format:
        result["formats_kept"] &= x.grad.is_contiguous(memory_format=fmt)
    for name in ("weight", "bias"):
        p = getattr(module, name)
        step["d" + name] = None if p is None else p.grad.detach().double().clone()
        if p is not None:
            p.grad = None
    step["dtype_ok"] = y.dtype == x.dtype
    result["steps"].append(step)


def run_case(case: Case):
    """Worker job: run the case on this rank; returns its outputs, gradients and buffers."""
    group = group_of(case.world)
    if not in_group(case.world):
        return None
    rank = torch.distributed.get_rank()
    data = make_data(case)
    dtype = DTYPES[case.dtype]
    fmt = _memory_format(case)
    module = build_module(case, data, group)
    result = {"steps": [], "formats_kept": True}
    for xs, dys in data["steps"]:
        x = lay_out(xs[rank].to(dtype), case, fmt).requires_grad_(case.input_grad_on(rank))
        y = module(x)
        backward_and_record(result, module, x, y, dys[rank].to(dtype), fmt, case.input_grad_on(rank))
    result["buffers"] = {
        name: None if buf is None else buf.detach().double().clone() for name, buf in module.named_buffers()
    }
    result["buffer_dtypes"] = {name: buf.dtype for name, buf in module.named_buffers()}
    module.eval()
    result["eval"] = module(lay_out(data["eval"][rank].to(dtype), case, fmt)).detach().double()
    return result


def oracle(case: Case, data=None, after=lambda y: y):
    """What one device computes on the concatenated batch, in float64: batch norm, then
    ``after`` (an activation, for the fused layer), on ``data`` (default ``make_data``)."""
    data = make_data(case) if data is None else data
    c = case.channels
    track = case.track
    running_mean = torch.zeros(c, dtype=torch.float64) if track else None
    running_var = torch.ones(c, dtype=torch.float64) if track else None
    weight = data["weight"] if case.affine else None
    bias = data["bias"] if case.affine and case.bias else None
    steps = []
    for i, (xs, dys) in enumerate(data["steps"]):
        x = torch.cat(xs).requires_grad_()
        w = None if weight is None else weight.clone().requires_grad_()
        b = None if bias is None else bias.clone().requires_grad_()
        momentum = case.momentum if case.momentum is not None else 1.0 / (i + 1)
        y = after(F.batch_norm(x, running_mean, running_var, w, b, True, momentum, case.eps))
        y.backward(torch.cat(dys))
        steps.append(
            {
                "y": y.detach(),
                "dx": x.grad,
                "dweight": None if w is None else w.grad,
                "dbias": None if b is None else b.grad,
            }
        )
    if track:
        evals = [F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, case.eps) for x in data["eval"]]
    else:  # eval without running statistics: each rank's own batch, no communication
        evals = [F.batch_norm(x, None, None, weight, bias, True, 0.0, case.eps) for x in data["eval"]]
    evals = [after(y) for y in evals]
    buffers = {}
    if track:
        buffers = {
            "running_mean": running_mean,
            "running_var": running_var,
            "num_batches_tracked": torch.tensor(float(case.steps), dtype=torch.float64),
        }
    return {"steps": steps, "eval": evals, "buffers": buffers}


def max_rel_err(actual, expected) -> float:
    """Largest ``|actual - expected|`` relative to the largest reference value (at least
    1); ``inf`` when either side holds a NaN or an infinity, so that a non-finite result
    never passes a tolerance (see ``nan_safe``)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return float("inf")
    scale = max(float(expected.abs().max()), 1.0)
    return as_error(float((actual - expected).abs().max()) / scale)


def check_case(case: Case, results, ref=None, label=None) -> dict:
    """Compare the ranks' results to the oracle (``ref``, default ``oracle(case)``);
    returns the largest errors seen. ``label`` names the case in failure messages."""
    ref = oracle(case) if ref is None else ref
    ranks = results[: case.world]
    tol = TOL[case.dtype]
    btol = max(BUFFER_TOL[case.dtype], TOL[case.param_dtype or case.dtype] / 4)
    worst = {"y": 0.0, "dx": 0.0, "dparam": 0.0, "buffers": 0.0, "eval": 0.0}

    def note(key, err):  # NaN-safe: a non-finite error counts as inf (builtin max drops NaN)
        worst[key] = max(worst[key], as_error(err))

    for r in ranks:
        assert r["formats_kept"], "memory format not preserved"
    for i, expect in enumerate(ref["steps"]):
        got = [r["steps"][i] for r in ranks]
        assert all(g["dtype_ok"] for g in got), "output dtype differs from the input dtype"
        note("y", max_rel_err(torch.cat([g["y"] for g in got]), expect["y"]))
        if not case.input_grad:
            assert all(g["dx"] is None for g in got)
        elif not case.frozen_inputs:
            note("dx", max_rel_err(torch.cat([g["dx"] for g in got]), expect["dx"]))
        else:  # each rank that needs one: its own rows of the oracle's input gradient
            for rank, (g, rows) in enumerate(zip(got, torch.split(expect["dx"], list(case.sizes)))):
                if rank in case.frozen_inputs:
                    assert g["dx"] is None, f"rank {rank}'s input needs no gradient"
                else:
                    note("dx", max_rel_err(g["dx"], rows))
        for name in ("dweight", "dbias"):
            if expect[name] is None:
                assert all(g[name] is None for g in got), f"{name} should be absent"
                continue
            total = sum(g[name] for g in got)
            note("dparam", max_rel_err(total, expect[name]))
    pdtype = DTYPES[case.param_dtype or case.dtype]
    for name, value in ref["buffers"].items():
        for r in ranks:
            note("buffers", max_rel_err(r["buffers"][name], value))
            assert torch.equal(r["buffers"][name], ranks[0]["buffers"][name]), f"{name} differs across ranks"
            if name != "num_batches_tracked" and "buffer_dtypes" in r:
                assert r["buffer_dtypes"][name] == pdtype, "buffers must keep the module's dtype"
    for r, expect in zip(ranks, ref["eval"]):
        note("eval", max_rel_err(r["eval"], expect))
    for key, err in worst.items():
        limit = btol if key == "buffers" else tol
        # an eval pass through half precision rounds its output like any other output
        assert err <= limit, f"{key}: relative error {err:.3g} > {limit:.3g} for {label or case}"
    return worst
