"""syncbn.SyncBatchNorm against the float64 oracle on real gloo processes, and its
module contract (constructor, state_dict, equality with torch.nn.BatchNorm*d)."""

import itertools
import random
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import syncbn
from bn_oracle import Case, check_case, run_case
from torch_compat import torch_batchnorm

DTYPE_NAMES = ["float32", "float64", "bfloat16", "float16"]


def _grid():
    """Every world size x input rank x dtype, with the other options cycled through."""
    rng = random.Random(7)
    cycle = itertools.count()
    cases = []
    for world, ndim, dtype in itertools.product([1, 2, 3, 4], [2, 3, 4, 5], DTYPE_NAMES):
        i = next(cycle)
        tail = {2: (), 3: (7,), 4: (5, 4), 5: (3, 4, 2)}[ndim]
        sizes = [rng.randint(0, 4) for _ in range(world)]
        if world > 1 and i % 2 == 0:
            sizes[rng.randrange(world)] = 0  # an empty rank
        # at least 4 values per channel: with 2 or 3 the float32 gradient is ill-conditioned
        # (x-hat is +-1 and dx cancels to ~0) for torch.nn itself, not a test of syncbn
        span = 1
        for d in tail:
            span *= d
        while sum(sizes) * span < 4:
            sizes[-1] += 1
        half = dtype in ("bfloat16", "float16")
        cases.append(
            Case(
                world=world,
                sizes=tuple(sizes),
                tail=tail,
                channels=[3, 5, 1, 8][i % 4],
                dtype=dtype,
                param_dtype=("float32" if i % 3 else None) if half else None,
                channels_last=ndim >= 4 and i % 2 == 1,
                affine=i % 5 != 0,
                bias=i % 7 != 3,
                momentum=None if i % 3 == 0 else [0.1, 0.5][i % 2],
                track=i % 6 != 1,
                steps=3,
                seed=i,
            )
        )
    return cases


GRID = _grid()


@pytest.mark.parametrize("case", GRID, ids=lambda c: f"W{c.world}-{c.ndim}d-{c.dtype}-{c.sizes}")
def test_matches_oracle(pool, case):
    check_case(case, pool.run(run_case, case))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_no_input_grad(pool, world):
    case = Case(world=world, sizes=(3,) * world, input_grad=False, dtype="float64")
    check_case(case, pool.run(run_case, case))


@pytest.mark.parametrize("sizes,frozen", [((4, 3), (0,)), ((3, 0, 2), (1,)), ((2, 3, 1), (0, 2))])
def test_ranks_differ_in_whether_the_input_needs_a_gradient(pool, sizes, frozen):
    """A rank whose input needs no gradient (the weight's only) still takes part in the
    backward all-reduce; the others' input gradients are the single device's."""
    case = Case(world=len(sizes), sizes=sizes, frozen_inputs=frozen, dtype="float64")
    check_case(case, pool.run(run_case, case))


def test_single_element_ranks(pool):
    """Every rank holds one element per channel; together they have enough."""
    case = Case(world=4, sizes=(1, 1, 0, 1), tail=(), dtype="float64")
    check_case(case, pool.run(run_case, case))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world=st.integers(2, 4),
    total=st.integers(4, 12),
    tail=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    channels=st.integers(1, 6),
    cuts=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    seed=st.integers(0, 10_000),
)
def test_random_splits_of_one_batch(pool, world, total, tail, channels, cuts, seed):
    """Any split of one global batch across ranks gives the one-device result."""
    points = sorted(int(c * total) for c in cuts[: world - 1])
    sizes = [b - a for a, b in zip([0] + points, points + [total])]
    case = Case(world=world, sizes=tuple(sizes), tail=tuple(tail), channels=channels, seed=seed, steps=2)
    check_case(case, pool.run(run_case, case))


