"""Ranks in different synchronized layer calls: the same LayerMismatchError on every rank,
before any running buffer moves, with no extra collective (see syncbn.torch.fingerprint)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import syncbn
from syncbn.torch import fingerprint
from syncbn.tools.traffic import record_collectives
from workers import group_of, group_of_ranks, in_group


# ---- the check itself, without processes ----------------------------------------------


def test_digits_round_trip():
    tags = (fingerprint.Tag(0, 0), fingerprint.Tag(0xFFFFFF, 0x7FF, True), fingerprint.Tag(0x123456, 0x789),
            fingerprint.Tag(0x123456, 0x789, True), fingerprint.Tag(0xFFFFFF, 0x7FF, False))
    assert len({tuple(fingerprint._digits(t)) for t in tags}) == len(tags)  # the graph bit counts
    for tag in tags:
        digits = fingerprint._digits(tag)
        assert len(digits) == fingerprint.DIGITS and all(0 <= d <= 15 for d in digits)
        assert fingerprint._undigits(digits) == tag


def summed(tags, dtype):
    """What the all-reduce would give: the sum of every rank's fingerprint."""
    return sum(fingerprint.fixed_values(t, dtype, torch.device("cpu")).double() for t in tags).to(dtype)


def verdicts(tags, dtype):
    """Each rank's verdict (rank r sent ``tags[r]``) on the summed fingerprints."""
    sums = summed(tags, dtype)
    return [bool(fingerprint._agree(sums, t, len(tags))) for t in tags]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sums_agree_exactly_when_every_rank_sent_the_same_tag(dtype):
    """Every rank reaches the same verdict: true when all sent one tag, false on every rank
    when one differs (also where a plain sum of the digits would match one rank's)."""
    a, b = fingerprint.Tag(0xABCDEF, 7), fingerprint.Tag(0xABCDEF, 8)
    for world in (2, 3, 7):
        assert verdicts([a] * world, dtype) == [True] * world
        assert verdicts([a] * (world - 1) + [b], dtype) == [False] * world
    # one digit apart by one; digits 1, 2, 3 whose sum is 3 times the middle rank's
    c, d = fingerprint.Tag(1, 0), fingerprint.Tag(2, 0)
    assert verdicts([c, d], dtype) == [False, False]
    assert verdicts([c, d, fingerprint.Tag(3, 0)], dtype) == [False] * 3
    assert verdicts([c, c, d, fingerprint.Tag(0, 0)], dtype) == [False] * 4


def test_float32_sums_stay_exact_up_to_the_largest_world():
    """Every digit 15 on MAX_WORLD ranks: sum d^2 = MAX_WORLD * 225 <= 2^24, exact in
    float32, and the check still separates a single rank one digit off, on both sides."""
    world = fingerprint.MAX_WORLD
    big, small = fingerprint.Tag(0xFFFFFF, 0xFFF), fingerprint.Tag(0xFFFFFE, 0xFFF)
    full = fingerprint.fixed_values(big, torch.float32, torch.device("cpu"))
    off = fingerprint.fixed_values(small, torch.float32, torch.device("cpu"))
    same = full * world
    assert bool(fingerprint._agree(same, big, world))
    assert not bool(fingerprint._agree(same - full + off, big, world))
    assert not bool(fingerprint._agree(same - full + off, small, world))


