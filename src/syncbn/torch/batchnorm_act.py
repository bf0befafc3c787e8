r"""``syncbn.SyncBatchNormAct``: synchronized batch norm and an invertible activation in
one layer that keeps only its output for the backward pass.

Batch norm followed by an activation normally keeps two activation-sized tensors alive
for backward: the batch norm's input ``x`` and the activation's input (or output). This
layer keeps only its output ``y = act(w * xhat + b)`` and recovers what the backward
pass needs from it (the idea of InPlace-ABN, Rota Bulo et al., CVPR 2018): with an
invertible activation, ``z = act^-1(y)`` is the normalized, affine output, and
``xhat = (z - b) / w``. Training statistics are those of :class:`syncbn.SyncBatchNorm`
(one all-reduce of ``2C + 1`` float64 values forward, one of ``2C + 1`` values backward,
uneven and empty ranks exact), and the function computed is exactly batch norm
followed by the activation with the same weights: no reparametrization, so a
``BatchNorm2d`` checkpoint loads as it is.

**Recovering xhat, and when not to.** Dividing by ``w`` fails where ``w == 0`` (the
output holds no trace of ``x``) and loses precision where ``|w|`` is small next to
``|b|``: the stored ``z`` is rounded at the scale of ``|b|``, so ``xhat`` recovered from
it carries an error of about ``u * |b| / |w|`` (``u`` the unit roundoff of the stored
dtype). The activation adds its own factor: leaky_relu divides the negative side by its
slope, and ELU's inverse ``log1p(y / alpha)`` amplifies rounding by ``exp(-z)`` where
it saturates (at ``y == -alpha`` the value is lost). So, per channel and per forward
call, the layer bounds that amplification from ``w``, ``b``, the activation and (for ELU
only) this rank's most negative pre-activation::

    A = (|b| + tiny / s) / |w|                 identity (s = 1), leaky_relu (s = slope)
    A = max((|b| + tiny) / |w|, exp(-z_min) / |w|)        elu

(``tiny`` the smallest normal number of the stored dtype, for outputs near zero) and,
for every channel where ``A`` exceeds a budget (2**16 for float64, 2**8 for float32,
2**3 for float16, 2**2 for bfloat16) or ``w == 0`` (for ELU also where ``exp(-z_min)``
exceeds ``1 / (8 eps)``: there the output is too close to ``-alpha`` for the first-order
bound, or at it, whatever ``|w|``; see :func:`elu_limit`), the layer also keeps that channel's
input values and takes ``xhat`` from them, exactly as :class:`syncbn.SyncBatchNorm`
does, and the activation's slope at the pre-activation recomputed from them (the stored
output may have rounded it to zero). The choice is local to each rank and changes what
is saved, never what is communicated. Negative weights need nothing special: the
division keeps their sign. The input gradient itself is written without dividing by
``w`` (see :func:`syncbn.torch.stats.input_grad_from_output`). With these budgets the
recovered ``xhat`` is within about 1e-11 (float64), 1.5e-5 (float32), 4e-3 (float16)
or 8e-3 (bfloat16) of the true one. Choosing the channels reads a C-sized mask on the
host once per training forward (the amount saved depends on it; ELU also takes each
channel's local minimum and maximum, one more pass over the input); a layer that needs
no gradient skips it. On CUDA with Triton (:mod:`syncbn.torch.kernels`; identity,
leaky_relu, and elu on float32/float64 inputs, its local minimum and maximum found in the
moments kernel's pass) there is no host read: the channels are chosen on the device and their
inputs copied into a buffer of fixed size (``C // 16`` channels, at least 1: 0.53x of
the bytes BatchNorm + activation keep for C >= 16); should more channels need their
inputs in some call, that step's check (when its backward pass ends, before any
optimizer step) raises :class:`KeptChannelsOverflow` rather than let an inexact
gradient through, on every rank alike: where the layer syncs, each rank's overflow rides
in the backward all-reduce (the last value of its payload, a slot that every path of both
layers sends, 0 where nothing overflowed; made also where the rank's input needs no
gradient, as in :class:`SyncBatchNorm`) and the check reads the group's sum: every
synchronized backward does, so a :class:`SyncBatchNorm` rank beside it (a model fused on
some ranks only) and a rank on the general path raise it too, at the same point.
On the CPU, where the moments come from the centered input (:func:`syncbn.torch.stats.use_centered`),
that centered input is normalized in place (exact where |mean| >> std); otherwise one more
read of C flags on the CPU (no synchronisation there) picks how to normalize: the native
kernel's single pass ``x * scale + shift``, or, where some channel has ``|mean| > 16 std``,
the centered ``(x - mean) * scale + b``, which accelerators always use.

**In place, only when asked.** The layer writes its output over its input only with
``inplace=True`` (as ``torch.nn.LeakyReLU(inplace=True)``), or when
:func:`syncbn.fuse_batchnorm_act` has proved from the traced model (train and eval
modes) that the input is a convolution's or linear layer's fresh output that nothing else
reads; otherwise it works out of place, with the same numbers and the same saved bytes
(only the output is kept either way). Every in-place write is declared to autograd
(``ctx.mark_dirty``), so a reader that was missed gets autograd's error at backward, never
a wrong value. With ``inplace=True`` the layer follows torch's in-place operators: memory
that torch does not own (``torch.from_numpy``, ``torch.as_tensor``, ``torch.from_dlpack``)
is written through as ``LeakyReLU(inplace=True)`` would write it; the fusion helper never
chooses in-place for an input it cannot prove to be a fresh torch allocation. An input
that is not dense in its memory format is handled out of place. Eval mode never writes
over its input.

The backward pass never writes over the incoming gradient (autograd's contract gives a
``Function`` no such right): it works in a copy only where it made one itself (a cast to
the compute dtype, or a change of memory format).

**Higher-order gradients** (``create_graph=True``: gradient penalties,
``torch.autograd.functional.hessian``) are not supported: the backward pass raises a
``RuntimeError`` naming the layer whenever autograd asks for a differentiable backward,
whether or not the incoming gradient itself requires grad. ``torch.func`` transforms and
forward-mode AD raise a ``RuntimeError`` naming the layer in training mode; in eval mode
the layer is plain ``F.batch_norm`` and the activation and works under both. Use
:func:`syncbn.revert_sync_batchnorm` (batch norm and activation as separate torch modules)
for such computations.

**Activation checkpointing.** A training forward recomputed by :func:`syncbn.checkpoint`
normalizes as the first one did and leaves the running statistics alone (see
:func:`syncbn.torch.recompute.recomputing`); any other training forward, including one run by a
hook during a backward pass and the recomputation of a plain
``torch.utils.checkpoint.checkpoint``, moves them as ``torch.nn.BatchNorm2d`` does.

Activations: ``"identity"``, ``"leaky_relu"`` (``activation_param`` is the negative
slope, which must be positive: slope 0 is ReLU, which loses the sign of every negative
input, and a negative slope is not monotonic) and ``"elu"`` (``activation_param`` is
alpha, which must be positive). ReLU is not invertible, so a ReLU block must stay
``SyncBatchNorm`` + ``ReLU``.

Outside training (eval with running statistics, or with local batch statistics when the
layer tracks none) the layer is plain ``F.batch_norm`` and the activation, and never
communicates; when a gradient may be asked for, it hands ``F.batch_norm`` copies of the
running buffers (``C`` values each), so that a later training forward, which updates the
buffers in place, cannot change what this call's backward reads (``torch.nn.BatchNorm2d``
computes that gradient with the updated buffers). Training on one process, or in a
group of one, runs torch's own training kernel forward and one call of its backward kernel on the recovered ``z``
(:class:`_LocalBatchNormAct`) wherever no channel has to keep its input and
``w * w / sqrt(eps)`` cannot overflow, with leaky_relu or identity in float32 or
float64; otherwise the code used across ranks,
without the collectives.

Saved for backward per layer: the output (one activation-sized tensor), a few C-sized
vectors, and the inputs of the channels chosen above (none in the common case).
``BatchNorm2d`` + ``LeakyReLU`` keeps two activation-sized tensors. With
``"identity"`` there is no second tensor to save: the layer keeps its output instead of
its input, which helps only where the next layer keeps that output too.
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.fx import Proxy

from . import distributed, fingerprint, stats

try:
    import numpy as _numpy
except ImportError:  # torch runs without numpy; the fit check then uses torch ops
    _numpy = None
from .batchnorm import _SyncNormBase
from .functional import (KeptChannelsOverflow, _check_count, backward_payload, check_dtypes, flat_spatial, has_dual,
                         kept_capacity, overflow_elsewhere, refuse_capture, refuse_create_graph, refuse_dual,
                         unflat_spatial)
from .recompute import recomputing

__all__ = ["SyncBatchNormAct", "ACTIVATIONS", "KeptChannelsOverflow"]

ACTIVATIONS = ("identity", "leaky_relu", "elu")

# How much recovering xhat from the stored output may amplify its rounding (in units of
# the stored dtype's unit roundoff) before a channel keeps its input instead.
# Resulting error in xhat: float64 ~1e-11, float32 ~1.5e-5, float16 ~4e-3, bfloat16 ~8e-3.
AMPLIFICATION_BUDGET = {
    torch.float64: 2.0**16,
    torch.float32: 2.0**8,
    torch.float16: 2.0**3,
    torch.bfloat16: 2.0**2,
}



def _check_activation(activation, param):
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(
            f"SyncBatchNormAct: unknown activation {activation!r}; expected one of "
            f"{', '.join(repr(a) for a in ACTIVATIONS)} (ReLU is not invertible: keep "
            "SyncBatchNorm followed by nn.ReLU for it)"
        )
    # numbers.Real: numpy's scalars too (np.float32 is no float), as torch's activations take them
    if isinstance(param, bool) or not isinstance(param, numbers.Real) or not math.isfinite(param):
        raise ValueError(
            f"SyncBatchNormAct: activation_param must be a finite real number, got {param!r} "
            f"({type(param).__name__})"
        )
    param = float(param)
    if activation == "leaky_relu" and param <= 0:
        raise ValueError(
            f"SyncBatchNormAct: leaky_relu needs a positive negative slope (activation_param) "
            f"to be invertible, got {param}: slope 0 is ReLU, which maps every negative input "
            "to 0, and a negative slope is not monotonic"
        )
    if activation == "elu" and param <= 0:
        raise ValueError(
            f"SyncBatchNormAct: elu needs alpha (activation_param) > 0 to be invertible, got {param}"
        )
    return activation, param


def _channel_shape(ndim: int, channels: int) -> list:
    return [1, channels] + [1] * (ndim - 2)


def _activate(y: Tensor, activation: str, param: float, inplace: bool = False) -> Tensor:
    """The activation: out of place (as ``nn.LeakyReLU`` / ``nn.ELU`` compute it), or in
    place on a tensor that nothing else reads."""
    if activation == "leaky_relu":
        return F.leaky_relu(y, param, inplace=inplace)
    if activation == "elu":
        return F.elu(y, param, inplace=inplace)
    return y


def _leaky_inverse(y: Tensor, slope: float) -> Tensor:
    """``z`` from ``y = leaky_relu(z, slope)``: one ``leaky_relu`` by ``1 / slope``, or,
    for a slope whose reciprocal overflows ``y``'s dtype (below about 5.6e-309 in float64,
    2.9e-39 in float32: torch takes such slopes), ``y / slope`` on the negative side."""
    reciprocal = 1.0 / slope
    if reciprocal <= torch.finfo(y.dtype).max:
        return F.leaky_relu(y, reciprocal)
    return torch.where(y > 0, y, y / slope)


def _invert(y: Tensor, dy: Tensor, activation: str, param: float, cdtype, dy_owned: bool = False):
    """``(z, dz, owned)``: the activation's input recovered from its output and the
    gradient with respect to it, both in the compute dtype; ``owned`` tells whether
    ``z`` is a new tensor that the caller may overwrite (identity returns ``y`` itself).
    ``dz`` is written over ``dy`` only where ``dy`` is a copy this call made itself
    (``dy_owned``, or the cast to the compute dtype), never over autograd's gradient."""
    yc = y.to(cdtype)
    dyc = dy.to(cdtype)
    in_place = dy_owned or dyc is not dy
    if activation == "leaky_relu":
        z = _leaky_inverse(yc, param)
        if in_place:
            dz = torch.ops.aten.leaky_relu_backward.grad_input(dyc, yc, param, True, grad_input=dyc)
        else:
            dz = torch.ops.aten.leaky_relu_backward(dyc, yc, param, True)
    elif activation == "elu":
        if in_place:
            dz = torch.ops.aten.elu_backward.grad_input(dyc, param, 1, 1, True, yc, grad_input=dyc)
        else:
            dz = torch.ops.aten.elu_backward(dyc, param, 1, 1, True, yc)
        # log1p(min(y, 0) / alpha) + max(y, 0): log1p(y / alpha) where y < 0, else y
        z = yc.clamp(max=0)
        if param != 1.0:
            z.div_(param)
        z.log1p_().add_(yc.clamp_(min=0) if yc is not y else F.relu(yc))
    else:
        z, dz = yc, dyc
    return z, dz, z is not y


