"""syncbn.SyncBatchNormAct: the float64 oracle (batch norm + activation on the concatenated
batch) on real gloo processes, the weights where x-hat cannot be read back from the
output, in place vs out of place, saved bytes, collectives, and the fusing helper."""

import copy
import itertools
import math
import random
import warnings
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import syncbn
from syncbn.torch import BatchNormNd, batchnorm_act, fingerprint, stats
from bn_oracle import DTYPES, TOL, Case, backward_and_record, check_case, lay_out, make_data, max_rel_err, oracle
from syncbn.tools.memory import peak_memory, saved_bytes, saved_tensors
from syncbn.tools.traffic import record_collectives
from workers import group_of, in_group
from torch_compat import torch_batchnorm

DTYPE_NAMES = ["float32", "float64", "bfloat16", "float16"]
ACTS = {"leaky_relu": (0.01, 0.2, 1.5), "elu": (1.0, 0.3), "identity": (0.01,)}


def torch_activation(name, param):
    return {"leaky_relu": lambda: nn.LeakyReLU(param), "elu": lambda: nn.ELU(param), "identity": nn.Identity}[name]()


# ---- the oracle ---------------------------------------------------------------------


@dataclass(frozen=True)
class ActCase:
    base: Case
    activation: str = "leaky_relu"
    param: float = 0.01
    weight: Optional[tuple] = None  # per-channel overrides of the drawn weights / biases
    bias: Optional[tuple] = None
    dy_from_x: float = 0.0  # add this multiple of the standardized input to dy


def act_data(case: ActCase):
    base = case.base
    data = make_data(base)
    pdtype = DTYPES[base.param_dtype or base.dtype]
    for key, values in (("weight", case.weight), ("bias", case.bias)):
        if values is not None:
            data[key] = torch.tensor(values, dtype=torch.float64).to(pdtype).to(torch.float64)
    if case.dy_from_x:
        dtype = DTYPES[base.dtype]
        steps = []
        for xs, dys in data["steps"]:
            x = torch.cat(xs)
            dims = [0] + list(range(2, x.dim()))
            std = x.std(dims, keepdim=True) if x.shape[0] > 1 or x.dim() > 2 else 1.0
            z = (x - x.mean(dims, keepdim=True)) / std
            parts = torch.split(z, [t.shape[0] for t in xs])
            dys = [(dy + case.dy_from_x * p).to(dtype).to(torch.float64) for dy, p in zip(dys, parts)]
            steps.append((xs, dys))
        data["steps"] = steps
    return data


def _format(base: Case):
    if base.channels_last and base.ndim == 4:
        return torch.channels_last
    if base.channels_last and base.ndim == 5:
        return torch.channels_last_3d
    return torch.contiguous_format


class _Producer(nn.Module):
    """Hands a fresh copy of its input to the next layer, and notes where it lives."""

    def forward(self, x):
        out = x.clone()
        self.ptr = out.data_ptr()
        return out


def run_act_case(case: ActCase):
    """Worker job: one rank's outputs, gradients and buffers for the case."""
    base = case.base
    group = group_of(base.world)
    if not in_group(base.world):
        return None
    rank = dist.get_rank()
    data = act_data(case)
    dtype = DTYPES[base.dtype]
    fmt = _format(base)
    module = syncbn.SyncBatchNormAct(
        base.channels, case.activation, case.param, eps=base.eps, momentum=base.momentum, affine=base.affine,
        track_running_stats=base.track, process_group=group, bias=base.bias,
    ).to(DTYPES[base.param_dtype or base.dtype])
    with torch.no_grad():
        if module.weight is not None:
            module.weight.copy_(data["weight"])
        if module.bias is not None:
            module.bias.copy_(data["bias"])
    producer = _Producer()
    chain = nn.Sequential(producer, module)
    result = {"steps": [], "formats_kept": True, "in_place": []}
    for i, (xs, dys) in enumerate(data["steps"]):
        x = lay_out(xs[rank].to(dtype), base, fmt).requires_grad_(base.input_grad_on(rank))
        if i % 2 == 0:  # inplace=True: overwrites the fresh copy
            module.inplace = True
            y = chain(x)
            result["in_place"].append(y.data_ptr() == producer.ptr or x.numel() == 0)
        else:  # the default: out of place
            module.inplace = False
            y = module(x)
            result["in_place"].append(False)
            assert x.numel() == 0 or torch.equal(x.detach().double(), xs[rank]), "input was overwritten"
        # odd steps: the gradient of a product (the engine's own tensor), even: the caller's
        backward_and_record(result, module, x, y, dys[rank].to(dtype), fmt, base.input_grad_on(rank),
                            through_product=i % 2 == 1)
    result["buffers"] = {n: None if b is None else b.detach().double().clone() for n, b in module.named_buffers()}
    module.eval()
    result["eval"] = module(lay_out(data["eval"][rank].to(dtype), base, fmt)).detach().double()
    return result


def _act64(z, case: ActCase):
    if case.activation == "leaky_relu":
        return F.leaky_relu(z, case.param)
    if case.activation == "elu":
        return F.elu(z, case.param)
    return z


def act_oracle(case: ActCase):
    """Batch norm then the activation, float64, on the concatenated batch."""
    return oracle(case.base, data=act_data(case), after=lambda y: _act64(y, case))


def check_act_case(case: ActCase, results) -> dict:
    """In place on the steps that allow it (even ones), out of place on the others, and
    everything else as the batch-norm oracle check with the activation's oracle."""
    dense = case.base.strides == "dense"  # other strides: never in place (not dense in a format)
    for r in results[: case.base.world]:
        assert (all(r["in_place"][0::2]) if dense else not any(r["in_place"])), r["in_place"]
        assert not any(r["in_place"][1::2]), r["in_place"]
    return check_case(case.base, results, ref=act_oracle(case), label=case)


def _grid():
    """World sizes 1-3 x input ranks 2-5 x dtypes, activations and options cycled (W = 4
    runs in the tests of hard weights and of collectives)."""
    rng = random.Random(11)
    cycle = itertools.count()
    acts = itertools.cycle([(a, p) for a, ps in ACTS.items() for p in ps])
    cases = []
    for world, ndim, dtype in itertools.product([1, 2, 3], [2, 3, 4, 5], DTYPE_NAMES):
        i = next(cycle)
        tail = {2: (), 3: (7,), 4: (5, 4), 5: (3, 4, 2)}[ndim]
        sizes = [rng.randint(0, 4) for _ in range(world)]
        if world > 1 and i % 2 == 0:
            sizes[rng.randrange(world)] = 0
        span = 1
        for d in tail:
            span *= d
        while sum(sizes) * span < 4:
            sizes[-1] += 1
        half = dtype in ("bfloat16", "float16")
        activation, param = next(acts)
        base = Case(
            world=world, sizes=tuple(sizes), tail=tail, channels=[3, 5, 1, 8][i % 4], dtype=dtype,
            param_dtype=("float32" if i % 3 else None) if half else None, channels_last=ndim >= 4 and i % 2 == 1,
            affine=i % 5 != 0, bias=i % 7 != 3, momentum=None if i % 3 == 0 else [0.1, 0.5][i % 2],
            track=i % 6 != 1, steps=2, seed=100 + i,
        )
        cases.append(ActCase(base, activation, param))
    return cases


@pytest.mark.parametrize(
    "case", _grid(), ids=lambda c: f"W{c.base.world}-{c.base.ndim}d-{c.base.dtype}-{c.activation}-{c.base.sizes}"
)
def test_matches_oracle(pool, case):
    check_act_case(case, pool.run(run_act_case, case))


# Inputs of more than 5 dims (as SyncBatchNorm, as torch.nn.SyncBatchNorm): one rank (torch's
# kernels, then the general path for ELU) and several, an empty rank, half inputs, strides
# other than the standard ones (those never in place); even steps in place where dense
HIGH_RANK = [
    ActCase(Case(world=1, sizes=(3,), tail=(2, 3, 2, 2), channels=3, dtype="float32", steps=2), "leaky_relu", 0.1),
    ActCase(Case(world=1, sizes=(3,), tail=(2, 1, 3, 2), channels=2, dtype="float64", steps=2, seed=1), "elu", 1.0),
    ActCase(Case(world=2, sizes=(2, 3), tail=(2, 1, 3, 2), channels=4, dtype="float64", steps=2, momentum=None,
                 seed=2), "elu", 0.3),
    ActCase(Case(world=3, sizes=(2, 0, 3), tail=(3, 2, 1, 2, 2), channels=2, dtype="float32", steps=2, seed=3),
            "leaky_relu", 0.01),
    ActCase(Case(world=2, sizes=(3, 2), tail=(2, 2, 3, 2), dtype="bfloat16", param_dtype="float32", steps=2,
                 seed=4), "identity", 0.01),
    ActCase(Case(world=2, sizes=(2, 2), tail=(2, 2, 3, 2), dtype="float16", steps=2, seed=5), "leaky_relu", 0.2),
    ActCase(Case(world=2, sizes=(3, 2), tail=(2, 3, 2, 2), dtype="float32", strides="channels_inner", steps=2,
                 seed=6), "leaky_relu", 0.2),
    ActCase(Case(world=3, sizes=(2, 2, 1), tail=(3, 2, 2, 2), dtype="float64", strides="spatial_reversed",
                 track=False, steps=2, seed=7), "elu", 1.0),
    ActCase(Case(world=1, sizes=(4,), tail=(2, 3, 2, 2), dtype="float32", strides="spatial_reversed", steps=2,
                 seed=8), "leaky_relu", 0.01),
]


@pytest.mark.parametrize("case", HIGH_RANK, ids=lambda c: f"W{c.base.world}-{c.base.ndim}d-{c.base.dtype}-"
                         f"{c.base.strides}-{c.activation}-{c.base.sizes}")
