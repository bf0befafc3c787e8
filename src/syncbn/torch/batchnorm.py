"""``syncbn.SyncBatchNorm``: the module form of :func:`syncbn.functional.sync_batch_norm`;
``syncbn.torch.BatchNormNd``: its plain, single-process counterpart for inputs of any rank."""

from __future__ import annotations

import copy
import inspect
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import Proxy
from torch.nn.modules.batchnorm import _BatchNorm

from . import distributed
from .functional import check_input, recomputing, refuse_capture, refuse_dual, sync_batch_norm

__all__ = ["BatchNormNd", "SyncBatchNorm"]

# torch.nn's batch norms take a keyword-only ``bias`` in recent releases only
_BIAS_KEYWORD = "bias" in inspect.signature(_BatchNorm.__init__).parameters


def _copy(buffer):
    return None if buffer is None else buffer.clone()


class _SyncNormBase(_BatchNorm):
    """What the synchronized layers share: torch.nn.SyncBatchNorm's constructor
    arguments and state, the input checks, and the running-buffer momentum."""

    def __init__(
        self,
        num_features: int,
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
        extra = {"bias": bias} if _BIAS_KEYWORD else {}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **extra)
        if affine and not bias and not _BIAS_KEYWORD:  # torch before the keyword: drop it here
            self.register_parameter("bias", None)
        self.process_group = process_group

    def __deepcopy__(self, memo):
        """``copy.deepcopy``: a copy of every tensor and attribute, as for any module, but
        the copy synchronizes over the very same ``process_group``. A process group is a
        handle on ranks, which cannot be copied (torch refuses: "cannot pickle
        ProcessGroup"), so a model holding layers on an explicit group (``sync_groups``,
        ``new_group``) could not be deep-copied: no EMA copy (timm's ``ModelEmaV3``), no
        ``copy.deepcopy(model)`` for a teacher or a snapshot."""
        group = self.__dict__.get("process_group")
        if group is not None:
            memo[id(group)] = group  # deepcopy gives back what the memo holds: the group itself
            memo.setdefault(id(memo), []).append(group)  # kept alive while the memo is, as copy does
        # what copy.deepcopy does for an object without this method: rebuild it from its
        # reduction (nn.Module's: the class and its __getstate__, the instance __dict__)
        reduced = self.__reduce_ex__(4)
        build, args, state = reduced[0], reduced[1], reduced[2] if len(reduced) > 2 else None
        new = build(*copy.deepcopy(args, memo))
        memo[id(self)] = new
        if state is not None:
            state = copy.deepcopy(state, memo)
            slots = None
            if isinstance(state, tuple) and len(state) == 2:
                state, slots = state
            if state:
                new.__setstate__(state)
            for name, value in (slots or {}).items():
                setattr(new, name, value)
        return new

    def __prepare_scriptable__(self):
        """``torch.jit.script`` calls this on every submodule before compiling: refuse
        with the fix, rather than fail deep in TorchScript's compiler (the forward calls
        an autograd Function and ``torch.distributed``; torch.nn.SyncBatchNorm does not
        script either). Raised before the model is changed, alike on every rank."""
        cls = type(self)
        # syncbn's two layers by their public name; any other class (timm's converted
        # layer, a user's subclass) by where it is defined
        public = cls.__module__ in ("syncbn.torch.batchnorm", "syncbn.torch.batchnorm_act")
        name = f"syncbn.{cls.__name__}" if public else f"{cls.__module__}.{cls.__qualname__}"
        raise RuntimeError(
            f"{name} cannot be compiled by torch.jit.script (torch.nn.SyncBatchNorm cannot "
            f"either). Call syncbn.revert_sync_batchnorm(model) first: it turns the layers back into "
            f"torch's own batch norms in place, with the same parameters and state_dict "
            f"(convert_sync_batchnorm again to go on training). Or, for inference, export the "
            f"eval-mode model as it is with torch.export.export or torch.jit.trace."
        )

    def _fx_leaf(self, input: Proxy, forward):
        """Under ``torch.fx``'s symbolic tracing: this call recorded as one call of the
        layer (a ``call_module`` node), as the tracer records ``torch.nn``'s batch norms,
        which it keeps whole; it traces into every module defined elsewhere, and this
        forward cannot be traced (it checks and reads values, moves the running buffers).
        None, to trace on as before, where the layer is the traced root (no name to call it
        by) or a subclass whose own ``forward`` does more than ``forward``."""
        if type(self).forward is not forward:
            return None
        tracer = input.tracer
        try:
            path = tracer.path_of_module(self)
        except NameError:  # not a submodule of the traced root
            return None
        return tracer.create_proxy("call_module", path, (input,), {}) if path else None

    def _check_input_dim(self, input: Tensor) -> None:
        # the channel count is checked against the layer's per-channel tensors, as torch's
        # batch norm does: a layer without any (affine=False, track_running_stats=False)
        # normalizes whatever channels it is given
        check_input(input, self.num_features if self._holds_channels() else None, type(self).__name__)

    def _holds_channels(self) -> bool:
        """Whether the layer holds a per-channel tensor (weight, bias, running_mean,
        running_var). Every call asks, eval included: the usual layer is answered from
        its parameter and buffer dicts (nn.Module's attribute lookup costs about 1 us a
        name); only a layer with neither registered asks every attribute (a wrapper such
        as FSDP1 may hold them as plain attributes)."""
        if self._parameters.get("weight") is not None or self._buffers.get("running_mean") is not None:
            return True
        return any(getattr(self, name, None) is not None for name in ("weight", "bias", "running_mean", "running_var"))

    def _momentum(self, as_tensor: bool, count: bool = True):
        """Weight of this batch in the running buffers; bumps ``num_batches_tracked``
        (unless ``count`` is False: a checkpoint recomputation)."""
        if not (self.training and self.track_running_stats and count):
            return 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is not None:
            return self.momentum
        if self.num_batches_tracked is None:
            return 0.0
        if as_tensor:  # the cumulative average without a host read
            return 1.0 / self.num_batches_tracked.to(torch.float64)
        return 1.0 / float(self.num_batches_tracked)


