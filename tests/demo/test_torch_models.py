"""The shared segmentation model: shape, BatchNorm count, seeded init, conversion."""

import pytest
import torch

import syncbn
from syncbn.demo.torch_models import TinyUNet, build_segmentation_model, count_batchnorm


def test_output_shape_and_batchnorm_count():
    model = TinyUNet()
    assert count_batchnorm(model) == 14
    out = model(torch.randn(3, 1, 32, 32))
    assert out.shape == (3, 11, 32, 32)
    assert count_batchnorm(TinyUNet(depth=2)) == 10
    assert TinyUNet(in_channels=3, num_classes=5, depth=2)(torch.randn(2, 3, 16, 24)).shape == (2, 5, 16, 24)


def test_seeded_init_is_reproducible_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_segmentation_model(0)
    after = torch.rand(3)
    torch.testing.assert_close(after, expected)
    b = build_segmentation_model(0)
    c = build_segmentation_model(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_variants_and_validation():
    classic = build_segmentation_model(0, activation="relu", pool="max", channels=(8, 16, 24, 32))
    assert classic(torch.randn(2, 1, 32, 32)).shape == (2, 11, 32, 32)
    assert any(isinstance(m, torch.nn.ReLU) for m in classic.modules())
    with pytest.raises(ValueError):
        TinyUNet(channels=(8, 16))
    with pytest.raises(ValueError):
        TinyUNet(activation="tanh")
    with pytest.raises(ValueError):
        TinyUNet(pool="min")
    with pytest.raises(ValueError):
        TinyUNet(depth=0)


def test_convert_sync_batchnorm_swaps_every_layer_and_keeps_the_output():
    model = build_segmentation_model(0)
    x = torch.randn(4, 1, 32, 32)
    model.train()
    expected = model(x)
    converted = syncbn.convert_sync_batchnorm(build_segmentation_model(0))
    assert sum(isinstance(m, syncbn.SyncBatchNorm) for m in converted.modules()) == 14
    assert count_batchnorm(converted) == 14
    # not distributed: exactly plain batch norm
    # not distributed: the converted layers run F.batch_norm, the same kernels as the original
    torch.testing.assert_close(converted(x), expected)