# Inputs of more than 5 dims, which torch.nn.SyncBatchNorm takes (any rank from 2): one
# rank and several, empty ranks, every dtype, and strides other than the standard ones
# (channels fastest in memory; spatial dims that do not merge without a copy)
HIGH_RANK = [
    Case(world=1, sizes=(3,), tail=(2, 3, 2, 2), channels=3, dtype="float32"),
    Case(world=2, sizes=(2, 3), tail=(2, 1, 3, 2), channels=4, dtype="float64", momentum=None),
    Case(world=3, sizes=(2, 0, 3), tail=(3, 2, 1, 2, 2), channels=2, dtype="float32", seed=1),
    Case(world=2, sizes=(3, 2), tail=(2, 2, 3, 2), dtype="bfloat16", param_dtype="float32", seed=2),
    Case(world=4, sizes=(1, 2, 0, 2), tail=(2, 3, 2, 2), dtype="float16", affine=False, seed=3),
    Case(world=2, sizes=(3, 2), tail=(2, 3, 2, 2), dtype="float32", strides="channels_inner", seed=4),
    Case(world=3, sizes=(2, 2, 1), tail=(3, 2, 2, 2), dtype="float64", strides="spatial_reversed", track=False,
         seed=5),
    Case(world=1, sizes=(4,), tail=(2, 3, 2, 2), dtype="float32", strides="spatial_reversed", seed=6),
    Case(world=3, sizes=(2, 3, 2), tail=(2, 2, 2, 2), dtype="float32", frozen_inputs=(1,), seed=7),
]


def _high_rank_name(case):
    return f"W{case.world}-{case.ndim}d-{case.dtype}-{case.strides}-{case.sizes}"


@pytest.mark.parametrize("case", HIGH_RANK, ids=_high_rank_name)
def test_inputs_of_more_than_five_dims_match_oracle(pool, case):
    """The layer normalizes (N, C, *) inputs of 6 and 7 dims as torch.nn.SyncBatchNorm does
    (it refused them): training, backward, buffers and eval against the float64 oracle."""
    check_case(case, pool.run(run_case, case))


# ---- module contract, single process -------------------------------------------------


def test_constructor_signature_matches_torch():
    import inspect

    ours = inspect.signature(syncbn.SyncBatchNorm.__init__).parameters
    theirs = inspect.signature(nn.SyncBatchNorm.__init__).parameters
    if "bias" not in theirs:  # a torch without the bias argument (2.11): ours takes it anyway
        assert ours["bias"].default is True
        ours = {name: p for name, p in ours.items() if name != "bias"}
    assert list(ours) == list(theirs)
    for name in theirs:
        assert ours[name].default == theirs[name].default, name
        assert ours[name].kind == theirs[name].kind, name


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d])
def test_state_dict_loads_both_ways(cls):
    ref = cls(6)
    ref.train()
    shape = {nn.BatchNorm1d: (4, 6, 3), nn.BatchNorm2d: (4, 6, 3, 3), nn.BatchNorm3d: (4, 6, 2, 3, 3)}[cls]
    ref(torch.randn(shape) + 3)
    ours = syncbn.SyncBatchNorm(6)
    ours.load_state_dict(ref.state_dict())
    back = cls(6)
    back.load_state_dict(ours.state_dict())
    for (k1, v1), (k2, v2) in zip(ref.state_dict().items(), back.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    assert list(ours.state_dict()) == list(nn.BatchNorm2d(6).state_dict())
    no_bias = syncbn.SyncBatchNorm(6, bias=False)
    assert no_bias.bias is None and list(no_bias.state_dict()) == list(torch_batchnorm(nn.BatchNorm2d, 6, bias=False).state_dict())


def _torch_module_inputs(cls):
    common = pytest.importorskip("torch.testing._internal.common_modules")
    info = next(m for m in common.module_db if m.module_cls is cls)
    return info


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("training", [True, False])
def test_same_as_torch_on_torch_module_inputs(cls, dtype, training):
    """On every sample input of torch's own module tests, the same outputs and grads."""
    info = _torch_module_inputs(cls)
    inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=training)
    assert inputs
    for sample in inputs:
        args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
        ref = cls(*args, **kwargs).to(dtype)
        ours = syncbn.SyncBatchNorm(*args, **kwargs).to(dtype)
        with torch.no_grad():
            for p in ref.parameters():
                p.uniform_(0.5, 1.5)
        ours.load_state_dict(ref.state_dict())
        ref.train(training)
        ours.train(training)
        (x,) = sample.forward_input.args
        for _ in range(2):
            xr = x.detach().clone().requires_grad_()
            xo = x.detach().clone().requires_grad_()
            yr, yo = ref(xr), ours(xo)
            torch.testing.assert_close(yo, yr, rtol=0, atol=0)
            if yr.numel():
                dy = torch.randn_like(yr)
                yr.backward(dy)
                yo.backward(dy)
                torch.testing.assert_close(xo.grad, xr.grad, rtol=0, atol=0)
        for (k1, v1), (k2, v2) in zip(ref.state_dict().items(), ours.state_dict().items()):
            assert k1 == k2
            torch.testing.assert_close(v2, v1, rtol=0, atol=0, equal_nan=True)
        for p_ref, p_ours in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(p_ours.grad, p_ref.grad, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d])