class SyncBatchNorm(_SyncNormBase):
    r"""Batch normalization over the union of all ranks' batches, for inputs of any rank.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} * \gamma + \beta

    In training, with ``torch.distributed`` initialized and a process group of W > 1
    ranks, the mean and the biased variance of each channel are taken over every element
    of that channel on all W ranks, weighted by element counts (so uneven and empty local
    batches are exact), with one all-reduce of ``2C + 1`` values; the backward pass adds
    the cross-rank terms with one all-reduce of ``2C + 1`` values (the two sums and a 0:
    :class:`syncbn.SyncBatchNormAct`'s overflow slot, so that both layers send one payload).
    ``weight`` and ``bias`` gradients are the local sums, which the data-parallel wrapper
    averages.

    The running buffers are updated with the global statistics (variance unbiased by the
    global count), so they stay identical on every rank. ``momentum=None`` keeps a
    cumulative average over ``num_batches_tracked``.

    Under activation checkpointing (``torch.utils.checkpoint``) the forward that is
    recomputed during the backward pass normalizes exactly as the first one did (same
    batch statistics, same collective on every rank) but leaves the running buffers and
    ``num_batches_tracked`` alone: they move once per real forward, as without
    checkpointing.

    Eval mode never communicates: it uses the running statistics, or, with
    ``track_running_stats=False``, the local batch statistics (as
    ``torch.nn.SyncBatchNorm`` does), so evaluating on one rank alone never hangs. Not
    distributed, or in a group of one, the module is exactly ``torch.nn.BatchNorm*d``.

    Args: those of ``torch.nn.SyncBatchNorm``; ``process_group`` None means the default
    group. Shapes: input (N, C, *) of any rank from 2, as ``torch.nn.SyncBatchNorm``
    takes (the statistics of channel c over dim 0 and every dim after 1; beyond 5 dims
    the synchronized call works on the (N, C, L) reshape); output the same shape and
    memory format. The ``state_dict`` is that of ``torch.nn.BatchNorm2d``.

    Code written against ``torch.nn.SyncBatchNorm`` finds what it calls:
    ``SyncBatchNorm.convert_sync_batchnorm(module, process_group=None)`` is
    :func:`syncbn.convert_sync_batchnorm`. The class is not a subclass of
    ``torch.nn.SyncBatchNorm``, on purpose: ``DistributedDataParallel`` refuses a CPU
    module holding any instance of that class ("SyncBatchNorm layers only work with GPU
    modules"), which would end syncbn's CPU and gloo training. Check with
    ``isinstance(m, torch.nn.modules.batchnorm._BatchNorm)`` (true for both) or
    ``isinstance(m, (torch.nn.SyncBatchNorm, syncbn.SyncBatchNorm))``.
    """

    # torch.nn.SyncBatchNorm's classmethod; defined in syncbn.torch.conversion, which
    # imports this module (so this module need not import it back)
    convert_sync_batchnorm: ClassVar[Callable[..., torch.nn.Module]]

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, Proxy):  # torch.fx.symbolic_trace: one call of the layer
            node = self._fx_leaf(input, SyncBatchNorm.forward)
            if node is not None:
                return node
        self._check_input_dim(input)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        # Only a module in training mode communicates; eval with batch statistics stays local.
        syncing = bn_training and self.training and distributed.group_size(self.process_group) > 1
        if syncing:  # before the momentum count moves (sync_batch_norm asks again, for its callers)
            refuse_capture(type(self).__name__, self)
            refuse_dual(type(self).__name__, self, input, self.weight, self.bias)
        # a checkpoint's recomputed forward: same normalization, no second count
        again = self.training and recomputing()
        momentum = self._momentum(as_tensor=syncing, count=not again)
        track = not bn_training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if again:  # ... and its buffer update lands in throwaway copies (see recomputing)
            running_mean, running_var = _copy(running_mean), _copy(running_var)
        if not syncing:
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, bn_training, momentum, self.eps
            )
        return sync_batch_norm(
            input, running_mean, running_var, self.weight, self.bias, True, momentum, self.eps, self.process_group,
            layer=self,
        )

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.process_group is not None:
            text += ", process_group=custom"
        return text


