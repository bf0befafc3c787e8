"""``syncbn.flax`` against Flax's own BatchNorm: its dtype semantics (integer, half,
float64 and complex inputs; ``dtype``, ``param_dtype``, ``force_float32_reductions``;
``jax_enable_x64`` off and on) and the behaviours Flax's BatchNorm tests check, written
here in our words with our data. One worker process per x64 setting, 2 host CPU devices
(``jax_enable_x64`` has to be set before anything is traced)::

    python tests/flax/flax_conformance_checks.py --out R.json [--x64] --checks NAME...

Flax (0.12) computes the batch statistics in the input's dtype (or ``dtype``) promoted to
at least float32, an integer input as float32, a complex input with a complex mean and
the real variance ``mean(|x - mean|**2)``; linen updates its running statistics as
``momentum * ra + (1 - momentum) * stat`` with JAX's promotion (a float32 running mean
becomes float64 after a float64 batch under x64, complex64 after a complex batch), nnx
assigns into float32 Variables (they stay float32). The tables below are compared with
Flax's own layers, never written down by hand. One difference is deliberate: with a
complex input, an axis_name and use_fast_variance=True (its default), Flax stacks the
complex mean and the real mean of ``|x|**2`` into one complex pmean, so its variance (and
running variance) comes out complex64 with a zero imaginary part; syncbn's variance is
real in every mode, as Flax's is on one device and with use_fast_variance=False.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np

from keras_harness import block_torch, run_checks
from flax_oracle import assert_close, reference_vjp
from nan_safe import worst

DEVICES = 2
AXIS = "d"
EPS = 1e-5
MOMENTUM = 0.9
CHECKS = {}  # run with jax_enable_x64 off
X64_CHECKS = {}  # run in a process with jax_enable_x64 on

# Scaled-error bounds |got - want| / (1 + |want|), by the real dtype of the compared value.
# float32: statistics and normalization carry a few hundred roundings of 2**-24 at most
# on values of order 1-10 (measured 1e-7 .. 2e-6), so 2e-5; float64 likewise with 2**-53
# (measured ~1e-15), so 1e-12; half-precision outputs are one rounding of a float32 value
# that may fall on the other side of a tie: one ulp, 2**-8 (bfloat16) or 2**-11 (float16).
TOL = {"float64": 1e-12, "float32": 2e-5, "bfloat16": 1e-2, "float16": 2e-3}
# With force_float32_reductions=False and a half input the statistics themselves are
# half precision, summed differently (Flax: a two-pass mean in that dtype; syncbn: centered
# sums merged in float64, then rounded once): they may differ by a few ulps of bfloat16
# (2**-8 each), so 6e-2 (measured: equal on these data).
TOL_HALF_STATS = 6e-2


def check(*modes):
    """Register a check for the x64-off process (``"x32"``), the x64 one, or both."""

    def register(fn):
        for mode in modes:
            (X64_CHECKS if mode == "x64" else CHECKS)[fn.__name__] = fn
        return fn

    return register


def setup(x64: bool):
    block_torch()
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # float64 asked for without x64 is float32, as for Flax: the warning says so each time
    warnings.filterwarnings("ignore", message="Explicitly requested dtype")
    warnings.filterwarnings("ignore", category=np.exceptions.ComplexWarning)
    import jax

    jax.config.update("jax_enable_x64", x64)
    assert len(jax.devices()) >= DEVICES, jax.devices()


def x64_on() -> bool:
    import jax

    return bool(jax.config.jax_enable_x64)


def tol_for(dtype) -> float:
    import jax.numpy as jnp

    real = jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.dtype("float32")
    return TOL[real.name]


def sample(dtype, shape, seed, offset=1.5):
    """Values of ``dtype`` away from zero mean: small integers, or normals (complex: both
    parts, the imaginary one with a mean of its own)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.asarray(rng.integers(0, 9, shape), dtype)
    x = rng.standard_normal(shape) * 2 + offset
    if jnp.issubdtype(dtype, jnp.complexfloating):
        x = x + 1j * (rng.standard_normal(shape) * 1.5 - 0.5 * offset)
    return jnp.asarray(x, dtype)


def kinds(tree):
    import jax

    return jax.tree.map(lambda a: str(a.dtype), tree)


# ----------------------------------------------------------------------------- dtypes

X_DTYPES = ("float32", "bfloat16", "float16", "float64", "int32", "uint8", "complex64", "complex128")
LAYER_KW = ({}, {"dtype": "bfloat16"}, {"dtype": "float64"}, {"dtype": "complex64"}, {"param_dtype": "bfloat16"},
            {"param_dtype": "float64"}, {"param_dtype": "complex64"}, {"force_float32_reductions": False},
            {"force_float32_reductions": False, "param_dtype": "bfloat16"})


def value_tol(x_dtype, kw, out_dtype):
    """The bound for a value of ``out_dtype`` computed from statistics in Flax's dtype
    for them: the coarser of the two decides."""
    import jax.numpy as jnp

    stats = jnp.dtype(kw.get("dtype") or x_dtype)
    if kw.get("force_float32_reductions", True):
        stats = jnp.promote_types(stats, jnp.float32)
    if stats in (jnp.bfloat16, jnp.float16):
        return TOL_HALF_STATS
    return max(tol_for(stats), tol_for(out_dtype))


def redraw(tree, seed):
    """Every leaf redrawn away from Flax's initial values, in the leaf's own dtype (a
    variance positive)."""
    import jax
    import jax.numpy as jnp

    def draw(i, path, a):
        if any("var" in str(getattr(k, "key", getattr(k, "name", k))) for k in path):
            return jnp.asarray(np.random.default_rng(seed + i).uniform(0.5, 2.0, a.shape), a.dtype)
        return sample(a.dtype, a.shape, seed + i, offset=0.8)

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree.unflatten(treedef, [draw(i, path, a) for i, (path, a) in enumerate(flat)])


@check("x32", "x64")
def variable_dtypes_follow_flax():
    """For every input dtype (float32, bfloat16, float16, float64, int32, uint8, complex64,
    complex128) and layer setting (dtype, param_dtype, force_float32_reductions): the
    linen layer's variables after init and after a training update, its output and its
    evaluation output have the dtypes flax.linen.BatchNorm's have, with Flax's values
    (its two-pass mode); likewise syncbn.flax.nnx.BatchNorm against flax.nnx.BatchNorm
    (state after the update, outputs). Parameters and running statistics are redrawn so
    that scale, bias and the momentum average all show."""
    import jax
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    info, count = {}, 0
    for x_name in X_DTYPES:
        x = sample(x_name, (6, 5, 3), 1)
        for kw in LAYER_KW:
            label = f"{x_name} {kw}"
            # linen: both from Flax's init, then the same redrawn values
            theirs = nn.BatchNorm(use_fast_variance=False, momentum=MOMENTUM, **kw)
            ours = sf.BatchNorm(momentum=MOMENTUM, **kw)
            v0 = theirs.init(jax.random.PRNGKey(0), x, use_running_average=False)
            assert kinds(ours.init(jax.random.PRNGKey(0), x, use_running_average=False)) == kinds(v0), label
            v0 = redraw(v0, 10)
            got = ours.apply(v0, x, use_running_average=False, mutable=["batch_stats"])
            want = theirs.apply(v0, x, use_running_average=False, mutable=["batch_stats"])
            assert kinds(got) == kinds(want), (label, kinds(got), kinds(want))
            tol = value_tol(x.dtype, kw, want[0].dtype)
            errors = [assert_close(f"{label} y", got[0], want[0], tol)]
            for k in ("mean", "var"):
                assert_close(f"{label} {k}", got[1]["batch_stats"][k], want[1]["batch_stats"][k],
                             value_tol(x.dtype, kw, want[1]["batch_stats"][k].dtype))
            updated = {**v0, **want[1]}
            e_got = ours.apply(updated, x, use_running_average=True)
            e_want = theirs.apply(updated, x, use_running_average=True)
            assert e_got.dtype == e_want.dtype, (label, e_got.dtype, e_want.dtype)
            assert_close(f"{label} eval", e_got, e_want, tol)
            count += 1
            info[label] = worst(errors)
            if "force_float32_reductions" in kw:
                continue  # not an nnx setting
            # nnx: the same construction, the same redrawn state
            theirs = nnx.BatchNorm(3, use_fast_variance=False, momentum=MOMENTUM, rngs=nnx.Rngs(0), **kw)
            ours = snnx.BatchNorm(3, momentum=MOMENTUM, rngs=nnx.Rngs(0), **kw)
            state = redraw(nnx.state(theirs), 20)
            nnx.update(theirs, state)
            nnx.update(ours, state)
            y_got, y_want = ours(x, use_running_average=False), theirs(x, use_running_average=False)
            assert y_got.dtype == y_want.dtype, (label, y_got.dtype, y_want.dtype)
            assert kinds(nnx.state(ours)) == kinds(nnx.state(theirs)), (label, kinds(nnx.state(ours)))
            errors.append(assert_close(f"nnx {label} y", y_got, y_want, tol))
            for k in ("mean", "var"):
                assert_close(f"nnx {label} {k}", getattr(ours, k)[...], getattr(theirs, k)[...], tol_for("float32"))
            e_got, e_want = ours(x, use_running_average=True), theirs(x, use_running_average=True)
            assert e_got.dtype == e_want.dtype, (label, e_got.dtype, e_want.dtype)
            assert_close(f"nnx {label} eval", e_got, e_want, tol)
            count += 1
            info[label] = worst(errors)
    info["combinations"] = count
    return info


