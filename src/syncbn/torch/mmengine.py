"""OpenMMLab (mmengine, mmcv, mmsegmentation, mmdetection, ...): configs build syncbn's layer.

Importing this module imports mmengine and calls :func:`register`, so that::

    import syncbn.torch.mmengine   # once, before the model is built

makes every existing config with ``norm_cfg=dict(type="SyncBN")`` (also ``"SyncBatchNorm"``,
and mmcv's ``"MMSyncBN"`` where mmcv's compiled ops are installed, through
:class:`MMSyncBN`, which takes mmcv's arguments) build :class:`syncbn.SyncBatchNorm`,
with the layer names, hence the checkpoint keys, of the config (``bn1``, ``norm1``, ...:
mmcv's ``build_norm_layer`` names a ``_BatchNorm`` subclass ``bn``). It also guards
mmengine's ``convert_sync_batchnorm``, which a runner with ``sync_bn="torch"`` (or
``"mmcv"``) calls and which would otherwise replace syncbn's layers by
``torch.nn.SyncBatchNorm`` without a word.

syncbn itself does not import this module: ``import syncbn`` never imports mmengine.
"""

from __future__ import annotations

import functools
import importlib
import sys

import mmengine.model
import mmengine.model.utils
import torch.nn as nn
from mmengine.registry import MODELS

from .batchnorm import SyncBatchNorm, _SyncNormBase

__all__ = ["GUARD_MESSAGE", "NAMES", "MMSyncBN", "register"]

# the registry names that build syncbn's layer after register(); "MMSyncBN" only where
# mmcv's compiled ops registered it
NAMES = ("SyncBN", "SyncBatchNorm", "MMSyncBN")


class MMSyncBN:
    """What ``"MMSyncBN"`` builds after :func:`register`: a :class:`syncbn.SyncBatchNorm`
    (calling this class returns one; there is never an instance of ``MMSyncBN``) from the
    arguments of mmcv's ``mmcv.ops.SyncBatchNorm``, so that configs written for mmcv's
    layer build syncbn's where the meaning is the same.

    - ``group``: mmcv's process group, None for the whole world; it becomes
      ``process_group`` (where None is the default group, the same).
    - ``stats_mode``: mmcv's choice between ``"default"`` (each rank's mean and variance
      weighted equally: the mean of per-rank means) and ``"N"`` (weighted by each rank's
      element count: the statistics of the union batch). syncbn always computes the
      exact, count-weighted statistics, mmcv's ``"N"``: left out, or ``"N"``, builds
      syncbn's layer; ``"default"`` given explicitly raises ``ValueError`` naming the
      difference (the two differ whenever ranks' batches differ in size, as an uneven
      last batch or an empty one makes them), since syncbn cannot compute what it asks
      for; any other value raises ``ValueError``, as mmcv refuses it.
    - ``num_features``, ``eps``, ``momentum``, ``affine``, ``track_running_stats``: as
      for ``torch.nn.SyncBatchNorm`` (``momentum=None``: the cumulative average).

    Other keywords raise ``TypeError``, as mmcv's layer does (``requires_grad`` is taken
    out by ``build_norm_layer``, as for every norm layer). One difference that no config
    names: mmcv draws a fresh layer's ``weight`` uniformly in [0, 1); syncbn's starts at
    ones, as torch's. ``build_norm_layer`` names the layer ``bn`` + postfix, as mmcv's.
    """

    _abbr_ = "bn"  # mmcv's build_norm_layer names the layer by this (infer_abbr)

    def __new__(  # type: ignore[misc]
        cls,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        group=None,
        stats_mode: str | None = None,
    ) -> SyncBatchNorm:
        if stats_mode is not None and stats_mode != "N":
            if stats_mode == "default":
                raise ValueError(
                    "MMSyncBN with stats_mode='default' (mmcv: every rank's mean and variance "
                    "weighted equally, whatever its batch size) cannot be built by syncbn, which "
                    "computes the exact statistics of the union of all ranks' batches, weighted "
                    "by each rank's count: mmcv's stats_mode='N'. The two differ whenever the "
                    "ranks' batches differ in size. Set stats_mode='N' or leave it out to use "
                    "syncbn's layer, or do not import syncbn.torch.mmengine to keep mmcv's"
                )
            raise ValueError(
                f"MMSyncBN: stats_mode must be 'N' (the exact statistics syncbn computes) or left out, "
                f"got {stats_mode!r}"
            )
        return SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats, process_group=group)