def test_inputs_of_more_than_five_dims_match_oracle(pool, case):
    """SyncBatchNormAct takes the inputs of 6 and 7 dims that torch.nn.SyncBatchNorm takes
    (it refused them), in place and out of place, against the float64 oracle."""
    check_act_case(case, pool.run(run_act_case, case))


# weights where x-hat is lost (0) or badly conditioned (tiny next to the bias), negative
# weights, and a plain channel; an empty rank in the middle
HARD_WEIGHT = (0.0, -0.7, 1e-6, 3e-4, 1.2, -1e-3, 1e-30)
HARD_BIAS = (0.5, 0.3, 2.0, 1.5, -0.2, -3.0, 0.0)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.01), ("elu", 1.0), ("identity", 0.01)])
def test_zero_negative_and_tiny_weights(pool, dtype, activation, param):
    base = Case(world=3, sizes=(3, 0, 2), tail=(4, 3), channels=7, dtype=dtype, steps=2, seed=5,
                param_dtype="float32" if dtype in ("bfloat16", "float16") else None)
    case = ActCase(base, activation, param, weight=HARD_WEIGHT, bias=HARD_BIAS, dy_from_x=1.5)
    check_act_case(case, pool.run(run_act_case, case))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.01), ("elu", 1.0), ("identity", 0.01)])
def test_bias_to_weight_ratio_at_the_budget(pool, dtype, activation, param):
    """|b| / |w| just under the amplification budget (read back from the output: the
    worst case of that path) and just over it (kept), with dy correlated with x-hat."""
    from syncbn.torch.batchnorm_act import AMPLIFICATION_BUDGET

    k = AMPLIFICATION_BUDGET[DTYPES[dtype]]
    bias = (0.9 * k, 0.9 * k * 0.5 * (1 if activation == "elu" else -1), 1.1 * k * 0.25, 0.0)
    base = Case(world=3, sizes=(3, 0, 4), tail=(6, 5), channels=4, dtype=dtype, steps=2, seed=21,
                param_dtype="float32" if dtype in ("bfloat16", "float16") else None)
    case = ActCase(base, activation, param, weight=(1.0, -0.5, 0.25, 1.0), bias=bias, dy_from_x=3.0)
    check_act_case(case, pool.run(run_act_case, case))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_elu_saturated_outputs(pool, dtype):
    """Pre-activations far below zero: ELU's output is -alpha to the last bit there."""
    base = Case(world=2, sizes=(4, 3), tail=(5,), channels=4, dtype=dtype, steps=2, seed=9)
    case = ActCase(base, "elu", 1.0, weight=(1.0, 3.0, -2.0, 0.5), bias=(-30.0, -6.0, -4.0, 0.0), dy_from_x=1.0)
    check_act_case(case, pool.run(run_act_case, case))


# ELU's most negative pre-activation put (through the bias, from the data) where the
# output rounds to -alpha although exp(-z_min) / |w| is within the budget, |w| being large:
# dtype -> (|w|, z_min)
ELU_EDGE = {"float32": (1e6, -18.3), "float64": (2e12, -38.2), "bfloat16": (1024.0, -7.3), "float16": (1e4, -9.8)}


def elu_edge_case(dtype: str) -> ActCase:
    """Channel 0 of a 2-rank ELU case at ``ELU_EDGE[dtype]``; the others ordinary."""
    from syncbn.torch.batchnorm_act import AMPLIFICATION_BUDGET

    half = dtype in ("bfloat16", "float16")
    base = Case(world=2, sizes=(3, 2), tail=(4, 3), channels=4, dtype=dtype, steps=1, seed=9,
                param_dtype="float32" if half else None)
    weight, z_min = ELU_EDGE[dtype]
    first = torch.cat(make_data(base)["steps"][0][0])[:, 0]
    low = ((first.min() - first.mean()) / torch.sqrt(first.var(unbiased=False) + base.eps)).item()
    case = ActCase(base, "elu", 1.0, weight=(weight, 1.0, -0.5, 0.7), bias=(z_min - weight * low, 0.2, -0.3, 0.1))
    # what makes the case, with room for the rounding of z: the budget alone keeps nothing,
    # and ELU's output is -1 at z_min + 0.3
    dt = DTYPES[dtype]
    assert math.exp(-z_min) / weight <= AMPLIFICATION_BUDGET[dt] / 2
    assert torch.expm1(torch.tensor(z_min + 0.3, dtype=torch.float64)).to(dt).item() == -1.0
    return case


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_elu_output_rounded_to_minus_alpha_with_a_large_weight(pool, dtype):
    """Where ELU's output is -alpha to the last bit its inverse gives -inf, whatever |w|:
    such a channel keeps its input even when exp(-z_min) / |w| is within the budget (before,
    its weight gradient was NaN)."""
    case = elu_edge_case(dtype)
    check_act_case(case, pool.run(run_act_case, case))


@pytest.mark.parametrize("world", [2, 3])
def test_no_input_grad(pool, world):
    base = Case(world=world, sizes=(3,) * world, input_grad=False, dtype="float64")
    case = ActCase(base, "elu", 0.5, weight=(0.0, 1.0, -1.0), bias=(1.0, 0.0, 0.5))
    check_act_case(case, pool.run(run_act_case, case))


@pytest.mark.parametrize("activation,param", [("elu", 0.5), ("leaky_relu", 0.1)])
def test_ranks_differ_in_whether_the_input_needs_a_gradient(pool, activation, param):
    base = Case(world=3, sizes=(3, 0, 2), frozen_inputs=(1,), dtype="float64")
    case = ActCase(base, activation, param, weight=(0.0, 1.0, -1.0), bias=(1.0, 0.0, 0.5))
    check_act_case(case, pool.run(run_act_case, case))


def test_single_element_ranks(pool):
    base = Case(world=4, sizes=(1, 1, 0, 1), tail=(), dtype="float64")
    case = ActCase(base, "leaky_relu", 0.1)
    check_act_case(case, pool.run(run_act_case, case))


def too_few_job(sizes):
    group = group_of(len(sizes))
    if not in_group(len(sizes)):
        return None
    layer = syncbn.SyncBatchNormAct(3, process_group=group)
    x = torch.randn(sizes[dist.get_rank()], 3)
    try:
        layer(x)
    except ValueError as err:
        return str(err)
    return None


def test_too_few_values_raise_on_every_rank(pool):
    """One value per channel over the group raises on every rank, as torch.nn.BatchNorm2d
    raises for one value per channel (every rank empty does not: see below)."""
    for message in pool.run(too_few_job, (1, 0, 0))[:3]:
        assert message is not None and "more than 1 value per channel" in message
        assert "across the process group" in message and "local input shape" in message


@pytest.mark.parametrize("activation", [("leaky_relu", 0.1), ("elu", 1.0), ("identity", 0.01)])
@pytest.mark.parametrize("momentum,track", [(0.1, True), (None, True), (0.1, False)])
def test_a_group_of_empty_ranks_is_torchs_empty_batch(pool, activation, momentum, track):
    """Every rank empty (W = 3, a global count of 0 values per channel; it raised
    ValueError): BatchNorm2d's empty batch followed by the activation, on every rank: an
    empty output and input gradient, zero weight and bias gradients, the running buffers
    bit for bit as they were, num_batches_tracked moved, one all-reduce each way; then a
    step with values as torch's (test_functional.check_empty_group; the other paths there
    and in test_kernels)."""
    from test_functional import check_empty_group, empty_group_job

    results = pool.run(empty_group_job, 3, "SyncBatchNormAct", momentum, track, "cpu", activation)
    check_empty_group(results, 3, "SyncBatchNormAct", momentum, track, activation)


def overflowed_variance_job(activation, param):
    """W = 2, float32, channel 0 holding one value of 1e30 (rank 0's): its variance
    overflows float32 to inf, so its invstd is 0. This rank's output, input gradient and
    local weight and bias gradients, beside torch's BatchNorm2d + activation on the
    concatenated batch (this rank's rows; torch's weight and bias gradients whole)."""
    from test_functional import SPIKED_AFFINE, spiked_batch

    group = group_of(2)
    if not in_group(2):
        return None
    rank = dist.get_rank()
    x, dy = spiked_batch(0, 1e30)
    rows = slice(3 * rank, 3 * rank + 3)
    layer = syncbn.SyncBatchNormAct(3, activation, param, process_group=group)
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        for module in (layer, bn):
            module.weight.copy_(torch.tensor(SPIKED_AFFINE[0]))
            module.bias.copy_(torch.tensor(SPIKED_AFFINE[1]))
    out = {}
    for name, module, inp, grad in (("ours", layer, x[rows], dy[rows]),
                                    ("torch", nn.Sequential(bn, torch_activation(activation, param)), x, dy)):
        inp = inp.clone().requires_grad_()
        y = module(inp)
        y.backward(grad)
        out[name] = (y.detach()[rows] if name == "torch" else y.detach(),
                     inp.grad[rows] if name == "torch" else inp.grad)
    out["ours_wb"] = (layer.weight.grad, layer.bias.grad)
    out["torch_wb"] = (bn.weight.grad, bn.bias.grad)
    return out


@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.1), ("elu", 1.0), ("identity", 0.01)])
def test_a_variance_beyond_float32_gives_torchs_zero_gradient(pool, activation, param):
    """A float32 channel whose variance overflows (values beyond about 1e19): torch's
    batch norm normalizes it with invstd 0 (every output the activated bias, input
    gradient 0); the synchronized backward divided the local sum of dz * xhat by that 0
    for its payload and gave every rank NaN input gradients there."""
    results = pool.run(overflowed_variance_job, activation, param)[:2]
    for r in results:
        (y, dx), (ref_y, ref_dx) = r["ours"], r["torch"]
        assert max_rel_err(y, ref_y) <= TOL["float32"]
        assert max_rel_err(dx, ref_dx) <= TOL["float32"]
        assert torch.equal(dx[:, 0], torch.zeros_like(dx[:, 0]))  # invstd 0: exactly 0, as torch's
    # the local weight and bias gradients add up to the single process's
    for ours, ref in zip(zip(*(r["ours_wb"] for r in results)), results[0]["torch_wb"]):
        assert max_rel_err(ours[0] + ours[1], ref) <= TOL["float32"]


