"""The Triton kernels compiled for a GPU (sm_90: H100/H200) on a machine without one:
Triton's compiler runs on the host down to the cubin (``triton.compile`` with a target),
so code that only the interpreter would accept (the CPU tests of test_kernels.py run
there) fails here. Each kernel in the variants the layers launch: every input dtype,
with and without affine parameters, running buffers, activation and kept channels."""

import inspect
import itertools
import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from syncbn.torch import kernels  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
INPUTS = ["fp32", "fp16", "bf16", "fp64"]


def _compute(dtype):
    return "fp64" if dtype == "fp64" else "fp32"


def _compile(name, signature, constexprs):
    kernels._triton()
    fn = triton.jit(getattr(kernels, name))
    if "constexprs" in inspect.signature(ASTSource).parameters:
        for key, value in constexprs.items():
            signature[key] = "constexpr"
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    else:  # Triton 3.0 (torch 2.4's): parameters by position, the constexprs as constants
        where = fn.arg_names.index
        source = ASTSource(fn=fn, signature={where(k): v for k, v in signature.items()},
                           constants={where(k): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=TARGET, options=dict(kernels.COMPILE_OPTIONS))
    assert compiled.asm.get("cubin"), name
    return compiled.asm["ptx"]


def _ints(*names):
    return {n: "i32" for n in names}


def _variants():
    for dtype in INPUTS:
        ct = _compute(dtype)
        yield ("_moment_partials_kernel", {"x_ptr": f"*{dtype}", "part_ptr": "*fp64",
                                           **_ints("C", "S", "T", "SB", "s_n", "s_c", "s_s", "tiles_per_prog")},
               {"BLOCK_R": 64, "BLOCK_C": 32, "EXTREMES": dtype in ("fp32", "fp64")})
        for act, keep, affine in itertools.product((0, 1, 2), (False, True), (False, True)):
            if keep and not act:
                continue
            yield ("_normalize_kernel", {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "w_ptr": "*fp32", "b_ptr": "*fp32",
                                         "stats_ptr": f"*{ct}", "scalar_ptr": "*fp64", "slot_ptr": "*i32",
                                         "keep_ptr": f"*{dtype}",
                                         **_ints("C", "S", "SB", "s_n", "s_c", "s_s", "y_n", "y_c", "y_s", "k_n", "k_c",
                                                 "k_s")},
                   {"BLOCK_R": 16, "BLOCK_C": 64, "HAS_W": affine, "HAS_B": affine, "ACT": act, "KEEP": keep})
        for mode, keep in ((0, False), (1, False), (1, True), (2, False), (2, True)):
            common = {"dy_ptr": f"*{dtype}", "src_ptr": f"*{dtype}", "stats_ptr": f"*{ct}", "scalar_ptr": "*fp64",
                      "w_ptr": "*fp32", "b_ptr": "*fp32", "slot_ptr": "*i32", "keep_ptr": f"*{dtype}"}
            flags = {"MODE": mode, "HAS_W": True, "HAS_B": mode >= 1, "KEEP": keep}
            yield ("_grad_partials_kernel", {**common, "part_ptr": "*fp64",
                                             **_ints("C", "S", "T", "SB", "d_n", "d_c", "d_s", "s_n", "s_c", "s_s",
                                                     "k_n", "k_c", "k_s", "tiles_per_prog")},
                   {"BLOCK_R": 64, "BLOCK_C": 16, **flags})
            yield ("_input_grad_kernel", {**common, "sum_ptr": f"*{ct}", "count_ptr": "*fp64", "agree_ptr": f"*{ct}",
                                          "ok_ptr": "*i1", "fit_ptr": "*i1", "dx_ptr": f"*{dtype}",
                                          **_ints("C", "S", "SB", "d_n", "d_c", "d_s", "s_n", "s_c", "s_s", "k_n",
                                                  "k_c", "k_s", "o_n", "o_c", "o_s")},
                   {"SIZE": 18, "LANES": 32, "BLOCK_R": 64, "BLOCK_C": 16, **flags})
    for ct in ("fp32", "fp64"):
        for mode in (0, 1, 2):
            for has_fits in (False, True) if mode else (False,):
                yield ("_grad_payload_kernel", {"part_ptr": "*fp64", "fixed_ptr": f"*{ct}", "stats_ptr": f"*{ct}",
                                                "fits_ptr": "*i1" if has_fits else "*fp32", "out_ptr": f"*{ct}",
                                                "dw_ptr": "*fp32", "db_ptr": "*fp32", **_ints("C", "P")},
                       {"SIZE": 18, "LANES": 32, "BLOCK": 128, "MODE": mode, "WIDE_W": ct == "fp64", "WIDE_B": False,
                        "HAS_FITS": has_fits})
        for running, choose, elu in itertools.product((False, True), (False, True), (False, True)):
            if elu and not choose:
                continue
            yield ("_merge_kernel", {"sum_ptr": "*fp64", "agree_ptr": "*fp64", "scalar_ptr": "*fp64",
                                     "mom_ptr": "*fp64",
                                     "rm_ptr": "*fp32", "rv_ptr": "*fp32", "stats_ptr": f"*{ct}", "ok_ptr": "*i1",
                                     "w_ptr": "*fp32", "b_ptr": "*fp32", "slot_ptr": "*i32", "fits_ptr": "*i1",
                                     "ext_ptr": "*fp64", **_ints("C", "capacity")},
                   {"SIZE": 18, "LANES": 32, "BLOCK": 256, "HAS_RM": running, "HAS_RV": running, "CHOOSE": choose,
                    "HAS_W": choose, "HAS_B": choose, "WIDE": ct == "fp64", "ELU": elu})
    for extremes in (False, True):
        yield ("_moment_payload_kernel", {"part_ptr": "*fp64", "fixed_ptr": "*fp64", "out_ptr": "*fp64",
                                          "ext_ptr": "*fp64", **_ints("C", "P", "n")},
               {"SIZE": 18, "LANES": 32, "BLOCK": 256, "EXTREMES": extremes})


VARIANTS = list(_variants())


@pytest.mark.parametrize("name,signature,constexprs", VARIANTS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(VARIANTS)])
def test_kernel_compiles_for_sm90(name, signature, constexprs):
    """It compiles, and every floating-point division in it rounds once, to nearest, as
    the interpreter's (numpy's) do: Triton's float32 ``/`` becomes PTX's approximate
    ``div.full.f32`` (up to 2 ulp), which only a compiled kernel would show; nor is any
    other float32 operation approximate (``tl.exp`` of a float32 is ``ex2.approx.f32``).
    (libdevice's float64 ``log`` seeds its Newton steps with ``rcp.approx.ftz.f64``.)"""
    ptx = _compile(name, dict(signature), dict(constexprs))
    assert re.findall(r"\bdiv\.(?:approx|full)\.[\w.]+", ptx) == [], name
    assert re.findall(r"\b\w+\.approx\.(?:ftz\.)?f32\b", ptx) == [], name
    # compiled with the launchers' options, no a * b + c becomes one fused multiply-add (the
    # interpreter rounds both); only the transcendental functions of ELU (libdevice's exp and
    # log, fused by design) hold any
    if not _transcendental(constexprs):
        assert re.findall(r"\bfma\.[\w.]+", ptx) == [], name


