"""``convert``: a copy of a Keras model whose BatchNormalization layers all synchronize."""

from __future__ import annotations

import warnings

import keras

from .layer import SyncBatchNormalization

__all__ = ["convert"]


def _is_plain_bn(layer) -> bool:
    """Exactly ``keras.layers.BatchNormalization``: the only class replaced. A subclass
    may change what the layer does (a frozen BN that always normalizes with its moving
    statistics, an extra constructor argument), which a synchronized copy would lose."""
    return type(layer) is keras.layers.BatchNormalization


def _is_bn_subclass(layer) -> bool:
    """A BatchNormalization subclass other than ours: left alone, and named in a warning."""
    return isinstance(layer, keras.layers.BatchNormalization) and not (
        _is_plain_bn(layer) or isinstance(layer, SyncBatchNormalization))


def _is_graph_model(layer) -> bool:
    """Sequential and Functional models (and their subclasses)."""
    from keras.src.models.functional import Functional

    return isinstance(layer, (keras.Sequential, Functional))


def _is_plain_graph_model(layer) -> bool:
    """Exactly Sequential or Functional: ``keras.models.clone_model`` rebuilds them
    exactly. A subclass (the keras_hub ``Backbone`` / ``Task`` pattern) has its own
    constructor, attributes and methods, which a clone into a plain Functional loses."""
    from keras.src.models.functional import Functional

    return type(layer) in (keras.Sequential, Functional)


def sync_from(bn):
    """A ``SyncBatchNormalization`` with ``bn``'s configuration, built like it and holding
    copies of its weights."""
    config = bn.get_config()
    config.pop("synchronized", None)
    new = SyncBatchNormalization.from_config(config)
    if bn.built:
        shape = [None] * bn.input_spec.ndim
        shape[bn.axis] = bn.moving_mean.shape[0]
        new.build(tuple(shape))
        new.set_weights(bn.get_weights())
    return new


def _copy_layer(layer):
    """A fresh copy of a layer from its config (not yet holding the weights)."""
    try:
        return layer.__class__.from_config(layer.get_config())
    except Exception as err:
        raise TypeError(
            f"convert: cannot copy layer {layer.name!r} of type {type(layer).__name__} from "
            f"its config ({type(err).__name__}: {err}); give it a get_config() that its "
            f"constructor accepts"
        ) from err


def _swap_sublayers(layer, seen, skipped):
    """Replace, in place, every plain BatchNormalization held by ``layer`` or by the
    layers it holds (attributes, lists, tuples and dicts of them) with a synchronized
    copy, and every nested Sequential / Functional model with a converted copy.

    The replacement takes the old layer's slot in Keras's layer tracking, so the
    order of ``layer.weights`` does not change.
    """
    if id(layer) in seen:
        return
    seen.add(id(layer))
    if _is_bn_subclass(layer):
        skipped.append(layer)
        return
    tracker = getattr(layer, "_tracker", None)
    stores = [] if tracker is None else [store for _, store in tracker.config.values()]

    def replace(value):
        if _is_plain_bn(value):
            new = sync_from(value)
        elif _is_graph_model(value):
            new = _convert(value, skipped)
        else:
            if isinstance(value, keras.layers.Layer):
                _swap_sublayers(value, seen, skipped)
            return value
        if tracker is not None and tracker.is_in_store("layers", value):
            tracker.replace_tracked_value("layers", value, new)
        return new

    for name, value in list(vars(layer).items()):
        if any(value is store for store in stores):
            continue  # Keras's own tracking lists; updated through the tracker
        if isinstance(value, keras.layers.Layer):
            new = replace(value)
            if new is not value:
                object.__setattr__(layer, name, new)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, keras.layers.Layer):
                    new = replace(item)
                    if new is not item:
                        list.__setitem__(value, i, new)
        elif isinstance(value, tuple) and any(isinstance(v, keras.layers.Layer) for v in value):
            items = [replace(v) if isinstance(v, keras.layers.Layer) else v for v in value]
            object.__setattr__(layer, name, type(value)(*items) if hasattr(value, "_fields") else type(value)(items))
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                if isinstance(item, keras.layers.Layer):
                    new = replace(item)
                    if new is not item:
                        dict.__setitem__(value, key, new)


