"""SyncBatchNormAct against the float64 oracle where the numerics are delicate, through
the public layer only (outputs, gradients and buffers; never its internals):

- ELU channels that saturate (output -alpha to the last bit) in float16 and bfloat16:
  the input of those channels must be kept, or the gradients become NaN;
- the one-process path for inputs of at least 2**20 elements, which normalizes with the
  batch's *biased* variance (and writes the unbiased one into ``running_var``).

Every comparison is NaN-safe (``bn_oracle.max_rel_err`` counts a non-finite value as an
infinite error) and finiteness is asserted on its own as well.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import syncbn
from bn_oracle import DTYPES, TOL, max_rel_err
from workers import group_of, in_group

# ELU: channel 0 saturates completely (z ~ -30), 1 and 2 deeply (z ~ -6 - 3 |x-hat|,
# weight negative in 2), 3 is an ordinary channel
ELU_WEIGHT = (1.0, 3.0, -2.0, 0.5)
ELU_BIAS = (-30.0, -6.0, -4.0, 0.0)


def elu_data(sizes, dtype, seed=3):
    """Per-rank inputs (non-zero channel means) and output gradients correlated with
    x-hat (so the x-hat term of the gradient matters), float64 values rounded through
    ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    center = torch.tensor([2.0, -3.0, 1.5, 4.0], dtype=torch.float64).view(1, 4, 1)
    xs, dys = [], []
    for n in sizes:
        x = torch.randn(n, 4, 5, generator=gen, dtype=torch.float64) * 1.5 + center
        xs.append(x.to(dtype).double())
    full = torch.cat(xs)
    xhat = (full - full.mean((0, 2), keepdim=True)) / full.std((0, 2), keepdim=True)
    for part in torch.split(xhat, list(sizes)):
        dy = torch.randn(part.shape, generator=gen, dtype=torch.float64) + part
        dys.append(dy.to(dtype).double())
    return xs, dys


def elu_oracle(xs, dys, weight, bias, steps):
    """BN + ELU(1.0) in float64 on the concatenated batch, ``steps`` training steps."""
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    x = torch.cat(xs).requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    for _ in range(steps):
        x.grad = w.grad = b.grad = None
        y = F.elu(F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5), 1.0)
        y.backward(torch.cat(dys))
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad, "rm": rm, "rv": rv}


def run_elu(xs, dys, rank, dtype, param_dtype, group=None, steps=2):
    """This rank's run of the layer; the step alternates a leaf input (kept) and a
    temporary (which the layer may overwrite)."""
    layer = syncbn.SyncBatchNormAct(4, "elu", 1.0, process_group=group).to(param_dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(ELU_WEIGHT))
        layer.bias.copy_(torch.tensor(ELU_BIAS))
    for step in range(steps):
        x = xs[rank].to(dtype).requires_grad_()
        y = layer(x if step % 2 else x * 1)
        dx, dw, db = torch.autograd.grad(y, [x, layer.weight, layer.bias], dys[rank].to(dtype))
    return {"y": y.detach().double(), "dx": dx.double(), "dw": dw.double(), "db": db.double(),
            "rm": layer.running_mean.double(), "rv": layer.running_var.double()}


def check_elu(got_ranks, ref, dtype, param_dtype):
    tol = TOL[dtype]
    buffer_tol = max(1e-5, TOL[param_dtype] / 4)  # buffers of a half layer are rounded to half
    for r in got_ranks:
        for key, value in r.items():
            assert torch.isfinite(value).all(), f"{key} is not finite: {value}"
    got = {key: torch.cat([r[key] for r in got_ranks]) for key in ("y", "dx")}
    got["dw"] = sum(r["dw"] for r in got_ranks)
    got["db"] = sum(r["db"] for r in got_ranks)
    for key in ("y", "dx", "dw", "db"):
        err = max_rel_err(got[key], ref[key])
        assert err <= tol, f"{key}: relative error {err:.3g} > {tol:.3g}"
    for r in got_ranks:
        for key in ("rm", "rv"):
            err = max_rel_err(r[key], ref[key])
            assert err <= buffer_tol, f"{key}: relative error {err:.3g} > {buffer_tol:.3g}"


