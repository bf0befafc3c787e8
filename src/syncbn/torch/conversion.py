"""Model conversion: swap every BatchNorm layer of a model for its synchronized form,
and back again for single-device inference and export.

The swap moves the very same parameter and buffer tensors into the new module, so an
optimizer built before the conversion keeps working, and values, ``requires_grad``,
device, dtype, the ``training`` flag, attributes and child modules set on the instance
and its module hooks are kept (not a fused layer's hooks, see below). A BatchNorm
subclass that overrides ``forward`` (an activation or dropout after the normalization)
or another method of torch's batch norm (``train``, to keep a frozen layer in eval mode)
is never replaced by a plain layer that would drop that behaviour: it is left as it is,
with a warning that counts the layers left local (or an error, with ``strict=True``),
unless a conversion for its class was registered with :func:`register_conversion`.
timm's norm-act layers are registered that way (:mod:`syncbn.torch.timm`) as soon as
timm is imported. So is a layer whose behaviour lives outside its parameters and buffers
(a weight pruned with ``torch.nn.utils.prune`` or parametrized with
``torch.nn.utils.parametrize``): moving its tensors would silently drop that behaviour.
So is a hooked :class:`syncbn.SyncBatchNormAct` on revert, and a hooked batch norm is
not fused: a hook on the fused layer sees the activated output.

:func:`fuse_batchnorm_act` goes one step further for memory: each batch norm followed
directly by an invertible activation becomes one :class:`syncbn.SyncBatchNormAct`.
:func:`revert_sync_batchnorm` undoes both.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import operator
import sys
import warnings
import weakref
from collections import Counter
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm, _LazyNormBase
from torch.nn.modules.lazy import LazyModuleMixin

from . import distributed, fingerprint
from .batchnorm import BatchNormNd, SyncBatchNorm, _SyncNormBase
from .batchnorm_act import SyncBatchNormAct

__all__ = ["convert_sync_batchnorm", "revert_sync_batchnorm", "fuse_batchnorm_act", "register_conversion", "name_layers"]

# classes whose forward is plain batch norm over the whole batch
_PLAIN_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, BatchNormNd)
# what revert gives back: the plain class a layer came from (see _not_restorable); else the
# rank-specific torch class that class derives from, if any; else (origin unknown or
# synchronizing) BatchNormNd, which takes every input the layer took
_RANKED_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_BN_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
# the class names a scripted (TorchScript) batch norm keeps as its original_name
_BN_NAMES = {cls.__name__ for cls in _PLAIN_BN} | {"LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"}
# per-module hooks that a move of the parameters and buffers into a new module would drop
_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)
# everything a module keeps about its hooks: the dictionaries above and what torch keeps
# beside them, keyed by the same handle ids (``_forward_hooks_with_kwargs``, ...), read off
# the torch in use rather than listed, so that a hook moves whole on any version
_HOOK_STATE = tuple(name for name in vars(nn.Module()) if "hook" in name)
_GLOBAL_HOOKS = (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks",
)
_MISSING = object()


# methods a batch-norm subclass may define and still be a plain batch norm: a layer of it
# computes, trains, saves and loads as torch's layer does
_HARMLESS_METHODS = {"__init__", "_check_input_dim", "extra_repr"}
# methods of syncbn's synchronized layers beyond torch's batch norm that a subclass may
# redefine and still revert to a plain batch norm: torch.jit.script's refusal, torch.fx's
# call of the layer, the question the input check asks (_check_input_dim is harmless), and
# copy.deepcopy's (how the process group is shared, which a plain layer does not hold);
# any other (``_momentum``, the running-buffer weight both forwards use) changes what the
# layer computes, so a subclass redefining it is left as it is by revert
_SYNC_HARMLESS_METHODS = _HARMLESS_METHODS | {"__prepare_scriptable__", "_fx_leaf", "_holds_channels", "__deepcopy__"}


def _overridden(cls: type, bases: tuple, methods_of: tuple = (_BatchNorm,), harmless: set = _HARMLESS_METHODS) -> list:
    """The methods of torch's batch norm (of a class in ``methods_of``) that ``cls`` (or a
    class between it and the first of ``bases`` in its MRO) redefines, beyond those in
    ``harmless``: ``train`` kept in eval (a frozen layer), ``forward``,
    ``_load_from_state_dict``, ... A converted or reverted layer would lose them."""
    found = []
    for c in cls.__mro__:
        if c in bases or c is _BatchNorm:
            break
        if c in (_LazyNormBase, LazyModuleMixin):  # a lazy layer's shape inference (see _become)
            continue
        for name, value in vars(c).items():
            if name not in harmless and name not in found and any(hasattr(k, name) for k in methods_of) and (
                callable(value) or isinstance(value, (property, staticmethod, classmethod))
            ):
                found.append(name)
    return found


def _overrides(m: nn.Module, bases: tuple) -> list:
    """:func:`_overridden` for the layer ``m``: by its class, and for a lazy layer by the class
    its first forward makes it too (``cls_to_become``)."""
    found = _overridden(_class_of(m), bases)
    become = getattr(m, "cls_to_become", None) if isinstance(m, _LazyNormBase) else None
    if isinstance(become, type):
        found += [name for name in _overridden(become, bases) if name not in found]
    return found


def _lazy_unfinished(m: nn.Module) -> bool:
    """Whether ``m`` is a lazy batch norm with a parameter or buffer not materialized yet
    (neither a forward nor ``load_state_dict`` gave it a shape)."""
    return isinstance(m, _LazyNormBase) and m.has_uninitialized_params()


# what a converter says about such a layer: no synchronized layer can take its place exactly
_LAZY_FIX = "an uninitialized lazy module: run one forward or load a state_dict holding its tensors first"


def _become(m: nn.Module) -> type:
    """The class ``m`` is taken for: for a lazy batch norm whose tensors are all materialized
    (``load_state_dict`` gives them their shapes), the class its first forward gives it
    (``cls_to_become``: ``BatchNorm2d`` for ``LazyBatchNorm2d``), else its own. The layer
    itself is left as it is: the user may hold it, and it stays a working lazy layer that
    its own first forward finishes (``LazyModuleMixin._infer_parameters``)."""
    become = getattr(m, "cls_to_become", None) if isinstance(m, _LazyNormBase) else None
    return become if isinstance(become, type) else type(m)


# the instance attributes holding a lazy layer's handles to its own shape-inference hooks
_LAZY_HANDLES = ("_initialize_hook", "_load_hook")


def _lazy_hook_ids(m: nn.Module) -> set:
    """The handle ids of a lazy layer's own shape-inference hooks, until its first forward
    removes them: they run this layer's own code, so they never move to its replacement
    (a SyncBatchNorm would fail in them), and the hook dictionaries holding them stay with it."""
    if not isinstance(m, LazyModuleMixin):
        return set()
    return {h.id for h in (m.__dict__.get(name) for name in _LAZY_HANDLES) if h is not None}


def _lazy_hooks_shared(m: nn.Module) -> list:
    """The hook dictionaries of a lazy layer not yet run that hold other hooks beside its own
    shape-inference ones. Those cannot move: the converted layer would need the same
    dictionaries (their handles hold them) without the lazy layer's own hooks in them, and
    taking those out would change the user's layer behind their back."""
    lazy = _lazy_hook_ids(m)
    if not lazy:
        return []
    return _hook_kinds(name for name in _HOOK_STATE if isinstance(hooks := m.__dict__.get(name), dict)
                       and lazy & set(hooks) and set(hooks) - lazy)


def _hook_kinds(names) -> list:
    """The kinds of hooks (``forward_pre_hooks``, ...) the hook-state names ``names`` keep,
    in order, each once (``_forward_hooks_with_kwargs`` keeps forward hooks too)."""
    found = []
    for name in names:
        kind = name.strip("_").replace("_with_kwargs", "").replace("_always_called", "")
        if kind not in found:
            found.append(kind)
    return found


def _channels(bn: nn.Module) -> int:
    """The number of channels ``bn``'s per-channel tensors hold, else its ``num_features``
    (a lazy batch norm materialized by ``load_state_dict`` keeps ``num_features`` 0, after
    its first forward too; torch's kernel never reads it, syncbn's input check does)."""
    for name in ("weight", "running_mean", "bias", "running_var"):
        tensor = getattr(bn, name, None)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
            return tensor.shape[0]
    return bn.num_features


