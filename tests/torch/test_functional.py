"""syncbn.torch.functional.sync_batch_norm: the function form, and errors that every rank agrees on."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from bn_oracle import Case, check_case, run_case
from syncbn.torch.functional import sync_batch_norm
from workers import group_of, in_group


def functional_job(world, sizes):
    group = group_of(world)
    if not in_group(world):
        return None
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, 4, 3, generator=gen, dtype=torch.float64) * 3 - 2 for n in sizes]
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    w = torch.linspace(0.5, 2, 4, dtype=torch.float64)
    y = sync_batch_norm(xs[rank], rm, rv, w, None, True, 0.3, 1e-3, group)
    return {"y": y, "rm": rm, "rv": rv, "xs": xs}


def test_functional_matches_batch_norm_on_concatenation(pool):
    sizes = (3, 0, 2, 5)
    results = pool.run(functional_job, 4, sizes)
    xs = results[0]["xs"]
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    w = torch.linspace(0.5, 2, 4, dtype=torch.float64)
    ref = F.batch_norm(torch.cat(xs), rm, rv, w, None, True, 0.3, 1e-3)
    # float64: defaults rtol = atol = 1e-7, far above ~n * 2^-53 * |mean|/std ~1e-15
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), ref)
    for r in results:
        torch.testing.assert_close(r["rm"], rm)
        torch.testing.assert_close(r["rv"], rv)


def test_not_training_is_plain_batch_norm():
    x = torch.randn(5, 3, 2) + 1
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    # not training: the same call of F.batch_norm on both sides, so equal on any CPU
    torch.testing.assert_close(sync_batch_norm(x, rm, rv, training=False), F.batch_norm(x, rm, rv))


def error_job(world, sizes, tail):
    """Run a layer whose global element count may be too small; report what each rank saw."""
    group = group_of(world)
    if not in_group(world):
        return None
    import syncbn

    bn = syncbn.SyncBatchNorm(3, process_group=group)
    x = torch.randn((sizes[dist.get_rank()], 3) + tuple(tail))
    try:
        bn(x)
    except ValueError as exc:
        return ("ValueError", str(exc))
    # the pool must still be usable afterwards: one more collective in the same group
    return ("ok", None)


@pytest.mark.parametrize("sizes", [(1, 0, 0, 0), (0, 1), (1,)])
def test_too_few_values_raise_on_every_rank(pool, sizes):
    """One value per channel over the whole group raises, as torch.nn.BatchNorm2d raises
    for one value per channel (a group whose ranks are all empty does not: see below)."""
    world = len(sizes)
    results = pool.run(error_job, world, sizes, ())[:world]
    for kind, message in results:
        assert kind == "ValueError" and "more than 1 value per channel" in message


# ---- a group whose ranks are all empty: torch.nn's empty batch --------------------------

EMPTY_STEPS = 2  # training steps in which every rank is empty, then one with values
EMPTY_TAIL = (4, 4)


def empty_group_setup(channels=3):
    """The layer's starting values (float64, bits not round: 1/3, 1/7, ...), the same in the
    workers and in the test process."""
    gen = torch.Generator().manual_seed(17)
    return {"running_mean": torch.randn(channels, generator=gen, dtype=torch.float64) / 3,
            "running_var": torch.rand(channels, generator=gen, dtype=torch.float64) / 7 + 0.5,
            "weight": torch.rand(channels, generator=gen, dtype=torch.float64) + 0.5,
            "bias": torch.randn(channels, generator=gen, dtype=torch.float64)}


def load_empty_group_setup(layer, start, track):
    """``layer`` (syncbn's or torch's) given the starting values ``start`` (:func:`empty_group_setup`)."""
    with torch.no_grad():
        layer.weight.copy_(start["weight"])
        layer.bias.copy_(start["bias"])
        if track:
            layer.running_mean.copy_(start["running_mean"])
            layer.running_var.copy_(start["running_var"])
    return layer


def empty_group_last(world, channels=3):
    """The last step's inputs and output gradients on every rank (an empty rank among them)."""
    sizes = (2, 0, 3, 1)[:world] if world > 2 else (2, 3)
    gen = torch.Generator().manual_seed(23)
    xs = [torch.randn(n, channels, *EMPTY_TAIL, generator=gen, dtype=torch.float64) * 2 + 1 for n in sizes]
    dys = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in xs]
    return xs, dys