GUARD_MESSAGE = (
    "this model is already synchronized by syncbn; leave sync_bn unset in the runner config "
    "(mmengine's convert_sync_batchnorm would replace its {count} syncbn layer(s), first {first!r}, "
    "by another SyncBatchNorm)"
)

# the modules whose name ``convert_sync_batchnorm`` is mmengine's converter: its home (whose
# global the converter's own recursion calls), the package that re-exports it, and those
# that import it from there at their import (patched only if already imported: imported
# later, they take the guarded one from mmengine.model)
_HOLDERS = ("mmengine.model.utils", "mmengine.model", "mmengine.runner.runner", "mmengine._strategy.distributed")


def _guarded(convert):
    """mmengine's ``convert_sync_batchnorm``, raising before it changes anything if the
    model holds a syncbn layer."""

    @functools.wraps(convert)
    def convert_sync_batchnorm(module, implementation="torch"):
        if isinstance(module, nn.Module):
            synced = [name for name, m in module.named_modules() if isinstance(m, _SyncNormBase)]
            if synced:
                raise RuntimeError(GUARD_MESSAGE.format(count=len(synced), first=synced[0] or "<the model>"))
        return convert(module, implementation)

    convert_sync_batchnorm._syncbn_guard = True  # type: ignore[attr-defined]
    return convert_sync_batchnorm


def _guard() -> None:
    guarded = mmengine.model.utils.convert_sync_batchnorm
    if not getattr(guarded, "_syncbn_guard", False):
        guarded = _guarded(guarded)
    for holder in _HOLDERS:  # one guarded function under every name of mmengine's
        module = sys.modules.get(holder)
        convert = getattr(module, "convert_sync_batchnorm", None)
        if convert is not None and not getattr(convert, "_syncbn_guard", False):
            # a holder with some other function under that name (patched by someone) is wrapped on its own
            new = guarded if convert is guarded.__wrapped__ else _guarded(convert)
            module.convert_sync_batchnorm = new  # type: ignore[union-attr]


def _registries(root):
    """``root`` and every registry below it (mmcv's, mmseg's, ... share mmengine's
    ``MODELS`` or are its children)."""
    yield root
    for child in root.children.values():
        yield from _registries(child)


def register() -> None:
    """Make OpenMMLab configs build :class:`syncbn.SyncBatchNorm`; idempotent, and done
    already by ``import syncbn.torch.mmengine``.

    - Registers ``syncbn.SyncBatchNorm`` in mmengine's ``MODELS`` registry under
      ``"SyncBN"`` and ``"SyncBatchNorm"``, and :class:`MMSyncBN` (which builds
      ``syncbn.SyncBatchNorm`` from mmcv's arguments) under ``"MMSyncBN"`` if mmcv's
      compiled ops (``mmcv.ops``, not in mmcv-lite) are installed, with ``force=True``
      for those names only: it replaces ``torch.nn.SyncBatchNorm`` (and mmcv's
      ``SyncBatchNorm``) for them, in every config, mmcv's ``build_norm_layer`` included,
      also in any registry below ``MODELS`` (mmseg's, mmdet's, ...) that holds one of
      those names itself. mmcv's own registrations (``mmcv.cnn``, ``mmcv.ops``) are
      imported first, so that a later import of mmcv cannot undo this (nor fail on a
      name already taken). ``"BN"`` stays ``torch.nn.BatchNorm2d``.
    - Guards ``mmengine.model.convert_sync_batchnorm`` (the function a runner with
      ``sync_bn="torch"`` or ``"mmcv"`` calls, under every name mmengine imports it by):
      on a model that holds any syncbn layer it raises ``RuntimeError("this model is
      already synchronized by syncbn; leave sync_bn unset in the runner config ...")``
      before changing anything; on other models it is mmengine's function, unchanged.
      Code that took the function by name before ``register()`` ran keeps the unguarded
      one.
    """
    for extra in ("mmcv.cnn", "mmcv.ops"):  # their registrations first (mmcv.ops: full mmcv only)
        try:
            importlib.import_module(extra)
        except ImportError:
            pass
    for registry in _registries(MODELS):
        for name in NAMES:
            if registry is MODELS and name != "MMSyncBN" or name in registry.module_dict:
                builder = MMSyncBN if name == "MMSyncBN" else SyncBatchNorm
                if registry.module_dict.get(name) is not builder:
                    registry.register_module(name=name, module=builder, force=True)
    _guard()


register()