def _activation_grad(dy: Tensor, z: Tensor, activation: str, param: float) -> Tensor:
    """The gradient with respect to the activation's input ``z``, given at ``z``."""
    if activation == "leaky_relu":
        return torch.ops.aten.leaky_relu_backward(dy, z, param, False)
    if activation == "elu":
        return torch.ops.aten.elu_backward(dy, param, 1, 1, False, z)
    return dy


def _channels_to_keep(x, dtype, weight, bias, mean, invstd, activation, param) -> Tensor:
    """Boolean mask of the channels whose xhat cannot be recovered from the stored
    output (of ``dtype``) within the amplification budget (see the module docstring).
    ``x - mean`` must be the centered input (``x`` may be centered already)."""
    info = torch.finfo(dtype)
    budget = AMPLIFICATION_BUDGET.get(dtype, 2.0**2)
    floor = info.tiny / min(param, 1.0) if activation == "leaky_relu" else info.tiny
    scale = weight.abs()
    amplification = (bias.abs() + floor) / scale  # inf (or nan) where the weight is 0
    if activation == "elu":
        dims = stats.reduce_dims(x.dim())  # (amin + amax: far faster than aminmax on CPU)
        low, high = x.amin(dims).to(mean.dtype), x.amax(dims).to(mean.dtype)
        # the most negative pre-activation of each channel on this rank
        extreme = torch.where(weight >= 0, low, high)
        z_min = bias + weight * ((extreme - mean) * invstd)
        grow = torch.exp(-z_min) * (1 + info.tiny / param)
        return ~((torch.maximum(amplification, grow / scale) <= budget) & (grow <= elu_limit(dtype)))
    return ~(amplification <= budget)


