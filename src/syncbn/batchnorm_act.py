r"""``syncbn.SyncBatchNormAct``: synchronized batch norm and an invertible activation in
one layer that keeps only its output for the backward pass.

Batch norm followed by an activation normally keeps two activation-sized tensors alive
for backward: the batch norm's input ``x`` and the activation's input (or output). This
layer keeps only its output ``y = act(w * xhat + b)`` and recovers what the backward
pass needs from it (the idea of InPlace-ABN, Rota Bulo et al., CVPR 2018): with an
invertible activation, ``z = act^-1(y)`` is the normalized, affine output, and
``xhat = (z - b) / w``. Training statistics are those of :class:`syncbn.SyncBatchNorm`
(one all-reduce of ``2C + 1`` float64 values forward, one of ``2C`` values backward,
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
2**3 for float16, 2**2 for bfloat16) or ``w == 0``, the layer also keeps that channel's
input values and takes ``xhat`` from them, exactly as :class:`syncbn.SyncBatchNorm`
does, and the activation's slope at the pre-activation recomputed from them (the stored
output may have rounded it to zero). The choice is local to each rank and changes what
is saved, never what is communicated. Negative weights need nothing special: the
division keeps their sign. The input gradient itself is written without dividing by
``w`` (see :func:`syncbn.stats.input_grad_from_output`). With these budgets the
recovered ``xhat`` is within about 1e-11 (float64), 1.5e-5 (float32), 4e-3 (float16)
or 8e-3 (bfloat16) of the true one. Choosing the channels reads a C-sized mask on the
host once per training forward (the only host synchronisation the layer adds, needed
because the amount saved depends on it; ELU also takes each channel's local minimum
and maximum, one more pass over the input); a layer that needs no gradient skips it.
On the CPU, where the moments come from the centered input (:func:`syncbn.stats.use_centered`),
that centered input is normalized in place (exact where |mean| >> std); otherwise one more
read of C flags on the CPU (no synchronisation there) picks how to normalize: the native
kernel's single pass ``x * scale + shift``, or, where some channel has ``|mean| > 16 std``,
the centered ``(x - mean) * scale + b``, which accelerators always use.

**In place.** The output is written over the input when nothing else can read the
input afterwards; otherwise the layer works out of place, with the same numbers and the
same saved bytes (in both cases only the output is kept). The input is overwritten only
when every one of these holds: it is a plain tensor that is not a leaf requiring grad,
not a view, not aliased by another tensor (its storage has no other user, which also
rules out a producer that saved its own output, such as ``relu``), not saved for
backward by another operation (no other C++ owner), has no tensor hooks, weak
references or ``retain_grad``; the layer has no module hooks and is called through
``Module.__call__``; and no Python name or container holds the input beyond the call
itself, checked with its reference count against a count measured once, at first use,
for the same call path. In practice: ``bnact(conv(x))`` and the layer inside
``nn.Sequential`` (where the container's loop variable is rebound right away) run in
place; ``x = conv(x); x = bnact(x)`` and anything else keeping ``x`` run out of place.
When the Python version makes a held tensor indistinguishable from a temporary by its
reference count, the layer never works in place.

The backward pass works in place too: the activation's gradient goes over the incoming
gradient when that is a fresh tensor that only the autograd engine and this call hold
(in a network, the input gradient of the next layer), so the pass allocates only the
recovered pre-activation and the input gradient (the synchronized path builds the input
gradient in the pre-activation's memory: one new tensor in all). The check compares the
gradient's Python, TensorImpl and storage reference counts with those of such a fresh
gradient, measured once at the first training forward together with two cases that must
differ from it (the caller's own tensor, and a gradient the engine still owes another
node, as ``a + b`` hands both sides the same tensor); if either cannot be told apart,
the incoming gradient is never overwritten. A gradient passed in by the caller
(``y.backward(g)``, ``torch.autograd.grad(y, x, g)``), kept by a hook or owed to a node
that has yet to run, a view, one that requires grad (double backward), and any gradient
when some channels keep their inputs get a buffer of their own (``retain_grad`` keeps a
copy, which is never touched).

Activations: ``"identity"``, ``"leaky_relu"`` (``activation_param`` is the negative
slope, which must be positive: slope 0 is ReLU, which loses the sign of every negative
input, and a negative slope is not monotonic) and ``"elu"`` (``activation_param`` is
alpha, which must be positive). ReLU is not invertible, so a ReLU block must stay
``SyncBatchNorm`` + ``ReLU``.

Outside training (eval with running statistics, or with local batch statistics when the
layer tracks none) the layer is plain ``F.batch_norm`` and the activation, and never
communicates. Training on one process, or in a group of one, runs torch's own
training kernel forward and one call of its backward kernel on the recovered ``z``
(:class:`_LocalBatchNormAct`) wherever no channel has to keep its input, with
leaky_relu or identity in float32 or float64; otherwise the code used across ranks,
without the collectives.

Saved for backward per layer: the output (one activation-sized tensor), a few C-sized
vectors, and the inputs of the channels chosen above (none in the common case).
``BatchNorm2d`` + ``LeakyReLU`` keeps two activation-sized tensors. With
``"identity"`` there is no second tensor to save: the layer keeps its output instead of
its input, which helps only where the next layer keeps that output too.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import distributed, fingerprint, stats

try:
    import numpy as _numpy
except ImportError:  # torch runs without numpy; the fit check then uses torch ops
    _numpy = None
from .batchnorm import _SyncNormBase
from .functional import recomputing

__all__ = ["SyncBatchNormAct", "ACTIVATIONS"]

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
    if isinstance(param, bool) or not isinstance(param, (int, float)) or not math.isfinite(param):
        raise ValueError(f"SyncBatchNormAct: activation_param must be a finite number, got {param!r}")
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


def _activate_(y: Tensor, activation: str, param: float) -> Tensor:
    """The activation, in place on a tensor that nothing else reads."""
    if activation == "leaky_relu":
        return F.leaky_relu(y, param, inplace=True)
    if activation == "elu":
        return F.elu(y, param, inplace=True)
    return y


def _invert(y: Tensor, dy: Tensor, activation: str, param: float, cdtype, overwrite_dy: bool = False):
    """``(z, dz, owned)``: the activation's input recovered from its output and the
    gradient with respect to it, both in the compute dtype; ``owned`` tells whether
    ``z`` is a new tensor that the caller may overwrite (identity returns ``y`` itself).
    ``dz`` is written over ``dy`` when ``overwrite_dy`` (nothing else reads ``dy``), or
    over its compute-dtype copy."""
    yc = y.to(cdtype)
    dyc = dy.to(cdtype)
    in_place = overwrite_dy or dyc is not dy
    if activation == "leaky_relu":
        z = F.leaky_relu(yc, 1.0 / param)
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
        amplification = torch.maximum(amplification, torch.exp(-z_min) * (1 + info.tiny / param) / scale)
    return ~(amplification <= budget)


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
        # the native inference kernel, in one pass in any memory layout (half: in
        # float32, rounded once, its error far below half's)
        ones = torch.ones_like(mean)
        if not inplace:
            return F.batch_norm(x, mean, ones, scale, beta, False, 0.0, 0.0)
        empty = x.new_empty(0, dtype=cdtype)
        torch.ops.aten.native_batch_norm.out(
            x, scale, beta, mean, ones, False, 0.0, 0.0, out=x, save_mean=empty, save_invstd=empty.clone()
        )
        return x
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
        # in place, the centered values go straight over the input, which becomes the output
        packed, centered, provisional = stats.pack_moments(
            x, stats.accumulate_dtype(x.device), keep=True, overwrite=inplace
        )
        ok = None
        if syncing:
            packed, ok = fingerprint.all_reduce_checked(packed, group, tag, distributed.group_size(group))
        count, mean, var = stats.merge_moments(packed, channels)
        # as in syncbn.functional: only ranks with at most one local value can see a
        # global count <= 1, and when it is, every rank reads it and raises alike
        if n <= 1 and int(count.item()) <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {int(count.item())} "
                f"value(s) per channel in total across the process group (local input shape "
                f"{tuple(x.shape)})"
            )
        if running_mean is not None or running_var is not None:
            fingerprint.update_running_stats(ok, running_mean, running_var, mean, var, count, momentum)

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
        _activate_(y, activation, param)
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
    @once_differentiable
    def backward(ctx, dy):
        refs = sys.getrefcount(dy)  # first: see _grad_is_free
        y, keep_x, keep_idx, gamma, beta, mean, invstd, count = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        channels = y.shape[1]
        cdtype = mean.dtype
        if y.numel() == 0:
            sum_dy = torch.zeros(channels, dtype=cdtype, device=y.device)
            sum_dy_xhat = torch.zeros_like(sum_dy)
        else:
            dy, free = _grad_in_layout(dy, y, refs)
            # the kept channels read dy again below: then dz gets its own buffer
            z, dz, owned = _invert(y, dy, ctx.activation, ctx.param, cdtype, overwrite_dy=free and keep_idx is None)
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
        if need_x:
            packed = torch.cat([sum_dy, sum_dy_xhat])
            if ctx.syncing:
                packed, _ = fingerprint.all_reduce_checked(
                    packed, ctx.group, ctx.tag, distributed.group_size(ctx.group), backward=True
                )
            total_dy, total_dy_xhat = packed[:channels], packed[channels:]
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


def _local_kernels_fit(x: Tensor, weight, bias, activation: str, param: float) -> bool:
    """Whether a training call without communication can take :class:`_LocalBatchNormAct`:
    torch's own kernels on a CPU or CUDA float32/float64 input, leaky_relu or identity,
    and no channel that would have to keep its input (every ``|w|`` clear of zero and
    within the amplification budget of ``|b|``, as in :func:`_channels_to_keep`; also
    ``|w| >= tiny ** 0.25`` so that ``w * w * invstd`` below cannot underflow). One read
    of a flag on the host, as the general path's channel choice."""
    if activation == "elu" or x.dtype not in (torch.float32, torch.float64) or _compiling():
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
    if x.device.type == "cpu" and _numpy is not None:  # C-sized: numpy costs a fraction of torch here
        scaled = _numpy.abs(_host_view(weight))
        scaled *= budget
        if bias is None:
            return bool((scaled >= least + floor).all())
        need = _numpy.abs(_host_view(bias))
        _numpy.maximum(need, least, out=need)
        need += floor
        return bool((need <= scaled).all())
    with torch.no_grad():
        need = torch.full_like(weight, least) if bias is None else bias.abs().clamp_min_(least)
        return bool((need.add_(floor) <= weight.abs().mul_(budget)).all())


