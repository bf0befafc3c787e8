"""Model conversion: swap every BatchNorm layer of a model for its synchronized form,
and back again for single-device inference and export.

The swap moves the very same parameter and buffer tensors into the new module, so an
optimizer built before the conversion keeps working, and values, ``requires_grad``,
device, dtype and the ``training`` flag are kept. A BatchNorm subclass that overrides
``forward`` (an activation or dropout after the normalization) is never replaced by a
plain layer that would drop that behaviour: it is left as it is, with a warning that
counts the layers left local (or an error, with ``strict=True``), unless a conversion
for its class was registered with :func:`register_conversion`. timm's norm-act layers
are registered that way (:mod:`syncbn.timm`) as soon as timm is imported.

:func:`fuse_batchnorm_act` goes one step further for memory: each batch norm followed
directly by an invertible activation becomes one :class:`syncbn.SyncBatchNormAct`.
:func:`revert_sync_batchnorm` undoes both.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase

from .batchnorm import SyncBatchNorm
from .batchnorm_act import SyncBatchNormAct

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm", "fuse_batchnorm_act", "register_conversion"]

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


def _synchronized(cls, bn: nn.Module, process_group, **kwargs) -> nn.Module:
    """A ``cls`` layer (SyncBatchNorm or SyncBatchNormAct) holding ``bn``'s state.

    The group is ``process_group``, else the one ``bn`` already synchronizes over; the
    layer remembers the plain torch class ``bn`` came from, for the revert.
    """
    group = process_group
    if group is None and isinstance(bn, (nn.SyncBatchNorm, SyncBatchNorm)):
        group = bn.process_group
    new = cls(
        bn.num_features,
        eps=bn.eps,
        momentum=bn.momentum,
        affine=bn.affine,
        track_running_stats=bn.track_running_stats,
        process_group=group,
        device="meta",
        bias=bn.bias is not None or not bn.affine,
        **kwargs,
    )
    new = _move_state(bn, new)
    new._syncbn_origin = getattr(bn, "_syncbn_origin", type(bn))
    return new


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


# ---- conversions registered for BatchNorm subclasses -------------------------------

# class -> (to_sync, to_plain); exact classes only (a subclass may change the behaviour)
_CONVERSIONS: dict = {}


def register_conversion(
    cls: type,
    to_sync: Callable[[nn.Module, object], nn.Module],
    to_plain: Callable[[nn.Module], nn.Module],
) -> None:
    """Teach :func:`convert_sync_batchnorm` and :func:`revert_sync_batchnorm` a layer class.

    ``to_sync(layer, process_group)`` returns the synchronized replacement of a ``cls``
    layer (it should move the layer's own parameter and buffer tensors, keep its
    ``state_dict`` keys, and synchronize over ``process_group``, where None means: the
    default group, or the group the layer already had). ``to_plain(synced)`` returns
    the single-process layer for a module that ``to_sync`` made; the converter records
    on that module, as ``_syncbn_origin``, the class it came from (``cls``).

    Only layers whose type is exactly ``cls`` are matched: a subclass may change what
    the layer computes, so it needs its own registration. Registering a class again
    replaces its conversion. timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` are
    registered this way by :mod:`syncbn.timm`.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_conversion: cls must be a torch.nn.Module subclass, got {cls!r}")
    for name, fn in (("to_sync", to_sync), ("to_plain", to_plain)):
        if not callable(fn):
            raise TypeError(f"register_conversion: {name} must be callable, got {fn!r}")
    _CONVERSIONS[cls] = (to_sync, to_plain)


def _register_known() -> None:
    """Register the conversions of the libraries already imported (never imports them)."""
    if "timm.layers.norm_act" in sys.modules:
        from . import timm as _timm

        _timm.register()


def _registered(cls: Optional[type]):
    return _CONVERSIONS.get(cls) if cls is not None else None


def _classify(m: nn.Module):
    """What conversion does with ``m``: None (not a batch norm), "synced" (already
    synchronized), "registered", "plain", or the reason it stays local."""
    if isinstance(m, (SyncBatchNorm, SyncBatchNormAct)) or "_syncbn_origin" in m.__dict__:
        return "synced"
    if type(m) in _CONVERSIONS:
        return "registered"
    if not isinstance(m, _BatchNorm):
        return None
    if isinstance(m, _LazyNormBase) and m.has_uninitialized_params():
        return "uninitialized lazy module: run one batch first"
    if not _is_plain(m):
        return "it overrides forward; teach the converter with syncbn.register_conversion"
    return "plain"


def convert_sync_batchnorm(module: nn.Module, process_group=None, strict: bool = False) -> nn.Module:
    """Return ``module`` with every BatchNorm1d/2d/3d and ``torch.nn.SyncBatchNorm``
    replaced by :class:`syncbn.SyncBatchNorm` on ``process_group``, and every layer of a
    class registered with :func:`register_conversion` (timm's norm-act layers, when
    timm is imported) by its registered synchronized form.

    Works in place on the children (like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``)
    and returns the root, which is a new module when the root itself is a BatchNorm.
    A ``torch.nn.SyncBatchNorm`` keeps its own process group unless one is given.

    A BatchNorm layer that cannot be converted (a subclass overriding ``forward`` with
    no registered conversion, an uninitialized lazy module) stays local: a warning says
    how many of the model's BatchNorm layers that leaves local, and which classes. With
    ``strict=True`` a ``ValueError`` is raised instead, before anything is changed (the
    decision depends only on the model, so every rank raises alike).
    """
    _register_known()
    decisions = {}
    total = 0
    for m in module.modules():
        kind = _classify(m)
        if kind is not None:
            decisions[id(m)] = kind
            total += 1
    local = Counter(
        (f"{type(m).__module__}.{type(m).__qualname__}", decisions[id(m)])
        for m in module.modules()
        if decisions.get(id(m)) not in (None, "synced", "registered", "plain")
    )
    if local:
        left = sum(local.values())
        message = (
            f"syncbn.convert_sync_batchnorm left {left} of {total} BatchNorm layers local "
            "(unsynchronized): "
            + "; ".join(f"{count} x {name} ({reason})" for (name, reason), count in sorted(local.items()))
        )
        if strict:
            raise ValueError(message)
    else:
        message = None

    def swap(m: nn.Module) -> nn.Module:
        kind = decisions.get(id(m))
        if kind == "plain":
            return _synchronized(SyncBatchNorm, m, process_group)
        if kind == "registered":
            new = _CONVERSIONS[type(m)][0](m, process_group)
            if new is not m and "_syncbn_origin" not in new.__dict__:
                new._syncbn_origin = type(m)
            return new
        return m

    result = _replace(module, swap)
    if message:
        warnings.warn(message, stacklevel=2)
    return result


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Return ``module`` with every :class:`syncbn.SyncBatchNorm` back as a plain
    ``torch.nn.BatchNorm{1,2,3}d``: the class it was converted from where known, else
    ``BatchNorm2d`` (which one only matters for its input-dimension check). Values are
    identical; the same parameter and buffer tensors are moved back.

    A layer made by a conversion registered with :func:`register_conversion` goes back
    through that registration's ``to_plain`` (timm's layers become timm's
    ``BatchNormAct2d``). A subclass of ``SyncBatchNorm`` that overrides ``forward``
    and has no registered conversion is left as it is (a plain layer would drop what
    its ``forward`` adds).

    A :class:`syncbn.SyncBatchNormAct` made by :func:`fuse_batchnorm_act` becomes the
    batch norm and activation it was made of, each in its old place (so the model's
    ``state_dict`` keys do not change); any other ``SyncBatchNormAct`` becomes
    ``nn.Sequential(BatchNorm, activation)`` (its keys gain a ``0.`` level).
    """
    _register_known()
    placeholders = [m for m in module.modules() if isinstance(m, _FusedActivation)]
    layers = {id(m) for m in module.modules() if isinstance(m, SyncBatchNormAct)}
    restored = {id(p._syncbn_fused_into) for p in placeholders if id(p._syncbn_fused_into) in layers}

    def swap(m: nn.Module) -> nn.Module:
        if isinstance(m, _FusedActivation):
            return m._syncbn_original if id(m._syncbn_fused_into) in restored else m
        conversion = _registered(m.__dict__.get("_syncbn_origin"))
        if conversion is not None:
            return conversion[1](m)
        if isinstance(m, SyncBatchNormAct):
            bn = _plain_batchnorm(m)
            if id(m) in restored:  # its activation comes back in its own place
                return bn
            return nn.Sequential(bn, _activation_module(m))
        if not isinstance(m, SyncBatchNorm) or type(m).forward is not SyncBatchNorm.forward:
            return m
        return _plain_batchnorm(m)

    return _replace(module, swap)


def _plain_batchnorm(m: nn.Module) -> nn.Module:
    origin = getattr(m, "_syncbn_origin", _REVERT_DEFAULT)
    # the plain torch class the layer came from (a subclass reverts to its torch base)
    cls = next((c for c in origin.__mro__ if c in _PLAIN_BN[:3]), _REVERT_DEFAULT)
    new = cls(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, device="meta")
    return _move_state(m, new)


# ---- fusing batch norm + activation ------------------------------------------------


class _FusedActivation(nn.Identity):
    """What :func:`fuse_batchnorm_act` leaves where an activation was: an identity (the
    activation now runs inside the ``SyncBatchNormAct`` before it). It remembers the
    original module and its partner, for :func:`revert_sync_batchnorm`, without
    registering them as children (no state, nothing new in ``modules()``)."""

    def __init__(self, original: nn.Module, fused_into: nn.Module):
        super().__init__()
        self.__dict__["_syncbn_original"] = original
        self.__dict__["_syncbn_fused_into"] = fused_into

    def extra_repr(self) -> str:
        return f"fused into the preceding SyncBatchNormAct: {self._syncbn_original!r}"


def _activation_spec(m: nn.Module):
    """``(activation, param)`` for an activation module SyncBatchNormAct can absorb."""
    if type(m) is nn.LeakyReLU and m.negative_slope > 0:
        return "leaky_relu", float(m.negative_slope)
    if type(m) is nn.ELU and m.alpha > 0:
        return "elu", float(m.alpha)
    # nn.Identity is never fused: it saves nothing, and the module after it (timm's
    # drop_block placeholder is followed by ReLU(inplace=True)) may overwrite the output
    # the fused layer keeps for backward
    return None  # ReLU included: it is not invertible


def _activation_module(m: SyncBatchNormAct) -> nn.Module:
    if m.activation == "leaky_relu":
        return nn.LeakyReLU(m.activation_param)
    if m.activation == "elu":
        return nn.ELU(m.activation_param)
    return nn.Identity()


def _fusable_batchnorm(m: nn.Module) -> bool:
    if isinstance(m, _LazyNormBase) and m.has_uninitialized_params():
        return False
    return _is_plain(m) or (isinstance(m, SyncBatchNorm) and type(m).forward is SyncBatchNorm.forward)


def _fuse(bn: nn.Module, act: nn.Module, spec, process_group):
    """The SyncBatchNormAct replacing ``bn`` followed by ``act``, and act's placeholder."""
    new = _synchronized(SyncBatchNormAct, bn, process_group, activation=spec[0], activation_param=spec[1])
    return new, _FusedActivation(act, new)


def _fuse_sequentials(root: nn.Module, process_group) -> int:
    """Fuse (batch norm, activation) neighbours inside every ``nn.Sequential``."""
    fused = 0
    for seq in list(root.modules()):
        if not isinstance(seq, nn.Sequential) or type(seq).forward is not nn.Sequential.forward:
            continue
        items = list(seq._modules.items())
        i = 0
        while i + 1 < len(items):
            (bn_name, bn), (act_name, act) = items[i], items[i + 1]
            spec = _activation_spec(act) if bn is not None and act is not None else None
            if spec is not None and _fusable_batchnorm(bn):
                seq._modules[bn_name], seq._modules[act_name] = _fuse(bn, act, spec, process_group)
                fused += 1
                i += 2
            else:
                i += 1
    return fused


class _LeafTracer(torch.fx.Tracer):
    """Symbolic tracer that stops at batch norms and activations."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (_BatchNorm, nn.LeakyReLU, nn.ELU, nn.Identity, nn.ReLU)):
            return True
        return super().is_leaf_module(m, qualname)


def _fuse_traced(root: nn.Module, process_group) -> int:
    """Fuse the pairs that ``torch.fx`` sees in ``root``'s forward: a batch-norm module
    whose one use feeds only an activation module. Where ``root`` does not trace, its
    children are tried one by one."""
    if not any(True for _ in root.children()) or isinstance(root, (_BatchNorm, _FusedActivation)):
        return 0
    if isinstance(root, torch.jit.ScriptModule):  # compiled code: nothing to rewire
        return 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = _LeafTracer().trace(root)
    except Exception:  # untraceable forward: try the children on their own
        return sum(_fuse_traced(child, process_group) for child in root.children())

    # modules registered under more than one name could be called by a name fx does not
    # report; leave them alone
    registrations = Counter(id(m) for _, m in root.named_modules(remove_duplicate=False))
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1:
            continue
        bn = root.get_submodule(node.target)
        if not _fusable_batchnorm(bn) or registrations[id(bn)] != 1 or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op != "call_module" or tuple(user.args) != (node,) or user.kwargs:
            continue
        act = root.get_submodule(user.target)
        spec = _activation_spec(act)
        if spec is None or registrations[id(act)] != 1:
            continue
        pairs.append((node.target, user.target, act, spec))
    # a shared activation module turns into an identity only if every call of it is fused
    uses = Counter(act_name for _, act_name, _, _ in pairs)
    pairs = [p for p in pairs if uses[p[1]] == calls[p[1]]]

    placeholders = {}
    for bn_name, act_name, act, spec in pairs:
        new, placeholder = _fuse(root.get_submodule(bn_name), act, spec, process_group)
        _set_submodule(root, bn_name, new)
        placeholders.setdefault(act_name, placeholder)
    for act_name, placeholder in placeholders.items():
        _set_submodule(root, act_name, placeholder)
    return len(pairs)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    parent._modules[child] = new


def fuse_batchnorm_act(module: nn.Module, process_group=None) -> nn.Module:
    """Fuse every batch norm directly followed by an invertible activation into one
    :class:`syncbn.SyncBatchNormAct`, which keeps only its output for backward.

    Batch norms: ``torch.nn.BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm`` and
    :class:`syncbn.SyncBatchNorm` (not subclasses that override ``forward``, nor
    uninitialized lazy ones). Activations: ``nn.LeakyReLU`` with a positive slope,
    ``nn.ELU`` with a positive alpha. ``nn.ReLU`` (and slope 0) is not invertible, and a
    batch norm followed by ``nn.Identity`` is never fused (nothing to save, and the next
    module may work in place on the output): those pairs stay as they are, as does
    everything else.

    Two passes, both in place on the children (the root is returned):

    1. inside every ``nn.Sequential`` (and subclasses that keep its ``forward``), each
       batch norm immediately followed by such an activation;
    2. ``torch.fx`` symbolic tracing of the model's ``forward``, for pairs written in a
       custom ``forward`` (``self.act(self.bn(x))``): a batch-norm module called once,
       whose output feeds nothing but an activation module, every call of which is such
       a pair. Where the model does not trace (data-dependent control flow, ...), its
       children are traced one by one, and what traces nowhere is left to pass 1:
       failures are silent. Tracing runs ``forward`` once with symbolic values: Python
       side effects in a ``forward`` happen once more. Activations applied as functions
       (``F.leaky_relu(self.bn(x))``) cannot be fused without rewriting code and stay.

    The batch norm is replaced by the fused layer (same parameter and buffer tensors,
    same ``state_dict`` keys) and the activation by an identity placeholder, so the
    model's ``state_dict`` keys and module indices do not change and
    :func:`revert_sync_batchnorm` restores both. The fused layer is synchronized over
    ``process_group`` (default: the default group; a ``SyncBatchNorm`` keeps its own).
    """
    _fuse_sequentials(module, process_group)
    _fuse_traced(module, process_group)
    return module
