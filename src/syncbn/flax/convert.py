"""Switch an existing linen model's ``flax.linen.BatchNorm`` layers to syncbn's.

Linen modules are frozen dataclasses built inside their parents' ``setup``/``compact``
methods, so the idiomatic way to change a layer "at a distance" is a method
interceptor (``flax.linen.intercept_methods``): inside ``with syncbn.flax.convert():``
every call of a ``flax.linen.BatchNorm``'s ``__call__`` runs syncbn's forward on that
very module (same scope, same variables, same fields). Nothing about the model
definition or its variables changes; leaving the context restores Flax's behaviour.
The other way is class substitution: build the model with ``syncbn.flax.BatchNorm``
where it used ``flax.linen.BatchNorm`` (it is a subclass with the same fields).
"""

from __future__ import annotations

import contextlib
from typing import Any

from flax import linen as nn

from .linen import linen_forward


@contextlib.contextmanager
def convert(axis_name: Any = None, axis_index_groups: Any = None):
    """Context manager: every ``flax.linen.BatchNorm.__call__`` run inside it (``init``,
    ``apply``, under ``jit``/``pmap``/``shard_map`` tracing) computes syncbn's exact
    synchronized statistics. With ``axis_name`` (and ``axis_index_groups``) the layers
    synchronize over it, overriding their own fields; without it each layer uses its own
    ``axis_name``. Tracing must happen inside the context: a function ``jit``-compiled
    before entering it keeps what it compiled."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, nn.BatchNorm):
            return next_fun(*args, **kwargs)
        return linen_forward(module, *args, axis_name=axis_name, axis_index_groups=axis_index_groups, **kwargs)

    with nn.intercept_methods(interceptor):
        yield