def empty_group_job(world, form, momentum, track, path="cpu", activation=("leaky_relu", 0.01)):
    """``form`` (SyncBatchNorm, SyncBatchNormAct, sync_batch_norm) trained for
    EMPTY_STEPS steps in which every rank of the group is empty, then one step with values,
    on this rank's ``path`` ("cpu", "cuda": the torch-op CUDA path forced, "portable": the
    path torch.compile traces, "triton": the kernels forced, in an interpreting pool,
    "compiled": the call under torch.compile, fullgraph where syncbn traces whole).
    Per step: the output, the input, weight and bias gradients, the buffers after it, and
    the collectives it ran. ``activation``: SyncBatchNormAct's (name, parameter)."""
    import contextlib

    import syncbn
    from syncbn.torch import fingerprint, stats
    from syncbn.tools.traffic import record_collectives

    group = group_of(world)
    if not in_group(world):
        return None
    rank = dist.get_rank()
    start = empty_group_setup()
    layer = None
    if form == "sync_batch_norm":
        weight = start["weight"].clone().requires_grad_()
        bias = start["bias"].clone().requires_grad_()
        buffers = [start["running_mean"].clone(), start["running_var"].clone()] if track else [None, None]
    else:
        kwargs = {}
        if form == "SyncBatchNormAct":
            kwargs = {"activation": activation[0], "activation_param": activation[1]}
        layer = getattr(syncbn, form)(3, momentum=momentum, track_running_stats=track, process_group=group,
                                      **kwargs).double()
        load_empty_group_setup(layer, start, track)
        weight, bias = layer.weight, layer.bias
        buffers = [None, None]
    xs, dys = empty_group_last(world)
    inputs = [(torch.empty(0, 3, *EMPTY_TAIL, dtype=torch.float64),) * 2] * EMPTY_STEPS + [(xs[rank], dys[rank])]
    if layer is None:
        def call(x):
            return sync_batch_norm(x, *buffers, weight, bias, True, momentum, 1e-5, group)
    else:
        call = layer
    if path == "compiled":
        from torch import _dynamo

        from syncbn.torch.distributed import TRACEABLE

        _dynamo.reset()
        call = torch.compile(call, fullgraph=TRACEABLE)
    forced = {"cuda": stats._forced_cuda_path, "triton": stats._forced_triton_path}.get(path)
    if path == "portable":
        fingerprint.IMMEDIATE_DEVICES.discard("cpu")
    steps = []
    try:
        with forced() if forced else contextlib.nullcontext():
            for x, dy in inputs:
                x = x.clone().requires_grad_()
                with record_collectives() as calls:
                    y = call(x)
                    y.backward(dy)
                if layer is not None and track:
                    buffers = [layer.running_mean, layer.running_var]
                steps.append({"y": y.detach().clone(), "dx": x.grad, "dw": weight.grad.clone(),
                              "db": bias.grad.clone(), "collectives": [c.op for c in calls],
                              "buffers": [None if b is None else b.clone() for b in buffers],
                              "tracked": None if layer is None or not track else layer.num_batches_tracked.clone()})
                weight.grad = bias.grad = None
    finally:
        fingerprint.IMMEDIATE_DEVICES.add("cpu")
    return steps


def empty_group_reference(world, form, momentum, track, activation=("leaky_relu", 0.01)):
    """The same steps by torch.nn.BatchNorm2d (F.batch_norm for the function; the activation
    after it for SyncBatchNormAct) in one process, each step's batch the ranks' batches
    concatenated."""
    start = empty_group_setup()
    layer = torch.nn.BatchNorm2d(3, momentum=momentum, track_running_stats=track).double()
    load_empty_group_setup(layer, start, track)
    buffers = [start["running_mean"].clone(), start["running_var"].clone()] if track else [None, None]
    xs, dys = empty_group_last(world)
    empty = torch.empty(0, 3, *EMPTY_TAIL, dtype=torch.float64)
    steps = []
    for x, dy in [(empty, empty)] * EMPTY_STEPS + [(torch.cat(xs), torch.cat(dys))]:
        x = x.clone().requires_grad_()
        if form == "sync_batch_norm":
            y = F.batch_norm(x, *buffers, layer.weight, layer.bias, True, momentum, 1e-5)
        else:
            y = layer(x)
            if track:
                buffers = [layer.running_mean, layer.running_var]
        if form == "SyncBatchNormAct" and activation[0] == "leaky_relu":
            y = F.leaky_relu(y, activation[1])
        elif form == "SyncBatchNormAct" and activation[0] == "elu":
            y = F.elu(y, activation[1])
        y.backward(dy)
        steps.append({"y": y.detach().clone(), "dx": x.grad, "dw": layer.weight.grad.clone(),
                      "db": layer.bias.grad.clone(), "buffers": [None if b is None else b.clone() for b in buffers],
                      "tracked": None if form == "sync_batch_norm" or not track else layer.num_batches_tracked.clone()})
        layer.weight.grad = layer.bias.grad = None
    return steps


