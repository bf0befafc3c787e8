"""The Triton kernels of the CUDA path (syncbn.torch.kernels), run on the CPU through
Triton's interpreter: against the float64 oracle and the torch-op CUDA path, every layout,
dtype, input rank and rank count, through the layers (the autograd Functions, the
fingerprint, the running buffers) and alone.

The interpreter must be chosen before Triton is first imported (``TRITON_INTERPRET=1``),
so these tests run in a pool of their own, spawned with that variable; the session's
pool and this process never import Triton. Tiny shapes: the interpreter runs each
program in Python.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from syncbn.torch import kernels  # noqa: E402 (imports no Triton)

# read from Triton's package metadata: importing Triton here would fix this process as compiling.
# The layers take the kernels from kernels.MIN_TRITON (3.4, the [triton] extra's floor). torch
# 2.4's wheels bring Triton 3.0, whose interpreter cannot run these kernels: it takes their
# annotations (strings, "tl.constexpr") for no constexpr, and cannot apply ~ to a mask (no
# get_int1_ty); its compiler builds them (test_kernels_compile.py)
if kernels._triton_version() is None:
    pytest.skip("Triton is not installed", allow_module_level=True)
if kernels._triton_version() < kernels.MIN_TRITON:
    pytest.skip(f"Triton {kernels._triton_version()}'s interpreter cannot run the kernels (the [triton] extra "
                "asks for >= 3.4)", allow_module_level=True)

from bn_oracle import TOL, Case, check_case, run_case  # noqa: E402
from test_batchnorm import GRID  # noqa: E402
from triton_pool import interpreting_pool  # noqa: E402
from test_batchnorm_act import ActCase, check_act_case, elu_edge_case, run_act_case  # noqa: E402
from test_batchnorm_act import _grid as act_grid  # noqa: E402
from workers import group_of, in_group  # noqa: E402


@pytest.fixture(scope="module")
def triton_pool():
    """4 gloo ranks whose Triton interprets kernels (CPU tensors)."""
    pool = interpreting_pool(4)
    yield pool
    pool.close()


class _Launches:
    """Counts the kernel launches of a block by wrapping the launchers."""

    NAMES = ("moment_partials", "moment_payload", "merge", "normalize", "grad_partials", "grad_payload",
             "input_grad")

    def __enter__(self):
        from syncbn.torch import kernels

        self.kernels, self.calls, self.saved = kernels, {n: 0 for n in self.NAMES}, {}
        for name in self.NAMES:
            self.saved[name] = getattr(kernels, name)

            def counted(*args, _name=name, **kwargs):
                self.calls[_name] += 1
                return self.saved[_name](*args, **kwargs)

            setattr(kernels, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.kernels, name, fn)


def kernel_case_job(case, path="triton"):
    """bn_oracle's run_case (SyncBatchNorm; ActCase: SyncBatchNormAct) on the forced
    Triton path (``path="cuda"``: the torch-op CUDA path), with the kernel calls made."""
    from syncbn.torch import kernels, stats

    assert kernels.available("cpu"), "the pool's Triton does not interpret"
    forced = stats._forced_triton_path() if path == "triton" else stats._forced_cuda_path()
    with _Launches() as launches, forced:
        result = run_act_case(case) if isinstance(case, ActCase) else run_case(case)
    if result is not None:
        result["launches"] = launches.calls
    return result


def _ran_kernels(results, case):
    """Every rank with rows ran every kernel. An empty rank, of SyncBatchNorm or of
    SyncBatchNormAct, stays on the kernels' path too (batchnorm_act._triton_forward and
    _triton_backward, as functional's): it launches the merge kernel alone, on the group's
    summed moments, and sends its empty payload (the fingerprint's values, then zeros:
    functional._empty_payload) in both all-reduces."""
    for size, r in zip(case.sizes, results[: case.world]):
        calls = r["launches"]
        if size:
            assert all(calls[name] > 0 for name in _Launches.NAMES), calls
        else:
            assert calls["merge"] > 0 and all(calls[name] == 0 for name in _Launches.NAMES if name != "merge"), calls


def _name(case):
    layout = "cl" if case.channels_last else "std"
    return f"W{case.world}-{case.ndim}d-{case.dtype}-{layout}-{case.sizes}"


# SyncBatchNorm's oracle grid (test_batchnorm.py: every world size, input rank and dtype,
# both layouts, empty ranks, options cycled) where it synchronizes (W > 1)
@pytest.mark.parametrize("case", [c for c in GRID if c.world > 1], ids=_name)
def test_sync_batch_norm_on_kernels_matches_oracle(triton_pool, case):
    """Output, input gradient, summed weight and bias gradients, running buffers and eval
    output against float64 batch norm on the concatenation (bn_oracle's tolerances)."""
    results = triton_pool.run(kernel_case_job, case)
    _ran_kernels(results, case)
    check_case(case, results)


def test_channels_last_3d_on_kernels_matches_oracle(triton_pool):
    case = Case(world=3, sizes=(2, 0, 3), tail=(2, 3, 2), channels=5, dtype="float16", param_dtype="float32",
                channels_last=True, momentum=None, steps=2, seed=3)
    results = triton_pool.run(kernel_case_job, case)
    _ran_kernels(results, case)
    check_case(case, results)


# Inputs of more than 5 dims reach the kernels as (N, C, L): a view of a dense input (also
# with the channels fastest in memory), a copy where the spatial dims do not merge
HIGH_RANK = [
    Case(world=2, sizes=(2, 3), tail=(2, 3, 1, 2), channels=3, dtype="float32", steps=2),
    Case(world=3, sizes=(2, 0, 2), tail=(2, 1, 2, 1, 2), channels=2, dtype="float16", param_dtype="float32",
         steps=2, seed=1),
    Case(world=2, sizes=(2, 2), tail=(2, 3, 2, 2), dtype="float64", strides="channels_inner", steps=2, seed=2),
    Case(world=2, sizes=(2, 1), tail=(3, 2, 2, 2), dtype="float32", strides="spatial_reversed", steps=2, seed=3),
]


@pytest.mark.parametrize("case", HIGH_RANK, ids=lambda c: f"{_name(c)}-{c.strides}")
def test_more_than_five_dims_on_kernels_match_oracle(triton_pool, case):
    """SyncBatchNorm, then SyncBatchNormAct, on 6-D and 7-D inputs (both refused them): the
    kernels run and the results match the float64 oracle."""
    results = triton_pool.run(kernel_case_job, case)
    _ran_kernels(results, case)
    check_case(case, results)
    act = ActCase(case, "leaky_relu", 0.1)
    results = triton_pool.run(kernel_case_job, act)
    _ran_kernels(results, case)
    check_act_case(act, results)


def _on_kernels(case):
    """Whether the kernels take the activated layer's case (ELU: float32/float64 inputs)."""
    return case.activation != "elu" or case.base.dtype in ("float32", "float64")


# SyncBatchNormAct's oracle grid (test_batchnorm_act.py) for the kernels' activations
@pytest.mark.parametrize("case", [c for c in act_grid() if _on_kernels(c)],
                         ids=lambda c: f"{_name(c.base)}-{c.activation}")
def test_act_grid_on_kernels_matches_oracle(triton_pool, case):
    results = triton_pool.run(kernel_case_job, case)
    _ran_kernels(results, case.base)
    check_act_case(case, results)


@pytest.mark.parametrize("path", ["triton", "cuda"])
@pytest.mark.parametrize("activation", [None, "leaky_relu", "elu"])
def test_ranks_differ_in_whether_the_input_needs_a_gradient(triton_pool, path, activation):
    """A rank whose input needs no gradient still makes the backward all-reduce on the
    kernels and the torch-op CUDA path (else the others wait, or gloo pairs wrongly)."""
    base = Case(world=3, sizes=(3, 2, 0), frozen_inputs=(1,), channels=4, dtype="float32", steps=2, seed=5)
    if activation is None:
        check_case(base, triton_pool.run(kernel_case_job, base, path))
    else:
        case = ActCase(base, activation, 0.1 if activation == "leaky_relu" else 1.0)
        check_act_case(case, triton_pool.run(kernel_case_job, case, path))


def test_half_elu_takes_the_torch_op_path(triton_pool):
    """float16/bfloat16 ELU keeps nearly every channel's input under half's budgets (more
    than the kernels' buffer holds): it takes the torch-op path, no kernel launched."""
    case = next(c for c in act_grid() if not _on_kernels(c) and all(c.base.sizes))
    results = triton_pool.run(kernel_case_job, case)
    assert all(sum(r["launches"].values()) == 0 for r in results[: case.base.world])
    check_act_case(case, results)


ACT_CASES = [
    ActCase(Case(world=2, sizes=(3, 2), tail=(3, 4), channels=4, dtype="float32", channels_last=True, steps=2),
            "leaky_relu", 0.2),
    ActCase(Case(world=3, sizes=(2, 3, 1), tail=(5,), channels=3, dtype="float64", steps=2), "identity", 0.01),
    ActCase(Case(world=2, sizes=(2, 2), tail=(2, 3, 2), channels=3, dtype="bfloat16", param_dtype="float32",
                 channels_last=True, steps=2), "leaky_relu", 0.01),
    ActCase(Case(world=2, sizes=(4, 3), tail=(), channels=5, dtype="float16", param_dtype="float32", steps=2,
                 momentum=None), "leaky_relu", 1.5),
    ActCase(Case(world=1, sizes=(4,), tail=(3, 3), channels=3, dtype="float32", steps=2), "leaky_relu", 0.01),
    # an empty rank on the kernels' path beside ranks with rows: the merge kernel alone, and
    # zero sums in both all-reduces
    ActCase(Case(world=3, sizes=(2, 0, 3), tail=(4, 3), channels=3, dtype="float32", steps=2), "leaky_relu", 0.1),
]


@pytest.mark.parametrize("case", ACT_CASES, ids=lambda c: f"{_name(c.base)}-{c.activation}")
def test_sync_batch_norm_act_on_kernels_matches_oracle(triton_pool, case):
    results = triton_pool.run(kernel_case_job, case)
    _ran_kernels(results, case.base)
    check_act_case(case, results)


# weights where x-hat is lost (0) or badly conditioned next to the bias, negative weights
HARD_WEIGHT = (0.0, -0.7, 1e-6, 3e-4, 1.2, -1e-3, 1e-30)
HARD_BIAS = (0.5, 0.3, 2.0, 1.5, -0.2, -3.0, 0.0)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("activation", ["leaky_relu", "identity"])
def test_act_kernels_keep_hard_channels_exactly(triton_pool, dtype, activation):
    """Channels whose x-hat the output cannot give back (w = 0, |w| << |b|) are chosen on
    the device and their inputs kept by the normalizing kernel: exact gradients, with dy
    correlated with x-hat (where a recovered x-hat would show its error)."""
    # 64 channels (room for 4 kept): the 7 above, then ordinary ones; 4 of them are hard
    base = Case(world=3, sizes=(3, 2, 2), tail=(2, 3), channels=64, dtype=dtype, steps=2, seed=5,
                param_dtype="float32" if dtype == "bfloat16" else None)
    rest = 64 - len(HARD_WEIGHT)
    weight = HARD_WEIGHT + tuple(0.5 + (i % 5) / 4 for i in range(rest))
    bias = HARD_BIAS + tuple((i % 7) / 3 - 1 for i in range(rest))
    case = ActCase(base, activation, 0.01, weight=weight, bias=bias, dy_from_x=1.5)
    results = triton_pool.run(kernel_case_job, case)
    _ran_kernels(results, base)
    check_act_case(case, results)


# ELU: channels that saturate (a bias far below zero: channels 0 and 1; channel 4 through
# its negative weight, from the maximum), and one that saturates on one rank only
# (channel 3: an outlier on rank 0), chosen per rank from its own minimum and maximum
ELU_WEIGHT = {"float32": (1.0, -1.0, 0.5, 1.0, -4.0), "float64": (1.0, -1.0, 0.5, 1.0, -8.0)}
ELU_BIAS = {"float32": (-14.0, -14.0, 0.3, -2.5, -6.0), "float64": (-33.0, -33.0, 0.3, -8.0, -16.0)}


def _with_outlier(made):
    def data(case):
        out = made(case)
        for xs, _ in out["steps"]:
            xs[0].view(xs[0].shape[0], xs[0].shape[1], -1)[0, 3, 0] = -40.0
        return out
    return data


def elu_outlier_job(case):
    """kernel_case_job with an outlier (-40) in channel 3 of rank 0's first sample."""
    import test_batchnorm_act

    made = test_batchnorm_act.act_data
    test_batchnorm_act.act_data = _with_outlier(made)
    try:
        return kernel_case_job(case)
    finally:
        test_batchnorm_act.act_data = made


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_elu_kernels_keep_saturating_channels_exactly(triton_pool, dtype, monkeypatch):
    """ELU's channels whose recovered x-hat would amplify rounding past the budget
    (exp(-z_min) / |w|, z_min the rank's most negative pre-activation) keep their inputs,
    chosen on the device from each rank's local extremes: exact gradients, and the
    statistics and buffers of the oracle."""
    import test_batchnorm_act

    base = Case(world=2, sizes=(3, 2), tail=(4, 3), channels=64, dtype=dtype, steps=2, seed=9)
    rest = 64 - len(ELU_WEIGHT[dtype])
    weight = ELU_WEIGHT[dtype] + tuple(0.5 + (i % 5) / 4 for i in range(rest))
    bias = ELU_BIAS[dtype] + tuple((i % 7) / 3 - 1 for i in range(rest))
    case = ActCase(base, "elu", 0.3, weight=weight, bias=bias, dy_from_x=1.5)
    results = triton_pool.run(elu_outlier_job, case)
    _ran_kernels(results, base)
    monkeypatch.setattr(test_batchnorm_act, "act_data", _with_outlier(test_batchnorm_act.act_data))
    check_act_case(case, results)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_elu_kernels_keep_channels_whose_output_rounds_to_minus_alpha(triton_pool, dtype):
    """A large |w| keeps exp(-z_min) / |w| within the budget while ELU's output at z_min is
    -alpha exactly (test_batchnorm_act.elu_edge_case): the merge kernel keeps that channel
    too (exp(-z_min) > 1 / (8 eps)); before, its gradients were NaN."""
    case = elu_edge_case(dtype)
    results = triton_pool.run(kernel_case_job, case)
    _ran_kernels(results, case.base)
    check_act_case(case, results)


def overflow_job(hard: int, world: int = 2, activation: str = "leaky_relu", weight: float = 0.0):
    """SyncBatchNormAct(32) on the kernels: ``hard`` channels with w = ``weight`` (the
    capacity is 32 // 16 = 2). Returns the name of the error raised by the end of the
    backward pass (W = 1: no communication, the check still runs) and its message, or "ok"."""
    import syncbn
    from syncbn.torch import fingerprint, stats

    group = group_of(world)
    if not in_group(world):
        return None
    torch.manual_seed(dist.get_rank())
    layer = syncbn.SyncBatchNormAct(32, activation, process_group=group)
    with torch.no_grad():
        layer.bias.uniform_(-1, 1)
        if activation == "elu":  # saturated: exp(9 + ...) > 2**8
            layer.bias[:hard] = -9.0
        else:
            layer.weight[:hard] = weight
    x = (torch.randn(2, 32, 3, 3) + 2).requires_grad_()
    try:
        with stats._forced_triton_path():
            layer(x).backward(torch.randn(2, 32, 3, 3))
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        fingerprint.reset()
        return type(exc).__name__, str(exc)
    return "ok"


def _raised(results):
    return [r if r == "ok" else r[0] for r in results if r is not None]


def test_act_kernels_raise_when_hard_channels_overflow(triton_pool):
    """More hard channels than the kept buffer holds: the step's check raises on every
    rank (never a silently wrong gradient); as many as it holds: no error."""
    assert _raised(triton_pool.run(overflow_job, 2)) == ["ok", "ok"]
    assert _raised(triton_pool.run(overflow_job, 3)) == ["KeptChannelsOverflow"] * 2
    assert _raised(triton_pool.run(overflow_job, 3, 1)) == ["KeptChannelsOverflow"]
    assert _raised(triton_pool.run(overflow_job, 2, 1)) == ["ok"]


def test_nan_weights_overflow_with_a_message_that_names_them(triton_pool):
    """A NaN weight makes its channel hard (its input cannot be recovered from the
    output): more of them than the buffer holds raise, and the message says that NaN
    counts, not only a weight too small."""
    results = triton_pool.run(overflow_job, 3, 2, "leaky_relu", float("nan"))[:2]
    assert [r[0] for r in results] == ["KeptChannelsOverflow"] * 2
    assert all("a NaN weight or bias" in r[1] for r in results), results[0][1]


def test_elu_kernels_raise_when_saturating_channels_overflow(triton_pool):
    assert _raised(triton_pool.run(overflow_job, 2, 2, "elu")) == ["ok", "ok"]
    assert _raised(triton_pool.run(overflow_job, 3, 2, "elu")) == ["KeptChannelsOverflow"] * 2


def one_rank_overflow_job(outliers: int, input_grad: bool = True, empty_rank: bool = False):
    """SyncBatchNormAct(32, "elu") on the kernels, float32, 4 ranks: only rank 0's data has an
    outlier (-1e4) in its first ``outliers`` channels, so only rank 0's ELU saturates there
    (z_min about -8: exp(8) > 2**8) and only rank 0 runs out of its 2 kept channels when
    ``outliers`` > 2; the others' data (about N(2, 1), z > 0) keep nothing. With
    ``empty_rank`` rank 3 has no samples. Returns the name of the error each rank raised by
    the end of the backward pass, or "ok"."""
    import syncbn
    from syncbn.torch import fingerprint, stats

    torch.manual_seed(dist.get_rank())
    layer = syncbn.SyncBatchNormAct(32, "elu")
    with torch.no_grad():
        layer.bias.zero_()
    x = torch.randn(0 if empty_rank and dist.get_rank() == 3 else 2, 32, 3, 3) + 2
    if dist.get_rank() == 0:
        x[0, :outliers, 0, 0] = -1e4
    x.requires_grad_(input_grad)
    try:
        with stats._forced_triton_path():
            layer(x).backward(torch.randn_like(x))
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        fingerprint.reset()
        return type(exc).__name__
    return "ok"


def test_elu_kernels_raise_on_every_rank_when_one_rank_overflows(triton_pool):
    """ELU's kept channels are chosen per rank (from its own extremes), but the overflow
    rides in the backward all-reduce: when only rank 0 runs out of room (its inexact sums
    already in every rank's input gradient) every rank raises KeptChannelsOverflow at the
    step's check, with or without an input gradient (then the backward all-reduces anyway)
    and with an empty rank; below the capacity no rank raises."""
    assert triton_pool.run(one_rank_overflow_job, 2) == ["ok"] * 4
    assert triton_pool.run(one_rank_overflow_job, 3) == ["KeptChannelsOverflow"] * 4
    assert triton_pool.run(one_rank_overflow_job, 3, False) == ["KeptChannelsOverflow"] * 4
    assert triton_pool.run(one_rank_overflow_job, 3, True, True) == ["KeptChannelsOverflow"] * 4
    assert triton_pool.run(one_rank_overflow_job, 3, False, True) == ["KeptChannelsOverflow"] * 4
    assert triton_pool.run(one_rank_overflow_job, 2, False, True) == ["ok"] * 4


def saved_bytes_job():
    """Bytes saved for backward: the fused layer on the kernels against BatchNorm2d +
    LeakyReLU (the bench's measure), C = 64."""
    import syncbn
    from syncbn.tools.memory import saved_bytes
    from syncbn.torch import stats

    group = group_of(2)
    if not in_group(2):
        return None
    x = (torch.randn(2, 64, 16, 16) + 1).requires_grad_()
    plain = saved_bytes(nn.Sequential(nn.BatchNorm2d(64), nn.LeakyReLU(0.01)), x)
    with stats._forced_triton_path():
        fused = saved_bytes(syncbn.SyncBatchNormAct(64, process_group=group), x)
    return fused, plain


def test_act_kernels_save_at_most_055_of_batchnorm_plus_activation(triton_pool):
    for fused, plain in triton_pool.run(saved_bytes_job)[:2]:
        assert fused / plain <= 0.55, (fused, plain)


def launch_options_job():
    """The ``enable_fp_fusion`` option of every kernel launch of both layers (forward and
    backward, LeakyReLU and ELU), as the launchers hand it to Triton, and the kernels launched."""
    import syncbn
    import triton.runtime.interpreter as interpreter
    from syncbn.torch import stats

    group = group_of(2)
    if not in_group(2):
        return None
    seen = []
    run = interpreter.InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, kwargs.get("enable_fp_fusion")))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = spy
    try:
        with stats._forced_triton_path():
            for layer in (syncbn.SyncBatchNorm(3, process_group=group),
                          syncbn.SyncBatchNormAct(3, activation="leaky_relu", process_group=group),
                          syncbn.SyncBatchNormAct(3, activation="elu", process_group=group)):
                x = torch.randn(2, 3, 4, 4, requires_grad=True)
                layer(x).sum().backward()
    finally:
        interpreter.InterpretedFunction.run = run
    return seen


