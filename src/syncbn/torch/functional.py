"""Synchronized batch normalization as a function, in the style of
``torch.nn.functional.batch_norm``.

Training across a process group of W > 1 ranks, per channel c:

    mu    = sum over all ranks of x / N
    var   = sum over all ranks of (x - mu)^2 / N          (biased)
    y     = (x - mu) / sqrt(var + eps) * weight + bias

with N the global element count of the channel. The backward pass sums
``dy`` and ``dy * xhat`` over all ranks, so the input gradient is the one a single
device would compute on the concatenated batch; the weight and bias gradients stay
local sums, to be averaged by the data-parallel wrapper.

On CUDA the work is done by the Triton kernels of :mod:`syncbn.torch.kernels` where
Triton is installed (four kernels forward, three backward, no host read), else by
torch's ops (:mod:`syncbn.torch.stats`, the CUDA path).

One all-reduce of ``2C + 1`` values in forward, one of ``2C + 1`` in backward (the two
sums and a 0, the slot where :class:`syncbn.SyncBatchNormAct`'s kernels count the ranks
that ran out of kept channels, so that both layers send one payload; made by
every rank whose backward reaches the layer, also where its own input needs no gradient:
ranks need not agree on that), whatever the world size; each also carries the call's
fingerprint (18 values, :mod:`syncbn.torch.fingerprint`), so ranks in different layer calls
raise instead of mixing statistics. Not distributed, a group of
one, or not training: exactly ``torch.nn.functional.batch_norm``.

``torch.compile(..., fullgraph=True)`` traces all of it without a graph break: the
autograd Function, its functional all-reduce each way, the running-buffer update (an
input mutation the compiler writes back) and the local-moment kernel (through the
``syncbn::pack_moments`` custom op). The host reads of the eager CPU path (the global
count, the fingerprint's verdict, whether some |mean| is far above the std) cost nothing
on the CPU; under the compiler the count check and the verdict are asserts inside the
graph.
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import distributed, fingerprint, stats
from .recompute import recomputing

__all__ = ["sync_batch_norm", "InputDtypeError", "InputTypeError", "check_input", "check_channels", "flat_spatial",
           "unflat_spatial", "check_dtypes", "recomputing", "refuse_create_graph", "refuse_capture", "has_dual", "refuse_dual",
           "refuse_export", "refuse_trace", "refuse_transform"]


def refuse_create_graph(name: str) -> None:
    """Raise, naming the layer, when autograd runs a backward pass with
    ``create_graph=True`` (grad mode is then on inside ``backward``): the synchronized
    backward passes are not differentiable, and a gradient built without a graph would
    silently drop every second-order term, even when the incoming gradient is a constant."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: higher-order gradients are not supported (a backward pass with "
            "create_graph=True reached the layer: gradient penalty, hessian, double backward). "
            "Use torch.nn batch norm for that computation (syncbn.revert_sync_batchnorm), or "
            "keep the layer out of the differentiated graph."
        )


def _label(name: str, layer) -> str:
    """``name``, with the model's name for ``layer`` where syncbn.name_layers recorded one."""
    recorded = getattr(layer, "_syncbn_name", None)
    return name if recorded is None else f"{name} {recorded!r}"


def refuse_export(name: str, layer=None) -> None:
    """Raise, naming the layer and the fix, while ``torch.export.export`` traces a
    training-mode call that synchronizes (``SyncBatchNormAct`` in one process takes torch's
    ops under an export instead of its own Function). torch (2.13) exports such a Function
    as its forward alone: the program's forward synchronizes, one all-reduce per layer
    (nested in ``wrap_with_set_grad_enabled`` subgraphs after the first), but no gradient
    flows through the layer, so a backward pass through ``exported.module()`` raises, or,
    where the loss reaches the input another way, makes no backward all-reduce and gives
    wrong input gradients and no parameter gradients. Depends only on the call: every rank
    that exports raises alike, before any collective."""
    if not distributed.exporting():
        return
    raise RuntimeError(
        f"{_label(name, layer)}: torch.export.export cannot capture this layer in training mode: the exported "
        "program would keep its forward (batch statistics, all-reduced across ranks; the running-buffer "
        "update) but not its backward (a custom autograd Function, exported as its forward alone), so "
        "gradients through the layer would be missing or wrong, with no backward all-reduce. Export "
        "the model in eval mode (model.eval(): running statistics, no collective), or "
        "call syncbn.revert_sync_batchnorm(model) first (torch's batch norms, which export with their "
        "backward; in training they normalize each rank's batch alone)."
    )


def refuse_trace(name: str, layer=None) -> None:
    """Raise, naming the layer and the fix, while ``torch.jit.trace`` records a
    training-mode call that synchronizes (W > 1 ranks). A trace keeps every Python-side
    value of the call as a constant (the call index of the layer fingerprint, the choice
    of path) and cannot record the all-reduce: torch (2.13) failed inside it with "Tried to
    trace <...ProcessGroup object> but it is not part of the active trace", the momentum
    count already moved. Called before the count moves: depends only on the call, so every
    rank that traces raises alike, before any collective."""
    if not distributed.tracing():
        return
    raise RuntimeError(
        f"{_label(name, layer)}: torch.jit.trace cannot record this layer in training mode across "
        "ranks: a trace cannot hold the all-reduce of the batch statistics, and it would keep each "
        "Python-side value of the call (the layer's call index in the cross-rank check, the path "
        "taken) as a constant. Trace the model in eval mode (model.eval(): running statistics, no "
        "collective), or call syncbn.revert_sync_batchnorm(model) first (torch's batch norms; in "
        "training they normalize each rank's batch alone)."
    )


