"""Revert gives back a layer that takes every input the converted one took.

A layer whose plain origin is recorded (``BatchNorm1d/2d/3d``, a subclass of one, another
library's any-rank batch norm such as mmengine's ``_BatchNormXd``) goes back to exactly
that class. A layer of unknown or synchronizing origin (``torch.nn.SyncBatchNorm``, as
MONAI's ``norm="syncbatch"`` builds; a ``syncbn.SyncBatchNorm`` built directly) goes back
to ``syncbn.torch.BatchNormNd``: torch's own ``_BatchNorm.forward`` with
``torch.nn.SyncBatchNorm``'s input check. (It used to go back to ``BatchNorm2d``, whose
check refuses the 5-D inputs of every 3-D model: "expected 4D input (got 5D input)".)

Each model is compared with the same model built with ``torch.nn.BatchNorm{1,2,3}d`` and
the same state: the kernel is the same (``F.batch_norm``), so outputs and running buffers
must be bitwise equal, in training and in eval mode.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn
from syncbn.torch import BatchNormNd


class AnyRankBatchNorm(_BatchNorm):
    """Stands for another library's rank-agnostic batch norm (mmengine's ``_BatchNormXd``:
    torch's forward, no input-dimension check)."""

    def _check_input_dim(self, input):
        return


# how each source builds its batch norm; None: built as torch's BatchNorm{1,2,3}d itself
SOURCES = {
    "torch-SyncBatchNorm": lambda c: nn.SyncBatchNorm(c, eps=1e-3, momentum=0.3),
    "syncbn-SyncBatchNorm": lambda c: syncbn.SyncBatchNorm(c, eps=1e-3, momentum=0.3),
    "another-library": lambda c: AnyRankBatchNorm(c, eps=1e-3, momentum=0.3),
    "BatchNormNd": lambda c: BatchNormNd(c, eps=1e-3, momentum=0.3),
}
TORCH_BN = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def build(dims: int, norm) -> nn.Module:
    """A small model with ``dims`` spatial dimensions (0: a Linear model on (N, C) inputs),
    its batch norms made by ``norm(channels)``; the same weights for the same ``dims``."""
    torch.manual_seed(dims)
    if dims == 0:
        first, second = nn.Linear(3, 4), nn.Linear(4, 5)
    else:
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
        first, second = conv(3, 4, 3, padding=1), conv(4, 5, 1)
    model = nn.Sequential(first, norm(4), nn.ReLU(), second, norm(5))
    return stir_batch_norms(model, 100 + dims)


