"""The test oracle for the Keras layer: float64 batch normalization in numpy on the
concatenation of every replica's input, with the concatenation of their output
gradients ``dy`` (the gradient of ``sum(y * dy)``), and Keras's moving-average rules.

Importable without any deep-learning framework; used by the worker scripts and by the
tests that compare the results of several processes.
"""

from __future__ import annotations

import numpy as np

from nan_safe import as_error

EPS = 1e-3


def make_inputs(rng, sizes, tail, channels, axis=-1, offset=None, scale=None):
    """Per-replica float32 inputs of shapes ``(n, *tail)`` with the channel axis at
    ``axis``, a non-zero per-channel mean and a per-channel spread; and matching ``dy``."""
    if offset is None:
        offset = rng.uniform(-20, 20, size=channels)
    if scale is None:
        scale = rng.uniform(0.3, 3.0, size=channels)
    xs, dys = [], []
    for n in sizes:
        shape = (n,) + tuple(tail)
        cshape = [1] * len(shape)
        cshape[axis] = channels
        x = rng.standard_normal(shape) * scale.reshape(cshape) + offset.reshape(cshape)
        xs.append(x.astype(np.float32))
        dys.append(rng.standard_normal(shape).astype(np.float32))
    return xs, dys


def make_masks(rng, xs, keep=0.6):
    """Per-replica boolean Keras masks: each input's shape without its last axis,
    whatever the channel axis (Keras broadcasts a mask over the last axis)."""
    return [rng.uniform(size=x.shape[:-1]) < keep for x in xs]


def _element_weights(x, mask):
    """A Keras mask broadcast to the whole input, as float64 0/1 weights."""
    if mask is None:
        return np.ones(x.shape)
    return np.broadcast_to(np.asarray(mask, np.float64)[..., None], x.shape)


def _channels_last(a, axis):
    return np.moveaxis(np.asarray(a, dtype=np.float64), axis % np.ndim(a), -1)


def batch_norm(
    xs,
    dys,
    axis=-1,
    gamma=None,
    beta=None,
    eps=EPS,
    momentum=0.99,
    moving_mean=None,
    moving_var=None,
    masks=None,
    renorm=None,
):
    """Forward, backward and buffer updates of batch norm over all replicas at once.

    ``xs``/``dys``/``masks``: one array per replica (a mask has its input's shape
    without the last axis, as in Keras, and may count each channel differently).
    ``renorm``: None, or a dict with
    ``renorm_mean``, ``renorm_std``, ``moving_std``, ``renorm_momentum`` and optional
    ``rmin``/``rmax``/``dmax`` (Keras's batch renormalization). Returns a dict with the
    per-replica ``y`` and ``dx`` (in each replica's layout), the summed ``dgamma``,
    ``dbeta``, and the updated ``moving_mean``/``moving_var`` (plus the renorm ones).
    """
    channels = xs[0].shape[axis]
    flat = lambda a: _channels_last(a, axis).reshape(-1, channels)  # noqa: E731
    x = np.concatenate([flat(a) for a in xs])
    dy = np.concatenate([flat(a) for a in dys])
    masks = [None] * len(xs) if masks is None else masks
    w = np.concatenate([flat(_element_weights(a, m)) for a, m in zip(xs, masks)])
    gamma = np.ones(channels) if gamma is None else np.asarray(gamma, np.float64)
    beta = np.zeros(channels) if beta is None else np.asarray(beta, np.float64)
    moving_mean = np.zeros(channels) if moving_mean is None else np.asarray(moving_mean, np.float64)
    moving_var = np.ones(channels) if moving_var is None else np.asarray(moving_var, np.float64)

    # Per channel; a channel that counts nothing has mean 0 and variance 0 (Keras).
    n = w.sum(0)
    safe = np.maximum(n, 1)
    mean = (w * x).sum(0) / safe
    var = (w * (x - mean) ** 2).sum(0) / safe
    inv = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean) * inv
    out = {"mean": mean, "var": var}

    if renorm is None:
        r, d = np.ones(channels), np.zeros(channels)
        out["moving_mean"] = moving_mean * momentum + mean * (1 - momentum)
        out["moving_var"] = moving_var * momentum + var * (1 - momentum)
    else:
        std = np.sqrt(var + eps)
        rmean = np.asarray(renorm["renorm_mean"], np.float64)
        rstd = np.asarray(renorm["renorm_std"], np.float64)
        floor = np.maximum(rstd, np.sqrt(eps))
        r = std / floor
        d = (mean - rmean) / floor
        if renorm.get("rmin") is not None:
            r = np.maximum(r, renorm["rmin"])
        if renorm.get("rmax") is not None:
            r = np.minimum(r, renorm["rmax"])
        if renorm.get("dmax") is not None:
            d = np.clip(d, -renorm["dmax"], renorm["dmax"])
        rm = renorm["renorm_momentum"]
        out["renorm_mean"] = rmean * rm + mean * (1 - rm)
        out["renorm_std"] = rstd * rm + std * (1 - rm)
        out["moving_mean"] = moving_mean * momentum + mean * (1 - momentum)
        out["moving_std"] = np.asarray(renorm["moving_std"], np.float64) * momentum + std * (1 - momentum)
        out["moving_var"] = np.maximum(out["moving_std"] ** 2 - eps, 0)

    y = (xhat * r + d) * gamma + beta
    s1 = dy.sum(0)
    s2 = (dy * xhat).sum(0)
    dx = gamma * r * inv * (dy - w * s1 / safe - w * xhat * s2 / safe)
    out["dgamma"] = (dy * (xhat * r + d)).sum(0)
    out["dbeta"] = s1

    # Split the flat rows back into the replicas' own layouts.
    out["y"], out["dx"] = [], []
    start = 0
    for a in xs:
        rows = a.size // channels
        last = _channels_last(a, axis).shape
        for key, full in (("y", y), ("dx", dx)):
            part = full[start : start + rows].reshape(last)
            out[key].append(np.moveaxis(part, -1, axis % a.ndim))
        start += rows
    return out


def variance_relative_error(var, reference):
    """Largest relative error of a computed variance against a float64 reference."""
    var = np.asarray(var, np.float64)
    reference = np.asarray(reference, np.float64)
    return as_error(np.max(np.abs(var - reference) / reference))  # NaN anywhere: inf
