"""Per-channel statistics of batch normalization: local moments, their merge, the
running-buffer update, and the backward formulas. No communication happens here.

The pack and merge are those of :mod:`syncbn.core.moments` (the derivation and its
error analysis are there), with shift ``K = 0``: rank r packs
``[n_r, n_r * m_r, M2_r + n_r * m_r^2]`` in float64 (``2C + 1`` values), the ranks sum
the packs with one all-reduce, and ``var = S2 / N - mean^2`` in float64. The local
``M2_r`` comes from a stable reduction (float64 sums about a center, or torch's Welford
kernel where that is exact enough, see :func:`cpu_local_stats` and :func:`use_centered`).
Devices without float64 (Apple MPS) fall back to float32 sums.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..core.moments import reduction_axes
from .layout import memory_format

__all__ = [
    "reduce_dims",
    "memory_format",
    "use_centered",
    "centered_moments",
    "local_moments",
    "cpu_local_stats",
    "far_from_zero",
    "cpu_pack_moments",
    "cpu_statistics",
    "compute_dtype",
    "accumulate_dtype",
    "pack_moments",
    "merge_moments",
    "update_running_stats",
    "update_running_buffers",
    "affine",
    "backward_sums",
    "input_grad",
    "backward_sums_from_output",
    "input_grad_from_output",
    "move_buffer",
    "constant",
    "cuda_path",
    "cuda_local_stats",
    "cuda_pack_moments",
    "cuda_statistics",
    "cuda_normalize",
    "cuda_backward_reduce",
    "cuda_input_grad",
    "triton_path",
    "kernel_scalars",
]

_HALF = (torch.float16, torch.bfloat16)

# Devices whose ATen build has the native batch-norm statistics and backward-reduction
# kernels used below (fast, any memory layout). Elsewhere (MPS, XPU, out-of-tree
# backends) the same quantities come from portable composite ops.
NATIVE_KERNEL_DEVICES = {"cpu", "cuda"}


def reduce_dims(ndim: int) -> list:
    """Dimensions to reduce for an input of ``ndim`` dims laid out as (N, C, *)."""
    return reduction_axes(ndim, 1)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the statistics used to normalize: float32 for half inputs, else the input's."""
    return torch.float32 if dtype in _HALF else dtype


def accumulate_dtype(device: torch.device) -> torch.dtype:
    """Dtype of the packed sums that travel between ranks: float64 where the device has it."""
    return torch.float32 if device.type == "mps" else torch.float64


def _channel_shape(ndim: int, channels: int) -> list:
    return [1, channels] + [1] * (ndim - 2)


def _mean_rounding_matters(mean, var, device) -> bool:
    """Whether the float32 rounding of a rank's mean could reach the merged variance.

    The rounding is about 6e-8 |mean|; it only competes with the spread of the ranks'
    means (and with what float32 data resolves at all) when |mean| is well above the
    standard deviation. On the CPU the test costs a read of C flags; elsewhere it would
    be a host synchronisation, so accelerators always take the correction.
    """
    if device.type != "cpu":
        return True
    return bool((mean.abs() > 16 * var.sqrt()).any())


def use_centered(x: torch.Tensor) -> bool:
    """Whether :func:`pack_moments` with ``keep=True`` (the fused layer) takes
    :func:`centered_moments`: on the CPU, for 3D-5D inputs in the standard layout with
    planes of at least 16 elements per (sample, channel), and for channels-last inputs.

    There the caller normalizes the centered tensor in place, which makes up for the
    centered moments' extra work in the standard layout (torch's kernel walks a channel
    with one scalar accumulator: about even with it, measured on (8, 256, 56, 56)), and
    it is exact at any offset. In channels-last torch's kernel accumulates ``(x -
    mean)^2`` in float32 one row after another: measured on float32 (8, 64, 56, 56), a
    relative error of the variance of 8e-6 at |mean| / std = 1 and 8e-3 at 1e4, where the
    centered moments stay below 1e-7. Tiny planes and (N, C) inputs take
    :func:`local_moments` (on the CPU :func:`cpu_local_stats`, exact there too)."""
    if x.device.type != "cpu" or x.dim() < 3 or _FORCE_CUDA_PATH:
        return False
    if x.is_contiguous():
        return x.numel() // max(1, x.shape[0] * x.shape[1]) >= 16
    return x.dim() in (4, 5) and memory_format(x) is not torch.contiguous_format


# Elements converted to float64 at a time by :func:`_float64_sums` (1 MiB of float64:
# the copy stays in cache, and the loop runs about numel / 2^17 times).
_FLOAT64_CHUNK = 1 << 17