def check_empty_group(results, world, form, momentum, track, activation=("leaky_relu", 0.01)):
    """Every rank's empty steps are torch's bit for bit: an empty output and input gradient,
    zero weight and bias gradients, the running buffers as they were and num_batches_tracked
    moved; one all-reduce forward and one backward on every rank; then the step with values
    matches torch on the concatenation (float64: bn_oracle's bound, 1e-10 relative to the
    largest value), so the buffers and the momentum count went on from where torch's did
    (momentum None: the third step's weight is 1/3)."""
    ref = empty_group_reference(world, form, momentum, track, activation)
    ranks = results[:world]
    for rank, steps in enumerate(ranks):
        assert len(steps) == EMPTY_STEPS + 1
        for i, (got, want) in enumerate(zip(steps[:EMPTY_STEPS], ref)):
            where = f"rank {rank}, empty step {i}"
            assert got["collectives"] == ["all_reduce", "all_reduce"], (where, got["collectives"])
            assert got["y"].shape == want["y"].shape and got["y"].dtype == want["y"].dtype, where
            assert got["dx"] is not None and got["dx"].shape == want["dx"].shape, where
            for key in ("dw", "db"):
                assert torch.equal(got[key], want[key]), (where, key, got[key])
            for a, b in zip(got["buffers"], want["buffers"]):
                assert (a is None) == (b is None), where
                if a is not None:  # bit for bit: untouched
                    assert torch.equal(a, b), (where, a, b)
            if got["tracked"] is not None:
                assert torch.equal(got["tracked"], want["tracked"]), (where, got["tracked"], want["tracked"])
    last = ref[-1]
    for key in ("y", "dx"):
        got = torch.cat([steps[-1][key] for steps in ranks])
        assert torch.isfinite(got).all(), key
        torch.testing.assert_close(got, last[key], rtol=0, atol=1e-10 * max(1.0, float(last[key].abs().max())),
                                   msg=key)
    for key in ("dw", "db"):
        got = sum(steps[-1][key] for steps in ranks)
        torch.testing.assert_close(got, last[key], rtol=0, atol=1e-10 * max(1.0, float(last[key].abs().max())),
                                   msg=key)
    for steps in ranks:
        for a, b in zip(steps[-1]["buffers"], last["buffers"]):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg="buffers")
        if steps[-1]["tracked"] is not None:
            assert torch.equal(steps[-1]["tracked"], last["tracked"])


_EMPTY_SETTINGS = [(0.1, True), (None, True), (0.1, False)]


@pytest.mark.parametrize("path", ["cpu", "cuda", "portable"])
@pytest.mark.parametrize("form", ["SyncBatchNorm", "SyncBatchNormAct", "sync_batch_norm"])
@pytest.mark.parametrize("momentum,track", _EMPTY_SETTINGS)
def test_a_group_of_empty_ranks_is_torchs_empty_batch(pool, path, form, momentum, track):
    """Every rank empty (a global count of 0 values per channel, W = 4; it raised
    ValueError): torch.nn.BatchNorm2d's empty batch on the concatenation, on every rank and
    every path (see check_empty_group)."""
    if form == "sync_batch_norm" and momentum is None:
        momentum = 0.3  # the function takes a number; the count is the layers'
    world = 4 if path == "cpu" else 2
    check_empty_group(pool.run(empty_group_job, world, form, momentum, track, path), world, form, momentum, track)


def test_enough_values_split_thinly_do_not_raise(pool):
    results = pool.run(error_job, 4, (1, 0, 1, 0), ())
    assert [r[0] for r in results] == ["ok"] * 4


def shape_error_job(world, channels, shape, affine, track, form):
    """One training call of ``form`` (a layer class's name, or "sync_batch_norm") for
    ``channels`` on a ``shape`` input on each rank of the group: the error class and
    message, or "ok", and the number of collectives the call ran."""
    group = group_of(world)
    if not in_group(world):
        return None
    import syncbn
    from syncbn.tools.traffic import record_collectives

    x = torch.randn(shape) + 1
    outcome = ("ok", None)
    with record_collectives() as calls:
        try:
            if form == "sync_batch_norm":  # per-channel tensors of ``channels`` values
                stats = [torch.zeros(channels), torch.ones(channels)] if track else [None, None]
                params = [torch.ones(channels), torch.zeros(channels)] if affine else [None, None]
                sync_batch_norm(x, *stats, *params, training=True, process_group=group)
            else:
                getattr(syncbn, form)(channels, affine=affine, track_running_stats=track, process_group=group)(x)
        except Exception as exc:  # noqa: BLE001 - the class is the result
            outcome = (type(exc).__name__, str(exc))
    return outcome + (len(calls),)


