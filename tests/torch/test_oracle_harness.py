"""The test harness itself: a result that is NaN or infinite anywhere must fail the
float64 oracle comparison (``bn_oracle.check_case``) and every error helper, never
count as a small error (``max(0.0, nan)`` is ``0.0`` in Python)."""

import math

import numpy as np
import pytest
import torch

import nan_safe
from bn_oracle import Case, check_case, max_rel_err, oracle

CASE = Case(world=3, sizes=(3, 0, 2), tail=(4,), channels=3, dtype="float32", steps=2)


def perfect_results(case: Case, ref):
    """What the ranks would return if they computed the oracle exactly."""
    results = [{"steps": [], "formats_kept": True, "buffers": dict(ref["buffers"]), "eval": ev}
               for ev in ref["eval"]]
    bounds = np.cumsum((0,) + case.sizes)
    for step in ref["steps"]:
        for rank, r in enumerate(results):
            rows = slice(bounds[rank], bounds[rank + 1])
            share = {"y": step["y"][rows].clone(), "dx": step["dx"][rows].clone(), "dtype_ok": True}
            for name in ("dweight", "dbias"):  # rank 0 holds the whole sum, the others zeros
                share[name] = step[name].clone() if rank == 0 else torch.zeros_like(step[name])
            r["steps"].append(share)
    return results


def spoil(results, where, value):
    """Put ``value`` into one element of the result named by ``where``."""
    r = results[0]
    if where in ("y", "dx", "dweight", "dbias"):
        r["steps"][1][where].view(-1)[1] = value
    elif where == "eval":
        r["eval"].view(-1)[2] = value
    else:  # a buffer: the same on every rank, so that only the value is wrong
        for r in results:
            r["buffers"][where] = r["buffers"][where].clone()
            r["buffers"][where][0] = value


def test_exact_results_pass():
    ref = oracle(CASE)
    errors = check_case(CASE, perfect_results(CASE, ref), ref=ref)
    assert all(err <= 1e-12 for err in errors.values()), errors


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["y", "dx", "dweight", "dbias", "eval", "running_mean", "running_var"])
def test_non_finite_result_fails_the_oracle(where, value):
    ref = oracle(CASE)
    results = perfect_results(CASE, ref)
    spoil(results, where, value)
    # (torch.equal never holds with a NaN, so a NaN buffer may fail the ranks' agreement first)
    with pytest.raises(AssertionError, match="relative error inf|differs across ranks"):
        check_case(CASE, results, ref=ref)


def test_all_nan_result_fails_the_oracle():
    """The case of issue #20: every output gradient NaN, as a broken half-precision
    path produced it; the old ``max(worst, err)`` kept 0.0 for it."""
    ref = oracle(CASE)
    results = perfect_results(CASE, ref)
    for r in results:
        for step in r["steps"]:
            step["dx"].fill_(math.nan)
    with pytest.raises(AssertionError, match="dx: relative error inf"):
        check_case(CASE, results, ref=ref)


def test_error_helpers_count_non_finite_as_infinite():
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert max_rel_err(a, a) == 0.0
    for bad in (math.nan, math.inf):
        b = a.clone()
        b[1] = bad
        assert max_rel_err(b, a) == math.inf
        assert max_rel_err(a, b) == math.inf  # a non-finite reference vouches for nothing
        assert nan_safe.max_abs_diff(b.numpy(), a.numpy()) == math.inf
        assert nan_safe.as_error(bad) == math.inf
    assert max(0.0, math.nan) == 0.0  # why the helpers exist
    assert nan_safe.worst([0.0, math.nan, 1e-9]) == math.inf
    assert nan_safe.worst([]) == 0.0 and nan_safe.worst([1e-9, 2e-9]) == 2e-9
    assert nan_safe.max_abs_diff(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
    with pytest.raises(AssertionError, match="shape"):
        nan_safe.max_abs_diff(np.zeros(2), np.zeros(3))
