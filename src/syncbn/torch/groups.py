"""Sync groups: synchronize BatchNorm inside blocks of ranks rather than the whole world.

With many ranks the statistics of the whole world are more than a layer needs, and every
layer call then waits for the slowest rank of the world. MegDet (Peng et al., 2018)
synchronized BN over the 8 GPUs of one machine instead. :func:`sync_groups` makes that a
one-liner::

    group = syncbn.sync_groups(8)          # ranks 0-7, 8-15, ... each form a group
    model = syncbn.convert_sync_batchnorm(model, process_group=group)

Each group's layers compute their statistics over the concatenation of that group's
batches only; the groups never talk to each other.
"""

from __future__ import annotations

import weakref
from typing import Dict, Tuple

from . import distributed

__all__ = ["sync_groups"]

# group_size -> weak references to (the default group it was made in, this rank's group):
# calling sync_groups again with the same size returns the same group instead of creating
# new ones, until the default group is destroyed and made anew. Weak, so that syncbn never
# keeps a group alive: destroy_process_group must be able to free both (docs/torch.md,
# "Ending a job": a group kept alive keeps gloo's threads running into interpreter shutdown).
_CACHE: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


def sync_groups(group_size: int):
    """Partition the world into consecutive blocks of ``group_size`` ranks and return
    this rank's block as a process group, for ``convert_sync_batchnorm(...,
    process_group=...)`` or ``SyncBatchNorm(..., process_group=...)``.

    Block ``k`` holds the global ranks ``k * group_size`` to ``(k + 1) * group_size - 1``.
    Creating process groups is collective over the whole world, so **every rank must call
    this**, with the same ``group_size``: each rank creates every block's group, in the
    same order, and keeps its own. Calling it again with the same size returns the same
    group without creating new ones, unless that group was destroyed since (on every rank:
    then the call creates them anew, like the first).

    Returns None (the default group) when ``group_size`` equals the world size, and when
    ``torch.distributed`` is not initialized and ``group_size`` is 1.

    Raises ``ValueError`` when ``group_size`` is below 1 or does not divide the world size,
    and ``RuntimeError`` when it is above 1 without an initialized process group. These
    depend only on the arguments and the world size, so every rank raises the same error,
    before any collective.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"sync_groups: group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"sync_groups: group_size must be at least 1, got {group_size}")
    if not distributed.is_initialized():
        if group_size == 1:
            return None
        raise RuntimeError(
            f"sync_groups({group_size}): torch.distributed is not initialized; "
            "call torch.distributed.init_process_group first"
        )
    world = distributed.group_size()
    if world % group_size:
        raise ValueError(
            f"sync_groups: the world size {world} is not a multiple of group_size {group_size}; "
            f"choose a divisor of {world}"
        )
    if group_size == world:
        return None
    world_group = distributed.default_group()
    cached = _CACHE.get(group_size)
    if cached is not None and cached[0]() is world_group:  # same world: reuse the groups
        group = cached[1]()
        # alive as long as torch's registry of groups (or the caller) holds it; a group the
        # caller destroyed on every rank is made anew, collectively, as on the first call
        if group is not None and distributed.registered_ranks(group) is not None:
            return group
    blocks = [range(start, start + group_size) for start in range(0, world, group_size)]
    group = distributed.new_groups(blocks)
    _CACHE[group_size] = (weakref.ref(world_group), weakref.ref(group))
    return group
