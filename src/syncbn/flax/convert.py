"""Synchronize the ``flax.linen.BatchNorm`` layers of an existing linen model.

As in every syncbn framework, conversion returns the model to use and revert the plain one::

    model = syncbn.flax.convert(model, axis_name="batch")   # a new linen module
    variables = model.init(key, x)        # the same variable tree as the original's
    y, updates = model.apply(variables, x, mutable=["batch_stats"])   # under pmap / shard_map
    model = syncbn.flax.revert(model)     # the original module itself

Linen modules are immutable dataclasses, so :func:`convert` returns a new module
(:class:`Synchronized`) that shares its variable scope with the original
(``flax.linen.share_scope``): same variables, same paths, and ``apply(...,
method=...)`` reaches the original's methods. While it runs, every
``flax.linen.BatchNorm.__call__`` inside it (compact or setup style, at any depth, in
``init`` and ``apply``) computes syncbn's synchronized statistics on that very layer,
and every ``flax.nnx.BatchNorm`` held through ``flax.nnx.bridge.ToLinen`` is synchronized
by :func:`syncbn.flax.nnx.convert` on the nnx module ToLinen builds for each call.
A subclass of ``flax.linen.BatchNorm`` keeps its own ``__call__``: what it adds runs as
written, and only its ``super().__call__(...)`` (Flax's computation) is synchronized; a
subclass whose ``__call__`` never calls ``flax.linen.BatchNorm.__call__`` is an error
(``TypeError`` naming it), not left unsynchronized.

The older form, ``with syncbn.flax.convert(axis_name="batch"):`` around the calls, still
works (see :func:`synchronizing`); the model form is the recommended one, because the
conversion then belongs to the model, not to where a function happens to be traced.
A third way is to build the model with ``syncbn.flax.BatchNorm`` (a subclass of
``flax.linen.BatchNorm`` with the same fields) in place of Flax's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import types
from typing import Any, NamedTuple

import jax
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

from .linen import BatchNorm, linen_forward
from .nnx_layer import BatchNorm as NnxBatchNorm
from .normalize import freeze_groups

__all__ = ["convert", "revert", "synchronizing", "Synchronized", "nnx_convert", "nnx_revert"]


class _Settings(NamedTuple):
    axis_name: Any
    axis_index_groups: Any


# The conversion in force, as a JAX user context (jax.make_user_context): its value is
# part of the key of every jit/pmap cache, so a function traced without the conversion is traced
# again inside it, and a trace made inside is reused only under the same settings.
_SETTINGS = jax.make_user_context(None)


# The methods whose body is the batch-norm computation that a conversion replaces. A user
# subclass's own __call__ is not one of them: it runs as written, and its
# super().__call__(...) is intercepted on its own (Flax runs the interceptors for every
# wrapped method, the inherited one included), so only Flax's computation is replaced.
_BATCH_NORM_CALLS = (inspect.unwrap(nn.BatchNorm.__call__), inspect.unwrap(BatchNorm.__call__))


class _SubclassCalls(threading.local):
    """The subclass ``__call__``s in progress on this thread, innermost last, as
    ``[module, reached]``: whether that call reached one of ``_BATCH_NORM_CALLS`` on
    that very module."""

    def __init__(self):
        self.stack = []


_SUBCLASS_CALLS = _SubclassCalls()


def _is_batch_norm_call(context) -> bool:
    method = context.orig_method  # Flax passes functools.partial(function, module)
    return inspect.unwrap(getattr(method, "func", method)) in _BATCH_NORM_CALLS


def _subclass_call(module, next_fun, args, kwargs):
    """A ``BatchNorm`` subclass's own ``__call__``, run as written; an error if it never
    reached the batch-norm computation on itself (nothing convert could synchronize)."""
    entry = [module, False]
    _SUBCLASS_CALLS.stack.append(entry)
    try:
        out = next_fun(*args, **kwargs)
    finally:
        _SUBCLASS_CALLS.stack.pop()
    if not entry[1]:
        cls = type(module)
        path = "/".join(str(p) for p in module.path) if module.scope is not None else "?"
        raise TypeError(
            f"syncbn.flax.convert: {cls.__module__}.{cls.__qualname__} (at '{path}') subclasses "
            f"flax.linen.BatchNorm and its __call__ did not call flax.linen.BatchNorm.__call__, so "
            f"convert cannot synchronize its statistics (left as it is, it would run unsynchronized). "
            f"Compute the normalization with super().__call__(x, ...) in its __call__, or derive it from "
            f"syncbn.flax.BatchNorm and pass axis_name.")
    return out


def _nnx_method(method, settings: _Settings):
    """``nnx_method`` for ``flax.nnx.bridge.ToLinen``: ``method`` (a name, a function or
    None for ``__call__``, as ToLinen takes it) run on the nnx module that ToLinen has
    just built from the linen variables, after :func:`syncbn.flax.nnx.convert` with the
    conversion's settings (in place: the same Variables, so ToLinen reads their updates
    back into the linen variables)."""

    def run(module, *args, **kwargs):
        converted = nnx_convert(module, axis_name=settings.axis_name, axis_index_groups=settings.axis_index_groups)
        fn = "__call__" if method is None else method
        if not isinstance(fn, str) and converted is not module:
            fn = getattr(fn, "__name__", fn)  # the root layer was replaced: its class's own method
        if isinstance(fn, str):
            fn = getattr(type(converted), fn)
        return fn(converted, *args, **kwargs)

    return run


def _intercept(next_fun, args, kwargs, context):
    settings = _SETTINGS.value  # the innermost conversion wins
    module = context.module
    if settings is not None and isinstance(module, bridge.ToLinen) and context.method_name == "__call__":
        # an nnx module inside the linen model: its nnx.BatchNorm layers, built anew by each
        # call, are synchronized as syncbn.flax.nnx.convert synchronizes them
        if module.is_initializing():  # as for linen's layers: the axis need not exist at init
            settings = _Settings(None, None)
        kwargs = dict(kwargs, nnx_method=_nnx_method(kwargs.get("nnx_method"), settings))
        return next_fun(*args, **kwargs)
    if settings is None or not isinstance(module, nn.BatchNorm):
        return next_fun(*args, **kwargs)
    if _is_batch_norm_call(context):
        for entry in reversed(_SUBCLASS_CALLS.stack):
            if entry[0] is module:
                entry[1] = True
                break
        return linen_forward(module, *args, axis_name=settings.axis_name,
                             axis_index_groups=settings.axis_index_groups, **kwargs)
    if context.method_name == "__call__":
        return _subclass_call(module, next_fun, args, kwargs)
    return next_fun(*args, **kwargs)


def _settings(axis_name: Any, axis_index_groups: Any, who: str) -> _Settings:
    """A conversion's settings; groups without ``axis_name`` are an error: each layer then
    keeps its own axis and groups, so the groups given would be dropped in silence (and the
    layers synchronize over every device of their axis, not within the groups)."""
    if axis_name is None and axis_index_groups is not None:
        raise ValueError(
            f"{who}: axis_index_groups was given without axis_name; without axis_name every layer "
            f"keeps its own axis_name and axis_index_groups, so these groups would be ignored. Pass "
            f"the axis they divide as well: axis_name=..., axis_index_groups=....")
    return _Settings(axis_name, freeze_groups(axis_index_groups))


@contextlib.contextmanager
def synchronizing(axis_name: Any = None, axis_index_groups: Any = None):
    """Context manager: every ``flax.linen.BatchNorm.__call__`` run inside it computes
    syncbn's synchronized statistics (``axis_name``/``axis_index_groups`` override the
    layers' own when given). It does exactly two things, both undone on exit:

    - registers a ``flax.linen.intercept_methods`` interceptor that runs syncbn's forward
      in place of each ``flax.linen.BatchNorm.__call__`` (same module, scope, variables
      and fields); a subclass's own ``__call__`` runs as written around its
      ``super().__call__``, and one that never reaches it raises ``TypeError``;
    - sets a JAX user context (``jax.make_user_context``) holding the settings, which
      ``jax.jit``/``jax.pmap`` include in their cache keys: a function traced outside
      is traced again inside (never reused unsynchronized), a function traced inside is
      traced again outside (never reused synchronized), and entering again with the
      same settings reuses the trace made inside (no recompilation per step).

    Nested, the innermost conversion's settings apply. This is ``convert()`` without a
    model; :func:`convert` with the model is the recommended form.
    """
    settings = _settings(axis_name, axis_index_groups, "syncbn.flax.convert")
    with _SETTINGS(settings), nn.intercept_methods(_intercept):
        yield


def _wrapped_method(module, name: str):
    """``module``'s class's own method ``name`` (not one of ``flax.linen.Module``'s), or None."""
    if not isinstance(module, nn.Module) or name.startswith("_") or hasattr(nn.Module, name):
        return None
    fn = getattr(type(module), name, None)
    return fn if inspect.isfunction(fn) else None


def _on_module(fn):
    """A method of :class:`Synchronized` that calls ``fn(module, ...)`` synchronized."""

    def method(wrapper, *args, **kwargs):
        return wrapper.call_module(fn, *args, **kwargs)

    return method


_OWN_METHODS = ("__call__", "call_module")


def _call(module, *args, **kwargs):
    return module(*args, **kwargs)


def _field_names(module) -> set:
    """The dataclass fields of ``module``'s class, as declared (``name``/``parent`` too)."""
    return {f.name for f in dataclasses.fields(module)}


class Synchronized(nn.Module):
    """``module`` with every ``flax.linen.BatchNorm`` it calls synchronized over
    ``axis_name`` (each layer's own when None). Made by :func:`convert`, undone by
    :func:`revert`. It shares ``module``'s scope, so its variables are ``module``'s.

    Calling it calls ``module``; ``apply``/``init`` with ``method=`` (a name, an unbound
    method of ``module``'s class, a bound method of the original module, or any function
    taking the module first) run that method on ``module``; a bound instance (``bind``,
    or a submodule of a parent model) forwards ``module``'s own methods likewise. The
    model's fields read through it (``converted.num_classes``), except the wrapper's own
    ``axis_name`` and ``axis_index_groups``, which are the conversion's settings (the
    model's are ``converted.module.axis_name``).
    """

    module: nn.Module
    axis_name: Any = None
    axis_index_groups: Any = None

    def setup(self):
        nn.share_scope(self, self.module)
        self._syncbn_shared = True  # a setup-defined attribute: reading it runs setup first

    # Neither method is a wrapped (recorded) one: the wrapper shares the module's scope, so
    # Flax would record its call beside the module's own (capture_intermediates: two entries
    # under '__call__' where the plain model has one; tabulate: the wrapper's row in place of
    # the module's). Only the module's methods are recorded; setup (the shared scope) runs
    # first, as Flax runs it before a wrapped method: Flax runs a bound module's setup, once,
    # when an attribute it defines is first read (None where unbound: Flax's own error follows).
    @nn.nowrap
    def __call__(self, *args, **kwargs):
        return self.call_module(_call, *args, **kwargs)

    @nn.nowrap
    def call_module(self, fn, *args, **kwargs):
        """``fn(module, *args, **kwargs)``, ``module`` bound, its BatchNorms synchronized."""
        getattr(self, "_syncbn_shared", None)
        with synchronizing(self.axis_name, self.axis_index_groups):
            return fn(self.module, *args, **kwargs)

    @nn.nowrap
    def _resolve(self, method):
        """``method`` as ``Module.apply`` takes it, meant for ``module``: a method of this wrapper."""
        if method is None:
            return None
        if isinstance(method, str):
            if method in _OWN_METHODS:
                return method
            return _on_module(lambda module, *args, **kwargs: getattr(module, method)(*args, **kwargs))
        if inspect.ismethod(method) and method.__self__ is self:
            return method  # one of this wrapper's methods, its own or forwarded
        if inspect.ismethod(method) and isinstance(method.__self__, nn.Module):
            method = method.__func__
        if any(method is getattr(Synchronized, name) for name in _OWN_METHODS):
            return method
        return _on_module(method)

    @nn.nowrap
    def apply(self, variables, *args, method=None, **kwargs):
        return super().apply(variables, *args, method=self._resolve(method), **kwargs)

    @nn.nowrap
    def init_with_output(self, rngs, *args, method=None, **kwargs):  # init goes through here
        return super().init_with_output(rngs, *args, method=self._resolve(method), **kwargs)

    @nn.nowrap
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("module")
            if isinstance(module, nn.Module) and name in _field_names(module):
                # a field of the model (the wrapper's own shadow it), also one whose
                # default is a function (an initializer), which is no method
                return getattr(module, name)
            fn = _wrapped_method(module, name)
            if fn is None:
                raise
            return types.MethodType(_on_module(fn), self)


def convert(module: Any = None, *, axis_name: Any = None, axis_index_groups: Any = None):
    """Synchronize every ``flax.linen.BatchNorm`` of a linen model.

    ``model = convert(model, axis_name="batch")`` returns a new module that behaves like
    ``model`` (same call, methods and variable tree: variables of ``model.init`` work
    with it and back) except that each ``flax.linen.BatchNorm`` it calls computes exact
    statistics over the devices of ``axis_name`` (and ``axis_index_groups``); without
    ``axis_name`` each layer keeps its own (then ``axis_index_groups`` is a ``ValueError``:
    it would be ignored). Converting a converted module replaces its
    settings. ``revert(convert(m))`` is ``m``.

    Without a module, ``with convert(axis_name=...):`` is a context manager
    (:func:`synchronizing`): inside it every ``flax.linen.BatchNorm.__call__`` of any
    model runs syncbn's forward (a ``flax.linen.intercept_methods`` interceptor), and
    ``jax.jit``/``jax.pmap`` key their caches on it (a JAX user context), so a step
    traced before entering is traced again inside, and one traced inside is not reused
    outside. Prefer the model form: the conversion then belongs to the model, not to
    where and when a function is traced.

    For ``flax.nnx`` models use :func:`syncbn.flax.nnx.convert`.
    """
    settings = _settings(axis_name, axis_index_groups, "syncbn.flax.convert")
    if module is None:
        return synchronizing(axis_name, axis_index_groups)
    if isinstance(module, Synchronized):
        module = module.module
    if not isinstance(module, nn.Module):
        hint = (" For a flax.nnx model use syncbn.flax.nnx.convert." if isinstance(module, nnx.Module)
                else " Pass axis_name and axis_index_groups by keyword.")
        raise TypeError(f"syncbn.flax.convert takes a flax.linen Module (or nothing, as a context manager), "
                        f"got {type(module).__name__}.{hint}")
    return Synchronized(module, axis_name=axis_name, axis_index_groups=settings.axis_index_groups)


def revert(module: Any):
    """The plain linen model of a :func:`convert`-ed one (the very module that was
    converted); any other linen module is returned as it is. For ``flax.nnx`` models use
    :func:`syncbn.flax.nnx.revert`."""
    if isinstance(module, Synchronized):
        return module.module
    if not isinstance(module, nn.Module):
        raise TypeError(f"syncbn.flax.revert takes a flax.linen Module, got {type(module).__name__}. "
                        "For a flax.nnx model use syncbn.flax.nnx.revert.")
    return module


# ---------------------------------------------------------------- flax.nnx models
# Here, beside linen's conversion, because each reaches the other: a ToLinen inside a linen
# model holds nnx modules, a ToNNX inside an nnx model a linen one.

# On a layer whose axis convert() replaced: the (axis_name, axis_index_groups) it had, for revert().
_AXIS_BEFORE = "axis_before_convert"


def _rebuilt(old: nnx.BatchNorm, cls, skip: tuple = ()) -> nnx.BatchNorm:
    """A ``cls`` layer holding every attribute of ``old`` but those in ``skip``, each as
    ``old`` holds it (a pytree node or static): its configuration, its very Variable
    objects (their values, sharding and any optimizer state referring to them stay
    valid), and whatever else was set on the layer (a Variable, a submodule, an array
    under ``nnx.data``, a plain value), so the model's state keeps every entry."""
    new = cls(old.num_features, use_scale=old.use_scale, use_bias=old.use_bias, rngs=nnx.Rngs(0))
    nodes = vars(old).get("_pytree__nodes", {})
    for name, value in vars(old).items():
        if name.startswith("_pytree__") or name in skip:
            continue
        setattr(new, name, nnx.data(value) if nodes.get(name, False) else nnx.static(value))
    return new


def _replace_layers(model, replace):
    """``replace(layer)`` for every layer of ``model``'s graph for which it is not None,
    in every place that holds the layer (a shared layer is replaced wherever it is);
    returns ``model``, or its replacement when ``model`` is itself such a layer.

    It reaches whatever the nnx graph can hold: attributes of modules (and of
    ``nnx.List``/``nnx.Dict``), lists and dicts (changed in place) and any other JAX
    pytree, such as a tuple or a namedtuple under ``nnx.data`` (rebuilt with the new
    layer and put back where it was)."""
    done = {}  # id(node) -> what takes its place (itself when nothing under it changed)

    def visit(node):
        if id(node) in done:
            return done[id(node)]
        done[id(node)] = node  # a cycle back to a node in progress keeps the node
        if isinstance(node, nnx.Variable):
            return node
        if isinstance(node, nnx.Pytree):
            new = replace(node)
            if new is not None:
                done[id(node)] = new
                return new
            for name, child in list(vars(node).items()):
                if not name.startswith("_pytree__") and visit(child) is not child:
                    setattr(node, name, done[id(child)])
            return node
        if isinstance(node, (list, dict)):
            for key, child in list(node.items() if isinstance(node, dict) else enumerate(node)):
                if visit(child) is not child:
                    node[key] = done[id(child)]
            return node
        children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda leaf: leaf is not node)
        if treedef.num_leaves == 1 and children and children[0] is node:
            return node  # a leaf: an array, a number, a function, ...
        new_children = [visit(child) for child in children]
        if any(a is not b for a, b in zip(new_children, children)):
            done[id(node)] = jax.tree_util.tree_unflatten(treedef, new_children)
        return done[id(node)]

    return visit(model)


