"""syncbn.flax: exact synchronized batch normalization for Flax (linen and nnx).

- :class:`BatchNorm` — drop-in ``flax.linen.BatchNorm`` (same fields, call, variables).
- :mod:`syncbn.flax.nnx` — ``BatchNorm`` for ``flax.nnx`` and its ``convert``/``revert``.
- :func:`convert` — context manager running every linen ``BatchNorm`` as syncbn's.
- :func:`batch_norm` — the functional transform (``jax.custom_vjp``).

Statistics are over the union of every device of ``axis_name`` under ``pmap`` or
``shard_map`` (or the whole sharded batch under ``jit``), weighted per valid element
with masks, stable far from zero, one ``psum`` forward and one backward per layer.
Needs JAX and Flax only (neither torch nor TensorFlow).
"""

from .convert import convert
from .linen import BatchNorm
from .moments import Moments, union_moments
from .normalize import Config, batch_norm
from . import nnx

__all__ = ["BatchNorm", "convert", "batch_norm", "union_moments", "Moments", "Config", "nnx"]
