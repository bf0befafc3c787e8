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
import functools
import os
import sys

import numpy as np

from keras_harness import block_torch, registry, run_checks
from flax_oracle import assert_close, reference_vjp
from nan_safe import worst

DEVICES = 4
AXIS = "d"
EPS = 1e-5
MOMENTUM = 0.9
CHECKS, check = registry()
# Scaled-error bounds, from the arithmetic: float32 statistics and normalization carry a
# few hundred float32 roundings at most (2**-24 each, ~6e-8) on values of order 1-10,
# so 2e-5 leaves a margin of >10x; bfloat16 results (dx in the input's dtype) are
# rounded to 8 bits (2**-9 ~ 2e-3 relative), so 1e-2.
TOL = {"float32": 2e-5, "bfloat16": 1e-2}


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


# ----------------------------------------------------------------------------- shard_map / jit


def mesh_1d(auto=False):
    """The 4 devices on one mesh axis: explicit sharding (``jax.make_mesh``'s default),
    or automatic (XLA's sharding propagation decides where values live)."""
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((DEVICES,), (AXIS,), axis_types=(AxisType.Auto if auto else AxisType.Explicit,))


def global_step(model, case, mesh, spec, wrap_shard_map, backward=True, mask_spec=None, stat_spec=None):
    """One training call on the global batch (``W*B`` leading), batch sharded over the
    mesh axis, parameters and statistics replicated; under ``shard_map`` when
    ``wrap_shard_map`` else plain ``jit`` (XLA makes the reductions global). Returns the
    results and the compiled HLO text; with ``backward=False`` only the forward is
    compiled and run (results None). ``x`` and ``dy`` take ``spec``, the mask
    ``mask_spec`` (default ``spec``), the running statistics' cotangents ``stat_spec``
    (default: none given; a cotangent must have its output's explicit sharding)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    variables = flax_variables(case)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    x = put(jnp.asarray(concat(case["x"]), case["dtype"]), spec)
    mask = None if case["mask"] is None else put(jnp.asarray(concat(case["mask"])), mask_spec or spec)
    params = jax.tree.map(lambda a: put(jnp.asarray(a), P()), variables["params"])
    stats = jax.tree.map(lambda a: put(jnp.asarray(a), P()), variables["batch_stats"])

    def body(x, params, stats, mask):
        y, upd = model.apply({"params": params, "batch_stats": stats}, x, mask=mask, mutable=["batch_stats"])
        return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

    fn = body
    if wrap_shard_map:
        fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), P(), spec if mask is not None else P()),
                           out_specs=(spec, P(), P()))

    def run(x, params, mask, dy, dm, dv):
        out, pullback = jax.vjp(lambda x, p: fn(x, p, stats, mask), x, params)
        return out, pullback((dy, dm, dv))

    if not backward:
        compiled = jax.jit(lambda x, params, mask: fn(x, params, stats, mask)).lower(x, params, mask).compile()
        compiled(x, params, mask)
        return None, compiled.as_text()
    dy = put(jnp.asarray(concat(case["dy"])), spec)
    d_stats = [jnp.asarray(case[k][0]) for k in ("d_mean", "d_var")]
    if stat_spec is not None:
        d_stats = [put(d, stat_spec) for d in d_stats]
    args = (x, params, mask, dy, *d_stats)
    compiled = jax.jit(run).lower(*args).compile()
    (y, mean, var), (dx, dparams) = compiled(*args)
    assert len(x.sharding.device_set) == mesh.size, x.sharding
    got = dict(y=np.asarray(y, np.float64), mean=np.asarray(mean), var=np.asarray(var),
               dx=np.asarray(dx, np.float64), dscale=np.asarray(dparams["scale"]), dbias=np.asarray(dparams["bias"]))
    return got, compiled.as_text()


# both layouts, both dtypes, with and without masks, in four compilations (pmap runs all eight)
GLOBAL_CASES = [("channels_last", "float32", True), ("channels_first", "float32", False),
                ("channels_last", "bfloat16", False), ("channels_first", "bfloat16", True)]


def global_cases(wrap_shard_map):
    from jax.sharding import PartitionSpec as P
    from syncbn.flax import BatchNorm

    info = {}
    mesh = mesh_1d()
    for i, (layout, dtype, masked) in enumerate(GLOBAL_CASES):
        case = make_case(100 + i, layout, dtype, masked)
        model = BatchNorm(use_running_average=False, axis=case["axis"], momentum=MOMENTUM, epsilon=EPS,
                          axis_name=AXIS if wrap_shard_map else None)
        got, _ = global_step(model, case, mesh, P(AXIS), wrap_shard_map)
        ref = oracle(case, case["d_mean"][0], case["d_var"][0])
        info[f"{layout}/{dtype}/{'masked' if masked else 'full'}"] = compare(got, ref, dtype, f"{layout} {dtype} {masked}")
    return info


@check
def shard_map_matches_oracle():
    """shard_map over a 4-device mesh, replicated parameters (their gradient is the
    total, from the same backward psum)."""
    return global_cases(True)


@check
def jit_sharded_matches_oracle():
    """jit with the batch sharded by NamedSharding and no axis_name: XLA's global
    reductions, same stable algorithm; also on an automatic-sharding mesh and over 3 of
    the 4 devices (3 groups where the device count alone would suggest 4)."""
    import jax
    from jax.sharding import PartitionSpec as P
    from syncbn.flax import BatchNorm

    info = global_cases(False)
    case = make_case(110, "channels_last", "float32", True)
    model = BatchNorm(use_running_average=False, axis=case["axis"], momentum=MOMENTUM, epsilon=EPS)
    ref = oracle(case, case["d_mean"][0], case["d_var"][0])
    for key, mesh in (("auto mesh", mesh_1d(auto=True)),
                      ("3 devices", jax.make_mesh((3,), (AXIS,), devices=jax.devices()[:3]))):
        got, _ = global_step(model, case, mesh, P(AXIS), False)
        info[key] = compare(got, ref, "float32", key)
    return info


@check
def jit_explicit_channel_sharding_matches_oracle():
    """jit on explicit-sharding meshes (jax.make_mesh's default) with the channel axis
    sharded: over the 4 devices with the batch replicated (channels at -1 and 1), and on a
    2 x 2 mesh with the batch on one axis and the channels on the other; with a mask that
    is replicated over the channels (its count is not sharded as the sums are) and
    without. Forward, running statistics and gradients equal the oracle (flax.linen's
    BatchNorm runs all of these; syncbn.flax raised ShardingTypeError stacking its
    payload). The compiled steps communicate as flax.linen.BatchNorm's do (measured with
    jax 0.10.2): nothing forward with the batch replicated, one all-reduce with it
    sharded; backward one all-reduce more with it sharded, and two all-gathers of the
    channel-sharded scale and bias gradients for the replicated parameters. nnx's layer
    (nnx.jit) on the 2 x 2 mesh, masked, too."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    from syncbn.flax import BatchNorm
    import syncbn.flax.nnx as snnx

    info = {}
    # the report's case: a 2-D batch, channels sharded, variables from init (forward and statistics)
    x = np.random.default_rng(119).normal(5, 2, (8, 4)).astype(np.float32)
    model = BatchNorm(use_running_average=False, momentum=MOMENTUM, epsilon=EPS)
    variables = model.init(jax.random.PRNGKey(0), jnp.asarray(x))
    with jax.set_mesh(mesh_1d()):
        y, upd = jax.jit(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))(
            variables, jax.device_put(jnp.asarray(x), P(None, AXIS)))
    ones, zeros = np.ones(4, np.float32), np.zeros(4, np.float32)
    (ref_y, ref_mean, ref_var), _ = reference_vjp(x, ones, zeros, None, -1, EPS, MOMENTUM, zeros, ones,
                                                  (np.zeros_like(x), zeros, zeros))
    info["2-D batch"] = {"y": assert_close("2-D y", y, ref_y, TOL["float32"]),
                         "mean": assert_close("2-D mean", upd["batch_stats"]["mean"], ref_mean, TOL["float32"]),
                         "var": assert_close("2-D var", upd["batch_stats"]["var"], ref_var, TOL["float32"])}
    mesh_2d = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    gathers = {"all-gather": 2}
    runs = [("channels sharded, batch replicated", "channels_last", mesh_1d(), P(None, None, AXIS), P(), P(AXIS),
             ({}, gathers)),
            ("channels sharded, batch replicated", "channels_first", mesh_1d(), P(None, AXIS), P(), P(AXIS),
             ({}, gathers)),
            ("2x2: batch and channels sharded", "channels_last", mesh_2d, P("data", None, "model"), P("data"),
             P("model"), ({"all-reduce": 1}, {"all-reduce": 2, **gathers}))]
    for i, (label, layout, mesh, spec, mask_spec, stat_spec, want) in enumerate(runs):
        for masked in (True, False):
            case = make_case(120 + 2 * i + masked, layout, "float32", masked)
            model = BatchNorm(use_running_average=False, axis=case["axis"], momentum=MOMENTUM, epsilon=EPS)
            with jax.set_mesh(mesh):  # as users of explicit sharding do (the types are the same without)
                got, both = global_step(model, case, mesh, spec, False, mask_spec=mask_spec, stat_spec=stat_spec)
                _, fwd = global_step(model, case, mesh, spec, False, backward=False, mask_spec=mask_spec)
            key = f"{label} {layout} {'masked' if masked else 'full'}"
            ref = oracle(case, case["d_mean"][0], case["d_var"][0])
            info[key] = compare(got, ref, "float32", key)
            counts = (collectives(fwd), collectives(both))
            assert counts == want, (key, counts, want)
            info[key]["collectives forward, forward+backward"] = counts

    case = make_case(130, "channels_last", "float32", True)
    layer = snnx.BatchNorm(4, momentum=MOMENTUM, epsilon=EPS, rngs=nnx.Rngs(0))
    for name, value in list(case["params"].items()) + list(case["stats"].items()):
        getattr(layer, name)[...] = jnp.asarray(value)
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh_2d, spec))
    x, dy = (put(concat(case[k]), P("data", None, "model")) for k in ("x", "dy"))
    mask = put(concat(case["mask"]), P("data"))

    @nnx.jit
    def step(layer, x, mask, dy):
        return nnx.grad(lambda layer, x: jnp.sum(layer(x, mask=mask) * dy), argnums=(0, 1))(layer, x)

    with jax.set_mesh(mesh_2d):
        grads, dx = step(layer, x, mask, dy)
    ref = oracle(case, np.zeros(4), np.zeros(4))
    info["nnx 2x2 masked"] = {
        "dx": assert_close("nnx dx", dx, ref["dx"], TOL["float32"]),
        "dscale": assert_close("nnx dscale", grads["scale"][...], ref["dscale"], TOL["float32"]),
        "dbias": assert_close("nnx dbias", grads["bias"][...], ref["dbias"], TOL["float32"]),
        "mean": assert_close("nnx mean", layer.mean[...], ref["mean"], TOL["float32"]),
        "var": assert_close("nnx var", layer.var[...], ref["var"], TOL["float32"])}
    return info


