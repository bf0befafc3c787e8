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

# the profiler's names of tensor dtypes (c10's C++ type names), in bytes per element
_DTYPE_BYTES = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::complex<double>": 16, "c10::complex<float>": 8, "c10::complex<c10::Half>": 4,
    "Half": 2, "BFloat16": 2, "long": 8,
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
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"record_collectives: no element size known for the profiler's dtype {dtype!r}")
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * _DTYPE_BYTES[dtype]


def _op_events(prof, fallback: bool = False) -> list:
    """``(name, input shapes, input dtypes)`` of every operation ``prof`` recorded.

    From the public ``FunctionEvent.input_dtypes`` where this torch has it (2.13 does);
    torch 2.11 records the dtypes but exposes them only on the profiler's
    kineto events (``prof.profiler.kineto_results``), which are read then (``fallback``
    forces that path, for the tests). Without either there is no payload to report, and
    that is an error, not a payload of 0."""
    events = prof.events()
    if not fallback and all(hasattr(e, "input_dtypes") for e in events):
        return [(e.name, e.input_shapes, e.input_dtypes) for e in events]
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None or not hasattr(type(results), "events"):
        raise RuntimeError(
            "record_collectives: this torch's profiler exposes no input dtypes, so the "
            "collectives' payloads cannot be known"
        )
    return [(e.name(), e.shapes(), e.dtypes()) for e in results.events()]


def _collectives(prof, fallback: bool = False) -> List[Collective]:
    calls = []
    for name, input_shapes, input_dtypes in _op_events(prof, fallback):
        match = _BACKEND_OP.match(name)
        if not match:
            continue
        if len(input_dtypes) != len(input_shapes):
            raise RuntimeError(
                f"record_collectives: {name} has {len(input_shapes)} input shape(s) but "
                f"{len(input_dtypes)} dtype(s); its payload cannot be known"
            )
        inputs = [(list(s), d) for s, d in zip(input_shapes, input_dtypes) if d]  # the tensors
        shapes, dtypes = [s for s, _ in inputs], [d for _, d in inputs]
        payload = sum(_shape_bytes(s, d) for s, d in inputs)
        calls.append(Collective(match.group(1), match.group(2), shapes, dtypes, payload))
    return calls


@contextlib.contextmanager
def record_collectives():
    """``with record_collectives() as calls: ...`` fills ``calls`` with the collectives run."""
    from torch.profiler import ProfilerActivity, profile

    calls: List[Collective] = []  # filled when the block ends
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield calls
    calls.extend(_collectives(prof))


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
