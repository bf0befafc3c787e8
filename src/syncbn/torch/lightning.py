"""Lightning: ``Trainer(strategy="ddp", plugins=[syncbn.torch.lightning.SyncBatchNorm()])``.

A ``LayerSync`` plugin: Lightning calls its ``apply`` on the model before wrapping it for
distributed training (``syncbn.convert_sync_batchnorm``) and its ``revert`` at the end of
``fit`` (``syncbn.revert_sync_batchnorm`` of the layers ``apply`` converted: layers the
model held synchronized already, built so or fused, stay as they are). Unlike
``Trainer(sync_batchnorm=True)`` (``torch.nn.SyncBatchNorm``, GPU only), it works on the
CPU with gloo as well as on GPUs, and it synchronizes timm's norm-act layers and any class
registered with :func:`syncbn.register_conversion`. Leave ``sync_batchnorm`` at its default (False): the
plugin replaces it.

Importing this module imports Lightning (``lightning.pytorch``, or ``pytorch_lightning``
where only that one is installed or already imported); ``import syncbn`` does not.
"""

from __future__ import annotations

import sys
import weakref

from .conversion import _revert, _synchronized_layers, convert_sync_batchnorm

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
        # the layers synchronized already (built so, or fused): revert leaves them as they are
        self._kept = weakref.WeakSet(_synchronized_layers(model))
        return convert_sync_batchnorm(model, process_group=self.process_group, strict=self.strict)

    def revert(self, model):
        """Undo what :meth:`apply` did: the layers it converted go back (as
        :func:`syncbn.revert_sync_batchnorm` does); the synchronized layers the model
        held before (built with syncbn's layers, fused, converted by the user) stay, with
        their process group and ``state_dict`` keys. Without an ``apply`` since the last
        ``revert`` it changes nothing: Lightning's teardown also reverts a ``fit`` that
        failed before the plugin's ``apply`` ran (in the module's ``setup`` or
        ``configure_model`` hook), where nothing was converted."""
        kept = self.__dict__.pop("_kept", None)
        if kept is None:
            return model
        return _revert(model, keep=list(kept))

    def __getstate__(self):  # Lightning's spawn launcher pickles the trainer with its plugins
        state = dict(self.__dict__)
        state.pop("_kept", None)
        return state