def refuse_transform(name: str, layer=None) -> None:
    """Raise, naming the layer, the transforms and the fix, when a training-mode call that
    synchronizes is made under a ``torch.func`` transform (``SyncBatchNormAct`` in one
    process takes torch's ops under one instead of its own Function): the Functions have no
    ``setup_context`` (nor a vmap rule), so torch would refuse them with its generic message.
    Depends only on the call: every rank alike, before any collective."""
    if not distributed.transforming():
        return
    raise RuntimeError(
        f"{_label(name, layer)}: torch.func transforms (grad, vjp, jacrev, jacfwd, hessian, vmap, "
        "jvp, functionalize) cannot run this layer in training mode: its training call is a custom "
        "autograd Function (the synchronized statistics and their backward) that they cannot "
        "differentiate or batch. Use torch.autograd instead (loss.backward(), torch.autograd.grad, "
        "with torch.func.functional_call for substituted parameters), put the layer in eval mode "
        "(model.eval()), or call syncbn.revert_sync_batchnorm(model) first (torch's batch norms, "
        "which torch.func takes with track_running_stats=False: "
        "torch.func.replace_all_batch_norm_modules_; in training they normalize each rank's batch "
        "alone)."
    )


def has_dual(*tensors) -> bool:
    """Whether any of ``tensors`` is a forward-mode dual tensor (``torch.autograd.forward_ad``),
    which the layers' own autograd Functions cannot carry (they have no ``jvp``)."""
    from torch.autograd import forward_ad

    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def refuse_dual(name: str, layer, *tensors) -> None:
    """Raise, naming the layer and the fix, when a training-mode call that synchronizes is
    given a forward-mode dual tensor (:func:`has_dual`): torch would refuse it with its
    generic error only after the forward all-reduce and the running buffers' update.
    Depends only on the call: every rank alike, before any collective."""
    if not has_dual(*tensors):
        return
    raise RuntimeError(
        f"{_label(name, layer)}: forward-mode AD (torch.autograd.forward_ad) cannot run this layer in "
        "training mode across ranks: its training call is a custom autograd Function (the "
        "synchronized statistics and their backward). Put the layer in eval mode (model.eval()), or "
        "call syncbn.revert_sync_batchnorm(model) first (torch's modules; in training they "
        "normalize each rank's batch alone)."
    )


def refuse_capture(name: str, layer=None) -> None:
    """:func:`refuse_export`, :func:`refuse_trace` and :func:`refuse_transform` at once: what
    a synchronizing training call asks before its momentum count moves and before any
    collective (``SyncBatchNorm``, :func:`sync_batch_norm`)."""
    refuse_export(name, layer)
    refuse_trace(name, layer)
    refuse_transform(name, layer)


# The local moments come from a native kernel that torch 2.13 cannot trace with fake
# tensors. Under torch.compile the packing is called through this custom op instead: one
# opaque kernel for the compiler, the same code as eager (stats.pack_moments). A torch
# without torch.library.custom_op (before 2.4) traces stats.pack_moments directly, and
# torch.compile without fullgraph then falls back to eager for it (a graph break).
def _pack_moments_eager(x: Tensor, dtype: torch.dtype) -> Tensor:
    return stats.pack_moments(x, dtype)


_pack_moments_op = None
if hasattr(torch.library, "custom_op"):
    # the schema written out: torch 2.4 cannot infer it from this module's string
    # annotations (``from __future__ import annotations``)
    _pack_moments_op = torch.library.custom_op(
        "syncbn::pack_moments", mutates_args=(), schema="(Tensor x, ScalarType dtype) -> Tensor"
    )(_pack_moments_eager)

    @_pack_moments_op.register_fake
    def _(x: Tensor, dtype: torch.dtype) -> Tensor:
        return x.new_empty(2 * x.shape[1] + 1, dtype=dtype)


def _pack_moments(x: Tensor, dtype: torch.dtype) -> Tensor:
    if _pack_moments_op is not None and distributed.compiling():
        return _pack_moments_op(x, dtype)
    return stats.pack_moments(x, dtype)


def _check_count(count: Tensor, n: int, shape, device_side: bool = False, syncing: bool = True) -> None:
    """Raise on every rank when the group holds exactly one value per channel.

    That is torch's rule (``torch.nn.BatchNorm2d`` raises for one value per channel and
    takes an empty batch: an empty output, the running buffers as they were). A group
    whose ranks are all empty (a global count of 0) passes: the callers leave the running
    buffers alone there. Only a rank that holds at most one element per channel can live
    in a group whose global count is 1; ranks with more know the count is fine. So the
    ranks that read the count are exactly the ranks that may have to raise, and when the
    count is 1 they all read it and all raise. Under torch.compile the host read would
    break the graph: there the check is an asynchronous assert in the graph instead
    (raised where the compiled kernel runs, on the same ranks). The CUDA path
    (``device_side``) takes that assert too: no host synchronisation, at the price of a
    device-side error. ``syncing=False`` (one process, a layer that computes locally)
    drops "across the process group" from the message.
    """
    if n > 1:
        return
    where = " across the process group" if syncing else ""
    if device_side or distributed.compiling():
        torch._assert_async(count != 1, f"Expected more than 1 value per channel when training{where}")
        return
    _refuse_count(count.item(), shape, syncing)