@pytest.mark.parametrize("form", ["SyncBatchNorm", "SyncBatchNormAct", "sync_batch_norm"])
@pytest.mark.parametrize("affine,track", [(True, True), (False, True), (True, False), (False, False)])
def test_shape_errors_raise_torchs_class_on_every_rank_before_any_collective(pool, affine, track, form):
    """On 2 ranks, a channel count other than the layer's raises RuntimeError (as
    torch.nn.SyncBatchNorm; it was ValueError) where the layer holds a per-channel tensor,
    and computes where it holds none; an input without channels or of one dim raises
    ValueError: on every rank alike, before any collective (the group works afterwards)."""
    held = affine or track
    wrong = pool.run(shape_error_job, 2, 4, (3, 3, 5), affine, track, form)[:2]
    if held:
        assert [(kind, calls) for kind, _, calls in wrong] == [("RuntimeError", 0)] * 2, wrong
        assert all("expected 4 channels" in message for _, message, _ in wrong), wrong
    else:
        assert [(kind, calls) for kind, _, calls in wrong] == [("ok", 1)] * 2, wrong
    for shape in ((3, 0, 5), (4,)):
        results = pool.run(shape_error_job, 2, 4, shape, affine, track, form)[:2]
        assert [(kind, calls) for kind, _, calls in results] == [("ValueError", 0)] * 2, results
    assert pool.run(shape_error_job, 2, 4, (3, 4, 5), affine, track, form)[:2] == [("ok", None, 1)] * 2


def momentum_job(world, momentum):
    group = group_of(world)
    if not in_group(world):
        return None
    x = torch.randn(3, 2, 4)
    try:
        sync_batch_norm(x, torch.zeros(2), torch.ones(2), training=True, momentum=momentum, process_group=group)
    except TypeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("momentum", [None, "0.1", torch.tensor([0.1, 0.2])])
def test_a_momentum_no_batch_norm_takes_is_named_on_every_rank(pool, momentum):
    """As F.batch_norm refuses it, before any collective (the group stays usable)."""
    for message in pool.run(momentum_job, 2, momentum)[:2]:
        assert message is not None and "momentum" in message, message
    assert pool.run(momentum_job, 2, torch.tensor(0.1, dtype=torch.float64))[:2] == [None, None]


# ---- the CUDA path, run on the CPU with its device-dependent choices forced ------------


def cuda_path_job(world, layout, sizes, dtype, ratio, forced, tail=(6, 7), layer_dtype=None):
    """One training step of SyncBatchNorm(5). ``forced``: the CUDA path on this rank (a
    bool), or each rank's path, a tuple of "cuda" (forced), "cpu" and "portable" (the
    path that torch.compile traces and other devices take)."""
    from syncbn.torch import fingerprint

    group = group_of(world)
    if not in_group(world):
        return None
    import syncbn

    rank = dist.get_rank()
    path = forced[rank] if isinstance(forced, tuple) else ("cuda" if forced else "cpu")
    if path == "portable":
        fingerprint.IMMEDIATE_DEVICES.discard("cpu")
    try:
        return _cuda_path_step(group, rank, layout, sizes, dtype, ratio, path == "cuda", tail, layer_dtype)
    finally:
        fingerprint.IMMEDIATE_DEVICES.add("cpu")


