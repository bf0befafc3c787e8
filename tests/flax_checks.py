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


# ----------------------------------------------------------------------------- shard_map / jit


def mesh_1d():
    import jax

    return jax.make_mesh((DEVICES,), (AXIS,))


def global_step(model, case, mesh, spec, wrap_shard_map):
    """One training call on the global batch (``W*B`` leading), batch sharded over the
    mesh axis, parameters and statistics replicated; under ``shard_map`` when
    ``wrap_shard_map`` else plain ``jit`` (XLA makes the reductions global)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    variables = flax_variables(case)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    x = put(jnp.asarray(concat(case["x"]), case["dtype"]), spec)
    mask = None if case["mask"] is None else put(jnp.asarray(concat(case["mask"])), spec)
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

    dy = put(jnp.asarray(concat(case["dy"])), spec)
    args = (x, params, mask, dy, jnp.asarray(case["d_mean"][0]), jnp.asarray(case["d_var"][0]))
    compiled = jax.jit(run).lower(*args).compile()
    (y, mean, var), (dx, dparams) = compiled(*args)
    assert len(x.sharding.device_set) == DEVICES, x.sharding
    got = dict(y=np.asarray(y, np.float64), mean=np.asarray(mean), var=np.asarray(var),
               dx=np.asarray(dx, np.float64), dscale=np.asarray(dparams["scale"]), dbias=np.asarray(dparams["bias"]))
    return got, compiled.as_text()


def global_cases(wrap_shard_map):
    from jax.sharding import PartitionSpec as P
    from syncbn.flax import BatchNorm

    info = {}
    mesh = mesh_1d()
    for i, (layout, dtype, masked) in enumerate(cases()):
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
    reductions, same stable algorithm."""
    return global_cases(False)


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


def count_all_reduces(hlo: str) -> int:
    """All-reduce instructions in compiled HLO text (async pairs count once)."""
    import re

    return len(re.findall(r"= [^=\n]*\ball-reduce(?:-start)?\(", hlo))


@check
def collective_counts():
    """Compiled HLO of one training step: exactly one all-reduce forward and one more
    for forward + backward under pmap (parameters passed per device, so pmap adds no
    gradient reduction of its own) and shard_map (replicated parameters: their total
    gradient comes out of the layer's backward psum); none in the forward with
    use_running_average=True. Under jit with a sharded batch the count XLA chose is
    reported (not asserted: XLA owns those)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from syncbn.flax import BatchNorm

    case = make_case(3, "channels_last", "float32", True)
    variables = flax_variables(case)
    x, mask = jnp.asarray(case["x"]), jnp.asarray(case["mask"])
    params = jax.tree.map(lambda a: jnp.broadcast_to(a, (DEVICES,) + a.shape), variables["params"])
    info = {}
    for train in (True, False):
        key = "train" if train else "eval"
        model = BatchNorm(use_running_average=not train, axis_name=AXIS)

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
        info[f"pmap {key} forward"] = count_all_reduces(fwd)
        info[f"pmap {key} forward+backward"] = count_all_reduces(both)
        want = (1, 2) if train else (0, 0)
        assert (info[f"pmap {key} forward"], info[f"pmap {key} forward+backward"]) == want, info

        _, hlo = global_step(model, case, mesh_1d(), P(AXIS), True)
        info[f"shard_map {key} forward+backward"] = count_all_reduces(hlo)
        if train:
            assert info[f"shard_map {key} forward+backward"] == 2, info
        model_jit = BatchNorm(use_running_average=not train)
        _, hlo = global_step(model_jit, case, mesh_1d(), P(AXIS), False)
        info[f"jit-sharded {key} forward+backward (XLA)"] = count_all_reduces(hlo)
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
