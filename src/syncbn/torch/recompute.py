"""Activation checkpointing that the synchronized layers can recognize.

A training-mode forward that activation checkpointing recomputes during the backward pass
must normalize exactly as the first one did (it does: the batch statistics are taken
again, with the same collective on every rank), but must not move the running statistics
and ``num_batches_tracked`` a second time. The layers learn that a forward is such a
recomputation from :func:`checkpoint`, a drop-in for ``torch.utils.checkpoint.checkpoint``
that runs the function under a marker on every call after its first (the first is the
original forward; later ones are recomputations, in both the reentrant and the
non-reentrant variant). Nothing else counts: a training forward run by a tensor hook
during a backward pass, or recomputed by a plain ``torch.utils.checkpoint.checkpoint``
(which offers no public way to tell its recomputation apart), updates the running
statistics as ``torch.nn.BatchNorm2d`` does.

Code that calls ``torch.utils.checkpoint`` itself (a wrapper library, ``checkpoint_sequential``)
can mark its recomputation with ``with syncbn.torch.recompute.recomputation(): ...``; with the
non-reentrant variant that is ``context_fn=lambda: (contextlib.nullcontext(), recomputation())``.
"""

from __future__ import annotations

import contextlib
import threading

from . import distributed

__all__ = ["checkpoint", "recomputation", "recomputing"]

_STATE = threading.local()  # the engine may recompute in its own worker threads: per thread


def recomputing() -> bool:
    """True while a forward runs as a recomputation marked by :func:`checkpoint` or
    :func:`recomputation` in this thread.

    Under ``torch.compile`` this is False: there the compiler plans any recomputation
    itself and applies buffer mutations once per forward."""
    if distributed.compiling():
        return False
    return getattr(_STATE, "depth", 0) > 0


class _Recomputation(contextlib.ContextDecorator):
    """The context of :func:`recomputation` (also a decorator, as before). Unlike a
    generator-based context manager it can be entered again: torch's non-reentrant
    checkpoint enters the recompute context that ``context_fn`` returned once per backward
    pass that needs the saved tensors (a second ``backward(retain_graph=True)`` recomputes
    again)."""

    def __enter__(self) -> None:
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc) -> bool:
        _STATE.depth -= 1
        return False


def recomputation() -> _Recomputation:
    """Mark the forwards run inside as a checkpoint's recomputation (see the module docs);
    the context may be entered any number of times, also as ``context_fn``'s recompute
    context."""
    return _Recomputation()


class _Marked:
    """``function`` that runs its second and later calls under :func:`recomputation`."""

    def __init__(self, function):
        self.function = function
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            return self.function(*args, **kwargs)
        with recomputation():
            return self.function(*args, **kwargs)


def checkpoint(function, *args, use_reentrant: bool = False, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., **kwargs)``
    whose recomputation the synchronized layers recognize: their running statistics move
    once per step, as without checkpointing. Same arguments and result as torch's (the
    default here is ``use_reentrant=False``, the variant torch recommends)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(_Marked(function), *args, use_reentrant=use_reentrant, **kwargs)
