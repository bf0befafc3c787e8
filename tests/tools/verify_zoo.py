"""Real models for ``syncbn verify`` (``verify_zoo:NAME``): torchvision, segmentation-
models-pytorch and timm, without pretrained weights, plus defects verify must catch.
Importing this module makes torchvision importable beside CPU torch (tests/torchvision_shim)."""

import os
import sys

import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import torchvision_shim  # noqa: E402

torchvision_shim.install()


def _no_dropout(model):
    """Dropout off (p = 0): DeepLabV3's ASPP heads (torchvision's and smp's) drop half their
    features in training, which makes the model random and verify says so."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model


def resnet18():
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def fcn_resnet50():
    import torchvision

    return _no_dropout(_Out(torchvision.models.segmentation.fcn_resnet50(num_classes=3, weights_backbone=None)))


def deeplabv3_mobilenet_v3_large():
    import torchvision

    return _no_dropout(_Out(torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(num_classes=3, weights_backbone=None)))


def lraspp_mobilenet_v3_large():
    import torchvision

    return _Out(torchvision.models.segmentation.lraspp_mobilenet_v3_large(num_classes=3, weights_backbone=None))


def smp_unet_resnet18():
    import segmentation_models_pytorch as smp

    return smp.Unet("resnet18", encoder_weights=None, classes=2)


def smp_deeplabv3plus_efficientnet_b0():
    """smp's own efficientnet encoder, with its drop-connect (on by default: 0.2) off."""
    import segmentation_models_pytorch as smp

    model = _no_dropout(smp.DeepLabV3Plus("efficientnet-b0", encoder_weights=None, classes=2))
    model.encoder._drop_connect_rate = 0.0
    return model


def smp_deeplabv3plus_efficientnet_b0_drop_connect():
    """As smp builds the encoder: drop-connect on in training, so random (dropout off)."""
    import segmentation_models_pytorch as smp

    return _no_dropout(smp.DeepLabV3Plus("efficientnet-b0", encoder_weights=None, classes=2))


def smp_unet_timm_efficientnet_b0():
    """An smp encoder from timm ("tu-"): timm's BatchNormAct2d layers."""
    import segmentation_models_pytorch as smp

    return smp.Unet("tu-efficientnet_b0", encoder_weights=None, classes=2, encoder_depth=5, drop_path_rate=0.0)


def smp_unet_timm_efficientnet_b0_encoder():
    """smp's "timm-efficientnet-b0" encoder (timm's blocks, timm's BatchNormAct2d), with its
    drop-path (on by default) off."""
    import segmentation_models_pytorch as smp

    model = smp.Unet("timm-efficientnet-b0", encoder_weights=None, classes=2)
    for m in model.modules():
        if type(m).__name__ == "DropPath":
            m.drop_prob = 0.0
    return model


def timm_regnetx_002():
    import timm

    return timm.create_model("regnetx_002", num_classes=4, drop_rate=0.0, drop_path_rate=0.0)


def timm_efficientnet_b0():
    import timm

    return timm.create_model("efficientnet_b0", num_classes=4, drop_rate=0.0, drop_path_rate=0.0)


def timm_mobilenetv3_small_100():
    import timm

    return timm.create_model("mobilenetv3_small_100", num_classes=4, drop_rate=0.0, drop_path_rate=0.0)


def timm_mobilenetv3_random():
    """drop-path on: random in training."""
    import timm

    return timm.create_model("mobilenetv3_small_100", num_classes=4, drop_rate=0.0, drop_path_rate=0.2)


class LocalBatchNorm(nn.BatchNorm2d):
    """A BN subclass that overrides forward, unknown to the converter: it stays local
    (like timm's BatchNormAct2d before syncbn knew it)."""

    def forward(self, x):
        return super().forward(x).relu()


def unconverted_norm_act():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), LocalBatchNorm(8),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )


class _Out(nn.Module):
    """torchvision's segmentation models return a dict; verify compares every output
    tensor, including the auxiliary ones (this wrapper just keeps 'out')."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]
