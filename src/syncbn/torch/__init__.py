"""syncbn.torch: exact synchronized batch normalization for PyTorch.

The names here are also the top-level API (``syncbn.SyncBatchNorm`` is
``syncbn.torch.SyncBatchNorm``). Modules, one concern each, in import order (a module
imports only those above it):

- :mod:`~syncbn.torch.distributed`: the one module that talks to ``torch.distributed``;
- :mod:`~syncbn.torch.layout`: which memory format an activation is laid out in;
- :mod:`~syncbn.torch.kernels`: the Triton kernels of the CUDA path (Triton imported on
  first use);
- :mod:`~syncbn.torch.stats`: local moments, the merge, normalize and backward formulas;
- :mod:`~syncbn.torch.recompute`: recognising an activation-checkpoint recomputation;
- :mod:`~syncbn.torch.fingerprint`: which layer call each rank is in, checked inside the
  statistics' all-reduce;
- :mod:`~syncbn.torch.functional`: :func:`~syncbn.torch.functional.sync_batch_norm` and
  its autograd function;
- :mod:`~syncbn.torch.batchnorm`, :mod:`~syncbn.torch.batchnorm_act`: the modules
  :class:`SyncBatchNorm` and :class:`SyncBatchNormAct`, and :class:`BatchNormNd`, the
  plain any-rank batch norm that a revert gives back;
- :mod:`~syncbn.torch.conversion`: model conversion, its inverse and layer naming;
- :mod:`~syncbn.torch.groups`, :mod:`~syncbn.torch.precise_bn`: sync groups and precise
  running statistics;
- :mod:`~syncbn.torch.timm`, :mod:`~syncbn.torch.lightning`: adapters for timm's
  norm-act layers and Lightning's ``LayerSync`` plugin (imported on first use only for
  Lightning; the timm adapter imports timm only once the user has);
- :mod:`~syncbn.torch.mmengine`: OpenMMLab configs (``norm_cfg=dict(type="SyncBN")``) build
  :class:`SyncBatchNorm`; never imported here (it imports mmengine): ``import
  syncbn.torch.mmengine``.
"""

from ..core.fingerprint import LayerMismatchError
from . import functional
from .batchnorm import BatchNormNd, SyncBatchNorm
from .batchnorm_act import SyncBatchNormAct
from .conversion import convert_sync_batchnorm, fuse_batchnorm_act, name_layers, register_conversion, revert_sync_batchnorm
from .fingerprint import check_agreement
from .groups import sync_groups
from .precise_bn import precise_bn
from .recompute import checkpoint
from . import timm as _timm  # noqa: F401 - registers timm's layers with the converter (imports no timm)

# the names every framework of syncbn uses (syncbn.keras.convert, syncbn.flax.convert, ...)
convert = convert_sync_batchnorm
revert = revert_sync_batchnorm

__all__ = [
    "BatchNormNd",
    "LayerMismatchError",
    "SyncBatchNorm",
    "SyncBatchNormAct",
    "check_agreement",
    "checkpoint",
    "convert",
    "convert_sync_batchnorm",
    "functional",
    "fuse_batchnorm_act",
    "name_layers",
    "precise_bn",
    "register_conversion",
    "revert",
    "revert_sync_batchnorm",
    "sync_groups",
]