@check
def jit_explicit_sharded_parameters_matches_oracle():
    """jit on an explicit 2 x 2 mesh with the batch sharded over "data", the channels of x
    not sharded, and scale, bias and the running statistics sharded over "model" (as a
    model that shards its parameters over another mesh axis has them). flax.linen's
    BatchNorm runs this; syncbn.flax's backward raised custom_vjp's type error, because
    dx took the channel sharding of scale ("float32[12@data,5,4@model] corresponding to
    an input of type float32[12@data,5,4]"). Both layouts, with and without a mask; the
    gradients come from one scalar loss (outputs and running statistics against the
    case's cotangents), so no cotangent needs a sharding of its own."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from syncbn.flax import BatchNorm

    info = {}
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    put = lambda a, spec: None if a is None else jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
    for i, layout in enumerate(("channels_last", "channels_first")):
        for masked in (True, False):
            case = make_case(140 + 2 * i + masked, layout, "float32", masked)
            model = BatchNorm(use_running_average=False, axis=case["axis"], momentum=MOMENTUM, epsilon=EPS)
            variables = jax.tree.map(lambda a: put(a, P("model")), flax_variables(case))
            x, dy, mask = (put(concat(case[k]), P("data")) for k in ("x", "dy", "mask"))
            d_mean, d_var = (jnp.asarray(case[k][0]) for k in ("d_mean", "d_var"))

            def loss(params, x):
                y, upd = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mask=mask,
                                     mutable=["batch_stats"])
                stats = upd["batch_stats"]
                value = jnp.sum(y * dy) + jnp.sum(stats["mean"] * d_mean) + jnp.sum(stats["var"] * d_var)
                return value, (y, stats)

            with jax.set_mesh(mesh):
                (_, (y, stats)), (dparams, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
                    variables["params"], x)
            got = dict(y=y, mean=stats["mean"], var=stats["var"], dx=dx, dscale=dparams["scale"],
                       dbias=dparams["bias"])
            key = f"{layout} {'masked' if masked else 'full'}"
            info[key] = compare(got, oracle(case, case["d_mean"][0], case["d_var"][0]), "float32", key)
    return info


@check
def axis_empty_matches_oracle():
    """axis=() (statistics over every axis, one scalar scale and bias, as flax.linen.BatchNorm
    accepts): the variables Flax's layer has (shapes () ), its outputs and running
    statistics on one device, and the float64 oracle (forward, running statistics,
    gradients) under pmap with uneven masks and under jit with the batch sharded; nnx's
    layer (num_features=1) gives flax.nnx's. The payload had no feature axis to
    concatenate along (ValueError before)."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from syncbn.flax import BatchNorm
    import syncbn.flax.nnx as snnx

    rng = np.random.default_rng(140)
    x = (rng.standard_normal((DEVICES, 3, 5)) * 2 + np.array([3.0, -1.0, 7.0, 0.5])[:, None, None]).astype(np.float32)
    mask = rng.random(x.shape) < np.array([0.9, 0.1, 0.0, 0.5])[:, None, None]
    mask[0, 0, 0] = True
    scalar = lambda v: np.float32(v)
    case = dict(x=x, mask=mask, params={"scale": scalar(1.3), "bias": scalar(-0.4)},
                stats={"mean": scalar(0.2), "var": scalar(1.5)}, dy=rng.standard_normal(x.shape).astype(np.float32),
                d_mean=rng.standard_normal(DEVICES).astype(np.float32),
                d_var=rng.standard_normal(DEVICES).astype(np.float32), axis=(), dtype="float32")

    def oracle_all(case, d_mean, d_var):
        # batch norm over every axis is batch norm of the flattened batch as one channel
        flat = lambda a: None if a is None else concat(a).reshape(-1, 1)
        as1 = lambda v: np.reshape(v, (1,))
        (y, mean, var), (dx, dscale, dbias) = reference_vjp(
            flat(case["x"]), as1(case["params"]["scale"]), as1(case["params"]["bias"]), flat(case["mask"]), -1,
            EPS, MOMENTUM, as1(case["stats"]["mean"]), as1(case["stats"]["var"]),
            (flat(case["dy"]), as1(d_mean), as1(d_var)))
        shape = concat(case["x"]).shape
        return dict(y=y.reshape(shape), mean=mean[0], var=var[0], dx=dx.reshape(shape), dscale=dscale[0],
                    dbias=dbias[0])

    info = {}
    # one device, against Flax's layer (its two-pass variance) and the oracle
    x0 = jnp.asarray(concat(x))
    ours = BatchNorm(use_running_average=False, axis=(), momentum=MOMENTUM, epsilon=EPS)
    theirs = nn.BatchNorm(use_running_average=False, axis=(), momentum=MOMENTUM, epsilon=EPS, use_fast_variance=False)
    variables = ours.init(jax.random.PRNGKey(0), x0)
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)
    assert shapes(variables) == shapes(theirs.init(jax.random.PRNGKey(0), x0)), shapes(variables)
    variables = flax_variables(case)
    (y, upd) = ours.apply(variables, x0, mutable=["batch_stats"])
    (y_f, upd_f) = theirs.apply(variables, x0, mutable=["batch_stats"])
    assert y.shape == y_f.shape == x0.shape and upd["batch_stats"]["mean"].shape == (), (y.shape, upd)
    info["one device vs flax y"] = assert_close("flax y", y, y_f, TOL["float32"])
    for k in ("mean", "var"):
        assert_close(f"flax {k}", upd["batch_stats"][k], upd_f["batch_stats"][k], TOL["float32"])
    one = dict(case, x=concat(x)[None], mask=None, dy=concat(case["dy"])[None])
    model = BatchNorm(use_running_average=False, axis=(), momentum=MOMENTUM, epsilon=EPS, axis_name=AXIS)
    got = pmap_step(model, dict(one, d_mean=case["d_mean"][:1], d_var=case["d_var"][:1]))
    got["mean"], got["var"] = got["mean"][0], got["var"][0]
    info["one device"] = compare(got, oracle_all(one, case["d_mean"][0], case["d_var"][0]), "float32", "one device")

    # pmap over 4 devices with uneven masks (one device fully masked)
    got = pmap_step(model, case)
    assert got["mean"].shape == (DEVICES,), got["mean"].shape
    got["mean"], got["var"] = got["mean"][0], got["var"][0]
    info["pmap masked"] = compare(got, oracle_all(case, case["d_mean"].sum(0), case["d_var"].sum(0)), "float32",
                                  "pmap masked")

    # jit, batch sharded over an explicit mesh, with and without the mask
    model = BatchNorm(use_running_average=False, axis=(), momentum=MOMENTUM, epsilon=EPS)
    for c, key in ((case, "jit masked"), (dict(case, mask=None), "jit full")):
        got, _ = global_step(model, c, mesh_1d(), P(AXIS), False)
        info[key] = compare(got, oracle_all(c, case["d_mean"][0], case["d_var"][0]), "float32", key)

    # nnx: one scalar feature (num_features=1), as flax.nnx.BatchNorm with axis=()
    ours = snnx.BatchNorm(1, axis=(), momentum=MOMENTUM, epsilon=EPS, rngs=nnx.Rngs(0))
    theirs = nnx.BatchNorm(1, axis=(), momentum=MOMENTUM, epsilon=EPS, use_fast_variance=False, rngs=nnx.Rngs(0))
    y, y_f = ours(x0), theirs(x0)
    info["nnx vs flax y"] = assert_close("nnx y", y, y_f, TOL["float32"])
    assert_close("nnx mean", ours.mean[...], theirs.mean[...], TOL["float32"])
    assert_close("nnx var", ours.var[...], theirs.var[...], TOL["float32"])
    return info


# ----------------------------------------------------------------------------- groups


@check
def groups_pmap_and_mesh_axis():
    """axis_index_groups [[0, 1], [2, 3]] under pmap, and its shard_map equivalent (a
    ('group', 'replica') mesh, axis_name='replica'), each equal to the oracle on each
    group's concatenated batch; axis_index_groups under shard_map is a clear error."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from syncbn.flax import BatchNorm

    info = {}
    case = make_case(7, "channels_last", "float32", True)
    groups = [[0, 1], [2, 3]]
    model = BatchNorm(use_running_average=False, momentum=MOMENTUM, epsilon=EPS, axis_name=AXIS,
                      axis_index_groups=groups)
    got = pmap_step(model, case)
    per = case["x"].shape[1]
    for g, members in enumerate(groups):
        sub = dict(case, x=case["x"][members], mask=case["mask"][members], dy=case["dy"][members])
        ref = oracle(sub, case["d_mean"][members].sum(0), case["d_var"][members].sum(0))
        rows = slice(members[0] * per, (members[-1] + 1) * per)
        for key in ("y", "dx"):
            info[f"pmap group {g} {key}"] = assert_close(f"group {g} {key}", got[key][rows], ref[key], TOL["float32"])
        for key in ("mean", "var"):
            for d in members:
                assert_close(f"group {g} {key}", got[key][d], ref[key], TOL["float32"])

    mesh = jax.make_mesh((2, 2), ("group", "replica"))
    spec = P(("group", "replica"))
    model = BatchNorm(use_running_average=False, momentum=MOMENTUM, epsilon=EPS, axis_name="replica")
    variables = flax_variables(case)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    x = put(jnp.asarray(concat(case["x"])), spec)
    mask = put(jnp.asarray(concat(case["mask"])), spec)
    dy = put(jnp.asarray(concat(case["dy"])), spec)

    def body(x, params, mask):
        y, upd = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mask=mask,
                             mutable=["batch_stats"])
        return y

    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), spec), out_specs=spec)
    y, pullback = jax.vjp(lambda x, p: fn(x, p, mask), x, variables["params"])
    dx, dparams = pullback(dy)
    dscale = np.zeros_like(case["params"]["scale"], np.float64)
    for g, members in enumerate(groups):
        sub = dict(case, x=case["x"][members], mask=case["mask"][members], dy=case["dy"][members])
        zeros = np.zeros_like(case["d_mean"][0])
        ref = oracle(sub, zeros, zeros)
        rows = slice(members[0] * per, (members[-1] + 1) * per)
        info[f"mesh group {g} y"] = assert_close(f"mesh group {g} y", np.asarray(y)[rows], ref["y"], TOL["float32"])
        info[f"mesh group {g} dx"] = assert_close(f"mesh group {g} dx", np.asarray(dx)[rows], ref["dx"], TOL["float32"])
        dscale += ref["dscale"]
    # scale is replicated over the whole mesh: its gradient sums both groups
    info["mesh dscale"] = assert_close("mesh dscale", dparams["scale"], dscale, TOL["float32"])

    model = BatchNorm(use_running_average=False, axis_name=AXIS, axis_index_groups=groups)
    mesh = mesh_1d()
    fn = jax.shard_map(lambda x: model.apply(variables, x, mutable=["batch_stats"])[0], mesh=mesh,
                       in_specs=P(AXIS), out_specs=P(AXIS))
    try:
        jax.jit(fn)(jax.device_put(jnp.asarray(concat(case["x"])), NamedSharding(mesh, P(AXIS))))
    except ValueError as err:
        assert "axis_index_groups is not supported under shard_map" in str(err), err
    else:
        raise AssertionError("axis_index_groups under shard_map did not raise")
    return info


# ----------------------------------------------------------------------------- collectives


def collectives(hlo: str) -> dict:
    """Cross-device collectives in compiled HLO text by kind (async pairs count once)."""
    import collections
    import re

    kinds = r"all-reduce|all-gather|all-to-all|collective-permute|collective-broadcast|reduce-scatter|ragged-all-to-all"
    found = re.findall(rf"= [^=\n]*\b({kinds})(?:-start)?\(", hlo)
    return dict(collections.Counter(found))


def all_reduces_only(hlo: str) -> int:
    """The number of all-reduces, asserting that no other kind of collective is there."""
    kinds = collectives(hlo)
    assert set(kinds) <= {"all-reduce"}, kinds
    return kinds.get("all-reduce", 0)


@check
def collective_counts():
    """Compiled HLO of one training step: exactly one all-reduce forward and one more
    backward, and no other collective, under pmap (parameters passed per device, so pmap
    adds no gradient reduction of its own), shard_map (replicated parameters: their total
    gradient comes out of the layer's backward psum) and jit with a sharded batch (XLA
    partitions the reductions: the per-group sums of moments.Groups keep both passes
    local), with and without a mask, channels at -1 and 1; none in a forward with
    use_running_average=True (its backward has the parameters' gradient reduction)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from syncbn.flax import BatchNorm

    info = {}
    for layout in ("channels_last", "channels_first"):
        case = make_case(3, layout, "float32", True)
        variables = flax_variables(case)
        x, mask = jnp.asarray(case["x"]), jnp.asarray(case["mask"])
        params = jax.tree.map(lambda a: jnp.broadcast_to(a, (DEVICES,) + a.shape), variables["params"])
        for train in (True, False):
            key = f"{layout} {'train' if train else 'eval'}"
            model = BatchNorm(use_running_average=not train, axis=case["axis"], axis_name=AXIS)

            def replica(x, params, mask):
                y, _ = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x, mask=mask,
                                   mutable=["batch_stats"])
                return y

            step = jax.pmap(replica, axis_name=AXIS)

            def fwd_bwd(x, params, mask):
                y, pullback = jax.vjp(lambda x, p: step(x, p, mask), x, params)
                return pullback(y)

            fwd = jax.jit(step).lower(x, params, mask).compile().as_text()
            both = jax.jit(fwd_bwd).lower(x, params, mask).compile().as_text()
            counts = {"pmap": (all_reduces_only(fwd), all_reduces_only(both))}
            _, fwd = global_step(model, case, mesh_1d(), P(AXIS), True, backward=False)
            _, both = global_step(model, case, mesh_1d(), P(AXIS), True)
            counts["shard_map"] = (all_reduces_only(fwd), all_reduces_only(both))
            model_jit = BatchNorm(use_running_average=not train, axis=case["axis"])
            meshes = [("", mesh_1d(), P(AXIS)), (" auto", mesh_1d(auto=True), P(AXIS))]
            if layout == "channels_last" and train:
                # the batch over one axis of a 2 x 2 mesh; over 3 of the 4 devices (12 rows:
                # the explicit sharding gives 3 groups where gcd(12, 4) would give 4)
                meshes.append((" 2x2 mesh", jax.make_mesh((2, 2), ("data", "model")), P("data")))
                meshes.append((" 3 devices", jax.make_mesh((3,), (AXIS,), devices=jax.devices()[:3]), P(AXIS)))
            for mesh_key, mesh, spec in meshes:
                for masked, c in (("masked", case), ("unmasked", dict(case, mask=None))):
                    _, fwd = global_step(model_jit, c, mesh, spec, False, backward=False)
                    _, both = global_step(model_jit, c, mesh, spec, False)
                    counts[f"jit-sharded{mesh_key} {masked}"] = (all_reduces_only(fwd), all_reduces_only(both))
            for mode, (n_fwd, n_both) in counts.items():
                info[f"{mode} {key} forward"] = n_fwd
                info[f"{mode} {key} forward+backward"] = n_both
            # eval: no statistics; the backward's one is the parameters' gradient (a sum
            # over the batch), except under pmap where parameters are per device
            want = {mode: (1, 2) if train else (0, 0 if mode == "pmap" else 1) for mode in counts}
            assert counts == want, (key, counts, want)
    return info


