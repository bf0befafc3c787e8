"""Conversion round trips keep every constructor field and every parameter and buffer.

``convert_sync_batchnorm`` / ``fuse_batchnorm_act`` and ``revert_sync_batchnorm`` (of a
converted layer, of a fused pair, and of a ``SyncBatchNormAct`` built directly) must
carry ``num_features``, ``eps``, ``momentum``, ``affine``, ``track_running_stats``,
the process group, the activation and its parameter, the presence of ``bias``, the
``training`` flag, and the very same parameter and buffer tensors with their values
(including ``num_batches_tracked`` and buffers that are absent). Each layer is built
with values that differ from every default, so a field reset to its default shows.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn
from syncbn.torch import BatchNormNd
from torch_compat import torch_batchnorm

FIELDS = ("num_features", "eps", "momentum", "affine", "track_running_stats")

# (class, constructor keywords): every field away from its default at least once
CONFIGS = [
    (nn.BatchNorm1d, dict(num_features=3, eps=1e-3, momentum=0.3)),
    (nn.BatchNorm2d, dict(num_features=4, eps=2e-4, momentum=None)),
    (nn.BatchNorm3d, dict(num_features=2, eps=1e-5, momentum=0.05, affine=False)),
    (nn.BatchNorm2d, dict(num_features=5, eps=3e-3, momentum=0.2, track_running_stats=False)),
    (nn.BatchNorm2d, dict(num_features=3, eps=1e-4, momentum=0.7, bias=False)),
    (nn.BatchNorm1d, dict(num_features=2, momentum=None, affine=False, track_running_stats=False)),
    (nn.SyncBatchNorm, dict(num_features=3, eps=5e-4, momentum=0.4)),
    (BatchNormNd, dict(num_features=4, eps=2e-3, momentum=0.15, bias=False)),
]
CONFIG_IDS = [f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for cls, kw in CONFIGS]


class Group:
    """Stands for a process group: conversion only stores it (never uses it) here."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Group({self.name})"


def make_bn(cls, kwargs, group=None):
    """The layer with every parameter and buffer away from its initial value."""
    if cls is nn.SyncBatchNorm:
        bn = torch_batchnorm(cls, **kwargs, process_group=group)
    else:
        bn = torch_batchnorm(cls, **kwargs)
    gen = torch.Generator().manual_seed(kwargs["num_features"])
    with torch.no_grad():
        for t in list(bn.parameters()) + [b for b in bn.buffers() if b.is_floating_point()]:
            t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
        if bn.num_batches_tracked is not None:
            bn.num_batches_tracked.fill_(7)
    if bn.weight is not None:
        bn.weight.requires_grad_(False)  # a frozen weight stays frozen
    bn.eval()  # and a non-default mode is kept
    return bn


def fields(m):
    out = {name: getattr(m, name) for name in FIELDS}
    out["bias"] = m.bias is not None
    return out


def state(m):
    """Every parameter and buffer slot, absent ones included: name -> tensor or None."""
    return {**{f"p.{k}": v for k, v in m._parameters.items()}, **{f"b.{k}": v for k, v in m._buffers.items()}}


def snapshot(m):
    return {k: None if v is None else (v, v.detach().clone(), v.requires_grad) for k, v in state(m).items()}


def assert_same_state(m, before):
    """Same slots, the very same tensors, unchanged values, dtypes and requires_grad."""
    now = state(m)
    assert sorted(now) == sorted(before), (sorted(now), sorted(before))
    for key, old in before.items():
        if old is None:
            assert now[key] is None, key
            continue
        tensor, value, requires_grad = old
        assert now[key] is tensor, f"{key}: not the same tensor"
        assert now[key].dtype == value.dtype and torch.equal(now[key], value), key
        assert now[key].requires_grad == requires_grad, key


def expected_group(bn, given):
    if given is not None:
        return given
    return bn.process_group if isinstance(bn, (nn.SyncBatchNorm, syncbn.SyncBatchNorm)) else None


def plain_class(cls):
    """What revert gives back: the rank-specific class, else the any-rank BatchNormNd."""
    return BatchNormNd if cls is nn.SyncBatchNorm else cls


@pytest.mark.parametrize("given", [None, Group("given")], ids=["default-group", "explicit-group"])
@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=CONFIG_IDS)
def test_convert_and_revert_keep_every_field_and_buffer(cls, kwargs, given):
    bn = make_bn(cls, kwargs, group=Group("own"))
    want, before, group = fields(bn), snapshot(bn), expected_group(bn, given)
    model = syncbn.convert_sync_batchnorm(nn.Sequential(bn), process_group=given)
    ours = model[0]
    assert type(ours) is syncbn.SyncBatchNorm
    assert fields(ours) == want
    assert ours.process_group is group
    assert not ours.training
    assert_same_state(ours, before)

    back = syncbn.revert_sync_batchnorm(model)[0]
    assert type(back) is plain_class(cls)
    assert fields(back) == want
    assert not back.training
    assert_same_state(back, before)


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=CONFIG_IDS)
def test_converting_a_bare_layer_keeps_every_field(cls, kwargs):
    """The root itself is a batch norm: a new root comes back, with the same fields."""
    bn = make_bn(cls, kwargs, group=Group("own"))
    want, before = fields(bn), snapshot(bn)
    ours = syncbn.convert_sync_batchnorm(bn)
    assert type(ours) is syncbn.SyncBatchNorm and fields(ours) == want
    assert ours.process_group is expected_group(bn, None)
    assert_same_state(ours, before)
    back = syncbn.revert_sync_batchnorm(ours)
    assert type(back) is plain_class(cls) and fields(back) == want
    assert_same_state(back, before)


