"""Checks of ``syncbn.flax`` on 4 host CPU devices, in one process with torch blocked
(``XLA_FLAGS=--xla_force_host_platform_device_count=4`` must be set before JAX starts,
so they cannot run in the pytest process, which may have imported JAX already).

    python tests/flax_checks.py --out R.json --checks NAME...

Every training call is compared with the float64 oracle on the concatenated batch
(``flax_oracle.py``): outputs, input gradients (``jax.vjp`` from outside
``pmap``/``shard_map``/``jit`` with an explicit dy), scale/bias gradients and the
updated running statistics.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from keras_harness import block_torch, run_checks
from flax_oracle import assert_close, reference_vjp

DEVICES = 4
AXIS = "d"
EPS = 1e-5
MOMENTUM = 0.9
CHECKS = {}
# Scaled-error bounds, from the arithmetic: float32 statistics and normalization carry a
# few hundred float32 roundings at most (2**-24 each, ~6e-8) on values of order 1-10,
# so 2e-5 leaves a margin of >10x; bfloat16 results (dx in the input's dtype) are
# rounded to 8 bits (2**-9 ~ 2e-3 relative), so 1e-2.
TOL = {"float32": 2e-5, "bfloat16": 1e-2}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def setup():
    block_torch()
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    assert len(jax.devices()) >= DEVICES, jax.devices()


# ----------------------------------------------------------------------------- data


def make_case(seed, layout, dtype, masked, per_device=3, spatial=5, channels=4):
    """Per-device inputs ``x[W, B, ...]`` with a different mean on each device, a mask
    keeping 90 %, 10 %, none and 50 % of the elements on devices 0..3 (uneven counts and
    a fully masked device), parameters and running statistics away from their defaults."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    if layout == "channels_last":
        shape, axis = (per_device, spatial, channels), -1
    else:
        shape, axis = (per_device, channels, spatial), 1
    offsets = np.array([3.0, -1.0, 7.0, 0.5])[:, None, None, None]
    x = (rng.standard_normal((DEVICES,) + shape) * 2 + offsets).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # the values the layer sees
    mask = None
    if masked:
        keep = np.array([0.9, 0.1, 0.0, 0.5])[:, None, None, None]
        mask = rng.random((DEVICES,) + shape) < keep
        mask[0, 0, 0] = True  # every channel has valid elements somewhere
    params = {"scale": rng.uniform(0.5, 1.5, channels).astype(np.float32),
              "bias": rng.uniform(-1, 1, channels).astype(np.float32)}
    stats = {"mean": rng.uniform(-1, 1, channels).astype(np.float32),
             "var": rng.uniform(0.5, 2, channels).astype(np.float32)}
    dy = rng.standard_normal((DEVICES,) + shape).astype(np.float32)
    d_mean = rng.standard_normal((DEVICES, channels)).astype(np.float32)
    d_var = rng.standard_normal((DEVICES, channels)).astype(np.float32)
    return dict(x=x, mask=mask, params=params, stats=stats, dy=dy, d_mean=d_mean, d_var=d_var, axis=axis,
                dtype=dtype)


def flax_variables(case):
    """Variables initialized by ``flax.linen.BatchNorm`` itself, then given the case's values."""
    import jax
    import flax.linen as nn

    variables = nn.BatchNorm(axis=case["axis"]).init(jax.random.PRNGKey(0), case["x"][0], use_running_average=False)
    assert set(variables) == {"params", "batch_stats"}
    for col, key in (("params", "scale"), ("params", "bias"), ("batch_stats", "mean"), ("batch_stats", "var")):
        assert variables[col][key].shape == case[col if col == "params" else "stats"][key].shape
    return {"params": dict(case["params"]), "batch_stats": dict(case["stats"])}


def concat(a):
    return None if a is None else np.concatenate(list(a), axis=0)


def oracle(case, d_mean, d_var):
    x = concat(case["x"])
    (y, ra_mean, ra_var), (dx, dscale, dbias) = reference_vjp(
        x, case["params"]["scale"], case["params"]["bias"], concat(case["mask"]), case["axis"], EPS, MOMENTUM,
        case["stats"]["mean"], case["stats"]["var"], (concat(case["dy"]), d_mean, d_var))
    return dict(y=y, mean=ra_mean, var=ra_var, dx=dx, dscale=dscale, dbias=dbias)


def compare(got, ref, dtype, label):
    tol = TOL[dtype]
    errs = {}
    for key in ("y", "mean", "var", "dscale", "dbias"):
        errs[key] = assert_close(f"{label} {key}", got[key], ref[key], TOL["float32"] if key != "y" else tol)
    errs["dx"] = assert_close(f"{label} dx", got["dx"], ref["dx"], tol)
    return errs


def cases():
    for layout in ("channels_last", "channels_first"):
        for dtype in ("float32", "bfloat16"):
            for masked in (False, True):
                yield layout, dtype, masked


# ----------------------------------------------------------------------------- pmap


def pmap_step(model, case, groups=None):
    """Forward and vjp of one training call under ``pmap``; returns arrays as numpy."""
    import jax
    import jax.numpy as jnp

    variables = flax_variables(case)
    x = jnp.asarray(case["x"], case["dtype"])
    mask = None if case["mask"] is None else jnp.asarray(case["mask"])

    def replica(x, params, mask):
        y, upd = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mask=mask,
                             mutable=["batch_stats"])
        return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

    step = jax.pmap(replica, axis_name=AXIS, in_axes=(0, None, 0 if mask is not None else None))
    out, pullback = jax.vjp(lambda x, p: step(x, p, mask), x, variables["params"])
    dy = jnp.asarray(case["dy"], out[0].dtype)
    dx, dparams = pullback((dy, jnp.asarray(case["d_mean"]), jnp.asarray(case["d_var"])))
    y, mean, var = (np.asarray(o, np.float64) for o in out)
    return dict(y=concat(y), mean=mean, var=var, dx=concat(np.asarray(dx, np.float64)),
                dscale=np.asarray(dparams["scale"]), dbias=np.asarray(dparams["bias"]))


@check
def pmap_matches_oracle():
    """pmap over 4 devices, channels at -1 and 1, float32 and bfloat16, with and without
    uneven masks (one device fully masked); running-statistics cotangents non-zero."""
    from syncbn.flax import BatchNorm

    info = {}
    for i, (layout, dtype, masked) in enumerate(cases()):
        case = make_case(i, layout, dtype, masked)
        model = BatchNorm(use_running_average=False, axis=case["axis"], axis_name=AXIS, momentum=MOMENTUM, epsilon=EPS)
        got = pmap_step(model, case)
        # each device returns its copy of the running statistics: their cotangents add up
        ref = oracle(case, case["d_mean"].sum(0), case["d_var"].sum(0))
        ref["mean"], ref["var"] = np.broadcast_to(ref["mean"], got["mean"].shape), np.broadcast_to(ref["var"], got["var"].shape)
        info[f"{layout}/{dtype}/{'masked' if masked else 'full'}"] = compare(got, ref, dtype, f"{layout} {dtype} {masked}")
    return info


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", nargs="+", default=list(CHECKS))
    args = parser.parse_args(argv)
    setup()
    results = run_checks(CHECKS, args.checks, args.out)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