# ----------------------------------------------------------------------------- numerics


def pmap_variance(model, parts):
    """The variance a model's pmap-ed training call merges from per-device ``parts``."""
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(np.stack(parts))
    variables = model.init(jax.random.PRNGKey(0), x[0])
    return np.asarray(_variance_fn(model, "pmap")(variables, x))[0].astype(np.float64)


def jit_variance(model, parts, keep=None):
    """The variance a model's jit-ed training call gives for the concatenated ``parts``,
    the batch sharded over the 4 devices, optionally with a mask ``keep``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh_1d(), P(AXIS))
    x = jax.device_put(jnp.asarray(np.concatenate(parts)), sharding)
    mask = None if keep is None else jax.device_put(jnp.asarray(keep), sharding)
    variables = model.init(jax.random.PRNGKey(0), jnp.asarray(parts[0]))
    return np.asarray(_variance_fn(model, "jit")(variables, x, mask)).astype(np.float64)


@functools.cache
def _variance_fn(model, how):
    """The model's training call returning the updated variance, under ``pmap`` (over
    the leading axis) or ``jit``, the variables an argument: made once per model (Flax
    modules hash by their fields), so that the calls for each |mean|/std reuse its
    compiled program, where a fresh closure per call would compile it again."""
    import jax

    def var(variables, x, mask=None):
        return model.apply(variables, x, mask=mask, mutable=["batch_stats"])[1]["batch_stats"]["var"]

    return jax.pmap(var, axis_name=AXIS, in_axes=(None, 0)) if how == "pmap" else jax.jit(var)


@check
def variance_far_from_zero():
    """Variance relative error at |mean|/std = 1, 1e2, 1e3, 1e4 (float32, 4 devices,
    every device with its own data) under pmap and under jit with the batch sharded
    (without and with a mask keeping 90 %, 10 %, none and 50 % of the devices' rows):
    syncbn.flax <= 1e-5 up to 1e3 and <= 1e-4 at 1e4; Flax's two variance modes
    reported beside it."""
    import flax.linen as nn
    from syncbn.flax import BatchNorm

    rng = np.random.default_rng(11)
    models = {"syncbn.flax": BatchNorm(use_running_average=False, axis_name=AXIS, momentum=0.0),
              "flax fast": nn.BatchNorm(use_running_average=False, axis_name=AXIS, momentum=0.0),
              "flax two-pass": nn.BatchNorm(use_running_average=False, axis_name=AXIS, momentum=0.0,
                                            use_fast_variance=False)}
    jit_models = {"syncbn.flax jit": BatchNorm(use_running_average=False, momentum=0.0),
                  "flax fast jit": nn.BatchNorm(use_running_average=False, momentum=0.0),
                  "flax two-pass jit": nn.BatchNorm(use_running_average=False, momentum=0.0,
                                                    use_fast_variance=False)}
    table = {name: {} for name in list(models) + list(jit_models) + ["syncbn.flax jit masked"]}
    for ratio in (1.0, 1e2, 1e3, 1e4):
        parts = [(ratio + rng.standard_normal((64, 8))).astype(np.float32) for _ in range(DEVICES)]
        whole = np.concatenate(parts).astype(np.float64)
        ref = whole.var(axis=0)
        rel = lambda var, ref: float(np.max(np.abs(var - ref) / ref))
        for name, model in models.items():
            table[name][f"{ratio:g}"] = rel(pmap_variance(model, parts), ref)
        for name, model in jit_models.items():
            table[name][f"{ratio:g}"] = rel(jit_variance(model, parts), ref)
        keep = np.concatenate([rng.random((64, 1)) < p for p in (0.9, 0.1, 0.0, 0.5)])
        ref_masked = whole[keep[:, 0]].var(axis=0)
        table["syncbn.flax jit masked"][f"{ratio:g}"] = rel(jit_variance(jit_models["syncbn.flax jit"], parts, keep),
                                                             ref_masked)
    for name in ("syncbn.flax", "syncbn.flax jit", "syncbn.flax jit masked"):
        ours = table[name]
        assert all(np.isfinite(v) for v in ours.values()), (name, ours)
        assert max(ours["1"], ours["100"], ours["1000"]) <= 1e-5, (name, ours)
        assert ours["10000"] <= 1e-4, (name, ours)
    return table


@check
def masked_uneven_counts_vs_flax():
    """Two devices with 60 and 6 valid elements, then the same plus two fully masked
    devices (4 in all): syncbn.flax's mean, variance and input gradient equal the
    union's; Flax's are reported (it averages per-device means; a fully masked device
    makes its statistics NaN)."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from syncbn.flax import BatchNorm

    rng = np.random.default_rng(5)
    info = {}
    for devices in (2, DEVICES):
        x = (rng.standard_normal((devices, 60, 1)) * 1.5).astype(np.float32)
        x[1] += 2.0
        mask = np.zeros((devices, 60, 1), bool)
        mask[0, :60] = True
        mask[1, :6] = True
        dy = rng.standard_normal(x.shape).astype(np.float32)
        valid = np.concatenate([x[0], x[1, :6]]).astype(np.float64)
        row = {"union mean": float(valid.mean()), "union var": float(valid.var())}
        ref_case = dict(x=x, mask=mask, dy=dy, axis=-1,
                        params={"scale": np.ones(1, np.float32), "bias": np.zeros(1, np.float32)},
                        stats={"mean": np.zeros(1, np.float32), "var": np.ones(1, np.float32)})
        ref = oracle(ref_case, np.zeros(1), np.zeros(1))
        for name, model in (("syncbn.flax", BatchNorm(use_running_average=False, axis_name=AXIS, momentum=0.0)),
                            ("flax", nn.BatchNorm(use_running_average=False, axis_name=AXIS, momentum=0.0))):
            variables = model.init(jax.random.PRNGKey(0), x[0])

            def replica(x, mask):
                y, upd = model.apply(variables, x, mask=mask, mutable=["batch_stats"])
                return y, upd["batch_stats"]["mean"], upd["batch_stats"]["var"]

            step = jax.pmap(replica, axis_name=AXIS, devices=jax.devices()[:devices])
            (y, mean, var), pullback = jax.vjp(lambda x: step(x, jnp.asarray(mask)), jnp.asarray(x))
            dx, = pullback((jnp.asarray(dy), jnp.zeros_like(mean), jnp.zeros_like(var)))
            dx = concat(np.asarray(dx, np.float64))
            with np.errstate(invalid="ignore"):
                rel = float(np.max(np.abs(dx - ref["dx"])) / np.max(np.abs(ref["dx"])))
            row[name] = {"mean": float(np.asarray(mean)[0, 0]), "var": float(np.asarray(var)[0, 0]),
                         "dx relative error": rel}
        ours = row["syncbn.flax"]
        assert abs(ours["mean"] - row["union mean"]) <= 1e-5 * (1 + abs(row["union mean"])), row
        assert abs(ours["var"] - row["union var"]) <= 1e-5 * row["union var"], row
        assert ours["dx relative error"] <= 1e-5, row
        info[f"{devices} devices" + (" (2 fully masked)" if devices > 2 else "")] = row
    return info


# ----------------------------------------------------------------------------- degenerate


@check
def tiny_batches_follow_flax():
    """N = 1 (one valid element over all devices): variance 0, output = bias, finite
    gradients, as Flax gives on a single device; N = 0 (everything masked): NaN
    statistics, as Flax (the mean of nothing); a fully masked device beside others is
    finite."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from syncbn.flax import BatchNorm

    x = jnp.asarray(np.arange(DEVICES * 2 * 3, dtype=np.float32).reshape(DEVICES, 2, 3) + 5)
    model = BatchNorm(use_running_average=False, axis_name=AXIS, momentum=0.0,
                      bias_init=jax.nn.initializers.constant(0.25))
    variables = model.init(jax.random.PRNGKey(0), x[0])

    def run(mask):
        def replica(x, mask):
            y, upd = model.apply(variables, x, mask=mask, mutable=["batch_stats"])
            return y, upd["batch_stats"]["var"]

        step = jax.pmap(replica, axis_name=AXIS)
        (y, var), pullback = jax.vjp(lambda x: step(x, mask), x)
        dx, = pullback((jnp.ones_like(y), jnp.zeros_like(var)))
        return np.asarray(y), np.asarray(var), np.asarray(dx)

    one = np.zeros((DEVICES, 2, 1), bool)
    one[2, 1] = True
    y, var, dx = run(jnp.asarray(one))
    assert np.all(var == 0) and np.all(np.isfinite(dx)), (var, dx)
    assert np.all(y[2, 1] == 0.25), y
    flax_y = nn.BatchNorm(use_running_average=False, bias_init=jax.nn.initializers.constant(0.25)).apply(
        variables, x[2, 1:2], mutable=["batch_stats"])[0]
    assert np.array_equal(np.asarray(flax_y), y[2, 1:2]), (flax_y, y[2, 1:2])
    info = {"N=1 var": var[0].tolist(), "N=1 y": y[2, 1].tolist()}
    y, var, dx = run(jnp.zeros((DEVICES, 2, 1), bool))
    assert np.all(np.isnan(var)) and np.all(np.isnan(y)), (var, y)
    return info


# ----------------------------------------------------------------------------- drop-in


@check
def linen_drop_in_single_device():
    """Without axis_name on one device: the same variables (collections, names, shapes,
    dtypes) as flax.linen.BatchNorm, outputs and updated statistics equal to Flax's
    two-pass mode within float32 rounding, identical in eval mode, channels at -1, 1
    and a tuple of feature axes; bfloat16 input gives float32 statistics."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from syncbn.flax import BatchNorm

    rng = np.random.default_rng(2)
    info = {}
    for axis, shape in ((-1, (6, 5, 4)), (1, (6, 4, 5)), ((1, 2), (6, 3, 4))):
        x = jnp.asarray(rng.standard_normal(shape) * 3 + 2, jnp.float32)
        kw = dict(axis=axis, momentum=0.8)
        ours, theirs = BatchNorm(**kw), nn.BatchNorm(use_fast_variance=False, **kw)
        v_ours = ours.init(jax.random.PRNGKey(0), x, use_running_average=False)
        v_theirs = theirs.init(jax.random.PRNGKey(0), x, use_running_average=False)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), v_ours) == jax.tree.map(lambda a: (a.shape, a.dtype), v_theirs)
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), v_ours, v_theirs))
        y1, u1 = ours.apply(v_theirs, x, use_running_average=False, mutable=["batch_stats"])
        y2, u2 = theirs.apply(v_theirs, x, use_running_average=False, mutable=["batch_stats"])
        info[f"axis {axis} y"] = assert_close("y", y1, y2, 2e-6)
        for k in ("mean", "var"):
            assert_close(k, u1["batch_stats"][k], u2["batch_stats"][k], 2e-6)
        e1 = ours.apply({**v_theirs, **u1}, x, use_running_average=True)
        e2 = theirs.apply({**v_theirs, **u1}, x, use_running_average=True)
        assert np.array_equal(np.asarray(e1), np.asarray(e2))
    xb = jnp.asarray(rng.standard_normal((8, 3)) + 1, jnp.bfloat16)
    y, upd = BatchNorm().apply(BatchNorm().init(jax.random.PRNGKey(0), xb, use_running_average=False), xb,
                               use_running_average=False, mutable=["batch_stats"])
    assert upd["batch_stats"]["var"].dtype == jnp.float32 and y.dtype == jnp.float32, (y.dtype, upd)
    yb = BatchNorm(dtype=jnp.bfloat16).apply(BatchNorm().init(jax.random.PRNGKey(0), xb, use_running_average=False), xb,
                                             use_running_average=False, mutable=["batch_stats"])[0]
    assert yb.dtype == jnp.bfloat16
    return info


