"""torch.compile(model, fullgraph=True) of a converted model: a training step (forward
and backward) on CPU with gloo, W = 2, ends where eager ends, with one all-reduce each
way per layer call inside the compiled graphs.

Compiling costs tens of seconds on two cores, so there is one compiled model (tiny, the
default inductor backend) and one compile per worker for the whole test; a third run
mixes them (rank 0 eager, rank 1 compiled)."""

import torch
import torch.distributed as dist
import torch.nn as nn

import syncbn
from syncbn.torch.distributed import TRACEABLE
from syncbn.torch.functional import sync_batch_norm
from syncbn.tools.traffic import record_collectives
from workers import group_of, in_group

# torch 2.11 and 2.13 trace the synchronized call whole (fullgraph: any graph break raises).
# Before 2.11 syncbn leaves it out of the graph (syncbn.torch.distributed.TRACEABLE): it runs
# eagerly at a graph break, so fullgraph is off there and the results must still be eager's.
FULLGRAPH = TRACEABLE

WORLD, STEPS = 2, 3
SIZES = (3, 2)  # uneven local batches


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4, momentum=None),  # cumulative average: a tensor momentum
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 2),
    ).double()


def data(step, rank):
    gen = torch.Generator().manual_seed(31 * step + rank)
    x = torch.randn(SIZES[rank], 3, 4, 4, generator=gen, dtype=torch.float64) * 3 + 2
    dy = torch.randn(SIZES[rank], 2, generator=gen, dtype=torch.float64)
    return x, dy


def train(model, step_fn, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, counts = [], []
    for step in range(STEPS):
        x, dy = data(step, rank)
        opt.zero_grad()
        with record_collectives() as calls:
            y = step_fn(x)
            y.backward(dy)
        counts.append([c.op for c in calls])
        outs.append(y.detach().clone())
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return {"outs": outs, "state": state, "grads": grads, "collectives": counts}


def compile_job():
    import torch._dynamo

    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    rank = dist.get_rank()
    eager = syncbn.convert_sync_batchnorm(tiny(), process_group=group)
    compiled_model = syncbn.convert_sync_batchnorm(tiny(), process_group=group)
    start = {k: v.clone() for k, v in compiled_model.state_dict().items()}
    torch._dynamo.reset()
    step = torch.compile(compiled_model, fullgraph=FULLGRAPH)  # raises on any graph break
    out = {"eager": train(eager, eager, rank), "compiled": train(compiled_model, step, rank)}
    # a group whose ranks differ: rank 0 eager, rank 1 compiled (same graphs, restarted)
    mixed = syncbn.convert_sync_batchnorm(tiny(), process_group=group) if rank == 0 else compiled_model
    mixed.load_state_dict(start)
    out["mixed"] = train(mixed, mixed if rank == 0 else step, rank)
    return out


def test_compiled_training_step_equals_eager(pool):
    results = pool.run(compile_job, timeout=600)[:WORLD]
    # float64; the compiled graph may fuse and reorder the same float64 operations: differences
    # ~n * 2^-53 * (condition) ~1e-14 per step over a few steps; bound 1e-9
    tol = dict(rtol=1e-9, atol=1e-9)
    for rank, r in enumerate(results):
        eager, compiled = r["eager"], r["compiled"]
        for a, b in zip(compiled["outs"], eager["outs"]):
            torch.testing.assert_close(a, b, **tol)
        for key, ref in eager["state"].items():
            torch.testing.assert_close(compiled["state"][key], ref, **tol, msg=key)
        for key, ref in eager["grads"].items():
            torch.testing.assert_close(compiled["grads"][key], ref, **tol, msg=key)
        assert int(compiled["state"]["1.num_batches_tracked"]) == STEPS
        # one all-reduce forward and one backward per step, compiled as in eager
        assert eager["collectives"] == [["all_reduce", "all_reduce"]] * STEPS
        assert compiled["collectives"] == eager["collectives"], rank
    # one rank eager and the other compiled (a rank whose compiled graph fell back to
    # eager, say): every path sends the same payload, so the step is still the eager one
    for rank, r in enumerate(results):
        for a, b in zip(r["mixed"]["outs"], r["eager"]["outs"]):
            torch.testing.assert_close(a, b, **tol)
        for key, ref in r["eager"]["state"].items():
            torch.testing.assert_close(r["mixed"]["state"][key], ref, **tol, msg=key)
        for key, ref in r["eager"]["grads"].items():
            torch.testing.assert_close(r["mixed"]["grads"][key], ref, **tol, msg=key)
    # no gradient averaging here, so only the buffers are shared by the two ranks
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(results[0]["compiled"]["state"][key], results[1]["compiled"]["state"][key]), key


def two_layers():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4),
    ).double()