def _cuda_path_step(group, rank, layout, sizes, dtype, ratio, forced, tail, layer_dtype=None):
    import contextlib

    import syncbn
    from syncbn.torch import stats

    gen = torch.Generator().manual_seed(3 + rank)
    x = (torch.randn(sizes[rank], 5, *tail, generator=gen, dtype=torch.float64) * 2 + 2 * ratio).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype)
    layer = syncbn.SyncBatchNorm(5, momentum=1.0, process_group=group).to(layer_dtype or dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(0.5, 2, 5))
        layer.bias.copy_(torch.linspace(-1, 1, 5))
    with stats._forced_cuda_path() if forced else contextlib.nullcontext():
        y = layer(x)
        y.backward(dy)
    return {"x": x.detach(), "y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad,
            "running_var": layer.running_var.clone(), "format_kept": y.is_contiguous(memory_format=torch.channels_last)
            if layout == "channels_last" else y.is_contiguous()}


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("sizes", [(3, 2, 4), (4, 0, 1), (0, 3, 2)])
def test_cuda_path_matches_the_cpu_path_in_float64(pool, layout, sizes):
    """float64, W = 3 with an empty rank (rank 0 too; the unbiased variance's N - 1 comes
    from the summed count, whichever rank is empty): the CUDA path (torch's
    statistics kernel, the stand-ins of its normalizing and backward kernels) gives the
    CPU path's output, gradients and buffers to rounding: both compute the same formulas
    in float64, a few 2^-53 times n (at most 42 per rank) and |mean| / std = 1 apart;
    bound 1e-12."""
    cuda = pool.run(cuda_path_job, 3, layout, sizes, torch.float64, 1.0, True)[:3]
    cpu = pool.run(cuda_path_job, 3, layout, sizes, torch.float64, 1.0, False)[:3]
    for a, b in zip(cuda, cpu):
        assert a["format_kept"]
        for key in ("y", "dx", "dw", "db", "running_var"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_path_half_inputs_match_the_cpu_path(pool, dtype):
    """Half inputs beside float32 parameters (as under autocast), W = 3, channels-last, an
    empty rank. CUDA's statistics kernel returns float32 statistics of a half input (its
    stand-in here must too: the CPU kernel, without float32 buffers, returns them rounded to
    half, off by ~u_half). Both paths compute in float32 or better and round the output
    and input gradient once to the input dtype: within 2 u (u = 2^-11 float16, 2^-8
    bfloat16) of each other relative to the largest value. The float32 parameter
    gradients and the running variance differ by the float32 sums' order, n u_32 ~ 2e-6
    for n <= 336 elements per channel and rank: bound 1e-5."""
    u = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    sizes = (3, 0, 5)
    cuda = pool.run(cuda_path_job, 3, "channels_last", sizes, dtype, 1.0, True, (6, 7), torch.float32)[:3]
    cpu = pool.run(cuda_path_job, 3, "channels_last", sizes, dtype, 1.0, False, (6, 7), torch.float32)[:3]
    for a, b in zip(cuda, cpu):
        assert a["y"].dtype == dtype and a["running_var"].dtype == torch.float32
        for key, rel in (("y", 2 * u), ("dx", 2 * u), ("dw", 1e-5), ("db", 1e-5), ("running_var", 1e-5)):
            gap = (a[key].double() - b[key].double()).abs().max() if a[key].numel() else torch.tensor(0.0)
            scale = max(float(b[key].double().abs().max()), 1.0) if b[key].numel() else 1.0
            assert torch.isfinite(gap) and gap <= rel * scale, (key, float(gap), rel * scale)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("paths", [("cpu", "portable", "cuda"), ("portable", "cuda", "cpu")])
@pytest.mark.parametrize("sizes", [(3, 2, 4), (0, 3, 2)])
def test_ranks_on_different_paths_sum_alike(pool, layout, paths, sizes):
    """Every path sends the same payloads (fingerprint first; [n, n m, n (var + m^2)]
    forward, [sum dy, sum dy (x - mean)] backward), so a group whose ranks take different
    paths (one compiled, another eager, say; here the CPU path, the portable path that
    torch.compile traces, and the CUDA path forced) trains as one that takes the CPU path
    on every rank: float64, bound 1e-12 as above. A payload laid out otherwise on one path
    raises LayerMismatchError or mixes sums of different meanings (off by O(1))."""
    mixed = pool.run(cuda_path_job, 3, layout, sizes, torch.float64, 1.0, paths)[:3]
    cpu = pool.run(cuda_path_job, 3, layout, sizes, torch.float64, 1.0, False)[:3]
    for a, b in zip(mixed, cpu):
        for key in ("y", "dx", "dw", "db", "running_var"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("ratio,bound", [(1e3, 1e-5), (1e4, 1e-4)])
def test_cuda_path_merged_variance_far_from_zero(pool, ratio, bound):
    """float32, W = 2, |mean| / std = r = ratio, n = 4096 elements per channel and rank.
    Without a residual pass each rank's mean keeps its float32 rounding d ~ u r / 2 std
    (u = 2^-24), so the merge sees the ranks' means moved by d: the variance is off by
    about 2 d / sqrt(n) (the rounding against the true spread of the ranks' means, ~1 /
    sqrt(n) std) + d^2, plus the buffer's u/2: ~1e-6 at 1e4, ~1e-7 at 1e3 here. The
    issue's bars for the CUDA path (1e-5 at 1e3, 1e-4 at 1e4) leave ~50x. Measured with the
    CPU's statistics kernel (double accumulators, d = u r / 2 at most); CUDA's float32
    Welford kernel rounds a few times more, checked by scripts/gpu-check."""
    results = pool.run(cuda_path_job, 2, "contiguous", (4, 4), torch.float32, ratio, True, (32, 32))[:2]
    x = torch.cat([r["x"] for r in results]).double()
    n = x.numel() // x.shape[1]
    ref = x.var(dim=(0, 2, 3), correction=1)
    rel = ((results[0]["running_var"].double() - ref).abs() / ref).max().item()
    assert rel < bound, rel


def high_rank_functional_job(world, sizes, tail):
    """sync_batch_norm on a (N, 4, *tail) input: output, input and weight gradients, buffers."""
    group = group_of(world)
    if not in_group(world):
        return None
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(n, 4, *tail, generator=gen, dtype=torch.float64) * 3 - 2 for n in sizes]
    dys = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in xs]
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    w = torch.linspace(0.5, 2, 4, dtype=torch.float64).requires_grad_()
    x = xs[rank].clone().requires_grad_()
    y = sync_batch_norm(x, rm, rv, w, None, True, 0.3, 1e-3, group)
    y.backward(dys[rank])
    return {"y": y.detach(), "dx": x.grad, "dw": w.grad, "rm": rm, "rv": rv, "xs": xs, "dys": dys}


