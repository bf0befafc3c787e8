"""syncbn: exact synchronized batch normalization across devices and processes.

Every BatchNorm layer of a model computes its mean and variance over the union of
all ranks' batches, forward and backward, with one collective of O(C) values per
layer call each way, numerically stable merging, uneven and empty ranks handled.

The package, one sibling per framework (as einops keeps ``layers/torch.py``,
``keras.py``, ``flax.py`` beside one core):

- :mod:`syncbn.torch`: the PyTorch layers; their names are also this package's own
  (``syncbn.SyncBatchNorm`` is ``syncbn.torch.SyncBatchNorm``);
- :mod:`syncbn.keras`: Keras 3 (TensorFlow, JAX and torch backends);
- :mod:`syncbn.flax`: Flax linen and nnx;
- :mod:`syncbn.core`: what they share without a framework;
- :mod:`syncbn.demo`, :mod:`syncbn.bench`, :mod:`syncbn.tools`: the ``syncbn`` command's
  demo, benchmark and other tools (:mod:`syncbn.cli`).

The PyTorch names below are imported lazily, on first use, so that
``import syncbn.keras`` works in an environment without torch, and
``import syncbn`` never imports TensorFlow.
"""

import sys
from importlib import import_module
from typing import TYPE_CHECKING

from . import _moved
from ._version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports them
    from .torch import (
        BatchNormNd,
        LayerMismatchError,
        SyncBatchNorm,
        SyncBatchNormAct,
        check_agreement,
        checkpoint,
        convert_sync_batchnorm,
        functional,
        fuse_batchnorm_act,
        name_layers,
        precise_bn,
        register_conversion,
        revert_sync_batchnorm,
        sync_groups,
    )

# public names, all exported by syncbn.torch (imported on first use, except the framework-free ones)
_TORCH_NAMES = (
    "BatchNormNd",
    "LayerMismatchError",
    "SyncBatchNorm",
    "SyncBatchNormAct",
    "check_agreement",
    "checkpoint",
    "convert_sync_batchnorm",
    "functional",
    "fuse_batchnorm_act",
    "name_layers",
    "precise_bn",
    "register_conversion",
    "revert_sync_batchnorm",
    "sync_groups",
)

_FRAMEWORK_FREE = ("LayerMismatchError",)  # of those, the ones syncbn.core defines

__all__ = sorted(_TORCH_NAMES) + ["__version__"]

# old module paths (syncbn.batchnorm, ...) keep importing, with a DeprecationWarning
_moved.install()


def _import_torch_distributed_nn() -> None:
    """Import ``torch.distributed.nn`` now if torch is already imported (about 4 ms).

    That module binds ``group.WORLD`` into its functions' default arguments when it is first
    imported, and torch's compiler imports it, so ``DistributedDataParallel`` and
    ``syncbn.torch`` do, lazily. First imported after ``init_process_group``, it holds the
    default group for good: ``destroy_process_group`` cannot free it, gloo's worker threads
    outlive the script, and on torch 2.13 such a thread can abort the process at exit
    ("terminate called without an active exception"; docs/torch.md, "Ending a job"). A script
    that imports torch, then syncbn, then makes its group has it imported here, first.
    Never imports torch itself (``import syncbn.keras`` needs none)."""
    if "torch" not in sys.modules:
        return
    torch = sys.modules["torch"]
    distributed = getattr(torch, "distributed", None)
    if distributed is None or not distributed.is_available():
        return
    try:
        import torch.distributed.nn  # noqa: F401
    except ImportError:  # pragma: no cover - a torch build without its RPC parts: nothing to bind early
        pass


_import_torch_distributed_nn()


if not TYPE_CHECKING:  # type checkers see the imports above, and an unknown name as an error

    def __getattr__(name):
        if name not in _TORCH_NAMES:
            raise AttributeError(f"module 'syncbn' has no attribute {name!r}")
        # the error every framework raises is framework-free: a Keras or Flax user without
        # torch catches it by this name too (syncbn.torch re-exports the same class)
        home = "syncbn.core.fingerprint" if name in _FRAMEWORK_FREE else "syncbn.torch"
        value = getattr(import_module(home), name)
        globals()[name] = value
        return value


def __dir__():
    return __all__