# ---- communication ------------------------------------------------------------------


def count_job(world, channels, input_grad, phase, zero_weights):
    group = group_of(world)
    if not in_group(world):
        return None
    layer = syncbn.SyncBatchNormAct(channels, "elu", 1.0, process_group=group)
    if zero_weights:
        with torch.no_grad():
            layer.weight[::2] = 0  # kept channels change what is saved, not what is sent
    x = (torch.randn(dist.get_rank(), channels, 4, 4) + 3).requires_grad_(input_grad)
    with record_collectives() as fwd:
        if phase == "eval":
            layer.eval()
        y = layer(x * 1)
    with record_collectives() as bwd:
        y.backward(torch.randn_like(y))
    return {"forward": [(c.op, c.shapes, c.dtypes) for c in fwd], "backward": [(c.op, c.shapes, c.dtypes) for c in bwd]}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("zero_weights", [False, True])
def test_one_collective_each_way(pool, world, zero_weights):
    channels = 6
    for r in pool.run(count_job, world, channels, True, "train", zero_weights)[:world]:
        f = fingerprint.SIZE  # the layer fingerprint rides along
        assert r["forward"] == [("all_reduce", [[2 * channels + 1 + f]], ["double"])]
        assert r["backward"] == [("all_reduce", [[2 * channels + 1 + f]], ["float"])]


def test_backward_collective_also_without_input_grad(pool):
    channels, f = 6, fingerprint.SIZE
    for r in pool.run(count_job, 4, channels, False, "train", False):
        assert len(r["forward"]) == 1
        assert r["backward"] == [("all_reduce", [[2 * channels + 1 + f]], ["float"])]


def test_no_collective_in_eval_or_alone(pool):
    for r in pool.run(count_job, 4, 6, True, "eval", False):
        assert r["forward"] == [] and r["backward"] == []
    r = pool.run(count_job, 1, 6, True, "train", False)[0]
    assert r["forward"] == [] and r["backward"] == []


# ---- one process: the same as torch.nn ----------------------------------------------


def _pair(channels, activation, param, dtype=torch.float32, seed=0, **kwargs):
    """A SyncBatchNormAct and the torch BatchNorm + activation with the same weights."""
    gen = torch.Generator().manual_seed(seed)
    ours = syncbn.SyncBatchNormAct(channels, activation, param, **kwargs).to(dtype)
    bn = nn.BatchNorm2d(channels, **{k: v for k, v in kwargs.items() if k != "process_group"}).to(dtype)
    with torch.no_grad():
        if ours.weight is not None:
            ours.weight.copy_(torch.rand(channels, generator=gen) * 3 - 1.5)
            ours.bias.copy_(torch.randn(channels, generator=gen))
    bn.load_state_dict(ours.state_dict())
    bn._check_input_dim = lambda x: None  # compare on every input rank
    return ours, nn.Sequential(bn, torch_activation(activation, param))


@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.05), ("elu", 0.7), ("identity", 0.01)])
@pytest.mark.parametrize("shape", [(6, 5), (3, 5, 7), (2, 5, 4, 3), (2, 5, 3, 2, 2)])
def test_one_process_equals_torch(activation, param, shape):
    dtype = torch.float64 if len(shape) % 2 else torch.float32
    momentum = None if len(shape) < 4 else 0.1
    ours, ref = _pair(5, activation, param, dtype, momentum=momentum)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = (torch.randn(shape, generator=gen, dtype=dtype) * 2 + 3)
        if len(shape) == 4 and step == 1:
            x = x.contiguous(memory_format=torch.channels_last)
        xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo, yr = ours(xo * 1), ref(xr * 1)
        assert max_rel_err(yo.detach().double(), yr.detach().double()) < tol
        dy = torch.randn(shape, generator=gen, dtype=dtype)
        yo.backward(dy)
        yr.backward(dy)
        assert max_rel_err(xo.grad.double(), xr.grad.double()) < tol
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert max_rel_err(p.grad.double(), q.grad.double()) < tol
            p.grad = q.grad = None
    for (k1, v1), (k2, v2) in zip(ours.state_dict().items(), ref[0].state_dict().items()):
        assert k1 == k2 and max_rel_err(v1.double(), v2.double()) < tol
    ours.eval()
    ref.eval()
    x = torch.randn(shape, generator=gen, dtype=dtype)
    with torch.no_grad():
        assert max_rel_err(ours(x).double(), ref(x).double()) < tol


def test_gradcheck_float64_with_hard_weights():
    """Finite differences agree, with a zero, a negative and a tiny weight among the channels."""
    from syncbn.torch.batchnorm_act import _SyncBatchNormAct

    w = torch.tensor([0.0, -0.5, 1e-9, 2.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.3, 0.1, 1.0, -0.4], dtype=torch.float64, requires_grad=True)
    x = (torch.randn(3, 4, 2, dtype=torch.float64) + 2).requires_grad_()
    for activation, param in [("elu", 0.8), ("leaky_relu", 0.2), ("identity", 0.01)]:
        fn = lambda x, w, b: _SyncBatchNormAct.apply(x, w, b, None, None, 1e-5, 0.1, None, False, activation, param, False)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w, b), fast_mode=True)