@check
def linen_convert_context():
    """A model written with flax.linen.BatchNorm (no axis_name), run inside
    syncbn.flax.convert(axis_name=...) under pmap, equals the same model written with
    syncbn.flax.BatchNorm(axis_name=...); outside the context it is Flax's again."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    import syncbn.flax as sf

    class Net(nn.Module):
        bn: type = nn.BatchNorm
        axis_name: str = None

        @nn.compact
        def __call__(self, x, train):
            x = nn.Dense(4)(x)
            x = self.bn(use_running_average=not train, axis_name=self.axis_name)(x)
            return self.bn(use_running_average=not train, axis_name=self.axis_name)(nn.relu(x))

    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((DEVICES, 5, 3)) + np.arange(DEVICES)[:, None, None] * 2, jnp.float32)
    plain, synced = Net(), Net(bn=sf.BatchNorm, axis_name=AXIS)
    variables = plain.init(jax.random.PRNGKey(1), x[0], True)
    assert jax.tree.structure(variables) == jax.tree.structure(synced.init(jax.random.PRNGKey(1), x[0], True))

    def run(model):
        return jax.pmap(lambda x: model.apply(variables, x, True, mutable=["batch_stats"]), axis_name=AXIS)(x)

    want = run(synced)
    with sf.convert(axis_name=AXIS):
        got = run(plain)
    outside = run(plain)
    same = jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, rtol=1e-6, atol=1e-6)), got, want))
    assert same, (got, want)
    differs = not np.allclose(np.asarray(outside[0]), np.asarray(want[0]), atol=1e-3)
    assert differs, "outside the context the layers must be Flax's (per-device statistics)"
    return {}


@check
def linen_convert_keeps_subclass_code():
    """A user subclass of flax.linen.BatchNorm whose __call__ adds code around
    super().__call__ (a ReLU and a shift), plain and under nn.remat, converted (model
    form and context form) and run under pmap: its own code still runs and only Flax's
    computation is synchronized, so it equals the same subclass built on
    syncbn.flax.BatchNorm(axis_name=...), outputs and running statistics. A subclass
    whose __call__ never calls flax.linen.BatchNorm.__call__ cannot be synchronized:
    converting it raises TypeError naming the class, in both forms."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    import syncbn.flax as sf

    def with_relu(base):
        class BNRelu(base):
            @nn.compact
            def __call__(self, x, use_running_average=None):
                return nn.relu(super().__call__(x, use_running_average)) - 0.25

        return BNRelu

    class OwnStats(nn.BatchNorm):  # normalizes by itself: nothing for convert to replace
        @nn.compact
        def __call__(self, x, use_running_average=None):
            return (x - x.mean(0)) / (x.std(0) + self.epsilon)

    class Net(nn.Module):
        bn: type
        remat: bool = False
        axis_name: str = None

        @nn.compact
        def __call__(self, x):
            x = nn.Dense(3)(x)
            layer = nn.remat(self.bn) if self.remat else self.bn
            return layer(use_running_average=False, axis_name=self.axis_name)(x)

    rng = np.random.default_rng(17)
    x = jnp.asarray(rng.standard_normal((DEVICES, 6, 3)) * 2 + np.arange(DEVICES)[:, None, None], jnp.float32)

    def run(model, variables):
        return jax.pmap(lambda x: model.apply(variables, x, mutable=["batch_stats"]), axis_name=AXIS)(x)

    info = {}
    for remat in (False, True):
        plain = Net(with_relu(nn.BatchNorm), remat)
        variables = plain.init(jax.random.PRNGKey(2), x[0])
        want = run(Net(with_relu(sf.BatchNorm), remat, AXIS), variables)
        outside = run(plain, variables)
        for form, got in (("model", lambda: run(sf.convert(plain, axis_name=AXIS), variables)),
                          ("context", lambda: run(plain, variables))):
            if form == "context":
                with sf.convert(axis_name=AXIS):
                    got = got()
            else:
                got = got()
            assert float(jnp.min(got[0])) == -0.25, (remat, form, "the subclass's ReLU and shift did not run")
            errors = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got, want))
            # the same float32 computation in the same order: equal up to a few roundings
            assert worst(errors) <= 1e-5, (remat, form, errors)
            info[f"remat={remat} {form}"] = worst(errors)
        # without the conversion the statistics are per device: the comparison can tell
        assert not np.allclose(np.asarray(outside[0]), np.asarray(want[0]), atol=1e-3)

    plain = Net(OwnStats)
    variables = plain.init(jax.random.PRNGKey(2), x[0])
    for form in ("model", "context"):
        try:
            if form == "model":
                run(sf.convert(plain, axis_name=AXIS), variables)
            else:
                with sf.convert(axis_name=AXIS):
                    run(plain, variables)
        except TypeError as err:
            assert "OwnStats" in str(err) and "super().__call__" in str(err), str(err)
        else:
            raise AssertionError(f"{form}: a subclass that never calls BatchNorm.__call__ was left unsynchronized")
    return info