def _class_of(m: nn.Module) -> type:
    """``m``'s class, not the subclass ``torch.nn.utils.parametrize`` makes for a
    parametrized module (what its ``remove_parametrizations`` restores)."""
    from torch.nn.utils import parametrize

    return type(m).__bases__[0] if parametrize.is_parametrized(m) else type(m)


def _is_plain(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and not _overrides(module, _PLAIN_BN)


def _own_attribute_names() -> set:
    """The instance attributes that syncbn's and torch's batch norms set themselves."""
    return set().union(*(_attributes_set_by(cls) for cls in (nn.BatchNorm2d, SyncBatchNorm, SyncBatchNormAct)))


def _attributes_set_by(cls: type) -> set:
    """The instance attributes that a ``cls`` layer (a batch norm built with one feature on
    the meta device) sets itself; made once per class."""
    if cls not in _SELF_SET:
        _SELF_SET[cls] = set(cls(1, device="meta").__dict__)
    return _SELF_SET[cls]


# class -> the instance attributes its layers set themselves (filled on first use)
_SELF_SET: dict = {}


def _foreign_attributes(m: nn.Module, made: nn.Module | None = None) -> list:
    """The attributes on the instance ``m`` that :func:`_carry` never moves, but that ``m``'s
    own batch norm class does not set: names that one of syncbn's or torch's batch norms
    sets itself (a user's ``inplace`` flag or ``process_group`` on a ``BatchNorm2d``
    subclass, an ``activation`` on a ``SyncBatchNorm`` subclass: moved into a synchronized
    layer, syncbn's value would take their place, and revert would give the layer back
    without them), and names that ``nn.Module`` declares on its class (a user's
    ``dump_patches`` or ``_version``: the new layer holds torch's) other than torch's own
    bookkeeping (:data:`_TORCH_BOOKKEEPING`) and its methods (a method set on the instance
    is :func:`_why_not_movable`'s). ``process_group`` is a ``torch.nn.SyncBatchNorm``'s own
    (and a syncbn layer's: the plain layer revert makes does not synchronize),
    ``activation``, ``inplace``, ... a :class:`SyncBatchNormAct`'s (revert gives them to the
    activation module). ``made``: the layer a registered conversion made of ``m``; the
    names it holds itself are its conversion's to carry."""
    own = set(_attributes_set_by(nn.BatchNorm2d))
    for kind, cls in ((nn.SyncBatchNorm, nn.SyncBatchNorm), (_SyncNormBase, SyncBatchNorm),
                      (SyncBatchNormAct, SyncBatchNormAct)):
        if isinstance(m, kind):
            own |= _attributes_set_by(cls)
    if made is not None:
        own |= set(made.__dict__)
    standard = _own_attribute_names()
    return sorted(name for name in m.__dict__ if name not in own and (name in standard or (
        hasattr(nn.Module, name) and name not in _TORCH_BOOKKEEPING
        and not inspect.isfunction(getattr(_BatchNorm, name, None)))))


# what torch sets on a module instance after building it and that never moves to a new
# layer: ``Module.compile()``'s compiled call of the old layer (see :func:`_carried`)
_TORCH_BOOKKEEPING = ("_compiled_call_impl",)


def _slotted(cls: type) -> str | None:
    """The classes (``A, B``) between ``cls`` and the torch batch norm it derives from that
    declare ``__slots__`` (``cls`` itself where only its instance size tells), or None. A
    slot's value lives outside the instance ``__dict__``, the only place conversion and
    revert carry attributes from."""
    base = next(c for c in cls.__mro__ if c in _BUILT_BN)
    slotted = [c.__qualname__ for c in cls.__mro__[:cls.__mro__.index(base)] if vars(c).get("__slots__")]
    if slotted or cls.__basicsize__ != base.__basicsize__:
        return ", ".join(slotted) or cls.__qualname__
    return None


def _not_carried(m: nn.Module, fix: str, made: nn.Module | None = None) -> str | None:
    """Why a layer made of the batch norm ``m`` (synchronized by convert or fusion, plain by
    revert) cannot hold all of ``m``'s state (see :func:`_slotted`,
    :func:`_foreign_attributes`), with ``fix`` for the fix beyond renaming or dropping, or
    None. ``made``: the layer a registered conversion made of ``m``, which carries what its
    class declares itself (``__slots__`` included)."""
    slotted = None if made is not None else _slotted(_class_of(m))
    if slotted is not None:
        return (f"{slotted} declares __slots__, whose values conversion cannot carry (it moves the instance "
                f"__dict__): drop __slots__{fix}")
    foreign = _foreign_attributes(m, made)
    if not foreign:
        return None
    standard = _own_attribute_names()
    groups = [[name for name in foreign if name in standard], [name for name in foreign if name not in standard]]
    one = not all(groups)  # the names of one kind only: "this name", else each kind's names

    def these(names):
        return ("these names" if len(names) > 1 else "this name") if one else ", ".join(names)

    owners = [f"syncbn's layers set {these(groups[0])} themselves"] if groups[0] else []
    owners += [f"torch.nn.Module declares {these(groups[1])} on its class"] if groups[1] else []
    return (f"its attribute{'s' * (len(foreign) > 1)} {', '.join(foreign)} would be lost: {' and '.join(owners)}, "
            f"with their own meaning; rename {'them' if len(foreign) > 1 else 'it'}{fix}")


_REGISTER_FIX = ", or teach the converter with syncbn.register_conversion"


def _carried(name: str) -> bool:
    """Whether an instance attribute ``name`` that no batch norm sets in ``__init__`` moves
    to the new layer. Not torch's own bookkeeping, which ``nn.Module`` declares on the class
    and sets on an instance later: ``Module.compile()`` stores the old layer's
    ``_call_impl``, compiled, and the new layer would run the old layer's forward on
    every call (torch's pickling drops it too); nor syncbn's own."""
    return not name.startswith("_syncbn") and not hasattr(nn.Module, name)


def _move_state(src: nn.Module, dst: nn.Module, *, attributes: bool = False, hooks: bool = False) -> nn.Module:
    """Give ``dst`` the parameters, buffers and flags of ``src`` (the same tensors).

    A batch-norm buffer that ``src`` lacks or holds as None (``bn.running_mean = None``,
    torch's way to normalize with batch statistics in eval mode) is None in ``dst``
    too, not the placeholder ``dst`` was built with (on the meta device). A buffer
    ``src`` keeps out of its ``state_dict`` stays out of ``dst``'s.

    ``attributes`` and ``hooks``: what :func:`_carry` moves besides."""
    for name in ("weight", "bias"):  # a BN built with bias=False keeps no bias
        if name in dst._parameters:
            dst._parameters[name] = src._parameters.get(name)
    for name, buf in src.named_buffers(recurse=False):
        dst._buffers[name] = buf
    for name in _BN_BUFFERS:
        if name in dst._buffers and src._buffers.get(name) is None:
            dst._buffers[name] = None
    dst._non_persistent_buffers_set = (dst._non_persistent_buffers_set - set(src._buffers)) | (
        src._non_persistent_buffers_set & set(dst._buffers))
    dst.train(src.training)
    if hasattr(src, "qconfig"):
        dst.qconfig = src.qconfig
    return _carry(src, dst, attributes=attributes, hooks=hooks)


def _carry(src: nn.Module, dst: nn.Module, *, attributes: bool = False, hooks: bool = False) -> nn.Module:
    """With ``attributes``, give ``dst`` ``src``'s child modules and the attributes set on the
    ``src`` instance that no batch norm sets itself (a user's or a framework's flags) and
    ``dst`` lacks; with ``hooks``, ``src``'s module hooks: the same hook dictionaries, so
    the handles that registered them still remove them. The one way every conversion
    carries these (a plain layer's, and after a registered conversion, see
    :func:`_carry_registered`). ``src`` itself is not changed: a lazy layer's own
    shape-inference hooks and their handles stay with it (see :func:`_lazy_hook_ids`).

    A hook dictionary that ``dst`` already fills itself (hooks a registered conversion put
    on its new layer) is never merged with ``src``'s: one of the two sets of handles would
    stop removing its hooks (:func:`_hooks_clash` keeps such layers as they are)."""
    if attributes:  # and child modules (an observer a hook calls), as torch's converter keeps them
        for name, child in src._modules.items():
            dst._modules.setdefault(name, child)
        standard = _own_attribute_names()
        lazy_handles = _LAZY_HANDLES if isinstance(src, LazyModuleMixin) else ()
        for name, value in src.__dict__.items():
            if name not in standard and name not in dst.__dict__ and _carried(name) and name not in lazy_handles:
                dst.__dict__[name] = value
    if hooks:
        clash = _hooks_clash(src, dst)
        if clash:  # the callers leave such a layer as it is before getting here
            raise RuntimeError(f"syncbn: cannot carry the {', '.join(clash)} of {type(src).__name__} to "
                               f"{type(dst).__name__}, which holds its own")
        lazy = _lazy_hook_ids(src)
        for name in _HOOK_STATE:
            moved, own = src.__dict__.get(name), dst.__dict__.get(name)
            if moved is None or moved is own or (isinstance(moved, dict) and not moved):
                continue  # nothing to move: ``dst`` keeps its own
            if isinstance(moved, dict) and lazy & set(moved):
                continue  # a lazy layer's own hooks, and no others (see _lazy_hooks_shared)
            dst.__dict__[name] = moved
        # torch holds a load_state_dict pre-hook with a weak reference to its module, which
        # it passes to the hook: make that ``dst`` (``src`` is about to go, and a dead
        # module makes the hook raise)
        for hook in dst._load_state_dict_pre_hooks.values():
            module = getattr(hook, "module", None)
            if getattr(hook, "with_module", False) and callable(module) and module() is src:
                hook.module = weakref.ref(dst)
    return dst


def _hooks_clash(src: nn.Module, new: nn.Module) -> list:
    """The kinds of module hooks that both ``src`` and ``new`` hold, each in its own
    dictionary (a registered conversion's ``to_sync`` or ``to_plain`` hooked the layer it
    made): moving ``src``'s to ``new`` cannot keep both sets of handles working. A handle
    removes its hook from the dictionary it was registered in; merged into one, the other
    set's handles would no longer remove theirs, silently. Empty when nothing clashes, or
    when nothing moves (:func:`_carries`)."""
    if not _carries(src, new):
        return []
    lazy = _lazy_hook_ids(src)  # the dictionaries holding a lazy layer's own hooks do not move
    return _hook_kinds(
        name for name in _HOOK_STATE
        if isinstance(moved := src.__dict__.get(name), dict) and isinstance(own := new.__dict__.get(name), dict)
        and moved and own and moved is not own and not lazy & set(moved)
    )


def _registered_reason(src: nn.Module, new: nn.Module, step: str) -> str | None:
    """Why the layer ``src``, which a registered conversion's ``step`` made ``new`` of, stays
    as it is, or None: hooks that cannot move (see :func:`_hooks_clash`), or attributes
    that :func:`_carry_registered` does not move and ``new`` does not hold (see
    :func:`_foreign_attributes`: ``step`` carries what its class sets itself)."""
    clash = _hooks_clash(src, new)
    if clash:
        return (f"its {', '.join(clash)} cannot move to the layer {step} makes, which it hooks itself (the handles "
                "of one set would no longer remove their hooks): remove these hooks before and register them on "
                "the new layer after")
    if not _carries(src, new):  # nothing moves: ``src`` stays in the model, or ``new`` holds it
        return None
    return _not_carried(src, f", or have {step} set the same name on the layer it makes", made=new)


def _carries(src: nn.Module, new: nn.Module) -> bool:
    """Whether :func:`_carry_registered` carries ``src``'s hooks and attributes to ``new``."""
    return not any(m is src for m in new.modules()) and not any(m is new for m in src.modules())


def _carry_registered(src: nn.Module, new: nn.Module) -> nn.Module:
    """After a registered conversion (``to_sync`` or ``to_plain``) made ``new`` of ``src``:
    carry what the conversion of a plain layer carries (:func:`_carry`), which that
    conversion need not know about. Its contract (the same computation and ``state_dict``
    keys) is what lets the hooks move. Nothing when ``new`` is ``src`` or holds it (a
    wrapper: ``src`` stays in the model with its hooks, which would run twice), or when
    ``src`` holds ``new`` (unwrapped: ``new`` would become its own child)."""
    if _carries(src, new):
        _carry(src, new, attributes=True, hooks=True)
    return new


def _synchronized(cls, bn: nn.Module, process_group, *, carry: dict | None = None, **kwargs) -> nn.Module:
    """A ``cls`` layer (SyncBatchNorm or SyncBatchNormAct) holding ``bn``'s state.

    The group is ``process_group``, else the one ``bn`` already synchronizes over; the
    layer remembers the plain torch class ``bn`` came from, for the revert. ``carry``:
    the keyword arguments of :func:`_move_state` (what else moves over).
    """
    group = process_group
    if group is None and isinstance(bn, (nn.SyncBatchNorm, SyncBatchNorm)):
        group = bn.process_group
    new = cls(
        _channels(bn),
        eps=bn.eps,
        momentum=bn.momentum,
        affine=bn.affine,
        track_running_stats=bn.track_running_stats,
        process_group=group,
        device="meta",
        bias=bn.bias is not None or not bn.affine,
        **kwargs,
    )
    new = _move_state(bn, new, **(carry or {}))
    new._syncbn_origin = getattr(bn, "_syncbn_origin", _become(bn))
    return new


def _replace(module: nn.Module, swap, done: Optional[dict] = None) -> nn.Module:
    """Apply ``swap`` to ``module`` and to every descendant, top-down; returns the root.
    A module registered in several places is swapped once, and every place gets the same
    replacement (two would split its parameters and running buffers)."""
    done = {} if done is None else done
    if id(module) in done:
        return done[id(module)][1]
    new = swap(module)
    done[id(module)] = (module, new)  # the module held too: its id stays its own meanwhile
    if new is not module:
        return new
    for name, child in module.named_children():
        replaced = _replace(child, swap, done)
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

    After each call the converter moves the old layer's module hooks, instance attributes
    and child modules to the new one, as for a plain batch norm (not when one holds the
    other: a wrapper keeps the old layer, hooks and all); hooks that ``to_sync`` or
    ``to_plain`` put on its new layer itself stay there, with their handles working. Where
    both layers hold hooks of one kind (a forward hook on each, say), no new layer can
    keep both sets of handles working (a handle removes its hook from the dictionary it
    was registered in): the old layer stays as it is (convert: local, with the warning, or
    ``strict=True``'s error, which ``to_sync`` is called before; revert: with its warning).
    So does one holding an attribute that the converter never moves (a name that syncbn's
    layers set themselves, ``inplace``, ``activation``, ... or that ``torch.nn.Module``
    declares on its class, ``_version``, ...) and that the new layer does not hold:
    ``to_sync`` and ``to_plain`` carry their class's own state (its attributes of those
    names, held by the layer they make under the same name, and its ``__slots__``).

    Only layers whose type is exactly ``cls`` are matched: a subclass may change what
    the layer computes, so it needs its own registration. Registering a class again
    replaces its conversion. timm's ``BatchNormAct2d`` and ``SyncBatchNormAct`` are
    registered this way by :mod:`syncbn.torch.timm`.
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_conversion: cls must be a torch.nn.Module subclass, got {cls!r}")
    for name, fn in (("to_sync", to_sync), ("to_plain", to_plain)):
        if not callable(fn):
            raise TypeError(f"register_conversion: {name} must be callable, got {fn!r}")
    _CONVERSIONS[cls] = (to_sync, to_plain)


# conversions of other libraries' layers, registered the first time a conversion runs
# after the library is imported: (module whose presence in sys.modules triggers it,
# register function). Filled by the adapters (:mod:`syncbn.torch.timm`), which import
# this module, never the other way round.
_LIBRARY_HOOKS: list = []


def register_library(module_name: str, register: Callable[[], None]) -> None:
    """Call ``register()`` before a conversion once ``module_name`` has been imported
    (by the user: nothing here imports it)."""
    _LIBRARY_HOOKS.append((module_name, register))


def _register_known() -> None:
    """Register the conversions of the libraries already imported (never imports them)."""
    for module_name, register in _LIBRARY_HOOKS:
        if module_name in sys.modules:
            register()


def _registered(cls: Optional[type]):
    return _CONVERSIONS.get(cls) if cls is not None else None


def _classify(m: nn.Module, name: str = ""):
    """What conversion does with ``m`` (called ``name`` in the model): None (not a batch
    norm), "synced" (already synchronized), "registered", "plain", or the reason it stays
    local."""
    if isinstance(m, (SyncBatchNorm, SyncBatchNormAct)) or "_syncbn_origin" in m.__dict__:
        return "synced"
    if isinstance(m, torch.jit.ScriptModule):  # compiled code: nothing can be rewired
        buffers = {n for n, _ in m.named_buffers(recurse=False)}
        if getattr(m, "original_name", "") in _BN_NAMES or {"running_mean", "running_var"} <= buffers:
            return "a TorchScript module (torch.jit.script or trace): convert the model before scripting it"
        return None
    registered = type(m) in _CONVERSIONS
    if not registered:
        if not isinstance(m, _BatchNorm):
            return None
        if _lazy_unfinished(m):
            return _LAZY_FIX
        overridden = _overrides(m, _PLAIN_BN)
        if overridden:
            return f"it overrides {', '.join(overridden)}; teach the converter with syncbn.register_conversion"
        slotted = _slotted(_class_of(m))
        if slotted is not None:  # by class, as the overrides
            return _not_carried(m, _REGISTER_FIX)
    # a registered conversion moves the layer's own tensors, and the converter its hooks
    # and attributes (_carry_registered), but not pruning or parametrizations: those stay
    # local too, as on a plain layer
    why = _why_not_movable(m, extra_tensors=not registered, hooks=False)
    if why is None and not registered:  # a registered conversion carries its class's attributes itself
        why = _not_carried(m, _REGISTER_FIX)
    if why is None and (shared := _lazy_hooks_shared(m)):
        why = (f"its {', '.join(shared)} hold other hooks beside its own shape-inference ones, "
               "which cannot move without them: run one forward before converting (torch then finishes the "
               "lazy layer), or register these hooks on the converted layer")
    if why is not None:
        return f"{name or type(m).__name__}: {why}"
    return "registered" if registered else "plain"


def convert_sync_batchnorm(module: nn.Module, process_group=None, strict: bool = False) -> nn.Module:
    """Return ``module`` with every BatchNorm1d/2d/3d, ``torch.nn.SyncBatchNorm`` and
    :class:`syncbn.torch.BatchNormNd` (and any other ``_BatchNorm`` subclass that keeps
    torch's ``forward``) replaced by :class:`syncbn.SyncBatchNorm` on ``process_group``,
    and every layer of a class registered with :func:`register_conversion` (timm's
    norm-act layers, when timm is imported) by its registered synchronized form.

    Works in place on the children (like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``)
    and returns the root, which is a new module when the root itself is a BatchNorm.
    A ``torch.nn.SyncBatchNorm`` keeps its own process group unless one is given; syncbn's
    layers already in the model keep theirs either way (not converted), and a warning names
    those on another group than a ``process_group`` given. A layer
    registered in several places becomes one synchronized layer held in all of them.

    A layer's module hooks, instance attributes and child modules move to its replacement
    (the same hook dictionaries: their handles still remove them), a registered class's
    too. A lazy layer materialized by ``load_state_dict`` converts as the class its first
    forward makes of it; the lazy layer itself is left as it is (its class, and its own
    shape-inference hooks, which stay with it): run, it is still a working lazy layer.

    A BatchNorm layer that cannot be converted (a subclass overriding ``forward`` or
    another of torch's batch-norm methods, such as ``train``, with no registered
    conversion, a lazy module not yet materialized (by one forward or by
    ``load_state_dict``: then it converts) or not yet run and holding forward-pre or
    load_state_dict-pre hooks beside its own (they share one dictionary, which cannot
    move without them: run one forward first), a layer whose behaviour lives outside its
    parameters and buffers: a pruned or parametrized weight; one holding an attribute
    named like one that syncbn's layers set themselves, ``process_group``, ``activation``,
    ``activation_param``, ``inplace`` (not a ``torch.nn.SyncBatchNorm``'s own group), or
    like one that ``torch.nn.Module`` declares on its class (``dump_patches``,
    ``_version``), or whose class declares ``__slots__``: what conversion carries is the
    instance ``__dict__``, without those names; a layer of a registered class holding such
    an attribute that the layer its ``to_sync`` made does not hold; a batch norm inside
    TorchScript code, ``torch.jit.script`` or
    ``trace``) stays local: a warning says
    how many of the model's BatchNorm layers that leaves local, and which classes. With
    ``strict=True`` a ``ValueError`` is raised instead, before anything is changed (the
    decision depends only on the model, so every rank raises alike).
    """
    _register_known()
    decisions = {}
    made = {}  # what the registered conversions made, by the id of the layer they made it of
    total = 0
    elsewhere = []  # the layers synchronized already over another group than the one given
    for name, m in module.named_modules():
        kind = _classify(m, name)
        if kind == "registered":  # made now, so that strict=True can refuse a clash before any change
            made[id(m)] = _CONVERSIONS[type(m)][0](m, process_group)
            why = _registered_reason(m, made[id(m)], "to_sync")
            if why is not None:
                kind = f"{name or type(m).__name__}: {why}"
                del made[id(m)]
        if kind is not None:
            decisions[id(m)] = kind
            total += 1
        if (kind == "synced" and process_group is not None and isinstance(m, _SyncNormBase)
                and not _same_group(m.process_group, process_group)):
            elsewhere.append(name or type(m).__name__)
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
            return _synchronized(SyncBatchNorm, m, process_group, carry={"attributes": True, "hooks": True})
        if kind == "registered":
            new = _carry_registered(m, made[id(m)])
            if new is not m and "_syncbn_origin" not in new.__dict__:
                new._syncbn_origin = type(m)
            return new
        return m

    result = _replace(module, swap)
    name_layers(result)  # qualified names identify the layers' collectives
    if message:
        warnings.warn(message, stacklevel=2)
    if elsewhere:
        warnings.warn(
            f"syncbn.convert_sync_batchnorm: process_group was given, but {len(elsewhere)} layer(s) synchronized "
            "already keep the group they were built or converted with "
            f"({', '.join(map(repr, elsewhere))}): convert gives it only to the layers it converts. Set "
            "layer.process_group = process_group on those to synchronize them over it too",
            stacklevel=2,
        )
    return result


def _same_group(a, b) -> bool:
    """Whether the process groups ``a`` and ``b`` are one (None: the default group)."""
    world = distributed.default_group()
    return (world if a is None else a) is (world if b is None else b)


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Return ``module`` with every :class:`syncbn.SyncBatchNorm` back as a plain batch
    norm that takes every input the layer took: an instance of exactly the class it was
    converted from (``torch.nn.BatchNorm1d/2d/3d``, your subclass of one with its own
    ``__init__``, ``_check_input_dim`` and ``extra_repr``, another library's any-rank
    ``_BatchNorm`` subclass such as mmengine's ``_BatchNormXd``), not built by that class's
    ``__init__`` but holding what it set: the instance attributes move back with the
    tensors. A layer converted from ``torch.nn.SyncBatchNorm`` (or a subclass of it: revert
    never gives back a synchronizing layer), or a ``SyncBatchNorm`` built directly, becomes
    :class:`syncbn.torch.BatchNormNd`, torch's plain batch norm for inputs of any rank; a
    lazy layer, the class its first forward makes of it. A class that is no plain batch
    norm any more (given a ``forward`` since, or declaring ``__slots__``) is given back as
    the ``BatchNorm1d/2d/3d`` it derives from (else ``BatchNormNd``), with a warning naming
    it. Values are identical (the same kernel); the same parameter and buffer tensors are
    moved back, so the ``state_dict`` keys and tensors do not change.

    A layer made by a conversion registered with :func:`register_conversion` goes back
    through that registration's ``to_plain`` (timm's layers become timm's
    ``BatchNormAct2d``). A subclass of ``SyncBatchNorm`` or ``SyncBatchNormAct`` that
    overrides ``forward`` (or another method of torch's batch norm, such as ``train``, or
    ``_momentum``) and has no registered conversion is left as it is, still synchronized
    (the plain layers would drop what its class adds), and named in a warning with the
    methods and the fix: replace that layer yourself with a plain batch norm (and
    activation) that does what its class adds.

    A :class:`syncbn.SyncBatchNormAct` made by :func:`fuse_batchnorm_act` becomes the
    batch norm and activation it was made of, each in its old place (so the model's
    ``state_dict`` keys do not change); any other ``SyncBatchNormAct`` becomes
    ``nn.Sequential(BatchNorm, activation)`` (its keys gain a ``0.`` level).

    A layer whose state the layer revert would make cannot hold is left as it is (still
    synchronized), named in a warning with why and the fix: one holding an attribute named
    like one that syncbn's layers set themselves and its own class does not (``inplace``,
    ``activation``, ``activation_param`` on a ``SyncBatchNorm`` or your subclass of it) or
    like one that ``torch.nn.Module`` declares on its class (``dump_patches``,
    ``_version``; not torch's own bookkeeping, such as ``compile()``'s compiled call, which
    never moves), none of which the converter moves; one whose class declares
    ``__slots__`` (only the instance ``__dict__`` moves); after a registered ``to_plain``,
    one holding such an attribute that the layer ``to_plain`` made does not hold. The fix:
    rename the attribute or drop ``__slots__`` (or, for a converted layer, register a
    conversion for the class it came from whose ``to_plain`` carries it). A pruned or
    parametrized layer, and a hooked ``SyncBatchNormAct`` not made by a registered
    conversion, are left as they are likewise.
    """
    return _revert(module, keep=())


def _synchronized_layers(module: nn.Module) -> list:
    """The layers of ``module`` that :func:`convert_sync_batchnorm` leaves as they are
    because they are synchronized already (what :func:`_revert` can be told to keep)."""
    return [m for m in module.modules() if _classify(m) == "synced"]


def _revert(module: nn.Module, keep) -> nn.Module:
    """:func:`revert_sync_batchnorm`, leaving the layers in ``keep`` (and the placeholders
    of those fused ones) as they are: the Lightning plugin reverts only what it converted."""
    _register_known()
    kept = {id(m) for m in keep}
    names = {id(m): name or type(m).__name__ for name, m in module.named_modules()}
    skipped, fallbacks = [], []
    placeholders = [m for m in module.modules() if isinstance(m, _FusedActivation)]
    layers = {id(m) for m in module.modules() if isinstance(m, SyncBatchNormAct) and id(m) not in kept}
    restored = {id(p._syncbn_fused_into) for p in placeholders if id(p._syncbn_fused_into) in layers}

    def leave(m: nn.Module, why: str) -> nn.Module:  # ``m`` stays as it is, named in the warning
        skipped.append(f"{names.get(id(m), type(m).__name__)} ({why})")
        restored.discard(id(m))  # a fused layer left keeps its activation's placeholder
        return m

    def swap(m: nn.Module) -> nn.Module:
        if id(m) in kept:
            return m
        if isinstance(m, _FusedActivation):
            return m._syncbn_original if id(m._syncbn_fused_into) in restored else m
        conversion = _registered(m.__dict__.get("_syncbn_origin"))
        synced = isinstance(m, (SyncBatchNorm, SyncBatchNormAct))
        if synced:
            # a class that overrides a method has no plain class to go back to; hooks move
            # with the layer, but not from a SyncBatchNormAct that no registered conversion
            # made: a forward or backward hook on it sees the activated output and its
            # gradient, which neither the batch norm nor the activation it splits into
            # computes (nor does a Sequential of them hold the layer's attributes or
            # state_dict keys, which its hooks read)
            why = ((_why_kept_synchronized(m) if conversion is None else None)
                   or _why_not_movable(m, hooks=conversion is None and isinstance(m, SyncBatchNormAct)))
            if why is not None:
                return leave(m, why)
        if conversion is not None:
            new = conversion[1](m)
            why = _registered_reason(m, new, "to_plain")
            if why is not None:
                return leave(m, why)
            return _carry_registered(m, new)
        if not synced:
            return m
        why = _not_carried(m, _revert_fix(m))  # the plain layer holds what _carry moves
        if why is not None:
            return leave(m, why)
        if isinstance(m, SyncBatchNormAct):
            bn = _plain_batchnorm(m, fallbacks=fallbacks)
            if id(m) in restored:  # its activation comes back in its own place
                return bn
            return nn.Sequential(bn, _activation_module(m))
        return _plain_batchnorm(m, hooks=True, fallbacks=fallbacks)

    # the layers first (a skipped fused layer keeps its placeholder), then the placeholders
    module = _replace(module, lambda m: m if isinstance(m, _FusedActivation) else swap(m))
    result = _replace(module, lambda m: swap(m) if isinstance(m, _FusedActivation) else m)
    if skipped:
        warnings.warn(
            "syncbn.revert_sync_batchnorm left these layers as they are: " + "; ".join(sorted(set(skipped))),
            stacklevel=2,
        )
    if fallbacks:
        warnings.warn(
            "syncbn.revert_sync_batchnorm gave these layers back as a torch class, not the class they were "
            "converted from: " + "; ".join(f"{count} x {what}" for what, count in sorted(Counter(fallbacks).items())),
            stacklevel=2,
        )
    return result


def _sync_overridden(cls: type) -> list:
    """The methods that ``cls``, a subclass of :class:`SyncBatchNorm` or
    :class:`SyncBatchNormAct`, redefines and the plain layers revert makes of it would not
    have: torch's batch-norm methods (``forward``, ``train``, ...) and those the
    synchronized layers add that change what they compute (``_momentum``; not those in
    :data:`_SYNC_HARMLESS_METHODS`)."""
    base = SyncBatchNormAct if issubclass(cls, SyncBatchNormAct) else SyncBatchNorm
    return _overridden(cls, (base,), methods_of=(_BatchNorm, _SyncNormBase), harmless=_SYNC_HARMLESS_METHODS)


def _why_kept_synchronized(m: nn.Module) -> Optional[str]:
    """Why revert leaves the :class:`SyncBatchNorm` or :class:`SyncBatchNormAct` ``m`` (no
    registered conversion made it) as it is, or None: its class overrides a method (see
    :func:`_sync_overridden`), which the plain batch norm (and activation) revert makes
    would not have; and there is no plain class to give back for a class derived from
    ``SyncBatchNorm`` or ``SyncBatchNormAct``."""
    cls = _class_of(m)
    overridden = _sync_overridden(cls)
    if not overridden:
        return None
    if isinstance(m, SyncBatchNormAct):
        base, plain, does = "SyncBatchNormAct", "a plain batch norm and activation", "do"
    else:
        base, plain, does = "SyncBatchNorm", "a plain batch norm", "does"
    return (f"its class {cls.__qualname__} overrides {', '.join(overridden)}, which {plain} would drop, and revert "
            f"has no plain class to give back for a class derived from {base}: replace this layer yourself with "
            f"{plain} that {does} what {cls.__qualname__} adds")


def _revert_fix(m: nn.Module) -> str:
    """The fix, beyond renaming or dropping, for a layer whose state the plain layer of
    revert cannot hold (see :func:`_not_carried`): a conversion registered for the class
    it was converted from, whose ``to_plain`` carries that state (revert looks a
    registration up by that class; a layer built synchronized has none)."""
    origin = m.__dict__.get("_syncbn_origin")
    if not isinstance(origin, type):
        return ""
    return (f", or revert it through a conversion registered for {origin.__qualname__} (syncbn.register_conversion) "
            "whose to_plain carries it")


def _plain_batchnorm(m: nn.Module, hooks: bool = False, fallbacks: Optional[list] = None) -> nn.Module:
    """The plain batch norm that revert gives back for ``m``, holding ``m``'s state: an
    instance of exactly the class ``m`` was converted from where :func:`_not_restorable`
    allows it (a user's subclass, another library's any-rank batch norm), else of the
    ``BatchNorm1d/2d/3d`` that class derives from, else :class:`BatchNormNd`, which takes
    every input ``m`` took (no origin recorded, ``torch.nn.SyncBatchNorm``). Where an
    origin that conversion took cannot be given back, ``fallbacks`` gets why."""
    origin = m.__dict__.get("_syncbn_origin")
    why = _not_restorable(origin)
    if why is None:  # built as its torch base, then made the origin (see _not_restorable)
        cls = next(c for c in origin.__mro__ if c in _BUILT_BN)
    else:
        cls = next((c for c in getattr(origin, "__mro__", ()) if c in _RANKED_BN), BatchNormNd)
        if why and fallbacks is not None:
            fallbacks.append(f"{origin.__module__}.{origin.__qualname__} as {cls.__name__} ({why})")
    new = cls(_channels(m), m.eps, m.momentum, m.affine, m.track_running_stats, device="meta")
    if why is None and origin is not cls:
        object.__setattr__(new, "__class__", origin)
    return _move_state(m, new, attributes=True, hooks=hooks)


# the classes revert builds a plain layer as: torch's and syncbn's plain batch norms, and
# their common base (for an any-rank subclass of it, such as mmengine's ``_BatchNormXd``)
_BUILT_BN = _RANKED_BN + (BatchNormNd, _BatchNorm)


def _not_restorable(origin) -> str | None:
    """None where revert can give a layer back as ``origin``, the class it was converted
    from: a plain batch norm, built as the torch base it derives from (the first of
    :data:`_BUILT_BN` in its MRO: that base's ``__init__`` makes the same parameters,
    buffers and fields as ``origin``'s own ``__init__`` did through it, and the attributes
    that ``__init__`` added travel with the layer, :func:`_carry`) and then made an
    instance of ``origin``. Sound because ``origin`` differs from that base only in the
    methods conversion allows (:data:`_HARMLESS_METHODS`) and adds no ``__slots__`` (the
    same instance layout). Else why not: "" for the origins revert never gives back
    (none recorded, a lazy class, a synchronizing one: ``torch.nn.SyncBatchNorm`` and its
    subclasses, syncbn's own), a reason for one that conversion took but that has since
    changed (a method overridden on its class, ``__slots__``)."""
    if not isinstance(origin, type) or not issubclass(origin, _BatchNorm):
        return ""
    if issubclass(origin, (nn.SyncBatchNorm, _SyncNormBase, LazyModuleMixin, torch.jit.ScriptModule)):
        return ""
    overridden = _overridden(origin, _BUILT_BN)
    if overridden:
        return f"its class overrides {', '.join(overridden)}, which a plain batch norm does not"
    slotted = _slotted(origin)
    if slotted is not None:
        return f"{slotted} declares __slots__, which conversion does not carry"
    return None


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

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # nn.Identity's, written here: torch 2.4's dynamo (torch.compile, strict export)
        # records a module whose forward is torch.nn's as one call and deep-copies it to
        # do so, the two modules it remembers included; a fused layer on an explicit
        # process group (which cannot be copied) then failed there in eval mode
        return input

    def extra_repr(self) -> str:
        return f"fused into the preceding SyncBatchNormAct: {self._syncbn_original!r}"


def _positive_finite(value) -> bool:
    try:
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        return False
    return math.isfinite(value) and value > 0


def _activation_spec(m: nn.Module):
    """``(activation, param)`` for an activation module SyncBatchNormAct can absorb (a
    parameter SyncBatchNormAct refuses, such as an infinite slope, leaves the pair as it is)."""
    if type(m) is nn.LeakyReLU and _positive_finite(m.negative_slope):
        return "leaky_relu", float(m.negative_slope)
    if type(m) is nn.ELU and _positive_finite(m.alpha):
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
    if _lazy_unfinished(m):
        return False
    return _is_plain(m) or (isinstance(m, SyncBatchNorm) and not _sync_overridden(_class_of(m)))


def _fusion_overrides(m: nn.Module) -> list:
    """The methods whose redefinition keeps the batch norm ``m`` out of fusion (the fused
    layer would not have them): :func:`_sync_overridden`'s for a :class:`SyncBatchNorm`
    subclass (``_momentum`` too), else :func:`_overrides`'s."""
    if isinstance(m, SyncBatchNorm):
        return _sync_overridden(_class_of(m))
    return _overrides(m, _PLAIN_BN)


def _fuse(bn: nn.Module, act: nn.Module, spec, process_group, inplace: bool):
    """The SyncBatchNormAct replacing ``bn`` followed by ``act``, and act's placeholder."""
    new = _synchronized(
        SyncBatchNormAct, bn, process_group, activation=spec[0], activation_param=spec[1], inplace=inplace,
        carry={"attributes": True},
    )
    return new, _FusedActivation(act, new)


# ---- what tracing proves --------------------------------------------------------------


class _LeafTracer(torch.fx.Tracer):
    """Symbolic tracer that stops at batch norms and activations."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (_BatchNorm, nn.LeakyReLU, nn.ELU, nn.Identity, nn.ReLU, _FusedActivation)):
            return True
        return super().is_leaf_module(m, qualname)


_PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None))


def _plain_value(value) -> bool:
    if isinstance(value, tuple):
        return all(_plain_value(v) for v in value)
    return type(value) in _PLAIN_VALUES


class _Reads:
    """What the traced forwards did with their modules' Python attributes, which the
    graph does not show: ``values`` the plain values read (flags: a branch taken on one
    of them may read a layer's output another time, so the fused layer checks they still
    hold), ``escapes`` the modules that stored a traced value in an attribute or read a
    mutable container (a traced value kept there would be read outside the graph)."""

    def __init__(self):
        self.values = {}  # (id(module), name) -> (module, name, value)
        self.escapes = {}  # id(module) -> reason

    @contextlib.contextmanager
    def recording(self, modules):
        """Context in which ``modules`` (instances) report their attribute reads and
        writes: each gets, for the duration, a subclass of its own class that records."""
        classes, swapped = {}, []
        try:
            for m in modules:
                cls = type(m)
                if cls not in classes:
                    classes[cls] = self._recording_class(cls)
                object.__setattr__(m, "__class__", classes[cls])
                swapped.append((m, cls))
            yield
        finally:
            for m, cls in swapped:
                object.__setattr__(m, "__class__", cls)

    def _recording_class(self, cls):
        reads = self

        def __getattribute__(obj, name):
            value = super(sub, obj).__getattribute__(name)
            if not name.startswith("_") and name != "training":
                if _plain_value(value):
                    reads.values.setdefault((id(obj), name), (obj, name, value))
                elif isinstance(value, (list, dict, set, bytearray)):
                    reads.escapes.setdefault(id(obj), f"its forward reads the mutable attribute {name!r}")
            return value

        def __setattr__(obj, name, value):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
            if isinstance(value, torch.fx.Proxy) or any(isinstance(v, torch.fx.Proxy) for v in items):
                reads.escapes.setdefault(id(obj), f"its forward stores a traced value in attribute {name!r}")
            super(sub, obj).__setattr__(name, value)

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        return sub


def _trace(root: nn.Module, training: bool):
    """``root``'s forward traced by torch.fx with every module in ``training`` mode (the
    modes are restored after), and the :class:`_Reads` of the modules traced through."""
    modes = [(m, m.training) for m in root.modules()]
    tracer = _LeafTracer()
    reads = _Reads()
    inner = [m for name, m in root.named_modules() if not tracer.is_leaf_module(m, name)]
    try:
        root.train(training)
        with warnings.catch_warnings(), reads.recording(inner):
            warnings.simplefilter("ignore")
            graph = tracer.trace(root)
    finally:
        for m, mode in modes:
            m.training = mode
    return graph, reads


# in-place forms that torch.fx records as the plain operator (``a += b`` is ``add``)
_MAYBE_AUGMENTED = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.matmul, operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift,
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
}
# results that share the argument's memory: an in-place change to them changes it too
_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute", "transpose", "t", "squeeze",
    "unsqueeze", "narrow", "select", "expand", "expand_as", "contiguous", "chunk", "split", "unbind", "detach",
    "movedim", "swapaxes", "diagonal", "unfold", "as_strided", "to", "type_as", "float", "double", "half",
    "bfloat16", "__getitem__",
}
_VIEW_FUNCTIONS = {
    operator.getitem, torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
    torch.chunk, torch.split, torch.unbind, torch.narrow, torch.select, torch.movedim, torch.t, torch.detach,
}
_VIEW_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten, _FusedActivation)
# producers whose output is a fresh tensor that they do not keep for their own backward
_FRESH_PRODUCERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                    nn.Linear)


def _inplace_flag(target, args, kwargs) -> bool:
    """Whether a call of the function ``target`` passes ``inplace=True``."""
    if _may_be_true(kwargs.get("inplace")):
        return True
    try:
        bound = inspect.signature(target).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return _may_be_true(bound.arguments.get("inplace"))


def _may_be_true(value) -> bool:
    """Whether an ``inplace`` argument may be true: any truthy value (``inplace=1``), or
    one the graph computes."""
    if isinstance(value, torch.fx.Node):
        return True
    try:
        return bool(value)
    except Exception:  # a value with no truth: assume it may be
        return True


def _changed_in_place(root: nn.Module, node) -> str | None:
    """How the graph may change ``node``'s value in place (directly or through a view),
    or None: the fused layer keeps its output for backward, which such a change breaks."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            first = bool(user.args) and user.args[0] is n
            if user.op == "call_function":
                name = getattr(user.target, "__name__", "")
                if first and user.target in _MAYBE_AUGMENTED:
                    return f"{name} (torch.fx records ``out += ...`` as ``out + ...``)"
                if first and name.endswith("_") and not name.endswith("__"):
                    return name
                if _inplace_flag(user.target, user.args, user.kwargs):
                    return f"{name}(..., inplace=True)"
                if user.target in _VIEW_FUNCTIONS:
                    todo.append(user)
            elif user.op == "call_method":
                if first and user.target.endswith("_") and not user.target.endswith("__"):
                    return f".{user.target}()"
                if first and user.target in _VIEW_METHODS:
                    todo.append(user)
            elif user.op == "call_module":
                m = root.get_submodule(user.target)
                if _may_be_true(getattr(m, "inplace", False)):
                    return f"{user.target} (inplace={getattr(m, 'inplace')!r})"
                if isinstance(m, _VIEW_MODULES):
                    todo.append(user)
    return None