def _refuse_count(total: float, shape, syncing: bool = True) -> None:
    """Raise where the group's count ``total`` (the same number on every rank) is 1
    (0, every rank empty, is an empty batch, as torch.nn takes it)."""
    if total == 1:
        where = " across the process group" if syncing else ""
        raise ValueError(
            f"Expected more than 1 value per channel when training{where}, got {int(total)} "
            f"value(s) per channel in total (local input shape {tuple(shape)})"
        )


class InputDtypeError(TypeError, NotImplementedError):
    """An input of a dtype no batch norm computes in (integer, bool, complex). A
    ``TypeError``, which it is, and the ``NotImplementedError`` that torch's batch norms
    raise for it (``"batch_norm" not implemented for 'Long'``), so that code catching
    torch's class catches ours."""


class InputTypeError(TypeError, AttributeError):
    """An input that is no tensor. A ``TypeError``, which it is, and the
    ``AttributeError`` that torch's batch norms raise for it (``'list' object has no
    attribute 'dim'``), so that code catching torch's class catches ours."""


def check_input(input: Tensor, num_features: Optional[int], name: str = "sync_batch_norm",
                source: str = "num_features", channels: bool = True) -> None:
    """Raise a clear error for an input no batch norm can take, with the exception class
    ``torch.nn.SyncBatchNorm`` raises for it: ``ValueError`` for fewer than 2 dims and
    (unless ``channels`` is False) for an input without channels, ``RuntimeError`` for a
    channel count other than ``num_features`` (the size of the layer's ``source``: None
    skips that check, as torch does where the layer holds no per-channel tensor),
    :class:`InputDtypeError` (a ``TypeError`` and torch's ``NotImplementedError``) for a
    non-float input, :class:`InputTypeError` (a ``TypeError`` and torch's
    ``AttributeError``) for one that is no tensor.

    These depend only on the layer and the input's shape and dtype, so every rank that
    runs the same model raises the same error before any collective is issued.
    """
    if not isinstance(input, Tensor):
        raise InputTypeError(f"{name}: expected a torch.Tensor input, got {type(input).__name__}")
    if input.dim() < 2:
        raise ValueError(
            f"{name}: expected at least 2D input of shape (N, C, *), got {input.dim()}D input "
            f"of shape {tuple(input.shape)}"
        )
    if channels and input.shape[1] == 0:
        raise ValueError(
            f"{name}: number of input channels should be non-zero, got input of shape {tuple(input.shape)}"
        )
    if num_features is not None and input.shape[1] != num_features:
        raise _channel_count_error(input, num_features, name, source)
    if not input.is_floating_point():
        raise InputDtypeError(f"{name}: expected a floating-point input, got dtype {input.dtype}")


def _channel_count_error(input: Tensor, expected: int, name: str, source: str) -> RuntimeError:
    return RuntimeError(
        f"{name}: expected {expected} channels in dim 1 ({source}), got input "
        f"of shape {tuple(input.shape)} with {input.shape[1]} channels"
    )


def check_channels(input: Tensor, name: str = "sync_batch_norm", channels: bool = True, **tensors) -> None:
    """:func:`check_input` against the size of every per-channel tensor given (None
    skipped): ``running_mean``, ``running_var``, ``weight``, ``bias``. The input is
    checked once, then each size (the errors and their order are those of
    ``check_input(input, t.numel(), name, f"the size of {source}", channels)`` per tensor)."""
    check_input(input, None, name, channels=channels)
    count = input.shape[1]
    for source, t in tensors.items():
        if t is not None and t.numel() != count:
            raise _channel_count_error(input, t.numel(), name, f"the size of {source}")


def flat_spatial(input: Tensor) -> Tensor:
    """``input`` as (N, C, L) where it has more than 5 dims (the statistics of a channel
    are over dim 0 and every dim after 1 alike; a view where the dims merge, else a copy),
    so that every path (kernels, layouts) sees at most 5 dims; itself otherwise. The
    result's :func:`unflat_spatial` has the input's shape."""
    return input.flatten(2) if input.dim() > 5 else input


def unflat_spatial(output: Tensor, input: Tensor) -> Tensor:
    """``output``, computed on ``flat_spatial(input)``, in ``input``'s shape (a view)."""
    return output.unflatten(2, input.shape[2:]) if input.dim() > 5 else output


_HALF = (torch.float16, torch.bfloat16)


def check_dtypes(input: Tensor, weight, bias, running_mean, running_var, name: str = "sync_batch_norm") -> None:
    """Refuse, on the CPU, the dtype mixes that torch's CPU batch norm refuses: the weight,
    bias and running buffers given must share one dtype, the input's, or float32 for a
    float16/bfloat16 input. The synchronized paths would compute any mix, so without this
    a model would train with W > 1 ranks and fail alone (or in eval) with the same layers.
    Other devices are left to their own paths. Depends only on the call: every rank alike."""
    if input.device.type != "cpu":
        return
    given = {key: t.dtype for key, t in (("weight", weight), ("bias", bias), ("running_mean", running_mean),
                                          ("running_var", running_var)) if t is not None}
    kinds = set(given.values())
    if not kinds or kinds == {input.dtype} or (input.dtype in _HALF and kinds == {torch.float32}):
        return
    allowed = f"{input.dtype}" + (" or all torch.float32" if input.dtype in _HALF else "")
    found = ", ".join(f"{key} {dtype}" for key, dtype in given.items())
    raise RuntimeError(
        f"{name}: mixed dtype: for a {input.dtype} input the weight, bias and running buffers must all be "
        f"{allowed} (as torch.nn's batch norm requires on the CPU), got {found}; convert the input or the "
        f"layer (layer.to(dtype))"
    )