@pytest.mark.parametrize("sizes,tail", [((3, 0, 2), (2, 3, 1, 2)), ((2, 1), (2, 1, 2, 1, 3))])
def test_functional_takes_more_than_five_dims(pool, sizes, tail):
    """sync_batch_norm takes 6-D and 7-D inputs (it refused them): float64 batch norm on
    the concatenation, output, input gradient, summed weight gradient and buffers, within
    bn_oracle's float64 bound (1e-10 relative to the largest value)."""
    world = len(sizes)
    results = pool.run(high_rank_functional_job, world, sizes, tail)[:world]
    x = torch.cat(results[0]["xs"]).requires_grad_()
    rm, rv = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    w = torch.linspace(0.5, 2, 4, dtype=torch.float64).requires_grad_()
    ref = F.batch_norm(x, rm, rv, w, None, True, 0.3, 1e-3)
    ref.backward(torch.cat(results[0]["dys"]))
    got = {"y": torch.cat([r["y"] for r in results]), "dx": torch.cat([r["dx"] for r in results]),
           "dw": sum(r["dw"] for r in results)}
    for key, expect in (("y", ref.detach()), ("dx", x.grad), ("dw", w.grad)):
        assert got[key].shape == expect.shape
        torch.testing.assert_close(got[key], expect, rtol=0, atol=1e-10 * max(1.0, float(expect.abs().max())),
                                   msg=key)
    for r in results:
        torch.testing.assert_close(r["rm"], rm, rtol=0, atol=1e-10)
        torch.testing.assert_close(r["rv"], rv, rtol=0, atol=1e-10)


def path_case_job(case, path):
    """bn_oracle's run_case (SyncBatchNorm) or test_batchnorm_act's run_act_case
    (SyncBatchNormAct) on the CUDA path forced ("cuda") or the portable path that
    torch.compile traces and devices without native kernels take ("portable")."""
    import contextlib

    from syncbn.torch import fingerprint, stats
    from test_batchnorm_act import ActCase, run_act_case

    if path == "portable":
        fingerprint.IMMEDIATE_DEVICES.discard("cpu")
    try:
        with stats._forced_cuda_path() if path == "cuda" else contextlib.nullcontext():
            return run_act_case(case) if isinstance(case, ActCase) else run_case(case)
    finally:
        fingerprint.IMMEDIATE_DEVICES.add("cpu")


_HIGH_RANK_PATH_CASES = [
    Case(world=3, sizes=(2, 0, 3), tail=(2, 3, 1, 2), channels=3, dtype="float32"),
    Case(world=2, sizes=(2, 3), tail=(2, 1, 2, 1, 2), channels=2, dtype="float64", momentum=None, seed=1),
    Case(world=2, sizes=(3, 2), tail=(2, 2, 3, 2), dtype="float16", param_dtype="float32", seed=2),
    Case(world=2, sizes=(3, 2), tail=(2, 3, 2, 2), dtype="float32", strides="channels_inner", seed=3),
    Case(world=2, sizes=(2, 2), tail=(3, 2, 2, 2), dtype="float64", strides="spatial_reversed", seed=4),
]


@pytest.mark.parametrize("path", ["cuda", "portable"])
@pytest.mark.parametrize("case", _HIGH_RANK_PATH_CASES,
                         ids=lambda c: f"W{c.world}-{c.ndim}d-{c.dtype}-{c.strides}-{c.sizes}")
def test_more_than_five_dims_on_the_cuda_and_portable_paths(pool, case, path):
    """6-D and 7-D inputs on the forced CUDA (torch-op) path and the portable path, against
    the float64 oracle with bn_oracle's tolerances (the CPU path: test_batchnorm.py)."""
    check_case(case, pool.run(path_case_job, case, path))


@pytest.mark.parametrize("path", ["cuda", "portable"])
def test_more_than_five_dims_act_on_the_cuda_and_portable_paths(pool, path):
    from test_batchnorm_act import ActCase, check_act_case

    for case in (ActCase(Case(world=3, sizes=(2, 0, 3), tail=(2, 3, 1, 2), dtype="float32", steps=2), "leaky_relu", 0.1),
                 ActCase(Case(world=2, sizes=(3, 2), tail=(2, 1, 2, 1, 2), dtype="float64", steps=2, seed=5), "elu", 1.0),
                 ActCase(Case(world=2, sizes=(2, 2), tail=(3, 2, 2, 2), dtype="float32", strides="spatial_reversed",
                              steps=2, seed=6), "identity", 0.01)):
        check_act_case(case, pool.run(path_case_job, case, path))


def cuda_path_constants_job(batches):
    from syncbn.torch import stats

    group = group_of(2)
    if not in_group(2):
        return None
    import syncbn

    layer = syncbn.SyncBatchNorm(5, process_group=group)
    kept = []
    with stats._forced_cuda_path():
        for batch in batches:
            x = torch.randn(batch, 5, 3, 3, requires_grad=True)
            layer(x).backward(torch.randn(x.shape))
            kept.append(set(stats._constants))
    return kept


