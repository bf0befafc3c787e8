"""A converted model under the torch features training jobs combine it with, on the
session's gloo pool (W = 2, CPU, float64), against one process on the concatenated batch:
FSDP2 ``fully_shard`` and FSDP1 on a CPU mesh; DDP with ``static_graph``,
``find_unused_parameters`` and gradient accumulation under ``no_sync()``;
``torch.func.functional_call`` with substituted parameters and buffers in training; and,
for deployment without a revert, ``torch.export.export``, ``torch.jit.trace`` and
``functional_call`` in eval mode, where ``torch.jit.script`` raises an error naming the fix
(training-mode capture, ``torch.export.export`` included, is test_training_capture.py's).

(``torch.nn.SyncBatchNorm`` cannot take part here: in training it raises on CPU inputs.)
Buffers under DDP's default ``broadcast_buffers`` are covered by test_batchnorm_ddp.py and
test_ddp_buffers.py."""

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import syncbn
from workers import group_of, in_group

WORLD, PER_RANK, STEPS, MICRO = 2, 3, 3, 3
# float64 data through a few layers and steps: rounding ~n * 2^-53 * (condition) ~1e-14;
# the bound of the other DDP tests, 1e-10, leaves 100x or more (NaN fails assert_close)
TOL = dict(rtol=1e-10, atol=1e-10)


class Net(nn.Module):
    """conv-BN-ReLU twice (one BN with momentum=None) and a head; with ``unused`` a
    layer the forward never uses (for ``find_unused_parameters``)."""

    def __init__(self, unused=False):
        super().__init__()
        torch.manual_seed(5)
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.LeakyReLU(0.1),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        self.unused = nn.Linear(2, 2) if unused else None
        self.double()

    def forward(self, x):
        return self.head(self.body(x))


def batch(step, rank=None):
    gen = torch.Generator().manual_seed(77 + step)
    x = torch.randn(WORLD * PER_RANK, 3, 5, 5, generator=gen, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 3, (WORLD * PER_RANK,), generator=gen)
    if rank is None:
        return x, y
    return x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]


