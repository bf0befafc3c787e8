"""The layer fingerprint's digit arithmetic, with no framework: shared by the PyTorch
layers (:mod:`syncbn.torch.fingerprint`) and the Keras layer (:mod:`syncbn.keras.replicas`).

A call of a synchronized layer is tagged by a :class:`Tag` (a 24-bit CRC-32 of the
layer's name and width, one bit saying whether the call records an autograd graph, and
an 11-bit call index). The tag's 36 bits are cut into
``DIGITS`` = 9 digits ``d`` of 4 bits, and the payload that is summed over the W ranks
carries ``d`` and ``d^2`` for each: ``SIZE`` = 18 values. After the sum,
``(sum d)^2 <= W * sum d^2`` (Cauchy-Schwarz), with equality exactly when every rank sent
the same digit. Every value is an integer below ``W * 225``, exact in float32 up to
``MAX_WORLD`` ranks (and in float64 far beyond). Every rank sees the same sums, so every
rank reaches the same verdict.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple, Optional, Sequence

__all__ = [
    "DIGIT_BITS",
    "IDENT_BITS",
    "INDEX_BITS",
    "GRAPH_BITS",
    "DIGITS",
    "SIZE",
    "MAX_WORLD",
    "LayerMismatchError",
    "Tag",
    "ident",
    "remember",
    "digits",
    "undigits",
    "values",
    "agree",
    "describe",
    "mismatch_message",
]

DIGIT_BITS = 4
IDENT_BITS = 24
GRAPH_BITS = 1
INDEX_BITS = 11
DIGITS = (IDENT_BITS + GRAPH_BITS + INDEX_BITS) // DIGIT_BITS  # 9
SIZE = 2 * DIGITS  # 18 extra values per payload
DIGIT_MAX = (1 << DIGIT_BITS) - 1
# sum of d^2 over W ranks must stay an exact float32 integer: W * 15^2 <= 2^24
MAX_WORLD = (1 << 24) // (DIGIT_MAX * DIGIT_MAX)


class LayerMismatchError(RuntimeError):
    """The ranks (workers) are not in the same synchronized layer call."""


class Tag(NamedTuple):
    ident: int  # 24-bit hash of the layer's name and num_features
    index: int  # call index within the step, modulo 2^11
    # the call records an autograd graph, so its backward will communicate (PyTorch: a
    # training forward under no_grad on one rank beside a recorded one on another pairs
    # a call without a backward with one that has it; the Keras layers leave it False)
    graph: bool = False


_names = {}  # ident -> (name, num_features): names this process can decode


def ident(name: str, num_features: int) -> int:
    """The 24-bit identity of a layer called ``name`` with ``num_features`` channels."""
    return zlib.crc32(f"{name}\0{num_features}".encode()) & ((1 << IDENT_BITS) - 1)


def remember(name: str, num_features: int) -> int:
    """:func:`ident`, remembering the name so that messages can decode it."""
    value = ident(name, num_features)
    _names.setdefault(value, (name, num_features))
    return value


def digits(tag: Tag) -> list:
    """The ``DIGITS`` 4-bit digits of ``tag``, least significant first."""
    value = (((tag.ident << GRAPH_BITS) | int(bool(tag.graph))) << INDEX_BITS) | (tag.index & ((1 << INDEX_BITS) - 1))
    return [(value >> (DIGIT_BITS * i)) & DIGIT_MAX for i in range(DIGITS)]


def undigits(ds) -> Tag:
    """The tag whose digits are ``ds``."""
    value = 0
    for i, d in enumerate(ds):
        value |= int(d) << (DIGIT_BITS * i)
    return Tag(value >> (INDEX_BITS + GRAPH_BITS), value & ((1 << INDEX_BITS) - 1), bool((value >> INDEX_BITS) & 1))


def values(tag: Tag) -> list:
    """The ``SIZE`` payload values of ``tag``: its digits, then their squares."""
    ds = digits(tag)
    return ds + [d * d for d in ds]


def agree(sums: Sequence, world: int) -> bool:
    """Whether the ``SIZE`` summed values say that all ``world`` ranks sent one tag."""
    ints = [int(v) for v in sums]
    return all(t * t == q * world for t, q in zip(ints[:DIGITS], ints[DIGITS:]))


def describe(tag: Tag, what: str = "layer", features: str = "features") -> str:
    """``tag`` in words: the layer's name when this process knows it."""
    known = _names.get(tag.ident)
    name = f"{what} {known[0]!r} ({known[1]} {features})" if known else f"a {what} unknown here (id {tag.ident:06x})"
    return f"{name}, call {tag.index} of the step" + (", recording autograd" if tag.graph else "")


def mismatch_message(tag: Tag, sums: Sequence, world: int, rank: int, backward: bool, who: str = "rank",
                     group: str = "the ranks of the process group", what: str = "layer",
                     features: str = "features", numbers: Optional[Sequence[int]] = None) -> str:
    """The error message of a disagreement seen by ``rank`` (which sent ``tag``): with
    two ranks it names both ranks' calls (the other's recovered from the sums; ``sums``
    None: only this rank's). ``rank`` None: this rank's number is not known. ``numbers``:
    the number to print for each rank of the group (a subgroup's members by their global
    ranks, the numbers users see in their logs); by default the group ranks themselves."""
    phase = "backward" if backward else "forward"
    number = (lambda r: r) if numbers is None else (lambda r: numbers[r])
    if rank is None:
        calls = f"this {who} called {describe(tag, what, features)}; the {world} {who}s did not all call it"
    elif world == 2 and sums is not None:
        own = digits(tag)
        other = undigits(int(s) - d for s, d in zip(list(sums)[:DIGITS], own))
        tags = {rank: tag, 1 - rank: other}
        calls = "; ".join(f"{who} {number(r)} called {describe(tags[r], what, features)}" for r in (0, 1))
        if tag._replace(graph=False) == other._replace(graph=False):
            calls += (f" (the same call, but only one {who} records it for a backward pass: a training-mode "
                      f"call under torch.no_grad, or on tensors that need no gradient, on one {who} alone)")
    else:
        calls = (f"{who} {number(rank)} (this {who}) called {describe(tag, what, features)}; the {world} "
                 f"{who}s did not all call it")
    return (
        f"syncbn: {group} are in different synchronized layer calls ({phase}): {calls}. Every "
        f"{who} must call the same synchronized layers in the same order (a data-dependent branch, "
        f"{who}-local code or a model built differently on one {who} breaks this); the statistics "
        f"of this call were not applied."
    )