def test_batchnorm2d_checkpoint_loads_and_matches():
    """A state_dict of nn.BatchNorm2d (next to an nn.LeakyReLU) loads as it is."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.BatchNorm2d(6), nn.LeakyReLU(0.1))
    ref.train()
    for _ in range(2):
        ref(torch.randn(4, 6, 3, 3) * 3 + 1)
    with torch.no_grad():
        ref[0].weight.uniform_(-2, 2)
        ref[0].bias.uniform_(-1, 1)
    ours = syncbn.SyncBatchNormAct(6, "leaky_relu", 0.1)
    ours.load_state_dict(ref[0].state_dict())
    assert list(ours.state_dict()) == list(nn.BatchNorm2d(6).state_dict())
    x = torch.randn(4, 6, 3, 3) + 2
    ours.eval(), ref.eval()
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    ours.train(), ref.train()
    torch.testing.assert_close(ours(x * 1), ref(x), rtol=1e-5, atol=1e-5)
    back = nn.BatchNorm2d(6)
    back.load_state_dict(ours.state_dict())
    no_bias = syncbn.SyncBatchNormAct(6, bias=False)
    assert no_bias.bias is None and list(no_bias.state_dict()) == list(torch_batchnorm(nn.BatchNorm2d, 6, bias=False).state_dict())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"activation": "relu"}, "unknown activation 'relu'.*ReLU is not invertible"),
        ({"activation": "gelu"}, "unknown activation"),
        ({"activation": None}, "unknown activation"),
        ({"activation": "leaky_relu", "activation_param": 0.0}, "positive negative slope.*slope 0 is ReLU"),
        ({"activation": "leaky_relu", "activation_param": -0.1}, "positive negative slope"),
        ({"activation": "elu", "activation_param": 0.0}, "alpha.*> 0"),
        ({"activation": "elu", "activation_param": -1.0}, "alpha.*> 0"),
        ({"activation": "elu", "activation_param": float("nan")}, "finite real number"),
        ({"activation": "leaky_relu", "activation_param": "0.1"}, "finite real number"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        syncbn.SyncBatchNormAct(4, **kwargs)


def test_bad_input_names_the_problem():
    layer = syncbn.SyncBatchNormAct(4)
    with pytest.raises(ValueError, match="at least 2D input"):
        layer(torch.randn(4))
    with pytest.raises(RuntimeError, match="expected 4 channels"):
        layer(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="number of input channels should be non-zero"):
        layer(torch.randn(2, 0, 5))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(2, 4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.randn(1, 4))
    # ELU takes the general path (not the local kernels): in one process there is no
    # group to name (the count rule is syncbn.functional's, in its words)
    with pytest.raises(ValueError, match="more than 1 value per channel") as err:
        syncbn.SyncBatchNormAct(4, activation="elu")(torch.randn(1, 4))
    assert "process group" not in str(err.value) and "(local input shape (1, 4))" in str(err.value)
    assert "activation='leaky_relu', activation_param=0.01" in repr(layer)


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, True)])
def test_repr_says_what_a_batch_norm_repr_says(affine, bias):
    """After the activation, the printed settings are those torch.nn.BatchNorm2d prints,
    in its order: bias=False (or affine=False) shows that the layer has no shift, which
    the repr used to leave out."""
    ours = repr(syncbn.SyncBatchNormAct(4, affine=affine, bias=bias))
    settings = f"eps=1e-05, momentum=0.1, affine={affine}, bias={affine and bias}, track_running_stats=True"
    assert ours.endswith(f", {settings})"), ours
    torchs = torch_batchnorm(nn.BatchNorm2d, 4, affine=affine, bias=bias).extra_repr()
    if "bias=" in torchs:  # torch before the bias argument (2.4) prints no bias
        assert torchs == f"4, {settings}"



def _meta_outputs(layer, shape, channels_last):
    x = torch.empty(shape, device="meta")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = layer(x)
    return y.device, y.shape, y.dtype, y.stride()


@pytest.mark.parametrize("activation", batchnorm_act.ACTIVATIONS)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_meta_inputs_give_what_batchnorm_and_activation_give(activation, inplace, channels_last, training):
    """On the meta device (shapes without values: shape inference) the layer gives the
    output BatchNorm2d and the activation give, as syncbn.SyncBatchNorm does; in training
    it raised torch's NotImplementedError for nonzero() on meta, from choosing which
    channels keep their input."""
    ours = syncbn.SyncBatchNormAct(4, activation=activation, activation_param=0.1, inplace=inplace)
    ref = nn.Sequential(nn.BatchNorm2d(4), torch_activation(activation, 0.1))
    for layer in (ours, ref):
        layer.to("meta").train(training)
    assert _meta_outputs(ours, (3, 4, 5, 2), channels_last) == _meta_outputs(ref, (3, 4, 5, 2), channels_last)
    assert ours.running_var.device.type == "meta"


def meta_job(world):
    group = group_of(world)
    if not in_group(world):
        return None
    layer = syncbn.SyncBatchNormAct(4, process_group=group).to("meta")
    with record_collectives() as calls:
        got = _meta_outputs(layer, (2 + dist.get_rank(), 4, 3), False)
    return got[1], len(calls)


def test_meta_inputs_across_ranks(pool):
    """Every rank on the meta device: the output's shape, and no collective (there are no
    values to sum), on every rank alike; it raised NotImplementedError on every rank."""
    assert pool.run(meta_job, 2)[:2] == [(torch.Size([2, 4, 3]), 0), (torch.Size([3, 4, 3]), 0)]


# ---- in place, and when not -----------------------------------------------------------


def _reference_grads(fn, x, layer):
    """Run fn with a plain BatchNorm2d + activation in place of ``layer``."""
    bn = nn.BatchNorm2d(layer.num_features)
    bn.load_state_dict(layer.state_dict())
    ref = nn.Sequential(bn, torch_activation(layer.activation, layer.activation_param))
    xr = x.detach().clone().requires_grad_()
    out = fn(ref, xr)
    out.backward(torch.ones_like(out))
    return out.detach(), xr.grad, [p.grad for p in bn.parameters()]


def _ours_grads(fn, x, layer):
    xo = x.detach().clone().requires_grad_()
    out = fn(layer, xo)
    out.backward(torch.ones_like(out))
    return out.detach(), xo.grad, [p.grad for p in layer.parameters()]


def _hard_layer(activation="leaky_relu", param=0.1):
    layer = syncbn.SyncBatchNormAct(4, activation, param)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.5, 0.0, 0.8]))
        layer.bias.copy_(torch.tensor([0.2, -0.3, 0.4, 0.0]))
    return layer


def _uses(name):
    """Graphs that hand the layer an input someone else still needs."""
    w = torch.linspace(0.5, 2, 4).view(1, 4, 1, 1)

    def saved_before(layer, x):  # x * w saves x for its backward, then the layer runs
        h = x * 2
        other = h * w
        return layer(h) + other

    def used_after(layer, x):  # another branch reads h after the layer
        h = x * 2
        y = layer(h)
        return y * 3 + h.sin()

    def leaf(layer, x):
        return layer(x)

    def view(layer, x):
        h = x * 2
        return layer(h[:, :, 1:]).sum(dim=2, keepdim=True) + h[:, :, :1]

    def alias(layer, x):
        h = x * 2
        keep = h.detach()
        return layer(h) + keep

    def saved_output(layer, x):  # exp keeps its own output for backward
        return layer(torch.exp(x))

    def retained(layer, x):
        h = x * 2
        h.retain_grad()
        y = layer(h)
        assert h.grad is None
        return y

    return {"saved_before": saved_before, "used_after": used_after, "leaf": leaf, "view": view,
            "alias": alias, "saved_output": saved_output, "retained": retained}[name]


@pytest.mark.parametrize("use", ["saved_before", "used_after", "leaf", "view", "alias", "saved_output", "retained"])
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.1), ("elu", 1.0)])
def test_inputs_needed_elsewhere_are_not_overwritten(use, activation, param):
    torch.manual_seed(3)
    x = torch.randn(3, 4, 5, 2) + 1
    fn = _uses(use)
    y_ref, dx_ref, dp_ref = _reference_grads(fn, x, _hard_layer(activation, param))
    layer = _hard_layer(activation, param)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, dx, dp = _ours_grads(fn, x, layer)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(dp, dp_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_retain_graph_backward_twice():
    layer = _hard_layer("elu", 1.0)
    x = (torch.randn(3, 4, 6) + 1).requires_grad_()
    y = layer(x * 1)
    dy = torch.randn_like(y)
    first = torch.autograd.grad(y, x, dy, retain_graph=True)[0]
    second = torch.autograd.grad(y, x, dy)[0]
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_activation_checkpointing_gives_the_same_gradients():
    from syncbn import checkpoint

    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), _hard_layer(), nn.Conv2d(4, 4, 1))
    ref = copy.deepcopy(block)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    checkpoint(block, x, use_reentrant=False).square().sum().backward()
    ref(x.detach().requires_grad_()).square().sum().backward()
    for p, q in zip(block.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    for (name, b1), b2 in zip(block.named_buffers(), ref.buffers()):  # moved once, not twice
        torch.testing.assert_close(b1, b2, rtol=1e-6, atol=1e-7, msg=name)


# ---- memory -------------------------------------------------------------------------


@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.01), ("elu", 1.0)])
@pytest.mark.parametrize("shape", [(2, 16, 8, 8), (4, 32, 28, 28), (8, 64, 16, 16)])
def test_saves_at_most_055_of_batchnorm_and_activation(activation, param, shape):
    """Bytes saved for backward (distinct storages), float32 NCHW."""
    ours, ref = _pair(shape[1], activation, param)
    x = torch.randn(shape) + 1
    theirs = saved_bytes(lambda: ref(x.clone().requires_grad_() * 1))
    mine = saved_bytes(lambda: ours(x.clone().requires_grad_() * 1))
    assert mine <= 0.55 * theirs, (mine, theirs)


def test_kept_channels_cost_only_their_inputs(monkeypatch):
    shape = (4, 8, 6, 6)
    x = torch.randn(shape) + 1
    layer = syncbn.SyncBatchNormAct(8)
    with monkeypatch.context() as m:  # the general path, which the zero weights below take
        m.setattr(batchnorm_act, "_local_kernels_fit", lambda *args: False)
        base = saved_bytes(lambda: layer(x.clone().requires_grad_() * 1))
    with torch.no_grad():
        layer.weight[:3] = 0  # three channels cannot be read back from the output
    kept = saved_bytes(lambda: layer(x.clone().requires_grad_() * 1))
    per_channel = x[:, :1].numel() * 4
    assert kept - base == 3 * per_channel + 3 * 8  # their inputs and their indices
    layer.requires_grad_(False)
    assert saved_bytes(lambda: layer(x * 1)) == 0  # no gradient needed: nothing saved


def test_fused_network_has_lower_peak():
    torch.manual_seed(0)

    def net():
        layers = []
        for _ in range(4):
            layers += [nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.1)]
        return nn.Sequential(*layers)

    plain = net()
    fused = syncbn.fuse_batchnorm_act(copy.deepcopy(plain))
    x = torch.randn(8, 16, 24, 24)

    def step(model):
        model(x.requires_grad_(False) * 1).square().mean().backward()

    assert peak_memory(step, fused) < 0.8 * peak_memory(step, plain)


def test_saved_tensors_counts_storages_once():
    a = torch.randn(10, 10, requires_grad=True)
    with saved_tensors() as saved:
        b = a * 2
        c = b[:5] * b[5:]  # two views of b saved, one storage
    assert saved.tensors == 2 and saved.storages == 1 and saved.bytes == 400
    w = nn.Linear(10, 10)
    with saved_tensors(ignore=[w]) as saved:
        w(b)
    assert saved.bytes == 400  # b only: the weight is not counted
    del c


def test_peak_memory_sees_a_temporary():
    def fn():
        t = torch.empty(1_000_000)
        del t
        return torch.empty(10)

    assert 4_000_000 <= peak_memory(fn) < 4_100_000


# ---- fusing and reverting ---------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, act=None):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.act = act if act is not None else nn.LeakyReLU(0.2)
        self.bn2 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.bn3 = nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))  # fusable
        y = self.bn2(x)
        x = self.relu(y) + y  # bn2 output used twice: not fusable
        return F.leaky_relu(self.bn3(x), 0.1)  # functional activation: left alone


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block(nn.ELU(0.5))
        self.seq = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4), nn.LeakyReLU(0.3))

    def forward(self, x):
        if float(x.detach().mean()) > 100:  # data-dependent: symbolic tracing fails here
            return x
        return self.seq(self.block(x))


def _randomized(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(-1.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model


def _same_function(a, b, x):
    for training in (True, False):
        a.train(training)
        b.train(training)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = a(xa), b(xb)
        torch.testing.assert_close(ya, yb, rtol=2e-5, atol=2e-5)
        ya.square().sum().backward()
        yb.square().sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)


def _kinds(model):
    return [type(m).__name__ for m in model.modules()]


def test_fuse_sequential_pairs():
    model = _randomized(nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.LeakyReLU(0.1),
        nn.Sequential(nn.BatchNorm2d(4), nn.ELU(0.7), nn.BatchNorm2d(4), nn.ReLU()),
        nn.BatchNorm2d(4), nn.Identity(), nn.BatchNorm2d(4), nn.LeakyReLU(0.0), nn.Conv2d(4, 2, 1),
    ))
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = syncbn.fuse_batchnorm_act(model)
    assert out is model
    fused = [m for m in model.modules() if isinstance(m, syncbn.SyncBatchNormAct)]
    assert [(m.activation, m.activation_param) for m in fused] == [("leaky_relu", 0.1), ("elu", 0.7)]
    assert type(model[3][3]) is nn.ReLU and type(model[7]) is nn.LeakyReLU  # ReLU and slope 0 stay
    assert type(model[4]) is nn.BatchNorm2d and type(model[5]) is nn.Identity  # never fused with an identity
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    _same_function(model, ref, torch.randn(4, 3, 6, 6))
    back = syncbn.revert_sync_batchnorm(model)
    assert _kinds(back) == _kinds(ref) and list(back.state_dict()) == keys
    _same_function(back, ref, torch.randn(4, 3, 6, 6))


def test_fuse_through_fx():
    model = _randomized(_Block())
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        syncbn.fuse_batchnorm_act(model)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["bn"] == "SyncBatchNormAct" and kinds["act"] == "_FusedActivation"
    assert kinds["bn2"] == kinds["bn3"] == "BatchNorm2d"
    assert model.bn.inplace  # its input is the convolution's fresh output, read by nothing else
    assert list(model.state_dict()) == keys
    _same_function(model, ref, torch.randn(3, 4, 5, 5))
    back = syncbn.revert_sync_batchnorm(model)
    assert _kinds(back) == _kinds(ref) and list(back.state_dict()) == keys


def test_untraceable_model_is_left_alone_with_a_warning():
    """A part traced alone could be tapped by the untraceable code around it."""
    model = _randomized(_Untraceable())
    kinds = _kinds(model)
    with pytest.warns(UserWarning, match="nothing fused: torch.fx cannot trace _Untraceable"):
        syncbn.fuse_batchnorm_act(model)
    assert _kinds(model) == kinds


def test_shared_activation_fuses_only_when_every_use_does():
    class Shared(nn.Module):
        def __init__(self, second_bn):
            super().__init__()
            self.bn1, self.act = nn.BatchNorm1d(3), nn.LeakyReLU(0.1)
            self.other = nn.BatchNorm1d(3) if second_bn else nn.Linear(3, 3)

        def forward(self, x):
            return self.act(self.other(self.act(self.bn1(x))))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every use of the activation fuses: nothing to say
        both = syncbn.fuse_batchnorm_act(Shared(True))
    assert isinstance(both.bn1, syncbn.SyncBatchNormAct) and isinstance(both.other, syncbn.SyncBatchNormAct)
    with pytest.warns(UserWarning, match=r"unfused: bn1 \(its activation act is also called where it cannot be fused\)"):
        one = syncbn.fuse_batchnorm_act(Shared(False))
    assert type(one.bn1) is nn.BatchNorm1d and type(one.act) is nn.LeakyReLU


def test_convert_leaves_the_fused_layer_alone_and_revert_splits_it():
    layer = _randomized(nn.Sequential(syncbn.SyncBatchNormAct(4, "elu", 0.5)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert syncbn.convert_sync_batchnorm(layer)[0] is layer[0]
    x = torch.randn(3, 4, 2, 2)
    layer.eval()
    expected = layer(x)
    back = syncbn.revert_sync_batchnorm(layer)
    assert [type(m) for m in back[0]] == [BatchNormNd, nn.ELU] and back[0][1].alpha == 0.5
    torch.testing.assert_close(back(x), expected, rtol=0, atol=0)
    converted = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4), nn.LeakyReLU(0.2)))
    fused = syncbn.fuse_batchnorm_act(converted)
    assert isinstance(fused[0], syncbn.SyncBatchNormAct)
    assert type(syncbn.revert_sync_batchnorm(fused)[0]) is nn.BatchNorm2d


# ---- figures: ``python tests/test_batchnorm_act.py`` prints what the tests assert ---------


def _figures():
    import collections

    from syncbn.torch.batchnorm_act import AMPLIFICATION_BUDGET
    from syncbn.tools.launch import WorkerPool

    print("bytes saved for backward (distinct storages), float32 NCHW, SyncBatchNormAct / BatchNorm2d + act")
    for shape in [(2, 16, 8, 8), (4, 64, 28, 28), (8, 64, 32, 32), (8, 256, 56, 56)]:
        x = torch.randn(shape) + 1
        cells = []
        for activation, param in [("leaky_relu", 0.01), ("elu", 1.0), ("identity", 0.01)]:
            ours = syncbn.SyncBatchNormAct(shape[1], activation, param)  # default weights: nothing kept
            ref = nn.Sequential(nn.BatchNorm2d(shape[1]), torch_activation(activation, param))
            theirs = saved_bytes(lambda: ref(x.clone().requires_grad_() * 1))
            mine = saved_bytes(lambda: ours(x.clone().requires_grad_() * 1))
            cells.append(f"{activation} {mine / theirs:.4f}")
        print(f"  {str(shape):17s} " + "   ".join(cells))

    hard = []
    for dtype in DTYPE_NAMES:
        half = "float32" if dtype in ("bfloat16", "float16") else None
        k = AMPLIFICATION_BUDGET[DTYPES[dtype]]
        for activation, param in [("leaky_relu", 0.01), ("elu", 1.0), ("identity", 0.01)]:
            base = Case(world=3, sizes=(3, 0, 2), tail=(4, 3), channels=7, dtype=dtype, steps=2, seed=5, param_dtype=half)
            hard.append(ActCase(base, activation, param, weight=HARD_WEIGHT, bias=HARD_BIAS, dy_from_x=1.5))
            base = Case(world=3, sizes=(3, 0, 4), tail=(6, 5), channels=4, dtype=dtype, steps=2, seed=21, param_dtype=half)
            bias = (0.9 * k, 0.9 * k * 0.5 * (1 if activation == "elu" else -1), 1.1 * k * 0.25, 0.0)
            hard.append(ActCase(base, activation, param, weight=(1.0, -0.5, 0.25, 1.0), bias=bias, dy_from_x=3.0))
        base = Case(world=2, sizes=(4, 3), tail=(5,), channels=4, dtype=dtype, steps=2, seed=9)
        hard.append(ActCase(base, "elu", 1.0, weight=(1.0, 3.0, -2.0, 0.5), bias=(-30.0, -6.0, -4.0, 0.0), dy_from_x=1.0))
    pool = WorkerPool(4, backend="gloo", timeout=120)
    try:
        for name, cases in [("oracle grid", _grid()), ("zero/negative/tiny weights, |b|/|w| at the budget, ELU saturation", hard)]:
            worst = collections.defaultdict(lambda: collections.defaultdict(float))
            for case in cases:
                for key, err in check_act_case(case, pool.run(run_act_case, case)).items():
                    worst[case.base.dtype][key] = max(worst[case.base.dtype][key], err)
            print(f"largest relative errors vs the float64 oracle, {name} ({len(cases)} cases):")
            for dtype in DTYPE_NAMES:
                print(f"  {dtype:9s} " + "  ".join(f"{k}={v:.2e}" for k, v in worst[dtype].items())
                      + f"   (tolerance {TOL[dtype]:.0e})")
    finally:
        pool.close()


if __name__ == "__main__":
    _figures()


def _run_layer(layer, x, dy, inplace):
    src = x.clone().requires_grad_()
    y = layer(src * 1) if inplace else layer(src)  # in place only over a temporary (a leaf cannot be)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(y, [src, *params], dy)
    return y.detach().clone(), grads, [b.clone() for b in layer.buffers()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.05), ("identity", 0.01)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "(N, C)"])
@pytest.mark.parametrize("affine,momentum,inplace", [(True, 0.1, True), (False, None, False), (True, None, False)])
def test_local_kernels_match_the_general_path(monkeypatch, dtype, activation, param, layout, affine, momentum, inplace):
    """Without communication the layer runs torch's kernels (one native backward call
    on the recovered z); the general path of the synchronized layer is its reference."""
    gen = torch.Generator().manual_seed(5)
    shape = (6, 5) if layout == "(N, C)" else (3, 5, 6, 7)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 3).to(dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "channels_last":
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    fast = syncbn.SyncBatchNormAct(5, activation, param, momentum=momentum, affine=affine, dtype=dtype, inplace=inplace)
    if affine:
        with torch.no_grad():
            fast.weight.copy_(torch.tensor([1.5, -0.7, 0.2, 2.0, -3.0]))
            fast.bias.copy_(torch.tensor([0.1, -0.4, 0.05, 1.0, 0.0]))
    slow = copy.deepcopy(fast)
    assert batchnorm_act._local_kernels_fit(x, fast.weight, fast.bias, activation, param)
    calls = []
    real = batchnorm_act._LocalBatchNormAct.apply
    monkeypatch.setattr(batchnorm_act._LocalBatchNormAct, "apply", lambda *a: calls.append(a[-1]) or real(*a))
    for step in range(2):
        got = _run_layer(fast, x, dy, inplace)
        with monkeypatch.context() as m:
            m.setattr(batchnorm_act, "_local_kernels_fit", lambda *args: False)
            ref = _run_layer(slow, x, dy, inplace)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        torch.testing.assert_close(got[0], ref[0], rtol=tol, atol=tol)
        for a, b in zip(got[1], ref[1]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * 10)
        for a, b in zip(got[2], ref[2]):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert calls == [inplace, inplace]  # the fast path ran, in place when it could


@pytest.mark.parametrize("host", ["numpy", "torch"])
@pytest.mark.parametrize("weight,fits", [(1.0, True), (-2.0, True), (0.0, False), (1e-30, False), (1e-3, True)])
def test_local_kernels_only_where_the_output_can_be_inverted(monkeypatch, host, weight, fits):
    if host == "torch":
        monkeypatch.setattr(batchnorm_act, "_numpy", None)
    layer = syncbn.SyncBatchNormAct(3)
    with torch.no_grad():
        layer.weight.fill_(weight)
        layer.bias.fill_(0.1)
    x = torch.randn(4, 3, 5)
    fit = batchnorm_act._local_kernels_fit(x, layer.weight, layer.bias, "leaky_relu", 0.01)
    assert fit == (fits and abs(weight) * 2.0**8 >= 0.1)
    assert not batchnorm_act._local_kernels_fit(x, layer.weight, layer.bias, "elu", 1.0)
    assert not batchnorm_act._local_kernels_fit(x.bfloat16(), layer.weight, layer.bias, "leaky_relu", 0.01)
    # a slope so small that the output's floor (tiny / slope) reaches the budget
    assert not batchnorm_act._local_kernels_fit(x, layer.weight, layer.bias, "leaky_relu", 1e-42)


def test_local_kernels_fit_reads_current_weights():
    """The fit check's cached host views never go stale: writes through ``.data`` (which
    bypass the version counter), a new storage, and a cast are all seen."""
    layer = syncbn.SyncBatchNormAct(3)
    x = torch.randn(4, 3, 5)
    fit = lambda: batchnorm_act._local_kernels_fit(x, layer.weight, layer.bias, "leaky_relu", 0.01)  # noqa: E731
    assert fit()
    layer.weight.data[1] = 0.0  # in place, no version bump
    assert not fit()
    layer.weight.data.fill_(1.0)
    assert fit()
    layer.weight.data = torch.tensor([1.0, 1e-30, 1.0])  # another storage
    assert not fit()
    layer.weight.data = torch.ones(3)
    assert fit()
    layer.double()
    assert not fit()  # float32 input, float64 weights: the general path
    assert batchnorm_act._local_kernels_fit(x.double(), layer.weight, layer.bias, "leaky_relu", 0.01)
    with torch.no_grad():
        layer.bias.fill_(1e3)  # |b| / |w| = 1e3: within the float64 budget, 2**16
    assert batchnorm_act._local_kernels_fit(x.double(), layer.weight, layer.bias, "leaky_relu", 0.01)
    with torch.no_grad():
        layer.bias.fill_(1e6)  # beyond it
    assert not batchnorm_act._local_kernels_fit(x.double(), layer.weight, layer.bias, "leaky_relu", 0.01)


@pytest.mark.parametrize("layout,shape", [
    ("contiguous", (4, 6, 10, 10)), ("contiguous", (4, 8, 256, 128)), ("channels_last", (4, 6, 10, 10)),
])
def test_local_output_exact_far_from_zero(layout, shape):
    """|mean| / std = 1e4 in float32: a large input in the standard layout (at least
    2**20 elements) normalizes the centered input; smaller ones and channels-last run
    torch's kernel, whose ``x * scale + shift`` rounds as torch.nn.BatchNorm2d does.

    Bounds, with u = 2^-24 and r = |mean| / std = 1e4. Centered: the statistics are
    float64 sums (relative error < 1e-9), so the error is the float32 arithmetic of
    ``(x - s) * a + b``: x - s rounded at u/2 |t|, a = invstd at u, product and sum at u/2
    each, at most about 4 u (|xhat| + 1); bound 8 u (max |xhat| + 1), about 3e-6 here
    (measured 3.7e-7; the float32 dot products used before gave 3.8e-6 here and 1.03e-5 on
    an AMD EPYC). torch's kernel: x * a and + b each round at u/2 of a value of size r,
    and b = -mean * a once more: about 1.5 u r = 9e-4; bound 5e-3."""
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5 + 5e3).float()
    exact = layout == "contiguous" and x.numel() >= batchnorm_act._LOCAL_CENTERED_MIN_ELEMENTS
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    layer = syncbn.SyncBatchNormAct(shape[1], "identity")
    y = layer(x.clone().requires_grad_()).detach().double()
    xd = x.double()
    mean = xd.mean(dim=(0, 2, 3), keepdim=True)
    ref = (xd - mean) / ((xd - mean) ** 2).mean(dim=(0, 2, 3), keepdim=True).add(1e-5).sqrt()
    err = (y - ref).abs().max().item()
    bound = 8 * 2.0**-24 * (ref.abs().max().item() + 1) if exact else 5e-3
    assert err < bound, (err, bound)


# ---- issue 13: never a silently wrong value -------------------------------------------
# Each test compares against float64 torch.nn.BatchNorm2d + the same activation.


def _ref64(layer):
    """Float64 BatchNorm2d + the activation, with ``layer``'s state."""
    bn = nn.BatchNorm2d(layer.num_features, eps=layer.eps, momentum=layer.momentum).double()
    bn.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in layer.state_dict().items()})
    bn.train(layer.training)
    return nn.Sequential(bn, torch_activation(layer.activation, layer.activation_param))