def test_every_kernel_launch_turns_floating_point_contraction_off(triton_pool):
    """A compiled kernel rounds each operation as the interpreter does (no fused
    multiply-add), whatever Triton's default: every launch says so."""
    for seen in triton_pool.run(launch_options_job)[:2]:
        assert {name for name, _ in seen} >= {f"_{n}_kernel" for n in _Launches.NAMES}, seen
        assert all(fusion is False for _, fusion in seen), seen


@pytest.mark.parametrize("case", [
    Case(world=3, sizes=(3, 0, 2), tail=(4, 3), channels=4, dtype="float64", channels_last=True, steps=2),
    Case(world=2, sizes=(2, 3), tail=(2, 2, 3), channels=3, dtype="float64", steps=2, momentum=None),
], ids=_name)
def test_kernels_match_the_torch_op_path(triton_pool, case):
    """float64: the kernels and torch's ops compute the same formulas (the kernels' sums in
    float64 around another shift): within a few 2^-53 times the element count, 1e-12."""
    ours = triton_pool.run(kernel_case_job, case)[: case.world]
    theirs = triton_pool.run(kernel_case_job, case, "cuda")[: case.world]
    for a, b in zip(ours, theirs):
        for sa, sb in zip(a["steps"], b["steps"]):
            for key in ("y", "dx", "dweight", "dbias"):
                torch.testing.assert_close(sa[key], sb[key], rtol=1e-12, atol=1e-12, msg=key)
        for key, value in b["buffers"].items():
            torch.testing.assert_close(a["buffers"][key], value, rtol=1e-12, atol=1e-12, msg=key)