def _why_not_movable(m: nn.Module, extra_tensors: bool = True, hooks: bool = True) -> str | None:
    """Why ``m``'s behaviour would not survive moving its parameters and buffers into a
    new module (pruned or parametrized weights, with ``hooks`` module hooks, a replaced
    forward, and with ``extra_tensors`` parameters or buffers beyond batch norm's own), or None."""
    from torch.nn.utils import parametrize, prune

    if parametrize.is_parametrized(m):
        return "it is parametrized (torch.nn.utils.parametrize)"
    if any(isinstance(h, prune.BasePruningMethod) for h in m._forward_pre_hooks.values()):
        return "it is pruned (torch.nn.utils.prune)"
    lazy = _lazy_hook_ids(m)  # a lazy layer's own: they stay with it, not move (see _lazy_hook_ids)
    found = [name.strip("_") for name in _HOOK_DICTS if set(getattr(m, name, None) or ()) - lazy] if hooks else []
    if found:
        return f"it has hooks ({', '.join(found)})"
    replaced = [name for name in m.__dict__
                if inspect.isfunction(getattr(_BatchNorm, name, None)) and name not in _HARMLESS_METHODS]
    if replaced:  # a function or a method bound to ``m`` (wrapping its train) set on the instance
        return f"its {', '.join(replaced)} is replaced on the instance"
    extra = sorted((set(m._parameters) - {"weight", "bias"}) | (set(m._buffers) - set(_BN_BUFFERS)))
    if extra and extra_tensors:
        return f"it holds other parameters or buffers ({', '.join(extra)})"
    return None