# Below this size the native training kernel's single call beats the centered moments'
# dozen small operations. Fused block time / SyncBatchNorm + LeakyReLU on this project's
# CPUs, native kernel vs centered moments: 2x256x28x28 1.15x vs 1.26x; 2x256x56x56 1.06x
# vs 0.83x.
_LOCAL_CENTERED_MIN_ELEMENTS = 2**20


class _LocalBatchNormAct(torch.autograd.Function):
    """The layer without communication (no process group, or a group of one), on
    torch's own kernels: the training batch-norm kernel (statistics, running buffers and
    normalization in one call; for large inputs in the standard CPU layout the centered
    moments of :func:`syncbn.stats.centered_moments` and one affine pass instead, faster
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
        _activate_(y, activation, param)
        ctx.save_for_backward(y, weight, bias, invstd)
        ctx.activation = activation
        ctx.param = param
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        refs = sys.getrefcount(dy)  # first: see _grad_is_free
        y, weight, bias, invstd = ctx.saved_tensors
        # the per-channel vectors first: small operations run faster before the passes
        # over the data than between them
        w = torch.ones_like(invstd) if weight is None else weight.detach()
        b = torch.zeros_like(invstd) if bias is None else bias.detach()
        scale, reciprocal = w * w * invstd, w.reciprocal()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dy, free = _grad_in_layout(dy, y, refs)
        if ctx.activation == "leaky_relu":
            z = F.leaky_relu(y, 1.0 / ctx.param)
            if free:  # dz over dy: one buffer fewer
                dz = torch.ops.aten.leaky_relu_backward.grad_input(dy, y, ctx.param, True, grad_input=dy)
            else:
                dz = torch.ops.aten.leaky_relu_backward(dy, y, ctx.param, True)
        else:
            z, dz = y, dy
        dx, dw, db = torch.ops.aten.native_batch_norm_backward(
            dz, z, scale, None, None, b, reciprocal, True, 0.0, [need_x, need_w, need_b]
        )
        return dx, dw, db, None, None, None, None, None, None, None


# ---- may the input be overwritten? ---------------------------------------------------


class _RefProbe(nn.Module):
    """Measures, at its first statement, what SyncBatchNormAct.forward measures at its."""

    def forward(self, input):
        refs = sys.getrefcount(input)
        frame = sys._getframe(1)
        self.seen = (refs, frame.f_code, frame.f_back.f_code, frame.f_back.f_back.f_code)
        del frame
        return input


class _Fresh(nn.Module):
    def forward(self, input):
        return torch.empty(0)


class _Keep(nn.Module):
    def forward(self, input):
        self.kept = torch.empty(0)
        return self.kept


def _probe_temporary(probe):
    probe(torch.empty(0))
    return probe.seen


def _probe_held(probe):
    held = torch.empty(0)
    probe(held)
    return probe.seen


def _measure_call_path():
    """Reference counts of a layer's input seen at the top of ``forward`` on the plain
    ``Module.__call__`` path: for a temporary, and for the output of the previous layer
    of an ``nn.Sequential``. Each is checked against the same situation with one more
    holder; if the two cannot be told apart, in-place is off (returns None)."""
    probe = _RefProbe()
    temporary, call_impl, wrapped, _ = _probe_temporary(probe)
    held = _probe_held(probe)[0]
    nn.Sequential(_Fresh(), probe)(torch.empty(0))
    sequential, seq_impl, seq_wrapped, seq_code = probe.seen
    nn.Sequential(_Keep(), probe)(torch.empty(0))
    seq_held = probe.seen[0]
    if seq_code is not nn.Sequential.forward.__code__:
        return None
    if not (held > temporary and seq_held > sequential):
        return None
    if seq_impl is not call_impl or seq_wrapped is not wrapped:
        return None
    return {"temporary": temporary, "sequential": sequential, "call_impl": call_impl,
            "wrapped": wrapped, "sequential_code": seq_code}


_CALL_PATH = []  # [measurement or None], filled at first use


def _call_path():
    if not _CALL_PATH:
        try:
            _CALL_PATH.append(_measure_call_path())
        except Exception:  # an unusual interpreter: never overwrite
            _CALL_PATH.append(None)
    return _CALL_PATH[0]


_MODULE_HOOKS = (
    "_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_hooks", "_global_forward_pre_hooks",
)


def _has_module_hooks(module: nn.Module) -> bool:
    from torch.nn.modules import module as module_impl

    if module._backward_hooks or module._backward_pre_hooks or module._forward_hooks or module._forward_pre_hooks:
        return True
    return any(getattr(module_impl, name, True) for name in _MODULE_HOOKS)


def _storage_users(t: Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_FRESH_COUNTS = []  # [(TensorImpl users, storage users)] of a fresh tensor


def _fresh_counts():
    if not _FRESH_COUNTS:
        t = torch.empty(1)
        _FRESH_COUNTS.append((t._use_count(), _storage_users(t)))
    return _FRESH_COUNTS[0]


def _can_overwrite(module: nn.Module, x: Tensor, refs) -> bool:
    """True when no one but this call can read ``x`` after it (see the module docstring)."""
    if refs is None or type(x) is not torch.Tensor:
        return False
    if x.requires_grad and x.is_leaf:
        return False
    if x._is_view() or not x.is_contiguous(memory_format=stats.memory_format(x)) or x.retains_grad:
        return False
    if x.is_inference() and not torch.is_inference_mode_enabled():
        return False
    if getattr(x, "_backward_hooks", None) or weakref.getweakrefs(x):
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(x) or x.device.type == "meta":
        return False
    impl_users, storage_users = _fresh_counts()
    if x._use_count() > impl_users or _storage_users(x) > storage_users:
        return False
    if _has_module_hooks(module):
        return False
    path = _call_path()
    if path is None:
        return False
    frame = sys._getframe(2)  # forward's caller: Module._call_impl
    try:
        if frame.f_code is not path["call_impl"] or frame.f_back.f_code is not path["wrapped"]:
            return False
        caller = frame.f_back.f_back.f_code
    finally:
        del frame
    limit = path["sequential"] if caller is path["sequential_code"] else path["temporary"]
    return refs <= limit


# ---- may the incoming gradient be overwritten? ----------------------------------------


class _GradProbe(torch.autograd.Function):
    """Measures, at the first statement of its backward, what the layer's backward
    measures at its: the reference counts of the incoming gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        refs = sys.getrefcount(dy)
        _GRAD_PROBE_SEEN.append((refs, dy._use_count(), _storage_users(dy)))
        return dy.clone()