@check("x32")
def integer_inputs_follow_flax():
    """An int32 / uint8 input (Flax promotes it to float32): syncbn's linen and nnx layers
    give Flax's output and statistics on one device, and under pmap over 2 devices with
    uneven counts the float64 oracle of the integers' values (output, running mean and
    variance); the gradient of the float parameters flows through."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    info = {}
    for name in ("int32", "uint8"):
        x = sample(name, (8, 3), 3)
        v = nn.BatchNorm().init(jax.random.PRNGKey(0), x, use_running_average=False)
        got = sf.BatchNorm(momentum=MOMENTUM).apply(v, x, use_running_average=False, mutable=["batch_stats"])
        want = nn.BatchNorm(momentum=MOMENTUM, use_fast_variance=False).apply(v, x, use_running_average=False,
                                                                             mutable=["batch_stats"])
        assert got[0].dtype == want[0].dtype == jnp.float32, (got[0].dtype, want[0].dtype)
        info[f"linen {name} y"] = assert_close("linen y", got[0], want[0], TOL["float32"])
        for k in ("mean", "var"):
            assert_close(f"linen {k}", got[1]["batch_stats"][k], want[1]["batch_stats"][k], TOL["float32"])
        ours, theirs = snnx.BatchNorm(3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, use_fast_variance=False, rngs=nnx.Rngs(0))
        info[f"nnx {name} y"] = assert_close("nnx y", ours(x), theirs(x), TOL["float32"])
        assert_close("nnx var", ours.var[...], theirs.var[...], TOL["float32"])

    # pmap: 2 devices, 5 and 2 valid rows, a synchronized integer batch
    x = np.stack([np.asarray(sample("int32", (5, 3), 4)), np.asarray(sample("int32", (5, 3), 5)) + 3])
    mask = np.zeros((2, 5, 1), bool)
    mask[0], mask[1, :2] = True, True
    dy = np.random.default_rng(6).standard_normal(x.shape)
    model = sf.BatchNorm(use_running_average=False, axis_name=AXIS, momentum=MOMENTUM)
    variables = model.init(jax.random.PRNGKey(0), jnp.asarray(x[0]))

    def replica(x, params, mask):
        y, upd = model.apply({**variables, "params": params}, x, mask=mask, mutable=["batch_stats"])
        return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

    step = jax.pmap(replica, axis_name=AXIS, in_axes=(0, None, 0))
    out, pullback = jax.vjp(lambda p: step(jnp.asarray(x), p, jnp.asarray(mask)), variables["params"])
    dparams, = pullback((jnp.asarray(dy, jnp.float32), jnp.zeros_like(out[1]), jnp.zeros_like(out[2])))
    (y, ra_mean, ra_var), (_, dscale, dbias) = reference_vjp(
        x.reshape(-1, 3).astype(np.float64), np.ones(3), np.zeros(3), np.broadcast_to(mask, x.shape).reshape(-1, 3), -1,
        EPS, MOMENTUM, np.zeros(3), np.ones(3), (dy.reshape(-1, 3), np.zeros(3), np.zeros(3)))
    assert out[0].dtype == jnp.float32, out[0].dtype
    info["pmap y"] = assert_close("pmap y", np.asarray(out[0]).reshape(-1, 3), y, TOL["float32"])
    assert_close("pmap mean", out[1][0], ra_mean, TOL["float32"])
    assert_close("pmap var", out[2][0], ra_var, TOL["float32"])
    assert_close("pmap dscale", dparams["scale"], dscale, TOL["float32"])
    assert_close("pmap dbias", dparams["bias"], dbias, TOL["float32"])
    return info


# ----------------------------------------------------------------------------- complex


@check("x32")
def complex_follows_flax():
    """A complex64 input on one device, linen and nnx, channels at -1 and 1, with and
    without a mask (excluded elements NaN, as in Flax's test), real and complex64
    parameters, dtype None and complex64: the output (complex64), the updated running
    mean (complex64) and variance (float32, real) and the evaluation output equal Flax's
    two-pass layer's; the kept outputs have mean 0 and variance 1 per channel and the
    running statistics moved by (1 - momentum) toward the batch's complex mean and real
    variance. Gradients (x, scale, bias, for a complex output cotangent, without NaN)
    equal those JAX derives through Flax's layer."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    info = {}
    rng = np.random.default_rng(7)
    tol = TOL["float32"]
    for axis, shape, red in ((-1, (5, 4, 3), (0, 1)), (1, (5, 3, 4), (0, 2))):
        channel_shape = [1, 1, 1]
        channel_shape[axis] = 3
        for masked in (False, True):
            for kw in ({}, {"param_dtype": jnp.complex64}, {"dtype": jnp.complex64}):
                label = f"axis {axis} mask={masked} {kw}"
                x = np.asarray(sample("complex64", shape, int(rng.integers(1 << 30))))
                m = None
                if masked:
                    m = rng.random(shape[:2] + (1,) if axis == -1 else (shape[0], 1, shape[2])) < 0.6
                    m[0], m[1] = True, True
                    x = np.where(m, x, np.nan + 1j * np.nan).astype(np.complex64)
                theirs = nn.BatchNorm(axis=axis, momentum=MOMENTUM, use_fast_variance=False, **kw)
                ours = sf.BatchNorm(axis=axis, momentum=MOMENTUM, **kw)
                variables = redraw(theirs.init(jax.random.PRNGKey(0), x, use_running_average=False), 30)
                got = ours.apply(variables, x, use_running_average=False, mask=m, mutable=["batch_stats"])
                want = theirs.apply(variables, x, use_running_average=False, mask=m, mutable=["batch_stats"])
                assert kinds(got) == kinds(want), (label, kinds(got), kinds(want))
                assert got[0].dtype == jnp.complex64 and got[1]["batch_stats"]["mean"].dtype == jnp.complex64
                assert got[1]["batch_stats"]["var"].dtype == jnp.float32, kinds(got)
                keep = np.ones(shape, bool) if m is None else np.broadcast_to(m, shape)
                info[label] = assert_close("y", np.asarray(got[0])[keep], np.asarray(want[0])[keep], tol)
                for k in ("mean", "var"):
                    assert_close(k, got[1]["batch_stats"][k], want[1]["batch_stats"][k], tol)
                updated = {**variables, **got[1]}
                assert_close("eval", np.asarray(ours.apply(updated, x, use_running_average=True))[keep],
                             np.asarray(theirs.apply(updated, x, use_running_average=True))[keep], tol)

                # Flax's test, for ours: normalized kept outputs, momentum average of the stats
                unit = sf.BatchNorm(axis=axis, momentum=MOMENTUM)
                y, fresh = unit.init_with_output(jax.random.PRNGKey(0), x, use_running_average=False, mask=m)
                y = np.asarray(y, np.complex128)
                xs = np.asarray(x, np.complex128)
                for c in range(3):
                    sel = np.moveaxis(keep, axis, -1)[..., c]
                    yc, xc = np.moveaxis(y, axis, -1)[..., c][sel], np.moveaxis(xs, axis, -1)[..., c][sel]
                    var_c = np.mean(np.abs(xc - xc.mean()) ** 2)
                    assert_close("kept mean", yc.mean(), 0.0, 1e-5)
                    assert_close("kept var", np.mean(np.abs(yc - yc.mean()) ** 2), var_c / (var_c + EPS), 1e-5)
                _, upd = unit.apply(fresh, x, use_running_average=False, mask=m, mutable=["batch_stats"])
                x_c = np.moveaxis(xs, axis, -1)
                k_c = np.moveaxis(keep, axis, -1)
                means = np.array([x_c[..., c][k_c[..., c]].mean() for c in range(3)])
                vars_ = np.array([np.mean(np.abs(x_c[..., c][k_c[..., c]] - means[c]) ** 2) for c in range(3)])
                assert_close("ema mean", upd["batch_stats"]["mean"], (1 - MOMENTUM) * means, 1e-6)
                assert_close("ema var", upd["batch_stats"]["var"], MOMENTUM + (1 - MOMENTUM) * vars_, 1e-6)

                if masked:
                    continue
                # gradients: ours (custom backward) against JAX's derivative of Flax's layer
                dy = np.asarray(sample("complex64", shape, 99, offset=0.0))

                def grads(model):
                    def f(x, params):
                        return model.apply({**variables, "params": params}, x, use_running_average=False,
                                           mutable=["batch_stats"])[0]

                    _, pullback = jax.vjp(f, jnp.asarray(x), variables["params"])
                    return pullback(jnp.asarray(dy))

                (dx, dp), (dx_f, dp_f) = grads(ours), grads(theirs)
                info[f"{label} dx"] = assert_close("dx", dx, dx_f, tol)
                for k in ("scale", "bias"):
                    assert dp[k].dtype == dp_f[k].dtype, (k, dp[k].dtype, dp_f[k].dtype)
                    assert_close(f"d{k}", dp[k], dp_f[k], tol)

    # nnx: complex input, the Variables stay float32 as Flax's do
    x = sample("complex64", (6, 3), 8)
    for kw in ({}, {"param_dtype": jnp.complex64}):
        ours = snnx.BatchNorm(3, momentum=MOMENTUM, rngs=nnx.Rngs(0), **kw)
        theirs = nnx.BatchNorm(3, momentum=MOMENTUM, use_fast_variance=False, rngs=nnx.Rngs(0), **kw)
        y_got, y_want = ours(x), theirs(x)
        assert y_got.dtype == y_want.dtype == jnp.complex64, (y_got.dtype, y_want.dtype)
        assert kinds(nnx.state(ours)) == kinds(nnx.state(theirs)), kinds(nnx.state(ours))
        info[f"nnx {kw}"] = assert_close("nnx y", y_got, y_want, tol)
        assert_close("nnx var", ours.var[...], theirs.var[...], tol)
        assert_close("nnx eval", ours(x, use_running_average=True), theirs(x, use_running_average=True), tol)
    return info


def complex_case(seed, layout, x_dtype, param_dtype, masked, per_device=4, spatial=3, channels=3):
    """Per-device inputs ``x[2, B, ...]`` with a different mean on each device, uneven
    masks (90 % and 30 % kept), parameters, running statistics and every cotangent
    (output, running mean, running variance) drawn in their dtypes."""
    rng = np.random.default_rng(seed)
    complex_x = np.issubdtype(np.dtype(x_dtype), np.complexfloating)
    shape = (per_device, spatial, channels) if layout == "channels_last" else (per_device, channels, spatial)
    axis = -1 if layout == "channels_last" else 1

    def draw(size, scale=1.0, cplx=True):
        v = rng.standard_normal(size) * scale
        return v + 1j * rng.standard_normal(size) * scale if cplx else v

    offsets = np.array([3.0 - 1j, -1.0 + 2j] if complex_x else [3.0, -1.0])[:, None, None, None]
    x = (draw((DEVICES,) + shape, 2.0, complex_x) + offsets).astype(x_dtype)
    mask = None
    if masked:
        mask = rng.random((DEVICES,) + shape) < np.array([0.9, 0.3])[:, None, None, None]
        mask[0, 0] = True
    complex_p = np.issubdtype(np.dtype(param_dtype), np.complexfloating)
    params = {"scale": (rng.uniform(0.5, 1.5, channels) + (1j * rng.uniform(-0.5, 0.5, channels) if complex_p else 0)),
              "bias": (rng.uniform(-1, 1, channels) + (1j * rng.uniform(-1, 1, channels) if complex_p else 0))}
    params = {k: v.astype(param_dtype) for k, v in params.items()}
    # float32 running statistics, as Flax creates them: after the update they have the
    # batch statistics' dtypes (the mean's: x's promoted to float32; the variance's: real)
    stats = {"mean": rng.uniform(-1, 1, channels).astype(np.float32),
             "var": rng.uniform(0.5, 2, channels).astype(np.float32)}
    stat_dtype = np.result_type(x_dtype, np.float32)
    dy = draw((DEVICES,) + shape, 1.0, complex_x or complex_p).astype(np.result_type(x_dtype, param_dtype))
    d_mean = draw((DEVICES, channels), 1.0, complex_x).astype(stat_dtype)
    d_var = rng.standard_normal((DEVICES, channels)).astype(np.finfo(stat_dtype).dtype)
    return dict(x=x, mask=mask, params=params, stats=stats, dy=dy, d_mean=d_mean, d_var=d_var, axis=axis)


def case_oracle(case, d_mean, d_var):
    cat = lambda a: None if a is None else np.concatenate(list(a), axis=0)
    (y, mean, var), (dx, dscale, dbias) = reference_vjp(
        cat(case["x"]), case["params"]["scale"], case["params"]["bias"], cat(case["mask"]), case["axis"], EPS,
        MOMENTUM, case["stats"]["mean"], case["stats"]["var"], (cat(case["dy"]), d_mean, d_var))
    # momentum * ra + (1 - momentum) * stat, as Flax writes it: the float32 running
    # statistic is scaled in float32 (a weakly typed Python float) before the sum takes
    # the batch statistic's dtype; the oracle scaled it exactly
    scaled = {k: (np.float32(MOMENTUM) * ra).astype(np.float64) - MOMENTUM * ra.astype(np.float64)
              for k, ra in case["stats"].items()}
    return dict(y=y, mean=mean + scaled["mean"], var=var + scaled["var"], dx=dx, dscale=dscale, dbias=dbias)


def pmap_case(case, param_dtype):
    """The linen layer's training call under pmap over 2 devices and its vjp for the
    case's cotangents; numpy results (x, dx concatenated, the devices' parameter
    gradients summed) and the compiled HLO texts of the forward and of both passes."""
    import jax
    import jax.numpy as jnp
    import syncbn.flax as sf

    model = sf.BatchNorm(use_running_average=False, axis=case["axis"], axis_name=AXIS, momentum=MOMENTUM,
                         epsilon=EPS, param_dtype=param_dtype)
    mask = None if case["mask"] is None else jnp.asarray(case["mask"])

    def replica(x, params, mask):
        y, upd = model.apply({"params": params, "batch_stats": case["stats"]}, x, mask=mask, mutable=["batch_stats"])
        return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

    # parameters passed per device, so that pmap adds no gradient reduction of its own
    # (the mask closed over: in_axes=(0, 0, None) with mask=None left the parameters unmapped, JAX 0.10)
    if mask is None:
        step = jax.pmap(lambda x, p: replica(x, p, None), axis_name=AXIS, devices=jax.devices()[:DEVICES])
    else:
        mapped = jax.pmap(replica, axis_name=AXIS, devices=jax.devices()[:DEVICES])
        step = lambda x, p: mapped(x, p, mask)

    def run(x, params, cotangents):
        out, pullback = jax.vjp(step, x, params)
        return out, pullback(cotangents)

    args = (jnp.asarray(case["x"]), jax.tree.map(lambda a: jnp.asarray(np.stack([a] * DEVICES)), case["params"]),
            tuple(jnp.asarray(case[k]) for k in ("dy", "d_mean", "d_var")))
    compiled = jax.jit(run).lower(*args).compile()
    (y, mean, var), (dx, dparams) = compiled(*args)
    forward = jax.jit(step).lower(*args[:2]).compile().as_text()
    got = dict(y=np.concatenate(list(np.asarray(y))), mean=np.asarray(mean), var=np.asarray(var),
               dx=np.concatenate(list(np.asarray(dx))), dscale=np.asarray(dparams["scale"]).sum(0),
               dbias=np.asarray(dparams["bias"]).sum(0))
    return got, forward, compiled.as_text()


def shard_map_case(case, param_dtype, wrap_shard_map):
    """The same call on the global batch sharded over the 2 devices: under shard_map
    with axis_name (replicated parameters: their total gradient from the layer's
    backward psum), or plain jit without it (XLA partitions the reductions)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import syncbn.flax as sf

    mesh = jax.make_mesh((DEVICES,), (AXIS,), devices=jax.devices()[:DEVICES])
    model = sf.BatchNorm(use_running_average=False, axis=case["axis"], momentum=MOMENTUM, epsilon=EPS,
                         param_dtype=param_dtype, axis_name=AXIS if wrap_shard_map else None)
    put = lambda a, s: jax.device_put(jnp.asarray(a), NamedSharding(mesh, s))
    cat = lambda a: np.concatenate(list(a), axis=0)
    x, dy = put(cat(case["x"]), P(AXIS)), put(cat(case["dy"]), P(AXIS))
    mask = None if case["mask"] is None else put(cat(case["mask"]), P(AXIS))
    params = jax.tree.map(lambda a: put(a, P()), case["params"])

    def body(x, params, mask):
        y, upd = model.apply({"params": params, "batch_stats": case["stats"]}, x, mask=mask, mutable=["batch_stats"])
        return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

    fn = body
    if wrap_shard_map:
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P(AXIS) if mask is not None else P()),
                           out_specs=(P(AXIS), P(), P()))

    @jax.jit
    def run(x, params, dy):
        out, pullback = jax.vjp(lambda x, p: fn(x, p, mask), x, params)
        return out, pullback((dy, jnp.asarray(case["d_mean"][0]), jnp.asarray(case["d_var"][0])))

    (y, mean, var), (dx, dparams) = run(x, params, dy)
    return dict(y=np.asarray(y), mean=np.asarray(mean), var=np.asarray(var), dx=np.asarray(dx),
                dscale=np.asarray(dparams["scale"]), dbias=np.asarray(dparams["bias"]))


def compare_case(got, ref, tol, label):
    errs = {}
    for key in ("y", "mean", "var", "dx", "dscale", "dbias"):
        want = ref[key]
        if key in ("mean", "var") and got[key].ndim == want.ndim + 1:
            want = np.broadcast_to(want, got[key].shape)  # pmap: each device's copy
        errs[key] = assert_close(f"{label} {key}", got[key], want, tol)
    return errs


def synchronized_matches_oracle(pairs, tol, seed):
    """For each (input dtype, parameter dtype): pmap (channels last with uneven masks,
    channels first without) and shard_map / jit with a sharded batch (masked) against
    the float64 / complex128 oracle: outputs, running statistics (and their dtypes: the
    float32 running mean takes the batch mean's dtype, complex for a complex input, the
    variance its real counterpart), input and parameter gradients (the parameters' in
    their own dtype, real for real ones), with non-zero cotangents for the running
    statistics; one all-reduce forward and one more backward under pmap."""
    from flax_checks import all_reduces_only

    info = {}
    for xd, pd in pairs:
        stat_dtype = np.result_type(xd, np.float32)
        for layout, masked in (("channels_last", True), ("channels_first", False)):
            label = f"x {xd} params {pd} {layout} {'masked' if masked else 'full'}"
            case = complex_case(seed, layout, xd, pd, masked)
            seed += 1
            got, fwd, both = pmap_case(case, pd)
            ref = case_oracle(case, case["d_mean"].sum(0), case["d_var"].sum(0))
            assert got["mean"].dtype == stat_dtype and got["var"].dtype == np.finfo(stat_dtype).dtype, \
                (label, got["mean"].dtype, got["var"].dtype)
            assert got["dx"].dtype == np.dtype(xd) and got["dscale"].dtype == np.dtype(pd), \
                (label, got["dx"].dtype, got["dscale"].dtype)
            info[label] = compare_case(got, ref, tol, label)
            counts = (all_reduces_only(fwd), all_reduces_only(both))
            assert counts == (1, 2), (label, counts)
        case = complex_case(seed, "channels_last", xd, pd, True)
        seed += 1
        ref = case_oracle(case, case["d_mean"][0], case["d_var"][0])
        for wrap in (True, False):
            label = f"x {xd} params {pd} {'shard_map' if wrap else 'jit-sharded'}"
            info[label] = compare_case(shard_map_case(case, pd, wrap), ref, tol, label)
    return info


@check("x32")
def complex_synchronized_matches_oracle():
    """complex64 inputs with float32 and complex64 parameters, and a float32 input with
    complex64 parameters (a complex output), synchronized over 2 devices against the
    complex128 oracle; see synchronized_matches_oracle."""
    pairs = (("complex64", "float32"), ("complex64", "complex64"), ("float32", "complex64"))
    return synchronized_matches_oracle(pairs, TOL["float32"], 200)


@check("x64")
def float64_synchronized_matches_oracle():
    """Under jax_enable_x64: float64 and complex128 inputs synchronized over 2 devices
    against the oracle at float64 precision, and the linen layer's running statistics
    are float64 (complex128 mean for a complex input) after the update, as Flax's."""
    pairs = (("float64", "float64"), ("complex128", "float64"), ("complex128", "complex128"), ("float64", "complex128"))
    return synchronized_matches_oracle(pairs, TOL["float64"], 300)


# Half-precision statistics (force_float32_reductions=False) are the exact statistics of
# the half-precision input rounded once to that dtype: relative error u = 2**-11
# (float16) or 2**-8 (bfloat16), plus the float32 accumulation of the local sums, about
# sqrt(n) * 2**-24 ~ 2e-5 for the 7e4 terms below (negligible beside u), so 2u. The output
# and dx carry that rounding of mean and variance (rstd: u / 2), the half-precision
# subtraction x - mean, rsqrt, product and the final rounding: about 5u of |y| (or |dx|),
# so 6u in the scaled error |got - want| / (1 + |want|).
HALF_U = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def half_case(x_name, param_dtype, x, axis_name):
    """The linen layer with half-precision statistics on ``x`` (pmapped over the leading
    axis with ``axis_name``, else one global call) against the float64 oracle on the
    rounded input and flax.linen.BatchNorm's dtypes: the scaled errors of y, dx and the
    batch statistics (momentum 0: the running statistics are the batch's)."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    import syncbn.flax as sf

    kw = dict(use_running_average=False, force_float32_reductions=False, param_dtype=param_dtype, momentum=0.0)
    ours, theirs = sf.BatchNorm(axis_name=axis_name, **kw), nn.BatchNorm(use_fast_variance=False, **kw)
    rows = x.reshape(-1, x.shape[-1])
    variables = jax.jit(theirs.init)(jax.random.PRNGKey(0), rows)
    dy = jnp.asarray(np.random.default_rng(5).standard_normal(x.shape), x.dtype)

    def step(x):
        y, upd = ours.apply(variables, x, mutable=["batch_stats"])
        return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

    f = jax.pmap(step, axis_name=axis_name, devices=jax.devices()[:x.shape[0]]) if axis_name else step

    # forward and backward as one program (the eager path runs in the other checks): on
    # 140000 x 2 elements each eager operation would be a program of its own
    @jax.jit
    def train(x, dy):
        (y, mean, var), pullback = jax.vjp(f, x)
        (dx,) = pullback((dy.astype(y.dtype), jnp.zeros_like(mean), jnp.zeros_like(var)))
        return y, mean, var, dx

    y, mean, var, dx = train(x, dy)
    want_y, want_upd = jax.jit(lambda v, r: theirs.apply(v, r, mutable=["batch_stats"]))(variables, rows)
    assert y.dtype == want_y.dtype and dx.dtype == x.dtype, (x_name, y.dtype, want_y.dtype, dx.dtype)
    assert (mean.dtype, var.dtype) == (want_upd["batch_stats"]["mean"].dtype, want_upd["batch_stats"]["var"].dtype)
    if axis_name:  # every device holds the same statistics
        mean, var = mean[0], var[0]
    channels = rows.shape[-1]
    (ry, rmean, rvar), (rdx, _, _) = reference_vjp(
        np.asarray(rows.astype(jnp.float32)), np.asarray(variables["params"]["scale"], np.float32),
        np.asarray(variables["params"]["bias"], np.float32), None, -1, 1e-5, 0.0, np.zeros(channels),
        np.ones(channels), (np.asarray(dy.astype(jnp.float32)).reshape(rows.shape), np.zeros(channels),
                            np.zeros(channels)))
    u = HALF_U[x_name]
    label = f"{x_name} param_dtype={jnp.dtype(param_dtype).name} shape={x.shape} axis_name={axis_name}"
    return {"y": assert_close(f"{label} y", np.asarray(y, np.float32).reshape(rows.shape), ry, 6 * u),
            "dx": assert_close(f"{label} dx", np.asarray(dx, np.float32).reshape(rows.shape), rdx, 6 * u),
            "mean": assert_close(f"{label} mean", mean, rmean, 2 * u),
            "var": assert_close(f"{label} var", var, rvar, 2 * u)}


@check("x32")
def half_statistics_accumulate_in_float32():
    """force_float32_reductions=False with float16 and bfloat16 inputs (float32 or
    half-precision parameters): the statistics keep Flax's half dtype but their sums and
    counts accumulate in float32, so nothing overflows float16's 65504 — sum((x - m)**2)
    of 256 elements of std 30 per device under pmap, the count of 70000 elements per
    group in a global call (the forward's and the backward's) — and y, dx and the
    statistics match the float64 oracle within the half precision's rounding."""
    import jax.numpy as jnp

    rng = np.random.default_rng(41)
    info = {}
    for x_name in ("float16", "bfloat16"):
        for param_dtype in (jnp.float32, jnp.dtype(x_name)):
            wide = jnp.asarray(rng.normal(0.5, 30.0, (DEVICES, 256, 4)), x_name)
            long = jnp.asarray(rng.normal(0.5, 1.0, (DEVICES * 70000, 2)), x_name)
            for x, axis_name in ((wide, AXIS), (long, None)):
                errs = half_case(x_name, param_dtype, x, axis_name)
                info[f"{x_name} {jnp.dtype(param_dtype).name} {x.shape}"] = worst(errs.values())
    return info


def wide_input_case(narrow, wide, seed, rows=16 * DEVICES, channels=3):
    """An input of dtype ``wide`` whose values rounded to ``narrow`` have exactly
    representable statistics: per channel, ``300 + k * u`` with ``u`` the spacing of
    ``narrow`` at 300 and ``k`` a permutation of -2, -1, 1, 2 repeated (mean 300, biased
    variance ``2.5 u**2``, both exact in ``narrow``), plus an offset of at most 0.4 u that
    rounding to ``narrow`` removes. Returns ``(x, x rounded)`` as float64 numpy."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    u = 2.0 ** (8 - jnp.finfo(narrow).nmant)  # 300 is in [2**8, 2**9)
    k = np.stack([rng.permutation(np.tile([-2.0, -1.0, 1.0, 2.0], rows // 4)) for _ in range(channels)], axis=1)
    rounded = 300.0 + k * u
    x = np.asarray(jnp.asarray(rounded + rng.uniform(-0.4, 0.4, k.shape) * u, wide), np.float64)
    assert np.array_equal(np.asarray(jnp.asarray(x, narrow), np.float64), rounded)  # what the statistics see
    return x, rounded


def wide_input_oracle(x, rounded, scale, bias, dy, d_mean, d_var):
    """Flax's definition in float64 (epsilon 0, momentum 0): statistics of the rounded
    values (their derivative that of the input), the input as given normalized."""
    import jax

    with jax.enable_x64(True):
        def f(x, scale, bias, rounded):
            seen = x + jax.lax.stop_gradient(rounded - x)
            mean = seen.mean(0)
            var = ((seen - mean) ** 2).mean(0)
            return (x - mean) * jax.lax.rsqrt(var) * scale + bias, mean, var

        @jax.jit  # one program, not one per operation
        def run(args, rounded, cotangents):
            out, pullback = jax.vjp(lambda *a: f(*a, rounded), *args)
            return out, pullback(cotangents)

        f64 = lambda a: jax.numpy.asarray(np.asarray(a, np.float64))
        out, grads = run([f64(a) for a in (x, scale, bias)], f64(rounded), tuple(f64(c) for c in (dy, d_mean, d_var)))
        return [np.asarray(o) for o in out], [np.asarray(g) for g in grads]


@check("x32", "x64")
def input_wider_than_statistics_follows_flax():
    """Statistics in a narrower dtype than the input (x32: a float32 input with dtype
    float16 or bfloat16 and force_float32_reductions=False; x64: a float64 input with
    dtype=float32): Flax takes the statistics of the input rounded to that dtype and
    normalizes the input as given. Far from zero (mean 300, std about 1.6 spacings of
    the narrow dtype there) rounding the input first moves each output by up to 0.4
    spacings over the std, 0.25 std. On one device and under pmap over 2 devices, y,
    the batch statistics and the gradients of x, scale and bias (with cotangents on the
    running statistics too) match the float64 oracle of that definition, and y Flax's
    layer (x32). Bounds: y carries the rounding of rsqrt(var) to the narrow dtype and its own
    rounding to it, under 2**-nmant of |y| (TOL of the narrow dtype); the statistics are
    exact; the backward runs in float32 (at least), so TOL["float32"]."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    import syncbn.flax as sf

    pairs = ((jnp.float64, jnp.float32),) if x64_on() else ((jnp.float32, jnp.float16), (jnp.float32, jnp.bfloat16))
    rng = np.random.default_rng(61)
    info = {}
    for wide, narrow in pairs:
        name = jnp.dtype(narrow).name
        x_np, rounded = wide_input_case(narrow, wide, 62)
        kw = dict(dtype=narrow, momentum=0.0, epsilon=0.0, use_running_average=False)
        if not x64_on():
            kw["force_float32_reductions"] = False
        x = jnp.asarray(x_np, wide)
        channels = x.shape[-1]
        params = {"scale": jnp.asarray(rng.uniform(0.5, 2.0, channels), jnp.float32),
                  "bias": jnp.asarray(rng.uniform(-1.0, 1.0, channels), jnp.float32)}
        stats = {"mean": jnp.zeros(channels, jnp.float32), "var": jnp.ones(channels, jnp.float32)}
        dy = jnp.asarray(rng.standard_normal(x.shape), narrow)
        # cotangents of the running statistics, values of the narrow dtype: the batch
        # statistics are of that dtype, so theirs arrive rounded to it (in Flax's too)
        d_mean = jnp.asarray(rng.standard_normal(channels), narrow).astype(jnp.float32)
        d_var = jnp.asarray(rng.standard_normal(channels) * 1e-3 / (2.0 ** (8 - jnp.finfo(narrow).nmant)),
                            narrow).astype(jnp.float32)
        (ry, rmean, rvar), (rdx, rdscale, rdbias) = wide_input_oracle(x_np, rounded, params["scale"], params["bias"],
                                                                       dy, d_mean, d_var)

        def layer_fn(model):
            def step(x, params):
                y, upd = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
                return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]
            return step

        ours = layer_fn(sf.BatchNorm(**kw))
        halves = x.reshape(DEVICES, -1, channels)
        synced = jax.pmap(layer_fn(sf.BatchNorm(axis_name=AXIS, **kw)), axis_name=AXIS, in_axes=(0, None),
                          devices=jax.devices()[:DEVICES])
        cotangents = (dy, d_mean, d_var)
        runs = {"one device": (ours, x, cotangents),
                "pmap": (synced, halves, (dy.reshape(halves.shape), *(jnp.stack([c] * DEVICES) / DEVICES
                                                                       for c in (d_mean, d_var))))}
        for where, (fn, xin, cts) in runs.items():
            (y, mean, var), pullback = jax.vjp(fn, xin, params)
            dx, dparams = pullback(cts)
            label = f"{name} statistics of a {jnp.dtype(wide).name} input, {where}"
            assert y.dtype == jnp.dtype(narrow) and dx.dtype == jnp.dtype(wide), (label, y.dtype, dx.dtype)
            mean, var = (mean[0], var[0]) if where == "pmap" else (mean, var)
            info[f"{label} y"] = assert_close(f"{label} y", np.asarray(y, np.float64).reshape(x.shape), ry,
                                              tol_for(narrow))
            assert_close(f"{label} mean", mean, rmean, TOL["float32"])
            assert_close(f"{label} var", var, rvar, TOL["float32"])
            info[f"{label} dx"] = assert_close(f"{label} dx", np.asarray(dx).reshape(x.shape), rdx, TOL["float32"])
            assert_close(f"{label} dscale", dparams["scale"], rdscale, TOL["float32"])
            assert_close(f"{label} dbias", dparams["bias"], rdbias, TOL["float32"])
        if not x64_on():
            # Flax's own layer (its float16 / bfloat16 means of these values are exact: jnp.mean
            # sums them in float32; its float32 mean of the x64 case sums 32 values near 300
            # in float32, which loses the spacing of the values: only the oracle there)
            want_y = layer_fn(nn.BatchNorm(use_fast_variance=False, **kw))(x, params)[0]
            info[f"{name} y vs Flax"] = assert_close(f"{name} y vs Flax", np.asarray(ours(x, params)[0], np.float64),
                                                     np.asarray(want_y, np.float64), tol_for(narrow))
    return info