def _close64(got, ref, tol):
    """Relative to the largest reference value; NaN and inf in ``got`` fail."""
    got, ref = got.detach().double(), ref.detach().double()
    assert torch.isfinite(got).all(), "non-finite values"
    err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()
    assert err <= tol, err


def _layer(activation="leaky_relu", param=0.1, **kwargs):
    layer = syncbn.SyncBatchNormAct(4, activation, param, **kwargs)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.5, 0.7, 0.8]))
        layer.bias.copy_(torch.tensor([0.2, -0.3, 0.4, 0.0]))
    return layer


def _foreign(kind, arr):
    """A tensor over memory that torch does not own (or, for dlpack_torch, another
    tensor's memory handed over through DLPack)."""
    import numpy as np

    if kind == "from_numpy":
        return torch.from_numpy(arr)
    if kind == "as_tensor":
        return torch.as_tensor(arr)
    if kind == "dlpack_numpy":
        return torch.from_dlpack(arr)
    assert kind == "dlpack_torch"
    return torch.from_dlpack(torch.from_numpy(np.ascontiguousarray(arr)))


@pytest.mark.parametrize("kind", ["from_numpy", "as_tensor", "dlpack_numpy", "dlpack_torch", "temporary"])
@pytest.mark.parametrize("path", ["local", "general"])
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.1), ("elu", 1.0)])
def test_group1_default_layer_never_writes_over_its_input(monkeypatch, kind, path, activation, param):
    """Group 1: without inplace=True the input, whoever owns its memory, keeps its values."""
    import numpy as np

    if path == "general":
        monkeypatch.setattr(batchnorm_act, "_local_kernels_fit", lambda *args: False)
    arr = (np.random.default_rng(0).standard_normal((3, 4, 5, 5)) + 1).astype(np.float32)
    before = arr.copy()
    layer = _layer(activation, param)
    ref = _ref64(layer)
    for training in (True, False):
        layer.train(training)
        ref.train(training)
        if kind == "temporary":
            y = layer(torch.from_numpy(arr) * 1)  # a temporary nothing else holds
        else:
            y = layer(_foreign(kind, arr))
        _close64(y, ref(torch.from_numpy(before).double()), 1e-5)
        assert np.array_equal(arr, before), "the input's memory was overwritten"


