"""syncbn.tools.traffic: collectives and their payloads as the profiler saw them, on every torch
this library supports (the dtypes come from the public FunctionEvent field where torch
has it, from the profiler's kineto events otherwise), and an error, never a payload of 0,
where they cannot be known."""

import pytest
import torch
import torch.distributed as dist

from syncbn.tools import traffic
from workers import group_of, in_group


def _profiled_job(world):
    """Three collectives of known payloads under the profiler, read both ways."""
    from torch.profiler import ProfilerActivity, profile

    group = group_of(world)
    if not in_group(world):
        return None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(torch.zeros(31, dtype=torch.float64), group=group)
        dist.broadcast(torch.zeros(3, 2), group=group, src=0)
        dist.all_reduce(torch.zeros((), dtype=torch.bfloat16), group=group)
    calls = traffic._collectives(prof)
    kineto = traffic._collectives(prof, fallback=True)
    return [(c.backend, c.op, c.shapes, c.dtypes, c.payload_bytes) for c in calls], [
        (c.backend, c.op, c.shapes, c.dtypes, c.payload_bytes) for c in kineto
    ]


def test_payloads_are_read_alike_from_either_source(pool):
    """torch 2.11's profiler events have no ``input_dtypes`` (a GPU machine's torch 2.11
    reported every payload as 0 bytes before the fallback): the kineto events give the
    same collectives, shapes, dtypes and bytes as the public field."""
    for calls, kineto in pool.run(_profiled_job, 2)[:2]:
        expected = [
            ("gloo", "all_reduce", [[31]], ["double"], 248),
            ("gloo", "broadcast", [[3, 2]], ["float"], 24),
            ("gloo", "all_reduce", [[]], ["c10::BFloat16"], 2),
        ]
        assert kineto == expected
        assert calls == expected


class _Event:
    def __init__(self, name, shapes, dtypes=None):
        self.name, self.input_shapes = name, shapes
        if dtypes is not None:
            self.input_dtypes = dtypes


class _Prof:
    def __init__(self, events, profiler=None):
        self._events, self.profiler = events, profiler

    def events(self):
        return self._events


def test_no_dtypes_anywhere_is_an_error_not_zero_bytes():
    prof = _Prof([_Event("gloo:all_reduce", [[31]])])  # no input_dtypes, no kineto results
    with pytest.raises(RuntimeError, match="exposes no input dtypes"):
        traffic._collectives(prof)


def test_unknown_dtype_or_missing_dtype_is_an_error():
    with pytest.raises(ValueError, match="no element size known .*'c10::Float9'"):
        traffic._collectives(_Prof([_Event("gloo:all_reduce", [[4]], ["c10::Float9"])]))
    with pytest.raises(RuntimeError, match="1 input shape.*0 dtype"):
        traffic._collectives(_Prof([_Event("nccl:all_gather", [[4]], [])]))
    assert traffic._collectives(_Prof([_Event("aten::add", [[4]], [])])) == []  # not a collective