def test_cuda_path_keeps_no_constant_per_batch_size(pool):
    """The CUDA path's device constants (copied to the GPU once, a host sync there) depend
    on the layer, the rank and eps, not on the batch: after the first step, batches of
    other sizes (multi-scale training, a last smaller batch) make no new one."""
    for kept in pool.run(cuda_path_constants_job, [2, 3, 5, 1, 4])[:2]:
        assert kept[0] and all(k == kept[0] for k in kept[1:]), [len(k) for k in kept]


# ---- float16 running buffers: the update is computed wide and rounded once -------------


def half_buffer_job(world, form, path):
    """One training step of a float16 layer on float16 inputs whose per-channel variance
    (about 1.6e5) is beyond float16's range (65504), on this rank's path: the inputs and
    the running buffers."""
    import contextlib

    import syncbn
    from syncbn.torch import fingerprint, stats

    group = group_of(world)
    if not in_group(world):
        return None
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(11 + rank)
    x = (torch.randn(3 + rank, 3, 4, 5, generator=gen, dtype=torch.float64) * 400 + 30).half()
    layer = getattr(syncbn, form)(3, process_group=group).half()
    if form == "SyncBatchNormAct":
        layer.activation = "identity"
    if path == "portable":
        fingerprint.IMMEDIATE_DEVICES.discard("cpu")
    try:
        forced = {"cuda": stats._forced_cuda_path, "triton": stats._forced_triton_path}.get(path)
        with forced() if forced else contextlib.nullcontext():
            layer(x)
    finally:
        fingerprint.IMMEDIATE_DEVICES.add("cpu")
    return x.double(), layer.running_mean.double(), layer.running_var.double()


@pytest.mark.parametrize("form", ["SyncBatchNorm", "SyncBatchNormAct"])
@pytest.mark.parametrize("path", ["cpu", "cuda", "portable"])
def test_float16_running_var_of_a_batch_variance_beyond_float16(pool, form, path):
    """A float16 layer whose batch variance (1.6e5) exceeds float16's largest value while
    the moved running variance (0.9 + 0.1 * 1.6e5) does not: torch.nn.BatchNorm2d computes
    the update in float32 and stores a finite value; the synchronized paths rounded the
    variance to float16 first (inf) and stored inf, which eval then divides by (every
    output 0 + bias). Tolerance: the result's float16 rounding (2^-11 relative) and the
    float32 statistics (~1e-6 relative), rtol 2e-3; atol 1e-3 for the mean (~4), whose
    float32 error is ~1e-4 of the std (400) times momentum 0.1."""
    check_half_buffers(pool.run(half_buffer_job, 2, form, path)[:2])


def check_half_buffers(results):
    """The ranks' running buffers (and torch's on the whole batch) against the float64 ones."""
    xs, means, variances = zip(*results)
    whole = torch.cat(xs)
    mean = whole.mean((0, 2, 3))
    var = whole.var((0, 2, 3), unbiased=True)
    assert var.min() > 65504  # the case: the batch variance itself is not a float16
    expected_mean, expected_var = 0.1 * mean, 0.9 + 0.1 * var
    got = [*zip(means, variances)]
    torchs = torch.nn.BatchNorm2d(3).half()
    torchs(whole.half())
    if torch.isfinite(torchs.running_var).all():  # torch 2.4's CPU kernel rounds the variance to float16 first: inf
        got.append((torchs.running_mean.double(), torchs.running_var.double()))
    for got_mean, got_var in got:
        torch.testing.assert_close(got_var, expected_var, rtol=2e-3, atol=0)
        torch.testing.assert_close(got_mean, expected_mean, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("activation", ["identity", "leaky_relu", "elu"])
def test_float16_running_var_beyond_float16_in_one_process(activation):
    """The same case in one process: SyncBatchNormAct on a float16 input takes the general
    path without collectives (its local kernels take float32/float64 only), which stored
    inf; the float64 moved variance is finite, as torch.nn.BatchNorm2d stores it (since after
    2.4, whose CPU kernel stored inf too). Same tolerance as above."""
    import syncbn

    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 3, 4, 5, generator=gen, dtype=torch.float64) * 400 + 30).half()
    ours = syncbn.SyncBatchNormAct(3, activation=activation).half()
    ours(x)
    check_half_buffers([(x.double(), ours.running_mean.double(), ours.running_var.double())])


SPIKED_AFFINE = ([1.5, 0.7, -1.2], [-0.3, 0.2, 0.1])  # the weight and bias of the spiked-batch tests