def elu_limit(dtype) -> float:
    """The most ``exp(-z_min)`` that ELU's inverse may meet in an output of ``dtype``,
    ``1 / (8 eps)``: the output's rounding error (at most ``eps * alpha``, with the forward's
    own) is then at most an eighth of its distance ``alpha * exp(z)`` from ``-alpha``, where
    ``log1p`` stays within 7% of its first-order error. Beyond it, ``z`` is lost (at ``-alpha``
    exactly, ``log1p`` gives ``-inf``) however large ``|w|``: the budget's ``exp(-z_min) / |w|``
    alone would let such a channel through when ``|w|`` is large (``|w| > 2**12`` in float32)."""
    return 1.0 / (8.0 * torch.finfo(dtype).eps)


def _centering_needed(mean: Tensor, var: Tensor, device) -> bool:
    """Whether ``x * scale + shift`` (the native kernel's one pass) could lose accuracy
    that ``(x - mean) * scale`` keeps: only where |mean| is well above the standard
    deviation. A read of C flags on the CPU; elsewhere it would be a host
    synchronisation, so accelerators always take the centered path."""
    if device.type != "cpu":
        return True
    return bool((mean.abs() > 16 * var.sqrt()).any())


def _normalize(x: Tensor, mean: Tensor, var: Tensor, scale: Tensor, beta: Tensor, cdtype, inplace: bool) -> Tensor:
    """``(x - mean) * scale + beta`` per channel, written over ``x`` when ``inplace``."""
    if x.device.type in stats.NATIVE_KERNEL_DEVICES and (
        cdtype != x.dtype or not _centering_needed(mean, var, x.device)
    ):
        # one pass, x * scale + (beta - mean * scale), in any memory layout (half: the
        # native kernel in float32, rounded once, its error far below half's). Through
        # aten, not F.batch_norm: torch 2.10 and 2.11 (F.batch_norm) refuse eps = 0 even
        # outside training.
        return stats.affine(x, mean, scale, beta, out=x if inplace else None)
    shape = _channel_shape(x.dim(), x.shape[1])
    scale = scale.view(shape)
    y = x if inplace else torch.empty_like(x)
    if cdtype == x.dtype:  # centered first: exact where |mean| >> std
        torch.sub(x, mean.view(shape), out=y)
        torch.addcmul(beta.view(shape), y, scale, out=y)
    else:  # half: one pass in float32, rounded once (its error is far below half's)
        torch.addcmul(beta.view(shape) - mean.view(shape) * scale, x, scale, out=y)
    return y


