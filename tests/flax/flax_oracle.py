"""Float64 oracle for ``syncbn.flax``: plain batch norm on the concatenated batch (masked
elements excluded from the statistics), written in ``jax.numpy`` and evaluated with
``float64`` (``jax.enable_x64``), so ``jax.vjp`` of it gives the reference gradients,
including those through the running statistics. Complex inputs or parameters are
evaluated in ``complex128``: mean complex, variance ``mean(|x - mean|**2)`` real, as Flax
defines batch norm for them, and ``jax.vjp`` gives JAX's complex cotangents."""

from __future__ import annotations

import functools

import numpy as np


def reference(x, scale, bias, mask, feature_axis, eps):
    """``(y, mean, var)`` of batch norm over every axis but ``feature_axis``, float64."""
    import jax.numpy as jnp

    axes = tuple(i for i in range(x.ndim) if i != feature_axis % x.ndim)
    shape = [1] * x.ndim
    shape[feature_axis] = x.shape[feature_axis]
    real = jnp.real(x).dtype
    m = jnp.ones(x.shape, real) if mask is None else jnp.broadcast_to(mask, x.shape).astype(real)
    n = m.sum(axes)
    mean = (m * x).sum(axes) / n
    d = x - mean.reshape(shape)
    var = (m * (d * jnp.conj(d)).real).sum(axes) / n
    y = (x - mean.reshape(shape)) / jnp.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) + bias.reshape(shape)
    return y, mean, var


def reference_vjp(x, scale, bias, mask, feature_axis, eps, momentum, ra_mean, ra_var, cotangents):
    """Reference outputs ``(y, new_ra_mean, new_ra_var)`` and the gradients of
    ``(x, scale, bias)`` for the given cotangents of those outputs, all float64 numpy.
    One compiled program per shapes and settings (:func:`_jitted_vjp`), not one per
    ``jax.numpy`` operation: the checks call it for many shapes."""
    import jax
    import jax.numpy as jnp

    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.complex128 if np.iscomplexobj(a) else np.float64))
        mask_ = None if mask is None else jnp.asarray(np.asarray(mask, bool))
        out, grads = _jitted_vjp()(f64(x), f64(scale), f64(bias), mask_, f64(ra_mean), f64(ra_var),
                                   tuple(f64(c) for c in cotangents), feature_axis=feature_axis, eps=eps,
                                   momentum=momentum)
        return [np.asarray(o) for o in out], [np.asarray(g) for g in grads]


@functools.cache
def _jitted_vjp():
    """:func:`reference_vjp`'s computation under ``jax.jit`` (the settings static): made
    once, so that calls of the same shapes and settings reuse one compiled program."""
    import jax

    def run(x, scale, bias, mask, ra_mean, ra_var, cotangents, feature_axis, eps, momentum):
        def f(x, scale, bias):
            y, mean, var = reference(x, scale, bias, mask, feature_axis, eps)
            return y, momentum * ra_mean + (1 - momentum) * mean, momentum * ra_var + (1 - momentum) * var

        out, pullback = jax.vjp(f, x, scale, bias)
        return out, pullback(cotangents)

    return jax.jit(run, static_argnames=("feature_axis", "eps", "momentum"))


def assert_close(name, got, want, tol):
    """``|got - want| <= tol * (1 + |want|)`` everywhere; NaN or inf anywhere fails.
    Complex values compare as complex (a lost imaginary part is an error)."""
    got, want = np.asarray(got), np.asarray(want)
    kind = np.complex128 if np.iscomplexobj(got) or np.iscomplexobj(want) else np.float64
    got, want = got.astype(kind), want.astype(kind)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{name}: non-finite values {got[~np.isfinite(got)][:5]}"
    assert np.isfinite(want).all(), f"{name}: the oracle is not finite"
    err = np.abs(got - want) / (1 + np.abs(want))
    assert err.max() <= tol, f"{name}: max scaled error {err.max():.3g} > {tol:.3g}"
    return float(err.max())