@check("x32")
def axis_forms_follow_flax():
    """``axis`` as Flax's layers take it: one axis (an int or a NumPy integer) or any
    iterable of axes (tuple, list, range, NumPy array, negative entries too). For each,
    syncbn.flax.BatchNorm has flax.linen.BatchNorm's variables (shapes, values) and gives
    its output and updated statistics (its two-pass mode, float32 rounding: TOL), and
    syncbn.flax.nnx.BatchNorm gives flax.nnx.BatchNorm's (Flax's nnx layer trains on one
    feature axis: the iterables there name one)."""
    import jax
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    x = sample("float32", (5, 2, 3), 71)
    info = {}
    forms = (np.int64(1), [1, 2], range(1, 3), np.array([2, 1]), (-1, 1), range(-1, 0))
    for axis in forms:
        label = f"linen axis={axis!r}"
        theirs, ours = nn.BatchNorm(axis=axis, use_fast_variance=False, momentum=MOMENTUM), sf.BatchNorm(
            axis=axis, momentum=MOMENTUM)
        v = theirs.init(jax.random.PRNGKey(0), x, use_running_average=False)
        v_ours = ours.init(jax.random.PRNGKey(0), x, use_running_average=False)
        assert jax.tree.map(np.shape, v_ours) == jax.tree.map(np.shape, v), (label, jax.tree.map(np.shape, v_ours))
        v = redraw(v, 72)
        got = ours.apply(v, x, use_running_average=False, mutable=["batch_stats"])
        want = theirs.apply(v, x, use_running_average=False, mutable=["batch_stats"])
        info[label] = assert_close(f"{label} y", got[0], want[0], TOL["float32"])
        for k in ("mean", "var"):
            assert_close(f"{label} {k}", got[1]["batch_stats"][k], want[1]["batch_stats"][k], TOL["float32"])
        assert_close(f"{label} eval", ours.apply(v, x, use_running_average=True),
                     theirs.apply(v, x, use_running_average=True), TOL["float32"])
    for axis, features in ((np.int64(1), 2), ([2], 3), (range(1, 2), 2), (np.array([-1]), 3)):
        label = f"nnx axis={axis!r}"
        theirs = nnx.BatchNorm(features, axis=axis, use_fast_variance=False, momentum=MOMENTUM, rngs=nnx.Rngs(0))
        ours = snnx.BatchNorm(features, axis=axis, momentum=MOMENTUM, rngs=nnx.Rngs(0))
        state = redraw(nnx.state(theirs, nnx.Variable), 73)  # (a NumPy axis is an array attribute too)
        nnx.update(theirs, state)
        nnx.update(ours, state)
        info[label] = assert_close(f"{label} y", ours(x), theirs(x), TOL["float32"])
        for k in ("mean", "var"):
            assert_close(f"{label} {k}", getattr(ours, k)[...], getattr(theirs, k)[...], TOL["float32"])
        assert_close(f"{label} eval", ours(x, use_running_average=True), theirs(x, use_running_average=True),
                     TOL["float32"])
    return info