def mixed_two_layers_job():
    import torch._dynamo

    from syncbn.torch import fingerprint

    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    rank = dist.get_rank()
    model = syncbn.convert_sync_batchnorm(two_layers(), process_group=group)
    torch._dynamo.reset()
    step = torch.compile(model, fullgraph=FULLGRAPH) if rank == 1 else model
    x, _ = data(0, rank)
    try:
        step(x).sum().backward()
        return ("ok", "")
    except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
        return (type(e).__name__, str(e))
    finally:
        fingerprint.reset()  # on every rank: call counts from 0 for the next test
        torch._dynamo.reset()


def test_compiled_rank_beside_an_eager_rank_raises_at_the_second_layer(pool):
    """A compiled call's fingerprint carries call index 0 (the graph is traced once), an
    eager call its index in the step: beside an eager rank, a compiled rank agrees on the
    step's first synchronized layer (test above) and, from the second on, every rank
    raises naming the disagreement (the eager rank LayerMismatchError, the compiled rank
    the assert in its graph) instead of hanging or mixing layers."""
    eager, compiled = pool.run(mixed_two_layers_job, timeout=600)[:WORLD]
    if not TRACEABLE:  # the compiled rank runs the layers eagerly: they agree
        assert eager == compiled == ("ok", ""), (eager, compiled)
        return
    assert eager[0] == "LayerMismatchError" and "call 1 of the step" in eager[1], eager
    assert "different synchronized layer calls" in compiled[1], compiled


def test_compiled_layer_takes_a_group_of_empty_ranks_as_torchs_empty_batch(pool):
    """Every rank empty under torch.compile (fullgraph where syncbn traces whole): the
    count check is an assert inside the graph, which raised for a global count of 0; now
    torch.nn.BatchNorm2d's empty batch (the running buffers bit for bit as they were, the
    momentum count moved: momentum None, so the step with values after it weighs 1/3),
    one all-reduce each way (test_functional.check_empty_group)."""
    from test_functional import check_empty_group, empty_group_job

    results = pool.run(empty_group_job, WORLD, "SyncBatchNorm", None, True, "compiled", timeout=600)
    check_empty_group(results, WORLD, "SyncBatchNorm", None, True)


def empty_rank_job():
    """Rank 0 empty, rank 1 with 3 samples: a compiled SyncBatchNorm and an eager one, one
    training step each (momentum None): the outputs, gradients, buffers and collectives."""
    import torch._dynamo

    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(41)
    xs = [torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64) * 2 + 1 for n in (0, 3)]
    dys = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in xs]
    out = {}
    torch._dynamo.reset()
    for mode in ("eager", "compiled"):
        layer = syncbn.SyncBatchNorm(3, momentum=None, process_group=group).double()
        call = torch.compile(layer, fullgraph=FULLGRAPH) if mode == "compiled" else layer
        x = xs[rank].clone().requires_grad_()
        with record_collectives() as calls:
            y = call(x)
            y.backward(dys[rank])
        out[mode] = {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad,
                     "buffers": [b.clone() for b in layer.buffers()], "collectives": [c.op for c in calls]}
    return out


