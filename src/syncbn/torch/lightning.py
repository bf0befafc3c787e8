"""Lightning: ``Trainer(strategy="ddp", plugins=[syncbn.torch.lightning.SyncBatchNorm()])``.

A ``LayerSync`` plugin: Lightning calls its ``apply`` on the model before wrapping it for
distributed training (``syncbn.convert_sync_batchnorm``) and its ``revert`` at the end of
``fit`` (``syncbn.revert_sync_batchnorm``). Unlike ``Trainer(sync_batchnorm=True)``
(``torch.nn.SyncBatchNorm``, GPU only), it works on the CPU with gloo as well as on GPUs,
and it synchronizes timm's norm-act layers and any class registered with
:func:`syncbn.register_conversion`. Leave ``sync_batchnorm`` at its default (False): the
plugin replaces it.

Importing this module imports Lightning (``lightning.pytorch``, or ``pytorch_lightning``
where only that one is installed or already imported); ``import syncbn`` does not.
"""

from __future__ import annotations

import sys

from .conversion import convert_sync_batchnorm, revert_sync_batchnorm

if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
    from pytorch_lightning.plugins.layer_sync import LayerSync
else:
    try:
        from lightning.pytorch.plugins.layer_sync import LayerSync
    except ImportError:  # the standalone package
        from pytorch_lightning.plugins.layer_sync import LayerSync

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(LayerSync):
    """Lightning plugin: every BatchNorm layer of the LightningModule synchronized by syncbn.

    Args:
        process_group: the group to synchronize over (default: all ranks).
        strict: raise instead of warning when a BatchNorm layer cannot be converted.
    """

    def __init__(self, process_group=None, strict: bool = False) -> None:
        self.process_group = process_group
        self.strict = strict

    def apply(self, model):
        return convert_sync_batchnorm(model, process_group=self.process_group, strict=self.strict)

    def revert(self, model):
        return revert_sync_batchnorm(model)