def train(model, rank=None, micro=1, no_sync=None, synced_first=False):
    """STEPS optimizer steps of ``micro`` micro-batches each (the loss divided by
    ``micro``), all but the last under ``no_sync`` when given; with ``synced_first`` the
    first step is a single micro-batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        count = 1 if synced_first and step == 0 else micro
        for i in range(count):
            x, y = batch(10 * step + i, rank)
            quiet = no_sync() if no_sync is not None and i < count - 1 else contextlib.nullcontext()
            with quiet:
                (F.cross_entropy(model(x), y) / count).backward()
        opt.step()


def full_state(model):
    """The state dict with plain keys and full (unsharded) tensors."""
    out = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # FSDP2's sharded DTensor
            value = value.full_tensor()
        for wrapper in ("module.", "_fsdp_wrapped_module."):
            key = key.replace(wrapper, "")
        out[key] = value.detach().clone()
    return out


def reference(unused=False, **kwargs):
    model = Net(unused)
    train(model, **kwargs)
    return full_state(model)


def assert_matches(results, ref):
    assert any("running_var" in k for k in ref) and any("num_batches_tracked" in k for k in ref)
    for state in results:
        assert state.keys() == ref.keys()
        for key, value in ref.items():
            torch.testing.assert_close(state[key], value, **TOL, msg=key)


# ---- FSDP ---------------------------------------------------------------------------


def fsdp2_job(per_layer):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")
    model = syncbn.convert_sync_batchnorm(Net(), process_group=group)
    if per_layer:  # each conv and each BN its own FSDP unit, as an auto-wrap policy would
        for layer in model.body:
            if isinstance(layer, (nn.Conv2d, syncbn.SyncBatchNorm)):
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert any(hasattr(p, "full_tensor") for p in model.parameters())  # really sharded
    train(model, dist.get_rank())
    return full_state(model)


def _has_public_fsdp2():
    import torch.distributed.fsdp

    return hasattr(torch.distributed.fsdp, "fully_shard")


# torch 2.4 has FSDP2 only as the prototype torch.distributed._composable.fsdp.fully_shard,
# which opens CUDA streams on its first forward even on a CPU mesh (tried on 2.4.1: "CUDA
# driver version is insufficient"); torch.distributed.fsdp.fully_shard runs on the CPU
@pytest.mark.skipif(not _has_public_fsdp2(), reason="torch.distributed.fsdp.fully_shard is missing on this torch "
                    "(torch 2.4's prototype FSDP2 needs CUDA even on a CPU mesh)")
@pytest.mark.parametrize("per_layer", [False, True], ids=["root", "per-layer"])
def test_fsdp2_fully_shard_on_cpu_trains_as_one_big_batch(pool, per_layer):
    assert_matches(pool.run(fsdp2_job, per_layer)[:WORLD], reference())


def fsdp1_job():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    model = syncbn.convert_sync_batchnorm(Net(), process_group=group)
    fsdp = FSDP(model, process_group=group, device_id=torch.device("cpu"), use_orig_params=True)
    train(fsdp, dist.get_rank())
    with warnings.catch_warnings():  # FSDP1's state-dict API is deprecated in favour of FSDP2's
        warnings.simplefilter("ignore", FutureWarning)
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT):
            return full_state(fsdp)


def test_fsdp1_on_cpu_trains_as_one_big_batch(pool):
    assert_matches(pool.run(fsdp1_job)[:WORLD], reference())


# ---- DDP variants ---------------------------------------------------------------------


def ddp_job(kwargs, micro, synced_first):
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    model = syncbn.convert_sync_batchnorm(Net(kwargs.get("find_unused_parameters", False)), process_group=group)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **kwargs)
    train(ddp, dist.get_rank(), micro=micro, no_sync=ddp.no_sync if micro > 1 else None, synced_first=synced_first)
    return full_state(ddp)


# static_graph with no_sync() in its very first iteration trips an internal assert of
# torch's reducer (reducer.cpp "expect_autograd_hooks_", also without any batch norm), so
# that case takes one synchronized step first
DDP_CASES = {
    "static_graph": ({"static_graph": True}, 1, False),
    "find_unused": ({"find_unused_parameters": True}, 1, False),
    "no_sync": ({}, MICRO, False),
    "no_sync+find_unused": ({"find_unused_parameters": True}, MICRO, False),
    "no_sync+static_graph": ({"static_graph": True}, MICRO, True),
}


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_variant_trains_as_one_big_batch(pool, case):
    kwargs, micro, synced_first = DDP_CASES[case]
    results = pool.run(ddp_job, kwargs, micro, synced_first)[:WORLD]
    unused = kwargs.get("find_unused_parameters", False)
    assert_matches(results, reference(unused, micro=micro, synced_first=synced_first))


# ---- torch.func.functional_call in training ---------------------------------------


def substitutes(model):
    """Parameters and buffers other than the module's own (a functional training step)."""
    params = {k: (v.detach() * 1.5 + 0.1).requires_grad_() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() + (0.3 if v.is_floating_point() else 2) for k, v in model.named_buffers()}
    return params, buffers


def functional_step(model, rank=None):
    params, buffers = substitutes(model)
    before = full_state(model)
    x, y = batch(0, rank)
    loss = F.cross_entropy(torch.func.functional_call(model, {**params, **buffers}, (x,)), y)
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    if rank is not None:  # the average a data-parallel wrapper takes
        for g in grads.values():
            dist.all_reduce(g, group=group_of(WORLD))
            g /= WORLD
    untouched = all(torch.equal(before[k], v) for k, v in full_state(model).items())
    return {"grads": grads, "buffers": buffers, "untouched": untouched}


