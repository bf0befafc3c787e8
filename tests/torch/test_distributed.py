"""Communication contract: one collective forward, one backward, O(C) payload whatever W,
none in eval; counted at the process-group level with the profiler. And the warning when
WORLD_SIZE > 1 but no process group exists (torchrun without init_process_group)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

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
    # + the layer fingerprint; backward: the sums and the kept-channel overflow slot (0 here)
    fwd, bwd = 2 * channels + 1 + fingerprint.SIZE, 2 * channels + 1 + fingerprint.SIZE
    for r in pool.run(count_job, world, channels, True, "train")[:world]:
        assert r["forward"] == [("all_reduce", [[fwd]], ["double"], 8 * fwd)]
        assert r["backward"] == [("all_reduce", [[bwd]], ["float"], 4 * bwd)]


def test_backward_collective_also_without_input_grad(pool):
    """Whether a rank's input needs a gradient is its own fact: every rank whose backward
    reaches the layer all-reduces, so that no rank waits for one that skipped."""
    channels = 8
    bwd = 2 * channels + 1 + fingerprint.SIZE
    for r in pool.run(count_job, 4, channels, False, "train"):
        assert len(r["forward"]) == 1
        assert r["backward"] == [("all_reduce", [[bwd]], ["float"], 4 * bwd)]


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


# ---- WORLD_SIZE > 1 without a process group (torchrun without init_process_group)

NOT_INITIALIZED = "init_process_group"  # the fix the warning names


@pytest.fixture
def fresh_warning():
    """The once-per-process warning not yet given, before and after the test."""
    from syncbn.torch import distributed

    distributed.reset_not_initialized_warning()
    yield
    distributed.reset_not_initialized_warning()


def _train_calls(form, calls=2, training=True):
    """Run ``calls`` forward (+ backward in training) calls of one form of the layer
    without a process group; return the syncbn warnings and the last output and input."""
    import warnings

    from syncbn.torch.functional import sync_batch_norm

    assert not dist.is_initialized()  # the test process has no group (the pool's workers have)
    torch.manual_seed(0)
    layer = {"module": lambda: syncbn.SyncBatchNorm(3), "act": lambda: syncbn.SyncBatchNormAct(3),
             "functional": lambda: None}[form]()
    if layer is not None:
        layer.train(training)
    mean, var = torch.zeros(3), torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a second warning would be recorded, not merged
        for _ in range(calls):
            x = (torch.randn(4, 3, 5, 5) + 2).requires_grad_(True)
            y = layer(x) if layer is not None else sync_batch_norm(x, mean, var, training=training)
            if training:
                y.backward(torch.randn_like(y))
    ours = [w for w in caught if issubclass(w.category, UserWarning) and NOT_INITIALIZED in str(w.message)]
    return ours, x, y


@pytest.mark.parametrize("form", ["module", "act", "functional"])
def test_world_size_without_process_group_warns_once_and_trains_locally(monkeypatch, fresh_warning, form):
    """torchrun sets WORLD_SIZE; without init_process_group every rank would normalize its
    own batch alone, silently. The first training call warns, naming the fix; later calls
    (any layer) do not repeat it; the result is still local batch norm."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    caught, x, y = _train_calls(form)
    assert len(caught) == 1, [str(w.message) for w in caught]
    text = str(caught[0].message)
    assert "torch.distributed.init_process_group(" in text and "unset WORLD_SIZE" in text
    assert "WORLD_SIZE=2" in text
    expected = F.batch_norm(x.detach(), None, None, training=True)
    if form == "act":
        expected = F.leaky_relu(expected, 0.01)
    torch.testing.assert_close(y.detach(), expected)
    again, _, _ = _train_calls("module" if form != "module" else "act")  # once per process, not per layer
    assert again == []


@pytest.mark.parametrize("world_size", [None, "1"])
@pytest.mark.parametrize("form", ["module", "act", "functional"])
def test_no_warning_without_world_size_above_one(monkeypatch, fresh_warning, form, world_size):
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    caught, _, _ = _train_calls(form)
    assert caught == []


@pytest.mark.parametrize("form", ["module", "act", "functional"])
def test_no_warning_in_eval(monkeypatch, fresh_warning, form):
    """Eval never communicates, so it has nothing to warn about; the warning is still owed
    to the first training call."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    caught, _, _ = _train_calls(form, training=False)
    assert caught == []
    caught, _, _ = _train_calls(form)
    assert len(caught) == 1


def world_size_env_job():
    """A training call in an initialized group with WORLD_SIZE set: no warning."""
    import os
    import warnings

    from syncbn.torch import distributed

    distributed.reset_not_initialized_warning()
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bn = syncbn.SyncBatchNorm(3)
            x = (torch.randn(2, 3, 4, 4) + 2).requires_grad_(True)
            bn(x).sum().backward()
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved
        distributed.reset_not_initialized_warning()
    return [str(w.message) for w in caught if NOT_INITIALIZED in str(w.message)]


def test_no_warning_with_an_initialized_group(pool):
    assert pool.run(world_size_env_job) == [[]] * 4


def test_world_size_warning_keeps_fullgraph_compile(monkeypatch, fresh_warning):
    """Under torch.compile(fullgraph=True) the check runs at trace time (a warning inside
    the graph would be a graph break, an error with fullgraph): it warns once, compiles."""
    import warnings

    monkeypatch.setenv("WORLD_SIZE", "2")
    torch._dynamo.reset()
    bn = torch.compile(syncbn.SyncBatchNorm(3), fullgraph=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                bn(torch.randn(4, 3, 2, 2) + 2)
    finally:
        torch._dynamo.reset()
    assert len([w for w in caught if NOT_INITIALIZED in str(w.message)]) == 1