def test_group1_inplace_true_writes_over_declared_to_autograd():
    """Group 1: inplace=True writes over the input (as LeakyReLU(inplace=True), also
    through numpy memory), and a reader that needs the old values gets autograd's error."""
    import numpy as np

    layer = _layer(inplace=True)
    ref = _ref64(layer)
    x0 = torch.randn(3, 4, 5, 5) + 1
    x = x0.clone().requires_grad_()
    h = x * 1
    y = layer(h)
    assert y.data_ptr() == h.data_ptr()
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = x0.double().requires_grad_()
    ref(xr).backward(dy.double())
    _close64(x.grad, xr.grad, 1e-5)
    # something else still needs h: the write is caught at backward, never used silently
    x = x0.clone().requires_grad_()
    h = x * 1
    other = h * torch.linspace(0.5, 2, 4).view(1, 4, 1, 1).requires_grad_()  # saves h
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (layer(h) + other).sum().backward()
    with pytest.raises(RuntimeError, match="leaf"):
        layer(x0.clone().requires_grad_())
    # numpy memory with an explicit inplace=True: written through, as torch's in-place ops do
    arr = x0.numpy().copy()
    torch_out = nn.LeakyReLU(0.1, inplace=True)(torch.from_numpy(arr.copy()))
    out = layer(torch.from_numpy(arr))
    assert np.array_equal(arr, out.detach().numpy())
    assert torch_out.data_ptr() != out.data_ptr()


@pytest.mark.parametrize("path,activation,param", [
    ("local", "leaky_relu", 0.1), ("general", "leaky_relu", 0.1), ("general", "elu", 1.0),
])
@pytest.mark.parametrize("kind", ["leaf", "view of a leaf"])
def test_inplace_refuses_a_leaf_before_writing_over_it(monkeypatch, path, activation, param, kind):
    """inplace=True on a leaf that requires grad (or a view of one) raises torch's error
    as LeakyReLU(inplace=True) does, with the tensor's values untouched; the running
    statistics move, as they do for BatchNorm followed by the in-place activation."""
    if path == "general":
        monkeypatch.setattr(batchnorm_act, "_local_kernels_fit", lambda *args: False)
    layer = _layer(activation, param, inplace=True)
    base = (torch.randn(3, 4, 5, 2) + 0.5).requires_grad_()
    before = base.detach().clone()
    x = base if kind == "leaf" else base[1:]
    with pytest.raises(RuntimeError, match=f"SyncBatchNormAct.inplace=True.: a {kind} Variable"):
        layer(x)
    assert torch.equal(base.detach(), before), "the leaf was written over before the error"
    assert int(layer.num_batches_tracked) == 1
    with torch.no_grad():  # no autograd to refuse it: written over
        y = layer(x)
    assert y.data_ptr() == x.data_ptr()


def leaf_job(world):
    """Every rank hands an in-place layer a leaf: each raises after the forward collective,
    so the next call pairs up with the others' and nothing waits."""
    group = group_of(world)
    if not in_group(world):
        return None
    layer = syncbn.SyncBatchNormAct(4, "leaky_relu", 0.1, inplace=True, process_group=group)
    x = (torch.randn(2 + dist.get_rank(), 4, 3) + 1).requires_grad_()
    before = x.detach().clone()
    try:
        layer(x)
        raised = None
    except RuntimeError as error:
        raised = str(error)
    untouched = torch.equal(x.detach(), before)
    y = layer(x * 1)
    y.sum().backward()
    return {"raised": raised, "untouched": untouched, "grad": bool(torch.isfinite(x.grad).all())}


