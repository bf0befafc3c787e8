"""timm's norm-act layers under convert/revert: every BatchNorm layer of timm's
EfficientNet, RegNet and MobileNetV3 is synchronized (timm's ``BatchNormAct2d`` and the
``SyncBatchNormAct`` of timm's own converter), with the same ``drop``/``act`` modules and
state_dict keys; revert gives timm's class back; and 2 ranks of the converted model
compute exactly what one process computes on the concatenated batch."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn
import torchvision_shim
from test_conversion import _seeded, check_hooks_and_attributes_move
from workers import group_of, in_group

torchvision_shim.install()  # here too: the pool's workers import this module, not conftest
timm = pytest.importorskip("timm")

from syncbn.torch.timm import SyncBatchNormDropAct  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# model -> number of BatchNorm layers (all of them timm BatchNormAct2d)
MODELS = {"efficientnet_b0": 49, "regnetx_002": 44, "mobilenetv3_small_100": 34}
WORLD, PER_RANK, SIZE = 2, 2, 32


def build(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=6, drop_rate=0.0, drop_path_rate=0.0)
    # running statistics and affine parameters away from their defaults (seeded again)
    return _seeded(model.double())


def _bn(model):
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_norm_act_layer_is_converted_and_reverted(name):
    model = build(name)
    layers = _bn(model)
    assert len(layers) == MODELS[name] and all(type(m) is timm.layers.BatchNormAct2d for m in layers)
    acts = [(m.drop, m.act) for m in layers]
    ref = copy.deepcopy(model).eval()
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left local, so no warning
        model = syncbn.convert_sync_batchnorm(model)
    synced = _bn(model)
    assert len(synced) == MODELS[name] and all(type(m) is SyncBatchNormDropAct for m in synced)
    assert [(m.drop, m.act) for m in synced] == acts  # the very same modules
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    x = torch.randn(2, 3, SIZE, SIZE, dtype=torch.float64)
    torch.testing.assert_close(model.eval()(x), ref(x), rtol=0, atol=0)
    torch.testing.assert_close(model.train()(x), ref.train()(x), rtol=0, atol=0)
    back = syncbn.revert_sync_batchnorm(model)
    assert [type(m) for m in _bn(back)] == [timm.layers.BatchNormAct2d] * MODELS[name]
    assert [(m.drop, m.act) for m in _bn(back)] == acts and list(back.state_dict()) == keys
    assert not any(set(vars(m)) - set(vars(timm.layers.BatchNormAct2d(1))) for m in _bn(back))  # nothing stray
    torch.testing.assert_close(back.eval()(x), ref.eval()(x), rtol=0, atol=0)


def test_a_hooked_norm_act_layer_moves_with_its_hooks():
    """The converter moves a hooked timm layer's hooks, attributes and child modules as it
    moves a plain batch norm's, through convert and revert. It was left local ('it has
    hooks'), so a framework's hook kept the layer out of synchronization."""
    check_hooks_and_attributes_move(
        build("mobilenetv3_small_100"), lambda model: _bn(model)[0], ("SyncBatchNormDropAct", "BatchNormAct2d"),
        lambda seed: torch.randn(2, 3, SIZE, SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)),
    )


def test_timm_sync_layers_and_input_checks():
    model = timm.layers.convert_sync_batchnorm(build("mobilenetv3_small_100"))
    theirs = [m for m in model.modules() if isinstance(m, timm.layers.SyncBatchNormAct)]
    assert len(theirs) == MODELS["mobilenetv3_small_100"]
    model = syncbn.convert_sync_batchnorm(model, strict=True)
    assert [type(m) for m in _bn(model)] == [SyncBatchNormDropAct] * len(theirs)
    assert [type(m) for m in _bn(syncbn.revert_sync_batchnorm(model))] == [timm.layers.BatchNormAct2d] * len(theirs)
    # a BatchNormAct2d takes NCHW only, like timm's
    layer = syncbn.convert_sync_batchnorm(timm.layers.BatchNormAct2d(3))
    with pytest.raises(ValueError, match="4D"):
        layer(torch.randn(4, 3))
    assert layer(torch.randn(2, 3, 2, 2)).shape == (2, 3, 2, 2)


def test_fuse_leaves_timm_resnet_drop_block_alone():
    """timm's resnet18: BN, then an Identity drop_block, then ReLU(inplace=True)."""
    model = timm.create_model("resnet18", pretrained=False, num_classes=4)
    ref = copy.deepcopy(model)
    syncbn.fuse_batchnorm_act(model)
    assert not any(isinstance(m, syncbn.SyncBatchNormAct) for m in model.modules())
    x = torch.randn(2, 3, 16, 16)
    model(x).sum().backward()  # with BN + Identity fused, this failed (in-place ReLU)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


