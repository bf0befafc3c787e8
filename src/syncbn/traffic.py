"""Counting collectives at the process-group level, as they really happen.

:func:`record_collectives` runs a block of code under the PyTorch profiler and returns
every collective the backend executed (``gloo:all_reduce``, ``nccl:all_gather`` ...)
with its payload, so the figures come from the process group itself, not from what
syncbn believes it sends. Used by the tests and by ``syncbn bench``.

Bytes on the wire for a payload of S bytes over W ranks, per rank, with the usual
bandwidth-optimal algorithms (what ``syncbn bench`` prints beside the payload):

- all_reduce (ring / reduce-scatter + all-gather): sends and receives 2 (W-1)/W * S each;
- all_gather of S bytes per rank: sends and receives (W-1) * S each.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import List

__all__ = ["Collective", "record_collectives", "wire_bytes"]

_DTYPE_BYTES = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "Half": 2, "BFloat16": 2, "long": 8, "unsigned char": 1, "bool": 1,
}
_BACKEND_OP = re.compile(r"^(gloo|nccl|mpi|ucc|xccl|fake):(\w+)$")


@dataclass
class Collective:
    """One collective as the backend ran it."""

    backend: str
    op: str  # all_reduce, all_gather, broadcast, ...
    shapes: list  # input tensor shapes
    dtypes: list
    payload_bytes: int  # bytes of this rank's input tensors


def _shape_bytes(shape, dtype: str) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * _DTYPE_BYTES.get(dtype, 4)


@contextlib.contextmanager
def record_collectives():
    """``with record_collectives() as calls: ...`` fills ``calls`` with the collectives run."""
    from torch.profiler import ProfilerActivity, profile

    calls: List[Collective] = []  # filled when the block ends
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield calls
    for event in prof.events():
        match = _BACKEND_OP.match(event.name)
        if not match:
            continue
        shapes = [list(s) for s in event.input_shapes if s]
        dtypes = [d for d in getattr(event, "input_dtypes", []) if d]
        payload = sum(_shape_bytes(s, d) for s, d in zip(shapes, dtypes))
        calls.append(Collective(match.group(1), match.group(2), shapes, dtypes, payload))


def wire_bytes(op: str, payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends (and receives) for a collective with this payload."""
    w = world_size
    if w <= 1:
        return 0
    if op == "all_reduce":
        return int(2 * (w - 1) * payload_bytes / w)
    if op in ("all_gather", "allgather", "all_gather_into_tensor", "_allgather_base"):
        return (w - 1) * payload_bytes
    if op in ("broadcast", "reduce"):
        return payload_bytes
    raise ValueError(f"no traffic model for collective {op!r}")