def test_inplace_leaf_refused_alike_on_every_rank(pool):
    for r in pool.run(leaf_job, 2)[:2]:
        assert r["raised"] is not None and "a leaf Variable" in r["raised"]
        assert r["untouched"] and r["grad"]


@pytest.mark.parametrize("path,activation,param", [
    ("local", "leaky_relu", 0.1), ("general", "leaky_relu", 0.1), ("general", "elu", 1.0), ("general", "identity", 0.01),
])
def test_group1_incoming_gradient_is_never_overwritten(monkeypatch, path, activation, param):
    """Group 1: the gradient autograd hands the layer keeps its values, whether the
    caller passed it, a hook keeps it, another node still needs it, or it is fresh."""
    if path == "general":
        monkeypatch.setattr(batchnorm_act, "_local_kernels_fit", lambda *args: False)
    x0 = torch.randn(3, 4, 5, 2) + 0.5
    g = torch.randn_like(x0)
    layer = _layer(activation, param)
    ref = _ref64(layer)

    def run(module, x, dtype):
        kept = []
        y = module(x * 1)
        y.register_hook(lambda grad: kept.append((grad, grad.clone())))
        other = x * 3  # a + b: the engine hands both sides the same gradient tensor
        ((y + other) * g.to(dtype)).sum().backward()
        return kept

    x = x0.clone().requires_grad_()
    kept = run(layer, x, torch.float32)
    xr = x0.double().requires_grad_()
    run(ref, xr, torch.float64)
    _close64(x.grad, xr.grad, 1e-5)
    (grad, copy_at_hook), = kept
    assert torch.equal(grad, copy_at_hook)
    caller = g.clone()
    layer(x0.clone().requires_grad_() * 1).backward(caller)
    assert torch.equal(caller, g)


def _twice_differentiable_cases(layer, x):
    def penalty():  # a constant incoming gradient (once_differentiable dropped it silently)
        xx = x.clone().requires_grad_()
        dx, = torch.autograd.grad(layer(xx).sum(), xx, create_graph=True)
        return dx

    def hessian():
        return torch.autograd.functional.hessian(lambda t: layer(t).square().sum(), x[:2])

    def grad_of_grad():  # the incoming gradient requires grad itself
        xx = x.clone().requires_grad_()
        v = torch.randn_like(x, requires_grad=True)
        return torch.autograd.grad(layer(xx), xx, v, create_graph=True)

    return [penalty, hessian, grad_of_grad]


@pytest.mark.parametrize("path", ["local", "general"])
def test_group2_create_graph_raises_in_the_fused_layer(monkeypatch, path):
    """Group 2: every backward with create_graph=True that reaches the layer raises."""
    if path == "general":
        monkeypatch.setattr(batchnorm_act, "_local_kernels_fit", lambda *args: False)
    layer = _layer("elu" if path == "general" else "leaky_relu", 1.0 if path == "general" else 0.1)
    x = torch.randn(3, 4, 5, 2) + 0.5
    for case in _twice_differentiable_cases(layer, x):
        with pytest.raises(RuntimeError, match="SyncBatchNormAct: higher-order gradients are not supported"):
            case()
    # a plain backward is still fine afterwards
    xx = x.clone().requires_grad_()
    layer(xx).sum().backward()
    assert torch.isfinite(xx.grad).all()


def double_backward_job(kind):
    group = group_of(2)
    if not in_group(2):
        return None
    torch.manual_seed(dist.get_rank())
    if kind == "act":
        layer = syncbn.SyncBatchNormAct(4, "leaky_relu", 0.1, process_group=group)
        name = "SyncBatchNormAct"
    else:
        layer = syncbn.SyncBatchNorm(4, process_group=group)
        name = "SyncBatchNorm"
    x = torch.randn(3, 4, 5) + 0.5
    messages = []
    for case in _twice_differentiable_cases(layer, x)[::2]:  # hessian: one rank-local call each
        try:
            case()
            messages.append(None)
        except RuntimeError as exc:
            messages.append(str(exc))
    return name, messages


@pytest.mark.parametrize("kind", ["act", "plain"])
def test_group2_create_graph_raises_when_synchronized(pool, kind):
    """Group 2: the synchronized paths (W = 2) raise on every rank alike."""
    for name, messages in pool.run(double_backward_job, kind)[:2]:
        assert all(m is not None and m.startswith(f"{name}: higher-order gradients") for m in messages), messages


def _transformed(layer, how, x):
    from torch.autograd import forward_ad

    if how == "grad":
        return torch.func.grad(lambda t: (layer(t).square() * t).sum())(x)
    if how == "jacrev":
        return torch.func.jacrev(layer)(x[:2])
    if how == "vmap":
        return torch.func.vmap(layer)(torch.stack([x, x * 2 - 1]))
    with forward_ad.dual_level():  # forward-mode AD
        return forward_ad.unpack_dual(layer(forward_ad.make_dual(x, torch.cos(x)))).tangent


@pytest.mark.parametrize("how", ["grad", "jacrev", "vmap", "forward_ad"])
@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.1), ("elu", 1.0), ("identity", 0.0)])
def test_group2_one_process_transforms_in_training_are_batchnorm_and_activation(how, activation, param):
    """Group 2: in one process a training call under a torch.func transform or forward-mode
    AD (which the layer's own autograd Function cannot carry) is torch's BatchNorm2d +
    activation: the same values bit for bit without running statistics (torch.func's
    batch-norm recipe), with them the same torch error or the same buffers. (It raised.)"""
    x = torch.randn(3, 4, 5, 2, dtype=torch.float64) + 0.5
    for track in (False, True):
        ours = _layer(activation, param, track_running_stats=track).double()
        ref = _ref64(ours) if track else nn.Sequential(
            torch_batchnorm(nn.BatchNorm2d, 4, track_running_stats=False).double(),
            torch_activation(activation, param))
        if not track:
            ref[0].load_state_dict(ours.state_dict())
        results = []
        for layer in (ours, ref):
            try:
                results.append(_transformed(layer, how, x))
            except RuntimeError as exc:
                results.append(str(exc))
        if isinstance(results[1], str):
            assert track and results[0] == results[1]  # torch's error for running buffers
            continue
        assert isinstance(results[0], torch.Tensor), results[0]
        assert torch.isfinite(results[0]).all()
        torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
        if track:  # forward-mode AD ran a real training forward: the buffers moved alike
            torch.testing.assert_close(ours.running_mean, ref[0].running_mean, rtol=0, atol=0)
            torch.testing.assert_close(ours.running_var, ref[0].running_var, rtol=0, atol=0)