def convert(model):
    """Return a copy of ``model`` in which every ``keras.layers.BatchNormalization`` is a
    :class:`SyncBatchNormalization` with the same configuration and weights.

    Only layers of exactly that class are replaced (and ours kept): a subclass of it
    may behave differently (a frozen BN that always runs in inference mode, extra
    constructor arguments), so it is left as it is and named in a warning.

    Sequential and Functional models are rebuilt with ``keras.models.clone_model``,
    recursing into nested Sequential / Functional models. A subclass of them (the
    keras_hub ``Backbone`` / ``Task`` pattern) is rebuilt through its own
    ``from_config(get_config())``, so its class, attributes and methods are kept, given
    the original's weights, and its BatchNormalization layers are then synchronized in
    place (the class of such a layer in the fresh copy becomes
    :class:`SyncBatchNormalization`, which adds no state of its own). Every other
    layer is copied from its config and given the original's weights, and
    BatchNormalization layers held inside custom layers (as attributes, or in lists,
    tuples, dicts) are replaced too. A bare BatchNormalization layer gives a
    SyncBatchNormalization; a built subclassed ``keras.Model`` is copied from its
    config, built on the original's input shape and given its weights. The original
    model is left untouched and shares nothing with the copy, whose outputs in
    inference equal the original's. Layer names are kept (except in a subclass
    rebuilt through its constructor, which names its layers afresh, as loading it from
    a file does), and weights files (``.weights.h5``) load both ways between the
    original and the copy.

    The copy is not compiled: compile it (inside ``strategy.scope()`` when training
    with a ``tf.distribute`` strategy, and build or convert it there as well so that
    its variables are mirrored).
    """
    skipped = []
    result = _convert(model, skipped)
    if skipped:
        names = sorted({f"{layer.name} ({type(layer).__name__})" for layer in skipped})
        warnings.warn(
            "syncbn.keras.convert left these BatchNormalization subclasses unsynchronized "
            "(only keras.layers.BatchNormalization itself is replaced): " + "; ".join(names),
            stacklevel=2,
        )
    return result


def _convert(model, skipped):
    if _is_plain_bn(model):
        return sync_from(model)
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"convert: expected a Keras model or layer, got {type(model).__name__}")
    if _is_bn_subclass(model):
        skipped.append(model)

    if not _is_plain_graph_model(model):
        new = _copy_layer(model)
        if model.built:
            if not new.built:
                _build_like(new, model)
            new.set_weights(model.get_weights())
        if _is_graph_model(new):
            _sync_in_place(new, set(), skipped)
        else:
            _swap_sublayers(new, set(), skipped)
        return new

    copies = []  # (original, copy) pairs whose weights are copied once the model is built

    def clone(layer):
        if _is_plain_bn(layer):
            return sync_from(layer)
        if _is_bn_subclass(layer):
            skipped.append(layer)
        new = _copy_layer(layer)
        copies.append((layer, new))
        return new

    new_model = keras.models.clone_model(model, clone_function=clone, recursive=True)
    seen = set()
    for old, new in copies:
        if old.built and new.built:
            new.set_weights(old.get_weights())
        if _is_graph_model(new) and not _is_plain_graph_model(new):
            _sync_in_place(new, seen, skipped)
        else:
            _swap_sublayers(new, seen, skipped)
    return new_model


def _sync_in_place(layer, seen, skipped):
    """Make every exact BatchNormalization held by ``layer`` (a fresh copy that nothing
    else references), at any depth, a SyncBatchNormalization without replacing the
    object: its class changes, its variables, name and place in the graph stay.
    ``SyncBatchNormalization`` adds no instance state to BatchNormalization (its
    constructor only validates ``axis`` and drops ``synchronized``), so the object is
    then exactly what its constructor would have made."""
    if id(layer) in seen:
        return
    seen.add(id(layer))
    if _is_plain_bn(layer):
        layer.__class__ = SyncBatchNormalization
        layer.synchronized = False
        return
    if _is_bn_subclass(layer):
        skipped.append(layer)
        return
    for value in list(vars(layer).values()):
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in list(items):
            if isinstance(item, keras.layers.Layer):
                _sync_in_place(item, seen, skipped)


def _build_like(new, old):
    """Build ``new`` (a fresh copy of ``old``) by calling it on symbolic inputs of the
    shapes ``old`` was built with, which builds its sublayers as a real call would."""
    shapes = getattr(old, "_build_shapes_dict", None)
    if not shapes:
        raise ValueError(
            f"convert: {old.name!r} ({type(old).__name__}) is built but its input shape "
            f"is unknown; convert it before building it, or wrap it in a Functional model"
        )
    new(*(keras.KerasTensor(shape) for shape in shapes.values()))