def far_from_zero_job(ratio: float, layout: str):
    """Emulated W = 2 in one process: each half of a float32 batch packed by the kernels,
    the payloads summed, then merged; the merged mean and variance against float64."""
    from syncbn.torch import fingerprint, kernels, stats

    gen = torch.Generator().manual_seed(7)
    x64 = torch.randn(4, 3, 24, 24, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 0.5, 2.0]).view(
        1, 3, 1, 1).double() + ratio * torch.tensor([1.0, -1.5, 0.75]).view(1, 3, 1, 1).double()
    x = x64.float()
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    fixed = torch.zeros(fingerprint.SIZE, dtype=torch.float64)
    summed = sum(kernels.moment_payload(kernels.moment_partials(part), fixed, part.numel() // 3)
                 for part in (x[:2], x[2:]))
    scalars = stats.kernel_scalars(0.0, "cpu")
    rv = torch.ones(3, dtype=torch.float64)
    stats_c, ok, _, _ = kernels.merge(summed, fixed, scalars, torch.tensor(1.0, dtype=torch.float64), None, rv,
                                      torch.float32)
    ref = x.double()
    var = ref.var(dim=(0, 2, 3), correction=1)
    mean = ref.mean(dim=(0, 2, 3))
    return {"ok": bool(ok), "var": float(((rv - var).abs() / var).max()),
            "mean": float(((stats_c[0].double() + stats_c[1].double() - mean).abs() / var.sqrt()).max())}


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("ratio", [1e3, 1e4])
def test_merged_variance_exact_far_from_zero(triton_pool, ratio, layout):
    """float32 at |mean| / std up to 1e4: merged variance within 1e-6 relative (the bar;
    the kernels' analysis gives ~2^-53 r^2 ~ 1e-8), the mean within 1e-6 std (mean_hi +
    mean_lo; torch's float32 kernel is off by ~u r = 6e-4 std at 1e4)."""
    got = triton_pool.run(far_from_zero_job, ratio, layout)[0]
    assert got["ok"]
    assert got["var"] < 1e-6, got
    assert got["mean"] < 1e-6, got


def mismatch_job():
    """Rank 0 and rank 1 in different layers (other names): both raise at the step's
    check, and neither moves its running buffers."""
    import syncbn
    from syncbn.torch import fingerprint, stats

    group = group_of(2)
    if not in_group(2):
        return None
    layer = syncbn.SyncBatchNorm(3, process_group=group)
    fingerprint.set_layer_name(layer, f"layer{dist.get_rank()}")
    x = torch.randn(2, 3, 4, requires_grad=True)
    try:
        with stats._forced_triton_path():
            layer(x).backward(torch.randn(2, 3, 4))
    except fingerprint.LayerMismatchError:
        fingerprint.reset()
        return bool((layer.running_mean == 0).all() and (layer.running_var == 1).all())
    return "no error"


def test_kernels_keep_the_fingerprint_check(triton_pool):
    assert triton_pool.run(mismatch_job)[:2] == [True, True]


def too_few_job(sizes):
    import syncbn
    from syncbn.torch import stats

    group = group_of(2)
    if not in_group(2):
        return None
    layer = syncbn.SyncBatchNorm(3, process_group=group)
    x = torch.randn(sizes[dist.get_rank()], 3)
    try:
        with stats._forced_triton_path():
            layer(x)
    except (RuntimeError, ValueError) as exc:
        return "more than 1 value" in str(exc)
    return "no error"


def test_kernels_refuse_one_value_per_channel(triton_pool):
    assert triton_pool.run(too_few_job, (1, 0))[:2] == [True, True]


def fused_on_kernels_job(fused_ranks, paths):
    """test_fingerprint's fused_on_job (conv, batch norm, LeakyReLU(0.1), conv in float64,
    fused by fuse_batchnorm_act on ``fused_ranks`` only; one step) with rank r on
    ``paths[r]``: "triton" (the kernels forced) or "cpu"; with the backward payload kernel's
    launches (the kernels taken)."""
    import contextlib

    from syncbn.torch import stats
    from test_fingerprint import fused_on_job

    rank = dist.get_rank()
    on_kernels = rank < len(paths) and paths[rank] == "triton"
    with _Launches() as launches, stats._forced_triton_path() if on_kernels else contextlib.nullcontext():
        result = fused_on_job(fused_ranks)
    return None if result is None else (*result, launches.calls["grad_payload"])


def fused_on_oracle():
    """fused_on_job's step in one process, float64, torch.nn.BatchNorm2d on both ranks' batch:
    each rank's input gradient and the first conv's weight gradient (the ranks' sum)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.LeakyReLU(0.1), nn.Conv2d(8, 1, 1)).double()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2.0)
        model[1].bias.uniform_(-1.0, 1.0)
    xs = [torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(r), dtype=torch.float64) * 3 + 1
          for r in range(2)]
    x = torch.cat(xs).requires_grad_()
    model(x).square().sum().backward()
    return list(x.grad.split(4)), model[0].weight.grad


@pytest.mark.parametrize("paths", [("triton", "triton"), ("triton", "cpu"), ("cpu", "triton")])
def test_a_layer_fused_on_one_rank_only_sums_like_with_like_on_kernels(triton_pool, paths):
    """A model fused by fuse_batchnorm_act on rank 0 only: its SyncBatchNormAct and rank 1's
    SyncBatchNorm share the fingerprint, so their backward sums are added. On the kernels
    the plain layer sent [fingerprint, sum dy, sum dy (x - mean)], the fused one
    [fingerprint, sum dz, sum dz xhat, overflow]: a size disagreement (gloo fails), and
    sums of different meanings; the general path's payload had no overflow value either.
    Now every path of both layers sends [fingerprint, sum dy, sum dy (x - mean), overflow],
    so kernels beside kernels and kernels beside the CPU path give the float64 oracle's
    gradients. Tolerance: float64 throughout (the kernels accumulate in float64), sums of
    100 terms of order 1 to 10 and a few dozen operations after them: rounding within
    ~1e-13 relative to the largest value; 1e-9 of it, where mixed sums are off by O(1)."""
    results = triton_pool.run(fused_on_kernels_job, (0,), paths, timeout=120)[:2]
    assert [r[0] for r in results] == ["SyncBatchNormAct", "SyncBatchNorm"]
    assert [r[3] > 0 for r in results] == [p == "triton" for p in paths]  # the kernels ran where asked
    dxs, dw = fused_on_oracle()
    for r, dx in zip(results, dxs):
        torch.testing.assert_close(r[1], dx, rtol=0, atol=1e-9 * float(dx.abs().max()))
    got = results[0][2] + results[1][2]
    torch.testing.assert_close(got, dw, rtol=0, atol=1e-9 * float(dw.abs().max()))


def empty_kernels_job(form, momentum, track):
    """test_functional's empty_group_job on the forced Triton path, and the merge kernel's
    launches (the kernels taken, not the torch-op fallback)."""
    from test_functional import empty_group_job

    with _Launches() as launches:
        steps = empty_group_job(2, form, momentum, track, "triton")
    return None if steps is None else (steps, launches.calls["merge"])


@pytest.mark.parametrize("form", ["SyncBatchNorm", "SyncBatchNormAct", "sync_batch_norm"])
@pytest.mark.parametrize("momentum,track", [(0.1, True), (None, True), (0.1, False)])
def test_kernels_take_a_group_of_empty_ranks_as_torchs_empty_batch(triton_pool, form, momentum, track):
    """Every rank empty (it raised): torch.nn.BatchNorm2d's empty batch, the running buffers
    bit for bit as they were (the merge kernel leaves them where N <= 1, its statistics
    finite zeros at N = 0), zero weight and bias gradients, one all-reduce each way, then a
    step with values as torch's (test_functional.check_empty_group)."""
    from test_functional import check_empty_group

    if form == "sync_batch_norm" and momentum is None:
        momentum = 0.3
    results = triton_pool.run(empty_kernels_job, form, momentum, track)[:2]
    assert all(merges == 3 for _, merges in results), [merges for _, merges in results]
    check_empty_group([steps for steps, _ in results], 2, form, momentum, track)


def fallback_job():
    """An input whose spatial dims do not flatten without a copy (a transposed plane)
    takes the torch-op path; the same values laid out densely take the kernels: the same
    output and gradients (float64)."""
    import syncbn
    from syncbn.torch import stats

    group = group_of(2)
    if not in_group(2):
        return None
    gen = torch.Generator().manual_seed(3 + dist.get_rank())
    base = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64) + 2
    dy = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    out = []
    for x in (base.transpose(2, 3), base.transpose(2, 3).contiguous()):
        x = x.detach().requires_grad_()
        layer = syncbn.SyncBatchNorm(3, process_group=group).double()
        with _Launches() as launches, stats._forced_triton_path():
            y = layer(x)
            y.backward(dy)
        out.append((y.detach(), x.grad, layer.weight.grad, layer.running_var.clone(), sum(launches.calls.values())))
    return out


