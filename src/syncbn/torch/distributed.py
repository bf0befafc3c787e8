"""The one module that talks to ``torch.distributed``.

Everything else in syncbn asks this module how large a process group is and hands it
a flat tensor to sum across the group. Keeping the collectives here makes it easy to
see (and to test) that every layer call issues exactly one of them each way.

"Not distributed" is decided here too (:func:`group_size` is 1): a process that the
environment places in a larger job (``WORLD_SIZE`` > 1, as ``torchrun`` sets it) but
that never called ``torch.distributed.init_process_group`` gets a warning, once.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

__all__ = [
    "is_initialized",
    "compiling",
    "exporting",
    "tracing",
    "transforming",
    "group_size",
    "group_rank",
    "default_group",
    "new_groups",
    "all_reduce_sum",
    "all_gather",
    "broadcast",
    "reset_not_initialized_warning",
]

# set once this process was warned that WORLD_SIZE > 1 but no process group exists
_warned_not_initialized = False


def is_initialized() -> bool:
    """True when a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def group_size(group=None) -> int:
    """Number of ranks in ``group`` (the default group when None); 1 when not distributed
    (with a warning, once per process, where ``WORLD_SIZE`` > 1 says it should be)."""
    if not is_initialized():
        if not _warned_not_initialized:  # after the warning: one global read per call
            _warn_if_launched()
        return 1
    return dist.get_world_size(group)


# torch.compile runs this at trace time instead of tracing it (a warning would break the
# graph): the warning then comes when the layer is compiled, and the flag it sets makes
# the next call recompile once, without the check.
@torch.compiler.assume_constant_result
def _warn_if_launched() -> bool:
    """Warn once per process when ``WORLD_SIZE`` > 1 but no process group exists;
    returns whether it warned.

    The layers ask :func:`group_size` only when training, so this is where a job started
    by torchrun (or any launcher that sets ``WORLD_SIZE``) that forgot
    ``init_process_group`` would otherwise normalize each rank's batch alone, silently.
    Reads the environment only: no collective, no device work.
    """
    global _warned_not_initialized
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    if world <= 1:
        return False
    _warned_not_initialized = True
    warnings.warn(
        f"syncbn: the environment says this process is one of {world} (WORLD_SIZE={world}), "
        "but torch.distributed is not initialized, so batch statistics are computed on this "
        "process alone, not synchronized across ranks. Call "
        "torch.distributed.init_process_group(...) before training, or unset WORLD_SIZE to "
        "train on one process. (Warned once per process.)",
        UserWarning,
        stacklevel=3,
    )
    return True


def reset_not_initialized_warning() -> None:
    """Forget that the once-per-process warning of :func:`group_size` was given, so the
    next training call without a process group under ``WORLD_SIZE`` > 1 warns again
    (for tests)."""
    global _warned_not_initialized
    _warned_not_initialized = False


def group_rank(group=None) -> int:
    """This process's rank inside ``group``; 0 when not distributed."""
    if not is_initialized():
        return 0
    return dist.get_rank(group)


def registered_ranks(group):
    """The global ranks of ``group`` while torch's registry holds it; None once it was
    destroyed (``destroy_process_group(group)``, or the world's destruction)."""
    try:
        return dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return None


def global_ranks(group=None):
    """The global rank of each rank of ``group``, in group-rank order; None for the whole
    world (where they are the same), when not distributed, or when the group is gone."""
    if not is_initialized() or group is None or group is dist.group.WORLD:
        return None
    ranks = registered_ranks(group)
    if ranks is None:  # destroyed since: the group ranks are all we have
        return None
    return None if ranks == list(range(dist.get_world_size())) else ranks


def default_group():
    """The default (world) process group object; None when not distributed."""
    return dist.group.WORLD if is_initialized() else None