class _Elsewhere(torch.Tensor):
    """A tensor on another device (it says ``cuda:0``; its values live in ``inner``) that,
    as a real device's kernels do, refuses every operation mixing it with a CPU tensor."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=torch.device("cuda", 0))

    def __init__(self, inner):
        self.inner = inner

    def __repr__(self):
        return f"_Elsewhere({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves, tree_map

        kwargs = kwargs or {}
        if any(not isinstance(t, cls) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)):
            raise RuntimeError(f"{func}: expected all tensors to be on the same device")
        args, kwargs = tree_map(lambda t: t.inner if isinstance(t, cls) else t, (args, kwargs))
        return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, func(*args, **kwargs))


@pytest.mark.parametrize("failing", ["cpu", "elsewhere", "none"])
def test_verdicts_on_two_devices_are_read_apart(failing):
    """A CPU check (a CPU layer's overflow, or one a user defers) may wait beside a GPU
    layer's verdicts: each device's verdicts are reduced on that device, so the check that
    failed raises its own error, not torch's device mismatch, and agreement raises nothing."""
    errors = {place: RuntimeError(f"the {place} check failed") for place in ("cpu", "elsewhere")}
    fingerprint.reset()
    try:
        for i in range(3):
            for place, error in errors.items():
                ok = torch.tensor(not (place == failing and i == 1))
                fingerprint.defer(_Elsewhere(ok) if place == "elsewhere" else ok, error)
        if failing == "none":
            fingerprint.check_agreement()
        else:
            with pytest.raises(RuntimeError, match=f"the {failing} check failed"):
                fingerprint.check_agreement()
        assert not fingerprint._pending
    finally:
        fingerprint.reset()


@pytest.mark.parametrize("kernel_fit", [True, False])
def test_overflow_checks_of_a_backward_pass_are_read_once_when_it_ends(monkeypatch, kernel_fit):
    """Every synchronized backward call queues its kept-channel check (defer_overflow):
    on the device they wait, like the backward verdicts, for the one read at the end of
    the pass, however many layer calls it has (a model of 342 or more layers went past
    the forward bound of 1024 waiting checks: a second host read mid-backward each step).
    ``kernel_fit``: the verdict from the input-gradient kernel; else one comparison on the
    (forced) CUDA path. An overflow among them still raises when the pass ends."""
    from syncbn.torch import stats

    reads = []
    check = fingerprint.check_agreement

    def counted():
        reads.append(len(fingerprint._pending))
        check()

    monkeypatch.setattr(fingerprint, "check_agreement", counted)
    calls, last = 1100, RuntimeError("the last call overflowed")

    class ManyLayers(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, dy):
            for i in range(calls):
                overflow = torch.tensor(1.0 if i == calls - 1 else 0.0)
                fit = torch.eq(overflow, 0) if kernel_fit else None
                fingerprint.defer_overflow(overflow, last if i == calls - 1 else RuntimeError("not this one"), fit)
            return dy

    fingerprint.reset()
    try:
        x = torch.ones(3, requires_grad=True)
        with stats._forced_cuda_path():  # no read at once: the device's way
            with pytest.raises(RuntimeError, match="the last call overflowed"):
                ManyLayers.apply(x).sum().backward()
        assert reads == [calls]  # one read, when the pass ended, of every check
    finally:
        fingerprint.reset()


# ---- on the worker pool ---------------------------------------------------------------


def three_layers(cls=None, channels=(8, 8, 8)):
    torch.manual_seed(0)
    if cls == "act":  # built with syncbn's layers directly: name_layers gives the names
        model = nn.Sequential(*[syncbn.SyncBatchNormAct(c) for c in channels])
        syncbn.name_layers(model)
        return model
    return syncbn.convert_sync_batchnorm(nn.Sequential(*[nn.BatchNorm2d(c) for c in channels]))


def on_group(model, group):
    """Have every synchronized layer of ``model`` communicate over ``group``."""
    for m in model.modules():
        if hasattr(m, "process_group"):
            m.process_group = group


def buffers(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def order_job(world, orders, kind, immediate=True, forced=False, poison=False):
    """Each rank calls the layers of a converted 3-layer model in ``orders[rank]``, then
    backward; returns what happened: the error (type, message) or the outputs, and
    whether the buffers moved. ``forced``: on the CUDA path (syncbn.torch.stats); ``poison``:
    one NaN in the input, so every statistic of the step is NaN."""
    import contextlib

    from syncbn.torch import stats

    group = group_of(world)
    fingerprint.reset()  # on every rank: the call counts of all groups start from 0 everywhere alike
    if not in_group(world):
        return None
    saved = set(fingerprint.IMMEDIATE_DEVICES)
    if not immediate:  # the CUDA way on the CPU: verdicts stay pending until checked
        fingerprint.IMMEDIATE_DEVICES.clear()
    try:
        model = three_layers(kind)
        on_group(model, group)
        before = buffers(model)
        rank = dist.get_rank()
        x = torch.randn(3, 8, 4, 4, generator=torch.Generator().manual_seed(rank)) + 2
        if poison:
            x[0, :, 0, 0] = float("nan")
        x.requires_grad_()
        out = {"phase": "forward"}
        with record_collectives() as calls, stats._forced_cuda_path() if forced else contextlib.nullcontext():
            try:
                y = x
                for i in orders[rank]:
                    y = model[i](y)
                out["phase"] = "backward"
                # a random dy: with dy = 1 the exact input gradient of batch norm is zero
                y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7 + rank)))
                out["result"] = "ok"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out["result"] = (type(exc).__name__, str(exc))
        out["collectives"] = [c.op for c in calls]
        after = buffers(model)
        out["moved"] = sorted(k for k in before if not torch.equal(before[k], after[k]) and "num_batches" not in k)
        out["grad"] = None if x.grad is None else bool(x.grad.abs().sum() > 0)
        return out
    finally:
        fingerprint.IMMEDIATE_DEVICES.update(saved)
        fingerprint.reset()