def same_non_finite(label, got, want, tol):
    """NaN, +inf and -inf at the same places, the finite values within ``tol``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (label, got.shape, want.shape)
    for kind in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(kind(got), kind(want)), (label, kind.__name__, got, want)
    finite = np.isfinite(want)
    return assert_close(label, got[finite], want[finite], tol) if finite.any() else 0.0


@check("x32")
def non_finite_inputs_follow_flax():
    """Non-finite elements give the statistics Flax's layer gives (its default, one-pass
    mode; its two-pass mode gives the same means): per channel, +inf among finite values
    gives mean +inf and variance NaN, -inf mean -inf, both infinities or a NaN a NaN mean,
    float32 values whose sum overflows (3e38 each) mean +inf, a NaN excluded by the mask
    nothing; the output is NaN exactly where Flax's is and equal elsewhere. Linen and nnx
    on one device, and linen under pmap over 2 devices (without the mask; the infinities
    on one device)."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    inf, nan = np.inf, np.nan
    # channels: finite, +inf, -inf, both, NaN, overflowing sum, NaN masked out
    x = np.array([[1.0, 1.0, 1.0, inf, 1.0, 3e38, nan],
                  [2.0, inf, 2.0, 2.0, nan, 3e38, 5.0],
                  [4.0, 3.0, -inf, -inf, 2.0, 3e38, 6.0],
                  [3.0, 2.0, 3.0, 1.0, 3.0, 3e38, 9.0]], np.float32)
    mask = np.ones(x.shape, bool)
    mask[0, 6] = False
    x, mask = jnp.asarray(x), jnp.asarray(mask)
    channels = x.shape[1]
    info = {}
    v = nn.BatchNorm().init(jax.random.PRNGKey(0), x, use_running_average=False)
    v = redraw(v, 81)
    for fast in (True, False):
        got = sf.BatchNorm(momentum=MOMENTUM).apply(v, x, use_running_average=False, mask=mask,
                                                    mutable=["batch_stats"])
        want = nn.BatchNorm(momentum=MOMENTUM, use_fast_variance=fast).apply(
            v, x, use_running_average=False, mask=mask, mutable=["batch_stats"])
        keys = ("mean", "var") if fast else ("mean",)  # two-pass: inf for the overflowing sum's variance
        for k in keys:
            info[f"linen {k} fast={fast}"] = same_non_finite(
                f"linen {k} fast={fast}", got[1]["batch_stats"][k], want[1]["batch_stats"][k], TOL["float32"])
        if fast:
            info["linen y"] = same_non_finite("linen y", got[0], want[0], TOL["float32"])
    ours, theirs = snnx.BatchNorm(channels, momentum=MOMENTUM, rngs=nnx.Rngs(0)), nnx.BatchNorm(
        channels, momentum=MOMENTUM, rngs=nnx.Rngs(0))
    info["nnx y"] = same_non_finite("nnx y", ours(x, mask=mask), theirs(x, mask=mask), TOL["float32"])
    for k in ("mean", "var"):
        info[f"nnx {k}"] = same_non_finite(f"nnx {k}", getattr(ours, k)[...], getattr(theirs, k)[...], TOL["float32"])

    def pmapped(model):  # no mask: with uneven counts Flax's pmean of the devices' means is not the mean
        def replica(x):
            y, upd = model.apply(v, x, mutable=["batch_stats"])
            return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

        return jax.pmap(replica, axis_name=AXIS, devices=jax.devices()[:DEVICES])(x.reshape(DEVICES, -1, channels))

    kw = dict(use_running_average=False, axis_name=AXIS, momentum=MOMENTUM)
    got, want = pmapped(sf.BatchNorm(**kw)), pmapped(nn.BatchNorm(**kw))
    for name, a, b in zip(("y", "mean", "var"), got, want):
        info[f"pmap {name}"] = same_non_finite(f"pmap {name}", a, b, TOL["float32"])
    return info