def test_compiled_layer_with_an_empty_rank_makes_one_collective_each_way(pool):
    """A compiled rank whose local batch is empty beside one that is not: its backward sums
    were zeros made from nothing, which the compiler moved, with their all-reduce, into the
    forward graph, so that rank ran 3 collectives to the other's 2 and gloo failed on the
    mismatch ("Received data size doesn't match expected size"). Now one all-reduce each way
    on both ranks, and the step is eager's (float64, same operations reordered: bound 1e-9,
    as above)."""
    results = pool.run(empty_rank_job, timeout=600)[:WORLD]
    for r in results:
        assert r["compiled"]["collectives"] == r["eager"]["collectives"] == ["all_reduce", "all_reduce"], r
        for key in ("y", "dx", "dw", "db"):
            torch.testing.assert_close(r["compiled"][key], r["eager"][key], rtol=1e-9, atol=1e-9, msg=key)
        for a, b in zip(r["compiled"]["buffers"], r["eager"]["buffers"]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


class LayerThenFunctional(nn.Module):
    """A SyncBatchNorm, then the functional form on buffers of the module's own."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.bn = syncbn.SyncBatchNorm(3, process_group=group)
        self.weight = nn.Parameter(torch.tensor([1.5, -0.5, 2.0]))
        self.bias = nn.Parameter(torch.tensor([0.1, 0.2, -0.3]))
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("running_var", torch.ones(3))

    def forward(self, x):
        y = self.bn(x)
        return sync_batch_norm(y * y, self.running_mean, self.running_var, self.weight, self.bias, True,
                               0.1, 1e-5, self.group, name="square")


DYNAMIC_SIZES = ((3, 2), (2, 4), (1, 1))  # per step, the local batch of each rank


def dynamic_batch(step, rank):
    gen = torch.Generator().manual_seed(97 * step + rank)
    x = torch.randn(DYNAMIC_SIZES[step][rank], 3, 2, 3, generator=gen, dtype=torch.float64) * 2 + 1
    return x, torch.randn(x.shape, generator=gen, dtype=torch.float64)


def dynamic_job():
    import torch._dynamo

    group = group_of(WORLD)
    if not in_group(WORLD):
        return None
    rank = dist.get_rank()
    model = LayerThenFunctional(group).double()
    torch._dynamo.reset()
    step = torch.compile(model, fullgraph=FULLGRAPH, dynamic=True)
    out = []
    try:
        for i in range(len(DYNAMIC_SIZES)):
            x, dy = dynamic_batch(i, rank)
            x.requires_grad_()
            model.zero_grad()
            step(x).backward(dy)
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            for g in grads.values():  # the sum over ranks: one process's on the concatenated batch
                dist.all_reduce(g, group=group)
            out.append({"dx": x.grad, "grads": grads,
                        "state": {k: v.clone() for k, v in model.state_dict().items()}})
    finally:
        torch._dynamo.reset()
    return out


def test_compiled_with_dynamic_shapes_trains_as_one_big_batch(pool):
    """torch.compile(dynamic=True): every dim of the input symbolic, the channel count too,
    which the fingerprint's layer identity (a constant-result function) could not take:
    fullgraph raised "assume_constant_result argument conversion failed" (torch 2.13). Now
    the layer and the functional form compile with symbolic batch sizes, and three steps
    whose local batches change train as one process on the concatenated batch."""
    results = pool.run(dynamic_job, timeout=600)[:WORLD]
    torch.manual_seed(0)
    ref = LayerThenFunctional(None).double()
    # float64: a few roundings of 2^-53 times the condition (|mean| / std ~ a few) per step,
    # the graphs reordering the same operations; ~1e-14, bound 1e-9 as above
    tol = dict(rtol=1e-9, atol=1e-9)
    for i in range(len(DYNAMIC_SIZES)):
        parts = [dynamic_batch(i, rank) for rank in range(WORLD)]
        x = torch.cat([p[0] for p in parts]).requires_grad_()
        ref.zero_grad()
        ref(x).backward(torch.cat([p[1] for p in parts]))
        start = 0
        for rank, r in enumerate(results):
            n = DYNAMIC_SIZES[i][rank]
            torch.testing.assert_close(r[i]["dx"], x.grad[start:start + n], **tol)
            start += n
            for key, p in ref.named_parameters():
                torch.testing.assert_close(r[i]["grads"][key], p.grad, **tol, msg=key)
            for key, value in ref.state_dict().items():
                torch.testing.assert_close(r[i]["state"][key], value, **tol, msg=key)