def spiked_batch(channel, value, dtype=torch.float32):
    """The (6, 3, 2, 2) batch and output gradient of the spiked-batch tests (two ranks of 3
    samples; seed 5), element (1, channel, 0, 1), on rank 0, set to ``value``."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 2, 2, generator=gen).to(dtype)
    x[1, channel, 0, 1] = value
    return x, torch.randn(6, 3, 2, 2, generator=gen).to(dtype)


def non_finite_job(form, path, value):
    """W = 2, float32, (6, 3, 2, 2) split 3 + 3: rank 0's element (1, c, 0, 1) set to
    ``value`` (channel 0 for a finite value, 1e30: its variance overflows float32; channel
    1 for NaN or inf), one training step of ``form`` (SyncBatchNormAct: leaky_relu 0.1) on
    this rank's ``path``. This rank's output and input gradient and the running buffers,
    beside torch's BatchNorm2d (+ LeakyReLU) on the concatenated batch (this rank's rows)."""
    import contextlib

    import torch.nn as nn

    import syncbn
    from syncbn.torch import fingerprint, stats

    group = group_of(2)
    if not in_group(2):
        return None
    rank = dist.get_rank()
    x, dy = spiked_batch(0 if math.isfinite(value) else 1, value)
    rows = slice(3 * rank, 3 * rank + 3)
    if form == "SyncBatchNorm":
        layer, ref = syncbn.SyncBatchNorm(3, process_group=group), nn.BatchNorm2d(3)
        chain = ref
    else:
        layer, ref = syncbn.SyncBatchNormAct(3, "leaky_relu", 0.1, process_group=group), nn.BatchNorm2d(3)
        chain = nn.Sequential(ref, nn.LeakyReLU(0.1))
    with torch.no_grad():
        for module in (layer, ref):
            module.weight.copy_(torch.tensor(SPIKED_AFFINE[0]))
            module.bias.copy_(torch.tensor(SPIKED_AFFINE[1]))
    forced = {"cuda": stats._forced_cuda_path, "triton": stats._forced_triton_path}.get(path)
    out = {}
    for name, module, inp, grad in (("ours", layer, x[rows], dy[rows]), ("torch", chain, x, dy)):
        inp = inp.clone().requires_grad_()
        with forced() if forced and name == "ours" else contextlib.nullcontext():
            y = module(inp)
            y.backward(grad)
            fingerprint.check_agreement()  # a NaN statistic is no disagreement
        keep = rows if name == "torch" else slice(None)
        out[name] = (y.detach()[keep], inp.grad[keep])
    out["buffers"] = [(m.running_mean.clone(), m.running_var.clone()) for m in (layer, ref)]
    return out


def check_non_finite(results, value):
    """Each rank's output, input gradient and running buffers are torch's: the channel
    holding a NaN or an infinity has output and input gradient NaN throughout, on every rank
    (torch's statistics of it are NaN), and its non-finite running buffers (and the
    overflowed channel's infinite running variance) are torch's, bit for bit; the rest is
    within float32's oracle tolerance (bn_oracle.TOL: the statistics of
    the 24 values per channel in float32 and a few roundings after); a channel whose
    float32 variance overflows normalized with invstd 0, as torch's, its input gradient
    exactly 0. ``max_rel_err`` counts any NaN or infinity as a failure."""
    from bn_oracle import TOL, max_rel_err

    bad = 0 if math.isfinite(value) else 1
    for r in results:
        pairs = list(zip(r["ours"], r["torch"])) + list(zip(*r["buffers"]))
        for ours, ref in pairs:
            if ours.dim() == 1:  # a running buffer: one value a channel
                ours, ref = ours[:, None], ref[:, None]
            else:
                ours, ref = ours.transpose(0, 1).flatten(1), ref.transpose(0, 1).flatten(1)
            for c in range(3):
                if not ref[c].isfinite().all():  # NaN where torch's is, the same values elsewhere
                    nan = ref[c].isnan()
                    assert torch.equal(ours[c].isnan(), nan) and torch.equal(ours[c][~nan], ref[c][~nan]), \
                        (c, ours[c], ref[c])
                else:
                    assert max_rel_err(ours[c].double(), ref[c].double()) <= TOL["float32"], (c, ours[c], ref[c])
        if math.isfinite(value):
            dx = r["ours"][1][:, 0]
            assert torch.equal(dx, torch.zeros_like(dx))  # invstd 0: exactly 0, as torch's
        else:
            assert all(t[:, bad].isnan().all() for t in r["ours"])  # torch's too (compared above)


@pytest.mark.parametrize("form", ["SyncBatchNorm", "SyncBatchNormAct"])
@pytest.mark.parametrize("path", ["cpu", "cuda"])
@pytest.mark.parametrize("value", [1e30, float("nan"), float("inf")], ids=["overflow", "nan", "inf"])
def test_non_finite_and_overflowing_channels_are_torchs(pool, form, path, value):
    """A NaN or an infinity in one rank's input, a float32 variance beyond float32's range:
    every path of both layers as torch's batch norm on the concatenated batch. On the
    torch-op CUDA path the CPU stand-in of torch.batch_norm_backward_reduce divided the sum
    of dy * xhat by invstd, 0 where the variance overflowed: every input gradient NaN (the
    CUDA kernel sums dy (x - mean) itself)."""
    check_non_finite(pool.run(non_finite_job, form, path, value)[:2], value)