def _transcendental(constexprs):
    return constexprs.get("ACT") == 2 or constexprs.get("MODE") == 2 or constexprs.get("ELU", False)


@pytest.mark.filterwarnings("error")
def test_launchers_have_shapes_for_torch_compile():
    """Each launcher is a custom operator with a fake implementation: under fake tensors
    (what torch.compile traces with) every one gives its outputs' shapes and dtypes
    without running a kernel, and without a warning (the row layout read a fake tensor's
    data pointer: torch warned every compiling user that this "will error")."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 6, 4, 5, dtype=torch.float16)
        fixed = torch.empty(18, dtype=torch.float64)
        partials = kernels.moment_partials(x)
        payload = kernels.moment_payload(partials, fixed, 40)
        assert payload.shape == (18 + 1 + 12,) and payload.dtype == torch.float64
        scalars, momentum = torch.empty(4, dtype=torch.float64), torch.empty(1, dtype=torch.float64)
        rm, rv, w = torch.empty(6), torch.empty(6), torch.empty(6)
        stats, ok, slots, fits = kernels.merge(payload, fixed, scalars, momentum, rm, rv, torch.float32, w, w, 1)
        assert stats.shape == (3, 6) and stats.dtype == torch.float32 and ok.dtype == torch.bool
        assert slots.shape == (6,) and slots.dtype == torch.int32
        y, keep = kernels.normalize(x, w, w, stats, scalars, 1, slots, 1)
        assert y.shape == x.shape and y.dtype == x.dtype and keep.shape == (2, 1, 4, 5)
        grads = kernels.grad_partials(x, y, stats, scalars, w, w, slots, keep, mode=1)
        out, dw, db = kernels.grad_payload(grads, fixed.float(), stats, 1, torch.float32, torch.float32, fits)
        assert out.shape == (18 + 12 + 1,) and dw.shape == db.shape == (6,)  # + the rank's overflow
        dx, ok, fit = kernels.input_grad(x, y, stats, scalars, w, w, slots, keep, out, payload[18], fixed.float(), 1)
        assert dx.shape == x.shape and dx.dtype == x.dtype and ok.dtype == fit.dtype == torch.bool and fit.dim() == 0
        out0 = kernels.grad_payload(grads, fixed.float(), stats, 0, torch.float32, torch.float32)[0]
        assert out0.shape == (18 + 12 + 1,)  # SyncBatchNorm: the same length, its overflow 0
        fit0 = kernels.input_grad(x, x, stats, scalars, w, None, None, None, out0, payload[18], fixed.float(), 0)[2]
        assert fit0.dtype == torch.bool and fit0.dim() == 0  # SyncBatchNorm reads the summed overflow too
        x32 = x.float()  # ELU: the local extremes from the moments' pass
        payload, local = kernels.moment_payload(kernels.moment_partials(x32, True), fixed, 40, True)
        assert payload.shape == (18 + 1 + 12,) and local.shape == (2, 6) and local.dtype == torch.float64
        assert kernels.merge(payload, fixed, scalars, momentum, rm, rv, torch.float32, w, w, 1, local)[2].shape == (6,)


@pytest.mark.parametrize("version,takes", [((3, 0), False), ((3, 3), False), (None, False), ((3, 4), True),
                                           ((4, 0), True)])
def test_the_kernels_take_only_a_tested_triton(monkeypatch, version, takes):
    """Below the [triton] extra's floor (Triton 3.0 comes with torch 2.4: its interpreter
    could not run the kernels, so they were never tested there), or where no distribution
    gives Triton's version, the layers keep the torch-op path on CUDA (they took the
    kernels with any Triton)."""
    monkeypatch.setattr(kernels, "_triton_version", lambda: version)
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    kernels._installed.cache_clear()
    try:
        assert kernels.available("cuda") is takes
    finally:
        kernels._installed.cache_clear()