def _layer_path(path) -> str:
    return "/".join(str(part) for part in path) or "(the model itself)"


def _check_plain_layers(model, when: str):
    """Raise if ``model``'s graph holds an ``nnx.BatchNorm`` that convert does not
    synchronize: a user subclass (before anything is changed) or, after conversion, a
    plain one left in a container convert could not rebuild."""
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.BatchNorm) or isinstance(node, NnxBatchNorm):
            continue
        cls = type(node)
        if cls is not nnx.BatchNorm:
            raise TypeError(
                f"syncbn.flax.nnx.convert: the layer at '{_layer_path(path)}' is a "
                f"{cls.__module__}.{cls.__qualname__}, a subclass of flax.nnx.BatchNorm; converting it "
                f"would drop its own code and leaving it would leave it unsynchronized. Derive "
                f"{cls.__qualname__} from syncbn.flax.nnx.BatchNorm instead (same constructor and "
                f"Variables), and convert synchronizes it. Nothing was changed.")
        if when == "after":
            raise RuntimeError(
                f"syncbn.flax.nnx.convert could not replace the flax.nnx.BatchNorm at "
                f"'{_layer_path(path)}' (held in a container it cannot rebuild), so it is not "
                f"synchronized; hold it in a module attribute, nnx.List, nnx.Dict, list, dict or tuple, "
                f"or build it as syncbn.flax.nnx.BatchNorm.")