def assert_same_error_everywhere(results, phase, moved=()):
    for r in results:
        assert r["result"] != "ok", r
        name, message = r["result"]
        assert name == "LayerMismatchError", message
        assert r["phase"] == phase and f"({phase})" in message
        # no statistics of the disagreeing call reach the buffers (earlier, agreeing calls did)
        assert r["moved"] == sorted(moved)


@pytest.mark.parametrize("kind", [None, "act"])
def test_swapped_layers_raise_on_both_ranks_naming_both(pool, kind):
    results = pool.run(order_job, 2, [[0, 1, 2], [1, 0, 2]], kind)[:2]
    assert_same_error_everywhere(results, "forward")
    # W = 2: each rank names its own layer and the other's, so the messages are the same
    assert results[0]["result"] == results[1]["result"]
    message = results[0]["result"][1]
    assert "rank 0 called layer 'Sequential/0' (8 features), call 0" in message
    assert "rank 1 called layer 'Sequential/1' (8 features), call 0" in message
    assert all(r["collectives"] == ["all_reduce"] for r in results)  # the first call raised


def test_skipped_layer_of_the_same_width_raises_on_every_rank(pool):
    results = pool.run(order_job, 3, [[0, 1, 2], [0, 2], [0, 1, 2]], None)[:3]
    assert_same_error_everywhere(results, "forward", ["0.running_mean", "0.running_var"])
    assert "rank 1 (this rank) called layer 'Sequential/2' (8 features), call 1" in results[1]["result"][1]
    assert "rank 0 (this rank) called layer 'Sequential/1' (8 features), call 1" in results[0]["result"][1]


def test_agreeing_ranks_still_train(pool):
    results = pool.run(order_job, 2, [[2, 0, 1], [2, 0, 1]], None)[:2]
    for r in results:
        assert r["result"] == "ok" and r["grad"] is True
        assert r["collectives"] == ["all_reduce"] * 6
        assert len(r["moved"]) == 6  # both buffers of the three layers


def test_pending_verdict_raises_at_the_end_of_backward_and_gates_the_buffers(pool):
    """The way CUDA checks (no host read per layer): the mismatch of the first forward
    call is found when the backward pass ends, on every rank, and the buffers of the
    disagreeing calls did not move (the later, agreeing call of layer 2 did)."""
    results = pool.run(order_job, 2, [[0, 1, 2], [1, 0, 2]], None, False)[:2]
    for r in results:
        assert r["phase"] == "backward"
        name, message = r["result"]
        assert name == "LayerMismatchError" and "(forward)" in message
        assert r["moved"] == ["2.running_mean", "2.running_var"]
    assert results[0]["result"] == results[1]["result"]


@pytest.mark.parametrize("poison", [False, True])
def test_cuda_path_raises_at_the_end_of_backward_and_keeps_the_buffers(pool, poison):
    """The CUDA path (forced on the CPU): the verdicts stay on the device and are read once
    when the backward pass ends; the buffers of the disagreeing calls keep their values bit
    for bit, also when the statistics are NaN (a lerp by 0 would write NaN), while the
    later, agreeing call of layer 2 moves its buffers."""
    results = pool.run(order_job, 2, [[0, 1, 2], [1, 0, 2]], None, True, True, poison)[:2]
    for r in results:
        assert r["phase"] == "backward"
        name, message = r["result"]
        assert name == "LayerMismatchError" and "(forward)" in message
        assert r["moved"] == ["2.running_mean", "2.running_var"]
        assert r["collectives"] == ["all_reduce"] * 6
    assert results[0]["result"] == results[1]["result"]
    ok = pool.run(order_job, 2, [[2, 0, 1], [2, 0, 1]], None, True, True, poison)[:2]
    assert all(r["result"] == "ok" and len(r["moved"]) == 6 for r in ok)