class _SyncBatchNormAct(torch.autograd.Function):
    """Forward and backward of the activated layer; one all-reduce each way when syncing."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, syncing, activation, param, inplace,
                tag=None):
        channels = x.shape[1]
        n = x.numel() // channels if channels else 0
        ctx.triton = _takes_kernels(x, activation)
        if ctx.triton:
            return _triton_forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, syncing,
                                   activation, param, inplace, tag)
        # in place, the centered values go straight over the input, which becomes the output
        packed, centered, provisional = stats.pack_moments(
            x, stats.accumulate_dtype(x.device), keep=True, overwrite=inplace
        )
        ok = None
        if syncing:
            packed, ok = fingerprint.all_reduce_checked(packed, group, tag, distributed.group_size(group))
        count, mean, var = stats.merge_moments(packed, channels)
        # only ranks with at most one local value can see a global count of 1, and when it
        # is, every rank reads it and raises alike (a count of 0, every rank empty, is
        # torch's empty batch: the buffers stay as they are)
        _check_count(count, n, x.shape, syncing=syncing)
        if running_mean is not None or running_var is not None:
            stats.update_running_stats(running_mean, running_var, mean, var, count, momentum, ok=ok)

        cdtype = stats.compute_dtype(x.dtype)
        offset = None if centered is None else (mean - provisional.to(mean.dtype)).to(cdtype)
        mean = mean.to(cdtype)
        invstd = torch.rsqrt(var.to(cdtype) + eps)
        gamma = torch.ones_like(mean) if weight is None else weight.detach().to(cdtype)
        beta = torch.zeros_like(mean) if bias is None else bias.detach().to(cdtype)

        # the input as it is kept (centered where the moments centered it) and its mean
        source, center = (x, mean) if centered is None else (centered, offset)
        keep_idx = keep_x = None
        if any(ctx.needs_input_grad[:3]) and x.numel():
            keep = _channels_to_keep(source, x.dtype, gamma, beta, center, invstd, activation, param)
            keep_idx = keep.nonzero().flatten()
            if keep_idx.numel():
                keep_x = source.index_select(1, keep_idx)
            else:
                keep_idx = None

        if centered is None:
            y = _normalize(x, mean, var, gamma * invstd, beta, cdtype, inplace)
        else:  # the centered input kept from the moments: (x - s) - (mean - s), exact
            same = centered.dtype == x.dtype
            y = stats.affine(centered, offset, gamma * invstd, beta, out=x if inplace and same else centered)
            if not same:
                y = x.copy_(y) if inplace else y.to(x.dtype)
        _activate(y, activation, param, inplace=True)
        if inplace:
            ctx.mark_dirty(x)

        ctx.save_for_backward(y, keep_x, keep_idx, gamma, beta, center, invstd, count.clone())
        ctx.group = group
        ctx.syncing = syncing
        ctx.tag = tag
        ctx.activation = activation
        ctx.param = param
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("SyncBatchNormAct")
        if ctx.triton:
            return _triton_backward(ctx, dy)
        y, keep_x, keep_idx, gamma, beta, mean, invstd, count = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        channels = y.shape[1]
        cdtype = mean.dtype
        if y.numel() == 0:
            sum_dy = torch.zeros(channels, dtype=cdtype, device=y.device)
            sum_dy_xhat = torch.zeros_like(sum_dy)
        else:
            dy, own_copy = _grad_in_layout(dy, y)
            # the kept channels read dy again below: then dz gets its own buffer
            z, dz, owned = _invert(y, dy, ctx.activation, ctx.param, cdtype, dy_owned=own_copy and keep_idx is None)
            sum_dy, sum_dy_xhat = stats.backward_sums_from_output(dz, z, gamma, beta)
            if keep_idx is not None:
                # the kept channels, from their inputs: x-hat exactly, and the activation's
                # slope taken at the pre-activation itself (which the stored output may
                # have rounded to zero)
                x_kept = keep_x.to(cdtype)
                kept_mean, kept_invstd = mean[keep_idx], invstd[keep_idx]
                shape = _channel_shape(y.dim(), keep_idx.numel())
                z_kept = torch.addcmul(
                    beta[keep_idx].view(shape), x_kept - kept_mean.view(shape),
                    (gamma[keep_idx] * kept_invstd).view(shape),
                )
                dy_kept = dy.index_select(1, keep_idx).to(cdtype)
                dz_kept = _activation_grad(dy_kept, z_kept, ctx.activation, ctx.param)
                s1, s2 = stats.backward_sums(dz_kept, x_kept, kept_mean, kept_invstd)
                sum_dy.index_copy_(0, keep_idx, s1)
                sum_dy_xhat.index_copy_(0, keep_idx, s2)

        dx = None
        if ctx.syncing:  # also without an input gradient here (another rank may need one)
            # the payload of every synchronized path, [sum dy, sum dy (x - mean), overflow],
            # not sum dy xhat: a rank whose layer is a SyncBatchNorm (not fused there) sums
            # with this one under the same fingerprint (same name and width), and mixed sums
            # were wrong. The overflow slot (0: this path keeps every channel it needs) is
            # where the Triton path's ranks count their kept-channel overflow
            # invstd is 0 where the variance overflowed the compute dtype (float32 inputs
            # beyond about 1e19): xhat, and torch's input gradient there, are 0, and the sum
            # received is multiplied by that 0. Divided by 0 it was NaN on every rank
            packed = backward_payload(sum_dy, sum_dy_xhat / torch.where(invstd == 0, 1.0, invstd))
            packed, _ = fingerprint.all_reduce_checked(
                packed, ctx.group, ctx.tag, distributed.group_size(ctx.group), backward=True
            )
            # a SyncBatchNormAct of another rank on the kernels may have overflowed: raise with it
            fingerprint.defer_overflow(packed[2 * channels],
                                       functools.partial(overflow_elsewhere, "SyncBatchNormAct", channels, ctx.tag))
            total_dy, total_dy_xhat = packed[:channels], packed[channels:2 * channels] * invstd
        else:
            total_dy, total_dy_xhat = sum_dy, sum_dy_xhat
        if need_x:
            if y.numel() == 0:
                dx = torch.zeros_like(y)
            else:
                dx = stats.input_grad_from_output(
                    dz, z, gamma, beta, invstd, total_dy, total_dy_xhat, count, overwrite_z=owned
                )
                if keep_idx is not None:
                    dx_kept = stats.input_grad(
                        dz_kept, x_kept, gamma[keep_idx], kept_mean, kept_invstd,
                        total_dy[keep_idx], total_dy_xhat[keep_idx], count,
                    )
                    dx.index_copy_(1, keep_idx, dx_kept)
                dx = dx.to(y.dtype)
        dw = sum_dy_xhat.to(ctx.weight_dtype) if need_w else None
        db = sum_dy.to(ctx.bias_dtype) if need_b else None
        if ctx.syncing:
            fingerprint.end_step(ctx.group)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


# ---- the CUDA path with the Triton kernels (syncbn.torch.kernels) ---------------------
# No host read per call. The channels whose xhat the stored output cannot give back
# within the amplification budget are chosen on the device by the merge kernel (in
# channel order), and the normalizing kernel copies their inputs into a buffer of a fixed
# ``capacity`` of channels (C // 16, at least 1: for C >= 16 at most 1/16 of the input's
# bytes beside the output, 0.53x of what BatchNorm + activation keep).
# Should more channels need their inputs than the buffer holds, the kernel flags it and
# the step's check (syncbn.torch.fingerprint.check_agreement, when the backward pass ends,
# before any optimizer step) raises: the gradient of such a step is never used silently.
# Where the layer syncs, the flag rides in the backward all-reduce (grad_payload writes the
# rank's overflow after its sums, input_grad whether the group's sum is zero: no launch
# more) and the check is on that sum, so every rank raises when any rank overflowed (its
# inexact sums are in every rank's input gradient; the plain layer's input_grad and the
# general paths read that sum too, so ranks where this layer is a SyncBatchNorm, or off the
# kernels, raise alike: functional._defer_overflow). A rank whose input needs no gradient
# runs that all-reduce too (then three small torch ops read the verdict and the flag: not the
# common case); a layer that does not sync checks the rank's own flag.
# ELU's choice also depends on the data (each rank's own minimum and maximum per channel,
# found by the moments kernel in its pass and used by the merge kernel: local to the rank,
# like the CPU path's). Only for float32/float64 inputs: with half's budgets (2**3, 2**2)
# ELU channels keep their inputs wherever the normalized minimum is below about -1.4 to -2
# (nearly every channel of ordinary data), far beyond the fixed buffer; float16/bfloat16
# ELU takes the general path, which keeps as many channels as it needs.

KERNEL_ACTIVATIONS = ("identity", "leaky_relu", "elu")
KERNEL_ELU_DTYPES = (torch.float32, torch.float64)


def _takes_kernels(x: Tensor, activation: str) -> bool:
    return (activation in KERNEL_ACTIVATIONS and (activation != "elu" or x.dtype in KERNEL_ELU_DTYPES)
            and stats.cuda_path(x) and not distributed.compiling() and stats.triton_path(x))


def _triton_forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, syncing, activation,
                    param, inplace, tag):
    from . import kernels
    from .functional import _empty_payload, _momentum_tensor

    channels, device = x.shape[1], x.device
    n = x.numel() // channels
    cdtype = stats.compute_dtype(x.dtype)
    world = distributed.group_size(group) if syncing else 1
    fingerprint.check_world(world)
    if syncing:
        fixed = fingerprint.fixed_values(tag, torch.float64, device)
        agree = fingerprint.agreeing_values(tag, world, torch.float64, device)
    else:
        fixed = agree = stats.constant(stats._filled, (0.0, fingerprint.SIZE), torch.float64, device)
    capacity = kept_capacity(channels) if any(ctx.needs_input_grad[:3]) and n else -1
    elu = activation == "elu"
    local = None  # ELU: this rank's minimum and maximum per channel, from the moments' pass
    if n:
        partials = kernels.moment_partials(x, elu and capacity >= 0)
        if elu and capacity >= 0:
            payload, local = kernels.moment_payload(partials, fixed, n, True)
        else:
            payload = kernels.moment_payload(partials, fixed, n)
    else:  # an empty rank still takes part (and moves its buffers as the others do)
        payload = _empty_payload(channels, fixed)
    summed = distributed.all_reduce_sum(payload, group) if syncing else payload
    size = fingerprint.SIZE
    slope = param if activation in ("leaky_relu", "elu") else 1.0  # ELU: alpha
    stored = x.dtype if x.dtype in AMPLIFICATION_BUDGET else torch.float32
    budget, floor, _ = _fit_bounds(stored, activation, slope)
    scalars = stats.kernel_scalars(eps, device, slope, budget, floor, elu_limit(stored))
    stats_c, ok, slots, fits = kernels.merge(summed, agree, scalars, _momentum_tensor(momentum, device), running_mean,
                                             running_var, cdtype, weight, bias, capacity, local)
    if syncing:
        fingerprint.pending_verdict(summed[:size], group, tag, world, ok=ok)
    _check_count(summed[size], n, x.shape, device_side=True)
    # Where the backward pass all-reduces (the layer syncs and something needs a gradient),
    # each rank's overflow rides in its payload and the check is on the group's sum: every
    # rank raises alike. Without communication the rank's own flag is checked.
    grads = any(ctx.needs_input_grad[:3])
    ctx.late = late = grads and syncing
    ctx.fits = fits if capacity >= 0 and late else None
    ctx.overflow = None
    if grads:
        kept_cap = kept_capacity(channels)
        where = " (on this rank or another of the process group, whose sums are in every rank's)" if late else ""
        ctx.overflow = KeptChannelsOverflow(
            f"SyncBatchNormAct({channels}): more channels than the {kept_cap} it can keep have a weight too small "
            f"next to their bias ((|b| + tiny) / |w| > {budget:g}; w = 0, a NaN weight or bias and an infinite "
            "bias included)"
            f"{' or saturate the ELU (exp(-z_min) / |w| > budget, or exp(-z_min) > 1 / (8 eps))' if elu else ''} for "
            f"their input to be recovered from the output{where}; this step's gradients are not exact. Use "
            "SyncBatchNorm followed by the activation for this layer (syncbn.revert_sync_batchnorm, or "
            "fuse_batchnorm_act leaving it out).")
    if capacity >= 0 and not late:
        fingerprint.defer(fits, ctx.overflow)
    if n:
        y, keep = kernels.normalize(x, weight, bias, stats_c, scalars, kernels.ACTIVATION_CODES[activation],
                                    slots if capacity > 0 else None, max(capacity, 0), out=x if inplace else None)
    else:
        y, keep = x if inplace else torch.empty_like(x), x.new_empty(0)
    if inplace:
        ctx.mark_dirty(x)
    ctx.save_for_backward(y, keep, slots, weight, bias, stats_c, summed[size])
    ctx.group, ctx.syncing, ctx.tag, ctx.world = group, syncing, tag, world
    ctx.scalars = scalars
    ctx.mode = 2 if elu else 1
    ctx.weight_dtype = None if weight is None else weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype
    return y


def _triton_backward(ctx, dy):
    from . import kernels
    from .functional import _empty_payload

    y, keep, slots, weight, bias, stats_c, count = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if not kernels.flattenable(dy):
        dy = dy.contiguous(memory_format=stats.memory_format(y))
    cdtype, device = stats_c.dtype, y.device
    if ctx.syncing:
        fixed = fingerprint.fixed_values(ctx.tag, cdtype, device)
        agree = fingerprint.agreeing_values(ctx.tag, ctx.world, cdtype, device)
    else:
        fixed = agree = stats.constant(stats._filled, (0.0, fingerprint.SIZE), cdtype, device)
    kept = slots if keep.numel() else None
    wdtype, bdtype = ctx.weight_dtype or cdtype, ctx.bias_dtype or cdtype
    if y.numel():
        partials = kernels.grad_partials(dy, y, stats_c, ctx.scalars, weight, bias, kept, keep, mode=ctx.mode)
        payload, dw, db = kernels.grad_payload(partials, fixed, stats_c, ctx.mode, wdtype, bdtype, ctx.fits)
    else:  # an empty rank: zero sums and no overflow (functional's empty payload), still in the all-reduce
        channels = y.shape[1]
        payload = _empty_payload(channels, fixed)
        dw = torch.zeros(channels, dtype=wdtype, device=device)
        db = torch.zeros(channels, dtype=bdtype, device=device)
    dx = ok = fit = None
    flag = fingerprint.SIZE + 2 * y.shape[1]  # the summed overflow (grad_payload's last value)
    # a syncing rank all-reduces also without an input gradient of its own (another rank may
    # need one; see functional._SyncBatchNorm.backward)
    summed = distributed.all_reduce_sum(payload, ctx.group) if ctx.syncing else payload
    if need_x:
        if y.numel():
            dx, ok, fit = kernels.input_grad(dy, y, stats_c, ctx.scalars, weight, bias, kept, keep, summed, count,
                                             agree, ctx.mode, y.dtype)
        else:
            dx = torch.zeros_like(y)
    if ctx.syncing:
        fingerprint.pending_verdict(summed[:fingerprint.SIZE], ctx.group, ctx.tag, ctx.world, backward=True, ok=ok)
    if ctx.late:  # every rank the same verdict on the group's overflow (an empty rank: one op)
        fingerprint.defer_overflow(summed[flag], ctx.overflow, fit)
    if ctx.syncing:
        fingerprint.end_step(ctx.group)
    else:  # the kept-channel check of the forward (fingerprint.defer) when this pass ends
        fingerprint.check_after_backward()
    return (dx, dw if need_w else None, db if need_b else None, None, None, None, None, None, None, None, None, None,
            None)


_FIT_BOUNDS = {}  # (dtype, activation, param) -> (budget, floor, least)


def _fit_bounds(dtype, activation: str, param: float):
    key = (dtype, activation, param)
    bounds = _FIT_BOUNDS.get(key)
    if bounds is None:
        info = torch.finfo(dtype)
        budget = AMPLIFICATION_BUDGET[dtype]
        floor = info.tiny / min(param, 1.0) if activation == "leaky_relu" else info.tiny
        bounds = _FIT_BOUNDS[key] = (budget, floor, budget * info.tiny**0.25)
    return bounds


_HOST_VIEWS = {}  # id(parameter) -> (weak reference, data pointer, numel, dtype, numpy view)


def _host_view(t: Tensor):
    """A numpy array over the memory of the CPU tensor ``t`` (so it always reads its
    current values), made once and kept while ``t`` lives and stays where it is: a
    parameter replaced through ``.data = ...``, moved or cast gets a new view. Its
    values are read each call; only the wrapping is cached (a C-sized check costs
    several times more with a fresh ``detach().numpy()`` per call)."""
    key = id(t)
    entry = _HOST_VIEWS.get(key)
    if entry is not None and entry[0]() is t and entry[1] == t.data_ptr() and entry[2] == t.numel() \
            and entry[3] == t.dtype:
        return entry[4]
    view = t.detach().numpy()
    _HOST_VIEWS[key] = (weakref.ref(t, lambda _, key=key: _HOST_VIEWS.pop(key, None)), t.data_ptr(), t.numel(),
                        t.dtype, view)
    return view


def _local_kernels_fit(x: Tensor, weight, bias, activation: str, param: float, eps: float = 1e-5) -> bool:
    """Whether a training call without communication can take :class:`_LocalBatchNormAct`:
    torch's own kernels on a CPU or CUDA float32/float64 input, leaky_relu or identity,
    and no channel that would have to keep its input (every ``|w|`` clear of zero and
    within the amplification budget of ``|b|``, as in :func:`_channels_to_keep`; also
    ``|w| >= tiny ** 0.25`` so that ``w * w * invstd`` below cannot underflow, and
    ``|w| <= sqrt(max * sqrt(eps) / 4)`` so that it cannot overflow: ``invstd`` is at
    most ``1 / sqrt(eps)``). One read of a flag on the host, as the general path's
    channel choice."""
    if activation == "elu" or x.dtype not in (torch.float32, torch.float64) or distributed.compiling():
        return False
    if x.device.type not in stats.NATIVE_KERNEL_DEVICES:
        return False
    if weight is None:
        return bias is None
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return False
    # max(|b|, budget * tiny ** 0.25) + floor <= budget * |w| (implies the amplification
    # bound of _channels_to_keep, (|b| + floor) / |w| <= budget, and |w| >= tiny ** 0.25)
    budget, floor, least = _fit_bounds(x.dtype, activation, param)
    most = math.sqrt(torch.finfo(x.dtype).max * math.sqrt(eps) / 4)
    if x.device.type == "cpu" and _numpy is not None:  # C-sized: numpy costs a fraction of torch here
        scaled = _numpy.abs(_host_view(weight))
        if not (scaled <= most).all():
            return False
        scaled *= budget
        if bias is None:
            return bool((scaled >= least + floor).all())
        need = _numpy.abs(_host_view(bias))
        _numpy.maximum(need, least, out=need)
        need += floor
        return bool((need <= scaled).all())
    with torch.no_grad():
        need = torch.full_like(weight, least) if bias is None else bias.abs().clamp_min_(least)
        scaled = weight.abs()
        return bool(((need.add_(floor) <= scaled * budget) & (scaled <= most)).all())


# Below this size the native training kernel's single call beats the centered moments'
# dozen small operations. Fused block time / SyncBatchNorm + LeakyReLU on this project's
# CPUs, native kernel vs centered moments: 2x256x28x28 1.15x vs 1.26x; 2x256x56x56 1.06x
# vs 0.83x.
_LOCAL_CENTERED_MIN_ELEMENTS = 2**20


class _LocalBatchNormAct(torch.autograd.Function):
    """The layer without communication (no process group, or a group of one), on
    torch's own kernels: the training batch-norm kernel (statistics, running buffers and
    normalization in one call; for large inputs in the standard CPU layout the centered
    moments of :func:`syncbn.torch.stats.centered_moments` and one affine pass instead, faster
    there), the activation in place; backward recovers ``z`` from the output and makes
    one call of the native backward kernel with ``z`` as its input,
    ``b`` as its mean and ``1 / w`` as its inverse standard deviation (so that its
    ``xhat`` is ``(z - b) / w``) and ``w * w * invstd`` as its weight (so that its
    ``dx`` carries ``w * invstd``): the input, weight and bias gradients in one pass.
    Only for inputs that :func:`_local_kernels_fit` admits."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, activation, param, inplace):
        if x.numel() // x.shape[1] <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}"
            )
        if (stats.memory_format(x) is torch.contiguous_format and stats.use_centered(x)
                and x.numel() >= _LOCAL_CENTERED_MIN_ELEMENTS):
            # torch's training kernel walks each channel with one scalar accumulator
            # here: the centered moments are faster (and exact), then one affine pass
            n = x.numel() // x.shape[1]
            mean, m2, centered, provisional = stats.centered_moments(x, torch.float64, keep=True)
            var = m2.div_(n)
            if running_mean is not None or running_var is not None:
                stats.update_running_stats(running_mean, running_var, mean, var, n, momentum)
            invstd = var.add_(eps).rsqrt_().to(x.dtype)
            scale = invstd if weight is None else invstd * weight
            shift = torch.zeros_like(invstd) if bias is None else bias
            # from the centered input, (x - s) - (mean - s): no cancellation at |mean| >> std
            offset = (mean - provisional.to(mean.dtype)).to(x.dtype)
            y = stats.affine(centered, offset, scale, shift, out=x if inplace else centered)
            if inplace:
                ctx.mark_dirty(x)
        elif inplace:
            mean, invstd = x.new_empty(0), x.new_empty(0)
            torch.ops.aten.native_batch_norm.out(
                x, weight, bias, running_mean, running_var, True, momentum, eps,
                out=x, save_mean=mean, save_invstd=invstd,
            )
            y = x
            ctx.mark_dirty(x)
        else:
            y, _, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
        _activate(y, activation, param, inplace=True)
        ctx.save_for_backward(y, weight, bias, invstd)
        ctx.activation = activation
        ctx.param = param
        return y

    @staticmethod
    def backward(ctx, dy):
        refuse_create_graph("SyncBatchNormAct")
        y, weight, bias, invstd = ctx.saved_tensors
        # the per-channel vectors first: small operations run faster before the passes
        # over the data than between them
        w = torch.ones_like(invstd) if weight is None else weight.detach()
        b = torch.zeros_like(invstd) if bias is None else bias.detach()
        scale, reciprocal = w * w * invstd, w.reciprocal()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dy, own_copy = _grad_in_layout(dy, y)
        if ctx.activation == "leaky_relu":
            z = _leaky_inverse(y, ctx.param)
            if own_copy:  # dz over this call's own copy of dy: one buffer fewer
                dz = torch.ops.aten.leaky_relu_backward.grad_input(dy, y, ctx.param, True, grad_input=dy)
            else:
                dz = torch.ops.aten.leaky_relu_backward(dy, y, ctx.param, True)
        else:
            z, dz = y, dy
        dx, dw, db = torch.ops.aten.native_batch_norm_backward(
            dz, z, scale, None, None, b, reciprocal, True, 0.0, [need_x, need_w, need_b]
        )
        return dx, dw, db, None, None, None, None, None, None, None