def test_inputs_the_kernels_do_not_take_fall_back_to_torch_ops(triton_pool):
    for strided, dense in triton_pool.run(fallback_job)[:2]:
        assert strided[-1] == 0 and dense[-1] > 0
        for a, b in zip(strided[:-1], dense[:-1]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", ["SyncBatchNorm", "SyncBatchNormAct"])
def test_float16_running_var_of_a_batch_variance_beyond_float16(triton_pool, form):
    """test_functional's case (a float16 layer, batch variance 1.6e5 > 65504) on the
    kernels: the merge moves the buffers in float64 and stores a finite float16 value."""
    from test_functional import check_half_buffers, half_buffer_job

    check_half_buffers(triton_pool.run(half_buffer_job, 2, form, "triton")[:2])


def overflow_beside_job(fused_ranks, paths, need_x=True, hard=3):
    """Conv, batch norm (32 channels), LeakyReLU(0.1), conv, fused by fuse_batchnorm_act on
    ``fused_ranks`` only, rank r on ``paths[r]``: "triton" (the kernels forced), "cuda" (the
    torch-op CUDA path forced) or "cpu". ``hard`` of the 32 weights are 0 on every rank; 3
    is more than the kernels' 2 kept channels: a fused rank on the kernels runs out of room,
    a fused rank on a general path keeps all three, a plain rank keeps nothing. Without
    ``need_x`` nothing before the layer needs a gradient. One step; returns (the error's
    name or "ok", its message, the backward payload kernel's launches)."""
    import contextlib

    import syncbn
    from syncbn.torch import fingerprint, stats
    from test_fingerprint import on_group

    group = group_of(2)
    fingerprint.reset()
    if not in_group(2):
        return None
    rank = dist.get_rank()
    forced = {"triton": stats._forced_triton_path, "cuda": stats._forced_cuda_path}.get(paths[rank])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 1), nn.BatchNorm2d(32), nn.LeakyReLU(0.1), nn.Conv2d(32, 1, 1))
    with torch.no_grad():
        model[1].bias.uniform_(-1.0, 1.0)
        model[1].weight[:hard] = 0.0
    model = syncbn.convert_sync_batchnorm(model)
    if rank in fused_ranks:
        model = syncbn.fuse_batchnorm_act(model)
    on_group(model, group)
    if not need_x:
        model[0].requires_grad_(False)
    x = torch.randn(2, 3, 3, 3, generator=torch.Generator().manual_seed(rank)) + 2
    with _Launches() as launches:
        try:
            with forced() if forced else contextlib.nullcontext():
                model(x).square().sum().backward()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return type(exc).__name__, str(exc), launches.calls["grad_payload"]
        finally:
            fingerprint.reset()
    return "ok", "", launches.calls["grad_payload"]