@check
def nnx_drop_in_and_convert():
    """syncbn.flax.nnx.BatchNorm has flax.nnx.BatchNorm's state; under nnx.jit with a
    sharded batch (with and without mask) and under shard_map with axis_name it equals the
    oracle; convert() swaps every
    nnx.BatchNorm of a model in place sharing its Variables, revert() undoes it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    import syncbn.flax.nnx as snnx

    ours = snnx.BatchNorm(4, momentum=MOMENTUM, epsilon=EPS, rngs=nnx.Rngs(0))
    theirs = nnx.BatchNorm(4, momentum=MOMENTUM, epsilon=EPS, rngs=nnx.Rngs(0))
    shapes = lambda m: jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(m))
    assert shapes(ours) == shapes(theirs)
    info = {}
    mesh = mesh_1d()
    for masked in (False, True):
        case = make_case(21 + masked, "channels_last", "float32", masked)
        for name, value in list(case["params"].items()) + list(case["stats"].items()):
            getattr(ours, name)[...] = jnp.asarray(value)
        x = jax.device_put(jnp.asarray(concat(case["x"])), NamedSharding(mesh, P(AXIS)))
        mask = None if case["mask"] is None else jax.device_put(jnp.asarray(concat(case["mask"])),
                                                                NamedSharding(mesh, P(AXIS)))
        dy = jnp.asarray(concat(case["dy"]))
        layer = nnx.clone(ours)

        @nnx.jit
        def step(layer, x, mask, dy):
            def loss(layer, x):
                return jnp.sum(layer(x, mask=mask) * dy)

            return nnx.grad(loss, argnums=(0, 1))(layer, x)

        grads, dx = step(layer, x, mask, dy)
        ref = oracle(case, np.zeros(4), np.zeros(4))
        info[f"jit masked={masked} dx"] = assert_close("nnx dx", dx, ref["dx"], TOL["float32"])
        assert_close("nnx dscale", grads["scale"][...], ref["dscale"], TOL["float32"])
        assert_close("nnx mean", layer.mean[...], ref["mean"], TOL["float32"])
        assert_close("nnx var", layer.var[...], ref["var"], TOL["float32"])

    # under shard_map with axis_name: split the layer, merge it inside, return its new state
    case = make_case(23, "channels_first", "float32", True)
    layer = snnx.BatchNorm(4, axis=1, momentum=MOMENTUM, epsilon=EPS, axis_name=AXIS, rngs=nnx.Rngs(0))
    for name, value in list(case["params"].items()) + list(case["stats"].items()):
        getattr(layer, name)[...] = jnp.asarray(value)
    graphdef, params, stats = nnx.split(layer, nnx.Param, nnx.BatchStat)
    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
    params, stats = (jax.tree.map(lambda a: put(a, P()), t) for t in (params, stats))

    def body(x, params, stats, mask):
        model = nnx.merge(graphdef, params, stats)
        y = model(x, mask=mask)
        return y, nnx.state(model, nnx.BatchStat)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(), P(), P(AXIS)), out_specs=(P(AXIS), P()))
    x, mask, dy = (put(concat(case[k]), P(AXIS)) for k in ("x", "mask", "dy"))

    @jax.jit
    def run(x, params):
        (y, new_stats), pullback = jax.vjp(lambda x, p: fn(x, p, stats, mask), x, params)
        return new_stats, pullback((dy, jax.tree.map(jnp.zeros_like, new_stats)))

    new_stats, (dx, dparams) = run(x, params)
    ref = oracle(case, np.zeros(4), np.zeros(4))
    info["shard_map dx"] = assert_close("nnx shard_map dx", dx, ref["dx"], TOL["float32"])
    assert_close("nnx shard_map dscale", dparams["scale"][...], ref["dscale"], TOL["float32"])
    assert_close("nnx shard_map var", new_stats["var"][...], ref["var"], TOL["float32"])

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.blocks = nnx.List([nnx.BatchNorm(4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])

    net = Net(nnx.Rngs(0))
    scale = net.blocks[0].scale
    snnx.convert(net, axis_name=AXIS)
    assert type(net.bn) is snnx.BatchNorm and type(net.blocks[0]) is snnx.BatchNorm, net
    assert net.blocks[0].scale is scale and net.bn.axis_name == AXIS
    snnx.revert(net)
    assert type(net.bn) is nnx.BatchNorm and type(net.blocks[0]) is nnx.BatchNorm
    assert net.blocks[0].scale is scale
    return info


# ----------------------------------------------------------------------------- Flax's own contract


@check
def flax_batch_norm_contract():
    """What Flax's own tests ask of its BatchNorm, for ours (our words and data): with
    and without a mask whose excluded elements are NaN, the kept outputs have mean 0 and
    variance 1 per channel and the running statistics move by (1 - momentum) toward the
    masked batch's mean and biased variance; a layer with axis_name initializes outside
    pmap and two calls of one layer at init agree; use_running_average must come from
    the constructor or the call. (Complex, integer and float64 inputs, dtypes, and the
    rest of what Flax's tests check: flax_conformance_checks.py.)"""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from syncbn.flax import BatchNorm

    rng = np.random.default_rng(31)
    info = {}
    for masked in (False, True):
        x = (rng.standard_normal((5, 4, 3)) * 2 + 1).astype(np.float32)
        m = None
        if masked:
            m = rng.random((5, 4, 1)) < 0.6
            m[0, 0] = m[1, 1] = True
            x = np.where(m, x, np.nan).astype(np.float32)
        model = BatchNorm(momentum=0.8, use_running_average=False)
        y, variables = model.init_with_output(jax.random.PRNGKey(0), jnp.asarray(x), mask=m)
        y = np.asarray(y, np.float64)
        keep = np.ones(x.shape, bool) if m is None else np.broadcast_to(m, x.shape)
        for c in range(3):
            kept = y[..., c][keep[..., c]]
            info[f"mask={masked} c{c} mean"] = assert_close("kept mean", kept.mean(), 0.0, 1e-5)
            assert_close("kept var", kept.var(), 1.0 - 1e-5 / (x[..., c][keep[..., c]].var() + 1e-5), 1e-5)
        _, upd = model.apply(variables, jnp.asarray(x), mask=m, mutable=["batch_stats"])
        xs = x.astype(np.float64)
        ref_mean = np.array([xs[..., c][keep[..., c]].mean() for c in range(3)])
        ref_var = np.array([xs[..., c][keep[..., c]].var() for c in range(3)])
        assert_close("ema mean", upd["batch_stats"]["mean"], 0.2 * ref_mean, 1e-6)
        assert_close("ema var", upd["batch_stats"]["var"], 0.8 + 0.2 * ref_var, 1e-6)

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            norm = BatchNorm(name="norm", use_running_average=False, axis_name="batch")
            first = norm(x)
            return first, norm(first)

    (y1, y2), _ = Twice().init_with_output(jax.random.PRNGKey(0), jnp.asarray(rng.standard_normal((6, 4)), jnp.float32))
    assert_close("twice", y2, y1, 1e-5)

    x = jnp.ones((4, 3))
    try:
        BatchNorm().init(jax.random.PRNGKey(0), x)
    except ValueError as err:
        assert "use_running_average" in str(err), err
    else:
        raise AssertionError("use_running_average given nowhere did not raise")
    return info


@check
def nnx_matches_flax_nnx():
    """Without axis_name, syncbn.flax.nnx.BatchNorm gives flax.nnx.BatchNorm's outputs
    (two-pass mode) and running statistics within float32 rounding, with and without
    scale/bias, for float32 and bfloat16 inputs and dtype=bfloat16, in train and eval;
    the same Variables types (Param, BatchStat)."""
    import jax.numpy as jnp
    from flax import nnx
    import syncbn.flax.nnx as snnx

    rng = np.random.default_rng(41)
    info = {}
    for use_scale, use_bias, in_dtype, dtype in ((True, True, "float32", None), (False, True, "float32", None),
                                                 (True, False, "bfloat16", None), (True, True, "bfloat16", "bfloat16")):
        kw = dict(use_scale=use_scale, use_bias=use_bias, momentum=0.7, dtype=dtype)
        ours = snnx.BatchNorm(3, rngs=nnx.Rngs(0), **kw)
        theirs = nnx.BatchNorm(3, use_fast_variance=False, rngs=nnx.Rngs(0), **kw)
        kinds = lambda m: {k: type(v).__name__ for k, v in vars(m).items() if isinstance(v, nnx.Variable)}
        assert kinds(ours) == kinds(theirs), (kinds(ours), kinds(theirs))
        x = jnp.asarray(rng.standard_normal((6, 5, 3)) * 2 + 3, in_dtype)
        y1, y2 = ours(x), theirs(x)
        assert y1.dtype == y2.dtype, (y1.dtype, y2.dtype)
        tol = 2e-5 if y1.dtype == jnp.float32 else 1e-2
        info[f"{use_scale}/{use_bias}/{in_dtype}/{dtype}"] = assert_close("nnx y", y1, y2, tol)
        assert_close("nnx mean", ours.mean[...], theirs.mean[...], 2e-6)
        assert_close("nnx var", ours.var[...], theirs.var[...], 2e-6)
        assert_close("nnx eval", ours(x, use_running_average=True), theirs(x, use_running_average=True), tol)
    return info


# ----------------------------------------------------------------------------- conversion (one API shape)


def linen_models():
    """Linen classes written with flax.linen.BatchNorm at three depths, in setup and
    compact style: ``Net`` (setup) -> ``first`` BN and ``Deep`` (compact) -> a compact BN
    and ``Inner`` (setup) -> ``norm`` BN, squares between the layers (so a layer fed
    with synchronized inputs still sees uneven devices); ``Net.encode`` runs ``first``."""
    import flax.linen as nn

    bn = lambda **kw: nn.BatchNorm(use_running_average=False, momentum=MOMENTUM, epsilon=EPS, **kw)

    class Inner(nn.Module):
        def setup(self):
            self.norm = bn()

        def __call__(self, x):
            return self.norm(x)

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = bn()(x)
            return Inner()(h * h)

    class Net(nn.Module):
        def setup(self):
            self.first = bn()
            self.deep = Deep()

        def __call__(self, x):
            h = self.first(x)
            return self.deep(h * h)

        def encode(self, x):
            return self.first(x)

    return Net, Deep


# the BatchNorm layers of linen_models().Net, in the order they run
NET_LAYERS = (("first",), ("deep", "BatchNorm_0"), ("deep", "Inner_0", "norm"))


def net_variables(model, x, seed):
    """``model.init``'s variables with every scale, bias and running statistic redrawn."""
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    rng = np.random.default_rng(seed)
    flat = traverse_util.flatten_dict(jax.tree.map(np.asarray, model.init(jax.random.PRNGKey(0), x)))
    draw = {"scale": (0.5, 1.5), "bias": (-1, 1), "mean": (-1, 1), "var": (0.5, 2)}
    flat = {k: jnp.asarray(rng.uniform(*draw[k[-1]], v.shape).astype(v.dtype)) for k, v in flat.items()}
    return traverse_util.unflatten_dict(flat)


def net_oracle(variables, x, dy, layers, square):
    """float64 reference of a chain of batch norms over the concatenated batch ``x``
    (``square``: h*h between layers): output, updated running statistics per layer,
    and the gradients of x and of every scale/bias for the cotangent ``dy``."""
    import jax
    import jax.numpy as jnp
    from flax_oracle import reference

    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
        params = [{k: f64(get_in(variables["params"], p)[k]) for k in ("scale", "bias")} for p in layers]

        def f(x, params):
            stats = []
            for i, (p, path) in enumerate(zip(params, layers)):
                if i and square:
                    x = x * x
                x, mean, var = reference(x, p["scale"], p["bias"], None, -1, EPS)
                old = get_in(variables["batch_stats"], path)
                stats.append((MOMENTUM * f64(old["mean"]) + (1 - MOMENTUM) * mean,
                              MOMENTUM * f64(old["var"]) + (1 - MOMENTUM) * var))
            return x, stats

        (y, stats), pullback = jax.vjp(f, f64(x), params)
        zeros = [(jnp.zeros_like(m), jnp.zeros_like(v)) for m, v in stats]
        dx, dparams = pullback((f64(dy), zeros))
        return (np.asarray(y), [tuple(map(np.asarray, s)) for s in stats], np.asarray(dx),
                [{k: np.asarray(v) for k, v in p.items()} for p in dparams])


def get_in(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def assert_net_matches(got, oracle, layers):
    """``pmap_net``'s ``got`` against ``net_oracle``'s ``oracle`` for ``layers``: y, dx, each
    layer's statistics on both devices and its scale/bias gradients, at the float32 bound;
    returns the errors by name."""
    y, stats, dx, dparams = oracle
    info = {"y": assert_close("y", concat(got[0]), y, TOL["float32"]),
            "dx": assert_close("dx", concat(got[2]), dx, TOL["float32"])}
    for path, (mean, var), dp in zip(layers, stats, dparams):
        name = "/".join(path)
        for d in range(2):
            assert_close(f"{name} mean", get_in(got[1], path)["mean"][d], mean, TOL["float32"])
            assert_close(f"{name} var", get_in(got[1], path)["var"][d], var, TOL["float32"])
        for k in ("scale", "bias"):
            info[f"{name} d{k}"] = assert_close(f"{name} d{k}", get_in(got[3], path)[k], dp[k], TOL["float32"])
    return info


def pmap_net(model, variables, x, dy, devices, **apply_kw):
    """One training call of a linen model under pmap over ``devices`` (parameters
    broadcast), its vjp for ``dy``: ``(y, batch_stats, dx, dparams)`` as numpy."""
    import jax
    import jax.numpy as jnp

    def replica(x, params):
        y, upd = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                             mutable=["batch_stats"], **apply_kw)
        return y, upd["batch_stats"]

    step = jax.pmap(replica, axis_name=AXIS, in_axes=(0, None), devices=devices)
    (y, stats), pullback = jax.vjp(lambda x, p: step(x, p), jnp.asarray(x), variables["params"])
    dx, dparams = pullback((jnp.asarray(dy), jax.tree.map(jnp.zeros_like, stats)))
    return jax.tree.map(np.asarray, (y, stats, dx, dparams))


def two_device_batch(seed, channels=3, per_device=4):
    rng = np.random.default_rng(seed)
    offsets = np.array([2.0, -3.0])[:, None, None]
    x = (rng.standard_normal((2, per_device, channels)) * 1.5 + offsets).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    return x, dy


@check
def linen_convert_function_matches_oracle():
    """model = syncbn.flax.convert(model, axis_name=...) on a model of plain
    flax.linen.BatchNorm layers (setup and compact style, depths 1 to 3) under pmap on 2
    devices: output, dx, every scale/bias gradient and running statistic equal to the
    float64 oracle on the concatenated batch and to the context form; apply(...,
    method=...) with a name, an unbound and a bound method equals the context form's
    (and the oracle of that one layer); the unconverted model differs (local statistics)."""
    import jax
    import syncbn.flax as sf

    Net, _ = linen_models()
    plain = Net()
    model = sf.convert(plain, axis_name=AXIS)
    x, dy = two_device_batch(51)
    variables = net_variables(plain, x[0], 52)
    devices = jax.devices()[:2]
    got = pmap_net(model, variables, x, dy, devices)
    with sf.convert(axis_name=AXIS):
        ctx = pmap_net(plain, variables, x, dy, devices)
    local = pmap_net(plain, variables, x, dy, devices)

    oracle = net_oracle(variables, concat(x), concat(dy), NET_LAYERS, True)
    y = oracle[0]
    info = assert_net_matches(got, oracle, NET_LAYERS)
    assert jax.tree.structure(got) == jax.tree.structure(ctx)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(ctx))):
        assert_close(f"function vs context form, leaf {i}", a, b, 1e-6)
    assert not np.allclose(concat(local[0]), y, atol=1e-2), "the plain model must not be synchronized"

    y1, _, dx1, _ = net_oracle(variables, concat(x), concat(dy), NET_LAYERS[:1], False)
    with sf.convert(axis_name=AXIS):
        ctx = pmap_net(plain, variables, x, dy, devices, method="encode")
    for label, method in (("name", "encode"), ("unbound", Net.encode), ("bound", plain.encode),
                          ("wrapper's", model.encode), ("function", lambda m, x: m.encode(x))):
        got = pmap_net(model, variables, x, dy, devices, method=method)
        info[f"method {label} y"] = assert_close(f"method {label} y", concat(got[0]), y1, TOL["float32"])
        assert_close(f"method {label} dx", concat(got[2]), dx1, TOL["float32"])
        assert_close(f"method {label} vs context", concat(got[0]), concat(ctx[0]), 1e-6)
    try:
        model.apply(variables, x[0], method="no_such_method")
    except AttributeError as err:
        assert "no_such_method" in str(err), err
    else:
        raise AssertionError("an unknown method did not raise")
    return info