def nnx_convert(model, *, axis_name: Any = None, axis_index_groups: Any = None):
    """:func:`syncbn.flax.nnx.convert` (documented there)."""

    def synchronized(layer):
        if isinstance(layer, bridge.ToNNX):
            # a linen model inside the nnx one: syncbn.flax.convert synchronizes its linen
            # BatchNorm layers (same variables, read and written by ToNNX as before)
            layer.to_nnx__module = convert(layer.to_nnx__module, axis_name=axis_name,
                                           axis_index_groups=axis_index_groups)
            return layer
        if type(layer) is nnx.BatchNorm:
            layer = _rebuilt(layer, NnxBatchNorm)
        elif not isinstance(layer, NnxBatchNorm):  # a user subclass of it keeps its class
            return None
        if axis_name is not None:
            if not hasattr(layer, _AXIS_BEFORE):
                setattr(layer, _AXIS_BEFORE, (layer.axis_name, layer.axis_index_groups))
            layer.axis_name, layer.axis_index_groups = axis_name, axis_index_groups
        return layer

    _settings(axis_name, axis_index_groups, "syncbn.flax.nnx.convert")
    _check_plain_layers(model, "before")
    model = _replace_layers(model, synchronized)
    _check_plain_layers(model, "after")
    return model


def nnx_revert(model):
    """:func:`syncbn.flax.nnx.revert` (documented there)."""

    def plain(layer):
        if isinstance(layer, bridge.ToNNX):
            layer.to_nnx__module = revert(layer.to_nnx__module)
            return layer
        if isinstance(layer, NnxBatchNorm) and type(layer) is not NnxBatchNorm:
            # a user subclass of syncbn's layer stays one: only its axis is restored
            if hasattr(layer, _AXIS_BEFORE):
                layer.axis_name, layer.axis_index_groups = getattr(layer, _AXIS_BEFORE)
                delattr(layer, _AXIS_BEFORE)
            return layer
        if type(layer) is not NnxBatchNorm:
            return None
        new = _rebuilt(layer, nnx.BatchNorm, skip=(_AXIS_BEFORE,))
        if hasattr(layer, _AXIS_BEFORE):
            new.axis_name, new.axis_index_groups = getattr(layer, _AXIS_BEFORE)
        return new

    return _replace_layers(model, plain)
