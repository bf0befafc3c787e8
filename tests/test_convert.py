"""convert_sync_batchnorm / revert_sync_batchnorm on a torchvision-like model built here."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import syncbn
from verify_models import BasicBlock  # the same torchvision-style block the verify tests use


def tiny_resnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        BasicBlock(8, 8),
        BasicBlock(8, 16, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.BatchNorm1d(16, affine=False),
        nn.Linear(16, 5),
    )


def _randomize_buffers(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.affine:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)


def test_round_trip_keeps_outputs_and_state():
    model = tiny_resnet()
    _randomize_buffers(model)
    x = torch.randn(4, 3, 8, 8) + 1
    model.eval()
    ref_eval = model(x)
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = {id(p) for p in model.parameters()}

    converted = syncbn.convert_sync_batchnorm(model)
    n_sync = sum(isinstance(m, syncbn.SyncBatchNorm) for m in converted.modules())
    assert n_sync == 7
    assert not any(type(m) in (nn.BatchNorm1d, nn.BatchNorm2d) for m in converted.modules())
    assert {id(p) for p in converted.parameters()} == params_before  # optimizers stay valid
    assert not converted.training
    torch.testing.assert_close(converted(x), ref_eval, rtol=0, atol=0)
    assert list(converted.state_dict()) == list(ref_state)

    converted.train()
    train_out = converted(x)
    reference = tiny_resnet()
    reference.load_state_dict(ref_state)
    reference.train()
    torch.testing.assert_close(train_out, reference(x), rtol=0, atol=0)

    reverted = syncbn.revert_sync_batchnorm(converted)
    kinds = [type(m) for m in reverted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert kinds == [nn.BatchNorm2d] * 6 + [nn.BatchNorm1d]
    reverted.eval()
    reference.eval()
    torch.testing.assert_close(reverted(x), reference(x), rtol=0, atol=0)
    for (k1, v1), (k2, v2) in zip(reverted.state_dict().items(), reference.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


def test_keeps_flags_dtype_and_missing_bias():
    model = nn.Sequential(nn.BatchNorm2d(4, bias=False), nn.BatchNorm3d(2, track_running_stats=False))
    model = model.double()
    model[0].weight.requires_grad_(False)
    model.eval()
    model[1].train()
    out = syncbn.convert_sync_batchnorm(model)
    assert out[0].bias is None and not out[0].weight.requires_grad
    assert out[0].weight.dtype == torch.float64 and out[0].running_mean.dtype == torch.float64
    assert not out[0].training and out[1].training
    assert out[1].running_mean is None and not out[1].track_running_stats
    back = syncbn.revert_sync_batchnorm(out)
    assert type(back[0]) is nn.BatchNorm2d and type(back[1]) is nn.BatchNorm3d
    assert back[0].bias is None and list(back[0].state_dict()) == list(nn.BatchNorm2d(4, bias=False).state_dict())


def test_top_level_and_torch_syncbn_are_converted():
    bn = nn.BatchNorm1d(3)
    assert isinstance(syncbn.convert_sync_batchnorm(bn), syncbn.SyncBatchNorm)
    torch_sync = nn.SyncBatchNorm(3, momentum=0.3, eps=1e-3)
    ours = syncbn.convert_sync_batchnorm(torch_sync)
    assert isinstance(ours, syncbn.SyncBatchNorm) and ours.momentum == 0.3 and ours.eps == 1e-3
    assert type(syncbn.revert_sync_batchnorm(ours)) is nn.BatchNorm2d


class BatchNormAct(nn.BatchNorm2d):
    """Like timm's BatchNormAct2d: BN followed by an activation in the same module."""

    def forward(self, x):
        return F.relu(super().forward(x))


class PlainSubclass(nn.BatchNorm2d):
    pass


def test_subclass_overriding_forward_is_left_with_a_warning():
    model = nn.Sequential(BatchNormAct(4), PlainSubclass(4), BatchNormAct(4), nn.BatchNorm1d(4))
    with pytest.warns(UserWarning, match=r"left 2 of 4 BatchNorm layers local .*2 x test_convert\.BatchNormAct "):
        out = syncbn.convert_sync_batchnorm(model)
    assert type(out[0]) is BatchNormAct and type(out[2]) is BatchNormAct
    assert isinstance(out[1], syncbn.SyncBatchNorm)
    assert type(syncbn.revert_sync_batchnorm(out)[1]) is nn.BatchNorm2d


def test_strict_raises_before_changing_anything():
    model = nn.Sequential(nn.BatchNorm2d(4), BatchNormAct(4))
    with pytest.raises(ValueError, match=r"left 1 of 2 BatchNorm layers local"):
        syncbn.convert_sync_batchnorm(model, strict=True)
    assert type(model[0]) is nn.BatchNorm2d  # untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), strict=True)
    assert isinstance(out[0], syncbn.SyncBatchNorm)


class SyncBatchNormRelu(syncbn.SyncBatchNorm):
    def forward(self, x):
        return F.relu(super().forward(x))


def test_registered_conversion_round_trip():
    from syncbn.convert import _CONVERSIONS, _move_state

    def to_sync(layer, group):
        new = SyncBatchNormRelu(layer.num_features, process_group=group, device="meta")
        return _move_state(layer, new)

    def to_plain(layer):
        return _move_state(layer, BatchNormAct(layer.num_features, device="meta"))

    syncbn.register_conversion(BatchNormAct, to_sync, to_plain)
    try:
        model = nn.Sequential(BatchNormAct(3), nn.Sequential(BatchNormAct(3)), PlainSubclass(3))
        _randomize_buffers(model)
        x = torch.randn(4, 3, 2, 2)
        expected = model.eval()(x)
        params = [id(p) for p in model.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = syncbn.convert_sync_batchnorm(model, strict=True)
        assert [type(m) for m in (out[0], out[1][0], out[2])] == [SyncBatchNormRelu, SyncBatchNormRelu, syncbn.SyncBatchNorm]
        assert out[0]._syncbn_origin is BatchNormAct
        torch.testing.assert_close(out(x), expected, rtol=0, atol=0)
        back = syncbn.revert_sync_batchnorm(out)
        assert [type(m) for m in (back[0], back[1][0], back[2])] == [BatchNormAct, BatchNormAct, nn.BatchNorm2d]
        assert [id(p) for p in back.parameters()] == params
        torch.testing.assert_close(back(x), expected, rtol=0, atol=0)
    finally:
        del _CONVERSIONS[BatchNormAct]
    with pytest.raises(TypeError):
        syncbn.register_conversion(object, to_sync, to_plain)
    with pytest.raises(TypeError):
        syncbn.register_conversion(BatchNormAct, to_sync, None)


def test_revert_keeps_an_unregistered_subclass_that_overrides_forward():
    layer = nn.Sequential(SyncBatchNormRelu(3))
    assert type(syncbn.revert_sync_batchnorm(layer)[0]) is SyncBatchNormRelu


def test_uninitialized_lazy_batchnorm_is_left_with_a_warning():
    model = nn.Sequential(nn.LazyBatchNorm2d())
    with pytest.warns(UserWarning, match="lazy"):
        syncbn.convert_sync_batchnorm(model)
    model(torch.randn(2, 3, 4, 4))  # initialized: it is a BatchNorm2d now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = syncbn.convert_sync_batchnorm(model)
    assert isinstance(out[0], syncbn.SyncBatchNorm)


def test_process_group_is_set():
    marker = object()
    out = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(2)), process_group=marker)
    assert out[0].process_group is marker
