"""timm's norm-act layers, synchronized.

timm builds most of its convolutional networks (EfficientNet, RegNet, MobileNetV3, the
timm encoders of segmentation-models-pytorch, ...) with ``timm.layers.BatchNormAct2d``:
a ``BatchNorm2d`` subclass whose ``forward`` applies a ``drop`` module and an ``act``
module after the normalization. :class:`SyncBatchNormDropAct` is the synchronized form:
:class:`syncbn.SyncBatchNorm` followed by the very same ``drop`` and ``act`` modules,
with timm's ``state_dict`` keys.

:func:`register` teaches :func:`syncbn.convert_sync_batchnorm` and
:func:`syncbn.revert_sync_batchnorm` timm's ``BatchNormAct2d`` and the output of timm's
own ``convert_sync_batchnorm`` (``timm.layers.SyncBatchNormAct``); the converter calls it
by itself whenever timm's layers are imported, so nothing here imports timm before the
user does. timm's frozen layers (``FrozenBatchNormAct2d``) are not batch norms that
learn or track anything and stay as they are.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn
from torch import Tensor
from torch.fx import Proxy

from .batchnorm import SyncBatchNorm
from .conversion import _move_state, _synchronized, register_conversion, register_library

__all__ = ["SyncBatchNormDropAct", "register"]

_REGISTERED = False


class SyncBatchNormDropAct(SyncBatchNorm):
    """:class:`syncbn.SyncBatchNorm`, then the ``drop`` module, then the ``act`` module
    (each applied only if the layer has it, as timm's ``SyncBatchNormAct`` does).

    ``input_dim``: the number of input dimensions required (4 for a layer converted from
    timm's ``BatchNormAct2d``, which accepts only NCHW), or None for any.
    """

    # kept under a _syncbn name: the converter carries a layer's other instance attributes
    # back to timm's layer on revert, where input_dim would be a stray
    @property
    def input_dim(self) -> Optional[int]:
        return self.__dict__.get("_syncbn_input_dim", self.__dict__.get("input_dim"))  # (or as pickled before)

    @input_dim.setter
    def input_dim(self, value: Optional[int]) -> None:
        self.__dict__["_syncbn_input_dim"] = value

    def _check_input_dim(self, input: Tensor) -> None:
        if self.input_dim is not None and input.dim() != self.input_dim:
            raise ValueError(f"expected {self.input_dim}D input (got {input.dim()}D input)")
        super()._check_input_dim(input)

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):  # torch.fx: one call of the layer, as SyncBatchNorm records itself
            node = self._fx_leaf(input, SyncBatchNormDropAct.forward)
            if node is not None:
                return node
        x = super().forward(input)
        if "drop" in self._modules:
            x = self.drop(x)
        if "act" in self._modules:
            x = self.act(x)
        return x


def _to_sync(layer: nn.Module, process_group) -> nn.Module:
    new = _synchronized(SyncBatchNormDropAct, layer, process_group)
    for name in ("drop", "act"):  # the same modules (and parameters, e.g. a PReLU's)
        if name in layer._modules:
            new._modules[name] = layer._modules[name]
    if isinstance(layer, nn.BatchNorm2d):
        new.input_dim = 4
    return new


def _to_plain(layer: nn.Module) -> nn.Module:
    from timm.layers import BatchNormAct2d

    settings = {key: getattr(layer, key) for key in ("eps", "momentum", "affine", "track_running_stats")}
    new = _move_state(layer, BatchNormAct2d(layer.num_features, **settings, apply_act=False, device="meta"))
    for name in ("drop", "act"):
        new._modules[name] = layer._modules.get(name, nn.Identity())
    return new


def register() -> None:
    """Register timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` with
    :func:`syncbn.register_conversion` (imports timm; idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from timm.layers import norm_act

    # timm (up to 1.0.29 at least) has no BatchNormAct1d/3d; its SyncBatchNormAct is only
    # ever made from a BatchNormAct2d, which is what it reverts to
    for cls in (norm_act.BatchNormAct2d, norm_act.SyncBatchNormAct):
        register_conversion(cls, _to_sync, _to_plain)
    _REGISTERED = True


# the converter registers timm's layers by itself once timm's norm-act module is imported
register_library("timm.layers.norm_act", register)