def _global_hooks() -> list:
    from torch.nn.modules import module as module_impl

    return [name.strip("_") for name in _GLOBAL_HOOKS if getattr(module_impl, name, None)]


def _ancestors(name: str):
    """The qualified names of the modules that contain ``name`` (root "" included)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_CALL_HOOKS = _FORWARD_HOOKS + ("_backward_hooks", "_backward_pre_hooks")


def _module_stack(node) -> set:
    """The qualified names of the modules inside whose call a traced node ran (for a
    module call, that module too): a value crosses the boundary of a module around its
    producer or its reader, where that module's hooks see it."""
    stack = node.meta.get("nn_module_stack") or {}
    names = {v[0] if isinstance(v, tuple) else k for k, v in stack.items()}
    if node.op == "call_module":
        names.add(node.target)
    return names


def _hooked(root: nn.Module, names, kinds) -> str | None:
    """``module 'name' has hooks (...)`` for the first of ``names`` with hooks of ``kinds``, or None."""
    for name in sorted(names):
        found = [kind.strip("_") for kind in kinds if getattr(root.get_submodule(name), kind, None)]
        if found:
            return f"module {name!r} has hooks ({', '.join(found)})"
    return None


def _pairs_in(root: nn.Module, graph, reads: _Reads):
    """From one traced mode: ``({bn_name: (act_name, spec, input_fresh, guard)}, {bn_name: reason})``
    for every batch-norm call that feeds an invertible activation module."""
    registrations = Counter(id(m) for _, m in root.named_modules(remove_duplicate=False))
    calls = Counter(node.target for node in graph.nodes if node.op == "call_module")
    names = {id(m): name for name, m in root.named_modules()}
    pairs, refused = {}, {}
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(root.get_submodule(node.target), _BatchNorm):
            continue
        if isinstance(root.get_submodule(node.target), SyncBatchNormAct):
            continue  # fused already
        bn = root.get_submodule(node.target)
        acts = [u for u in node.users if u.op == "call_module"
                and _activation_spec(root.get_submodule(u.target)) is not None]
        if not acts:
            continue  # not followed by an invertible activation: nothing to say
        (user, *_) = acts
        act = root.get_submodule(user.target)
        reason = None
        if not _fusable_batchnorm(bn):
            reason = (f"it is {_LAZY_FIX}" if _lazy_unfinished(bn)
                      else f"its class overrides {', '.join(_fusion_overrides(bn))}")
        # attributes and __slots__ that the fused layer could not hold (see _not_carried)
        reason = reason or _not_carried(bn, "")
        # hooks cannot move into the fused layer as they move into a SyncBatchNorm: a forward
        # or backward hook on the batch norm sees its output and gradient, the fused layer's
        # are the activation's (and a module's hook on the activation, likewise)
        reason = reason or _why_not_movable(bn)
        if reason is None and (registrations[id(bn)] != 1 or calls[node.target] != 1):
            reason = "it is registered or called more than once"
        if reason is None and len(node.users) != 1:
            others = sorted(u.name for u in node.users if u is not user)
            reason = f"its output is also read by {', '.join(others)}"
        if reason is None and (tuple(user.args) != (node,) or user.kwargs):
            reason = f"its activation {user.target} takes other arguments"
        if reason is None and registrations[id(act)] != 1:
            reason = f"its activation {user.target} is registered more than once"
        if reason is None:
            why = _why_not_movable(act)
            reason = None if why is None else f"its activation {user.target}: {why}"
        if reason is None:
            changed = _changed_in_place(root, user)
            reason = None if changed is None else f"the activation's output may be changed in place by {changed}"
        if reason is None:  # torch.fx does not run module hooks: those on the way would be bypassed
            crossed = (_module_stack(node) ^ _module_stack(user)) - {node.target, user.target}
            hooked = _hooked(root, crossed, _CALL_HOOKS)
            reason = None if hooked is None else f"{hooked}, which would see the batch norm's output activated"
        if reason is None:
            for reader in user.users:
                hooked = _hooked(root, (_module_stack(user) ^ _module_stack(reader)) - {user.target}, _FORWARD_HOOKS)
                if hooked is not None:
                    reason = (f"{hooked}, which the activation's output passes; a change they make to it in place "
                              "would break the fused layer's backward")
                    break
        ancestors = _ancestors(node.target)
        if reason is None:
            for name in ancestors:
                escape = reads.escapes.get(id(root.get_submodule(name)))
                if escape is not None:
                    reason = f"module {name or type(root).__name__!r}: {escape}"
                    break
        if reason is not None:
            refused[node.target] = reason
            continue
        source = node.args[0] if node.args else None
        fresh = (
            source is not None and getattr(source, "op", None) == "call_module" and len(source.users) == 1
            and type(root.get_submodule(source.target)) in _FRESH_PRODUCERS
            and _why_not_movable(root.get_submodule(source.target)) is None
            # and no hooked module around the producer's output, which could hold it
            and _hooked(root, (_module_stack(source) ^ _module_stack(node)) - {source.target, node.target},
                        _CALL_HOOKS) is None
        )
        inside = set(ancestors)
        guard = tuple(v for v in reads.values.values() if names.get(id(v[0])) in inside)
        pairs[node.target] = (user.target, _activation_spec(act), fresh, guard)
    return pairs, refused, calls


