r"""Triton kernels of the synchronized layers' GPU path: four launches forward (five per
layer call with the module's ``num_batches_tracked += 1``), three backward, no host
read (the torch-op CUDA path of :mod:`syncbn.torch.stats` is the fallback wherever
these do not apply).

Every input is seen as a strided (N, C, S) tensor (S the product of the spatial dims; any
strides, so the standard layout, channels-last and channels-last-3d take the same code).
A tile is ``BLOCK_R`` plane positions of one sample by ``BLOCK_C`` channels; where the
samples follow one another in memory (channels-last, 2-D) they fold into one plane of
``N * S`` positions. Per layer call:

forward
    1. :func:`moment_partials` (one pass over x): each program sums ``t = x - K`` and
       ``t^2`` over its share of the rows, ``K = x[0, c, 0]`` (this rank's first element
       of the channel), in float64 (for ELU also each channel's minimum and maximum, in the
       same pass);
    2. :func:`moment_payload`: adds the programs' partials and writes the all-reduce
       payload, ``[fingerprint, n, sum x, sum x^2]`` in float64 (the payload of every
       other path: ``sum x = n K + sum t``, ``sum x^2 = sum t^2 + K (2 sum t + n K)``);
    3. (the all-reduce) then :func:`merge`: the fingerprint's verdict, ``mean = S1 / N``,
       ``var = S2 / N - mean^2``, ``invstd`` and the running buffers (moved only where the
       verdict is good and ``N > 1``: a group whose ranks are all empty, ``N = 0``, keeps
       them as they are, its statistics finite zeros), all in float64; the normalizing
       statistics are written as ``[mean_hi, mean_lo, invstd]`` in the compute dtype, ``mean_hi + mean_lo``
       the float64 mean to twice the compute precision;
    4. :func:`normalize`: ``y = act(((x - mean_hi) - mean_lo) * invstd * w + b)``
       (ELU's ``alpha expm1(z)`` in float64, Kahan's ``(e^z - 1) z / log e^z``; its inverse
       in the backward kernels, ``log1p``, likewise: accurate to a few ulp without libdevice,
       which Triton's interpreter lacks).

backward
    1. :func:`grad_partials` (one pass over dy and x, or dy and the output y of the
       activated layer): ``sum dy`` and ``sum dy (x - mean)`` (``sum dz``, ``sum dz xhat``
       for the activated layer) per program, in float64;
    2. :func:`grad_payload`: the payload ``[fingerprint, sum dy, sum dy (x - mean),
       overflow]`` in the compute dtype, for both layers (the activated layer's ``sum dz
       xhat`` divided by ``invstd``), the same as every other path's, so that a plain and
       an activated layer of one fingerprint (one fused on some ranks only) sum alike;
       ``overflow`` is the activated layer's kept-channel overflow on this rank, 0 or 1 (so
       that the all-reduce counts the ranks that ran out of kept channels), always 0 for
       the plain layer; and the local weight and bias gradients;
    3. (the all-reduce) then :func:`input_grad`: ``dx`` in one pass, the backward
       verdict and whether the summed overflow is zero, the same on every rank (both layers:
       beside a plain layer, a layer fused on another rank may have overflowed).

**Error analysis of the local moments.** ``x`` (float32 or half: a float32 value; float64)
is converted to float64 exactly; ``t = x - K`` in float64 is exact for float32 inputs (two
24-bit significands whose difference fits in 53 bits) and within ``2^-53 |t|`` for float64
inputs. ``t^2`` is exact for float32 inputs (48 bits). The sums over a program's tiles
run in float64 lanes of a tile (each lane adds one term per tile) and are added up by a
tree, then over the programs in float64: a relative error of at most ``L 2^-53`` of
``sum |t|`` and ``sum t^2`` with ``L`` the longest chain (the tiles per program plus a
few dozen: at most a few thousand), about 1e-13. Since ``K`` is a sample of the
channel, ``|t|`` is of the order of the standard deviation whatever ``|mean|``: nothing
cancels when ``|mean| >> std``. The payload then
holds ``sum x^2`` in float64, rounded at ``2^-53 n mean^2``: the merged variance
``S2 / N - mean^2`` loses ``~2^-53 (|mean| / std)^2`` relative, 1e-8 at ``|mean| / std =
1e4`` (the bar: 1e-6), the same as the CPU path. torch's float32 statistics kernel,
which this replaces on CUDA, loses ``~u |mean| / std`` in the mean (u = 2^-24) and 3.6e-5 in
the merged variance at 1e4 (measured on an H200).

**Normalizing.** ``x - mean_hi`` is exact where ``|mean| >> std`` (two close float32
values), and ``mean_lo`` carries the float64 mean's remaining bits, so the output is
within a few ``u`` of ``(x - mean) * invstd * w + b`` at any offset (torch's
``x * scale + shift`` form loses ``u |mean| / std``).

**Kernels on the CPU.** With ``TRITON_INTERPRET=1`` set before Triton is first imported,
Triton runs these kernels on CPU tensors through its interpreter: :func:`available` says
whether a tensor's device can take them in this process, and :func:`enable_interpreter`
sets the variable while Triton is still unimported (tests, ``syncbn bench``'s counts).

Each launch is a custom operator ``syncbn::triton_*`` (one recorded operation per kernel
launch, so ``syncbn.bench.cuda_counts`` counts launches honestly, and opaque to
``torch.compile``). Importing this module imports neither Triton nor registers anything.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Optional

import torch

from .layout import memory_format

__all__ = [
    "available",
    "interpreting",
    "enable_interpreter",
    "supports",
    "SIZE_LIMIT",
    "MAX_CHANNEL_BLOCKS",
    "COMPILE_OPTIONS",
    "channel_blocks_fit",
    "moment_partials",
    "moment_payload",
    "merge",
    "normalize",
    "grad_partials",
    "grad_payload",
    "input_grad",
    "ACTIVATION_CODES",
]

# activation codes of the kernels (the activated layer's names)
ACTIVATION_CODES = {"none": 0, "identity": 0, "leaky_relu": 1, "elu": 2}
# the fingerprint's values are loaded as one block of this many lanes
_FIXED_LANES = 32
# the kernels index with 64-bit offsets, but keep the row count in 32-bit program ids
SIZE_LIMIT = 2**31 - 1
# the channel blocks of a launch lie along its grid's second axis, at most 65535 on CUDA; an
# input with more (see channel_blocks_fit) keeps the torch-op path
MAX_CHANNEL_BLOCKS = 65535
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# Triton is imported on first use (:func:`_triton`), not here: its first import fixes
# whether the process interprets kernels (``TRITON_INTERPRET`` is read then).
triton = None
tl = None  # bound by _triton(): the kernels' source refers to it as a global


# the oldest Triton the kernels are tested with (the ``[triton]`` extra's floor): Triton
# 3.0 (torch 2.4's) compiles them, but its interpreter read their ``tl.constexpr``
# annotations as plain arguments and could not apply ``~`` to a mask, so no test has ever
# run them there; an older Triton leaves the layers on the torch-op path
MIN_TRITON = (3, 4)


def _find_spec() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _triton_version():
    """Triton's version as a tuple of ints from its distribution's metadata (so without
    importing it), or None where no distribution says (``pytorch-triton`` builds too)."""
    import importlib.metadata
    import re

    for dist in ("triton", "pytorch-triton", "triton-nightly"):
        try:
            text = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        found = re.match(r"(\d+)\.(\d+)", text)
        if found:
            return tuple(int(part) for part in found.groups())
    return None


@functools.lru_cache(maxsize=None)
def _installed() -> bool:
    """Triton importable, at :data:`MIN_TRITON` or newer."""
    try:
        if not _find_spec():
            return False
    except (ImportError, ValueError):  # pragma: no cover
        return False
    version = _triton_version()
    return version is not None and version >= MIN_TRITON


def _triton():
    """Import Triton (once) and bind ``tl`` and the kernels' helper functions."""
    global triton, tl, _elu_inverse, _affine, _div
    if triton is None:
        import triton as _t
        import triton.language as _tl

        triton, tl = _t, _tl
        _elu_inverse = _t.jit(_elu_inverse_source)
        _affine = _t.jit(_affine_source)
        _div = _t.jit(_div_source)
    return triton