_GRAD_PROBE_SEEN = []
_GRAD_BASELINE = []  # [(Python refs, TensorImpl users, storage users) of a gradient no one else holds, or None]


def _measure_grad_baseline():
    """The counts of an incoming gradient that nothing but the engine and the call hold
    (the fresh output of the next node's backward), checked against the same gradient
    held by the caller, and against one that another node still has to read: None when
    either cannot be told apart from the free one."""
    x = torch.zeros(3, requires_grad=True)
    with torch.enable_grad():
        _GRAD_PROBE_SEEN.clear()
        (_GradProbe.apply(x) * 2.0).sum().backward()
        free = _GRAD_PROBE_SEEN[-1]
        held = torch.ones(3)
        _GradProbe.apply(x).backward(held)
        caller = _GRAD_PROBE_SEEN[-1]
        other = x * 3.0  # its node runs after the probe's: it still holds the shared gradient
        ((_GradProbe.apply(x) + other) * 2.0).sum().backward()
        shared = _GRAD_PROBE_SEEN[-1]
    _GRAD_PROBE_SEEN.clear()
    distinct = lambda seen: any(a > b for a, b in zip(seen, free))  # noqa: E731
    return free if distinct(caller) and distinct(shared) else None


_GRAD_BASELINE_LOCK = threading.Lock()  # data-parallel threads may run their first forwards at once