def bridge_linen_model():
    """A linen model whose batch norms are nnx layers through ``flax.nnx.bridge.ToLinen``:
    an ``nnx.BatchNorm`` itself, then (after h*h) one held inside an nnx module."""
    import flax.linen as nn
    from flax import nnx
    from flax.nnx import bridge

    kw = dict(use_running_average=False, momentum=MOMENTUM, epsilon=EPS, use_fast_variance=False)

    class Inner(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.BatchNorm(3, rngs=rngs, **kw)

        def __call__(self, x):
            return self.norm(x)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = bridge.ToLinen(nnx.BatchNorm, args=(3,), kwargs=kw)(x)
            return bridge.ToLinen(Inner)(x * x)

    return Net(), (("ToLinen_0",), ("ToLinen_1", "norm"))


@check
def linen_convert_reaches_nnx_bridge():
    """syncbn.flax.convert(model, axis_name=...) on a linen model holding nnx.BatchNorm
    layers through flax.nnx.bridge.ToLinen (one as the wrapped class, one inside a wrapped
    nnx module) under pmap on 2 devices: output, dx, scale/bias gradients and running
    statistics equal the float64 oracle on the concatenated batch; the converted model
    initializes outside pmap to the plain model's variables. Before, the conversion
    intercepted only linen BatchNorm calls: these layers ran with each device's own
    statistics, silently."""
    import jax
    import syncbn.flax as sf

    plain, layers = bridge_linen_model()
    model = sf.convert(plain, axis_name=AXIS)
    x, dy = two_device_batch(57)
    ours, theirs = (m.init(jax.random.PRNGKey(0), x[0]) for m in (model, plain))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert np.array_equal(a, b), "init differs from the plain model's"
    variables = net_variables(plain, x[0], 58)
    got = pmap_net(model, variables, x, dy, jax.devices()[:2])
    return assert_net_matches(got, net_oracle(variables, concat(x), concat(dy), layers, True), layers)


@check
def nnx_convert_reaches_linen_bridge():
    """syncbn.flax.nnx.convert(model, axis_name=...) on an nnx model holding linen batch
    norms through flax.nnx.bridge.ToNNX (a flax.linen.BatchNorm, and one inside a linen
    module's setup), under shard_map (check_vma=False) on 2 devices: output, dx, scale/bias gradients and
    running statistics equal the float64 oracle on the concatenated batch; revert gives
    each ToNNX its very linen module back. Before, convert walked only the nnx graph, and
    the linen layers inside ToNNX ran with each device's own statistics, silently."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    from flax.nnx import bridge
    from jax.sharding import PartitionSpec as P
    import syncbn.flax.nnx as snnx

    kw = dict(use_running_average=False, momentum=MOMENTUM, epsilon=EPS, use_fast_variance=False)

    class Inner(nn.Module):
        def setup(self):
            self.norm = nn.BatchNorm(**kw)

        def __call__(self, x):
            return self.norm(x)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.bn1 = bridge.ToNNX(nn.BatchNorm(**kw), rngs=rngs)
            self.bn2 = bridge.ToNNX(Inner(), rngs=rngs)

        def __call__(self, x):
            h = self.bn1(x, mutable=["batch_stats"])
            return self.bn2(h * h, mutable=["batch_stats"])

    x, dy = two_device_batch(61)
    model = Net(nnx.Rngs(0))
    bridge.lazy_init(model, jnp.asarray(x[0]))
    layers = (("bn1",), ("bn2", "norm"))
    variables = {}
    for col, kind in (("params", nnx.Param), ("batch_stats", nnx.BatchStat)):
        state = nnx.state(model, kind)
        variables[col] = net_variables_like(state.to_pure_dict(), 62 if col == "params" else 63)
        nnx.replace_by_pure_dict(state, variables[col])
        nnx.update(model, state)
    originals = [model.bn1.to_nnx__module, model.bn2.to_nnx__module]
    assert snnx.convert(model, axis_name=AXIS) is model

    graphdef, params, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    mesh = jax.make_mesh((2,), (AXIS,), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))

    def body(params, x, stats, rest):  # every state an argument: ToNNX counts its rng draws
        net = nnx.merge(graphdef, params, stats, rest)
        return net(x), nnx.state(net, nnx.BatchStat).to_pure_dict()

    # check_vma=False, as pmap runs: nothing would stop per-device statistics going out as P()
    # Under jit: run eagerly, shard_map compiled each primitive apart (436 programs, 13 s);
    # the eager path is groups_pmap_and_mesh_axis's
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS), P(), P()), out_specs=(P(AXIS), P()),
                                 check_vma=False))
    (y, new_stats), pullback = jax.vjp(lambda p, x: step(p, x, stats, rest), params, jnp.asarray(concat(x)))
    dparams, dx = pullback((jnp.asarray(concat(dy)), jax.tree.map(jnp.zeros_like, new_stats)))
    dparams = dparams.to_pure_dict()
    ref_y, ref_stats, ref_dx, ref_dparams = net_oracle(variables, concat(x), concat(dy), layers, True)
    info = {"y": assert_close("y", y, ref_y, TOL["float32"]), "dx": assert_close("dx", dx, ref_dx, TOL["float32"])}
    for path, (mean, var), dp in zip(layers, ref_stats, ref_dparams):
        name = "/".join(path)
        assert_close(f"{name} mean", get_in(new_stats, path)["mean"], mean, TOL["float32"])
        assert_close(f"{name} var", get_in(new_stats, path)["var"], var, TOL["float32"])
        for k in ("scale", "bias"):
            info[f"{name} d{k}"] = assert_close(f"{name} d{k}", get_in(dparams, path)[k], dp[k], TOL["float32"])
    assert snnx.revert(model) is model
    assert model.bn1.to_nnx__module is originals[0] and model.bn2.to_nnx__module is originals[1]
    return info


def net_variables_like(tree, seed):
    """``tree`` (nested dicts of scale/bias or mean/var arrays) with every value redrawn, as
    :func:`net_variables` draws them."""
    import jax.numpy as jnp
    from flax import traverse_util

    rng = np.random.default_rng(seed)
    draw = {"scale": (0.5, 1.5), "bias": (-1, 1), "mean": (-1, 1), "var": (0.5, 2)}
    flat = traverse_util.flatten_dict(tree)
    flat = {k: jnp.asarray(rng.uniform(*draw[k[-1]], np.shape(v)).astype(np.float32)) for k, v in flat.items()}
    return traverse_util.unflatten_dict(flat)


@check
def linen_convert_variables_and_revert():
    """A converted linen model has exactly the original's variable tree (paths, shapes,
    dtypes, and the same initial values for the same key), also as a submodule of a
    parent (setup and compact); variables are interchangeable both ways;
    revert(convert(m)) is m with every field equal, also after converting twice, and the
    converted model reads the model's fields (those it does not share with the wrapper); nnx
    models and a positional axis name are TypeErrors, not no-ops."""
    import dataclasses
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf

    Net, Deep = linen_models()

    class ParentSetup(nn.Module):
        sync: bool

        def setup(self):
            self.body = sf.convert(Net(), axis_name=AXIS) if self.sync else Net()

        def __call__(self, x):
            return self.body.encode(self.body(x))  # a forwarded method too

    class ParentCompact(nn.Module):
        sync: bool

        @nn.compact
        def __call__(self, x):
            deep = Deep()
            return (sf.convert(deep, axis_name=AXIS) if self.sync else deep)(x)

    x, _ = two_device_batch(53)
    key = jax.random.PRNGKey(3)
    spec = lambda tree: jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda a: (a.shape, a.dtype), tree))
    info = {}
    for plain, converted in ((Net(), sf.convert(Net(), axis_name=AXIS)),
                             (Deep(), sf.convert(Deep())),
                             (nn.BatchNorm(use_running_average=False), sf.convert(nn.BatchNorm(use_running_average=False))),
                             (ParentSetup(False), ParentSetup(True)), (ParentCompact(False), ParentCompact(True))):
        name = type(plain).__name__
        v_plain, v_conv = plain.init(key, x[0]), converted.init(key, x[0])
        assert spec(v_plain) == spec(v_conv), (name, spec(v_plain), spec(v_conv))
        for a, b in zip(jax.tree.leaves(v_plain), jax.tree.leaves(v_conv)):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
        # the variables are interchangeable: each model runs on the other's
        y_conv = jax.pmap(lambda x: converted.apply(v_plain, x, mutable=["batch_stats"])[0], axis_name=AXIS,
                          devices=jax.devices()[:2])(x)
        y_plain = jax.pmap(lambda x: plain.apply(v_conv, x, mutable=["batch_stats"])[0], axis_name=AXIS,
                           devices=jax.devices()[:2])(x)
        assert np.isfinite(np.asarray(y_conv)).all() and np.isfinite(np.asarray(y_plain)).all(), name
        info[name] = len(jax.tree.leaves(v_plain))

    for original in (Net(), Deep(), nn.BatchNorm(use_running_average=False, momentum=0.7, axis_name="mine",
                                                 axis_index_groups=[[0, 1]])):
        once = sf.convert(original, axis_name=AXIS, axis_index_groups=[[0, 1]])
        twice = sf.convert(once, axis_name="other")
        assert twice.axis_name == "other", twice
        for field in dataclasses.fields(original):  # the model's fields read through the wrapper
            if field.name not in ("axis_name", "axis_index_groups", "name", "parent"):
                assert getattr(twice, field.name) == getattr(original, field.name), field.name
        for back in (sf.revert(once), sf.revert(twice)):
            assert back is original, (back, original)
            assert type(back) is type(original)
            for field in dataclasses.fields(original):
                assert getattr(back, field.name) == getattr(original, field.name), field.name
        assert sf.revert(original) is original  # nothing to revert
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                     sf.revert(sf.convert(Net())).init(key, x[0]), Net().init(key, x[0])))

    for bad, call, hint in ((nnx.BatchNorm(3, rngs=nnx.Rngs(0)), sf.convert, "syncbn.flax.nnx.convert"),
                            ("d", sf.convert, "by keyword"),
                            (nnx.BatchNorm(3, rngs=nnx.Rngs(0)), sf.revert, "syncbn.flax.nnx.revert")):
        try:
            call(bad)
        except TypeError as err:
            assert hint in str(err), err
        else:
            raise AssertionError(f"{call.__name__}({type(bad).__name__}) did not raise")
    return info


@check
def linen_convert_records_as_the_model():
    """What Flax records of a call is the model's, not the wrapper's: with
    capture_intermediates (Flax's filter and one taking every method, with
    method='encode' too) a converted model, at the top and as a submodule, gives the
    plain model's intermediates (one '__call__' entry per module, not two: the wrapper
    shares the model's scope; the values are syncbn's, so within float32's tolerance of
    Flax's), and tabulate names the model's class on its row."""
    import jax
    import flax.linen as nn
    import syncbn.flax as sf

    Net, _ = linen_models()

    class Parent(nn.Module):
        body: nn.Module

        def __call__(self, x):
            return self.body(x) * 2

    x, _ = two_device_batch(56)
    x = x[0]
    shapes = lambda tree: jax.tree_util.tree_flatten_with_path(jax.tree.map(np.shape, tree))[0]
    everything = lambda module, name: True
    info = {}
    for label, plain, converted in (("top", Net(), sf.convert(Net())),
                                    ("submodule", Parent(Net()), Parent(sf.convert(Net())))):
        variables = plain.init(jax.random.PRNGKey(0), x)
        runs = [("flax filter", {}, True)]
        if label == "top":
            runs += [("every method", {}, everything), ("encode", {"method": "encode"}, everything)]
        for run, kw, capture in runs:
            want = plain.apply(variables, x, capture_intermediates=capture, mutable=["intermediates", "batch_stats"],
                               **kw)[1]["intermediates"]
            got = converted.apply(variables, x, capture_intermediates=capture, mutable=["intermediates", "batch_stats"],
                                  **kw)[1]["intermediates"]
            assert shapes(got) == shapes(want), (label, run, shapes(got), shapes(want))
            info[f"{label} {run}"] = max(assert_close(f"{label} {run} {i}", a, b, TOL["float32"])
                                         for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))))
    table = Parent(sf.convert(Net())).tabulate(jax.random.PRNGKey(0), x, console_kwargs={"width": 240})
    assert "Synchronized" not in table and " Net " in table, table[-3000:]
    return info


@check
def linen_context_retraces_cached_functions():
    """with syncbn.flax.convert(axis_name=...): around a pmap'd training step traced
    before, outside the context: inside it the step is traced again and synchronized
    (equal to the function form); after it, plain Flax again (per-device statistics);
    entering the context again reuses the trace made inside (2 traces in all)."""
    import jax
    import syncbn.flax as sf

    Net, _ = linen_models()
    plain = Net()
    x, dy = two_device_batch(54)
    variables = net_variables(plain, x[0], 55)
    traces = []

    def replica(x):
        traces.append(1)
        return plain.apply(variables, x, mutable=["batch_stats"])[0]

    step = jax.pmap(replica, axis_name=AXIS, devices=jax.devices()[:2])
    local = np.asarray(step(x))
    synced = np.asarray(jax.pmap(lambda x: sf.convert(plain, axis_name=AXIS).apply(
        variables, x, mutable=["batch_stats"])[0], axis_name=AXIS, devices=jax.devices()[:2])(x))
    y, *_ = net_oracle(variables, concat(x), concat(dy), NET_LAYERS, True)
    info = {"synchronized vs oracle": assert_close("function form", concat(synced), y, TOL["float32"])}
    assert not np.allclose(local, synced, atol=1e-2), "the plain step must not be synchronized"
    for attempt in range(2):
        with sf.convert(axis_name=AXIS):
            inside = np.asarray(step(x))
        info[f"inside {attempt}"] = assert_close(f"inside the context ({attempt})", inside, synced, 1e-6)
        outside = np.asarray(step(x))
        assert np.array_equal(outside, local), f"after the context ({attempt}): not plain Flax again"
    assert len(traces) == 2, f"{len(traces)} traces: one outside, one inside, each reused"
    return info


@check
def nnx_revert_restores_every_field():
    """nnx: model = convert(model, axis_name=...) returns the same object and replaces
    every nnx.BatchNorm (a shared one in both places); revert(model) returns it with
    plain layers whose every attribute equals the original's (axis_name and
    axis_index_groups included, no extra one), holding the very same Variables with
    unchanged values; the reverted model then runs on one device, outside any
    pmap/shard_map (no unbound axis name); a model that is itself a BatchNorm is
    returned replaced."""
    import jax.numpy as jnp
    from flax import nnx
    import syncbn.flax.nnx as snnx

    default_promote = nnx.BatchNorm(1, rngs=nnx.Rngs(0)).promote_dtype

    def custom_promote(args, /, *, dtype=None, inexact=True):
        return default_promote(args, dtype=dtype, inexact=inexact)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, momentum=0.7, epsilon=1e-3, use_fast_variance=False, rngs=rngs)
            self.alias = self.bn
            self.blocks = nnx.List([
                nnx.BatchNorm(4, axis_name="own", axis_index_groups=((0, 1),), use_bias=False,
                              param_dtype=jnp.float32, dtype=jnp.float32, promote_dtype=custom_promote, rngs=rngs),
                nnx.Linear(4, 4, rngs=rngs),
                nnx.BatchNorm(4, use_scale=False, use_running_average=True, rngs=rngs)])

    net = Net(nnx.Rngs(0))
    layers = [net.bn, net.blocks[0], net.blocks[2]]
    for i, layer in enumerate(layers):
        layer.mean[...] = jnp.arange(4.0) + i
    config = lambda layer: {k: v for k, v in vars(layer).items()
                            if not k.startswith("_pytree__") and not isinstance(v, nnx.Variable)}
    fields = {"num_features", "use_running_average", "axis", "momentum", "epsilon", "dtype", "param_dtype",
              "use_bias", "use_scale", "axis_name", "axis_index_groups", "use_fast_variance", "promote_dtype"}
    assert set(config(layers[0])) >= fields, fields - set(config(layers[0]))  # what is compared below
    before = [config(layer) for layer in layers]
    variables = [{k: v for k, v in vars(layer).items() if isinstance(v, nnx.Variable)} for layer in layers]
    values = [{k: np.asarray(v[...]) for k, v in vs.items()} for vs in variables]

    assert snnx.convert(net, axis_name=AXIS, axis_index_groups=((0, 1), (2, 3))) is net
    now = [net.bn, net.blocks[0], net.blocks[2]]
    assert all(type(layer) is snnx.BatchNorm for layer in now) and net.alias is net.bn, now
    assert all(layer.axis_name == AXIS and layer.axis_index_groups == ((0, 1), (2, 3)) for layer in now)
    assert snnx.revert(net) is net
    back = [net.bn, net.blocks[0], net.blocks[2]]
    assert net.alias is net.bn
    for i, layer in enumerate(back):
        assert type(layer) is nnx.BatchNorm, type(layer)
        got = config(layer)
        assert set(got) == set(before[i]), (i, set(got) ^ set(before[i]))
        for k, want in before[i].items():
            assert got[k] is want or got[k] == want, (i, k, got[k], want)
        for k, var in variables[i].items():
            assert getattr(layer, k) is var, (i, k)
            assert np.array_equal(np.asarray(var[...]), values[i][k]), (i, k)
    net.blocks[0].axis_name = net.blocks[0].axis_index_groups = None  # the one layer built with an axis
    x = jnp.asarray(np.random.default_rng(61).standard_normal((6, 3)) + 2, jnp.float32)
    y = net.blocks[2](net.blocks[0](net.bn(net.lin(x))))
    assert np.isfinite(np.asarray(y)).all()

    single = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    converted = snnx.convert(single, axis_name=AXIS)
    assert type(converted) is snnx.BatchNorm and converted.scale is single.scale
    reverted = snnx.revert(converted)
    assert type(reverted) is nnx.BatchNorm and reverted.axis_name is None and reverted.scale is single.scale
    reverted(x[:, :1].repeat(4, 1))  # one device, no axis name
    return {"layers": len(back)}


@check
def nnx_convert_reaches_every_container():
    """nnx.convert reaches every nnx.BatchNorm the graph holds, wherever: a tuple, a
    namedtuple, a list and a dict under nnx.data (nested too), nnx.List, nnx.Dict, one
    layer shared by three of them (one new layer in all three places); each keeps its
    Variables and synchronizes over axis_name, and a pmapped call on the tuple's layer
    matches one call on the concatenated batch. A user subclass of syncbn's layer keeps
    its class and code and takes the axis (revert gives its axis back). A user subclass
    of flax.nnx.BatchNorm cannot be converted without dropping its code: TypeError
    naming its path and class, and nothing changed. revert undoes the rest."""
    import collections
    import jax
    import jax.numpy as jnp
    from flax import nnx
    import syncbn.flax.nnx as snnx

    Pair = collections.namedtuple("Pair", "layer tag")

    class ReluBN(snnx.BatchNorm):
        def __call__(self, x, **kw):
            return nnx.relu(super().__call__(x, **kw))

    class Net(nnx.Module):
        def __init__(self, extra=None):
            make = lambda: nnx.BatchNorm(3, use_running_average=False, rngs=nnx.Rngs(0))
            shared = make()
            self.pair = nnx.data((make(), shared))
            self.named = nnx.data(Pair(make(), "tag"))
            self.plain = nnx.data([make(), {"inner": make(), "again": (shared,)}])
            self.blocks = nnx.List([make(), shared])
            self.table = nnx.Dict(norm=make())
            self.mine = ReluBN(3, use_running_average=False, rngs=nnx.Rngs(0))
            if extra is not None:
                self.extra = extra

    def batch_norms(model):
        return [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.BatchNorm)]

    net = Net()
    variables = {path: id(node) for path, node in nnx.iter_graph(net) if isinstance(node, nnx.Variable)}
    assert snnx.convert(net, axis_name=AXIS) is net
    layers = batch_norms(net)
    assert len(layers) == 8, [path for path, _ in layers]
    for path, layer in layers:
        assert isinstance(layer, snnx.BatchNorm) and layer.axis_name == AXIS, (path, type(layer), layer.axis_name)
    assert type(net.mine) is ReluBN
    assert net.pair[1] is net.blocks[1] is net.plain[1]["again"][0]
    assert type(net.named) is Pair and net.named.tag == "tag"
    assert {path: id(node) for path, node in nnx.iter_graph(net) if isinstance(node, nnx.Variable)} == variables

    # the tuple's layer is synchronized: pmapped over 4 devices equals one call on all rows
    x = jnp.asarray(np.random.default_rng(23).standard_normal((DEVICES, 5, 3)) * 2 + 1, jnp.float32)
    def pmapped(layer):
        graphdef, state = nnx.split(layer)
        return jax.pmap(lambda x, state: nnx.merge(graphdef, state)(x), axis_name=AXIS, in_axes=(0, None))(x, state)

    y = pmapped(net.pair[0])
    single = nnx.BatchNorm(3, use_running_average=False, rngs=nnx.Rngs(0))
    want = single(x.reshape(-1, 3))
    # the same float32 statistics, merged differently: a few roundings of values of order 1
    err = assert_close("tuple layer y", np.asarray(y).reshape(-1, 3), np.asarray(want), TOL["float32"])
    assert float(jnp.min(pmapped(net.mine))) == 0.0  # its ReLU ran

    assert snnx.revert(net) is net
    for path, layer in batch_norms(net):
        want_type = ReluBN if path == ("mine",) else nnx.BatchNorm
        assert type(layer) is want_type and layer.axis_name is None, (path, type(layer), layer.axis_name)
    from syncbn.flax.convert import _AXIS_BEFORE  # where nnx's conversion keeps the axis it replaced

    assert not hasattr(net.mine, _AXIS_BEFORE)

    class OwnBN(nnx.BatchNorm):  # a subclass of Flax's layer: its code would be lost
        def __call__(self, x, **kw):
            return nnx.relu(super().__call__(x, **kw))

    net = Net(extra=nnx.data((OwnBN(3, rngs=nnx.Rngs(0)),)))
    try:
        snnx.convert(net, axis_name=AXIS)
    except TypeError as error:
        assert "OwnBN" in str(error) and "extra/0" in str(error) and "syncbn.flax.nnx.BatchNorm" in str(error), error
    else:
        raise AssertionError("a subclass of flax.nnx.BatchNorm was left unsynchronized")
    assert all(type(layer) in (nnx.BatchNorm, ReluBN, OwnBN) and layer.axis_name is None
               for _, layer in batch_norms(net)), "convert changed the model before raising"
    return {"layers": len(layers), "tuple layer y": err}


@check
def convert_groups_need_axis_name():
    """axis_index_groups passed to a conversion without axis_name (linen model and context
    forms, nnx) raise ValueError naming axis_name, and the nnx model is left unchanged.
    Before, the groups were dropped in silence: layers built with axis_name synchronized
    over all 4 devices under pmap, not within the two groups asked for."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    groups = [[0, 1], [2, 3]]
    layer = nn.BatchNorm(use_running_average=False, axis_name=AXIS)
    x = jnp.asarray(np.random.default_rng(29).standard_normal((DEVICES, 3, 2)) + np.arange(DEVICES)[:, None, None],
                    jnp.float32)
    variables = layer.init(jax.random.PRNGKey(0), x[0])

    def grouped(model):  # what the groups ask for, for the message below
        return jax.pmap(lambda x: model.apply(variables, x, mutable=["batch_stats"])[0], axis_name=AXIS)(x)

    within = grouped(sf.convert(layer, axis_name=AXIS, axis_index_groups=groups))
    everywhere = grouped(sf.convert(layer, axis_name=AXIS))
    assert not np.allclose(within, everywhere, atol=1e-2), "the groups must change the statistics"

    def raises(make, label):
        try:
            made = make()
            if label == "context":
                made.__enter__()
        except ValueError as error:
            assert "axis_index_groups" in str(error) and "axis_name" in str(error), (label, error)
        else:
            raise AssertionError(f"{label}: groups without axis_name were accepted (and ignored)")

    raises(lambda: sf.convert(layer, axis_index_groups=groups), "linen model")
    raises(lambda: sf.convert(axis_index_groups=groups), "context")
    net = nnx.Sequential(nnx.BatchNorm(2, axis_name=AXIS, rngs=nnx.Rngs(0)))
    raises(lambda: snnx.convert(net, axis_index_groups=groups), "nnx")
    assert type(net.layers[0]) is nnx.BatchNorm and net.layers[0].axis_index_groups is None
    return {}


