"""``convert``: a copy of a Keras model whose BatchNormalization layers all synchronize."""

from __future__ import annotations

import keras

from .layer import SyncBatchNormalization

__all__ = ["convert"]


def _is_plain_bn(layer) -> bool:
    return isinstance(layer, keras.layers.BatchNormalization) and not isinstance(layer, SyncBatchNormalization)


def _is_graph_model(layer) -> bool:
    """Sequential and Functional models: rebuilt by ``keras.models.clone_model``."""
    from keras.src.models.functional import Functional

    return isinstance(layer, (keras.Sequential, Functional))


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


def _swap_sublayers(layer, seen):
    """Replace, in place, every plain BatchNormalization held by ``layer`` or by the
    layers it holds (attributes, lists, tuples and dicts of them) with a synchronized
    copy, and every nested Sequential / Functional model with a converted copy.

    The replacement takes the old layer's slot in Keras's layer tracking, so the
    order of ``layer.weights`` does not change.
    """
    if id(layer) in seen:
        return
    seen.add(id(layer))
    tracker = getattr(layer, "_tracker", None)
    stores = [] if tracker is None else [store for _, store in tracker.config.values()]

    def replace(value):
        if _is_plain_bn(value):
            new = sync_from(value)
        elif _is_graph_model(value):
            new = convert(value)
        else:
            if isinstance(value, keras.layers.Layer):
                _swap_sublayers(value, seen)
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

    Sequential and Functional models are rebuilt with ``keras.models.clone_model``,
    recursing into nested Sequential / Functional models; every other layer is copied
    from its config and given the original's weights, and BatchNormalization layers
    held inside custom layers (as attributes, or in lists, tuples, dicts) are replaced
    too. A bare BatchNormalization layer gives a SyncBatchNormalization; a built
    subclassed ``keras.Model`` is copied from its config, built on the original's
    input shape and given its weights. The original model is left untouched and shares
    nothing with the copy, whose outputs in inference equal the original's.

    The copy is not compiled: compile it (inside ``strategy.scope()`` when training
    with a ``tf.distribute`` strategy, and build or convert it there as well so that
    its variables are mirrored).
    """
    if _is_plain_bn(model):
        return sync_from(model)
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"convert: expected a Keras model or layer, got {type(model).__name__}")

    if not _is_graph_model(model):
        new = _copy_layer(model)
        if model.built:
            _build_like(new, model)
            new.set_weights(model.get_weights())
        _swap_sublayers(new, set())
        return new

    copies = []  # (original, copy) pairs whose weights are copied once the model is built

    def clone(layer):
        if _is_plain_bn(layer):
            return sync_from(layer)
        new = _copy_layer(layer)
        copies.append((layer, new))
        return new

    new_model = keras.models.clone_model(model, clone_function=clone, recursive=True)
    seen = set()
    for old, new in copies:
        if old.built and new.built:
            new.set_weights(old.get_weights())
        _swap_sublayers(new, seen)
    return new_model


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