def _grad_baseline(measure: bool = False):
    """The measurement above, taken once, at a training forward (never inside a backward
    pass, where the engine's nesting could change the counts)."""
    if not _GRAD_BASELINE and measure:
        with _GRAD_BASELINE_LOCK:
            if not _GRAD_BASELINE:
                try:
                    _GRAD_BASELINE.append(_measure_grad_baseline())
                except Exception:  # an unusual interpreter or autograd build: never overwrite
                    _GRAD_BASELINE.append(None)
    return _GRAD_BASELINE[0] if _GRAD_BASELINE else None


def _grad_is_free(dy: Tensor, refs: int) -> bool:
    """True when the gradient handed to a backward call can be overwritten: a plain,
    non-view tensor that needs no grad, which nothing but the engine and this call
    holds (``refs`` is its Python reference count taken at the first statement of the
    backward). A gradient that the caller passed in (``y.backward(g)``,
    ``autograd.grad(..., g)``), that a hook keeps, or that the engine still owes
    another node (``a + b``: both sides get the same tensor) has more holders than the
    baseline measured by :func:`_measure_grad_baseline`."""
    base = _grad_baseline()
    if base is None or type(dy) is not torch.Tensor or dy.requires_grad or dy._is_view():
        return False
    if weakref.getweakrefs(dy) or torch._C._functorch.is_functorch_wrapped_tensor(dy) or _compiling():
        return False
    return refs <= base[0] and dy._use_count() <= base[1] and _storage_users(dy) <= base[2]


