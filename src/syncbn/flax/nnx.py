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

from typing import Any

from .convert import nnx_convert as _nnx_convert, nnx_revert as _nnx_revert
from .nnx_layer import BatchNorm

__all__ = ["BatchNorm", "convert", "revert"]


def convert(model, *, axis_name: Any = None, axis_index_groups: Any = None):
    """Synchronize every ``flax.nnx.BatchNorm`` of ``model``, in place.

    ``model = convert(model, axis_name="batch")``: each ``flax.nnx.BatchNorm`` in the
    graph is replaced, wherever it is held, by a :class:`BatchNorm` with the same
    configuration and the very same ``scale``/``bias``/``mean``/``var`` Variables (their
    values, sharding and any optimizer state referring to them stay valid). With
    ``axis_name``, the converted layers (and any :class:`BatchNorm` already there)
    synchronize over it and ``axis_index_groups``; otherwise each keeps its own (and
    ``axis_index_groups`` alone is a ``ValueError``: it would be ignored).
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
    return _nnx_convert(model, axis_name=axis_name, axis_index_groups=axis_index_groups)


def revert(model):
    """The inverse of :func:`convert`, in place: every :class:`BatchNorm` becomes a
    ``flax.nnx.BatchNorm`` with its configuration (the ``axis_name`` and
    ``axis_index_groups`` it had before :func:`convert` replaced them) and the very same
    Variables. Returns ``model`` itself (or the new layer when ``model`` is one)."""
    return _nnx_revert(model)
