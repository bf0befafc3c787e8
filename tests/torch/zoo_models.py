"""Small random-init models from MONAI, Hugging Face transformers and mmsegmentation,
as factories for ``syncbn verify`` (``zoo_models:NAME``); used by test_zoos.py.

Every model has dropout and drop-path off (verify refuses a model that is random in
training) and keeps widths small. Nothing is downloaded: models come from constructors
and config objects only. The mmsegmentation factories stand in for mmcv-lite's missing
``mmcv.ops`` first (tests/mmcv_shim.py) and register syncbn with mmengine."""

import os
import sys

import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
for _path in (TESTS, HERE):  # the shims (in the pool's workers too)
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torchvision_shim  # noqa: E402

torchvision_shim.install()  # transformers and mmseg import torchvision


class LocalBatchNorm3d(nn.BatchNorm3d):
    """A BN subclass overriding ``forward``, unknown to the converter: it stays local."""

    def forward(self, x):
        return super().forward(x) * 1.0


# ---- MONAI 1.6: 3-D segmentation ----------------------------------------------------------


def _monai_unet(norm):
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                num_res_units=1, norm=norm, dropout=0.0)


def monai_unet3d():
    return _monai_unet("batch")


def monai_unet3d_syncbatch():
    """``norm="syncbatch"``: torch.nn.SyncBatchNorm layers, which syncbn's converter replaces."""
    return _monai_unet("syncbatch")


def monai_unet3d_one_layer_local():
    """Negative control: the first BN layer swapped for a subclass the converter leaves local."""
    model = _monai_unet("batch")
    name, bn = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm3d))
    local = LocalBatchNorm3d(bn.num_features, eps=bn.eps, momentum=bn.momentum)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, local)
    return model


def monai_dynunet3d():
    from monai.networks.nets import DynUNet

    return DynUNet(spatial_dims=3, in_channels=1, out_channels=2, kernel_size=[3, 3, 3], strides=[1, 2, 2],
                   upsample_kernel_size=[2, 2], filters=[4, 8, 16], norm_name="batch", res_block=True)


def monai_segresnet3d():
    from monai.networks.nets import SegResNet

    return SegResNet(spatial_dims=3, init_filters=4, in_channels=1, out_channels=2, norm="batch",
                     blocks_down=(1, 1, 1), blocks_up=(1, 1), dropout_prob=None)


# ---- Hugging Face transformers 5 (the models return a ModelOutput: verify reads its
# tensors, here the logits or the predicted depth alone) ----------------------------------


def hf_resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    return ResNetForImageClassification(config)


def hf_upernet_convnext():
    from transformers import ConvNextConfig, UperNetConfig, UperNetForSemanticSegmentation

    backbone = ConvNextConfig(hidden_sizes=[8, 8, 16], depths=[1, 1, 1], num_stages=3,
                              out_features=["stage1", "stage2", "stage3"], drop_path_rate=0.0)
    config = UperNetConfig(backbone_config=backbone, hidden_size=8, pool_scales=[1, 2], num_labels=2,
                           auxiliary_channels=8)  # the auxiliary FCN head on stage3
    return UperNetForSemanticSegmentation(config)


def hf_segformer():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    config = SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                             patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                             decoder_hidden_size=16, num_labels=2, classifier_dropout_prob=0.0, drop_path_rate=0.0)
    return SegformerForSemanticSegmentation(config)


def hf_mobilevit():
    from transformers import MobileViTConfig, MobileViTForSemanticSegmentation

    config = MobileViTConfig(image_size=64, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 16, 16, 16, 32],
                             num_attention_heads=2, aspp_out_channels=16, num_labels=2, hidden_dropout_prob=0.0,
                             classifier_dropout_prob=0.0, aspp_dropout_prob=0.0)
    return MobileViTForSemanticSegmentation(config)


def hf_dpt():
    """ViT DPT with BatchNorm in the fusion blocks' residual layers."""
    from transformers import DPTConfig, DPTForDepthEstimation

    config = DPTConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
                       image_size=32, patch_size=8, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 8, 16, 16],
                       fusion_hidden_size=16, use_batch_norm_in_fusion_residual=True, head_hidden_size=8)
    return DPTForDepthEstimation(config)


def hf_levit():
    """LeViT: BatchNorm1d on the (batch x tokens, channels) rows of its linear layers and
    on the pooled features of its classifier."""
    from transformers import LevitConfig, LevitForImageClassification

    config = LevitConfig(image_size=32, hidden_sizes=[16, 32], num_attention_heads=[2, 2], depths=[1, 1],
                         key_dim=[8, 8], mlp_ratio=[2, 2], attention_ratio=[2, 2], num_labels=3,
                         down_ops=[["Subsample", 8, 16 // 8, 2, 2, 2]])
    return LevitForImageClassification(config)


# ---- mmsegmentation 1.2: config dicts with norm_cfg=dict(type='SyncBN') -------------------


def _mmseg_build(cfg):
    """``cfg`` built by mmseg's registry. ``import syncbn.torch.mmengine`` makes
    ``'SyncBN'`` build syncbn.SyncBatchNorm directly."""
    import mmcv_shim

    mmcv_shim.install()
    import syncbn.torch.mmengine  # noqa: F401 - registers
    from mmseg.registry import MODELS
    from mmseg.utils import register_all_modules

    register_all_modules()
    return _Tensor(MODELS.build(cfg))


class _Tensor(nn.Module):
    """An mmseg EncoderDecoder in its tensor mode: backbone, neck and decode head, no data samples."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x, mode="tensor")


def _unet_fcn(norm):
    norm_cfg = dict(type=norm, requires_grad=True)
    return dict(
        type="EncoderDecoder",
        backbone=dict(type="UNet", in_channels=3, base_channels=4, num_stages=3, strides=(1, 1, 1),
                      enc_num_convs=(1, 1, 1), dec_num_convs=(1, 1), downsamples=(True, True),
                      enc_dilations=(1, 1, 1), dec_dilations=(1, 1), norm_cfg=norm_cfg,
                      upsample_cfg=dict(type="InterpConv"), norm_eval=False),
        decode_head=dict(type="FCNHead", in_channels=4, in_index=2, channels=4, num_convs=1, concat_input=False,
                         dropout_ratio=0.0, num_classes=3, norm_cfg=norm_cfg, align_corners=False),
    )


def _upernet_r(norm):
    norm_cfg = dict(type=norm, requires_grad=True)
    return dict(
        type="EncoderDecoder",
        backbone=dict(type="ResNetV1c", depth=18, num_stages=2, stem_channels=8, base_channels=8, out_indices=(0, 1),
                      strides=(1, 2), dilations=(1, 1), norm_cfg=norm_cfg, norm_eval=False, style="pytorch",
                      contract_dilation=True),
        decode_head=dict(type="UPerHead", in_channels=[8, 16], in_index=[0, 1], pool_scales=(1, 2), channels=8,
                         dropout_ratio=0.0, num_classes=3, norm_cfg=norm_cfg, align_corners=False),
    )


def mmseg_unet_fcn_syncbn():
    return _mmseg_build(_unet_fcn("SyncBN"))


def mmseg_unet_fcn_bn():
    return _mmseg_build(_unet_fcn("BN"))


def mmseg_upernet_r_syncbn():
    return _mmseg_build(_upernet_r("SyncBN"))


def mmseg_upernet_r_bn():
    return _mmseg_build(_upernet_r("BN"))