def _grad_in_layout(dy: Tensor, y: Tensor, refs: int):
    """``(dy in y's memory format, whether it may be overwritten)``: a copy made here is
    this call's own; the tensor as it came needs :func:`_grad_is_free`."""
    laid_out = dy.contiguous(memory_format=stats.memory_format(y))
    return laid_out, laid_out is not dy or _grad_is_free(dy, refs)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


class SyncBatchNormAct(_SyncNormBase):
    r"""Synchronized batch normalization followed by an invertible activation, keeping
    only the output for the backward pass.

    .. math::
        y = \mathrm{act}\left(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}
            * \gamma + \beta\right)

    Exactly :class:`syncbn.SyncBatchNorm` followed by the activation (same statistics,
    same running buffers, same communication: one all-reduce forward and one backward in
    training, none in eval, uneven and empty ranks exact), with the backward pass rebuilt
    from the output (see :mod:`syncbn.batchnorm_act` for the method and its safeguards).

    Args:
        num_features: C of an input (N, C, *).
        activation: ``"leaky_relu"`` (default), ``"elu"`` or ``"identity"``.
        activation_param: the negative slope of leaky_relu (> 0), or alpha of elu (> 0);
            ignored by identity. Default 0.01 for both.
        eps, momentum, affine, track_running_stats, process_group, device, dtype: as
            :class:`syncbn.SyncBatchNorm`. Keyword-only ``bias=False`` drops the shift.

    Shapes: input (N, C), (N, C, L), (N, C, H, W) or (N, C, D, H, W); output the same
    shape and memory format, often the very input tensor (see "In place" in the module
    docs). The ``state_dict`` is that of ``torch.nn.BatchNorm2d``.
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
    ) -> None:
        activation, activation_param = _check_activation(activation, activation_param)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, device, dtype, bias=bias
        )
        self.activation = activation
        self.activation_param = activation_param

    def forward(self, input: Tensor) -> Tensor:
        refs = None if _compiling() else sys.getrefcount(input)  # first: nothing else may hold it yet
        self._check_input_dim(input)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        local_plain = not (bn_training and self.training)  # eval: running or local batch stats
        syncing = not local_plain and distributed.group_size(self.process_group) > 1
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
            out = F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, momentum, self.eps)
            return _activate_(out, self.activation, self.activation_param)
        if self.eps <= 0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {self.eps}")
        inplace = _can_overwrite(self, input, refs)
        if not _GRAD_BASELINE and not again and torch.is_grad_enabled() and refs is not None \
                and type(input) is torch.Tensor and not torch._C._functorch.is_functorch_wrapped_tensor(input):
            _grad_baseline(measure=True)  # once, here: never inside a backward pass, a transform or compile
        if not syncing and _local_kernels_fit(input, self.weight, self.bias, self.activation, self.activation_param):
            if isinstance(momentum, Tensor):
                momentum = float(momentum)
            return _LocalBatchNormAct.apply(
                input, self.weight, self.bias, running_mean, running_var, self.eps, momentum,
                self.activation, self.activation_param, inplace,
            )
        tag = fingerprint.forward_tag(self, self.num_features, self.process_group) if syncing else None
        return _SyncBatchNormAct.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum,
            self.process_group, syncing, self.activation, self.activation_param, inplace, tag,
        )

    def extra_repr(self) -> str:
        text = f"{self.num_features}, activation={self.activation!r}"
        if self.activation != "identity":
            text += f", activation_param={self.activation_param}"
        text += (
            f", eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}"
        )
        if self.process_group is not None:
            text += ", process_group=custom"
        return text