def _grad_in_layout(dy: Tensor, y: Tensor):
    """``(dy in y's memory format, whether that is a copy made here)``: only such a copy
    may be overwritten; autograd's own gradient never is."""
    laid_out = dy.contiguous(memory_format=stats.memory_format(y))
    return laid_out, laid_out is not dy


def _eval_buffers(running_mean, running_var, needs_grad: bool):
    """The running buffers for an eval-mode call: copies when a gradient may be asked
    for, so a later training forward (which updates the buffers in place) cannot change
    what this call's backward reads; the buffers themselves otherwise."""
    if not needs_grad and not torch.jit.is_tracing():  # a trace: alike with and without grad
        return running_mean, running_var
    return (None if running_mean is None else running_mean.clone(),
            None if running_var is None else running_var.clone())


def _in_place_refusal(x: Tensor) -> Optional[str]:
    """torch's reason to refuse an in-place write to ``x`` under autograd (a leaf that
    requires grad, or a view of one), else None: checked before anything is written,
    since the Function's ``mark_dirty`` would refuse only after the output is over ``x``."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return None
    if x.is_leaf:
        return "a leaf Variable that requires grad is being used in an in-place operation."
    base = x._base  # a view's base tensor (None for a tensor that owns its storage)
    if base is not None and base.is_leaf and base.requires_grad:
        return "a view of a leaf Variable that requires grad is being used in an in-place operation."
    return None


@distributed.eager_unless_traceable
def _synchronized(layer, input, running_mean, running_var, momentum, syncing: bool, inplace: bool):
    """The layer's general call: its fingerprint (when it communicates) and the function."""
    tag = fingerprint.forward_tag(layer, layer.num_features, layer.process_group,
                                  graph=fingerprint.records_graph(input, layer.weight, layer.bias)) if syncing else None
    return _SyncBatchNormAct.apply(
        input, layer.weight, layer.bias, running_mean, running_var, layer.eps, momentum,
        layer.process_group, syncing, layer.activation, layer.activation_param, inplace, tag,
    )


