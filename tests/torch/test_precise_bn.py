"""precise_bn: after it, each BN layer's running statistics are the float64 statistics of
that layer's inputs over all the batches on all ranks (recorded independently here),
for syncbn.SyncBatchNorm, SyncBatchNormAct and plain torch BN layers; the weights, the
modes and the other layer settings are untouched; uneven batch counts fail alike on
every rank."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import syncbn

BATCHES = 5


class Net(nn.Module):
    """A converted BN, a fused BN + activation, a plain torch BN left unconverted, a BN
    called twice per forward and a frozen (eval-mode) BN."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)  # converted to syncbn.SyncBatchNorm below
        self.act_bn = syncbn.SyncBatchNormAct(4, activation="leaky_relu", activation_param=0.1)
        self.fc = nn.Linear(4, 5)
        self.twice = nn.BatchNorm1d(5)  # converted too; sees two inputs per batch
        self.frozen = nn.BatchNorm1d(5)  # converted, then put in eval mode
        self.momentum_none = nn.BatchNorm1d(5, momentum=None)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.act_bn(self.bn(self.conv(x)) * 1.5 + 0.5)
        v = self.fc(h.mean(dim=(2, 3)))
        v = self.twice(v) + self.twice(v * 2 - 1)
        return self.momentum_none(self.frozen(self.drop(v)))


def build(plain_tail: bool):
    torch.manual_seed(0)
    net = Net()
    model = syncbn.convert_sync_batchnorm(net)
    if plain_tail:  # a plain torch BN layer in the mix
        model.momentum_none = nn.BatchNorm1d(5, momentum=None)
    model = model.double()
    # make the buffers something to overwrite
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.fill_(3.0)
            m.running_var.fill_(7.0)
            m.num_batches_tracked.fill_(11)
    model.train()
    model.frozen.eval()
    return model


def rank_batches(rank, count, size=None):
    gen = torch.Generator().manual_seed(500 + rank)
    for i in range(count):
        n = size if size is not None else 2 + (rank + i) % 3  # uneven batch sizes
        yield torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64) * (1 + rank) + 2 * rank - 1


RECORDED = ("bn", "act_bn", "twice", "momentum_none")


def precise_job(plain_tail):
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = build(plain_tail)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    modes = {k: m.training for k, m in model.named_modules()}
    frozen = {k: v.clone() for k, v in model.frozen.state_dict().items()}
    seen = {name: [] for name in RECORDED}
    handles = [
        getattr(model, name).register_forward_pre_hook(
            lambda mod, args, name=name: seen[name].append(args[0].detach().double().clone())
        )
        for name in RECORDED
    ]
    # 7 batches available, 5 used
    used = syncbn.precise_bn(model, rank_batches(rank, BATCHES + 2), num_batches=BATCHES, progress=rank == 0)
    for h in handles:
        h.remove()
    return {
        "used": used,
        "inputs": seen,
        "buffers": {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k},
        "params_kept": all(torch.equal(p, params[k]) for k, p in model.named_parameters()),
        "modes_kept": {k: m.training for k, m in model.named_modules()} == modes,
        "frozen_kept": all(torch.equal(v, frozen[k]) for k, v in model.frozen.state_dict().items()),
        "settings": [(m.momentum, m.track_running_stats) for m in model.modules() if hasattr(m, "track_running_stats")],
    }


def population(chunks):
    """float64 mean and unbiased variance per channel of all the recorded inputs."""
    x = torch.cat([c.transpose(0, 1).reshape(c.shape[1], -1) for c in chunks], dim=1)
    return x.mean(dim=1), x.var(dim=1, correction=1)