# ----------------------------------------------------------------------------- deployment (jax.export)


def exported_outputs(fn, *args):
    """``fn(*args)`` through ``jax.export`` (exported, serialized, deserialized, called)."""
    import jax

    exported = jax.export.deserialize(jax.export.export(jax.jit(fn))(*args).serialize())
    return exported.call(*args)


@check
def nnx_convert_carries_what_was_set_on_a_layer():
    """What a user set on an nnx.BatchNorm beside its own fields (a Variable, an array under
    nnx.data, a submodule, a plain value) is on the converted layer and on the reverted one,
    held alike (node or static), so the model's state keeps every entry: convert dropped
    them (the state lost the layer's extra Variables, a checkpoint no longer matched)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    import syncbn.flax.nnx as snnx

    layer = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    layer.steps = nnx.BatchStat(jnp.zeros((), jnp.int32))
    layer.extra = nnx.data(jnp.arange(3.0))
    layer.probe = nnx.Linear(4, 2, rngs=nnx.Rngs(1))
    layer.tag = "encoder"
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(2)), layer)
    nodes = dict(layer._pytree__nodes)

    def entries(m):
        return sorted(str(path) for path, _ in nnx.to_flat_state(nnx.state(m)))

    before = entries(model)
    assert {"('layers', 1, 'steps')", "('layers', 1, 'extra')", "('layers', 1, 'probe', 'kernel')"} <= set(before), before
    for step, change in (("convert", lambda m: snnx.convert(m, axis_name=AXIS)), ("revert", snnx.revert)):
        change(model)
        got = model.layers[1]
        assert type(got) is (snnx.BatchNorm if step == "convert" else nnx.BatchNorm), (step, type(got))
        assert entries(model) == before, (step, set(entries(model)) ^ set(before))
        assert got.steps is layer.steps and got.probe is layer.probe and got.tag == "encoder", step
        assert np.array_equal(np.asarray(got.extra), np.arange(3.0)), step
        assert {k: v for k, v in got._pytree__nodes.items() if k in nodes} == nodes, step
    assert not hasattr(model.layers[1], "axis_before_convert")
    return {"entries": len(before)}


@check
def jax_export_eval_and_training():
    """Deployment through ``jax.export``. Evaluation (use_running_average=True) of a
    converted linen model and a converted nnx model exports and gives exactly what Flax's
    BatchNorm gives exported the same way. A training call outside any named axis (no
    pmap / shard_map binding axis_name) is not exported with local statistics: it raises
    JAX's unbound-axis NameError naming the axis, as Flax's layer does. A synchronized
    training step under shard_map exports with its backward (``vjp_order=1``): after
    serialization its output, running statistics and gradients equal the float64 oracle
    on the whole batch, and ``jit(..., donate_argnums=...)`` of it gives the same values."""
    import jax
    import jax.numpy as jnp
    import flax.linen as nn
    from flax import nnx
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
    import syncbn.flax as sf
    import syncbn.flax.nnx as snnx

    rng = np.random.default_rng(61)
    x = jnp.asarray(rng.standard_normal((8, 3)) * 2 + 3, jnp.float32)

    class Eval(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            h = nn.BatchNorm(use_running_average=not train, axis_name=AXIS, momentum=MOMENTUM, epsilon=EPS)(x)
            return nn.BatchNorm(use_running_average=not train, axis_name=AXIS, momentum=MOMENTUM, epsilon=EPS)(h * h)

    plain = Eval()
    model = sf.convert(plain, axis_name=AXIS)
    variables = net_variables(plain, x, 62)
    want = exported_outputs(lambda v, x: plain.apply(v, x), variables, x)
    got = exported_outputs(lambda v, x: model.apply(v, x), variables, x)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg="linen eval export")

    class Pair(nnx.Module):  # string keys all the way down: jax.export serializes its state
        def __init__(self):
            bn = lambda: nnx.BatchNorm(3, axis_name=AXIS, momentum=MOMENTUM, epsilon=EPS, rngs=nnx.Rngs(0))
            self.first, self.second = bn(), bn()

        def __call__(self, x):
            h = self.first(x)
            return self.second(h * h)

    stats = [(rng.uniform(-1, 1, 3), rng.uniform(0.5, 2, 3)) for _ in range(2)]
    nets = {"flax": Pair(), "syncbn": snnx.convert(Pair())}
    for net in nets.values():
        for layer, (mean, var) in zip((net.first, net.second), stats):
            layer.mean[...], layer.var[...] = jnp.asarray(mean, jnp.float32), jnp.asarray(var, jnp.float32)
    outs = {}
    for name, net in nets.items():
        net.eval()
        graph, state = nnx.split(net)

        def infer(pure, x, graph=graph, state=state):  # a plain dict of arrays crosses the export
            nnx.replace_by_pure_dict(state, pure)
            return nnx.merge(graph, state)(x)

        outs[name] = exported_outputs(infer, nnx.to_pure_dict(state), x)
    assert np.isfinite(np.asarray(outs["syncbn"])).all()
    np.testing.assert_array_equal(np.asarray(outs["syncbn"]), np.asarray(outs["flax"]), err_msg="nnx eval export")

    # training outside any named axis: a clear error, never local statistics
    net = nets["syncbn"]
    net.train()
    graph, state = nnx.split(net)
    for label, fn, args in (
            ("linen", lambda v, x: model.apply(v, x, True, mutable=["batch_stats"]), (variables, x)),
            ("nnx", lambda s, x: nnx.merge(graph, s)(x), (state, x))):
        try:
            jax.export.export(jax.jit(fn))(*args)
        except NameError as err:
            assert "unbound axis name" in str(err) and AXIS in str(err), (label, err)
        else:
            raise AssertionError(f"{label}: a training call outside any named axis exported")

    # a synchronized training step under shard_map, exported with its backward
    Net, _ = linen_models()
    plain = Net()
    model = sf.convert(plain, axis_name=AXIS)
    xs, dy = two_device_batch(63)
    xs, dy = concat(xs), concat(dy)
    variables = net_variables(plain, xs[:4], 64)
    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,), axis_types=(AxisType.Auto,))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))

    def step(params, stats, x):
        y, upd = model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])
        return y, upd["batch_stats"]

    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(AXIS), P()))
    args = (put(variables["params"], P()), put(variables["batch_stats"], P()), put(jnp.asarray(xs), P(AXIS)))
    exported = jax.export.deserialize(jax.export.export(jax.jit(sharded))(*args).serialize(vjp_order=1))
    (y, stats), pullback = jax.vjp(lambda p, x: exported.call(p, args[1], x), args[0], args[2])
    dparams, dx = pullback((put(jnp.asarray(dy), P(AXIS)), jax.tree.map(jnp.zeros_like, stats)))
    ref_y, ref_stats, ref_dx, ref_dparams = net_oracle(variables, xs, dy, NET_LAYERS, True)
    info = {"y": assert_close("exported y", y, ref_y, TOL["float32"]),
            "dx": assert_close("exported dx", dx, ref_dx, TOL["float32"])}
    for path, (mean, var), dp in zip(NET_LAYERS, ref_stats, ref_dparams):
        name = "/".join(path)
        assert_close(f"exported {name} mean", get_in(stats, path)["mean"], mean, TOL["float32"])
        assert_close(f"exported {name} var", get_in(stats, path)["var"], var, TOL["float32"])
        for k in ("scale", "bias"):
            info[f"{name} d{k}"] = assert_close(f"exported {name} d{k}", get_in(dparams, path)[k], dp[k],
                                                TOL["float32"])
    kept = jax.jit(sharded)(*args)
    donated = jax.jit(sharded, donate_argnums=(0, 1))(*jax.tree.map(jnp.copy, args))
    for a, b in zip(jax.tree.leaves(donated), jax.tree.leaves(kept)):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg="donate_argnums")
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
