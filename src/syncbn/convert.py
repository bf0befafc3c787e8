"""Model conversion: swap every BatchNorm layer of a model for its synchronized form,
and back again for single-device inference and export.

The swap moves the very same parameter and buffer tensors into the new module, so an
optimizer built before the conversion keeps working, and values, ``requires_grad``,
device, dtype and the ``training`` flag are kept. A BatchNorm subclass that overrides
``forward`` (an activation or dropout after the normalization, as in timm's
``BatchNormAct2d``) is never replaced by a plain layer that would drop that behaviour:
it is left as it is, with a warning naming it.
"""

from __future__ import annotations

import warnings

import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase

from .batchnorm import SyncBatchNorm

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm"]

# classes whose forward is plain batch norm over the whole batch
_PLAIN_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_FORWARDS = {cls.forward for cls in _PLAIN_BN} | {_BatchNorm.forward}
_REVERT_DEFAULT = nn.BatchNorm2d


def _is_plain(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and type(module).forward in _FORWARDS


def _move_state(src: nn.Module, dst: nn.Module) -> nn.Module:
    """Give ``dst`` the parameters, buffers and flags of ``src`` (the same tensors)."""
    for name in ("weight", "bias"):  # a BN built with bias=False keeps no bias
        if name in dst._parameters:
            dst._parameters[name] = src._parameters.get(name)
    for name, buf in src.named_buffers(recurse=False):
        dst._buffers[name] = buf
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        if name in dst._buffers and name not in src._buffers:
            dst._buffers[name] = None
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return dst


def _replace(module: nn.Module, swap) -> nn.Module:
    """Apply ``swap`` to ``module`` and to every descendant, top-down; returns the root."""
    new = swap(module)
    if new is not module:
        return new
    for name, child in module.named_children():
        replaced = _replace(child, swap)
        if replaced is not child:
            module._modules[name] = replaced
    return module


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Return ``module`` with every BatchNorm1d/2d/3d and ``torch.nn.SyncBatchNorm``
    replaced by :class:`syncbn.SyncBatchNorm` on ``process_group``.

    Works in place on the children (like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``)
    and returns the root, which is a new module when the root itself is a BatchNorm.
    A ``torch.nn.SyncBatchNorm`` keeps its own process group unless one is given.
    """
    skipped = []

    def swap(m: nn.Module) -> nn.Module:
        if not isinstance(m, _BatchNorm) or isinstance(m, SyncBatchNorm):
            return m
        if isinstance(m, _LazyNormBase) and m.has_uninitialized_params():
            skipped.append(f"{type(m).__name__} (uninitialized lazy module: run one batch first)")
            return m
        if not _is_plain(m):
            skipped.append(f"{type(m).__module__}.{type(m).__qualname__} (it overrides forward)")
            return m
        group = process_group
        if group is None and isinstance(m, nn.SyncBatchNorm):
            group = m.process_group
        new = SyncBatchNorm(
            m.num_features,
            m.eps,
            m.momentum,
            m.affine,
            m.track_running_stats,
            process_group=group,
            device="meta",
            bias=m.bias is not None or not m.affine,
        )
        new = _move_state(m, new)
        new._syncbn_origin = type(m)
        return new

    result = _replace(module, swap)
    if skipped:
        warnings.warn(
            "syncbn.convert_sync_batchnorm left these BatchNorm layers unsynchronized: "
            + "; ".join(sorted(set(skipped))),
            stacklevel=2,
        )
    return result


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Return ``module`` with every :class:`syncbn.SyncBatchNorm` back as a plain
    ``torch.nn.BatchNorm{1,2,3}d``: the class it was converted from where known, else
    ``BatchNorm2d`` (which one only matters for its input-dimension check). Values are
    identical; the same parameter and buffer tensors are moved back.
    """

    def swap(m: nn.Module) -> nn.Module:
        if not isinstance(m, SyncBatchNorm):
            return m
        origin = getattr(m, "_syncbn_origin", _REVERT_DEFAULT)
        # the plain torch class the layer came from (a subclass reverts to its torch base)
        cls = next((c for c in origin.__mro__ if c in _PLAIN_BN[:3]), _REVERT_DEFAULT)
        new = cls(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, device="meta")
        return _move_state(m, new)

    return _replace(module, swap)
