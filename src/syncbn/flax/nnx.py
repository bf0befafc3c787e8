"""``syncbn.flax.nnx.BatchNorm``: a drop-in ``flax.nnx.BatchNorm`` (same constructor,
``.scale``/``.bias`` params and ``.mean``/``.var`` batch statistics, same update rule)
whose training statistics are exact over the union of devices; and the conversion of
an existing model, as in every syncbn framework::

    model = syncbn.flax.nnx.convert(model, axis_name="batch")   # synchronized
    model = syncbn.flax.nnx.revert(model)                        # plain again

nnx modules are mutable, so both work in place and return the same root object (the
new layer when the root is itself a BatchNorm); the layers keep their Variables, and
``revert(convert(m))`` restores every field of every layer, ``axis_name`` included.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import nnx
from flax.nnx import bridge

from .linen import canonical_axes, make_config, stored_normalize
from .normalize import batch_norm


class BatchNorm(nnx.BatchNorm):
    """Synchronized ``flax.nnx.BatchNorm``; see :class:`syncbn.flax.BatchNorm` for the
    statistics, masks, groups and dtypes. The constructor is Flax's."""

    def __call__(self, x, use_running_average: Optional[bool] = None, *, mask: Optional[jax.Array] = None):
        if use_running_average is None:
            use_running_average = self.use_running_average
        if use_running_average is None:
            raise ValueError(
                "No `use_running_average` argument was provided to BatchNorm: pass it to the "
                "constructor or to the call, or use `nnx.view` (as for flax.nnx.BatchNorm).")
        feature_axes = canonical_axes(x.ndim, self.axis)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, mean, var, scale, bias = self.promote_dtype((x, self.mean[...], self.var[...], scale, bias),
                                                       dtype=self.dtype)
        if use_running_average:
            return stored_normalize(x, mean, var, scale, bias, feature_axes, self.epsilon, self.dtype)
        config = make_config(x, feature_axes, self.epsilon, self.axis_name, self.axis_index_groups, self.dtype,
                             True, scale, bias)
        y, mean, var = batch_norm(x, scale, bias, mask, config)
        # as Flax's, the Variables keep their dtype (float32 as built): nnx casts what is assigned
        stop = jax.lax.stop_gradient if (self.mean._can_update or self.var._can_update) else (lambda v: v)
        m = self.momentum
        self.mean[...] = stop(m * self.mean[...] + (1 - m) * mean)
        self.var[...] = stop(m * self.var[...] + (1 - m) * var)
        return y


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
        if not isinstance(node, nnx.BatchNorm) or isinstance(node, BatchNorm):
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


def convert(model, *, axis_name: Any = None, axis_index_groups: Any = None):
    """Synchronize every ``flax.nnx.BatchNorm`` of ``model``, in place.

    ``model = convert(model, axis_name="batch")``: each ``flax.nnx.BatchNorm`` in the
    graph is replaced, wherever it is held, by a :class:`BatchNorm` with the same
    configuration and the very same ``scale``/``bias``/``mean``/``var`` Variables (their
    values, sharding and any optimizer state referring to them stay valid). With
    ``axis_name``, the converted layers (and any :class:`BatchNorm` already there)
    synchronize over it and ``axis_index_groups``; otherwise each keeps its own.
    Returns ``model`` itself (or the new layer when ``model`` is itself a BatchNorm).
    ``revert(convert(m))`` restores every field of ``m``.

    Every container the graph can hold is reached (module attributes, ``nnx.List``,
    ``nnx.Dict``, lists, dicts, tuples and other pytrees under ``nnx.data``). A user
    subclass of :class:`BatchNorm` keeps its class and code and takes ``axis_name``; a
    user subclass of ``flax.nnx.BatchNorm`` cannot be replaced without dropping its own
    code, so ``convert`` raises ``TypeError`` naming its path (before changing anything):
    derive it from :class:`BatchNorm` instead. No plain ``flax.nnx.BatchNorm`` is left
    unsynchronized without an error. The linen module of a ``flax.nnx.bridge.ToNNX`` is
    replaced by :func:`syncbn.flax.convert` of it (the same settings and variables), which
    synchronizes its ``flax.linen.BatchNorm`` layers; :func:`revert` puts it back.
    """

    def synchronized(layer):
        if isinstance(layer, bridge.ToNNX):
            # a linen model inside the nnx one: syncbn.flax.convert synchronizes its linen
            # BatchNorm layers (same variables, read and written by ToNNX as before)
            from .convert import convert as linen_convert  # that module imports this one

            layer.to_nnx__module = linen_convert(layer.to_nnx__module, axis_name=axis_name,
                                                 axis_index_groups=axis_index_groups)
            return layer
        if type(layer) is nnx.BatchNorm:
            layer = _rebuilt(layer, BatchNorm)
        elif not isinstance(layer, BatchNorm):  # a user subclass of it keeps its class
            return None
        if axis_name is not None:
            if not hasattr(layer, _AXIS_BEFORE):
                setattr(layer, _AXIS_BEFORE, (layer.axis_name, layer.axis_index_groups))
            layer.axis_name, layer.axis_index_groups = axis_name, axis_index_groups
        return layer

    _check_plain_layers(model, "before")
    model = _replace_layers(model, synchronized)
    _check_plain_layers(model, "after")
    return model


def revert(model):
    """The inverse of :func:`convert`, in place: every :class:`BatchNorm` becomes a
    ``flax.nnx.BatchNorm`` with its configuration (the ``axis_name`` and
    ``axis_index_groups`` it had before :func:`convert` replaced them) and the very same
    Variables. Returns ``model`` itself (or the new layer when ``model`` is one)."""

    def plain(layer):
        if isinstance(layer, bridge.ToNNX):
            from .convert import revert as linen_revert

            layer.to_nnx__module = linen_revert(layer.to_nnx__module)
            return layer
        if isinstance(layer, BatchNorm) and type(layer) is not BatchNorm:
            # a user subclass of syncbn's layer stays one: only its axis is restored
            if hasattr(layer, _AXIS_BEFORE):
                layer.axis_name, layer.axis_index_groups = getattr(layer, _AXIS_BEFORE)
                delattr(layer, _AXIS_BEFORE)
            return layer
        if type(layer) is not BatchNorm:
            return None
        new = _rebuilt(layer, nnx.BatchNorm, skip=(_AXIS_BEFORE,))
        if hasattr(layer, _AXIS_BEFORE):
            new.axis_name, new.axis_index_groups = getattr(layer, _AXIS_BEFORE)
        return new

    return _replace_layers(model, plain)