def stir_batch_norms(model: nn.Module, seed: int) -> nn.Module:
    """Every batch-norm parameter and buffer of ``model`` away from its initial value
    (uniform in [0.5, 1.5) from ``seed``, ``num_batches_tracked`` 3), so that a load or a
    copy that skips or re-initialises one shows; returns ``model``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                for t in (m.weight, m.bias, m.running_mean, m.running_var):
                    t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
                m.num_batches_tracked.fill_(3)
    return model


def inputs(dims: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((3, 3) + (5,) * dims, generator=gen) * 2 + 1.5  # a non-zero mean


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state_dict(model, before):
    now = model.state_dict()
    assert list(now) == list(before)
    for key, value in before.items():
        assert now[key].dtype == value.dtype and torch.equal(now[key], value), key


def bn_types(model):
    return [type(m) for m in model.modules() if isinstance(m, _BatchNorm)]


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("dims", [0, 1, 2, 3], ids=["(N,C)", "1d", "2d", "3d"])
def test_a_layer_of_no_known_rank_reverts_to_one_that_takes_its_inputs(dims, source):
    """Convert, revert: every layer is a BatchNormNd (the any-rank class it came from, for
    another library's) holding the same tensors, and the model equals torch's
    BatchNorm{1,2,3}d model exactly, training and eval."""
    model = build(dims, SOURCES[source])
    before = snapshot(model)
    tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    model = syncbn.convert_sync_batchnorm(model, strict=True)
    assert bn_types(model) == [syncbn.SyncBatchNorm] * 2
    model = syncbn.revert_sync_batchnorm(model)
    assert_same_state_dict(model, before)
    for key, tensor in model.state_dict(keep_vars=True).items():
        assert tensor is tensors[key], f"{key}: not the same tensor"
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            assert (m.eps, m.momentum, m.affine, m.track_running_stats) == (1e-3, 0.3, True, True)

    reference = build(dims, lambda c: TORCH_BN[dims](c, eps=1e-3, momentum=0.3))
    reference.load_state_dict(before)
    for step in range(2):  # training: batch statistics, running buffers updated alike
        x = inputs(dims, step)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert_same_state_dict(model, snapshot(reference))
    model.eval()
    reference.eval()
    x = inputs(dims, 9)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert bn_types(model) == [AnyRankBatchNorm if source == "another-library" else BatchNormNd] * 2


class Plain3d(nn.BatchNorm3d):
    """A subclass that keeps torch's forward: it reverts to itself."""


@pytest.mark.parametrize("cls,want", [
    (nn.BatchNorm1d, nn.BatchNorm1d), (nn.BatchNorm2d, nn.BatchNorm2d), (nn.BatchNorm3d, nn.BatchNorm3d),
    (Plain3d, Plain3d),
], ids=["1d", "2d", "3d", "subclass-of-3d"])
def test_a_layer_from_a_rank_specific_class_reverts_to_that_class(cls, want):
    model = syncbn.convert_sync_batchnorm(nn.Sequential(cls(4, eps=1e-3)), strict=True)
    assert type(model[0]) is syncbn.SyncBatchNorm
    back = syncbn.revert_sync_batchnorm(model)
    assert type(back[0]) is want and back[0].eps == 1e-3 and back[0].num_features == 4


def test_batchnormnd_checks_its_input_as_torch_syncbatchnorm_does():
    layer = BatchNormNd(3)
    with pytest.raises(ValueError) as ours:
        layer(torch.randn(3))
    with pytest.raises(ValueError) as theirs:
        nn.SyncBatchNorm(3)(torch.randn(3))
    assert str(ours.value) == str(theirs.value) == "expected at least 2D input (got 1D input)"
    for shape in [(2, 3), (2, 3, 4), (2, 3, 2, 2), (2, 3, 2, 2, 2), (2, 3, 2, 1, 2, 2)]:
        assert layer(torch.randn(shape)).shape == shape


def test_batchnormnd_is_torch_batchnorm_and_exports_as_such():
    """torch's own forward (F.batch_norm, never a collective): it exports to aten's
    batch norm."""
    assert BatchNormNd.forward is _BatchNorm.forward
    model = syncbn.revert_sync_batchnorm(syncbn.convert_sync_batchnorm(build(3, SOURCES["torch-SyncBatchNorm"])))
    model.eval()
    x = inputs(3, 0)
    expected = model(x)
    exported = torch.export.export(model, (x,))
    torch.testing.assert_close(exported.module()(x), expected, rtol=0, atol=0)


def test_batchnormnd_is_a_plain_batch_norm_to_every_converter():
    """syncbn's conversion takes it (and reverting gives it again, same tensors); torch's
    and timm's conversions turn it into torch.nn.SyncBatchNorm with the same values."""
    model = build(3, SOURCES["BatchNormNd"])
    before = snapshot(model)
    tensors = [model[1].weight, model[1].running_mean]
    converted = syncbn.convert_sync_batchnorm(model, strict=True)
    assert bn_types(converted) == [syncbn.SyncBatchNorm] * 2
    back = syncbn.revert_sync_batchnorm(converted)
    assert bn_types(back) == [BatchNormNd] * 2 and [back[1].weight, back[1].running_mean] == tensors
    assert_same_state_dict(back, before)
    theirs = [nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(back))]
    timm_layers = pytest.importorskip("timm.layers")
    theirs.append(timm_layers.convert_sync_batchnorm(copy.deepcopy(back)))
    for other in theirs:
        assert bn_types(other) == [nn.SyncBatchNorm] * 2
        assert_same_state_dict(other, before)


def test_monai_3d_unet_built_with_syncbatchnorm_reverts_and_runs():
    """The issue's model: MONAI's UNet(spatial_dims=3, norm="syncbatch"), torch.nn.SyncBatchNorm
    layers, converted and reverted, runs its 5-D input and computes what it computed."""
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                      norm="syncbatch")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # batch norms away from the identity that a fresh init computes
        for m in model.modules():
            if isinstance(m, _BatchNorm):
                for t in (m.weight, m.bias, m.running_mean, m.running_var):
                    t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
    count = len(bn_types(model))
    assert count > 0 and bn_types(model) == [nn.SyncBatchNorm] * count
    model.eval()
    x = torch.randn(1, 1, 16, 16, 16, generator=gen) + 0.5
    expected = model(x)
    before = snapshot(model)
    model = syncbn.revert_sync_batchnorm(syncbn.convert_sync_batchnorm(model, strict=True))
    assert_same_state_dict(model, before)
    assert not model.training
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert bn_types(model) == [BatchNormNd] * count