def interpreting() -> bool:
    """Whether Triton runs (or, once imported, will run) kernels through its interpreter
    in this process: ``TRITON_INTERPRET`` was set when Triton was first imported."""
    if "triton" in sys.modules:
        try:
            from triton import knobs
        except ImportError:  # Triton before 3.4: the variable, read at import
            pass
        else:
            return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def enable_interpreter() -> bool:
    """Set ``TRITON_INTERPRET=1`` if Triton is installed and not yet imported in this
    process (so that CPU tensors can take the kernels); returns :func:`interpreting`.
    Importing torch's compiler (``torch._dynamo``, which ``syncbn.torch`` does) imports
    Triton, so in practice the variable must be in the environment when the process
    starts (tests and ``python -m syncbn.bench.cuda_counts`` spawn their workers so)."""
    if _installed() and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    return _installed() and interpreting()


def available(device) -> bool:
    """Whether the kernels can run on ``device`` in this process: Triton installed (at
    :data:`MIN_TRITON` or newer), and a CUDA device with Triton compiling, or the CPU with
    Triton interpreting."""
    if not _installed():
        return False
    kind = torch.device(device).type
    if kind == "cuda":
        return not interpreting()
    return kind == "cpu" and interpreting()


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: 2-D to 5-D, a float32/float16/bfloat16/float64
    input of at most ``SIZE_LIMIT`` elements, whose channel blocks fit a launch grid
    (:func:`channel_blocks_fit`), on a device :func:`available` admits."""
    return (x.dtype in _DTYPES and 2 <= x.dim() <= 5 and x.numel() <= SIZE_LIMIT
            and channel_blocks_fit(x) and available(x.device))


def channel_blocks_fit(x: torch.Tensor) -> bool:
    """Whether every launch over ``x`` has at most ``MAX_CHANNEL_BLOCKS`` channel blocks,
    its grid's second axis (CUDA's limit there; the interpreter has none, and applies it
    alike so that CPU runs take the path a GPU would). The channels a tile holds are
    :func:`_tiles`'s for every kernel's tile size and for the plane as it is and as
    :func:`_rows` may fold the samples into it (the fewest of those): 64 where the channels
    are the contiguous dim (channels-last, 2-D), else fewer the larger the plane (one for
    planes of 1024 positions and more)."""
    channels = x.shape[1] if x.dim() >= 2 else 0
    if channels <= MAX_CHANNEL_BLOCKS:
        return True
    spatial = x.numel() // max(x.shape[0] * channels, 1)
    block_c = min(_tiles(channels, plane, (0, x.stride(1), 1), size)[1]
                  for size in (1024, 2048) for plane in (spatial, x.shape[0] * spatial))
    return -(-channels // block_c) <= MAX_CHANNEL_BLOCKS


# ---- layout -------------------------------------------------------------------------


def _strides(t: torch.Tensor):
    """``(sN, sC, sS)``: the strides of ``t`` seen as (N, C, S), S the flattened spatial
    dims (for a 2-D input S = 1). The spatial dims must flatten without a copy (true of
    every dense layout: standard, channels-last, channels-last-3d)."""
    if t.dim() == 2:
        return t.stride(0), t.stride(1), 1
    # read from the strides, not data pointers: torch.compile's fake tensors have none (and
    # warn that they will raise)
    if not flattenable(t):  # pragma: no cover - callers pass dense tensors
        raise ValueError("syncbn kernels: the spatial dims must flatten without a copy")
    flat = t.flatten(2)
    return flat.stride(0), flat.stride(1), flat.stride(2)


def flattenable(t: torch.Tensor) -> bool:
    """Whether ``t``'s spatial dims flatten to one without a copy (see :func:`_strides`)."""
    if t.dim() <= 3:
        return True
    spatial = list(zip(t.shape[2:], t.stride()[2:]))
    for (size, stride), (inner_size, inner_stride) in zip(spatial, spatial[1:]):
        if size > 1 and inner_size > 1 and stride != inner_stride * inner_size:
            return False
    return True


def _pow2(v: int) -> int:
    return 1 << max(0, int(v) - 1).bit_length()


def _rows(*tensors) -> tuple:
    """``(N, S, strides...)``: the row space of the kernels, (sample, plane position),
    and the (n, c, s) strides of each tensor. Where every tensor has its samples one
    after another in memory (``s_n == S * s_s``: channels-last, 2-D), the samples fold
    into the plane, ``(1, N * S)``: the rows of a tile then run through memory with one
    stride, whatever the sample."""
    t = tensors[0]
    n, spatial = t.shape[0], t.numel() // max(t.shape[0] * t.shape[1], 1)
    strides = [_strides(u) for u in tensors]
    if n > 1 and all(s_n == spatial * s_s for s_n, _, s_s in strides):
        return (1, n * spatial, *[(0, s_c, s_s) for _, s_c, s_s in strides])
    return (n, spatial, *strides)