def test_group2_transforms_are_exact_in_eval():
    """Group 2: eval (plain torch ops) computes torch.func and forward-mode AD exactly."""
    from torch.autograd import forward_ad
    from torch.func import functional_call, grad

    layer = _layer()
    x = torch.randn(3, 4, 5, 2) + 0.5
    params = dict(layer.named_parameters())

    def loss(p, t):
        return functional_call(layer, p, (t,)).square().sum()

    layer.eval()
    ref = _ref64(layer)
    got = grad(loss, argnums=1)(params, x)
    xr = x.double().requires_grad_()
    ref(xr).square().sum().backward()
    _close64(got, xr.grad, 1e-5)
    tangent = torch.randn_like(x)
    with forward_ad.dual_level():
        out = forward_ad.unpack_dual(layer(forward_ad.make_dual(x, tangent))).tangent
        want = forward_ad.unpack_dual(ref(forward_ad.make_dual(x.double(), tangent.double()))).tangent
    _close64(out, want, 1e-5)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_group3_training_forward_in_a_backward_hook_updates_running_stats(momentum):
    """Group 3: a forward run by a tensor hook during backward is a real forward: the
    running statistics and num_batches_tracked move as torch.nn.BatchNorm2d's do."""
    layer = _layer(momentum=momentum)
    ref = _ref64(layer)
    x0 = torch.randn(3, 4, 5, 2) + 0.5
    side = torch.randn(6, 4, 3, 3) * 2 + 1

    def step(module, dtype):
        x = x0.to(dtype).requires_grad_()
        h = x * 2
        h.register_hook(lambda g: (module(side.to(dtype)), None)[1])
        module(h).sum().backward()

    step(layer, torch.float32)
    step(ref, torch.float64)
    bn = ref[0]
    assert int(layer.num_batches_tracked) == int(bn.num_batches_tracked) == 2
    _close64(layer.running_mean, bn.running_mean, 1e-6)
    _close64(layer.running_var, bn.running_var, 1e-6)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_group3_checkpoint_recomputation_moves_running_stats_once(use_reentrant):
    """Group 3: syncbn.checkpoint's recomputation leaves the buffers alone (as without
    checkpointing); a plain torch.utils.checkpoint recomputes as torch.nn.BatchNorm2d
    does under it (buffers moved twice)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    x0 = torch.randn(3, 4, 5, 2) + 0.5

    def step(module, dtype, run):
        x = x0.to(dtype).requires_grad_()
        out = module(x * 1) if run is None else run(module, x * 1, use_reentrant=use_reentrant)
        out.square().sum().backward()
        return module

    for run, ref_run, counted in ((syncbn.checkpoint, None, 1), (torch_checkpoint, torch_checkpoint, 2)):
        layer = step(_layer(momentum=None), torch.float32, run)
        ref = step(_ref64(_layer(momentum=None)), torch.float64, ref_run)[0]
        assert int(layer.num_batches_tracked) == int(ref.num_batches_tracked) == counted
        _close64(layer.running_mean, ref.running_mean, 1e-6)
        _close64(layer.running_var, ref.running_var, 1e-6)


@pytest.mark.parametrize("path", ["local", "general"])
def test_group4_huge_weight_gives_a_finite_exact_input_gradient(monkeypatch, path):
    """Group 4: |w| = 1e20 in float32 (w * w * invstd would overflow)."""
    if path == "general":
        monkeypatch.setattr(batchnorm_act, "_local_kernels_fit", lambda *args: False)
    layer = _layer()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1e20, -1e20, 1.0, 3e19]))
    ref = _ref64(layer)
    x0 = torch.randn(3, 4, 5, 2) + 0.5
    dy = torch.randn_like(x0)
    x = x0.clone().requires_grad_()
    layer(x * 1).backward(dy)
    xr = x0.double().requires_grad_()
    ref(xr).backward(dy.double())
    for c in range(4):  # per channel: their scales differ by 1e20
        _close64(x.grad[:, c], xr.grad[:, c], 1e-4)
    _close64(layer.weight.grad, ref[0].weight.grad, 1e-4)


def test_group7_eval_then_train_then_backward():
    """Group 7: an eval call's backward uses the running statistics of its own call, even
    after a training forward updated them in place (torch.nn.BatchNorm2d would use the
    updated values)."""
    layer = _layer()
    x0 = torch.randn(3, 4, 5, 2) + 0.5
    d1, d2 = torch.randn_like(x0), torch.randn_like(x0)
    # the oracle: each call's gradient taken right after its own forward
    ref = _ref64(layer)
    xr = x0.double().requires_grad_()
    ref.eval()
    ref(xr).backward(d1.double())
    ref.train()
    ref(xr).backward(d2.double())
    x = x0.clone().requires_grad_()
    layer.eval()
    y1 = layer(x)
    layer.train()
    y2 = layer(x * 1)
    ((y1 * d1).sum() + (y2 * d2).sum()).backward()
    _close64(x.grad, xr.grad, 1e-5)
    _close64(layer.running_var, ref[0].running_var, 1e-6)


def test_no_measurement_a_tracing_tool_could_inflate():
    """The issue's seventh group: a first training forward under a tracer that reads every
    frame's locals, or under a dispatch mode that keeps op outputs, once inflated a
    measured baseline for the whole process. Nothing is measured now: later plain calls
    leave their input and a hook-kept gradient alone, and match the float64 reference."""
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    class KeepOutputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kept = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.kept.append(out)
            return out

    def tracer(frame, event, arg):
        frame.f_locals  # noqa: B018 (a debugger reads them)
        return tracer

    layer = _layer()
    x0 = torch.randn(3, 4, 5, 2) + 0.5
    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        layer(x0.clone().requires_grad_() * 1).sum().backward()
    finally:
        sys.settrace(old)
    with KeepOutputs():
        layer(x0.clone().requires_grad_() * 1).sum().backward()
    ref = _ref64(layer)
    x = x0.clone().requires_grad_()
    h = x * 1
    kept = []
    y = layer(h)
    assert torch.equal(h, x0)
    y.register_hook(lambda g: kept.append((g, g.clone())))
    (y * 2).sum().backward()
    (g, at_hook), = kept
    assert torch.equal(g, at_hook)
    xr = x0.double().requires_grad_()
    (ref(xr) * 2).sum().backward()
    _close64(x.grad, xr.grad, 1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "(N, C)"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("path", ["local", "general", "cuda path"])
@pytest.mark.parametrize("inplace", [False, True])
def test_never_hands_functional_batch_norm_a_zero_eps(monkeypatch, layout, dtype, path, inplace):
    """torch 2.10 and 2.11 made ``F.batch_norm`` refuse eps <= 0 in training and in eval
    alike (a GPU run on torch 2.11 raised it inside the fused layer's normalization;
    2.13 refuses it only in training). The layer's own inner normalizations use eps = 0
    on purpose (the variance already holds the user's eps), so they must not go through
    ``F.batch_norm``: here it refuses eps <= 0 as those versions do, and every path,
    layout, dtype and mode of both layers runs forward and backward under it."""
    real = F.batch_norm

    def strict(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
        if eps <= 0.0:
            raise ValueError(f"batch_norm eps must be positive, but got {eps}")
        return real(input, running_mean, running_var, weight, bias, training, momentum, eps)

    monkeypatch.setattr(torch.nn.functional, "batch_norm", strict)
    if path != "local":
        monkeypatch.setattr(batchnorm_act, "_local_kernels_fit", lambda *args: False)
    if path == "cuda path":  # CUDA's choices on the CPU (the statistics kernel's stand-in)
        monkeypatch.setattr(stats, "_FORCE_CUDA_PATH", True)
    gen = torch.Generator().manual_seed(11)
    shape = (6, 4) if layout == "(N, C)" else (3, 4, 5, 6)
    for offset in (0.5, 1e3):  # near zero the one-pass kernel runs, far from it the centered path
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) + offset).to(dtype)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        pdtype = torch.float32 if dtype == torch.bfloat16 else dtype  # half inputs, float32 parameters
        for layer in (syncbn.SyncBatchNormAct(4, "leaky_relu", 0.1, dtype=pdtype, inplace=inplace),
                      syncbn.SyncBatchNorm(4, dtype=pdtype)):
            for training in (True, False):
                layer.train(training)
                src = x.clone().requires_grad_()
                y = layer(src * 1)
                assert torch.isfinite(y).all()
                (g,) = torch.autograd.grad(y.float().square().sum(), src)
                assert torch.isfinite(g).all() and g.dtype == dtype


@pytest.mark.parametrize("layer_dtype,input_dtype", [
    (torch.float64, torch.float32), (torch.float32, torch.float64), (torch.bfloat16, torch.float16),
    (torch.float32, torch.bfloat16),
], ids=str)
def test_training_takes_the_dtype_mixes_batchnorm_takes(layer_dtype, input_dtype):
    """In training the layer refuses the mixes of layer and input dtype that BatchNorm (and
    the layer itself in eval mode) refuses on the CPU, instead of computing them."""
    x = torch.randn(4, 3, 5).to(input_dtype)
    layer = syncbn.SyncBatchNormAct(3, "leaky_relu", 0.1, dtype=layer_dtype)
    try:
        expected = nn.LeakyReLU(0.1)(nn.BatchNorm1d(3, dtype=layer_dtype)(x))
    except RuntimeError:
        with pytest.raises(RuntimeError, match="SyncBatchNormAct: mixed dtype"):
            layer(x)
        assert int(layer.num_batches_tracked) == 1  # counted before the refusal, as torch.nn does
        return
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize("path", ["local", "general"])
@pytest.mark.parametrize("dtype,slope", [(torch.float64, 1e-310), (torch.float32, 1e-40)], ids=["float64", "float32"])
def test_slope_too_small_for_its_reciprocal_matches_leaky_relu(monkeypatch, path, dtype, slope):
    """A negative slope below 1 / max of the dtype, which torch's LeakyReLU takes: 1 / slope
    overflows (inf in float64 gave NaN gradients; float32 raised), so the negative side is
    inverted by dividing by the slope.

    Tolerances: the negative outputs ``z * slope`` are subnormal, rounded to within half
    their spacing (2**-1075 in float64, 2**-150 in float32), so the recovered ``z`` is off
    by at most 2**-1075 / 1e-310 ~ 2.5e-14 (float64) or 2**-150 / 1e-40 ~ 7e-6 (float32),
    and ``xhat`` by that over |w| >= 0.5: ~5e-14 and ~1.4e-5, entering the gradients at
    order one next to their largest value, beside float32's own rounding (~1e-6 over 30
    values a channel). Relative to each reference's largest value: 1e-11 (float64, >100x
    margin) and 1e-4 (float32, ~7x)."""
    taken = []
    fit = batchnorm_act._local_kernels_fit
    monkeypatch.setattr(batchnorm_act, "_local_kernels_fit",
                        lambda *args: taken.append(path) or (path == "local" and fit(*args)))
    layer = _layer("leaky_relu", slope).to(dtype)
    ref = _ref64(layer)
    gen = torch.Generator().manual_seed(3)
    x0 = (torch.randn(3, 4, 5, 2, generator=gen) + 0.3).to(dtype)
    dy = torch.randn(x0.shape, generator=gen).to(dtype)
    x = x0.clone().requires_grad_()
    y = layer(x * 1)
    y.backward(dy)
    xr = x0.double().requires_grad_()
    yr = ref(xr)
    yr.backward(dy.double())
    assert taken == [path] and (path == "general" or fit(x0, layer.weight, layer.bias, "leaky_relu", slope))
    tol = 1e-11 if dtype == torch.float64 else 1e-4
    _close64(y, yr, tol)
    _close64(x.grad, xr.grad, tol)
    _close64(layer.weight.grad, ref[0].weight.grad, tol)
    _close64(layer.bias.grad, ref[0].bias.grad, tol)
    _close64(layer.running_var, ref[0].running_var, tol)


@pytest.mark.parametrize("param", [np.float32(0.25), np.float64(0.25), np.int64(2)], ids=repr)
@pytest.mark.parametrize("activation", ["leaky_relu", "elu"])
def test_numpy_scalar_activation_param_is_taken_as_torch_takes_it(activation, param):
    """numpy scalars (np.float32 is no Python float) are accepted, as nn.LeakyReLU and
    nn.ELU accept them, with the value torch uses; a bool or a tensor is refused with its type."""
    layer = syncbn.SyncBatchNormAct(3, activation, param).double()
    assert type(layer.activation_param) is float and layer.activation_param == float(param)
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    ref = nn.Sequential(nn.BatchNorm1d(3), torch_activation(activation, param)).double()
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-12, atol=1e-12)
    for bad, name in ((True, "bool"), (torch.tensor(0.25), "Tensor")):
        with pytest.raises(ValueError, match=rf"finite real number, got .* \({name}\)"):
            syncbn.SyncBatchNormAct(3, activation, bad)
