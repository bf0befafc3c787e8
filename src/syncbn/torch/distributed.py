"""The one module that talks to ``torch.distributed``.

Everything else in syncbn asks this module how large a process group is and hands it
a flat tensor to sum across the group. Keeping the collectives here makes it easy to
see (and to test) that every layer call issues exactly one of them each way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "is_initialized",
    "compiling",
    "group_size",
    "group_rank",
    "default_group",
    "new_groups",
    "all_reduce_sum",
    "all_gather",
    "broadcast",
]


def is_initialized() -> bool:
    """True when a default process group exists in this process."""
    return dist.is_available() and dist.is_initialized()


def group_size(group=None) -> int:
    """Number of ranks in ``group`` (the default group when None); 1 when not distributed."""
    if not is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    """This process's rank inside ``group``; 0 when not distributed."""
    if not is_initialized():
        return 0
    return dist.get_rank(group)


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
