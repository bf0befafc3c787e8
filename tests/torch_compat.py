"""torch's own batch norms built alike on every torch the library supports (``torch>=2.4``).

torch 2.13 takes ``bias=False`` in the batch-norm constructors; torch 2.11 has no such
argument (a GPU machine's torch 2.11 raised TypeError in the tests that used it). There
the same layer is the one built with a bias, its ``bias`` then registered as None, which is
what 2.13's ``bias=False`` registers."""

import inspect


def torch_batchnorm(cls, *args, bias: bool = True, **kwargs):
    """``cls(*args, bias=bias, **kwargs)`` for a torch batch-norm class, on any torch."""
    if "bias" in inspect.signature(cls.__init__).parameters:
        return cls(*args, bias=bias, **kwargs)
    layer = cls(*args, **kwargs)
    if not bias:
        layer.register_parameter("bias", None)
    return layer
