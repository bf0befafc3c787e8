"""Module paths of syncbn 0.1 that moved when the package was laid out one sibling per
framework: importing an old path still works for one release (syncbn 0.2) and warns.

``import syncbn.batchnorm`` (or ``from syncbn.convert import ...``, or unpickling an
object saved under an old path) gives the very module object of the new path, so
there is one module, one set of classes and one state whichever path reached it. The
mechanism is the import system's public one: a finder on ``sys.meta_path`` that answers
only for the names below, and a loader whose ``exec_module`` puts the new module into
``sys.modules`` under the old name (the import system returns what ``sys.modules``
holds after ``exec_module``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old path -> new path
MOVED = {
    "syncbn.batchnorm": "syncbn.torch.batchnorm",
    "syncbn.batchnorm_act": "syncbn.torch.batchnorm_act",
    "syncbn.convert": "syncbn.torch.conversion",
    "syncbn.distributed": "syncbn.torch.distributed",
    "syncbn.fingerprint": "syncbn.torch.fingerprint",
    "syncbn.functional": "syncbn.torch.functional",
    "syncbn.groups": "syncbn.torch.groups",
    "syncbn.lightning": "syncbn.torch.lightning",
    "syncbn.precise_bn": "syncbn.torch.precise_bn",
    "syncbn.recompute": "syncbn.torch.recompute",
    "syncbn.stats": "syncbn.torch.stats",
    "syncbn.timm": "syncbn.torch.timm",
    "syncbn.layer_fingerprint": "syncbn.core.fingerprint",
    "syncbn.launch": "syncbn.tools.launch",
    "syncbn.memory": "syncbn.tools.memory",
    "syncbn.soak": "syncbn.tools.soak",
    "syncbn.traffic": "syncbn.tools.traffic",
    "syncbn.verify": "syncbn.tools.verify",
    "syncbn.digits": "syncbn.demo.digits",
    "syncbn.models": "syncbn.demo.torch_models",
    "syncbn.demo_flax": "syncbn.demo.flax",
    "syncbn.demo_keras": "syncbn.demo.keras",
    "syncbn.demo_report": "syncbn.demo.report",
    "syncbn.demo_torch": "syncbn.demo.torch",
    "syncbn.flax.demo": "syncbn.demo.flax_runs",
    "syncbn.flax.models": "syncbn.demo.flax_models",
    "syncbn.keras.demo": "syncbn.demo.keras_runs",
    "syncbn.keras.models": "syncbn.demo.keras_models",
}

# ``syncbn.functional`` is also a name of the package itself (``syncbn.functional.sync_batch_norm``):
# importing it by that path is not deprecated
_STILL_PUBLIC = {"syncbn.functional"}

REMOVED_IN = "0.3"


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED`, and loads each as its new module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return None  # the default module; exec_module replaces it

    def exec_module(self, module):
        old = module.__name__
        new = MOVED[old]
        if old not in _STILL_PUBLIC:
            warnings.warn(
                f"{old} has moved to {new}; import it from there (the old path goes in syncbn {REMOVED_IN})",
                DeprecationWarning,
                stacklevel=2,
            )
        sys.modules[old] = importlib.import_module(new)


_FINDER = _MovedModuleFinder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