@pytest.mark.parametrize("fused_ranks,paths", [
    ((0,), ("triton", "triton")), ((0,), ("triton", "cpu")), ((0,), ("triton", "cuda")),
    ((0, 1), ("triton", "cpu")), ((0, 1), ("triton", "cuda")),
])
def test_every_rank_raises_when_a_fused_rank_beside_it_overflows(triton_pool, fused_ranks, paths):
    """Rank 0's SyncBatchNormAct on the kernels runs out of kept channels; rank 1 runs the
    same layer (one fingerprint, so their backward sums are added) as a SyncBatchNorm (the
    model fused on rank 0 only) on the kernels, the CPU path or the CUDA torch-op path, or as
    a SyncBatchNormAct on a general path (which keeps every channel it needs). Rank 0's
    inexact sums are in both ranks' gradients, and rank 0 raises KeptChannelsOverflow when
    its backward pass ends: rank 1 must too, at the same point, naming the other rank (it
    returned normally, with inexact gradients, and would then wait in its next collective
    for a rank that had raised). Also where rank 1's input and parameters before the
    layer need no gradient (the backward all-reduce is made for the layer's weight)."""
    for need_x in (True, False):
        results = triton_pool.run(overflow_beside_job, fused_ranks, paths, need_x, timeout=120)[:2]
        assert [r[0] for r in results] == ["KeptChannelsOverflow"] * 2, results
        assert [r[2] > 0 for r in results] == [p == "triton" for p in paths]  # the kernels ran where asked
        assert "on this rank or another of the process group" in results[0][1], results[0][1]
        assert "another rank of the process group runs this layer" in results[1][1], results[1][1]