class BatchNormNd(_BatchNorm):
    r"""Plain batch normalization for inputs of any rank: ``torch.nn.BatchNorm1d/2d/3d``
    in one class, as ``torch.nn.SyncBatchNorm`` is for the synchronized layer.

    The forward is torch's own ``_BatchNorm.forward`` (``F.batch_norm`` on the local
    batch, never a collective), so the layer computes exactly what
    ``torch.nn.BatchNorm{1,2,3}d`` computes for an input of that rank and exports like
    them; only the input check differs: (N, C) and (N, C, \*) are accepted, as
    ``torch.nn.SyncBatchNorm`` accepts them. Arguments, fields and ``state_dict`` are
    those of ``torch.nn.BatchNorm2d``.

    :func:`syncbn.revert_sync_batchnorm` gives a layer back as this class when it does
    not know a plain class it came from: a ``torch.nn.SyncBatchNorm`` (MONAI's
    ``norm="syncbatch"``, ...), a :class:`syncbn.SyncBatchNorm` built directly (another
    library's rank-agnostic batch norm, mmengine's ``_BatchNormXd``, goes back to its own
    class). It is a plain batch
    norm to every converter: :func:`syncbn.convert_sync_batchnorm` turns it into
    :class:`syncbn.SyncBatchNorm` (and revert gives this class again), torch's and timm's
    ``convert_sync_batchnorm`` into ``torch.nn.SyncBatchNorm``.
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:  # torch.nn.SyncBatchNorm's check and message
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