class _FusionGuard:
    """Checks, at each call of a fused layer, that the plain attribute values the traced
    forwards read still hold. Holds the modules themselves (not weak references), so
    that ``copy.deepcopy`` and pickling of the model carry it over consistently."""

    def __init__(self, entries):
        self.entries = [(m, name, value) for m, name, value in entries]

    def __call__(self):
        for m, name, value in self.entries:
            now = getattr(m, name, _MISSING)
            if not (now is value or (type(now) is type(value) and now == value)):
                raise RuntimeError(
                    f"SyncBatchNormAct: {type(m).__name__}.{name} was {value!r} when fuse_batchnorm_act "
                    f"traced the model and is now {'missing' if now is _MISSING else repr(now)}; the fused "
                    "graph may no longer hold. Call syncbn.revert_sync_batchnorm(model) and fuse again."
                )


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    parent._modules[child] = new


def fuse_batchnorm_act(module: nn.Module, process_group=None, *, inplace: bool = True) -> nn.Module:
    """Fuse every batch norm directly followed by an invertible activation into one
    :class:`syncbn.SyncBatchNormAct`, which keeps only its output for backward, where
    tracing proves the fusion computes what the model computed.

    Batch norms: ``torch.nn.BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm`` and
    :class:`syncbn.SyncBatchNorm` (not subclasses that override ``forward`` or declare
    ``__slots__``, nor layers holding an attribute named like one of the fused layer's,
    nor uninitialized lazy ones). Activations: ``nn.LeakyReLU`` with a positive finite slope,
    ``nn.ELU`` with a positive finite alpha. ``nn.ReLU`` (and slope 0) is not invertible, and a
    batch norm followed by ``nn.Identity`` is never fused (nothing to save, and the next
    module may work in place on the output): those pairs stay as they are, as does
    everything else.

    The whole model's ``forward`` is traced by ``torch.fx``, once with every module in
    training mode and once in eval mode (the modes are restored). A pair is fused only
    when both traces show it: a batch-norm module called once whose output is read by
    nothing but the activation module, every call of which is such a pair; and neither is
    pruned, parametrized or hooked, nor is any module whose boundary the batch norm's or
    the activation's output crosses (a container ending at the batch norm, the module
    reading the activation's output: the traced graph does not show what their hooks
    see or do). It is skipped, with a warning naming it and why, when
    any of that fails, when the activation's output may be changed in place (an in-place
    method, a module or function with ``inplace=True``, or ``out += x``, which torch.fx
    cannot tell from ``out + x``: write ``x + out``), or when a module around it stores a
    traced value in an attribute or reads a mutable container attribute in ``forward``
    (a value kept there is read outside the graph). Plain attribute values that the
    traced forwards read (flags, modes) are recorded; the fused layer raises a
    ``RuntimeError`` naming the attribute if one of those around it changes later. A
    model that does not trace (data-dependent control flow, ...) is left as it is, with
    a warning: a part traced alone could be tapped by the code around it. Tracing runs
    ``forward`` twice with symbolic values: Python side effects in a ``forward`` happen
    twice more. Activations applied as functions (``F.leaky_relu(self.bn(x))``) stay.
    Only ``forward`` is traced: another method of the model that calls a fused batch norm
    without its activation would get the activated output, so fuse models whose other
    entry points (``forward_features``, ...) run the pair as ``forward`` does, or not at all.

    With ``inplace=True`` (the default) a fused layer writes its output over its input
    when both traces show that input to be the fresh output of a convolution or linear
    module that nothing else reads, with no hooks on it or on a module it ends (one
    activation-sized allocation less at the forward peak; saved memory is the same
    either way); ``inplace=False`` never.

    The batch norm is replaced by the fused layer (same parameter and buffer tensors,
    same ``state_dict`` keys) and the activation by an identity placeholder, so the
    model's ``state_dict`` keys and module indices do not change and
    :func:`revert_sync_batchnorm` restores both. The fused layer is synchronized over
    ``process_group`` (default: the default group; a ``SyncBatchNorm`` keeps its own).
    """
    hooks = _global_hooks()
    if hooks:
        warnings.warn(
            f"syncbn.fuse_batchnorm_act: nothing fused: global module hooks are registered ({', '.join(hooks)}), "
            "and they would see a fused batch norm's output activated",
            stacklevel=2,
        )
        return module
    if not any(True for _ in module.children()) or isinstance(module, (_BatchNorm, _FusedActivation)):
        return module
    if isinstance(module, torch.jit.ScriptModule):  # compiled code: nothing to rewire
        return module
    found = []
    for training in (True, False):
        try:
            graph, reads = _trace(module, training)
        except Exception as exc:  # untraceable: nothing can be proved
            warnings.warn(
                f"syncbn.fuse_batchnorm_act: nothing fused: torch.fx cannot trace "
                f"{type(module).__qualname__} in {'training' if training else 'eval'} mode "
                f"({type(exc).__name__}: {exc}); a model is fused only where its whole forward traces",
                stacklevel=2,
            )
            return module
        found.append(_pairs_in(module, graph, reads))
    (train_pairs, train_refused, train_calls), (eval_pairs, eval_refused, eval_calls) = found
    refused = {**eval_refused, **train_refused}
    pairs = {}
    for bn_name, (act_name, spec, fresh, guard) in train_pairs.items():
        other = eval_pairs.get(bn_name)
        if bn_name in refused:
            continue
        if other is None or other[0] != act_name:
            refused[bn_name] = "the eval-mode trace does not show the same pair"
            continue
        pairs[bn_name] = (act_name, spec, fresh and other[2], guard + other[3])
    for bn_name in eval_pairs:
        if bn_name not in train_pairs and bn_name not in refused:
            refused[bn_name] = "the training-mode trace does not show the same pair"
    # a shared activation module turns into an identity only if every call of it is fused
    uses = Counter(act_name for act_name, *_ in pairs.values())
    for bn_name, (act_name, *_) in list(pairs.items()):
        if uses[act_name] != train_calls[act_name] or uses[act_name] != eval_calls[act_name]:
            refused[bn_name] = f"its activation {act_name} is also called where it cannot be fused"
            del pairs[bn_name]
    if refused:
        warnings.warn(
            "syncbn.fuse_batchnorm_act left these batch norms unfused: "
            + "; ".join(f"{name} ({why})" for name, why in sorted(refused.items())),
            stacklevel=2,
        )
    # every fused layer is built before the model changes: one that fails leaves it as it was
    placeholders, layers = {}, {}
    for bn_name, (act_name, spec, fresh, guard) in pairs.items():
        act = module.get_submodule(act_name)
        new, placeholder = _fuse(module.get_submodule(bn_name), act, spec, process_group, inplace and fresh)
        if guard:
            new.__dict__["_syncbn_fusion_guard"] = _FusionGuard(guard)
        layers[bn_name] = new
        placeholders.setdefault(act_name, placeholder)
    for bn_name, new in layers.items():
        _set_submodule(module, bn_name, new)
    for act_name, placeholder in placeholders.items():
        _set_submodule(module, act_name, placeholder)
    name_layers(module)
    return module


