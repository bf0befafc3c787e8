"""syncbn: exact synchronized batch normalization across devices and processes.

Every BatchNorm layer of a model computes its mean and variance over the union of
all ranks' batches, forward and backward, with one collective of O(C) values per
layer call each way, numerically stable merging, uneven and empty ranks handled.

The PyTorch names below are imported lazily, on first use, so that
``import syncbn.keras`` works in an environment without torch, and
``import syncbn`` never imports TensorFlow.
"""

from importlib import import_module

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "SyncBatchNorm": "syncbn.batchnorm",
    "SyncBatchNormAct": "syncbn.batchnorm_act",
    "convert_sync_batchnorm": "syncbn.convert",
    "revert_sync_batchnorm": "syncbn.convert",
    "fuse_batchnorm_act": "syncbn.convert",
    "checkpoint": "syncbn.recompute",
    "register_conversion": "syncbn.convert",
    "sync_groups": "syncbn.groups",
    "precise_bn": "syncbn.precise_bn",
    "functional": "syncbn.functional",
    "check_agreement": "syncbn.fingerprint",
    "name_layers": "syncbn.fingerprint",
    "LayerMismatchError": "syncbn.layer_fingerprint",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'syncbn' has no attribute {name!r}")
    mod = import_module(module)
    # a function named like its module (precise_bn) wins over the module itself
    value = getattr(mod, name, mod)
    globals()[name] = value
    return value


def __dir__():
    return __all__