def synchronized_net(fused):
    """This rank's converted Net on the W-rank group (fused when asked), or None on a rank
    outside it."""
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    model = syncbn.convert_sync_batchnorm(Net(), process_group=group)
    if fused:
        model = syncbn.fuse_batchnorm_act(model)
        assert isinstance(model.body[4], syncbn.SyncBatchNormAct)
    return model


def functional_call_job(fused):
    model = synchronized_net(fused)
    return None if model is None else functional_step(model, dist.get_rank())


@pytest.mark.parametrize("fused", [False, True], ids=["SyncBatchNorm", "SyncBatchNormAct"])
def test_functional_call_trains_the_substitutes(pool, fused):
    ref = functional_step(Net())
    for got in pool.run(functional_call_job, fused)[:WORLD]:
        assert got["untouched"] and ref["untouched"]  # the module's own tensors stay as they were
        for part in ("grads", "buffers"):
            assert got[part].keys() == ref[part].keys()
            for key, value in ref[part].items():
                torch.testing.assert_close(got[part][key], value, **TOL, msg=f"{part} {key}")


# ---- deployment without a revert: eval mode ----------------------------------------


def eval_export_job(fused):
    model = synchronized_net(fused)
    if model is None:
        return None
    train(model, dist.get_rank())
    model.eval()
    x, _ = batch(99)
    outs = {"eager": model(x).detach()}
    for strict in (False, True):
        outs[f"export strict={strict}"] = torch.export.export(model, (x,), strict=strict).module()(x).detach()
    outs["compile"] = torch.compile(model, backend="eager")(x).detach()
    outs["trace"] = torch.jit.trace(model, (x,))(x).detach()  # check_trace on: traced twice, compared
    outs["functional_call"] = torch.func.functional_call(model, dict(model.state_dict()), (x,)).detach()
    try:
        torch.jit.script(model)
        outs["script"] = "scripted"
    except RuntimeError as exc:
        outs["script"] = str(exc)
    reverted = syncbn.revert_sync_batchnorm(model)  # the fix the error names
    assert not any(isinstance(m, syncbn.SyncBatchNorm) for m in reverted.modules())
    outs["reverted script"] = torch.jit.script(reverted)(x).detach()
    return outs


@pytest.mark.parametrize("fused", [False, True], ids=["SyncBatchNorm", "SyncBatchNormAct"])
def test_eval_model_exports_traces_and_names_the_fix_for_script(pool, fused):
    results = pool.run(eval_export_job, fused)[:WORLD]
    for outs in results:
        assert "revert_sync_batchnorm" in outs.pop("script")
        eager = outs.pop("eager")
        assert torch.isfinite(eager).all()
        for how, out in outs.items():
            torch.testing.assert_close(out, eager, rtol=0, atol=0, msg=how)


# ---- the same in one process (no pool): each layer on its own --------------------------


@pytest.mark.parametrize("make", [lambda: syncbn.SyncBatchNorm(4),
                                  lambda: syncbn.SyncBatchNormAct(4, "leaky_relu", 0.1)],
                         ids=["SyncBatchNorm", "SyncBatchNormAct"])
def test_one_layer_in_eval_traces_and_names_the_fix_for_script(make):
    layer = make().double()
    with torch.no_grad():  # running statistics of an earlier training
        layer.running_mean.uniform_(-1, 1)
        layer.running_var.uniform_(0.5, 2)
        layer.weight.uniform_(0.5, 2)
    layer.eval()
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64) * 2 + 1
    eager = layer(x).detach()
    # check_trace traces a second time under no_grad and compares the graphs
    torch.testing.assert_close(torch.jit.trace(layer, (x,))(x), eager, rtol=0, atol=0)
    torch.testing.assert_close(torch.export.export(layer, (x,)).module()(x), eager, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=rf"syncbn\.{type(layer).__name__} cannot be compiled by "
                                           r"torch\.jit\.script.*revert_sync_batchnorm\(model\)"):
        torch.jit.script(layer)