class SyncBatchNormAct(_SyncNormBase):
    r"""Synchronized batch normalization followed by an invertible activation, keeping
    only the output for the backward pass.

    .. math::
        y = \mathrm{act}\left(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}
            * \gamma + \beta\right)

    Exactly :class:`syncbn.SyncBatchNorm` followed by the activation (same statistics,
    same running buffers, same communication: one all-reduce forward and one backward in
    training, none in eval, uneven and empty ranks exact), with the backward pass rebuilt
    from the output (see :mod:`syncbn.torch.batchnorm_act` for the method and its safeguards).

    Args:
        num_features: C of an input (N, C, *).
        activation: ``"leaky_relu"`` (default), ``"elu"`` or ``"identity"``.
        activation_param: the negative slope of leaky_relu (> 0), or alpha of elu (> 0);
            ignored by identity. Default 0.01 for both.
        eps, momentum, affine, track_running_stats, process_group, device, dtype: as
            :class:`syncbn.SyncBatchNorm`. Keyword-only ``bias=False`` drops the shift.
        inplace: keyword-only, default False. True writes the training output over the
            input (as ``torch.nn.LeakyReLU(inplace=True)``; declared to autograd, so an
            input that something else still needs raises at backward). It saves one
            activation-sized allocation at the forward peak, not in what is kept for
            backward.

    Shapes: input (N, C, *) of any rank from 2, as :class:`syncbn.SyncBatchNorm`; output
    the same shape and memory format (with ``inplace=True`` in training, the input
    tensor itself).
    The ``state_dict`` is that of ``torch.nn.BatchNorm2d``. Higher-order gradients,
    ``torch.func`` transforms and forward-mode AD raise in training (see the module docs).
    """

    def __init__(
        self,
        num_features: int,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
        inplace: bool = False,
    ) -> None:
        activation, activation_param = _check_activation(activation, activation_param)
        if not isinstance(inplace, bool):
            raise TypeError(f"SyncBatchNormAct: inplace must be True or False, got {inplace!r}")
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype, bias=bias
        )
        self.activation = activation
        self.activation_param = activation_param
        self.inplace = inplace

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):  # torch.fx.symbolic_trace: one call of the layer
            node = self._fx_leaf(input, SyncBatchNormAct.forward)
            if node is not None:
                return node
        self._check_input_dim(input)
        guard = self.__dict__.get("_syncbn_fusion_guard")
        if guard is not None:  # set by fuse_batchnorm_act: the traced model still holds
            guard()
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        local_plain = not (bn_training and self.training)  # eval: running or local batch stats
        captured = False
        syncing = not local_plain and distributed.group_size(self.process_group) > 1
        if not local_plain and input.device.type == "meta":
            # a meta input has shapes and no values (shape inference): nothing to choose kept
            # channels from or to sum across ranks; torch's ops give BatchNorm + activation's
            # output (shape, dtype, memory format), on every rank alike
            local_plain = captured = True
            syncing = False
        if syncing:  # before the momentum count moves: every rank alike, before any collective
            refuse_capture(type(self).__name__, self)  # export, jit.trace, torch.func
            refuse_dual(type(self).__name__, self, input, self.weight, self.bias)
        elif not local_plain and (distributed.transforming() or distributed.exporting() or distributed.tracing()
                                  or has_dual(input, self.weight, self.bias)):
            # one process under a capture that cannot hold the layer's own autograd Function
            # (a torch.func transform, forward-mode AD, torch.export) or would keep this
            # call's host-read choices as constants (torch.jit.trace: the kept channels, the
            # general path's shapes): F.batch_norm and the activation, exactly what
            # BatchNorm + activation compute (and what the capture takes or refuses as it
            # does them), without the memory saving; the activation out of place, as an
            # activation module computes it (ELU's in-place backward reads its output:
            # other roundings)
            local_plain = captured = True
        if not syncing and input.numel() == 0:
            local_plain = True  # an empty batch on one process: as torch.nn does it
        # a checkpoint's recomputed forward (as SyncBatchNorm): same output, buffers moved once
        again = self.training and recomputing()
        momentum = self._momentum(as_tensor=not local_plain, count=not again)
        track = not bn_training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if again:  # the recomputation's update lands in throwaway copies
            running_mean = None if running_mean is None else running_mean.clone()
            running_var = None if running_var is None else running_var.clone()
        if local_plain:
            if isinstance(momentum, Tensor):
                momentum = float(momentum)
            if not bn_training:
                needs_grad = torch.is_grad_enabled() and any(
                    t is not None and t.requires_grad for t in (input, self.weight, self.bias))
                running_mean, running_var = _eval_buffers(running_mean, running_var, needs_grad)
            out = F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, momentum, self.eps)
            return _activate(out, self.activation, self.activation_param, inplace=not captured)
        if self.eps <= 0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {self.eps}")
        check_dtypes(input, self.weight, self.bias, running_mean, running_var, type(self).__name__)
        inplace = self.inplace and input.is_contiguous(memory_format=stats.memory_format(input))
        refusal = _in_place_refusal(input) if inplace else None
        if refusal is not None:  # computed out of place (every rank's collective runs), then refused
            inplace = False
        given, input = input, flat_spatial(input)  # beyond 5 dims: (N, C, L), a view of a contiguous input
        if not syncing and not _takes_kernels(input, self.activation) and _local_kernels_fit(
                input, self.weight, self.bias, self.activation, self.activation_param, self.eps):
            if isinstance(momentum, Tensor):
                momentum = float(momentum)
            out = _LocalBatchNormAct.apply(
                input, self.weight, self.bias, running_mean, running_var, self.eps, momentum,
                self.activation, self.activation_param, inplace,
            )
        else:
            out = _synchronized(self, input, running_mean, running_var, momentum, syncing, inplace)
        if refusal is not None:
            raise RuntimeError(
                f"SyncBatchNormAct(inplace=True): {refusal} The input is left unchanged (the running "
                "statistics moved, as with BatchNorm followed by an in-place activation). Pass the "
                "layer a computed tensor, or set inplace=False."
            )
        if inplace and given is not input:  # beyond 5 dims: written over the input's (N, C, L) view
            return given
        return unflat_spatial(out, given)

    def extra_repr(self) -> str:
        text = f"{self.num_features}, activation={self.activation!r}"
        if self.activation != "identity":
            text += f", activation_param={self.activation_param}"
        # torch's batch norms say whether the layer has a shift (bias=False, or affine=False)
        text += (
            f", eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"bias={self.bias is not None}, track_running_stats={self.track_running_stats}"
        )
        if self.inplace:
            text += ", inplace=True"
        if self.process_group is not None:
            text += ", process_group=custom"
        return text
