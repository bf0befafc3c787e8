"""Communication contract: one collective forward, one backward, O(C) payload whatever W,
none in eval; counted at the process-group level with the profiler."""

import pytest
import torch
import torch.distributed as dist

import syncbn
from syncbn.torch import fingerprint
from syncbn.tools.traffic import record_collectives, wire_bytes
from workers import group_of, in_group


def count_job(world, channels, input_grad, phase):
    group = group_of(world)
    if not in_group(world):
        return None
    bn = syncbn.SyncBatchNorm(channels, process_group=group)
    x = (torch.randn(2 + dist.get_rank(), channels, 4, 4) + 3).requires_grad_(input_grad)
    with record_collectives() as fwd:
        if phase == "eval":
            bn.eval()
        y = bn(x)
    with record_collectives() as bwd:
        y.backward(torch.randn_like(y))
    return {
        "forward": [(c.op, c.shapes, c.dtypes, c.payload_bytes) for c in fwd],
        "backward": [(c.op, c.shapes, c.dtypes, c.payload_bytes) for c in bwd],
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_collective_each_way_with_o_c_payload(pool, world):
    channels = 16
    fwd, bwd = 2 * channels + 1 + fingerprint.SIZE, 2 * channels + fingerprint.SIZE  # + the layer fingerprint
    for r in pool.run(count_job, world, channels, True, "train")[:world]:
        assert r["forward"] == [("all_reduce", [[fwd]], ["double"], 8 * fwd)]
        assert r["backward"] == [("all_reduce", [[bwd]], ["float"], 4 * bwd)]


def test_no_backward_collective_without_input_grad(pool):
    for r in pool.run(count_job, 4, 8, False, "train"):
        assert len(r["forward"]) == 1 and r["backward"] == []


def test_no_collective_in_eval(pool):
    for r in pool.run(count_job, 4, 8, True, "eval"):
        assert r["forward"] == [] and r["backward"] == []


def test_group_of_one_has_no_collective(pool):
    r = pool.run(count_job, 1, 8, True, "train")[0]
    assert r["forward"] == [] and r["backward"] == []


def test_wire_bytes_model():
    assert wire_bytes("all_reduce", 800, 4) == 1200
    assert wire_bytes("all_gather", 100, 8) == 700
    assert wire_bytes("all_reduce", 800, 1) == 0


def test_eager_unless_traceable_keeps_the_call_out_of_a_graph(monkeypatch):
    """On a torch before 2.11 (TRACEABLE false) the synchronized call is kept out of
    torch.compile's graph: fullgraph then raises at it, and without fullgraph it runs
    eagerly. From 2.11 the function is returned as it is."""
    from syncbn.torch import distributed

    def double(x):
        return x * 2

    assert distributed.eager_unless_traceable(double) is double or not distributed.TRACEABLE
    monkeypatch.setattr(distributed, "TRACEABLE", False)
    kept_out = distributed.eager_unless_traceable(double)
    assert kept_out is not double
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)disable|skip"):
        torch.compile(lambda x: kept_out(x) + 1, fullgraph=True)(torch.ones(3))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(lambda x: kept_out(x) + 1)(torch.ones(3)), torch.full((3,), 3.0))
    torch._dynamo.reset()