def name_layers(root: nn.Module, model: Optional[str] = None) -> None:
    """Record every synchronized layer's qualified name in ``root``, after the name of the
    model, for the fingerprint (see :mod:`syncbn.torch.fingerprint`): ``Generator/1``.
    ``model``: the model's name, by default the class of ``root`` (:func:`_model_label`:
    ``Generator`` for a class of the script or of torch, ``teacher.Model`` for one
    imported from ``teacher``), the same on every rank. Layers of two models converted
    separately differ in the fingerprint even where their paths and widths are the same;
    name two models of one class apart (two ``nn.Sequential``: ``model="generator"``).
    :func:`convert_sync_batchnorm` and :func:`fuse_batchnorm_act` call it (with the class);
    call it yourself for a model built with syncbn's layers directly, or after converting
    to give the model a name of your own."""
    label = _model_label(type(root)) if model is None else str(model)
    for name, module in root.named_modules():
        if isinstance(module, _SyncNormBase):
            if name:
                fingerprint.set_layer_name(module, name, label)
            else:  # ``root`` is the layer itself: its class name (or the model's name given)
                fingerprint.set_layer_name(module, type(module).__name__ if model is None else label)


def _model_label(cls: type) -> str:
    """The name of a model of class ``cls`` in the fingerprint: its ``__qualname__`` after
    its module (``teacher.Model`` and ``student.Model`` differ), without the module for a
    class of the script, which is ``__main__`` in one process and ``__mp_main__`` in those
    ``multiprocessing`` spawns, and for torch's own (``Sequential``)."""
    module = cls.__module__
    if module in ("__main__", "__mp_main__") or module.partition(".")[0] == "torch":
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


def _convert_classmethod(cls, module: nn.Module, process_group=None) -> nn.Module:
    """``SyncBatchNorm.convert_sync_batchnorm(module, process_group=None)``, the classmethod
    of ``torch.nn.SyncBatchNorm`` for code written against it: :func:`convert_sync_batchnorm`."""
    return convert_sync_batchnorm(module, process_group)


SyncBatchNorm.convert_sync_batchnorm = classmethod(_convert_classmethod)