@check("x32")
def complex_input_real_statistics_follows_flax():
    """A complex64 input with a real ``dtype`` (float32, bfloat16): Flax takes real
    statistics of its real part, normalizes the complex input and casts the output to the
    real dtype. With complex64 parameters the imaginary part of the input reaches the
    output (Re((x - mean) * rsqrt(var + eps) * scale)), and the real statistics pass a real
    cotangent back. Output, running statistics and the gradients of x, scale and bias (a
    real output cotangent and cotangents on the running statistics) equal Flax's two-pass
    layer's on one device and under pmap over 2 devices (Flax's pmean of the devices'
    means is the mean here: equal counts), for real and complex parameters. Bounds: TOL of
    the output's dtype for y, float32 rounding (TOL) for the rest."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    import syncbn.flax as sf

    info = {}
    x = sample("complex64", (4 * DEVICES, 3), 91)
    rng = np.random.default_rng(92)
    for dtype, param_dtype in ((jnp.float32, jnp.complex64), (jnp.bfloat16, jnp.complex64), (jnp.float32, jnp.float32)):
        kw = dict(dtype=dtype, param_dtype=param_dtype, momentum=MOMENTUM, use_running_average=False)
        v = redraw(nn.BatchNorm(**kw).init(jax.random.PRNGKey(0), x), 93)
        y_dtype = jnp.dtype(dtype)
        dy = jnp.asarray(rng.standard_normal(x.shape), y_dtype)
        d_stats = {k: jnp.asarray(rng.standard_normal(3), jnp.float32) for k in ("mean", "var")}

        def grads(model, axis_name=None):
            def step(x, params):
                y, upd = model.apply({**v, "params": params}, x, mutable=["batch_stats"])
                return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

            if axis_name is None:
                @jax.jit
                def run(x, params, cts):
                    out, pullback = jax.vjp(step, x, params)
                    return out, pullback(cts)
                return run(x, v["params"], (dy, d_stats["mean"], d_stats["var"]))
            halves = x.reshape(DEVICES, -1, 3)
            mapped = jax.pmap(step, axis_name=AXIS, in_axes=(0, None), devices=jax.devices()[:DEVICES])
            (y, mean, var), pullback = jax.vjp(mapped, halves, v["params"])
            cts = (dy.reshape(halves.shape), *(jnp.stack([d_stats[k]] * DEVICES) / DEVICES for k in ("mean", "var")))
            dx, dparams = pullback(cts)
            return (y.reshape(x.shape), mean[0], var[0]), (dx.reshape(x.shape), dparams)

        label = f"dtype={y_dtype.name} param_dtype={jnp.dtype(param_dtype).name}"
        for where, axis_name in (("one device", None), ("pmap", AXIS)):
            got = grads(sf.BatchNorm(axis_name=axis_name, **kw), axis_name)
            want = grads(nn.BatchNorm(axis_name=axis_name, use_fast_variance=False, **kw), axis_name)
            (y, mean, var), (dx, dparams) = got
            (wy, wmean, wvar), (wdx, wparams) = want
            assert y.dtype == wy.dtype == y_dtype and dx.dtype == wdx.dtype == x.dtype, (label, y.dtype, dx.dtype)
            info[f"{label} {where} y"] = assert_close(f"{label} {where} y", y, wy, tol_for(y_dtype))
            assert_close(f"{label} {where} mean", mean, wmean, TOL["float32"])
            assert_close(f"{label} {where} var", var, wvar, TOL["float32"])
            info[f"{label} {where} dx"] = assert_close(f"{label} {where} dx", dx, wdx, TOL["float32"])
            for k in ("scale", "bias"):
                assert_close(f"{label} {where} d{k}", dparams[k], wparams[k], TOL["float32"])
    return info


@check("x32")
def empty_batch_follows_flax():
    """A batch with an axis of size 0 (no element at all), linen and nnx: an empty output
    of Flax's shape and dtype, NaN batch statistics as Flax's (the mean of nothing), and
    parameter gradients 0, the exact gradient of outputs that do not exist (docs/flax.md:
    Flax's scale gradient is NaN there, its empty sum times a NaN rsqrt(var + eps))."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    info = {}
    for shape in ((0, 3), (4, 0, 3)):
        x = jnp.zeros(shape, jnp.float32)
        v = nn.BatchNorm().init(jax.random.PRNGKey(0), x, use_running_average=False)

        def loss(model):
            def f(x, params):
                y, upd = model.apply({**v, "params": params}, x, use_running_average=False, mutable=["batch_stats"])
                return jnp.sum(y), (y, upd["batch_stats"])
            return jax.grad(f, argnums=(0, 1), has_aux=True)(x, v["params"])

        (dx, dparams), (y, stats) = loss(sf.BatchNorm(momentum=MOMENTUM))
        _, (want_y, want_stats) = loss(nn.BatchNorm(momentum=MOMENTUM))
        assert y.shape == want_y.shape == shape and y.dtype == want_y.dtype, (shape, y.shape, y.dtype)
        assert dx.shape == shape, dx.shape
        for k in ("mean", "var"):
            assert np.isnan(np.asarray(stats[k])).all() and np.isnan(np.asarray(want_stats[k])).all(), (k, stats)
        for k in ("scale", "bias"):
            assert np.array_equal(np.asarray(dparams[k]), np.zeros(3)), (k, dparams[k])
        ours = snnx.BatchNorm(3, momentum=MOMENTUM, rngs=nnx.Rngs(0))
        theirs = nnx.BatchNorm(3, momentum=MOMENTUM, rngs=nnx.Rngs(0))
        y_nnx, want_nnx = ours(x), theirs(x)
        assert y_nnx.shape == want_nnx.shape == shape and y_nnx.dtype == want_nnx.dtype, y_nnx.shape
        for k in ("mean", "var"):
            assert np.isnan(np.asarray(getattr(ours, k)[...])).all(), (k, getattr(ours, k)[...])
            assert np.isnan(np.asarray(getattr(theirs, k)[...])).all()
        info[str(shape)] = "empty output, NaN statistics, zero parameter gradients"
    return info


# ----------------------------------------------------------------------------- Flax's tests


@check("x32")
def nnx_and_linen_layers_agree():
    """As Flax checks its nnx layer against its linen one: syncbn.flax.nnx.BatchNorm
    (with an identity promote_dtype, as linen has none) and syncbn.flax.BatchNorm, each
    followed by a dense layer with the same weights, give bitwise equal outputs, and
    equal parameters and updated running statistics, for dtype and param_dtype float32
    or float16, use_fast_variance on and off, without a mask, with a mask over rows, and
    with Flax's mask over features (the excluded channels have no element: NaN there
    and only there, as Flax gives, in both layers)."""
    import itertools
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    x = sample("float32", (10, 5), 11)
    row_mask = np.random.default_rng(12).random((10, 1)) < 0.6
    row_mask[:2] = True
    # Flax's mask over features: the excluded channels have no element (NaN statistics)
    feature_mask = np.array([True, False, True, False, True])
    count = 0
    for dtype, param_dtype, fast, mask in itertools.product((jnp.float32, jnp.float16), (jnp.float32, jnp.float16),
                                                            (True, False), (None, row_mask, feature_mask)):
        class Linen(nn.Module):
            @nn.compact
            def __call__(self, x, mask=None):
                h = sf.BatchNorm(use_running_average=False, dtype=dtype, param_dtype=param_dtype,
                                 use_fast_variance=fast, name="norm")(x, mask=mask)
                return h, nn.Dense(4, dtype=dtype, param_dtype=param_dtype, name="dense")(h)

        class Nnx(nnx.Module):
            def __init__(self, rngs):
                self.norm = snnx.BatchNorm(5, use_running_average=False, dtype=dtype, param_dtype=param_dtype,
                                           use_fast_variance=fast, promote_dtype=lambda args, **kw: args, rngs=rngs)
                self.dense = nnx.Linear(5, 4, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

            def __call__(self, x, mask=None):
                h = self.norm(x, mask=mask)
                return h, self.dense(h)

        linen = Linen()
        variables = linen.init(jax.random.PRNGKey(1), x)
        (h_linen, y_linen), upd = linen.apply(variables, x, mask=mask, mutable=["batch_stats"])
        model = Nnx(nnx.Rngs(0))
        model.dense.kernel[...] = variables["params"]["dense"]["kernel"]
        model.dense.bias[...] = variables["params"]["dense"]["bias"]
        h_nnx, y_nnx = model(x, mask=mask)
        label = (dtype.__name__, param_dtype.__name__, fast, None if mask is None else mask.shape)
        # NaN only where a channel has no element, in both; elsewhere finite and equal
        empty = ~feature_mask if mask is feature_mask else np.zeros(5, bool)
        for h in (h_linen, h_nnx):
            assert np.array_equal(np.isnan(np.asarray(h)).any(0), empty), (label, h)
            assert np.isfinite(np.asarray(h)[:, ~empty]).all(), label
        assert h_linen.dtype == h_nnx.dtype and y_linen.dtype == y_nnx.dtype, label
        assert np.array_equal(np.asarray(h_linen), np.asarray(h_nnx), equal_nan=True), label
        assert np.array_equal(np.asarray(y_linen), np.asarray(y_nnx), equal_nan=True), label
        for k in ("scale", "bias"):
            assert np.array_equal(np.asarray(variables["params"]["norm"][k]), np.asarray(getattr(model.norm, k)[...]))
        for k in ("mean", "var"):
            assert np.array_equal(np.asarray(upd["batch_stats"]["norm"][k]), np.asarray(getattr(model.norm, k)[...]),
                                  equal_nan=True), (label, k)
        count += 1
    return {"settings": count}


@check("x32")
def flax_transforms_and_tools():
    """What Flax's transform, module and tooling tests do with a BatchNorm, with ours:
    linen nn.vmap with axis_name over 5 groups equals one call on the 20 rows; an nnx
    ensemble built under nnx.vmap (running statistics per member, parameters shared)
    runs under nnx.vmap; an nnx.scan over stacked layers runs a 1-row batch (variance 0,
    output the bias); an nnx.jit training step with an optax optimizer updates the
    parameters and the running statistics; nnx.view / set_attributes switch
    use_running_average; a spectral-normalized Sequential holding a BatchNorm gives the
    same output in linen and nnx; the tabulated summaries name the layer BatchNorm; the
    variables round-trip through flax.serialization; the nnx graph does not depend on
    the initializers, and Variable metadata is kept."""
    import jax
    import jax.numpy as jnp
    import optax
    import flax.linen as nn
    from flax import nnx, serialization
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    info = {}
    # linen vmap with an axis name: 5 groups of 4 rows synchronized = 20 rows at once
    class MlpBn(nn.Module):
        axis_name: str = None

        @nn.compact
        def __call__(self, x):
            return sf.BatchNorm(axis_name=self.axis_name, use_running_average=False)(nn.Dense(3)(x))

    x = sample("float32", (5, 4, 2), 12)
    flat = MlpBn()
    variables = jax.jit(flat.init)(jax.random.PRNGKey(0), x[0])  # jitted: one program, not one per operation
    grouped = nn.vmap(MlpBn, in_axes=(0,), variable_axes={"params": None, "batch_stats": None},
                      split_rngs={"params": False}, axis_name="batch")(axis_name="batch")
    y1 = jax.jit(lambda v, x: flat.apply(v, x, mutable=["batch_stats"])[0])(variables, x.reshape(20, 2)).reshape(5, 4, 3)
    y2 = jax.jit(lambda v, x: grouped.apply(v, x, mutable=["batch_stats"])[0])(variables, x)
    info["vmap axis_name"] = assert_close("vmap", y2, y1, 1e-5)

    # nnx ensemble: BatchStat per member (axis 0), everything else shared
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 3, rngs=rngs)
            self.bn = snnx.BatchNorm(3, use_running_average=False, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.bn(self.linear(x)))

    ensemble = nnx.vmap(lambda key: Block(nnx.Rngs(key)), in_axes=0, out_axes=0)(jax.random.split(jax.random.key(0), 5))
    assert ensemble.bn.mean.shape == (5, 3) and ensemble.linear.kernel.shape == (5, 2, 3), ensemble.bn.mean.shape
    y = nnx.vmap(lambda m, x: m(x), in_axes=(0, None), out_axes=0)(ensemble, sample("float32", (4, 2), 13))
    assert y.shape == (5, 4, 3) and np.isfinite(np.asarray(y)).all(), y.shape
    means = np.asarray(ensemble.bn.mean[...])
    assert not np.allclose(means[0], means[1]), means  # each member's own statistics

    # nnx.scan over 3 stacked layers, one row: variance 0, so every layer outputs its bias
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.bn = snnx.BatchNorm(3, use_running_average=False, bias_init=nnx.initializers.constant(0.5),
                                     rngs=rngs)

        def __call__(self, x):
            return self.bn(x)

    stack = nnx.vmap(lambda key: Layer(nnx.Rngs(key)), in_axes=0, out_axes=0)(jax.random.split(jax.random.key(1), 3))

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
    def through(layer, x):
        return layer(x), None

    out, _ = through(stack, jnp.ones((1, 3)) * 2)
    assert np.array_equal(np.asarray(out), np.full((1, 3), 0.5, np.float32)), out
    # each layer's own running mean moved toward its one row (2, then 0.5, 0.5)
    assert_close("scan means", stack.bn.mean[...], 0.01 * np.array([[2.0], [0.5], [0.5]]) * np.ones(3), 1e-6)

    # a jitted training step with an optimizer
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(2, 4, rngs=rngs)
            self.bn = snnx.BatchNorm(4, use_running_average=False, rngs=rngs)
            self.out = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.bn(self.linear(x))))

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, target = sample("float32", (8, 2), 14), sample("float32", (8, 1), 15)

    @nnx.jit
    def train_step(model, optimizer, x, target):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    scale, mean = np.asarray(model.bn.scale[...]), np.asarray(model.bn.mean[...])
    losses = [float(train_step(model, optimizer, x, target)) for _ in range(3)]
    assert np.all(np.isfinite(losses)), losses
    assert not np.array_equal(np.asarray(model.bn.scale[...]), scale)
    assert not np.array_equal(np.asarray(model.bn.mean[...]), mean)

    # switching modes on a model
    model.set_attributes(use_running_average=True)
    assert model.bn.use_running_average is True
    view = nnx.view(model, use_running_average=False)
    assert view.bn.use_running_average is False and view.bn.scale is model.bn.scale
    frozen = np.asarray(model.bn.mean[...])
    model(x)
    assert np.array_equal(np.asarray(model.bn.mean[...]), frozen)  # eval: statistics unchanged

    # spectral norm over a Sequential holding a BatchNorm: linen and nnx agree
    class Spectral(nn.Module):
        def setup(self):
            self.seq = nn.Sequential([nn.Dense(4), nn.relu, sf.BatchNorm(use_running_average=False)])
            self.norm = nn.SpectralNorm(self.seq)

        def __call__(self, x):
            return self.norm(x, update_stats=True)

    x = sample("float32", (10, 5), 16)
    v = jax.jit(Spectral().init)(jax.random.PRNGKey(1), x)
    y_linen, _ = jax.jit(lambda v, x: Spectral().apply(v, x, mutable=["batch_stats"]))(v, x)
    seq = nnx.Sequential(nnx.Linear(5, 4, rngs=nnx.Rngs(0)), nnx.relu,
                         snnx.BatchNorm(4, use_running_average=False, rngs=nnx.Rngs(0)))
    seq.layers[0].kernel[...] = v["params"]["seq"]["layers_0"]["kernel"]
    seq.layers[0].bias[...] = v["params"]["seq"]["layers_0"]["bias"]
    spectral = nnx.SpectralNorm(seq, update_stats=True, rngs=nnx.Rngs(0))
    for name in ("u", "sigma"):
        stat = v["batch_stats"]["norm"][f"seq/layers_0/kernel/{name}"]
        spectral.batch_stats[("layers", 0, "kernel", name)].set_value(stat)
    info["spectral norm"] = assert_close("spectral", spectral(x), y_linen, 1e-6)

    # summaries and serialization
    class Conv(nn.Module):
        @nn.compact
        def __call__(self, x):
            return sf.BatchNorm(use_running_average=True)(nn.Dense(3)(x))

    table = Conv().tabulate(jax.random.PRNGKey(0), jnp.ones((2, 3)), console_kwargs={"width": 240})
    assert "BatchNorm_0" in table, table[-2000:]
    assert "BatchNorm" in str(nnx.tabulate(Model(nnx.Rngs(0)), jnp.ones((2, 2))))
    variables = Conv().init(jax.random.PRNGKey(0), jnp.ones((2, 3)))
    restored = serialization.from_bytes(variables, serialization.to_bytes(variables))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), restored, variables))

    # the nnx graph does not depend on initializers; metadata stays on the Variables
    make = lambda init: snnx.BatchNorm(3, scale_init=init, bias_init=init, rngs=nnx.Rngs(0))
    assert nnx.graphdef(make(nnx.initializers.zeros)) == nnx.graphdef(make(nnx.initializers.ones))
    layer = snnx.BatchNorm(3, scale_metadata={"tag": "s"}, bias_metadata={"tag": "b"}, rngs=nnx.Rngs(0))
    assert layer.scale.get_metadata().get("tag") == "s", layer.scale.get_metadata()
    assert layer.bias.get_metadata().get("tag") == "b", layer.bias.get_metadata()
    return info


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--x64", action="store_true")
    parser.add_argument("--checks", nargs="+")
    args = parser.parse_args(argv)
    setup(args.x64)
    checks = X64_CHECKS if args.x64 else CHECKS
    assert x64_on() == args.x64
    results = run_checks(checks, args.checks or list(checks), args.out)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