def test_same_errors_as_torch_on_torch_error_inputs(cls):
    info = _torch_module_inputs(cls)
    if info.module_error_inputs_func is None:  # torch 2.4's module_db lists none for batch norm
        pytest.skip(f"this torch lists no error inputs for {cls.__name__}")
    errors = info.module_error_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=False, training=True)
    assert errors
    for err in errors:
        sample = err.module_error_input
        ours = syncbn.SyncBatchNorm(*sample.constructor_input.args, **sample.constructor_input.kwargs)
        with pytest.raises(err.error_type, match=err.error_regex):
            ours(*sample.forward_input.args)


def test_bad_input_names_the_problem():
    bn = syncbn.SyncBatchNorm(4)
    with pytest.raises(ValueError, match="at least 2D input"):
        bn(torch.randn(4))
    with pytest.raises(RuntimeError, match="expected 4 channels"):
        bn(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="number of input channels should be non-zero"):
        bn(torch.randn(2, 0, 5))
    with pytest.raises(TypeError, match="floating-point"):
        bn(torch.ones(2, 4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(torch.randn(1, 4))


def _outcome(layer, x):
    """The output, or the class of the error the call raised."""
    try:
        return layer(x)
    except Exception as err:  # noqa: BLE001 - the class is the result
        return type(err)


_SHAPE_CASES = [  # layer channels, input shape
    (4, (3, 3, 5)), (4, (3, 5, 2, 2)), (0, (3, 4, 5)), (4, (3, 0, 5)), (0, (3, 0, 5)), (4, (4,)),
    (4, (2, 4, 2, 1, 2, 3)),
]


@pytest.mark.parametrize("cls", [syncbn.SyncBatchNorm, syncbn.SyncBatchNormAct])
@pytest.mark.parametrize("channels,shape", _SHAPE_CASES, ids=str)
@pytest.mark.parametrize("affine,track", [(True, True), (False, True), (True, False), (False, False)])
@pytest.mark.parametrize("training", [True, False])
def test_shape_errors_are_torchs(cls, channels, shape, affine, track, training):
    """A channel count other than the layer's, an input without channels or of one dim,
    with or without affine parameters and running statistics, training or eval: the
    layer raises the class torch.nn.SyncBatchNorm raises (RuntimeError for the channel
    count, where it was ValueError; ValueError for no channels, where SyncBatchNorm(0)
    raised an IndexError), and computes what torch computes where torch raises nothing (a
    layer without per-channel tensors takes any channel count; it raised)."""
    torch.manual_seed(0)
    x = torch.randn(shape) * 2 + 1
    ref = nn.SyncBatchNorm(channels, affine=affine, track_running_stats=track).train(training)
    ours = cls(channels, affine=affine, track_running_stats=track).train(training)
    if cls is syncbn.SyncBatchNormAct:  # the activation after torch's layer
        ours.activation = "identity"
    expected, got = _outcome(ref, x), _outcome(ours, x)
    if isinstance(expected, type):
        assert got is expected, (got, expected)
    else:
        assert isinstance(got, torch.Tensor), got
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [syncbn.SyncBatchNorm, syncbn.SyncBatchNormAct])
@pytest.mark.parametrize("make", [
    lambda: torch.ones(2, 4, 3, dtype=torch.int64), lambda: torch.ones(2, 4, 3, dtype=torch.bool),
    lambda: torch.ones(2, 4, 3, dtype=torch.complex64), lambda: [[1.0] * 3] * 4, lambda: None,
], ids=["int64", "bool", "complex64", "list", "None"])
@pytest.mark.parametrize("training", [True, False])
def test_input_type_errors_are_torchs_and_name_the_problem(cls, make, training):
    """An input of a dtype no batch norm computes in, or no tensor at all: the error is
    one torch.nn.SyncBatchNorm's code can catch (its NotImplementedError / AttributeError,
    in both modes) and a TypeError naming what was wrong."""
    try:
        nn.SyncBatchNorm(4).train(training)(make())
    except Exception as err:  # noqa: BLE001 - the class is the result
        torchs = type(err)
    else:
        raise AssertionError("torch's layer took the input")
    with pytest.raises(torchs) as caught:
        cls(4).train(training)(make())
    assert isinstance(caught.value, TypeError)
    assert re.search(r"expected a (floating-point input|torch.Tensor input)", str(caught.value)), caught.value


def test_a_weight_held_as_a_plain_attribute_still_sets_the_channel_count():
    """The channel check asks whether the layer holds a per-channel tensor; a weight kept
    as a plain attribute (as FSDP1 keeps the views of its flat parameter), not a
    registered parameter, counts, and without any the layer takes any channel count."""
    torch.manual_seed(3)
    x = torch.randn(4, 3, 5) * 2 + 1
    layer = syncbn.SyncBatchNorm(4, track_running_stats=False)
    del layer.weight, layer.bias
    layer.weight, layer.bias = torch.ones(4), None  # plain attributes now
    assert "weight" not in layer._parameters
    with pytest.raises(RuntimeError, match="expected 4 channels"):
        layer(x)
    layer.weight = None
    torch.testing.assert_close(layer(x), nn.functional.batch_norm(x, None, None, training=True), rtol=0, atol=0)


class _OwnSyncBatchNorm(syncbn.SyncBatchNorm):
    """A user's subclass, defined in this module."""


def test_script_refusal_names_the_class_where_it_is_defined():
    """torch.jit.script refuses every syncbn layer; the message names syncbn's two layers
    by their public names and any other class (timm's converted layer, a user's subclass)
    by its module, not as a syncbn.<name> that does not exist."""
    from syncbn.torch.timm import SyncBatchNormDropAct

    layers = {"syncbn.SyncBatchNorm": syncbn.SyncBatchNorm(3), "syncbn.SyncBatchNormAct": syncbn.SyncBatchNormAct(3),
              "syncbn.torch.timm.SyncBatchNormDropAct": SyncBatchNormDropAct(3),
              f"{__name__}._OwnSyncBatchNorm": _OwnSyncBatchNorm(3)}
    for name, layer in layers.items():
        with pytest.raises(RuntimeError) as info:
            torch.jit.script(nn.Sequential(nn.Conv2d(3, 3, 1), layer))
        assert str(info.value).startswith(f"{name} cannot be compiled by torch.jit.script"), str(info.value)


def test_nan_and_inf_propagate_like_torch():
    x = torch.randn(4, 3, 5) + 2
    x[0, 1, 2] = float("nan")
    x[1, 2, 0] = float("inf")
    ref, ours = nn.BatchNorm1d(3), syncbn.SyncBatchNorm(3)
    # no group: the layer runs F.batch_norm itself, the same kernel on both sides (equal)
    torch.testing.assert_close(ours(x), ref(x), equal_nan=True)
    torch.testing.assert_close(ours.running_var, ref.running_var, equal_nan=True)


def test_eval_without_group_uses_running_stats():
    bn = syncbn.SyncBatchNorm(3, momentum=None)
    for _ in range(3):
        bn(torch.randn(6, 3, 4) * 2 + 5)
    assert int(bn.num_batches_tracked) == 3
    bn.eval()
    x = torch.randn(2, 3, 4)
    expected = (x - bn.running_mean.view(1, 3, 1)) / torch.sqrt(bn.running_var.view(1, 3, 1) + bn.eps)
    # float32: the kernel's x * a + b against (x - m) / sqrt(v + eps), |x| <~ 4, |m| ~ 5, v ~ 4:
    # a few roundings of u = 6e-8 times values of size <~ 5, ~1e-6; default atol 1e-5 (+ rtol 1.3e-6)
    torch.testing.assert_close(bn(x), expected)


# layer dtype, input dtype: the mixes torch's CPU batch norm refuses, and two it takes
_DTYPE_MIXES = [
    (torch.float64, torch.float32), (torch.float32, torch.float64), (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float16), (torch.float64, torch.bfloat16),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
]


def _train_once(layer, input_dtype):
    """'ok' and the output's dtype, or the error's type, after one training call."""
    try:
        return "ok", layer(torch.randn(4, 3, 2).to(input_dtype)).dtype
    except RuntimeError as err:
        return "RuntimeError", str(err)


def _dtype_mix_job(layer_dtype, input_dtype):
    return _train_once(syncbn.SyncBatchNorm(3, dtype=layer_dtype), input_dtype)


@pytest.mark.parametrize("layer_dtype,input_dtype", _DTYPE_MIXES, ids=str)
def test_synchronized_training_takes_the_dtype_mixes_torch_takes(pool, layer_dtype, input_dtype):
    """Across ranks the layer refuses what torch.nn.BatchNorm1d (and the layer itself in one
    process) refuses, before any collective; it used to compute any mix, so a model trained
    distributed and failed alone or in eval."""
    expected = _train_once(nn.BatchNorm1d(3, dtype=layer_dtype), input_dtype)
    alone = _train_once(syncbn.SyncBatchNorm(3, dtype=layer_dtype), input_dtype)
    ranks = pool.run(_dtype_mix_job, layer_dtype, input_dtype)
    for got in [alone, *ranks]:
        assert got[0] == expected[0], (got, expected)
        if got[0] == "ok":
            assert got[1] == expected[1] == input_dtype
    if expected[0] != "ok":
        assert all("mixed dtype" in message and "SyncBatchNorm" in message for _, message in ranks)
    # and the group is fine afterwards
    assert pool.run(_dtype_mix_job, torch.float32, torch.float32) == [("ok", torch.float32)] * len(ranks)


class _TwoNorms(nn.Module):
    """A small model whose batch norm is called twice (a shared layer) between other modules."""

    def __init__(self, norm):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 4, 1), norm

    def forward(self, x):
        return self.norm(self.norm(self.conv(x)) * 2)