def backward_order_job(immediate=True):
    """Both ranks run the same forward (two layers on two branches) but run the two
    backward passes in the opposite order."""
    group = group_of(2)
    fingerprint.reset()  # on every rank: the call counts of all groups start from 0 everywhere alike
    if not in_group(2):
        return None
    saved = set(fingerprint.IMMEDIATE_DEVICES)
    if not immediate:
        fingerprint.IMMEDIATE_DEVICES.clear()
    try:
        model = three_layers()
        on_group(model, group)
        rank = dist.get_rank()
        x = torch.randn(3, 8, 4, 4, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        outs = [model[0](x), model[1](x)]
        first, second = (0, 1) if rank == 0 else (1, 0)
        try:
            outs[first].backward(torch.ones_like(outs[first]))
            outs[second].backward(torch.ones_like(outs[second]))
            return "ok"
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc)
    finally:
        fingerprint.IMMEDIATE_DEVICES.update(saved)
        fingerprint.reset()


@pytest.mark.parametrize("immediate", [True, False])
def test_backward_in_another_order_raises_on_both_ranks(pool, immediate):
    results = pool.run(backward_order_job, immediate)[:2]
    assert results[0] == results[1]
    name, message = results[0]
    assert name == "LayerMismatchError" and "(backward)" in message
    assert "rank 0 called layer 'Sequential/0'" in message and "rank 1 called layer 'Sequential/1'" in message


def functional_job():
    """The functional form, one name and width throughout: rank 1 ends a step that rank 0
    does not (as the end of a backward pass through a layer on the group marks it; a
    backward itself communicates, so the step's end is marked directly), so their next
    calls differ in the call index alone."""
    group = group_of(2)
    fingerprint.reset()  # on every rank: the call counts of all groups start from 0 everywhere alike
    if not in_group(2):
        return None
    try:
        rank = dist.get_rank()
        x = torch.randn(4, 5, 3)
        w = torch.ones(5, requires_grad=True)
        syncbn.functional.sync_batch_norm(x, None, None, w, training=True, process_group=group, name="head")
        if rank == 1:
            fingerprint.end_step(group)
        try:
            syncbn.functional.sync_batch_norm(x, None, None, w, training=True, process_group=group, name="head")
            return "ok"
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc)
    finally:
        fingerprint.reset()


def test_functional_form_checks_the_call_index(pool):
    results = pool.run(functional_job, timeout=120)[:2]
    name, message = results[0]
    assert results[0] == results[1] and name == "LayerMismatchError"
    assert "rank 0 called layer 'head' (5 features), call 1 of the step" in message
    assert "rank 1 called layer 'head' (5 features), call 0 of the step" in message