def _float64_sums(t: torch.Tensor, shift: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None):
    """Per-channel ``(sum t, sum t^2)`` accumulated in float64, for a standard-layout or
    channels-last ``t`` (left as it is unless it is ``out``).

    With ``shift`` (per channel; channels-last ``t`` only), the sums are of ``t - shift``
    instead, each block subtracted just before it is converted and written to the same
    place in ``out`` (a tensor laid out as ``t``, or ``t`` itself; None: a block-sized
    temporary): the values and sums are those of ``t - shift`` made first in one pass,
    without reading it back from memory.

    ``t`` is converted to float64 a cache-sized block at a time, so the sums hold whatever
    the plane size, CPU or BLAS: every product and partial sum is a float64 operation,
    a relative error of at most ``n * 2^-53`` (2e-10 at 2M elements per channel). A
    float32 dot product (a BLAS ``sdot`` through ``bmm``, as before) accumulates in
    float32 along chains whose length the BLAS chooses: measured 5e-6 relative on a
    512x512 plane at |mean| / std = 1e4, where the centered values are quantized and
    the roundings no longer cancel."""
    channels = t.shape[1]
    first = torch.zeros(channels, dtype=torch.float64, device=t.device)
    second = torch.zeros_like(first)
    if memory_format(t) is torch.contiguous_format:
        if shift is not None:  # private: centered_moments subtracts first in this layout
            raise ValueError("_float64_sums: shift is for channels-last inputs only")
        planes = t.reshape(t.shape[0], channels, -1)  # a view: (sample, channel, plane)
        width = max(1, _FLOAT64_CHUNK // channels)  # plane elements per block
        samples = max(1, _FLOAT64_CHUNK // planes[0].numel())  # whole samples per block
        for start in range(0, planes.shape[0], samples):
            for column in range(0, planes.shape[2], width):
                block = planes[start : start + samples, :, column : column + width].to(torch.float64)
                rows = block.view(-1, 1, block.shape[2])  # one dot product per (sample, channel)
                first += block.sum((0, 2))
                second += torch.bmm(rows, rows.transpose(1, 2)).view(-1, channels).sum(0)
    else:  # channels-last: the (element, channel) rows are contiguous
        order = (0, *range(2, t.dim()), 1)
        rows = t.permute(order).reshape(-1, channels)  # a view
        if shift is not None:
            targets = None if out is None else out.permute(order).view(-1, channels)
        height = max(1, _FLOAT64_CHUNK // channels)
        for start in range(0, rows.shape[0], height):
            block = rows[start : start + height]
            if shift is not None:
                block = torch.sub(block, shift, out=None if targets is None else targets[start : start + height])
            converted = block.dtype != torch.float64  # then block.to makes a copy of our own
            block = block.to(torch.float64)
            first += block.sum(0)
            # squared in place where the block is our copy: the same values as square(),
            # without a new block-sized tensor per block (measured 2-5x faster per block)
            second += (block.mul_(block) if converted else block.square()).sum(0)
    return first, second


def centered_moments(xs: torch.Tensor, dtype: torch.dtype, keep: bool = False, overwrite: bool = False):
    """``(mean, M2)`` from vectorized reductions around a provisional mean ``s``:
    ``t = x - s``, ``S1 = sum t``, ``mean = s + S1 / n``, ``M2 = sum t^2 - S1^2 / n``
    (exact identities; ``t`` is exact where x and s are close, so nothing cancels when
    |mean| >> std, and ``S1`` carries the rounding of ``s`` back into the mean).

    With ``keep=True`` also ``(t, s)``: a new tensor the caller may normalize in place,
    as ``(t - (mean - s)) * scale + shift``, which rounds far less than ``x * scale +
    (shift - mean * scale)`` where |mean| >> std and saves the forward one pass.
    ``overwrite=True`` writes ``t`` over ``xs`` (no temporary: the caller gives ``xs`` up)."""
    dims = reduce_dims(xs.dim())
    n = xs.numel() // xs.shape[1]
    provisional = xs.sum(dims).div_(n)
    if memory_format(xs) is torch.contiguous_format:
        # one subtraction pass first: faster here than subtracting strided blocks inside
        # the float64 sums (measured 5-10% on the whole function)
        shift = provisional.view(_channel_shape(xs.dim(), xs.shape[1]))
        centered = xs.sub_(shift) if overwrite else xs - shift
        sums = _float64_sums(centered)
    else:  # channels-last: t = x - s made block by block inside the float64 sums (one
        # read of the activation less), kept only where asked for
        centered = xs if overwrite else torch.empty_like(xs) if keep else None
        sums = _float64_sums(xs, provisional, centered)
    first, second = (part.to(dtype) for part in sums)
    mean = provisional.to(dtype) + first / n
    m2 = (second - first * first / n).clamp_min_(0)
    return (mean, m2, centered, provisional) if keep else (mean, m2)


def local_moments(x: torch.Tensor, dtype: torch.dtype):
    """This rank's per-channel ``(mean, M2)`` in ``dtype``, for a non-empty ``x``.

    The native batch-norm statistics kernel gives the mean and the biased variance in
    one pass, in any memory layout. Its mean comes back rounded to the input's precision
    (about 6e-8 |mean| in float32); when |mean| >> std that rounding is as large as the
    differences between the ranks' means that the merge must resolve, so for inputs
    below float64 the rounding is measured and added back: ``x - mean`` is exact
    where it matters (both close together), and its small sum is accurate. On the CPU,
    :func:`cpu_local_stats` (the kernel where it is exact, the centered moments elsewhere).
    """
    xs = x.float() if x.dtype in _HALF else x
    if xs.device.type == "cpu" and not _FORCE_CUDA_PATH:
        mean, var = cpu_local_stats(xs)
        return mean.to(dtype), var.to(dtype) * (x.numel() // x.shape[1])
    if x.device.type in NATIVE_KERNEL_DEVICES:
        mean, var = torch.batch_norm_update_stats(xs, None, None, 0.0)
    else:  # portable composite ops (Welford) for every other backend
        var, mean = torch.var_mean(xs, dim=reduce_dims(x.dim()), correction=0)
    n = x.numel() // x.shape[1]
    m2 = var.to(dtype) * n
    mean_hi = mean.to(dtype)
    if xs.dtype != torch.float64 and _mean_rounding_matters(mean, var, x.device):
        dims = reduce_dims(x.dim())
        residual = (xs - mean.view(_channel_shape(x.dim(), x.shape[1]))).sum(dims)
        mean_hi = mean_hi + residual.to(dtype) / n
    return mean_hi, m2


def cpu_local_stats(x: torch.Tensor):
    """This rank's per-channel ``(mean, biased var)`` on the CPU, exact to float32
    resolution whatever the plane size or offset, for a non-empty ``x`` (float32 for
    half inputs; float64 where the centered moments are taken).

    Standard layout: torch's statistics kernel (float64 accumulation, one pass for the
    mean, one around it; the kernel BatchNorm2d itself runs). Its mean comes back rounded
    to float32, about ``u |mean|`` (u = 2^-24): harmless to the merge unless |mean| is
    well above the std (:func:`far_from_zero`, a read of C values), and there the
    centered moments are taken instead. Channels-last (where the kernel accumulates in
    float32, 8e-3 relative at |mean| / std = 1e4) always takes the centered moments.
    Inputs with one element per (sample, channel), (N, C) or (N, C, 1, 1), have the
    channel as the fastest-moving dimension, where the kernel takes its channels-last
    loop (float32 (1e6, 4) at offset 0: variance off by 1.6e-4 relative, measured): they
    go through the kernel as a float64 copy (exact; 0.03 ms for (64, 512))."""
    xs = x.float() if x.dtype in _HALF else x
    if memory_format(xs) is torch.contiguous_format:
        if xs.numel() == xs.shape[0] * xs.shape[1]:
            return torch.batch_norm_update_stats(xs.double(), None, None, 0.0)
        mean, var = torch.batch_norm_update_stats(xs, None, None, 0.0)
        if xs.dtype == torch.float64 or not far_from_zero(mean, var):
            return mean, var
    mean, m2 = centered_moments(xs, torch.float64)
    return mean, m2.div_(xs.numel() // xs.shape[1])


def cpu_pack_moments(mean, var, n: int, dtype: torch.dtype, fixed: tuple) -> torch.Tensor:
    """``[fixed, n, n * m, n * (var + m^2)]`` in ``dtype`` (:func:`pack_moments`'s
    ``2C + 1`` values after the caller's ``fixed`` integers): one ``cat`` with a kept
    constant, then ``n *`` and ``+ n m * m`` in place."""
    size, channels = len(fixed), mean.shape[0]
    payload = torch.cat([constant(_listed, (tuple(fixed) + (n,),), dtype, mean.device), mean, var])
    scaled = payload[size + 1:].mul_(n)
    scaled[channels:].addcmul_(scaled[:channels], mean)
    return payload


def cpu_statistics(summed: torch.Tensor, count: float, eps: float, cdtype: torch.dtype):
    """From the group's sums ``[S1, S2]`` (:func:`cpu_pack_moments` summed, after the
    count) and the count ``N`` (a number: read on the CPU at no cost): ``(mean, invstd,
    unbiased var)`` in ``cdtype``. The biased variance ``S2 / N - mean^2`` is formed in
    the sums' dtype (float64: that one cancellation loses about 1e-16 (|mean| / std)^2
    relative), then converted; ``invstd`` and the unbiased variance are taken from it in
    ``cdtype``, as :class:`torch.nn.BatchNorm2d` does from its own variance."""
    mean, var = _merged_rows(summed, count).to(cdtype)
    return mean, torch.add(var, eps).rsqrt_(), var * (count / (count - 1))


def far_from_zero(mean: torch.Tensor, var: torch.Tensor) -> bool:
    """Whether ``|mean| > 16 sqrt(var)`` for some channel (a host read: CPU only).

    Below that, a float32 rounding of the mean (``u |mean|``) is at most ``16 u`` of a
    standard deviation (1e-6), and ``x * scale + (shift - mean * scale)`` rounds the
    output by as little in units of its std. NaN statistics are not far: they
    propagate as they are."""
    return bool(torch.addcmul(var, mean, mean, value=-1.0 / 256).min() < 0)


def pack_moments(x: torch.Tensor, dtype: torch.dtype, keep: bool = False, overwrite: bool = False):
    """This rank's ``[n, n*m, M2 + n*m^2]`` for every channel, as one flat tensor.

    ``n`` is the same for every channel (the element count per channel); an empty
    batch packs zeros, so an empty rank still takes part in the reduce. With
    ``keep=True`` returns ``(packed, centered, provisional)``: the centered input and
    its shift from :func:`centered_moments` where :func:`use_centered` picks that path
    (x in float32 for half inputs), else ``(packed, None, None)``; with ``overwrite``
    the centered values of a float32/float64 ``x`` are written over ``x`` itself.
    """
    channels = x.shape[1]
    n = x.numel() // channels if channels else 0
    packed = torch.zeros(2 * channels + 1, dtype=dtype, device=x.device)
    packed[0] = n
    centered = provisional = None
    if n > 0:
        if keep and use_centered(x):
            xs = x.float() if x.dtype in _HALF else x  # a copy for half inputs: overwriting it is free
            mean, m2, centered, provisional = centered_moments(xs, dtype, keep=True, overwrite=overwrite)
        else:
            mean, m2 = local_moments(x, dtype)
        torch.mul(mean, n, out=packed[1 : channels + 1])
        torch.addcmul(m2, mean, mean, value=n, out=packed[channels + 1 :])
    return (packed, centered, provisional) if keep else packed


def merge_moments(packed: torch.Tensor, channels: int):
    """Global ``(count, mean, biased var)`` from the summed packs of every rank.

    ``count`` is a 0-d tensor (kept on the device: no host synchronisation); mean and
    variance stay in the packed dtype. The variance is clamped at zero, so rounding can
    never make it negative.
    """
    count = packed[0]
    mean, var = _merged_rows(packed[1 : 2 * channels + 1], count)
    return count, mean, var


def _merged_rows(sums: torch.Tensor, count) -> torch.Tensor:
    """``[mean, biased var]`` as one (2, C) tensor from the summed ``[S1, S2]`` and the
    count (a 0-d tensor or a number): ``S1 / N`` and ``S2 / N - mean^2``, clamped at 0.
    A count of 0 (every rank empty: the sums are 0) gives zeros, not 0 / 0."""
    count = count.clamp_min(1) if isinstance(count, torch.Tensor) else max(count, 1)
    rows = torch.div(sums.view(2, -1), count)  # [mean, E x^2]
    rows[1].addcmul_(rows[0], rows[0], value=-1).clamp_min_(0)
    return rows


@torch.no_grad()
def update_running_stats(running_mean, running_var, mean, var, count, momentum, ok=None) -> None:
    """EMA update of the running buffers with the global statistics, in place.

    ``momentum`` is the weight of the new value (a float, or a 0-d tensor for the
    cumulative average); the variance written is unbiased with the global count. ``ok``
    (a 0-d bool tensor, see :func:`move_buffer`) gates the update on the device; so does
    the count (a 0-d tensor, or a number read already): the buffers move only where it is
    above 1 (a count of 0, every rank empty, leaves them as they are, as torch.nn's
    batch norm does; 1 raises in the callers)."""
    if isinstance(count, torch.Tensor):
        held = count > 1
        ok = held if ok is None else ok & held
    elif count <= 1:
        return
    if running_mean is not None:
        move_buffer(running_mean, mean, momentum, ok)
    if running_var is not None:
        unbiased = var * (count / (count - 1))
        move_buffer(running_var, unbiased, momentum, ok)


def move_buffer(buffer, value, momentum, ok=None, moved=None) -> None:
    """``buffer.lerp_(value, momentum)`` where ``ok`` holds (None: always). Where it does
    not, the buffer keeps its bits whatever it and ``value`` hold (``torch.where``, no host
    read; a lerp by 0 would still write NaN from a non-finite value). ``moved``: the lerp,
    computed already. A 0-d tensor ``momentum`` is cast to the buffer's dtype first: torch
    2.4's lerp takes no weight of another dtype, and newer ones cast it to that dtype anyway
    (bit for bit the same).

    ``value`` of another dtype than the buffer is cast to it, except into a float16 or
    bfloat16 buffer: there the lerp is computed in ``value``'s wider dtype and rounded once,
    as torch's batch norm kernels compute the update in float32, so that a value beyond
    float16's range (a batch variance above 65504) whose moved result fits stores finite."""
    if moved is None and value.dtype != buffer.dtype:
        if buffer.dtype in _HALF and torch.finfo(value.dtype).bits > torch.finfo(buffer.dtype).bits:
            weight = momentum.to(value.dtype) if isinstance(momentum, torch.Tensor) else momentum
            moved = torch.lerp(buffer.to(value.dtype), value, weight).to(buffer.dtype)
            if ok is None:
                buffer.copy_(moved)
                return
        else:
            value = value.to(buffer.dtype)
    if isinstance(momentum, torch.Tensor):
        momentum = momentum.to(buffer.dtype)
    if ok is None:
        buffer.lerp_(value, momentum)
        return
    if moved is None:
        moved = torch.lerp(buffer, value, momentum)
    torch.where(ok, moved, buffer, out=buffer)


def affine(x: torch.Tensor, mean, scale, shift, out=None) -> torch.Tensor:
    """``(x - mean) * scale + shift`` per channel in one pass, as ``x * scale + (shift -
    mean * scale)`` (what torch's inference batch-norm kernel computes too, so both
    ways round alike): that kernel in the standard layout, ``addcmul`` in channels-last,
    where the kernel runs at about half the speed of an elementwise op on this
    project's CPUs. The per-channel vectors must have ``x``'s dtype for ``addcmul``
    (half inputs with float32 statistics take the kernel). ``out`` may be ``x``."""
    if x.dim() > 2 and memory_format(x) is not torch.contiguous_format and scale.dtype == x.dtype:
        shape = _channel_shape(x.dim(), x.shape[1])
        offset = torch.addcmul(shift, mean, scale, value=-1)
        return torch.addcmul(offset.view(shape), x, scale.view(shape), out=out)
    ones = constant(_filled, (1.0, mean.shape[0]), mean.dtype, mean.device)
    if out is None:  # mean detached: torch 2.4's compiler refuses a running mean that may need grad
        return torch.batch_norm(x, scale, shift, mean.detach(), ones, False, 0.0, 0.0, False)
    empty = x.new_empty(0, dtype=mean.dtype)
    return torch.ops.aten.native_batch_norm.out(
        x, scale, shift, mean, ones, False, 0.0, 0.0, out=out, save_mean=empty, save_invstd=empty.clone()
    )[0]


def backward_sums(dy: torch.Tensor, x: torch.Tensor, mean, invstd):
    """This rank's ``(sum dy, sum dy * xhat)`` per channel, in the compute dtype."""
    channels = x.shape[1]
    cdtype = compute_dtype(x.dtype)
    if x.numel() == 0:
        # zeros, taken from dy (a sum over no element): so that under torch.compile the
        # backward all-reduce that sends them depends on the gradient and stays in the
        # backward graph (zeros from nothing were moved into the forward graph, which
        # then ran a collective more on an empty rank than on the others)
        zeros = dy.sum(reduce_dims(dy.dim()), dtype=cdtype)
        return zeros, zeros.clone()
    if x.device.type in NATIVE_KERNEL_DEVICES:
        # the native backward kernel's weight and bias gradients are exactly these sums
        # (whatever the weight: it scales only the input gradient, not asked for here;
        # the CUDA kernel needs a defined one to allocate its weight gradient like it)
        ones = constant(_filled, (1.0, channels), mean.dtype, mean.device)
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, ones, None, None, mean, invstd, True, 0.0, [False, True, True]
        )
    else:
        shape = _channel_shape(x.dim(), channels)
        dims = reduce_dims(x.dim())
        dyc = dy.to(cdtype)
        sum_dy = dyc.sum(dims)
        sum_dy_xhat = (dyc * (x.to(cdtype) - mean.view(shape))).sum(dims) * invstd
    return sum_dy.to(cdtype), sum_dy_xhat.to(cdtype)


def input_grad(dy, x, weight, mean, invstd, sum_dy, sum_dy_xhat, count):
    """``dx = w * invstd * (dy - S1/N - xhat * S2/N)`` with the global sums S1, S2.

    Written as ``dx = a * dy + (b * (x - mean) + c)`` with per-channel a, b, c. The
    bracket is an affine map of ``x - mean`` per channel (:func:`affine`, one pass; it
    rounds like torch's own kernels, about ``u * |mean| / std`` in units of the std
    where |mean| >> std); one ``addcmul`` adds ``a * dy``. Two passes over the data.
    """
    shape = _channel_shape(x.dim(), x.shape[1])
    cdtype = compute_dtype(x.dtype)
    a = invstd if weight is None else invstd * weight.to(cdtype)
    per_element = torch.div(a, count).neg_()  # -a / N (the count stays a 0-d tensor)
    c = sum_dy * per_element
    b = torch.mul(sum_dy_xhat, invstd).mul_(per_element)
    dx = affine(x.to(cdtype), mean, b, c)  # half inputs: the bracket and the sum in float32
    dx.addcmul_(dy, a.view(shape))
    return dx.to(x.dtype)


# ---- the same formulas from the normalized output ------------------------------------
# An activated, in-place layer keeps only its output. With ``z = w * xhat + b`` (the
# normalized, affine output before the activation) recovered from it, ``xhat`` is
# ``(z - b) / w``; these two functions take z where the ones above take x.


def backward_sums_from_output(dz: torch.Tensor, z: torch.Tensor, weight, bias):
    """This rank's ``(sum dz, sum dz * xhat)`` per channel with ``xhat = (z - bias) / weight``.

    ``weight`` and ``bias`` are per-channel tensors in the compute dtype (ones and zeros
    for a layer without affine parameters). A channel whose weight is 0 gets 0 for the
    second sum: its ``xhat`` cannot be recovered from ``z`` and must come from elsewhere.
    """
    reciprocal = torch.where(weight != 0, weight.reciprocal(), 0.0)  # inf where 0, replaced
    return backward_sums(dz, z, bias, reciprocal)


def input_grad_from_output(dz, z, weight, bias, invstd, sum_dy, sum_dy_xhat, count, *, overwrite_z=False):
    """``dx = w * invstd * (dz - S1/N) - invstd * S2/N * (z - b)``: the input gradient of
    :func:`input_grad` with ``xhat`` replaced by ``(z - b) / w``, so ``xhat`` is never
    formed and nothing is divided by ``w`` (finite for any weight, 0 included).

    Two passes, ``dx = a * dz + (b * (z - bias) + shift)``: the bracket is :func:`affine`
    with ``bias`` as its mean (one pass, any layout), which rounds ``z - bias`` at about
    ``u * |bias|``, the rounding ``z`` itself already carries. The result is in the
    compute dtype. ``overwrite_z=True`` builds it in ``z``'s memory (``z`` must then be a
    compute-dtype tensor that nothing else reads).
    """
    shape = _channel_shape(z.dim(), z.shape[1])
    cdtype = compute_dtype(z.dtype)
    count = count.to(cdtype)
    a = invstd * weight
    b = -invstd * (sum_dy_xhat / count)
    shift = -a * (sum_dy / count)
    dx = affine(z.to(cdtype), bias, b, shift, out=z if overwrite_z and z.dtype == cdtype else None)
    return dx.addcmul_(dz, a.view(shape))


# ---- the CUDA path -------------------------------------------------------------------
# On a GPU a layer call is bounded by passes over activation-sized tensors and by kernel
# launches (DESIGN.md). Where Triton is installed, the layers take the kernels of
# syncbn.torch.kernels (see triton_path below: 4 kernels forward, 3 backward, exact
# moments); the torch-op path here is the fallback. On it the synchronized layer takes torch's one-pass statistics
# kernel, C-sized operations with no host read, and torch's own SyncBatchNorm kernels to
# normalize, for the backward reduction and for the input gradient: 3 passes forward (read
# x; read x, write y) and 5 backward (read dy and x; read dy and x, write dx), as
# torch.nn.SyncBatchNorm, and within its kernel launches + 4 each way (``syncbn bench``).
#
# ``_FORCE_CUDA_PATH`` (tests and ``syncbn bench`` only) sends CPU tensors down the same
# path, so that its operations can be counted and checked on a machine without a GPU.
# Three of its kernels exist only on CUDA; on the CPU each is replaced by a stand-in
# custom operator with the same inputs and output (one recorded operation, as the CUDA
# kernel is one launch), built from the portable formulas above.
_FORCE_CUDA_PATH = False


@contextlib.contextmanager
def _forced_cuda_path():
    """Within the block, CPU tensors take the CUDA path (private: tests and the bench)."""
    global _FORCE_CUDA_PATH
    before, _FORCE_CUDA_PATH = _FORCE_CUDA_PATH, True
    try:
        yield
    finally:
        _FORCE_CUDA_PATH = before


def cuda_path(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the CUDA path (a CUDA tensor, or the private switch is on)."""
    return x.device.type == "cuda" or _FORCE_CUDA_PATH


# On the CUDA path, the Triton kernels of :mod:`syncbn.torch.kernels` replace torch's ops
# wherever they apply (Triton installed, a supported dtype and rank): 5 launches forward
# (with the module's num_batches_tracked += 1) and 3 backward per call instead of 17 and
# 6, and exact local moments. The torch-op path
# above stays the fallback. ``SYNCBN_TRITON=0`` in the environment keeps CUDA tensors on
# it; ``_forced_triton_path`` (tests, ``syncbn bench``) sends CPU tensors through the
# kernels, which Triton then runs in its interpreter (``TRITON_INTERPRET=1``).
_TRITON_ENABLED = os.environ.get("SYNCBN_TRITON", "1") != "0"
_FORCE_TRITON = False


@contextlib.contextmanager
def _forced_triton_path():
    """Within the block, CPU tensors take the CUDA path with the Triton kernels (private:
    tests and the bench; the process must interpret Triton, see
    :func:`syncbn.torch.kernels.enable_interpreter`, else the torch-op path is taken)."""
    global _FORCE_TRITON
    before, _FORCE_TRITON = _FORCE_TRITON, True
    try:
        with _forced_cuda_path():
            yield
    finally:
        _FORCE_TRITON = before


def triton_path(x: torch.Tensor) -> bool:
    """Whether ``x`` (on the CUDA path) takes the Triton kernels: a CUDA tensor (unless
    ``SYNCBN_TRITON=0``) or, in ``_forced_triton_path``, a CPU tensor, that
    :func:`syncbn.torch.kernels.supports` admits, with spatial dims that flatten
    without a copy (every dense layout)."""
    if x.device.type == "cuda":
        if not _TRITON_ENABLED:
            return False
    elif not (_FORCE_TRITON and x.device.type == "cpu"):
        return False
    from . import kernels

    return kernels.supports(x) and kernels.flattenable(x)


def _kernel_scalars(eps: float, param: float, budget: float, floor: float, limit: float) -> list:
    return [eps, param, budget, floor, limit]


def kernel_scalars(eps: float, device, param: float = 1.0, budget: float = 0.0, floor: float = 0.0,
                   limit: float = 0.0):
    """The kernels' float64 scalars ``[eps, activation parameter, budget, floor, limit]``
    (``limit``: ELU's bound on ``exp(-z_min)``), kept on the device (:func:`constant`)."""
    return constant(_kernel_scalars, (float(eps), float(param), float(budget), float(floor), float(limit)),
                    torch.float64, device)


# Small constant tensors of the CUDA path (the payload's fixed values, its offset and mask,
# eps), built once per device and dtype, none depending on the batch size: a
# host-to-device copy is a host synchronisation on CUDA, so it happens on the first call
# (capture a CUDA graph after an eager warm-up step, as torch recommends anyway).
_constants = {}


def constant(build, args: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(build(*args), dtype=dtype, device=device)``, made once and kept.

    The key is ``(build, args, dtype, device)``: everything the tensor is made from, so a
    kept tensor always holds what a new one would (``build`` must be a pure function of
    ``args``). Callers only read the tensor, never write it. The store is bounded. While
    ``torch.compile`` traces the caller, a new tensor each time (the graph holds it; a
    kept one would be a Python-side cache under the trace)."""
    if torch.compiler.is_compiling():
        return torch.tensor(build(*args), dtype=dtype, device=device)
    key = (build, args, dtype, device)
    kept = _constants.get(key)
    if kept is None:
        if len(_constants) > 4096:
            _constants.clear()
        kept = _constants[key] = torch.tensor(build(*args), dtype=dtype, device=device)
    return kept


def _filled(value: float, size: int) -> list:
    return [value] * size


def _listed(values: tuple) -> list:
    return list(values)


def _pack_offset(fixed: tuple, channels: int) -> list:
    # the fixed values, then zeros for the count and the sums
    return list(fixed) + [0] * (1 + 2 * channels)


def _pack_mask(size: int, channels: int) -> list:
    return [0] * size + [1] * (1 + 2 * channels)


def _count_offsets() -> list:
    return [0.0, 1.0]


def _eps_rows(eps: float) -> list:
    return [[[0.0], [0.0]], [[eps], [0.0]]]


def _floors(eps: float) -> list:
    return [[eps], [0.0]]


def cuda_local_stats(x: torch.Tensor):
    """This rank's per-channel ``(mean, biased var)`` from torch's one-pass statistics
    kernel (zeros for an empty ``x``)."""
    channels = x.shape[1]
    if x.numel() == 0:
        zeros = torch.zeros(channels, dtype=compute_dtype(x.dtype), device=x.device)
        return zeros, zeros
    if x.device.type == "cpu" and compute_dtype(x.dtype) != x.dtype:
        # the forced path on the CPU (tests, the bench): CUDA's kernel returns float32
        # statistics of half inputs; the CPU one does so only beside float32 running
        # buffers, which a momentum of 0 leaves as they are
        scratch = torch.zeros(channels, dtype=compute_dtype(x.dtype))
        return torch.batch_norm_update_stats(x, scratch, scratch.clone(), 0.0)
    return torch.batch_norm_update_stats(x, None, None, 0.0)


def cuda_pack_moments(mean, var, n: int, dtype: torch.dtype, fixed: tuple) -> torch.Tensor:
    """``[fixed, n, n * m, n * (var + m^2)]`` in ``dtype`` (the payload of every other
    path, :func:`cpu_pack_moments` and :func:`pack_moments` after the caller's ``fixed``
    integers, so that ranks on different paths sum alike) in three C-sized operations:

        rows    = [fixed, 1, m, var]                                  (cat)
        payload = [fixed, 0...] + n * rows * [0..., 1, 1...]          (addcmul)
        payload[n (var + m^2) part] += n * m * m                      (addcmul_)

    (the mask's zeros meet only the finite fixed values, so a NaN statistic never reaches
    the fixed part: the fingerprint's verdict stays exact). The vectors are kept device
    constants that do not depend on ``n`` (a batch of another size makes none); the
    ``addcmul`` also converts to ``dtype``.

    For float32 statistics the float64 products are exact (a float32 value times an
    integer below 2^29) but for ``n * m^2``, rounded once. No residual pass for the
    rounding of the mean: that rounding, d ~ u r std at |mean| / std = r (u = 2^-24; a
    few times that from the kernel's float32 Welford accumulation on CUDA), moves each
    rank's mean, so the merge sees the true spread of the ranks' means (~1 / sqrt(n) std
    for n elements per rank) shifted by d: the merged variance is off by about
    2 d / sqrt(n) + d^2 relative (1e-6 at r = 1e4, n = 2.6e5; 1e-4 only below n ~ 100
    there), the merged mean by ~u |mean|, the resolution of a float32 mean.
    torch.nn.SyncBatchNorm merges float32 means the same way. The CPU path measures the
    rounding and adds it back (:func:`local_moments`)."""
    channels, size, device = mean.shape[0], len(fixed), mean.device
    rows = torch.cat([constant(_listed, (tuple(fixed) + (1,),), mean.dtype, device), mean, var])
    payload = torch.addcmul(constant(_pack_offset, (tuple(fixed), channels), dtype, device),
                            rows, constant(_pack_mask, (size, channels), dtype, device), value=n)
    if n:
        payload[size + 1 + channels:].addcmul_(mean, mean, value=n)
    return payload


def cuda_statistics(summed: torch.Tensor, channels: int, eps: float, cdtype: torch.dtype):
    """From the group's sums ``[N, S1, S2]`` (:func:`cuda_pack_moments` summed):
    ``(mean, invstd, unbiased var, count)``, the first three in ``cdtype`` (what the
    normalizing kernels and the running buffers take), the global count as a 0-d tensor.
    Seven C-sized operations, no host read:

        [N, N - 1]             = N - [0, 1]                                   (sub)
        [mean, a, E2 + eps, F] = [[0, 0], [eps, 0]] + [S1, S2] / [N, N - 1]   (addcdiv)
        [var + eps, unbiased]  = [E2 + eps, F] - [mean, a] * mean             (addcmul_)

    (a = S1 / (N - 1), F = S2 / (N - 1): ``F - a * mean = (S2 - S1^2 / N) / (N - 1)``;
    the counts clamped below at 1 first, so that a group with no value, N = 0, gives finite
    zeros for the mean and variances instead of 0 / 0: its caller leaves the buffers alone),
    the results clamped below at [eps, 0], then ``rsqrt``, all in the sums' dtype (float64:
    the one cancellation, ``E2 - mean^2``, loses about 1e-16 (|mean| / std)^2 relative),
    and one conversion to ``cdtype``."""
    sums = summed[1:].view(2, 1, channels)
    counts = torch.sub(summed[:1], constant(_count_offsets, (), summed.dtype, summed.device)).view(1, 2, 1)
    counts.clamp_min_(1)  # N = 0 (every rank empty, the sums 0): zeros, not 0 / 0; N = 1 raises
    rows = torch.addcdiv(constant(_eps_rows, (eps,), summed.dtype, summed.device), sums, counts).view(4, channels)
    rows[2:].addcmul_(rows[:2], rows[:1], value=-1)
    rows[2:].clamp_min_(constant(_floors, (eps,), summed.dtype, summed.device))
    torch.rsqrt(rows[2], out=rows[1])
    out = rows.to(cdtype)
    return out[0], out[1], out[3], summed[0]


@torch.no_grad()
def update_running_buffers(running_mean, running_var, mean, unbiased, momentum, ok) -> None:
    """The running buffers (CPU and CUDA paths) moved towards ``mean`` and ``unbiased``
    by ``momentum`` where ``ok`` (a 0-d bool tensor; None: always): both lerps in one ``_foreach_lerp`` (a
    float momentum and the buffers in the statistics' dtype), then one ``torch.where`` per
    buffer that keeps it bit for bit where ``ok`` is false (:func:`move_buffer`)."""
    pairs = [(b, v) for b, v in ((running_mean, mean), (running_var, unbiased)) if b is not None]
    if not pairs:
        return
    if isinstance(momentum, torch.Tensor) or any(b.dtype != v.dtype for b, v in pairs):
        for buffer, value in pairs:
            move_buffer(buffer, value, momentum, ok)  # half buffers: moved in the wider dtype
        return
    buffers, values = [b for b, _ in pairs], [v for _, v in pairs]
    if ok is None:
        torch._foreach_lerp_(buffers, values, momentum)
        return
    for buffer, moved in zip(buffers, torch._foreach_lerp(buffers, values, momentum)):
        move_buffer(buffer, None, momentum, ok, moved=moved)


def _normalize_standin(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
    shift = torch.zeros_like(mean) if bias is None else bias.to(mean.dtype)
    return affine(x, mean, scale, shift).to(x.dtype)


def _input_grad_standin(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        weight: Optional[torch.Tensor], sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor,
                        count: torch.Tensor) -> torch.Tensor:
    return input_grad(dy, x, weight, mean, invstd, sum_dy, sum_dy_xmu * invstd, count.sum())


def _backward_reduce_standin(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                             weight: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
    # sum dy (x - mean) taken directly (invstd 1), as the CUDA kernel does: not the sum
    # of dy * xhat divided by invstd, which is 0 where the variance overflowed the compute
    # dtype (float32 inputs beyond about 1e19), and 0 / 0 was NaN in every input gradient
    ones = constant(_filled, (1.0, x.shape[1]), invstd.dtype, invstd.device)
    sum_dy, sum_dy_xmu = backward_sums(dy, x, mean, ones)
    dtype = sum_dy.dtype if weight is None else weight.dtype
    return sum_dy, sum_dy_xmu, (sum_dy_xmu * invstd).to(dtype), sum_dy.to(dtype, copy=True)


@functools.lru_cache(maxsize=None)
def _standins():
    """The three stand-ins as custom operators (one opaque operation each, like the CUDA
    kernels), registered on first use: only the forced path needs them, so importing
    syncbn registers nothing."""
    ops = (_normalize_standin, _input_grad_standin, _backward_reduce_standin)
    if not hasattr(torch.library, "custom_op"):
        return ops
    # the schemas written out: torch 2.4 cannot infer them from string annotations
    schemas = {
        "batch_norm_elemt_standin": "(Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor invstd) -> Tensor",
        "batch_norm_backward_elemt_standin": "(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight, "
        "Tensor sum_dy, Tensor sum_dy_xmu, Tensor count) -> Tensor",
        "batch_norm_backward_reduce_standin": "(Tensor dy, Tensor x, Tensor mean, Tensor invstd, Tensor? weight) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
    }
    return tuple(
        torch.library.custom_op(f"syncbn::{name}", mutates_args=(), schema=schema)(op)
        for (name, schema), op in zip(schemas.items(), ops)
    )


def cuda_normalize(x, weight, bias, mean, invstd) -> torch.Tensor:
    """``(x - mean) * invstd * weight + bias``: ``torch.batch_norm_elemt`` (one pass)."""
    if x.device.type == "cuda":
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, 0.0)
    return _standins()[0](x, weight, bias, mean, invstd)


def cuda_backward_reduce(dy, x, mean, invstd, weight, need_w: bool, need_b: bool):
    """``(sum dy, sum dy * (x - mean), weight gradient, bias gradient)`` per channel:
    ``torch.batch_norm_backward_reduce`` (one pass: read dy and x). The gradients are
    None unless asked for (``need_w``, ``need_b``)."""
    if x.device.type == "cuda":
        return torch.batch_norm_backward_reduce(dy, x, mean, invstd, weight, True, need_w, need_b)
    sum_dy, sum_dy_xmu, dw, db = _standins()[2](dy, x, mean, invstd, weight)
    return sum_dy, sum_dy_xmu, dw if need_w else None, db if need_b else None


def cuda_input_grad(dy, x, weight, mean, invstd, sum_dy, sum_dy_xmu, count) -> torch.Tensor:
    """:func:`input_grad` as ``torch.batch_norm_backward_elemt`` (one pass: read dy and
    x, write dx), which takes the group's ``sum dy * (x - mean)`` and integer counts."""
    counts = count.to(torch.int32).view(1)
    if x.device.type == "cuda":
        return torch.batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts)
    return _standins()[1](dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts)