def _tiles(channels: int, spatial: int, strides, size: int = 2048) -> tuple:
    """``(BLOCK_R, BLOCK_C)``: about ``size`` elements a tile (2048 for the elementwise
    kernels, 1024 for the reductions, whose two float64 accumulators per element would
    otherwise take 200-240 registers a thread on sm_90: 100-160 at 1024, no spills),
    channels along the fast axis when they are the contiguous dim (channels-last, 2-D),
    plane positions otherwise (a tile never spans two samples: small planes take more
    channels a tile)."""
    s_n, s_c, s_s = strides
    if s_c == 1 and channels > 1:
        block_c = min(_pow2(channels), 64, size // 16)
    else:
        block_c = min(_pow2(channels), max(1, size // _pow2(max(spatial, 1))), 16)
    block_r = max(1, min(size // block_c, _pow2(max(spatial, 1))))
    return block_r, block_c


def _programs(device, channel_blocks: int, tiles: int) -> int:
    """How many programs share a channel block's tiles in the reduction kernels."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
        per_block = max(1, target // max(channel_blocks, 1))
    else:  # the interpreter: a few, so the combination of programs is always exercised
        per_block = 2
    return max(1, min(per_block, tiles))


# ---- the kernels (plain functions, compiled by _kernel on first use) ----------------

_elu_inverse = None  # bound by _triton(): _elu_inverse_source, compiled
_affine = None  # bound by _triton(): _affine_source, compiled
_div = None  # bound by _triton(): _div_source, compiled


def _affine_source(w_ptr, b_ptr, cols, cmask, BLOCK: tl.constexpr, HAS_W: tl.constexpr,
                   HAS_B: tl.constexpr):
    # a block of the weight and bias in float64; an absent weight reads as 1, a bias as 0
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=1.0).to(tl.float64)
    else:
        w = tl.full([BLOCK], 1.0, tl.float64)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float64)
    else:
        b = tl.zeros([BLOCK], dtype=tl.float64)
    return w, b


def _div_source(a, b):
    # a / b rounded once, to nearest, as every other path divides: Triton compiles a float32
    # ``/`` to an approximate division on NVIDIA GPUs (PTX ``div.full.f32``, up to 2 ulp; the
    # interpreter divides exactly), so float32 goes through ``div_rn`` (``div.rn.f32``), which
    # takes operands of one shape (a scalar ``b`` is broadcast, exactly); float64 ``/`` is
    # already ``div.rn.f64``
    if a.dtype == tl.float32:
        return tl.math.div_rn(a, tl.broadcast_to(b.to(tl.float32), a.shape))
    else:
        return a / b


def _elu_inverse_source(y, alpha):
    # log1p(y / alpha) for float64 y <= 0 (Kahan: log(w) v / (w - 1), w = 1 + v, exact to a
    # few ulp given log); y = -alpha gives -inf and y < -alpha NaN, as torch's log1p
    v = y / alpha
    w = 1.0 + v
    fine = (w != 1.0) & (w > 0.0)
    safe = tl.where(fine, w, 0.5)
    return tl.where(w == 1.0, v, tl.where(w > 0.0, tl.log(safe) * v / (safe - 1.0), tl.log(tl.where(w > 0.0, 1.0, w))))



def _moment_partials_kernel(x_ptr, part_ptr, C, S, T, SB, s_n, s_c, s_s, tiles_per_prog,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EXTREMES: tl.constexpr):
    # T tiles of BLOCK_R plane positions of one sample; SB tiles a sample
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    coff = cols.to(tl.int64) * s_c
    shift = tl.load(x_ptr + coff, mask=cmask, other=0.0).to(tl.float64)  # x[0, c, 0]
    acc1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    if EXTREMES:  # the local minimum and maximum (ELU's kept-channel choice), from K, a value of x
        low = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64) + shift[None, :]
        high = low
    start = p * tiles_per_prog
    stop = tl.minimum(start + tiles_per_prog, T)
    for tile in range(start, stop):
        n = tile // SB
        pos = (tile - n * SB) * BLOCK_R + tl.arange(0, BLOCK_R)
        roff = n.to(tl.int64) * s_n + pos.to(tl.int64) * s_s
        mask = (pos < S)[:, None] & cmask[None, :]
        v = tl.load(x_ptr + roff[:, None] + coff[None, :], mask=mask, other=0.0).to(tl.float64)
        t = tl.where(mask, v - shift[None, :], 0.0)
        acc1 += t
        acc2 += t * t
        if EXTREMES:
            low = tl.minimum(low, tl.where(mask, v, shift[None, :]))
            high = tl.maximum(high, tl.where(mask, v, shift[None, :]))
    base = part_ptr + (1 + 2 * p) * C
    tl.store(base + cols, tl.sum(acc1, axis=0), mask=cmask)
    tl.store(base + C + cols, tl.sum(acc2, axis=0), mask=cmask)
    if EXTREMES:  # rows 1 + 2P + 2p, 2 + 2P + 2p
        ext = part_ptr + (1 + 2 * tl.num_programs(0) + 2 * p) * C
        tl.store(ext + cols, tl.min(low, axis=0), mask=cmask)
        tl.store(ext + C + cols, tl.max(high, axis=0), mask=cmask)
    tl.store(part_ptr + cols, shift, mask=cmask & ((cols * 0 + p) == 0))


def _moment_payload_kernel(part_ptr, fixed_ptr, out_ptr, ext_ptr, C, P, n,
                           SIZE: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr, EXTREMES: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < C
    shift = tl.load(part_ptr + cols, mask=cmask, other=0.0)
    s1 = tl.zeros([BLOCK], dtype=tl.float64)
    s2 = tl.zeros([BLOCK], dtype=tl.float64)
    for p in range(0, P):
        base = part_ptr + (1 + 2 * p) * C
        s1 += tl.load(base + cols, mask=cmask, other=0.0)
        s2 += tl.load(base + C + cols, mask=cmask, other=0.0)
    if EXTREMES:  # this rank's minimum and maximum per channel: (2, C), not communicated
        low = shift
        high = shift
        for p in range(0, P):
            ext = part_ptr + (1 + 2 * P + 2 * p) * C
            low = tl.minimum(low, tl.load(ext + cols, mask=cmask, other=0.0))
            high = tl.maximum(high, tl.load(ext + C + cols, mask=cmask, other=0.0))
        tl.store(ext_ptr + cols, low, mask=cmask)
        tl.store(ext_ptr + C + cols, high, mask=cmask)
    count = tl.zeros([], dtype=tl.float64) + n
    tl.store(out_ptr + SIZE + 1 + cols, count * shift + s1, mask=cmask)
    tl.store(out_ptr + SIZE + 1 + C + cols, s2 + shift * (2.0 * s1 + count * shift), mask=cmask)
    lanes = tl.arange(0, LANES)
    lead = (lanes * 0 + pid) == 0  # (a vector: the interpreter takes no scalar in a vector mask)
    head = (lanes < SIZE) & lead
    tl.store(out_ptr + lanes, tl.load(fixed_ptr + lanes, mask=head, other=0.0), mask=head)
    tl.store(out_ptr + SIZE + lanes, tl.where(lanes == 0, count, 0.0), mask=(lanes == 0) & lead)


def _merge_kernel(sum_ptr, agree_ptr, scalar_ptr, mom_ptr, rm_ptr, rv_ptr, stats_ptr, ok_ptr,
                  w_ptr, b_ptr, slot_ptr, fits_ptr, ext_ptr, C, capacity,
                  SIZE: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr,
                  HAS_RM: tl.constexpr, HAS_RV: tl.constexpr, CHOOSE: tl.constexpr,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, WIDE: tl.constexpr, ELU: tl.constexpr):
    # WIDE: float64 running buffers; others are stored from float32 (a float64 value
    # goes through float32 on its way to half: Triton's interpreter rounds float64 to
    # bfloat16 wrongly)
    lanes = tl.arange(0, LANES)
    head = lanes < SIZE
    got = tl.load(sum_ptr + lanes, mask=head, other=0.0)
    want = tl.load(agree_ptr + lanes, mask=head, other=0.0)
    ok = tl.sum(tl.where(head & (got != want), 1, 0), axis=0) == 0
    count = tl.load(sum_ptr + SIZE)
    eps = tl.load(scalar_ptr)
    budget = tl.load(scalar_ptr + 2)
    floor = tl.load(scalar_ptr + 3)
    momentum = tl.load(mom_ptr).to(tl.float64)
    update = (ok & (count > 1.0)).to(tl.int32)
    unbias = count / tl.maximum(count - 1.0, 1.0)
    held = tl.maximum(count, 1.0)  # N = 0 (every rank empty, the sums 0): zeros, not 0 / 0
    taken = tl.zeros([], dtype=tl.int32)
    for first in range(0, C, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        cmask = cols < C
        moving = cmask & ((cols * 0 + update) == 1)
        s1 = tl.load(sum_ptr + SIZE + 1 + cols, mask=cmask, other=0.0)
        s2 = tl.load(sum_ptr + SIZE + 1 + C + cols, mask=cmask, other=0.0)
        mean = s1 / held
        # negative rounding residue to 0; a NaN (a NaN or infinity in the channel's input)
        # stays NaN, as torch's statistics and running variance: tl.maximum returned the 0
        var = s2 / held - mean * mean
        var = tl.where(var < 0.0, 0.0, var)
        invstd = 1.0 / tl.sqrt(var + eps)
        hi = mean.to(stats_ptr.dtype.element_ty)
        lo = (mean - hi.to(tl.float64)).to(stats_ptr.dtype.element_ty)
        tl.store(stats_ptr + cols, hi, mask=cmask)
        tl.store(stats_ptr + C + cols, lo, mask=cmask)
        tl.store(stats_ptr + 2 * C + cols, invstd.to(stats_ptr.dtype.element_ty), mask=cmask)
        if HAS_RM:
            old = tl.load(rm_ptr + cols, mask=cmask, other=0.0).to(tl.float64)
            new = old + momentum * (mean - old)
            if WIDE:
                tl.store(rm_ptr + cols, new, mask=moving)
            else:
                tl.store(rm_ptr + cols, new.to(tl.float32).to(rm_ptr.dtype.element_ty), mask=moving)
        if HAS_RV:
            old = tl.load(rv_ptr + cols, mask=cmask, other=0.0).to(tl.float64)
            new = old + momentum * (var * unbias - old)
            if WIDE:
                tl.store(rv_ptr + cols, new, mask=moving)
            else:
                tl.store(rv_ptr + cols, new.to(tl.float32).to(rv_ptr.dtype.element_ty), mask=moving)
        if CHOOSE:
            # channels whose xhat the stored output cannot give back within the budget:
            # (|b| + floor) / |w| > budget, w = 0 included; each takes the next free slot
            ws, bs = _affine(w_ptr, b_ptr, cols, cmask, BLOCK, HAS_W, HAS_B)
            w = tl.abs(ws)
            hard = (~((tl.abs(bs) + floor) <= budget * w)) & cmask
            if ELU:
                # also exp(-z_min) (1 + tiny / alpha) / |w| > budget: z_min = b + w (x_ext - mean)
                # invstd is this rank's most negative pre-activation (x_ext its local minimum
                # where w >= 0, else its maximum), where ELU's inverse amplifies rounding most
                low = tl.load(ext_ptr + cols, mask=cmask, other=0.0)
                high = tl.load(ext_ptr + C + cols, mask=cmask, other=0.0)
                z_min = bs + ws * ((tl.where(ws >= 0, low, high) - mean) * invstd)
                grow = tl.exp(-z_min) * (1.0 + floor / tl.load(scalar_ptr + 1))
                # and exp(-z_min) > limit (1 / (8 eps)): the output is within an eighth of its
                # own rounding of -alpha, or at it, where the first-order bound fails
                fine = (grow <= budget * w) & (grow <= tl.load(scalar_ptr + 4))
                hard = hard | ((~fine) & cmask)
            flags = tl.where(hard, 1, 0)
            order = taken + tl.cumsum(flags, axis=0) - 1
            slot = tl.where(hard & (order < capacity), order, -1)
            tl.store(slot_ptr + cols, slot.to(tl.int32), mask=cmask)
            taken += tl.sum(flags, axis=0)
    tl.store(ok_ptr, ok)
    if CHOOSE:
        tl.store(fits_ptr, taken <= capacity)


def _normalize_kernel(x_ptr, y_ptr, w_ptr, b_ptr, stats_ptr, scalar_ptr, slot_ptr, keep_ptr,
                      C, S, SB, s_n, s_c, s_s, y_n, y_c, y_s, k_n, k_c, k_s,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_W: tl.constexpr,
                      HAS_B: tl.constexpr, ACT: tl.constexpr, KEEP: tl.constexpr):
    tile = tl.program_id(0)
    n = (tile // SB).to(tl.int64)
    s = ((tile - (tile // SB) * SB) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (s < S)[:, None] & cmask[None, :]
    ct = stats_ptr.dtype.element_ty
    hi = tl.load(stats_ptr + cols, mask=cmask, other=0.0)
    lo = tl.load(stats_ptr + C + cols, mask=cmask, other=0.0)
    scale = tl.load(stats_ptr + 2 * C + cols, mask=cmask, other=0.0)
    if HAS_W:
        scale = scale * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ct)
    if HAS_B:
        shift = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ct)
    else:
        shift = tl.zeros([BLOCK_C], dtype=ct)
    c64 = cols.to(tl.int64)
    raw = tl.load(x_ptr + (n * s_n + s * s_s)[:, None] + (c64 * s_c)[None, :], mask=mask, other=0.0)
    z = ((raw.to(ct) - hi[None, :]) - lo[None, :]) * scale[None, :] + shift[None, :]
    if ACT == 1:
        slope = tl.load(scalar_ptr + 1).to(ct)
        z = tl.where(z >= 0, z, z * slope)
    if ACT == 2:  # ELU: alpha expm1(z) for z <= 0, in float64 (Kahan's expm1: (u - 1) z / log u)
        zn = tl.where(z > 0, 0.0, z.to(tl.float64))
        u = tl.exp(zn)
        d = u - 1.0
        em1 = tl.where(d == 0.0, zn, tl.where(u == 0.0, -1.0, d * zn / tl.log(tl.where((d != 0.0) & (u != 0.0), u, 0.5))))
        z = tl.where(z > 0, z, (tl.load(scalar_ptr + 1) * em1).to(ct))
    if KEEP:  # the chosen channels' inputs, for an exact backward
        slot = tl.load(slot_ptr + cols, mask=cmask, other=-1)
        kmask = mask & (slot >= 0)[None, :]
        koff = (n * k_n + s * k_s)[:, None] + (tl.maximum(slot, 0).to(tl.int64) * k_c)[None, :]
        tl.store(keep_ptr + koff, raw, mask=kmask)
    tl.store(y_ptr + (n * y_n + s * y_s)[:, None] + (c64 * y_c)[None, :], z.to(y_ptr.dtype.element_ty), mask=mask)


def _grad_partials_kernel(dy_ptr, src_ptr, stats_ptr, scalar_ptr, w_ptr, b_ptr, slot_ptr, keep_ptr, part_ptr,
                          C, S, T, SB, d_n, d_c, d_s, s_n, s_c, s_s, k_n, k_c, k_s, tiles_per_prog,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, MODE: tl.constexpr,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, KEEP: tl.constexpr):
    # MODE 0: sums of dy and dy (x - mean) from x; MODE 1 (the activated layer, src = y;
    # leaky_relu of slope scalars[1], identity slope 1), MODE 2 (ELU, alpha scalars[1]):
    # sums of dz and dz xhat with z = act^-1(y), xhat = (z - b) / w, or from the kept x
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    c64 = cols.to(tl.int64)
    hi = tl.load(stats_ptr + cols, mask=cmask, other=0.0).to(tl.float64)
    lo = tl.load(stats_ptr + C + cols, mask=cmask, other=0.0).to(tl.float64)
    if MODE >= 1:
        invstd = tl.load(stats_ptr + 2 * C + cols, mask=cmask, other=0.0).to(tl.float64)
        slope = tl.load(scalar_ptr + 1)
        w, b = _affine(w_ptr, b_ptr, cols, cmask, BLOCK_C, HAS_W, HAS_B)
        recip = tl.where(w != 0, 1.0 / tl.where(w != 0, w, 1.0), 0.0)
        if KEEP:
            slot = tl.load(slot_ptr + cols, mask=cmask, other=-1)
        else:
            slot = tl.full([BLOCK_C], -1, tl.int32)
        kept = slot >= 0
    acc1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float64)
    start = p * tiles_per_prog
    stop = tl.minimum(start + tiles_per_prog, T)
    for tile in range(start, stop):
        n = (tile // SB).to(tl.int64)
        s = ((tile - (tile // SB) * SB) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (s < S)[:, None] & cmask[None, :]
        dy = tl.load(dy_ptr + (n * d_n + s * d_s)[:, None] + (c64 * d_c)[None, :], mask=mask,
                     other=0.0).to(tl.float64)
        if MODE == 0:
            v = tl.load(src_ptr + (n * s_n + s * s_s)[:, None] + (c64 * s_c)[None, :], mask=mask,
                        other=0.0).to(tl.float64)
            acc1 += dy
            acc2 += dy * ((v - hi[None, :]) - lo[None, :])
        else:
            out_mask = mask & (~kept)[None, :]
            y = tl.load(src_ptr + (n * s_n + s * s_s)[:, None] + (c64 * s_c)[None, :], mask=out_mask,
                        other=0.0).to(tl.float64)
            if MODE == 2:  # ELU, alpha = slope: z = log1p(y / alpha) for y < 0, dz = dy (y + alpha)
                z = tl.where(y >= 0, y, _elu_inverse(y, slope))
                dz = tl.where(y <= 0, dy * (y + slope), dy)
            else:
                z = tl.where(y >= 0, y, y / slope)
            xhat = (z - b[None, :]) * recip[None, :]
            if KEEP:
                koff = (n * k_n + s * k_s)[:, None] + (tl.maximum(slot, 0).to(tl.int64) * k_c)[None, :]
                v = tl.load(keep_ptr + koff, mask=mask & kept[None, :], other=0.0).to(tl.float64)
                xk = ((v - hi[None, :]) - lo[None, :]) * invstd[None, :]
                xhat = tl.where(kept[None, :], xk, xhat)
                z = tl.where(kept[None, :], w[None, :] * xk + b[None, :], z)
            if MODE == 2:  # the kept channels: the slope at z itself, alpha exp(z)
                if KEEP:
                    dz = tl.where(kept[None, :], tl.where(z > 0, dy, dy * (slope * tl.exp(tl.where(z > 0, 0.0, z)))),
                                  dz)
            else:
                dz = tl.where(z > 0, dy, dy * slope)
            dz = tl.where(mask, dz, 0.0)
            acc1 += dz
            acc2 += dz * xhat
    base = part_ptr + (2 * p) * C
    tl.store(base + cols, tl.sum(acc1, axis=0), mask=cmask)
    tl.store(base + C + cols, tl.sum(acc2, axis=0), mask=cmask)


def _grad_payload_kernel(part_ptr, fixed_ptr, stats_ptr, fits_ptr, out_ptr, dw_ptr, db_ptr, C, P,
                         SIZE: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr,
                         WIDE_W: tl.constexpr, WIDE_B: tl.constexpr, HAS_FITS: tl.constexpr):
    # WIDE_W, WIDE_B: float64 parameter gradients; others through float32 (see _merge_kernel).
    # The payload is [fixed, sum dy, sum dy (x - mean), overflow] in every mode (2C + SIZE + 1
    # values, the general paths' too), so that a plain and an activated layer of one
    # fingerprint sum alike; overflow, out[SIZE + 2C], is this rank's kept-channel overflow
    # (1 where fits_ptr, the merge kernel's flag, is false; 0 without HAS_FITS, and always 0
    # in MODE 0)
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < C
    s1 = tl.zeros([BLOCK], dtype=tl.float64)
    s2 = tl.zeros([BLOCK], dtype=tl.float64)
    for p in range(0, P):
        base = part_ptr + (2 * p) * C
        s1 += tl.load(base + cols, mask=cmask, other=0.0)
        s2 += tl.load(base + C + cols, mask=cmask, other=0.0)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + SIZE + cols, s1.to(ty), mask=cmask)
    invstd = tl.load(stats_ptr + 2 * C + cols, mask=cmask, other=1.0).to(tl.float64)
    if MODE == 0:  # s2 = sum dy (x - mean), sent as it is; the weight gradient sum dy xhat = invstd s2
        tl.store(out_ptr + SIZE + C + cols, s2.to(ty), mask=cmask)
        s2 = s2 * invstd
    else:  # s2 = sum dz xhat, the weight gradient; sent as sum dz (x - mean) = s2 / invstd (invstd > 0)
        tl.store(out_ptr + SIZE + C + cols, (s2 / invstd).to(ty), mask=cmask)
    if WIDE_W:
        tl.store(dw_ptr + cols, s2, mask=cmask)
    else:
        tl.store(dw_ptr + cols, s2.to(tl.float32).to(dw_ptr.dtype.element_ty), mask=cmask)
    if WIDE_B:
        tl.store(db_ptr + cols, s1, mask=cmask)
    else:
        tl.store(db_ptr + cols, s1.to(tl.float32).to(db_ptr.dtype.element_ty), mask=cmask)
    lanes = tl.arange(0, LANES)
    head = (lanes < SIZE) & ((lanes * 0 + pid) == 0)
    tl.store(out_ptr + lanes, tl.load(fixed_ptr + lanes, mask=head, other=0.0), mask=head)
    if MODE >= 1:
        if HAS_FITS:
            over = tl.where(tl.load(fits_ptr), 0.0, 1.0)
        else:
            over = (pid * 0).to(tl.float32)
    else:  # the plain layer never runs out of kept channels
        over = (pid * 0).to(tl.float32)
    tl.store(out_ptr + SIZE + 2 * C, over.to(ty), mask=pid == 0)


def _input_grad_kernel(dy_ptr, src_ptr, stats_ptr, scalar_ptr, w_ptr, b_ptr, slot_ptr, keep_ptr, sum_ptr,
                       count_ptr, agree_ptr, ok_ptr, fit_ptr, dx_ptr,
                       C, S, SB, d_n, d_c, d_s, s_n, s_c, s_s, k_n, k_c, k_s, o_n, o_c, o_s,
                       SIZE: tl.constexpr, LANES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       MODE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, KEEP: tl.constexpr):
    tile = tl.program_id(0)
    n = (tile // SB).to(tl.int64)
    s = ((tile - (tile // SB) * SB) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (s < S)[:, None] & cmask[None, :]
    ct = stats_ptr.dtype.element_ty
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
    lanes = tl.arange(0, LANES)
    head = lanes < SIZE
    got = tl.load(sum_ptr + lanes, mask=head, other=0.0)
    want = tl.load(agree_ptr + lanes, mask=head, other=0.0)
    tl.store(ok_ptr, tl.sum(tl.where(head & (got != want), 1, 0), axis=0) == 0, mask=first)
    # the group's summed kept-channel overflow (grad_payload's last value): none. The plain
    # layer reads it too: beside it (a model fused on some ranks only) an activated layer
    # of another rank may have run out of kept channels, and every rank raises alike
    tl.store(fit_ptr, tl.load(sum_ptr + SIZE + 2 * C) == 0, mask=first)
    count = tl.load(count_ptr).to(ct)
    hi = tl.load(stats_ptr + cols, mask=cmask, other=0.0)
    lo = tl.load(stats_ptr + C + cols, mask=cmask, other=0.0)
    invstd = tl.load(stats_ptr + 2 * C + cols, mask=cmask, other=0.0)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(ct)
    else:
        w = tl.full([BLOCK_C], 1.0, ct)
    g1 = _div(tl.load(sum_ptr + SIZE + cols, mask=cmask, other=0.0).to(ct), count)
    g2 = _div(tl.load(sum_ptr + SIZE + C + cols, mask=cmask, other=0.0).to(ct), count)
    a = w * invstd
    c64 = cols.to(tl.int64)
    dy = tl.load(dy_ptr + (n * d_n + s * d_s)[:, None] + (c64 * d_c)[None, :], mask=mask, other=0.0).to(ct)
    # invstd^2 is never formed: where a float32 variance overflows (values beyond about 1e19;
    # the float64 statistics keep invstd finite) it underflows to 0. Each product below is
    # O(1) or of dy's size instead
    # (xhat = (x - mean) invstd, invstd S2/N = the mean of dy xhat), with the same number of
    # roundings as invstd * invstd * S2/N * (x - mean).
    if MODE == 0:  # dx = w invstd (dy - S1/N - xhat (invstd S2/N)), S2 = sum dy (x - mean)
        v = tl.load(src_ptr + (n * s_n + s * s_s)[:, None] + (c64 * s_c)[None, :], mask=mask, other=0.0).to(ct)
        xhat = ((v - hi[None, :]) - lo[None, :]) * invstd[None, :]
        dx = a[None, :] * (dy - g1[None, :] - xhat * (invstd * g2)[None, :])
    else:  # dx = w invstd (dz - S1/N) - invstd^3 (z - b) S2/N, S2 = sum dz (x - mean); kept: from x
        slope = tl.load(scalar_ptr + 1).to(ct)
        if HAS_B:
            b = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(ct)
        else:
            b = tl.zeros([BLOCK_C], dtype=ct)
        if KEEP:
            slot = tl.load(slot_ptr + cols, mask=cmask, other=-1)
        else:
            slot = tl.full([BLOCK_C], -1, tl.int32)
        kept = slot >= 0
        y = tl.load(src_ptr + (n * s_n + s * s_s)[:, None] + (c64 * s_c)[None, :],
                    mask=mask & (~kept)[None, :], other=0.0).to(ct)
        if MODE == 2:  # ELU (slope: alpha), inverted in float64
            z = tl.where(y >= 0, y, _elu_inverse(y.to(tl.float64), tl.load(scalar_ptr + 1)).to(ct))
            dz = tl.where(y <= 0, dy * (y + slope), dy)
        else:
            z = tl.where(y >= 0, y, _div(y, slope))
        zb = z - b[None, :]
        if KEEP:
            koff = (n * k_n + s * k_s)[:, None] + (tl.maximum(slot, 0).to(tl.int64) * k_c)[None, :]
            v = tl.load(keep_ptr + koff, mask=mask & kept[None, :], other=0.0).to(ct)
            xk = ((v - hi[None, :]) - lo[None, :]) * invstd[None, :]
            zk = w[None, :] * xk
            zb = tl.where(kept[None, :], zk, zb)
            z = tl.where(kept[None, :], zk + b[None, :], z)
        if MODE == 2:
            if KEEP:
                grow = (tl.load(scalar_ptr + 1) * tl.exp(tl.where(z > 0, 0.0, z).to(tl.float64))).to(ct)
                dz = tl.where(kept[None, :], tl.where(z > 0, dy, dy * grow), dz)
        else:
            dz = tl.where(z > 0, dy, dy * slope)
        # invstd S2 = sum dz xhat: grad_payload divided it by this invstd (one float64
        # rounding, 2^-53), the payload's own rounding to the compute dtype as before, and one
        # more rounding here (u of the compute dtype) multiplying it back; (z - b) invstd = w xhat
        dx = a[None, :] * (dz - g1[None, :]) - (invstd * g2)[None, :] * (zb * invstd[None, :])
    tl.store(dx_ptr + (n * o_n + s * o_s)[:, None] + (c64 * o_c)[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


# Triton's compile options for every launch. No floating-point contraction (a * b + c into
# one fused multiply-add): a compiled kernel then rounds every operation as the interpreter
# (numpy) does, which the CPU tests check, whatever Triton's default (fused up to 3.9, with a
# warning to every user that it changes; not fused from 3.10). The kernels are bound by
# memory, not arithmetic; the error analyses above count one rounding per operation.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


class _Launcher:
    """A jitted kernel whose launches (``kernel[grid](*args)``) carry :data:`COMPILE_OPTIONS`."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return functools.partial(self.fn[grid], **COMPILE_OPTIONS)


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    """The kernel ``name``, compiled (or interpreted) by Triton on first use."""
    t = _triton()
    return _Launcher(t.jit(globals()[name]))


# ---- launchers ----------------------------------------------------------------------
# Each is a custom operator: one recorded operation per kernel launch.


def _dummy(device) -> torch.Tensor:
    return torch.empty(1, device=device)


def _split(device, channels: int, samples: int, spatial: int, strides) -> tuple:
    """``(BLOCK_R, BLOCK_C, SB, tiles, programs, tiles per program, channel blocks)`` of
    a reduction kernel."""
    block_r, block_c = _tiles(channels, spatial, strides, 1024)
    per_sample = -(-spatial // block_r)
    tiles = samples * per_sample
    cblocks = -(-channels // block_c)
    programs = _programs(device, cblocks, tiles)
    per_prog = -(-tiles // programs)
    return block_r, block_c, per_sample, tiles, -(-tiles // per_prog), per_prog, cblocks


def _moment_partials(x: torch.Tensor, extremes: bool = False) -> torch.Tensor:
    channels = x.shape[1]
    samples, spatial, strides = _rows(x)
    block_r, block_c, per_sample, tiles, programs, per_prog, cblocks = _split(x.device, channels, samples, spatial,
                                                                              strides)
    partials = torch.empty((1 + 4 * programs) if extremes else (1 + 2 * programs), channels, dtype=torch.float64,
                           device=x.device)
    _kernel("_moment_partials_kernel")[(programs, cblocks)](
        x, partials, channels, spatial, tiles, per_sample, *strides, per_prog, BLOCK_R=block_r, BLOCK_C=block_c,
        EXTREMES=extremes)
    return partials


def _moment_payload(partials: torch.Tensor, fixed: torch.Tensor, n: int, extremes: bool = False):
    channels = partials.shape[1]
    programs = (partials.shape[0] - 1) // (4 if extremes else 2)
    size = fixed.shape[0]
    out = torch.empty(size + 1 + 2 * channels, dtype=torch.float64, device=partials.device)
    ext = torch.empty(2 if extremes else 0, channels, dtype=torch.float64, device=partials.device)
    block = min(_pow2(channels), 1024)
    _kernel("_moment_payload_kernel")[(-(-channels // block),)](
        partials, fixed, out, ext if extremes else _dummy(partials.device), channels, programs, n, SIZE=size,
        LANES=_FIXED_LANES, BLOCK=block, EXTREMES=extremes)
    return out, ext


def _merge(summed, agree, scalars, momentum, running_mean, running_var, cdtype, weight, bias, capacity,
           extremes=None):
    size = agree.shape[0]
    channels = (summed.shape[0] - size - 1) // 2
    device = summed.device
    stats = torch.empty(3, channels, dtype=cdtype, device=device)
    ok = torch.empty((), dtype=torch.bool, device=device)
    choose = capacity >= 0
    slots = torch.empty(channels if choose else 0, dtype=torch.int32, device=device)
    fits = torch.empty((), dtype=torch.bool, device=device)
    dummy = _dummy(device)
    _kernel("_merge_kernel")[(1,)](
        summed, agree, scalars, momentum,
        dummy if running_mean is None else running_mean, dummy if running_var is None else running_var,
        stats, ok, dummy if weight is None else weight, dummy if bias is None else bias,
        slots if choose else dummy, fits, dummy if extremes is None else extremes, channels, max(capacity, 0),
        SIZE=size, LANES=_FIXED_LANES, BLOCK=min(_pow2(channels), 1024),
        HAS_RM=running_mean is not None, HAS_RV=running_var is not None, CHOOSE=choose,
        HAS_W=weight is not None, HAS_B=bias is not None, ELU=choose and extremes is not None,
        WIDE=any(b is not None and b.dtype == torch.float64 for b in (running_mean, running_var)))
    return stats, ok, slots, fits


def _normalize(x, weight, bias, stats, scalars, act, slots, capacity):
    out = torch.empty_like(x)
    return out, _normalize_into(x, weight, bias, stats, scalars, act, slots, capacity, out)


def _normalize_(x, weight, bias, stats, scalars, act, slots, capacity):
    return _normalize_into(x, weight, bias, stats, scalars, act, slots, capacity, x)


def _normalize_into(x, weight, bias, stats, scalars, act, slots, capacity, out):
    channels = x.shape[1]
    rows = x.numel() // channels
    keep_on = slots is not None and capacity > 0
    if keep_on:
        keep = torch.empty((x.shape[0], capacity) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device,
                           memory_format=memory_format(x))
    else:
        keep = x.new_empty(0)
    if rows == 0:
        return keep
    samples, spatial, strides, out_strides, *keep_strides = _rows(x, out, *([keep] if keep_on else []))
    block_r, block_c = _tiles(channels, spatial, strides)
    per_sample = -(-spatial // block_r)
    device = x.device
    dummy = _dummy(device)
    _kernel("_normalize_kernel")[(samples * per_sample, -(-channels // block_c))](
        x, out, dummy if weight is None else weight, dummy if bias is None else bias, stats, scalars,
        slots if keep_on else dummy, keep if keep_on else dummy,
        channels, spatial, per_sample, *strides, *out_strides, *(keep_strides[0] if keep_on else (0, 0, 0)),
        BLOCK_R=block_r, BLOCK_C=block_c, HAS_W=weight is not None, HAS_B=bias is not None, ACT=act,
        KEEP=keep_on)
    return keep


def _grad_partials(dy, src, stats, scalars, weight, bias, slots, keep, mode):
    channels = src.shape[1]
    keep_on = slots is not None and keep is not None and keep.numel() > 0
    samples, spatial, dy_strides, strides, *keep_strides = _rows(dy, src, *([keep] if keep_on else []))
    block_r, block_c, per_sample, tiles, programs, per_prog, cblocks = _split(src.device, channels, samples, spatial,
                                                                              strides)
    partials = torch.empty(2 * programs, channels, dtype=torch.float64, device=src.device)
    dummy = _dummy(src.device)
    _kernel("_grad_partials_kernel")[(programs, cblocks)](
        dy, src, stats, scalars, dummy if weight is None else weight, dummy if bias is None else bias,
        slots if keep_on else dummy, keep if keep_on else dummy, partials,
        channels, spatial, tiles, per_sample, *dy_strides, *strides,
        *(keep_strides[0] if keep_on else (0, 0, 0)), per_prog,
        BLOCK_R=block_r, BLOCK_C=block_c, MODE=mode, HAS_W=weight is not None, HAS_B=bias is not None,
        KEEP=keep_on)
    return partials


def _grad_payload(partials, fixed, stats, mode, weight_dtype, bias_dtype, fits=None):
    channels = partials.shape[1]
    programs = partials.shape[0] // 2
    size = fixed.shape[0]
    out = torch.empty(size + 2 * channels + 1, dtype=stats.dtype, device=partials.device)
    dw = torch.empty(channels, dtype=weight_dtype, device=partials.device)
    db = torch.empty(channels, dtype=bias_dtype, device=partials.device)
    block = min(_pow2(channels), 1024)
    _kernel("_grad_payload_kernel")[(-(-channels // block),)](
        partials, fixed, stats, _dummy(partials.device) if fits is None else fits, out, dw, db, channels, programs,
        SIZE=size, LANES=_FIXED_LANES, BLOCK=block, MODE=mode, WIDE_W=weight_dtype == torch.float64,
        WIDE_B=bias_dtype == torch.float64, HAS_FITS=fits is not None)
    return out, dw, db


def _input_grad(dy, src, stats, scalars, weight, bias, slots, keep, summed, count, agree, mode, dtype):
    channels = src.shape[1]
    ok = torch.empty((), dtype=torch.bool, device=src.device)
    fit = torch.empty((), dtype=torch.bool, device=src.device)
    dx = torch.empty_like(src, dtype=dtype)
    keep_on = slots is not None and keep is not None and keep.numel() > 0
    samples, spatial, dy_strides, strides, dx_strides, *keep_strides = _rows(
        dy, src, dx, *([keep] if keep_on else []))
    block_r, block_c = _tiles(channels, spatial, strides)
    per_sample = -(-spatial // block_r)
    dummy = _dummy(src.device)
    grid = (max(1, samples * per_sample), -(-channels // block_c))
    _kernel("_input_grad_kernel")[grid](
        dy, src, stats, scalars, dummy if weight is None else weight, dummy if bias is None else bias,
        slots if keep_on else dummy, keep if keep_on else dummy, summed, count, agree, ok, fit, dx,
        channels, spatial, per_sample, *dy_strides, *strides,
        *(keep_strides[0] if keep_on else (0, 0, 0)), *dx_strides,
        SIZE=agree.shape[0], LANES=_FIXED_LANES, BLOCK_R=block_r, BLOCK_C=block_c, MODE=mode,
        HAS_W=weight is not None, HAS_B=bias is not None, KEEP=keep_on)
    return dx, ok, fit


# ---- the custom operators -----------------------------------------------------------

_SCHEMAS = {
    "triton_moment_partials": ("(Tensor x, bool extremes=False) -> Tensor", (), _moment_partials),
    "triton_moment_payload": ("(Tensor partials, Tensor fixed, int n, bool extremes=False) -> (Tensor, Tensor)", (),
                              _moment_payload),
    "triton_merge": ("(Tensor summed, Tensor agree, Tensor scalars, Tensor momentum, Tensor(a!)? running_mean, "
                     "Tensor(b!)? running_var, ScalarType cdtype, Tensor? weight, Tensor? bias, int capacity, "
                     "Tensor? extremes=None) "
                     "-> (Tensor, Tensor, Tensor, Tensor)", ("running_mean", "running_var"), _merge),
    "triton_normalize": ("(Tensor x, Tensor? weight, Tensor? bias, Tensor stats, Tensor scalars, int act, "
                         "Tensor? slots, int capacity) -> (Tensor, Tensor)", (), _normalize),
    "triton_normalize_": ("(Tensor(a!) x, Tensor? weight, Tensor? bias, Tensor stats, Tensor scalars, int act, "
                          "Tensor? slots, int capacity) -> Tensor", ("x",), _normalize_),
    "triton_grad_partials": ("(Tensor dy, Tensor src, Tensor stats, Tensor scalars, Tensor? weight, Tensor? bias, "
                             "Tensor? slots, Tensor? keep, int mode) -> Tensor", (), _grad_partials),
    "triton_grad_payload": ("(Tensor partials, Tensor fixed, Tensor stats, int mode, ScalarType weight_dtype, "
                            "ScalarType bias_dtype, Tensor? fits=None) -> (Tensor, Tensor, Tensor)", (), _grad_payload),
    "triton_input_grad": ("(Tensor dy, Tensor src, Tensor stats, Tensor scalars, Tensor? weight, Tensor? bias, "
                          "Tensor? slots, Tensor? keep, Tensor summed, Tensor count, Tensor agree, int mode, "
                          "ScalarType dtype) -> (Tensor, Tensor, Tensor)", (), _input_grad),
}


@functools.lru_cache(maxsize=None)
def _ops() -> dict:
    """The launchers as custom operators ``syncbn::triton_*``, registered on first use
    (without ``torch.library.custom_op``, before torch 2.4, the plain launchers)."""
    if not hasattr(torch.library, "custom_op"):  # pragma: no cover
        return {name: fn for name, (_, _, fn) in _SCHEMAS.items()}
    ops = {}
    for name, (schema, mutated, fn) in _SCHEMAS.items():
        ops[name] = torch.library.custom_op(f"syncbn::{name}", mutates_args=mutated, schema=schema)(fn)
    _register_fakes(ops)
    return ops


def _register_fakes(ops: dict) -> None:
    """Shapes for ``torch.compile`` (fake tensors)."""

    @ops["triton_moment_partials"].register_fake
    def _(x, extremes=False):
        samples, spatial, strides = _rows(x)  # pragma: no cover
        programs = _split(x.device, x.shape[1], samples, spatial, strides)[4]
        return x.new_empty((4 if extremes else 2) * programs + 1, x.shape[1], dtype=torch.float64)

    @ops["triton_moment_payload"].register_fake
    def _(partials, fixed, n, extremes=False):
        return (partials.new_empty(fixed.shape[0] + 1 + 2 * partials.shape[1]),  # pragma: no cover
                partials.new_empty(2 if extremes else 0, partials.shape[1]))

    @ops["triton_merge"].register_fake
    def _(summed, agree, scalars, momentum, running_mean, running_var, cdtype, weight, bias, capacity,
          extremes=None):
        channels = (summed.shape[0] - agree.shape[0] - 1) // 2  # pragma: no cover
        return (summed.new_empty(3, channels, dtype=cdtype), summed.new_empty((), dtype=torch.bool),
                summed.new_empty(channels if capacity >= 0 else 0, dtype=torch.int32),
                summed.new_empty((), dtype=torch.bool))

    @ops["triton_normalize"].register_fake
    def _(x, weight, bias, stats, scalars, act, slots, capacity):
        return torch.empty_like(x), _kept_like(x, slots, capacity)  # pragma: no cover

    @ops["triton_normalize_"].register_fake
    def _(x, weight, bias, stats, scalars, act, slots, capacity):
        return _kept_like(x, slots, capacity)  # pragma: no cover

    @ops["triton_grad_partials"].register_fake
    def _(dy, src, stats, scalars, weight, bias, slots, keep, mode):
        keep_on = slots is not None and keep is not None and keep.numel() > 0  # pragma: no cover
        samples, spatial, _, strides, *_ = _rows(dy, src, *([keep] if keep_on else []))
        programs = _split(src.device, src.shape[1], samples, spatial, strides)[4]
        return src.new_empty(2 * programs, src.shape[1], dtype=torch.float64)

    @ops["triton_grad_payload"].register_fake
    def _(partials, fixed, stats, mode, weight_dtype, bias_dtype, fits=None):
        channels = partials.shape[1]  # pragma: no cover
        return (stats.new_empty(fixed.shape[0] + 2 * channels + 1),
                stats.new_empty(channels, dtype=weight_dtype),
                stats.new_empty(channels, dtype=bias_dtype))

    @ops["triton_input_grad"].register_fake
    def _(dy, src, stats, scalars, weight, bias, slots, keep, summed, count, agree, mode, dtype):
        return (torch.empty_like(src, dtype=dtype), src.new_empty((), dtype=torch.bool),  # pragma: no cover
                src.new_empty((), dtype=torch.bool))


def _kept_like(x, slots, capacity):
    if slots is not None and capacity > 0:  # pragma: no cover
        return x.new_empty((x.shape[0], capacity) + tuple(x.shape[2:]))
    return x.new_empty(0)  # pragma: no cover


# ---- the public launchers -----------------------------------------------------------


def moment_partials(x: torch.Tensor, extremes: bool = False) -> torch.Tensor:
    """Per-program float64 partial sums of ``t = x - K`` and ``t^2`` (row 0: ``K``), for
    a non-empty ``x`` (kernel 1 forward); with ``extremes``, also each program's minimum
    and maximum of ``x`` per channel (rows ``1 + 2P + 2p``, ``2 + 2P + 2p``), in the same pass."""
    return _ops()["triton_moment_partials"](x, extremes)


def moment_payload(partials: torch.Tensor, fixed: torch.Tensor, n: int, extremes: bool = False):
    """The forward payload ``[fixed, n, sum x, sum x^2]`` in float64 (kernel 2); with
    ``extremes`` (partials made with ``extremes``) ``(payload, local)``, ``local`` the
    (2, C) float64 minimum and maximum of this rank's ``x`` per channel (not communicated:
    for :func:`merge`'s ELU channel choice)."""
    payload, local = _ops()["triton_moment_payload"](partials, fixed, n, extremes)
    return (payload, local) if extremes else payload


def merge(summed, agree, scalars, momentum, running_mean, running_var, cdtype, weight=None, bias=None,
          capacity: int = -1, extremes=None):
    """After the all-reduce (kernel 3): ``(stats, ok, slots, fits)``. ``stats`` is (3, C)
    ``[mean_hi, mean_lo, invstd]`` in ``cdtype``; ``ok`` the fingerprint's verdict (0-d
    bool); the running buffers move in place where ``ok`` and ``N > 1``. ``scalars`` is
    the float64 ``[eps, activation parameter, budget, floor, limit]``, ``momentum`` a 0-d tensor.
    With ``capacity >= 0`` (the activated layer) also ``slots`` (int32, C): the slot in
    the kept inputs of each channel whose ``(|b| + floor) / |w|`` exceeds the budget, in
    channel order (-1: none), and ``fits``: whether all such channels got a slot. With
    ``extremes`` (ELU: this rank's (2, C) minimum and maximum from :func:`moment_payload`,
    ``scalars[1]`` alpha) also each channel where ``exp(-z_min) (1 + floor / alpha) / |w|``
    exceeds the budget or ``exp(-z_min) (1 + floor / alpha)`` exceeds ``limit``,
    ``z_min = b + w (x_ext - mean) invstd`` this rank's most negative pre-activation: a
    choice local to the rank, the statistics and buffers the group's."""
    return _ops()["triton_merge"](summed, agree, scalars, momentum, running_mean, running_var, cdtype, weight,
                                  bias, capacity, extremes)


def normalize(x, weight, bias, stats, scalars, act: int = 0, slots=None, capacity: int = 0, out=None):
    """``y = act(((x - mean_hi) - mean_lo) * invstd * w + b)`` written to a new tensor
    laid out as ``x``, or over ``x`` (``out=x``), and the kept inputs of the channels with a slot
    (shape (N, capacity, *), x's layout). Returns ``(y, keep)`` (kernel 4)."""
    if out is None:
        return _ops()["triton_normalize"](x, weight, bias, stats, scalars, act, slots, capacity)
    if out is not x:  # pragma: no cover - the layers normalize into a new tensor or in place
        raise ValueError("syncbn kernels: normalize writes a new tensor or over x")
    return x, _ops()["triton_normalize_"](x, weight, bias, stats, scalars, act, slots, capacity)


def grad_partials(dy, src, stats, scalars, weight=None, bias=None, slots=None, keep=None, mode: int = 0):
    """Per-program float64 sums of the backward pass (kernel 1 backward): mode 0 ``(sum
    dy, sum dy (x - mean))`` from ``src = x``; mode 1 (leaky_relu/identity activated
    layer, ``src = y``) and mode 2 (ELU, ``scalars[1]`` alpha) ``(sum dz, sum dz xhat)``."""
    return _ops()["triton_grad_partials"](dy, src, stats, scalars, weight, bias, slots, keep, mode)


def grad_payload(partials, fixed, stats, mode: int, weight_dtype, bias_dtype, fits=None):
    """``(payload, dw, db)`` (kernel 2 backward): the payload ``[fixed, S1, S2, overflow]``
    (``SIZE + 2C + 1`` values) in the statistics' dtype and the local weight and bias
    gradients. Every mode sends the same sums, ``S1 = sum dy`` and ``S2 = sum dy (x -
    mean)`` (the activated layer's dz for dy: its ``sum dz xhat`` divided by ``invstd``), as
    every other path does, so that ranks where one layer is fused and ranks where it is not
    sum like with like. For the activated layer (``mode >= 1``) ``overflow`` is 1 where
    ``fits`` (:func:`merge`'s 0-d flag of this rank's forward) is false, else 0 (also
    without ``fits``: a rank that kept nothing), so that the all-reduce sums how many
    ranks ran out of kept channels; the plain layer (mode 0) sends 0 there."""
    return _ops()["triton_grad_payload"](partials, fixed, stats, mode, weight_dtype, bias_dtype, fits)


def input_grad(dy, src, stats, scalars, weight, bias, slots, keep, summed, count, agree, mode: int,
               dtype: Optional[torch.dtype] = None):
    """``(dx, ok, fit)`` (kernel 3 backward): the input gradient from the group's sums
    ``summed`` (``[fingerprint sums, S1, S2, overflow]`` from :func:`grad_payload`), the
    fingerprint's verdict and ``fit`` (0-d bool), whether the summed overflow is zero, i.e.
    no rank of the group ran out of kept channels (the same value on every rank), written by
    the same launch in every mode: the plain layer (mode 0) raises with the activated one
    where a model is fused on some ranks only."""
    return _ops()["triton_input_grad"](dy, src, stats, scalars, weight, bias, slots, keep, summed, count, agree,
                                       mode, dtype or src.dtype)