ELU_DTYPES = [("float16", "float16"), ("float16", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32")]


@pytest.mark.parametrize("dtype,param_dtype", ELU_DTYPES)
def test_saturated_elu_in_half_precision_one_process(dtype, param_dtype):
    xs, dys = elu_data((7,), DTYPES[dtype])
    weight = torch.tensor(ELU_WEIGHT, dtype=torch.float64).to(DTYPES[param_dtype]).double()
    bias = torch.tensor(ELU_BIAS, dtype=torch.float64).to(DTYPES[param_dtype]).double()
    ref = elu_oracle(xs, dys, weight, bias, steps=2)
    assert (ref["y"][:, 0].to(DTYPES[dtype]) == -1.0).all()  # the first channel is saturated in dtype
    check_elu([run_elu(xs, dys, 0, DTYPES[dtype], DTYPES[param_dtype])], ref, dtype, param_dtype)


def elu_job(sizes, dtype, param_dtype):
    world = len(sizes)
    group = group_of(world)
    if not in_group(world):
        return None
    xs, dys = elu_data(sizes, DTYPES[dtype])
    return run_elu(xs, dys, dist.get_rank(), DTYPES[dtype], DTYPES[param_dtype], group)


@pytest.mark.parametrize("dtype,param_dtype", ELU_DTYPES)
def test_saturated_elu_in_half_precision_across_ranks(pool, dtype, param_dtype):
    sizes = (4, 0, 3)
    xs, dys = elu_data(sizes, DTYPES[dtype])
    weight = torch.tensor(ELU_WEIGHT, dtype=torch.float64).to(DTYPES[param_dtype]).double()
    bias = torch.tensor(ELU_BIAS, dtype=torch.float64).to(DTYPES[param_dtype]).double()
    ref = elu_oracle(xs, dys, weight, bias, steps=2)
    check_elu(pool.run(elu_job, sizes, dtype, param_dtype)[: len(sizes)], ref, dtype, param_dtype)


# ---- one process, at least 2**20 elements ---------------------------------------------
# 256 channels of 4096 values each. Normalizing with the unbiased variance instead of the
# biased one would scale x-hat by sqrt(1 - 1/4096), an error of 1.2e-4 * |x-hat|: about
# 1e-4 of the largest output. The float32 result is within the rounding of its output
# and of float64-accumulated statistics (|mean| / std <= 4 here): measured 1.2e-7 for y,
# 1.8e-7 for dx, 2.5e-7 for the weight / bias gradients, 1.2e-7 for the buffers (this
# project's CPU). Tolerances 3e-6 (y, dx), 1e-5 (parameter gradients: float32 sums of
# 4096 terms, whose rounding depends on the CPU's summation order), 1e-6 (buffers): 8x or
# more above those; the unbiased variance gives 1.1e-4, 35x above the tolerance.
BIG_SHAPE = (4, 256, 32, 32)


def big_data(seed=11):
    gen = torch.Generator().manual_seed(seed)
    c = BIG_SHAPE[1]
    center = (torch.rand(c, generator=gen, dtype=torch.float64) * 8 - 4).view(1, c, 1, 1)
    x = (torch.randn(BIG_SHAPE, generator=gen, dtype=torch.float64) + center).float()
    dy = torch.randn(BIG_SHAPE, generator=gen, dtype=torch.float64).float()
    weight = torch.linspace(0.5, 2.0, c, dtype=torch.float64).float()
    bias = torch.linspace(-1.0, 1.0, c, dtype=torch.float64).float()
    return x, dy, weight, bias


def big_oracle(x, dy, weight, bias, activation, slope, momentum):
    x = x.double().requires_grad_()
    w = weight.double().requires_grad_()
    b = bias.double().requires_grad_()
    rm, rv = torch.zeros(x.shape[1], dtype=torch.float64), torch.ones(x.shape[1], dtype=torch.float64)
    y = F.batch_norm(x, rm, rv, w, b, True, momentum, 1e-5)
    if activation == "leaky_relu":
        y = F.leaky_relu(y, slope)
    y.backward(dy.double())
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "db": b.grad, "rm": rm, "rv": rv}


@pytest.mark.parametrize("inplace", [True, False], ids=["temporary-input", "kept-input"])
@pytest.mark.parametrize("activation", ["leaky_relu", "identity"])
def test_large_input_one_process_matches_the_biased_variance_oracle(activation, inplace):
    x, dy, weight, bias = big_data()
    assert x.numel() >= 2**20
    layer = syncbn.SyncBatchNormAct(BIG_SHAPE[1], activation, 0.1, momentum=0.3)
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    leaf = x.clone().requires_grad_()
    y = layer(leaf * 1 if inplace else leaf)
    dx, dw, db = torch.autograd.grad(y, [leaf, layer.weight, layer.bias], dy)
    ref = big_oracle(x, dy, weight, bias, activation, 0.1, 0.3)
    got = {"y": y, "dx": dx, "dw": dw, "db": db, "rm": layer.running_mean, "rv": layer.running_var}
    tolerances = {"y": 3e-6, "dx": 3e-6, "dw": 1e-5, "db": 1e-5, "rm": 1e-6, "rv": 1e-6}
    for key, tol in tolerances.items():
        value = got[key].detach().double()
        assert torch.isfinite(value).all(), key
        err = max_rel_err(value, ref[key])
        assert err <= tol, f"{key}: relative error {err:.3g} > {tol:.3g}"