def subgroup_job(immediate):
    """Ranks 1 and 3 form a group and call two layers in swapped orders; ranks 0 and 2
    only take part in creating the group (``dist.new_group`` is collective). The group is
    the pool's, kept: destroying it here hung a rank on torch 2.4 (see tests/workers.py)."""
    group = group_of_ranks([1, 3])
    fingerprint.reset()
    saved = set(fingerprint.IMMEDIATE_DEVICES)
    if not immediate:  # verdicts wait on the device, read at the end of backward
        fingerprint.IMMEDIATE_DEVICES.clear()
    try:
        if dist.get_rank() not in (1, 3):
            return None
        model = three_layers()
        on_group(model, group)
        order = [0, 1] if dist.get_rank() == 1 else [1, 0]
        x = torch.randn(3, 8, 4, 4, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
        try:
            y = model[order[1]](model[order[0]](x))
            y.backward(torch.randn(y.shape))
            return "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return type(exc).__name__, str(exc)
    finally:
        fingerprint.IMMEDIATE_DEVICES.update(saved)
        fingerprint.reset()


@pytest.mark.parametrize("immediate", [True, False])
def test_a_subgroup_names_its_ranks_by_their_global_ranks(pool, immediate):
    results = pool.run(subgroup_job, immediate)
    assert results[0] is None and results[2] is None
    assert results[1] == results[3] and results[1][0] == "LayerMismatchError", results
    message = results[1][1]
    # group ranks 0 and 1 are the processes users know as ranks 1 and 3
    assert "rank 1 called layer 'Sequential/0' (8 features), call 0" in message
    assert "rank 3 called layer 'Sequential/1' (8 features), call 0" in message


def no_grad_extra_job():
    """After a step, rank 0 alone runs a training-mode forward under no_grad (a stray
    statistics pass); rank 1 goes on with its next step."""
    group = group_of(2)
    fingerprint.reset()
    if not in_group(2):
        return None
    try:
        model = three_layers()
        on_group(model, group)
        rank = dist.get_rank()
        x = torch.randn(3, 8, 4, 4, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        model(x).backward(torch.randn(3, 8, 4, 4))
        try:
            if rank == 0:
                with torch.no_grad():
                    model(x)
            model(x).backward(torch.randn(3, 8, 4, 4))
            fingerprint.check_agreement()
            return "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return type(exc).__name__, str(exc)
    finally:
        fingerprint.reset()


def test_a_no_grad_forward_on_one_rank_is_named_at_once(pool):
    """Without the graph bit the no_grad forward pairs with the other rank's recorded one,
    and the next collectives pair a forward with a backward of another size: the
    backend crashes instead of raising our error. (On the CPU, where the verdict is read
    at once; on CUDA it is read at the next check, see docs/disagreement.md.)"""
    results = pool.run(no_grad_extra_job, timeout=120)[:2]
    assert results[0] == results[1] and results[0][0] == "LayerMismatchError", results
    message = results[0][1]
    assert "rank 0 called layer 'Sequential/0' (8 features), call 0 of the step;" in message
    assert "rank 1 called layer 'Sequential/0' (8 features), call 0 of the step, recording autograd" in message
    assert "only one rank records it for a backward pass" in message


# ---- layers of separately converted models ---------------------------------------------


class Generator(nn.Sequential):
    pass


class Discriminator(nn.Sequential):
    pass


def of_module(module):
    """A model class named ``Model`` as a module ``module`` would define it (a teacher's and
    a student's, each in a file of its own)."""
    return type("Model", (nn.Sequential,), {"__module__": module, "__qualname__": "Model"})


# the labels of the models of two_models(kind), as the messages print them
LABELS = {"classes": (f"{__name__}.Generator", f"{__name__}.Discriminator"),
          "names": ("generator", "discriminator"), "modules": ("teacher.Model", "student.Model")}


def two_models(kind):
    """Two models converted on their own whose layers have the same paths and widths
    ('0', 8 features): of two classes, two plain nn.Sequential given names, or two
    classes of one name from two modules."""
    torch.manual_seed(0)
    if kind == "modules":
        return tuple(syncbn.convert_sync_batchnorm(of_module(m)(nn.BatchNorm2d(8))) for m in ("teacher", "student"))
    if kind == "names":
        first = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(8)))
        second = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(8)))
        syncbn.name_layers(first, model="generator")
        syncbn.name_layers(second, model="discriminator")
        return first, second
    return (syncbn.convert_sync_batchnorm(Generator(nn.BatchNorm2d(8))),
            syncbn.convert_sync_batchnorm(Discriminator(nn.BatchNorm2d(8))))


@pytest.mark.parametrize("kind", LABELS)
def test_separately_converted_models_name_their_layers_apart(kind):
    models = two_models(kind)
    assert [fingerprint.layer_name(m[0]) for m in models] == [f"{label}/0" for label in LABELS[kind]]
    assert models[0][0]._syncbn_name == "0"  # the path alone, as other messages print it
    idents = [fingerprint._layer_ident(m[0]) for m in models]
    assert idents[0] != idents[1]


def test_model_label_leaves_out_the_script_and_torch():
    """A script's class is ``__main__.X`` in one process and ``__mp_main__.X`` in those that
    multiprocessing spawns: one label on every rank. torch's containers keep their short name."""
    labels = [fingerprint.layer_name(syncbn.convert_sync_batchnorm(of_module(m)(nn.BatchNorm2d(8)))[0])
              for m in ("__main__", "__mp_main__")]
    assert labels == ["Model/0", "Model/0"]
    assert fingerprint.layer_name(syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(8)))[0]) == "Sequential/0"
    layer = syncbn.convert_sync_batchnorm(nn.BatchNorm2d(8))  # the root is the layer: its class name
    assert fingerprint.layer_name(layer) == "SyncBatchNorm"