def check(results):
    for r in results:
        assert r["used"] == BATCHES
        assert r["params_kept"] and r["modes_kept"] and r["frozen_kept"]
        assert r["settings"] == results[0]["settings"]
    assert (None, True) in results[0]["settings"] and (0.1, True) in results[0]["settings"]
    for name in RECORDED:
        chunks = [c for r in results for c in r["inputs"][name]]
        assert len(chunks) == len(results) * BATCHES * (2 if name == "twice" else 1)
        mean, var = population(chunks)
        for r in results:
            # float64 data through a few layers and steps: rounding ~n * 2^-53 * (condition) ~1e-14; bound 1e-10 leaves 100x or more
            torch.testing.assert_close(r["buffers"][f"{name}.running_mean"], mean, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(r["buffers"][f"{name}.running_var"], var, rtol=1e-10, atol=1e-10)
            assert int(r["buffers"][f"{name}.num_batches_tracked"]) == 11
    for key, value in results[0]["buffers"].items():
        assert all(torch.equal(r["buffers"][key], value) for r in results), key


def test_population_statistics_across_four_ranks(pool):
    check(pool.run(precise_job, True))


def test_population_statistics_single_process():
    check([precise_job(False)])
    from syncbn import precise_bn
    from syncbn.torch.precise_bn import precise_bn as function

    assert callable(precise_bn) and callable(syncbn.precise_bn) and callable(function)


def uneven_job():
    rank = dist.get_rank()
    model = build(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        syncbn.precise_bn(model, rank_batches(rank, 2 if rank == 1 else BATCHES), num_batches=BATCHES, progress=False)
    except ValueError as exc:
        return str(exc), all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return None, False


def test_batches_running_out_on_one_rank_fails_alike_everywhere(pool):
    results = pool.run(uneven_job)
    messages = {m for m, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and "rank(s) [1] after 2 batch(es)" in message
    assert all(kept for _, kept in results)


def short_job():
    rank = dist.get_rank()
    model = build(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        used = syncbn.precise_bn(model, rank_batches(rank, 3), num_batches=BATCHES, progress=False)
    return used, any("ran out after 3" in str(w.message) for w in caught)


def test_batches_running_out_everywhere_uses_what_was_seen(pool):
    assert pool.run(short_job) == [(3, True)] * 4


def test_eval_model_recomputes_every_layer_and_stays_in_eval():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.9), nn.Linear(4, 2), nn.BatchNorm1d(2))
    model = model.double().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(6, 3, generator=gen, dtype=torch.float64) + 4 for _ in range(4)]
    seen = {1: [], 4: []}
    for i in seen:
        model[i].register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0].clone()))
    with pytest.warns(UserWarning, match="ran out after 4 of num_batches=10"):
        assert syncbn.precise_bn(model, batches, num_batches=10, progress=False) == 4
    assert not any(m.training for m in model.modules())
    for i, chunks in seen.items():
        mean, var = population(chunks)
        # float64 data through a few layers and steps: rounding ~n * 2^-53 * (condition) ~1e-14; bound 1e-12 leaves 100x or more
        torch.testing.assert_close(model[i].running_mean, mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(model[i].running_var, var, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="empty"):
        syncbn.precise_bn(model, [], progress=False)
    with pytest.raises(ValueError, match="num_batches"):
        syncbn.precise_bn(model, batches, num_batches=0)


@pytest.mark.parametrize("training", [False, True])
def test_other_modules_keep_their_state_in_an_eval_model(training):
    """What the docs say of the other modules: in an eval model only the BatchNorm buffers
    change (an InstanceNorm's running statistics and spectral norm's vector stay bit for
    bit); in a training model those run as in a training step and move."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 4, 1)),
                          nn.InstanceNorm2d(4, track_running_stats=True), nn.BatchNorm2d(4))
    model.train(training)
    batches = [torch.randn(2, 3, 5, 5) + 3 for _ in range(3)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert syncbn.precise_bn(model, batches, num_batches=3, progress=False) == 3
    after = model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert {"2.running_mean", "2.running_var"} <= moved
    others = {k for k in moved if not k.startswith("2.")}
    if training:
        assert {"1.running_mean", "1.running_var"} <= others
    else:
        assert others == set(), others


# ---- layers that saw at most one value per channel (issue #20, item 7) ---------------


class Branchy(nn.Module):
    """``used`` sees every batch; ``unused`` is never called; ``single`` is called once,
    with one row on rank 0 and none elsewhere (so one value per channel in all:
    training batch norm raises, and the forward carries on without it)."""

    def __init__(self):
        super().__init__()
        self.used = nn.BatchNorm1d(3)
        self.unused = nn.BatchNorm1d(3)
        self.single = nn.BatchNorm1d(3)
        self.fed = False

    def forward(self, x):
        if not self.fed:
            self.fed = True
            rows = 1 if (not dist.is_initialized() or dist.get_rank() == 0) else 0
            try:
                self.single(x[:rows])
            except ValueError:  # "more than 1 value per channel", on every rank alike
                pass
        return self.used(x)


def starved_layers_run(convert: bool):
    torch.manual_seed(0)
    model = Branchy().double()
    if convert:
        model = syncbn.convert_sync_batchnorm(model)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.fill_(3.0)
            m.running_var.fill_(7.0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(40 + rank)
    batches = [torch.randn(4, 3, generator=gen, dtype=torch.float64) * 2 + 1 for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        used = syncbn.precise_bn(model, batches, num_batches=3, progress=False)
    messages = [str(w.message) for w in caught if "at most one value per channel" in str(w.message)]
    buffers = {name: (m.running_mean.clone(), m.running_var.clone()) for name, m in model.named_children()}
    return {"used": used, "messages": messages, "buffers": buffers}


def check_starved(result):
    assert result["used"] == 3
    assert len(result["messages"]) == 1, result["messages"]
    listed = sorted(name.strip() for name in result["messages"][0].split(":")[-1].split(","))
    assert listed == ["single", "unused"], result["messages"]
    for name in ("unused", "single"):
        mean, var = result["buffers"][name]
        assert torch.isfinite(mean).all() and torch.isfinite(var).all(), name
        assert torch.equal(mean, torch.full((3,), 3.0, dtype=torch.float64)), name
        assert torch.equal(var, torch.full((3,), 7.0, dtype=torch.float64)), name
    mean, var = result["buffers"]["used"]  # the layer that saw data got its statistics
    assert torch.isfinite(var).all() and not torch.equal(mean, torch.full((3,), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("convert", [False, True])
def test_layers_that_saw_at_most_one_value_warn_and_keep_their_buffers(convert):
    check_starved(starved_layers_run(convert))


def test_layers_that_saw_at_most_one_value_across_ranks(pool):
    """One value on rank 0, none on the others: the pooled count is 1 on every rank."""
    results = pool.run(starved_layers_run, True)
    for r in results:
        check_starved(r)
    for name in ("used", "unused", "single"):
        for r in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r["buffers"][name], results[0]["buffers"][name]))


class BatchNormThenDrop(nn.BatchNorm1d):
    """A norm layer holding a dropout module it applies after normalizing (as timm's
    BatchNormAct2d and syncbn's SyncBatchNormDropAct hold their ``drop``)."""

    def __init__(self, channels):
        super().__init__(channels)
        self.drop = nn.Dropout(0.9)

    def forward(self, x):
        return self.drop(super().forward(x))


@pytest.mark.parametrize("convert", [False, True])
def test_modules_inside_a_layer_keep_their_eval_mode_during_the_passes(convert):
    """Only the layer itself runs in training mode: a dropout it holds stays in eval,
    as the model was put, so the next layer's statistics are those of undropped values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), BatchNormThenDrop(4), nn.Linear(4, 2), nn.BatchNorm1d(2)).double()
    if convert:
        from syncbn.torch.timm import SyncBatchNormDropAct

        layer = SyncBatchNormDropAct(4).double()
        layer.drop = model[1].drop
        model[1] = layer
    model.eval()
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randn(6, 3, generator=gen, dtype=torch.float64) + 4 for _ in range(3)]
    seen = []
    model[3].register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    syncbn.precise_bn(model, batches, num_batches=3, progress=False)
    assert not any(m.training for m in model.modules())
    # what layer 3 sees with layer 1 normalizing by its batch statistics and nothing dropped
    with torch.no_grad():
        want = [model[2](nn.functional.batch_norm(model[0](x), None, None, model[1].weight, model[1].bias, True))
                for x in batches]
    assert len(seen) == 3
    for got, expected in zip(seen, want):
        # the same float64 operations in the same order: equal to rounding, ~1e-15; 1e-12 leaves room
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    mean, var = population(want)
    torch.testing.assert_close(model[3].running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[3].running_var, var, rtol=1e-12, atol=1e-12)


def test_lazy_layer_materialized_by_load_state_dict():
    """A lazy batch norm given its tensors by ``load_state_dict`` keeps ``num_features`` 0
    (its first forward, during the passes, does not set it): the channel count comes from
    its buffers, and it gets its population statistics like any layer."""
    lazy = nn.LazyBatchNorm1d(dtype=torch.float64)
    lazy.load_state_dict(nn.BatchNorm1d(3, dtype=torch.float64).state_dict())
    assert lazy.num_features == 0
    model = nn.Sequential(lazy)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(5, 3, generator=gen, dtype=torch.float64) * 2 + 1 for _ in range(3)]
    assert syncbn.precise_bn(model, batches, num_batches=3, progress=False) == 3
    mean, var = population(batches)
    # float64 sums of 15 values: rounding ~1e-15 relative; 1e-12 leaves room
    torch.testing.assert_close(model[0].running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[0].running_var, var, rtol=1e-12, atol=1e-12)


class KeywordCall(nn.Module):
    """Calls its batch norm with the input by keyword, ``bn(input=x)`` (torch's name)."""

    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def forward(self, x):
        return self.bn(input=x)


@pytest.mark.parametrize("layer", ["BatchNorm1d", "SyncBatchNorm", "SyncBatchNormAct"])
def test_a_layer_called_with_its_input_by_keyword(layer):
    """The recording hook takes the input given as ``input=`` too (it raised IndexError on
    the empty positional arguments), and the layer gets its population statistics."""
    bn = {"BatchNorm1d": lambda: nn.BatchNorm1d(3, dtype=torch.float64),
          "SyncBatchNorm": lambda: syncbn.SyncBatchNorm(3, dtype=torch.float64),
          "SyncBatchNormAct": lambda: syncbn.SyncBatchNormAct(3, dtype=torch.float64)}[layer]()
    model = KeywordCall(bn)
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(6, 3, generator=gen, dtype=torch.float64) * 3 - 2 for _ in range(3)]
    assert syncbn.precise_bn(model, batches, num_batches=3, progress=False) == 3
    mean, var = population(batches)
    # float64 sums of 18 values: rounding ~1e-15 relative; 1e-12 leaves room
    torch.testing.assert_close(bn.running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, var, rtol=1e-12, atol=1e-12)
