"""NaN-safe error figures for the tests' numeric comparisons (no framework imported).

Python's ``max`` drops a NaN that is not its first argument (``max(0.0, nan)`` is
``0.0``), and an error computed from a result full of NaN is itself NaN: a test that
keeps "the worst error so far" with ``max`` would count such a result as exact. Every
error figure a test compares with a tolerance goes through :func:`as_error` (or
:func:`worst` / :func:`max_abs_diff`), which turn NaN and infinity into ``inf``, so a
non-finite result always fails ``err <= tol``.
"""

from __future__ import annotations

import math

__all__ = ["as_error", "worst", "max_abs_diff"]


def as_error(value) -> float:
    """``float(value)``, with NaN and +-inf turned into ``inf``."""
    value = float(value)
    return value if math.isfinite(value) else math.inf


def worst(errors, start: float = 0.0) -> float:
    """The largest of ``errors`` (and ``start``); ``inf`` if any of them is not finite."""
    result = as_error(start)
    for err in errors:
        result = max(result, as_error(err))
    return result


def max_abs_diff(actual, expected) -> float:
    """Largest ``|actual - expected|`` of two arrays of the same shape (0 when empty);
    ``inf`` when either holds a NaN or an infinity."""
    import numpy as np

    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shape {a.shape} != expected {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.inf
    return as_error(np.max(np.abs(a - b), initial=0.0))