# ---- 2 ranks against one process on the whole batch ---------------------------------------


def batch(name):
    gen = torch.Generator().manual_seed(len(name))
    x = torch.randn(WORLD * PER_RANK, 3, SIZE, SIZE, generator=gen, dtype=torch.float64) * 2 + 0.5
    g = torch.randn(WORLD * PER_RANK, 6, generator=gen, dtype=torch.float64)
    return x, g


def step(model, x, g):
    """One training forward and backward; what a data-parallel step would leave."""
    out = model(x)
    (out * g).sum().backward()
    return out.detach()


def rank_job(name):
    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    rank = torch.distributed.get_rank()
    model = syncbn.convert_sync_batchnorm(build(name).train(), process_group=group)
    x, g = batch(name)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out = step(model, x[rows], g[rows])
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.distributed.all_reduce(grads, group=group)  # the gradient of the whole batch's loss
    buffers = {k: v for k, v in model.state_dict().items() if "running" in k}
    return {"out": out, "grads": grads if rank == 0 else None, "buffers": buffers}


def reference(name, x, g):
    model = build(name).train()
    out = step(model, x, g)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    buffers = {k: v for k, v in model.state_dict().items() if "running" in k}
    return out, grads, buffers


def _close(actual, expected, spread, what):
    """The tolerance is the model's own conditioning: 10x the change of one process's
    result when the inputs move by a few ulp (``spread``; syncbn's differences are
    rounding differences of the same size inside the network), plus 64 ulp of the
    quantity's scale for quantities that move by less than that. NaN/inf fail."""
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), what
    scale = float(expected.abs().max())
    tol = 10 * float(spread.abs().max()) + 64 * torch.finfo(torch.float64).eps * scale
    err = float((actual - expected).abs().max())
    assert err <= tol, f"{what}: {err:.3g} > {tol:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_two_ranks_equal_one_big_batch(pool, name):
    results = pool.run(rank_job, name, timeout=300)[:WORLD]
    x, g = batch(name)
    out, grads, buffers = reference(name, x, g)
    # the same run with inputs a few ulp away: how far rounding alone moves the results
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    out2, grads2, buffers2 = reference(name, x * (1 + 4 * torch.finfo(x.dtype).eps * noise), g)
    _close(torch.cat([r["out"] for r in results]), out, out2 - out, "outputs")
    _close(results[0]["grads"], grads, grads2 - grads, "gradients")
    for key, ref in buffers.items():
        for r in results:
            _close(r["buffers"][key], ref, buffers2[key] - ref, key)


def test_a_converted_model_traces_with_torch_fx_as_timm_s_does():
    """torch.fx (torchvision's create_feature_extractor, ...) traces timm's BatchNormAct2d;
    the converted layer is recorded as one call of the layer, as syncbn.SyncBatchNorm is
    (its forward cannot be traced: it checks and reads values). Tracing it failed with
    'symbolically traced variables cannot be used as inputs to control flow'."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1), timm.layers.BatchNormAct2d(4, act_layer=nn.SiLU, drop_layer=lambda: nn.Dropout(0.5)),
    ).double()
    torch.fx.symbolic_trace(model)  # timm's own layer traces
    model = syncbn.convert_sync_batchnorm(model, strict=True)
    graph = torch.fx.symbolic_trace(model)
    assert [n.target for n in graph.graph.nodes if n.op == "call_module"] == ["0", "1"]
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    model.eval()
    graph.eval()
    assert torch.equal(graph(x), model(x))  # the same layer called: the same values
