"""syncbn.flax: exact synchronized batch normalization for Flax (linen and nnx).

Convert a model, as in every syncbn framework: ``convert`` returns the model to use,
``revert`` the plain one, so callers always write ``model = convert(model)``::

    model = syncbn.flax.convert(model, axis_name="batch")   # linen: a new module
    model = syncbn.flax.revert(model)                        # the original module
    model = syncbn.flax.nnx.convert(model, axis_name="batch")   # nnx: in place, same object
    model = syncbn.flax.nnx.revert(model)

A converted linen model has the original's variables (same tree, interchangeable);
a converted nnx model keeps its Variables. ``revert(convert(m))`` restores every field.

- :func:`convert`/:func:`revert` — linen models (``with convert(axis_name=...):`` also
  works, as a context manager, but the model form is the recommended one).
- :class:`BatchNorm` — drop-in ``flax.linen.BatchNorm`` (same fields, call, variables).
- :mod:`syncbn.flax.nnx` — ``BatchNorm`` for ``flax.nnx`` and its ``convert``/``revert``.
- :func:`batch_norm` — the functional transform (``jax.custom_vjp``).

Statistics are over the union of every device of ``axis_name`` under ``pmap`` or
``shard_map`` (or the whole sharded batch under ``jit``), weighted per valid element
with masks, stable far from zero, one ``psum`` forward and one backward per layer.
Needs JAX and Flax only (neither torch nor TensorFlow).
"""

from .convert import convert, revert
from .linen import BatchNorm
from .moments import Moments, union_moments
from .normalize import Config, batch_norm
from . import nnx

__all__ = ["BatchNorm", "convert", "revert", "batch_norm", "union_moments", "Moments", "Config", "nnx"]
