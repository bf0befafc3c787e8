"""The one module that talks to ``torch.distributed``.

Everything else in syncbn asks this module how large a process group is and hands it
a flat tensor to sum across the group. Keeping the collectives here makes it easy to
see (and to test) that every layer call issues exactly one of them each way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["is_initialized", "group_size", "group_rank", "all_reduce_sum"]


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


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``tensor`` over every rank of ``group`` and return the result.

    Eager mode reduces in place with one blocking ``all_reduce``. Under
    ``torch.compile`` the traceable functional collective is used instead, so the
    layer compiles without a graph break; it is still a single all-reduce.
    """
    if _compiling():
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(tensor, "sum", group if group is not None else dist.group.WORLD)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