def new_groups(blocks):
    """Create one process group per list of ranks in ``blocks``; return this rank's.

    ``dist.new_group`` is collective over the whole world: every rank must call this
    with the same ``blocks`` in the same order, and every rank creates every group,
    including those it is not a member of. Returns None when this rank is in no block.
    """
    rank = dist.get_rank()
    mine = None
    for ranks in blocks:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine


def compiling() -> bool:
    """True while ``torch.compile`` is tracing the calling code."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def exporting() -> bool:
    """True while ``torch.export.export`` is tracing the calling code (strict or not; on a
    torch without ``torch.compiler.is_exporting``, before 2.5, non-strict export only).

    torch 2.4 has no ``is_exporting``, but its export sets the flag behind
    ``torch.compiler.is_compiling()`` around the tracing that runs the model's Python
    (non-strict export), where ``torch.compiler.is_dynamo_compiling()`` stays False; in
    code that torch.compile (or strict export's first pass) traces, dynamo makes both
    True, and in eager code, a graph break's included, both are False. Strict export on
    2.4 is therefore not seen here: there every call that runs syncbn's autograd
    Functions goes through :func:`eager_unless_traceable`, which dynamo's export refuses
    (a graph break), so it fails, not silently."""
    compiler = getattr(torch, "compiler", None)
    check = getattr(compiler, "is_exporting", None)
    if check is not None:
        return bool(check())
    dynamo = getattr(compiler, "is_dynamo_compiling", None)
    return bool(dynamo is not None and compiler.is_compiling() and not dynamo())


def tracing() -> bool:
    """True while ``torch.jit.trace`` records the calling code (False under torch.compile,
    which traces by other means)."""
    return not compiling() and torch.jit.is_tracing()


def transforming() -> bool:
    """True while a ``torch.func`` transform (grad, vjp, jacrev, jacfwd, hessian, vmap, jvp,
    functionalize) is active around the calling code; False under torch.compile.

    torch documents no public test for this. The predicate asked here,
    ``torch._C._are_functorch_transforms_active``, is private, but it is the very one
    ``torch.autograd.Function.apply`` asks before refusing a Function without
    ``setup_context`` (with a generic message, once the layer's call has begun: the momentum
    count moved). Asking it first lets a layer refuse exactly where torch would, before any
    state changes or collective, with its own name and the fix. The alternatives are no more
    public (``torch._C._functorch.is_functorch_wrapped_tensor`` on the layer's tensors, which
    misses a transform whose inputs do not reach the layer), or match torch's message text
    after the fact (catching the RuntimeError of ``apply``). False where torch lacks it.
    """
    if compiling():
        return False
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active is not None and active())


# torch.compile traces the synchronized call whole on torch 2.11 and 2.13 (tested). torch
# 2.4's compiler cannot trace its backward, and after a recompile with dynamic shapes it
# raised inside the layer fingerprint on the recompiling rank alone, leaving the other ranks
# in their collective. Before 2.11 the call is therefore left out of the graph: it runs
# eagerly (a graph break, as torch.nn.SyncBatchNorm's call does), with eager's fingerprint.
TRACEABLE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)


def eager_unless_traceable(fn):
    """``fn``, or on a torch before 2.11 ``fn`` that torch.compile runs eagerly."""
    return fn if TRACEABLE else torch.compiler.disable(fn)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over every rank of ``group`` and return the result.

    Eager mode reduces in place with one blocking ``all_reduce``. Under
    ``torch.compile`` the traceable functional collective is used instead, so the
    layer compiles without a graph break; it is still a single all-reduce.
    """
    if compiling():
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(tensor, "sum", group if group is not None else dist.group.WORLD)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape on each), stacked in group-rank order.

    Used by the tools (PreciseBN's batch-count agreement, ``syncbn verify``'s layer-order
    check), never by the layers themselves.
    """
    parts = [torch.empty_like(tensor) for _ in range(group_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with the one of global rank ``src``; returns it."""
    dist.broadcast(tensor, src, group=group)
    return tensor