def two_models_job(kind):
    """Rank 0 runs the first model, then the second; rank 1 the other way round (a
    data-dependent branch). Each model's one layer is the step's first call on its rank,
    so the call index cannot tell them apart: only the model in the identity can."""
    group = group_of(2)
    fingerprint.reset()
    if not in_group(2):
        return None
    try:
        models = two_models(kind)
        for model in models:
            on_group(model, group)
        before = [buffers(m) for m in models]
        rank = dist.get_rank()
        x = torch.randn(3, 8, 4, 4, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        order = models if rank == 0 else models[::-1]
        try:
            for model in order:
                model(x).backward(torch.randn(3, 8, 4, 4, generator=torch.Generator().manual_seed(7 + rank)))
            result = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = (type(exc).__name__, str(exc))
        moved = [sorted(k for k in b if not torch.equal(b[k], a[k]) and "num_batches" not in k)
                 for b, a in zip(before, [buffers(m) for m in models])]
        return result, moved
    finally:
        fingerprint.reset()


@pytest.mark.parametrize("kind", LABELS)
def test_two_models_called_in_opposite_orders_raise_on_both_ranks(pool, kind):
    """Without the model in the identity both ranks' first calls carry '0' with 8
    features at call 0: the generator's statistics were mixed with the discriminator's
    and the step completed on both ranks."""
    results = pool.run(two_models_job, kind, timeout=120)[:2]
    assert results[0] == results[1], results
    result, moved = results[0]
    assert result != "ok", "the two models' calls were paired and mixed without an error"
    name, message = result
    assert name == "LayerMismatchError", message
    first, second = LABELS[kind]
    assert f"rank 0 called layer '{first}/0' (8 features), call 0 of the step" in message
    assert f"rank 1 called layer '{second}/0' (8 features), call 0 of the step" in message
    assert moved == [[], []]  # neither model's running statistics took the mixed ones


# ---- a layer fused on some ranks only ---------------------------------------------------


def fused_on_job(fused_ranks):
    """Conv, batch norm, LeakyReLU, conv in float64, converted on every rank and fused
    (SyncBatchNormAct) on ``fused_ranks`` only: one step; returns this rank's input
    gradient and the first conv's weight gradient."""
    group = group_of(2)
    fingerprint.reset()
    if not in_group(2):
        return None
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.LeakyReLU(0.1), nn.Conv2d(8, 1, 1)).double()
        with torch.no_grad():  # not torch's ones and zeros, so that the affine terms count
            model[1].weight.uniform_(0.5, 2.0)
            model[1].bias.uniform_(-1.0, 1.0)
        model = syncbn.convert_sync_batchnorm(model)
        if dist.get_rank() in fused_ranks:
            model = syncbn.fuse_batchnorm_act(model)
        on_group(model, group)
        rank = dist.get_rank()
        x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(rank), dtype=torch.float64) * 3 + 1
        x.requires_grad_()
        model(x).square().sum().backward()
        return type(model[1]).__name__, x.grad, model[0].weight.grad
    finally:
        fingerprint.reset()


def test_a_layer_fused_on_one_rank_only_sums_like_with_like(pool):
    """SyncBatchNorm and SyncBatchNormAct of one name and width share the fingerprint, so
    their backward sums are added together: the fused layer sent sum dy xhat where the
    other sent sum dy (x - mean), and both ranks' gradients came out wrong without an
    error (the first conv's weight gradient changed sign). Now every path sends the
    latter. Tolerance: float64 throughout, a few dozen operations on sums of 100
    elements of order 1 to 10 in either form: rounding far below 1e-9 relative, where the
    mixed sums were off by order 1."""
    plain = pool.run(fused_on_job, (), timeout=120)[:2]
    mixed = pool.run(fused_on_job, (1,), timeout=120)[:2]
    assert [m[0] for m in mixed] == ["SyncBatchNorm", "SyncBatchNormAct"]
    for want, got in zip(plain, mixed):
        for a, b in zip(want[1:], got[1:]):
            scale = float(a.abs().max())
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9 * scale)
