"""Measuring memory: the bytes a forward pass keeps for backward, and the peak memory
of a step. Used by the tests and by ``syncbn bench``.

:func:`saved_tensors` counts what autograd saves, with
``torch.autograd.graph.saved_tensors_hooks``: every saved tensor is mapped to its
storage, and each storage is counted once, whole (a view keeps all of its base alive;
two saved views of one tensor are one storage). Storages that exist anyway, such as
the parameters and buffers of a model, can be left out with ``ignore``.

:func:`peak_memory` runs a function and returns how far the memory allocated on a
device rose above its level at the start: from the CUDA caching allocator's counters on
CUDA, from the profiler's allocation events elsewhere (CPU included). It cannot run
inside another profiler (``syncbn.tools.traffic.record_collectives`` is one).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["SavedTensors", "saved_tensors", "saved_bytes", "peak_memory"]


def _storage_key_and_bytes(t: Tensor):
    try:
        storage = t.untyped_storage()
        return (t.device, storage.data_ptr(), storage.nbytes()), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, or a wrapper subclass
        nbytes = t.numel() * t.element_size()
        return ("tensor", id(t)), nbytes


def _ignored_keys(ignore) -> set:
    keys = set()
    for item in ignore or ():
        tensors = list(item.parameters()) + list(item.buffers()) if isinstance(item, nn.Module) else [item]
        for t in tensors:
            if isinstance(t, Tensor):
                keys.add(_storage_key_and_bytes(t)[0])
    return keys


@dataclass
class SavedTensors:
    """What autograd saved while the block ran.

    ``bytes``: bytes of the distinct storages saved (each counted once, whole);
    ``storages``: how many distinct storages; ``tensors``: how many tensors autograd
    saved (a tensor saved twice, or two views of one storage, count twice here).
    """

    bytes: int = 0
    storages: int = 0
    tensors: int = 0
    _seen: set = field(default_factory=set, repr=False)


@contextlib.contextmanager
def saved_tensors(ignore: Optional[Iterable] = None):
    """``with saved_tensors() as saved: loss = model(x)`` fills ``saved`` (a
    :class:`SavedTensors`) with what the forward pass saved for backward.

    ``ignore``: tensors or modules (their parameters and buffers) whose storages are not
    counted. Saved tensors are left as they are: the graph can be run backward after.
    """
    result = SavedTensors()
    skip = _ignored_keys(ignore)

    def pack(t: Tensor):
        result.tensors += 1
        key, nbytes = _storage_key_and_bytes(t)
        if key not in skip and key not in result._seen:
            result._seen.add(key)
            result.storages += 1
            result.bytes += nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result


def saved_bytes(fn: Callable, *args, ignore: Optional[Iterable] = None, **kwargs) -> int:
    """Bytes (distinct storages) that ``fn(*args, **kwargs)`` saves for backward."""
    with saved_tensors(ignore) as saved:
        fn(*args, **kwargs)
    return saved.bytes


def _profiled_peak(fn, device: torch.device) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name.lower() == device.type
    ]
    level = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        level += nbytes
        peak = max(peak, level)
    return peak


def peak_memory(fn: Callable, *args, device=None, **kwargs) -> int:
    """Run ``fn(*args, **kwargs)`` once; return the peak memory allocated on ``device``
    during the call, in bytes above the level at its start.

    ``device`` defaults to CPU. On CUDA the caching allocator's peak counter is used (it
    is reset first); on other devices the profiler's allocation events, summed in time
    order. Memory that is allocated before the call and freed during it lowers the
    level, so the result can undercount a step that frees its inputs early; memory held
    across the call (parameters, optimizer state) is not counted.
    """
    device = torch.device("cpu" if device is None else device)
    call = lambda: fn(*args, **kwargs)  # noqa: E731
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return max(torch.cuda.max_memory_allocated(device) - start, 0)
    return _profiled_peak(call, device)
