"""Helpers that run inside the worker processes of the test pool."""

import torch.distributed as dist

# global ranks -> process group, made on first use and kept for the life of the pool's
# processes: jobs never destroy a group. On torch 2.4.1 (and any torch without pytorch PR
# #154976, "Release GIL in PG destructor", merged 2025-06; open issue pytorch#56297)
# freeing a gloo group right after a collective on it can deadlock: the last reference drops
# with the GIL held and ~ProcessGroupGloo joins its worker threads, while a worker thread,
# releasing the finished all-reduce, waits for the GIL to free the tensor's Python object.
# A job that made a group, used it and destroyed it hung one rank in 5 to 7 of 10 runs there
# (docs/torch.md, "torch versions").
_GROUPS = {}


def group_of(size: int):
    """The process group of ranks 0..size-1 (None: the default group when it is the world).

    Every rank of the pool must call this with the same sizes in the same order
    (``dist.new_group`` is collective); ranks outside the group get a non-member handle.
    """
    if size == dist.get_world_size():
        return None
    return group_of_ranks(range(size))


def group_of_ranks(ranks):
    """The process group of the global ``ranks`` (kept: see ``_GROUPS``).

    Collective on first use, as ``group_of``: every rank calls it with the same ranks in the
    same order; ranks outside the group get a non-member handle.
    """
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key))
    return _GROUPS[key]


def in_group(size: int) -> bool:
    return dist.get_rank() < size
