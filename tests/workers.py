"""Helpers that run inside the worker processes of the test pool."""

import torch.distributed as dist

_GROUPS = {}


def group_of(size: int):
    """The process group of ranks 0..size-1 (None: the default group when it is the world).

    Every rank of the pool must call this with the same sizes in the same order
    (``dist.new_group`` is collective); ranks outside the group get a non-member handle.
    """
    if size == dist.get_world_size():
        return None
    if size not in _GROUPS:
        _GROUPS[size] = dist.new_group(list(range(size)))
    return _GROUPS[size]


def in_group(size: int) -> bool:
    return dist.get_rank() < size