class _SyncBatchNorm(torch.autograd.Function):
    """Forward and backward of the synchronized layer; one all-reduce each way."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, tag):
        channels = x.shape[1]
        n = x.numel() // channels if channels else 0
        centered = None
        world = distributed.group_size(group)
        ctx.group, ctx.tag, ctx.world = group, tag, world
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.cuda = stats.cuda_path(x) and not distributed.compiling()
        ctx.triton = ctx.cuda and stats.triton_path(x)
        if ctx.triton:  # 4 kernels, 3 passes, no host read (syncbn.torch.kernels)
            y, stats_c, count = _triton_forward(x, weight, bias, running_mean, running_var, eps, momentum,
                                                group, tag, world)
            ctx.eps = eps
            ctx.save_for_backward(x, weight, stats_c, count)
            return y
        if ctx.cuda:  # 3 passes, no host read (stats.cuda_path)
            y, mean_c, invstd, count = _cuda_forward(x, weight, bias, running_mean, running_var, eps, momentum,
                                                     group, tag, world)
            ctx.save_for_backward(x, weight, mean_c, invstd, count)
            return y
        # the CPU path reads its verdicts at once (tests take "cpu" out of the immediate
        # devices to run the portable path below, as on devices without native kernels)
        ctx.cpu = x.device.type == "cpu" and "cpu" in fingerprint.IMMEDIATE_DEVICES and not distributed.compiling()
        if ctx.cpu:
            y, mean_c, invstd, count = _cpu_forward(x, weight, bias, running_mean, running_var, eps, momentum,
                                                    group, tag, world)
            ctx.save_for_backward(x, weight, mean_c, invstd, count)
            return y
        if distributed.compiling():
            packed = _pack_moments(x, stats.accumulate_dtype(x.device))
        else:  # the centered input, where the CPU path makes one, is normalized in place
            packed, centered, provisional = stats.pack_moments(x, stats.accumulate_dtype(x.device), keep=True)
        packed, ok = fingerprint.all_reduce_checked(packed, group, tag, world)
        count, mean, var = stats.merge_moments(packed, channels)
        _check_count(count, n, x.shape)

        if running_mean is not None or running_var is not None:
            stats.update_running_stats(running_mean, running_var, mean, var, count, momentum, ok=ok)

        cdtype = stats.compute_dtype(x.dtype)
        mean_c = mean.to(cdtype)
        var_c = var.to(cdtype)
        invstd = torch.rsqrt(var_c + eps)
        # the statistics stay in float32 for half inputs: the (C-sized) affine
        # parameters are brought to their dtype rather than the statistics to half
        scale = invstd if weight is None else invstd * weight.to(cdtype)
        shift = torch.zeros_like(mean_c) if bias is None else bias.to(cdtype)
        if centered is None:
            y = stats.affine(x, mean_c, scale, shift)
        else:  # (x - s) - (mean - s): no cancellation where |mean| >> std
            offset = (mean - provisional.to(mean.dtype)).to(cdtype)
            y = stats.affine(centered, offset, scale, shift, out=centered).to(x.dtype)

        ctx.save_for_backward(x, weight, mean_c, invstd, count)
        return y

    @staticmethod
    def backward(ctx, dy):
        # Every rank whose backward reaches this layer takes part in its all-reduce, also
        # where its own input needs no gradient (only the weight's, say): whether the input
        # needs one is each rank's own fact, and a rank that skipped the collective while
        # another made it would leave the group waiting or pair the next collectives wrongly.
        refuse_create_graph("SyncBatchNorm")
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if ctx.triton:
            from . import kernels

            x, weight = ctx.saved_tensors[:2]
            if not kernels.flattenable(dy):
                dy = dy.contiguous(memory_format=stats.memory_format(x))
            dx, dw, db = _triton_backward(ctx, dy, x, weight, need_x, need_w, need_b)
            fingerprint.end_step(ctx.group)
            return dx, dw, db, None, None, None, None, None, None
        x, weight, mean, invstd, count = ctx.saved_tensors
        dy = dy.contiguous(memory_format=stats.memory_format(x))
        if ctx.cuda:
            dx, dw, db = _cuda_backward(ctx, dy, x, weight, mean, invstd, count, need_x, need_w, need_b)
            fingerprint.end_step(ctx.group)
            return dx, dw, db, None, None, None, None, None, None
        if ctx.cpu:
            dx, dw, db = _cpu_backward(ctx, dy, x, weight, mean, invstd, count, need_x, need_w, need_b)
            fingerprint.end_step(ctx.group)
            return dx, dw, db, None, None, None, None, None, None
        # the backward payload of every path: sum dy and sum dy (x - mean) (the CUDA
        # kernels' sums) and the overflow slot, so that a compiled rank and an eager one sum alike
        sum_dy, sum_dy_xmu = stats.backward_sums(dy, x, mean, _ones_like(invstd))

        dx = None
        channels = x.shape[1]
        packed = backward_payload(sum_dy, sum_dy_xmu)
        packed, _ = fingerprint.all_reduce_checked(packed, ctx.group, ctx.tag, ctx.world, backward=True)
        _defer_overflow(packed[2 * channels], channels, ctx.tag)
        if need_x:
            global_dy, global_dy_xhat = packed[:channels], packed[channels:2 * channels] * invstd
            if x.numel() == 0:
                dx = torch.zeros_like(x)
            else:
                dx = stats.input_grad(dy, x, weight, mean, invstd, global_dy, global_dy_xhat, count)
        dw = (sum_dy_xmu * invstd).to(weight.dtype) if need_w else None
        db = sum_dy.to(ctx.bias_dtype) if need_b else None
        fingerprint.end_step(ctx.group)
        return dx, dw, db, None, None, None, None, None, None


# ---- the CPU path: torch's CPU kernels where they are exact, few C-sized operations
# Per call, forward: the local statistics (stats.cpu_local_stats), the payload
# ([fingerprint, n, n m, n (var + m^2)]: one cat, two in-place operations), the all-reduce,
# the verdict read at once (a host read of 18 values costs nothing on the CPU), the merge
# (stats.cpu_statistics), one lerp of both running buffers and one affine pass (torch's
# inference kernel). Backward: torch's backward reduction, one cat, the all-reduce, the
# verdict and two passes for the input gradient (stats.input_grad).


def _cpu_forward(x, weight, bias, running_mean, running_var, eps, momentum, group, tag, world):
    fingerprint.check_world(world)
    channels = x.shape[1]
    n = x.numel() // channels if channels else 0
    cdtype = stats.compute_dtype(x.dtype)
    if n:
        mean, var = stats.cpu_local_stats(x)
    else:
        mean = var = torch.zeros(channels, dtype=cdtype)
    fixed = fingerprint.payload_values(tag)
    size = len(fixed)
    packed = stats.cpu_pack_moments(mean, var, n, stats.accumulate_dtype(x.device), fixed)
    packed = distributed.all_reduce_sum(packed, group)
    fingerprint.check_now(packed[:size], group, tag, world)
    total = packed[size].item()  # a host read that costs nothing on the CPU
    _refuse_count(total, x.shape)
    count = packed[size]
    if not total:  # every rank empty: an empty output, the buffers as they were (as torch.nn)
        return torch.empty_like(x), mean, torch.full_like(mean, eps).rsqrt_(), count
    mean_c, invstd, unbiased = stats.cpu_statistics(packed[size + 1:], total, eps, cdtype)
    stats.update_running_buffers(running_mean, running_var, mean_c, unbiased, momentum, None)
    if not n:
        return torch.empty_like(x), mean_c, invstd, count
    scale = invstd if weight is None else invstd * weight.to(cdtype)
    shift = stats.constant(stats._filled, (0.0, channels), cdtype, x.device) if bias is None else bias.to(cdtype)
    # in units of the std (var + eps = 1), is any |mean| above 16?
    if not stats.far_from_zero(mean_c * invstd, stats.constant(stats._filled, (1.0, 1), cdtype, x.device)):
        return stats.affine(x, mean_c, scale, shift), mean_c, invstd, count
    # |mean| >> std: x - mean_c rounds relative to itself, and mean_c is the rounding of
    # the float64 mean: the rest of the difference, mean - mean_c, is small and exact
    rest = (packed[size + 1:size + 1 + channels] / count - mean_c).to(cdtype)
    centered = torch.sub(x.to(cdtype), mean_c.view(stats._channel_shape(x.dim(), channels)))
    return stats.affine(centered, rest, scale, shift, out=centered).to(x.dtype), mean_c, invstd, count


def _synced_input_grad(ctx, dy, x, weight, mean, invstd, count, sum_dy: Tensor, sum_dy_xmu: Tensor, cuda: bool,
                       need_x: bool = True):
    """The input gradient from this rank's backward sums ``(sum dy, sum dy (x - mean))``,
    summed over the group with the backward fingerprint in front and a 0 after them (the
    activated layer's kept-channel overflow on the Triton path: :func:`backward_payload`),
    one all-reduce; the verdict read at once on the CPU, left on the device on the CUDA
    path. Every path sends this payload (the CUDA kernels' own sums; the others convert
    from ``sum dy xhat``), so ranks on different paths (one compiled, one eager) and ranks
    where the layer is fused and ranks where it is not sum alike. Without ``need_x``
    (this rank's input needs no gradient) the rank still takes part and returns None:
    see :class:`_SyncBatchNorm`'s backward."""
    fixed = fingerprint.fixed_values(ctx.tag, sum_dy.dtype, sum_dy.device)
    size, channels = fixed.shape[0], sum_dy.shape[0]
    packed = distributed.all_reduce_sum(backward_payload(sum_dy, sum_dy_xmu, fixed), ctx.group)
    verdict = fingerprint.pending_verdict if cuda else fingerprint.check_now
    verdict(packed[:size], ctx.group, ctx.tag, ctx.world, backward=True)
    _defer_overflow(packed[size + 2 * channels], channels, ctx.tag)
    if not need_x:
        return None
    if x.numel() == 0:
        return torch.zeros_like(x)
    total_dy, total_dy_xmu = packed[size:size + channels], packed[size + channels:size + 2 * channels]
    if cuda:
        return stats.cuda_input_grad(dy, x, weight, mean, invstd, total_dy, total_dy_xmu, count)
    return stats.input_grad(dy, x, weight, mean, invstd, total_dy, total_dy_xmu * invstd, count)


def backward_payload(sum_dy: Tensor, sum_dy_xmu: Tensor, fixed: Optional[Tensor] = None) -> Tensor:
    """The backward all-reduce's payload of every path and both layers: ``[fixed, sum dy,
    sum dy (x - mean), overflow]``, ``2C + 1`` values after the fingerprint's ``fixed``
    (which :func:`syncbn.torch.fingerprint.all_reduce_checked` puts in front where it is
    None). ``overflow`` counts the ranks whose :class:`syncbn.SyncBatchNormAct` ran out of
    kept channels on the Triton path (:func:`syncbn.torch.kernels.grad_payload` writes it
    there); every other path has none and sends 0, so that the payload has one length
    and one meaning wherever it is made. Every synchronized backward reads the summed
    value (:func:`_defer_overflow`), so that all ranks raise where one rank's fused layer
    ran out."""
    zero = stats.constant(stats._filled, (0.0, 1), sum_dy.dtype, sum_dy.device)
    return torch.cat([sum_dy, sum_dy_xmu, zero] if fixed is None else [fixed, sum_dy, sum_dy_xmu, zero])


def kept_capacity(channels: int) -> int:
    """How many channels' inputs :class:`syncbn.SyncBatchNormAct` can keep per call on the
    Triton kernels (``C // 16``, at least 1; see :mod:`syncbn.torch.batchnorm_act`)."""
    return max(1, channels // 16)


class KeptChannelsOverflow(RuntimeError):
    """More channels of a SyncBatchNormAct call needed their inputs kept than it holds
    (:mod:`syncbn.torch.batchnorm_act`, which exports it).

    Raised when the backward pass ends, before any optimizer step. Where the layer syncs,
    every rank of the group raises it for that call, also a rank whose own layer kept
    every channel it needed: a SyncBatchNormAct beside one that overflowed, a
    SyncBatchNormAct off the kernels (the general path keeps as many channels as it needs),
    a :class:`syncbn.SyncBatchNorm` where the model is fused on some ranks only (see
    :func:`overflow_elsewhere`)."""


def overflow_elsewhere(layer: str, channels: int, tag) -> KeptChannelsOverflow:
    """The error of a rank whose own call of a synchronized layer kept every channel it
    needed (``layer``: ``"SyncBatchNorm"``, or ``"SyncBatchNormAct"`` off the kernels) when
    the group's summed overflow says another rank's SyncBatchNormAct of the same
    fingerprint ran out of kept channels: that rank's inexact sums are in this rank's
    gradients too, so this rank raises with it, at the same point."""
    return KeptChannelsOverflow(
        f"{layer}({channels}) {fingerprint._tag_name(tag)!r}: another rank of the process group runs this layer as "
        f"a SyncBatchNormAct on the Triton kernels, and it ran out of kept channels (more channels than the "
        f"{kept_capacity(channels)} it can keep have a weight too small next to their bias, or saturate the ELU, "
        "for their input to be recovered from the output); its inexact backward sums are in every rank's "
        "gradients, so this step's gradients are not exact on any rank. Use SyncBatchNorm followed by the "
        "activation for this layer on every rank (syncbn.revert_sync_batchnorm, or fuse_batchnorm_act leaving "
        "it out).")


def _defer_overflow(overflow: Tensor, channels: int, tag, fit: Optional[Tensor] = None) -> None:
    """The group's summed kept-channel overflow (the payload's last value), read by this
    layer too: where the model is fused on some ranks only, a SyncBatchNormAct of this
    fingerprint on another rank may have run out of kept channels, its inexact sums now in
    this rank's gradients; then every rank raises
    :class:`KeptChannelsOverflow` when the backward pass ends,
    as that rank does (:func:`syncbn.torch.fingerprint.defer_overflow`: no host read on
    the device; ``fit``, the verdict from the input-gradient kernel)."""
    fingerprint.defer_overflow(overflow, functools.partial(overflow_elsewhere, "SyncBatchNorm", channels, tag), fit)


def _ones_like(invstd: Tensor) -> Tensor:
    """Ones in place of ``invstd``: :func:`stats.backward_sums` then gives ``sum dy (x - mean)``."""
    return stats.constant(stats._filled, (1.0, invstd.shape[0]), invstd.dtype, invstd.device)


def _cpu_backward(ctx, dy, x, weight, mean, invstd, count, need_x, need_w, need_b):
    sum_dy, sum_dy_xmu = stats.backward_sums(dy, x, mean, _ones_like(invstd))  # sum dy (x - mean)
    dx = _synced_input_grad(ctx, dy, x, weight, mean, invstd, count, sum_dy, sum_dy_xmu, False, need_x)
    dw = (sum_dy_xmu * invstd).to(weight.dtype) if need_w else None
    db = sum_dy.to(ctx.bias_dtype) if need_b else None
    return dx, dw, db


# ---- the CUDA path (stats.cuda_path): torch's kernels, C-sized operations, no host read
# Per call, forward: the statistics kernel, the payload (one cat, two addcmul),
# the all-reduce, the fingerprint verdict (2), the merge (6), the running buffers (5: the
# gate on the verdict and the count, the lerps, the two selections) and
# batch_norm_elemt; backward: batch_norm_backward_reduce, one cat, the all-reduce, the
# verdict (2), the group's kept-channel overflow (1: fingerprint.defer_overflow), the
# integer count and batch_norm_backward_elemt. The payloads are those of
# every path (so that ranks on different paths, compiled and eager, sum alike):
# [fingerprint, n, n m, n (var + m^2)] forward, [fingerprint, sum dy, sum dy (x - mean), 0]
# backward (backward_payload; the 0: the kept-channel overflow of the Triton path's
# SyncBatchNormAct).


def _cuda_forward(x, weight, bias, running_mean, running_var, eps, momentum, group, tag, world):
    fingerprint.check_world(world)
    channels = x.shape[1]
    n = x.numel() // channels if channels else 0
    mean, var = stats.cuda_local_stats(x)
    fixed = fingerprint.payload_values(tag)
    size = len(fixed)
    packed = stats.cuda_pack_moments(mean, var, n, stats.accumulate_dtype(x.device), fixed)
    packed = distributed.all_reduce_sum(packed, group)
    ok = fingerprint.pending_verdict(packed[:size], group, tag, world)
    _check_count(packed[size], n, x.shape, device_side=True)
    mean_c, invstd, unbiased, count = stats.cuda_statistics(packed[size:], channels, eps, stats.compute_dtype(x.dtype))
    # the buffers move where the ranks agree and the group holds values (a global count
    # of 0: every rank empty, the buffers keep their bits, as torch.nn's)
    stats.update_running_buffers(running_mean, running_var, mean_c, unbiased, momentum, ok & (count > 1))
    y = stats.cuda_normalize(x, weight, bias, mean_c, invstd) if n else torch.empty_like(x)
    return y, mean_c, invstd, count


def _cuda_backward(ctx, dy, x, weight, mean, invstd, count, need_x, need_w, need_b):
    channels = x.shape[1]
    if x.numel() == 0:
        sum_dy = sum_dy_xmu = torch.zeros(channels, dtype=mean.dtype, device=x.device)
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros(channels, dtype=ctx.bias_dtype, device=x.device) if need_b else None
    else:
        sum_dy, sum_dy_xmu, dw, db = stats.cuda_backward_reduce(dy, x, mean, invstd, weight, need_w, need_b)
    dx = _synced_input_grad(ctx, dy, x, weight, mean, invstd, count, sum_dy, sum_dy_xmu, True, need_x)
    dw = None if dw is None else dw.to(weight.dtype)
    db = None if db is None else db.to(ctx.bias_dtype)
    return dx, dw, db


# ---- the CUDA path with the Triton kernels (syncbn.torch.kernels): per call, forward
# the moments (2 launches: partial sums, payload), the all-reduce, the merge (verdict,
# statistics, running buffers: 1) and the normalizing pass (1); backward the sums (2), the
# all-reduce and the input gradient with the backward verdict (1). Same payloads as every
# other path.


def _momentum_tensor(momentum, device) -> Tensor:
    if isinstance(momentum, Tensor):
        return momentum
    return stats.constant(stats._filled, (float(momentum), 1), torch.float64, device)


def _empty_payload(channels: int, fixed: Tensor) -> Tensor:
    """An empty rank's payload, ``fixed`` and ``2C + 1`` zeros: forward ``[n, sum x, sum
    x^2]``, backward ``[sum dy, sum dy (x - mean), overflow]`` (the same length)."""
    zeros = stats.constant(stats._filled, (0.0, 1 + 2 * channels), fixed.dtype, fixed.device)
    return torch.cat([fixed, zeros])


def _triton_forward(x, weight, bias, running_mean, running_var, eps, momentum, group, tag, world):
    from . import kernels

    fingerprint.check_world(world)
    channels = x.shape[1]
    n = x.numel() // channels if channels else 0
    device = x.device
    fixed = fingerprint.fixed_values(tag, torch.float64, device)
    if n:
        payload = kernels.moment_payload(kernels.moment_partials(x), fixed, n)
    else:
        payload = _empty_payload(channels, fixed)
    summed = distributed.all_reduce_sum(payload, group)
    size = fixed.shape[0]
    agree = fingerprint.agreeing_values(tag, world, torch.float64, device)
    stats_c, ok, _, _ = kernels.merge(summed, agree, stats.kernel_scalars(eps, device),
                                      _momentum_tensor(momentum, device), running_mean, running_var,
                                      stats.compute_dtype(x.dtype))
    fingerprint.pending_verdict(summed[:size], group, tag, world, ok=ok)
    _check_count(summed[size], n, x.shape, device_side=True)
    y = kernels.normalize(x, weight, bias, stats_c, stats.kernel_scalars(eps, device))[0] if n else torch.empty_like(x)
    return y, stats_c, summed[size]


def _triton_backward(ctx, dy, x, weight, need_x, need_w, need_b):
    from . import kernels

    stats_c, count = ctx.saved_tensors[2:]
    channels, device, cdtype = x.shape[1], x.device, stats_c.dtype
    fixed = fingerprint.fixed_values(ctx.tag, cdtype, device)
    scalars = stats.kernel_scalars(ctx.eps, device)
    wdtype = cdtype if weight is None else weight.dtype
    bdtype = ctx.bias_dtype or cdtype
    if x.numel():
        partials = kernels.grad_partials(dy, x, stats_c, scalars, weight)
        payload, dw, db = kernels.grad_payload(partials, fixed, stats_c, 0, wdtype, bdtype)
    else:
        payload = _empty_payload(channels, fixed)  # [fixed, zeros of S1, S2 and the overflow]
        dw = torch.zeros(channels, dtype=wdtype, device=device)
        db = torch.zeros(channels, dtype=bdtype, device=device)
    dx = fit = None
    summed = distributed.all_reduce_sum(payload, ctx.group)  # with or without need_x: see backward
    size = fixed.shape[0]
    if need_x:
        if x.numel():
            agree = fingerprint.agreeing_values(ctx.tag, ctx.world, cdtype, device)
            # the kernel's verdicts: the fingerprint's and whether the summed overflow is 0
            dx, ok, fit = kernels.input_grad(dy, x, stats_c, scalars, weight, None, None, None, summed, count, agree,
                                             0, x.dtype)
            fingerprint.pending_verdict(summed[:size], ctx.group, ctx.tag, ctx.world, backward=True, ok=ok)
        else:
            fingerprint.pending_verdict(summed[:size], ctx.group, ctx.tag, ctx.world, backward=True)
            dx = torch.zeros_like(x)
    else:
        fingerprint.pending_verdict(summed[:size], ctx.group, ctx.tag, ctx.world, backward=True)
    _defer_overflow(summed[size + 2 * channels], channels, ctx.tag, fit)  # fit None: one op (not the common case)
    return dx, dw if need_w else None, db if need_b else None


def sync_batch_norm(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    training: bool = False,
    momentum=0.1,
    eps: float = 1e-5,
    process_group=None,
    *,
    name: Optional[str] = None,
    layer=None,
) -> Tensor:
    """Batch normalization whose training statistics span every rank of ``process_group``.

    Arguments are those of :func:`torch.nn.functional.batch_norm`, plus the process
    group (the default group when None). ``momentum`` is the weight of the new batch
    statistics in the running buffers (``0.1`` like ``torch.nn``); pass
    ``1 / num_batches_tracked`` for a cumulative average (a 0-d tensor works too and
    avoids a host read).

    In training with a group of more than one rank, every rank must call this for the
    same layer in the same order: each call is one all-reduce forward and one backward.
    An empty local batch is allowed (it still takes part); a global count of exactly
    one element per channel raises ``ValueError`` on every rank (under ``torch.compile``,
    a ``RuntimeError`` from an assert inside the compiled graph, see ``_check_count``), as
    ``torch.nn.BatchNorm2d`` raises for one value per channel. Where every rank's batch is
    empty (a global count of 0) the call is torch's on an empty batch: an empty output,
    the running buffers left as they are, zero weight and bias gradients (the backward
    all-reduce is still made on every rank).

    Every training call on W > 1 ranks carries a fingerprint in its two all-reduces (see
    :mod:`syncbn.torch.fingerprint`): ranks that are in different layer calls raise
    :class:`syncbn.torch.fingerprint.LayerMismatchError` on every rank, before the running
    buffers move. ``name`` identifies the call there (default ``"sync_batch_norm"``);
    ``layer`` is the module calling (its recorded name is used instead).

    A training call recomputed by :func:`syncbn.checkpoint` during the backward pass
    (see :func:`recomputing`) normalizes as the first call did and leaves the running
    buffers alone, so they are updated once per step, as without checkpointing.
    """
    # an input without channels: F.batch_norm's empty output where this is F.batch_norm
    # (below), a ValueError before the collective where it synchronizes (as the layers)
    syncing = training and distributed.group_size(process_group) > 1
    label = name or (type(layer).__name__ if layer is not None else "sync_batch_norm")
    check_channels(input, label, channels=syncing, running_mean=running_mean, running_var=running_var,
                   weight=weight, bias=bias)
    _check_momentum(momentum)
    if training and recomputing():  # activation checkpointing: the buffers moved already
        running_mean = None if running_mean is None else running_mean.clone()
        running_var = None if running_var is None else running_var.clone()
    if not syncing:
        if isinstance(momentum, Tensor):
            momentum = float(momentum)
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if eps <= 0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    refuse_capture(label, layer)
    refuse_dual(label, layer, input, weight, bias)
    check_dtypes(input, weight, bias, running_mean, running_var, label)
    return _synchronized(input, weight, bias, running_mean, running_var, eps, momentum, process_group, layer, name)


def _check_momentum(momentum) -> None:
    """A clear error for a momentum no batch norm takes (before any collective: it depends
    only on the call, alike on every rank running the same code)."""
    if isinstance(momentum, Tensor):
        if momentum.numel() != 1 or not momentum.is_floating_point():
            raise TypeError(f"sync_batch_norm: a tensor momentum must hold one floating-point value, got "
                            f"shape {tuple(momentum.shape)} and dtype {momentum.dtype}")
    elif not isinstance(momentum, numbers.Real):
        raise TypeError(f"sync_batch_norm: momentum must be a float (or a one-value tensor), got "
                        f"{type(momentum).__name__}; for a cumulative average pass 1 / num_batches_tracked")


@distributed.eager_unless_traceable
def _synchronized(input, weight, bias, running_mean, running_var, eps, momentum, process_group, layer, name):
    tag = fingerprint.forward_tag(layer, input.shape[1], process_group, name,
                                  fingerprint.records_graph(input, weight, bias))
    y = _SyncBatchNorm.apply(
        flat_spatial(input), weight, bias, running_mean, running_var, eps, momentum, process_group, tag
    )
    return unflat_spatial(y, input)