@pytest.mark.parametrize("cls", [syncbn.SyncBatchNorm, syncbn.SyncBatchNormAct])
@pytest.mark.parametrize("training", [True, False])
def test_fx_symbolic_trace_records_the_layer_as_torchs_batch_norm(cls, training):
    """torch.fx.symbolic_trace keeps torch.nn's batch norms whole (call_module nodes) and
    traces into modules defined elsewhere: through syncbn's layers it raised (the input
    check refused the Proxy). Now each call is one call_module node, as for BatchNorm2d;
    tracing leaves the running buffers and the batch count alone, and the traced module
    computes what the model computes (the same calls of the same modules)."""
    torch.manual_seed(0)
    model = _TwoNorms(cls(4)).train(training)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    traced = torch.fx.symbolic_trace(model)
    reference = torch.fx.symbolic_trace(_TwoNorms(nn.BatchNorm2d(4)))
    assert [(n.op, n.target) for n in traced.graph.nodes] == [(n.op, n.target) for n in reference.graph.nodes]
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    twin = _TwoNorms(cls(4)).train(training)
    twin.load_state_dict(before)
    x = torch.randn(5, 3, 6, 6)
    torch.testing.assert_close(traced(x), twin(x), rtol=0, atol=0)
    for (key, got), want in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=key)


def test_fx_symbolic_trace_of_the_layer_itself_or_a_subclass_with_more_forward_still_refuses():
    """Only a call of the layer as a submodule becomes a node: the traced root itself has
    no name to call it by, and a user's subclass whose own forward adds work is not
    syncbn's to declare a leaf (its forward may call what the user wants traced); both
    raise as before, naming the Proxy. (timm's converted BatchNormAct2d,
    SyncBatchNormDropAct, declares itself one node: test_timm.)"""
    from syncbn.torch.timm import SyncBatchNormDropAct

    class WithRelu(syncbn.SyncBatchNorm):
        def forward(self, input):
            return torch.relu(super().forward(input))

    class DropActMore(SyncBatchNormDropAct):
        def forward(self, input):
            return super().forward(input) * 2

    for model in (syncbn.SyncBatchNorm(4), nn.Sequential(WithRelu(4)), nn.Sequential(DropActMore(4))):
        with pytest.raises(TypeError, match="Proxy"):
            torch.fx.symbolic_trace(model)
