"""The moment merge that every framework's layer implements, derived once, with its error
analysis; and the few helpers about it that need no framework.

The PyTorch (:mod:`syncbn.torch.stats`), Keras (:mod:`syncbn.keras.moments`) and Flax
(:mod:`syncbn.flax.moments`) layers each compute it with their own ops; their docstrings
say only what is particular to them (how the local moments are reduced, which shift,
which summing dtype) and cite this page for the rest.

**The payload.** Per channel, rank (replica, device) ``r`` holds ``n_r >= 0`` elements
``x`` (those its mask keeps), with mean ``m_r`` and ``M2_r = sum (x - m_r)^2``. Around a
shift ``K`` that every rank holds identically (0, or the layer's running mean), it sends

    P_r = [n_r,  n_r a_r,  M2_r + n_r a_r^2]        with a_r = m_r - K,

one value for the count (or one per channel when a mask gives each channel its own) and
two per channel: ``2C + 1`` values (``3C``), whatever the number of ranks. One sum over
the ranks (a single all-reduce / ``psum``) gives ``N = sum n_r``, ``S1 = sum n_r a_r``,
``S2 = sum (M2_r + n_r a_r^2)``, and

    mean = K + S1 / N,        var = S2 / N - (S1 / N)^2        (biased).

**Why it is exact.** Over a rank's elements ``sum (x - K)^2 = M2_r + n_r a_r^2`` (expand
``x - K = (x - m_r) + a_r``; the cross term ``2 a_r sum (x - m_r)`` is 0). Summed over
the ranks, ``S2 = sum (x - K)^2`` over the union, and
``N var = sum (x - mean)^2 = S2 - N (mean - K)^2``. This is Chan's parallel merge
(``sum M2_r + sum n_r (m_r - mean)^2``) rewritten as a sum, so one all-reduce of O(C)
values suffices, where an all-gather of per-rank moments would carry W times as much.
A rank that first centers on an approximate mean ``c`` (to keep its reduction stable)
packs the corrected moments: with ``s = sum (x - c)`` and ``q = sum (x - c)^2``,
``m_r = c + s / n_r`` and ``M2_r = q - s^2 / n_r`` (the corrected two-pass algorithm).

**Error analysis** (``u`` is the unit roundoff of a dtype: 6.0e-8 for float32, 1.1e-16
for float64; ``d = |mean - K| / std``):

1. *Local moments.* ``M2_r`` comes from a stable reduction (two-pass, corrected
   two-pass, or Welford), whose relative error is a small multiple of ``u`` times the
   depth of the summation, independent of ``d``. The naive ``sum x^2 - n mean^2`` in the
   input's float32 loses ``u32 d^2`` relative: at ``d = 1e3`` that is 6e-2, at ``1e4``
   the variance is noise (measured on Keras's layer: mean 1000, std 0.1 gives variance 0).
   Even in float64 the naive sum of squares of ``n`` elements loses about
   ``n u64 d^2`` with recursive summation, 10 at ``n = 1e6, d = 1e4``: the local reduction
   must be centered.
2. *Packing.* The terms are formed in the summing dtype (float64 wherever the device has
   it), each rounded once: ``n_r a_r^2`` and ``M2_r`` carry ``u64`` relative error.
3. *The sum over ``W`` ranks* adds at most ``(W - 1) u64`` times the sum of the terms'
   magnitudes, about ``N (var + (mean - K)^2)``.
4. *The final subtraction* ``S2 / N - (S1 / N)^2`` cancels ``(mean - K)^2``: its absolute
   error is a few ``u64 (var + (mean - K)^2)``, i.e. relative to ``var`` about
   ``(W + 3) u64 (1 + d^2)``: 1e-8 at ``d = 1e4`` with W = 8, far below what a float32
   input resolves (``u32`` = 6e-8). The variance is clamped at 0 so that rounding never
   makes it negative.
5. *Without float64* (Apple MPS in torch, a Keras device without it) the sums are
   float32 and step 4 costs ``u32 (1 + d^2)``: that is what the shift is for (``K`` the
   running mean keeps ``d`` small once it tracks the data).

So for float32 and half inputs the merged variance is within a few ``u`` of the input
dtype of the exact one, up to ``|mean| / std = 1e4`` and beyond, provided step 1 holds;
each framework states how its local reduction meets it, and the tests measure it against
a float64 oracle. A float64 input is the exception: the sums are float64 too, so step 4's
``(W + 3) u64 (1 + d^2)`` is the error itself, not far below the input's ``u``: 1e-8
relative at ``d = 1e4``, 1e-4 at ``1e6`` (W = 8; shift 0: PyTorch and Flax), where one
process's two-pass float64 batch norm is exact. Only a shift that every rank holds and
that tracks the mean, or a second collective, would do better; across ranks, keep such
data centered (its offset removed before the layer).
"""

from __future__ import annotations

from typing import List

__all__ = ["reduction_axes", "broadcast_shape"]


def reduction_axes(ndim: int, axis: int) -> List[int]:
    """Every axis of an ``ndim``-dimensional input except the channel ``axis``."""
    axis = axis % ndim
    return [i for i in range(ndim) if i != axis]


def broadcast_shape(ndim: int, axis: int, channels: int) -> List[int]:
    """Shape that broadcasts a per-channel vector against the input: 1 except at ``axis``."""
    shape = [1] * ndim
    shape[axis % ndim] = channels
    return shape