ACTIVATIONS = [
    (nn.LeakyReLU(0.2), "leaky_relu", 0.2),
    (nn.LeakyReLU(0.01), "leaky_relu", 0.01),
    (nn.ELU(0.7), "elu", 0.7),
    (nn.ELU(1.0), "elu", 1.0),
]


def activation_fields(act):
    if isinstance(act, nn.LeakyReLU):
        return (nn.LeakyReLU, act.negative_slope, act.inplace)
    if isinstance(act, nn.ELU):
        return (nn.ELU, act.alpha, act.inplace)
    return (type(act),)


@pytest.mark.parametrize("given", [None, Group("given")], ids=["default-group", "explicit-group"])
@pytest.mark.parametrize("act,name,param", ACTIVATIONS, ids=[f"{a[1]}-{a[2]}" for a in ACTIVATIONS])
@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=CONFIG_IDS)
def test_fuse_and_revert_keep_every_field_and_buffer(cls, kwargs, act, name, param, given):
    bn = make_bn(cls, kwargs, group=Group("own"))
    want, before, group = fields(bn), snapshot(bn), expected_group(bn, given)
    model = syncbn.fuse_batchnorm_act(nn.Sequential(bn, act), process_group=given)
    fused = model[0]
    assert type(fused) is syncbn.SyncBatchNormAct
    assert fields(fused) == want
    assert fused.process_group is group
    assert fused.activation == name
    if param is not None:
        assert fused.activation_param == param
    assert not fused.training
    assert_same_state(fused, before)

    back = syncbn.revert_sync_batchnorm(model)
    assert type(back[0]) is plain_class(cls) and fields(back[0]) == want
    assert not back[0].training
    assert_same_state(back[0], before)
    assert back[1] is act and activation_fields(back[1]) == activation_fields(act)


@pytest.mark.parametrize("cls,kwargs", CONFIGS, ids=CONFIG_IDS)
def test_batch_norm_before_an_identity_is_never_fused(cls, kwargs):
    """Nothing to save, and the next module may work in place on the output: the pair
    stays exactly as it was (the same modules, fields and state)."""
    bn, act = make_bn(cls, kwargs, group=Group("own")), nn.Identity()
    want, before = fields(bn), snapshot(bn)
    model = syncbn.fuse_batchnorm_act(nn.Sequential(bn, act))
    assert model[0] is bn and model[1] is act and fields(model[0]) == want
    assert_same_state(model[0], before)


def test_fusing_a_converted_layer_keeps_its_group_and_fields():
    bn = make_bn(nn.BatchNorm2d, dict(num_features=3, eps=1e-3, momentum=0.3, bias=False))
    want, before = fields(bn), snapshot(bn)
    group = Group("converted")
    model = syncbn.convert_sync_batchnorm(nn.Sequential(bn, nn.ELU(0.5)), process_group=group)
    model = syncbn.fuse_batchnorm_act(model)
    assert type(model[0]) is syncbn.SyncBatchNormAct and model[0].process_group is group
    assert fields(model[0]) == want and model[0].activation_param == 0.5
    assert_same_state(model[0], before)
    back = syncbn.revert_sync_batchnorm(model)
    assert type(back[0]) is nn.BatchNorm2d and fields(back[0]) == want
    assert_same_state(back[0], before)


@pytest.mark.parametrize("name,param,act_cls,attr", [
    ("leaky_relu", 0.2, nn.LeakyReLU, "negative_slope"),
    ("leaky_relu", 3.0, nn.LeakyReLU, "negative_slope"),
    ("elu", 0.3, nn.ELU, "alpha"),
    ("identity", 0.01, nn.Identity, None),
])
@pytest.mark.parametrize("kwargs", [
    dict(eps=1e-3, momentum=0.3),
    dict(eps=2e-4, momentum=None, affine=False),
    dict(eps=1e-5, momentum=0.6, track_running_stats=False, bias=False),
], ids=["momentum0.3", "no-affine", "untracked-no-bias"])
def test_standalone_fused_layer_reverts_to_batchnorm_and_its_activation(name, param, act_cls, attr, kwargs):
    """A SyncBatchNormAct built directly becomes Sequential(BatchNormNd, activation),
    with the activation's parameter and every batch-norm field and tensor."""
    layer = syncbn.SyncBatchNormAct(4, name, param, process_group=Group("own"), **kwargs)
    with torch.no_grad():
        for t in list(layer.parameters()) + [b for b in layer.buffers() if b.is_floating_point()]:
            t.uniform_(0.5, 1.5)
    want, before = fields(layer), snapshot(layer)
    back = syncbn.revert_sync_batchnorm(layer)
    assert type(back) is nn.Sequential and len(back) == 2
    assert type(back[0]) is BatchNormNd and fields(back[0]) == want
    assert_same_state(back[0], before)
    assert type(back[1]) is act_cls
    if attr is not None:
        assert getattr(back[1], attr) == param


def test_round_trip_through_both_conversions_computes_the_same_function():
    """Values too, not only fields: training then eval outputs of the reverted model
    equal the original's (a wrong eps or momentum would show here as well)."""
    torch.manual_seed(0)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3, eps=1e-2, momentum=0.5), nn.LeakyReLU(0.3),
            nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, momentum=None, eps=0.5), nn.ELU(0.4),
        )

    ref, model = build(), build()
    model = syncbn.revert_sync_batchnorm(syncbn.fuse_batchnorm_act(syncbn.convert_sync_batchnorm(model)))
    x = torch.randn(4, 2, 5, 5, dtype=torch.float32) * 2 + 1
    for _ in range(3):
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    assert not any(isinstance(m, (syncbn.SyncBatchNorm, syncbn.SyncBatchNormAct)) for m in model.modules())
    assert all(type(m) is nn.BatchNorm2d for m in model.modules() if isinstance(m, _BatchNorm))
