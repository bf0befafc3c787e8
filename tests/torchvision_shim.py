"""Make PyPI's torchvision importable beside a CPU-only torch (test setup only).

PyPI's Linux torchvision wheel is built against CUDA; beside the CPU build of torch its
compiled extension does not load, and ``import torchvision`` then stops at registering
fake kernels for ``torchvision::nms`` and ``torchvision::qnms``, operators that the
extension would have defined ("operator torchvision::nms does not exist"). Defining those
two schemas first lets the import finish; the models the tests build never call them
(calling one raises: no kernel is registered). timm, segmentation-models-pytorch and
Lightning import torchvision, so tests (and pool workers) call :func:`install` before
importing them. Where the extension loads, nothing is defined.
"""

import glob
import importlib.util
import os

_LIBRARY = None  # kept alive: the schemas live as long as this object


def _schema_exists(name: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
        return True
    except RuntimeError:
        return False


def install() -> None:
    """Define the missing operator schemas if torchvision's extension cannot provide them."""
    global _LIBRARY
    import torch

    spec = importlib.util.find_spec("torchvision")
    if _LIBRARY is not None or spec is None or _schema_exists("torchvision::nms"):
        return
    for path in glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so")):
        try:
            torch.ops.load_library(path)  # the extension works here: it defines the ops
            return
        except OSError:
            pass
    lib = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY = lib