@pytest.mark.parametrize("paths", [("triton", "triton"), ("triton", "cpu")])
def test_no_rank_raises_beside_a_fused_rank_that_keeps_its_channels(triton_pool, paths):
    """The same with 2 zero weights, as many as the kernels keep: no rank raises."""
    results = triton_pool.run(overflow_beside_job, (0,), paths, True, 2, timeout=120)[:2]
    assert [r[:2] for r in results] == [("ok", "")] * 2, results


@pytest.mark.parametrize("shape, strides, fits", [
    # contiguous: one channel a tile where planes are large, so 65,535 channels is the most
    ((1, 65535, 32, 32), None, True),
    ((1, 65536, 32, 32), None, False),
    ((1, 70000, 2048), None, False),
    # small planes: several channels a tile (16 at 4 positions), as the launchers tile them
    ((2, 70000, 4), None, True),
    ((2, 16 * 65535 + 1, 4), None, False),
    # channels the contiguous dim: 64 a tile whatever the plane
    ((1, 70000, 32, 32), "channels_last", True),
    ((3, 70000), None, True),
    ((3, 64 * 65535), None, True),
    ((3, 64 * 65535 + 1), None, False),
])
def test_kernels_refuse_more_channel_blocks_than_a_launch_grid_holds(monkeypatch, shape, strides, fits):
    # meta tensors: the decision reads shapes and strides only; on CUDA a launch with more
    # than 65,535 programs along its grid's second axis (the channel blocks) fails
    x = torch.empty(shape, device="meta")
    if strides == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    assert kernels.channel_blocks_fit(x) is fits
    # the worst case of every launch over x, as the launchers tile it
    spatial = x.numel() // (x.shape[0] * x.shape[1])
    s_c = x.stride(1)
    worst = max(-(-x.shape[1] // kernels._tiles(x.shape[1], n_s, (0, s_c, 1), size)[1])
                for size in (1024, 2048) for n_s in (spatial, x.shape[0] * spatial))
    assert (worst <= kernels.MAX_CHANNEL_BLOCKS) is fits
    monkeypatch.setattr(kernels, "available", lambda device: True)
    assert kernels.supports(x) is fits


def non_finite_kernels_job(form, value):
    """test_functional's non_finite_job on the Triton path, with the kernel calls made."""
    from syncbn.torch import kernels
    from test_functional import non_finite_job

    assert kernels.available("cpu"), "the pool's Triton does not interpret"
    with _Launches() as launches:
        result = non_finite_job(form, "triton", value)
    if result is not None:
        result["launches"] = launches.calls
    return result


@pytest.mark.parametrize("form", ["SyncBatchNorm", "SyncBatchNormAct"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nan_statistic_is_torchs_on_kernels(triton_pool, form, value):
    """A NaN or an infinity in one rank's input: the channel's output, input gradient and
    running variance NaN on every rank, as torch's on the concatenated batch, the other
    channels untouched, and no disagreement reported. The merge kernel clamped the
    variance with tl.maximum(var, 0), which returns the 0 for a NaN: the running variance
    moved towards 0, finite."""
    from test_functional import check_non_finite

    results = triton_pool.run(non_finite_kernels_job, form, value)[:2]
    assert all(all(n > 0 for n in r["launches"].values()) for r in results), [r["launches"] for r in results]
    check_non_finite(results, value)


def overflow_kernels_job(form):
    """test_functional's non_finite_job with 1e30 (channel 0's float32 variance overflows)
    on the Triton path, and the same step in float64 (torch's batch norm on the concatenated
    batch: there the variance, about 4e58, is finite)."""
    from test_functional import SPIKED_AFFINE, spiked_batch

    result = non_finite_kernels_job(form, 1e30)
    if result is None:
        return None
    x, dy = spiked_batch(0, 1e30, torch.float64)  # non_finite_job's batch, in float64
    bn = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(SPIKED_AFFINE[0]))
        bn.bias.copy_(torch.tensor(SPIKED_AFFINE[1]))
    chain = bn if form == "SyncBatchNorm" else nn.Sequential(bn, nn.LeakyReLU(0.1))
    x.requires_grad_()
    y = chain(x)
    y.backward(dy)
    rows = slice(3 * dist.get_rank(), 3 * dist.get_rank() + 3)
    result["float64"] = (y.detach()[rows], x.grad[rows])
    return result


@pytest.mark.parametrize("form", ["SyncBatchNorm", "SyncBatchNormAct"])
def test_a_variance_beyond_float32_is_normalized_exactly_on_kernels(triton_pool, form):
    """Where a float32 channel's variance overflows float32 (a value of 1e30: about 4e58),
    torch's batch norm and the torch-op paths normalize with invstd 0 (output the activated
    bias, input gradient 0: test_functional). The kernels hold the statistics in float64,
    so they normalize that channel as float64 does (docs/torch.md says so): output and
    input gradient within float32's oracle tolerance of the float64 step, each channel's
    error relative to its own largest value (channel 0's input gradients are about 1e-30,
    which bn_oracle's floor of 1 would not see). The input-gradient kernel formed invstd^2,
    which underflowed float32 there: those gradients were off by up to half their size."""
    results = triton_pool.run(overflow_kernels_job, form)[:2]
    assert all(all(n > 0 for n in r["launches"].values()) for r in results), [r["launches"] for r in results]
    for r in results:
        for ours, ref in zip(r["ours"], r["float64"]):
            for c in range(3):
                a, b = ours[:, c].double(), ref[:, c]
                assert a.isfinite().all() and b.isfinite().all(), (c, a, b)
                assert float((a - b).abs().max()) <= TOL["float32"] * float(b.abs().max()), (c, a, b)
