"""``syncbn.torch.lightning.SyncBatchNorm``: a Lightning ``LayerSync`` plugin. On the pool's 4
gloo ranks (CPU), ``Trainer(strategy=DDP, plugins=[SyncBatchNorm()])`` trains exactly like
one process on the concatenated batch, and the model comes back with plain BatchNorm
layers after ``fit``; ``import syncbn`` does not import Lightning."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import torchvision_shim

torchvision_shim.install()  # Lightning imports torchvision when it is installed
pytest.importorskip("lightning")

WORLD, PER_RANK, STEPS, LR = 4, 2, 2, 0.1


def net():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    ).double()


def data(step):
    gen = torch.Generator().manual_seed(11 + step)
    x = torch.randn(WORLD * PER_RANK, 3, 5, 5, generator=gen, dtype=torch.float64) * 2 + 0.5
    g = torch.randn(WORLD * PER_RANK, 3, generator=gen, dtype=torch.float64)
    return x, g


def lightning_job():
    import lightning.pytorch as L
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    import syncbn.torch.lightning

    class PoolEnvironment(ClusterEnvironment):
        """The pool's process group is already up: Lightning joins it."""

        creates_processes_externally = True
        main_address, main_port = "127.0.0.1", 0

        @staticmethod
        def detect():
            return True

        def world_size(self):
            return dist.get_world_size()

        def set_world_size(self, size):
            pass

        def global_rank(self):
            return dist.get_rank()

        def set_global_rank(self, rank):
            pass

        def local_rank(self):
            return dist.get_rank()

        def node_rank(self):
            return 0

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, index):
            x, g = batch
            return (self.net(x) * g).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    rank = dist.get_rank()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    batches = [tuple(t[rows] for t in data(step)) for step in range(STEPS)]
    module = Module()
    kinds = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, index):
            kinds.append(sorted({type(m).__name__ for m in pl_module.modules() if "BatchNorm" in type(m).__name__}))

    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=DDPStrategy(cluster_environment=PoolEnvironment(), process_group_backend="gloo"),
        plugins=[syncbn.torch.lightning.SyncBatchNorm()], callbacks=[Watch()],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    after = sorted({type(m).__name__ for m in module.modules() if "BatchNorm" in type(m).__name__})
    return {"state": {k: v.detach().clone() for k, v in module.net.state_dict().items()}, "during": kinds, "after": after}


def test_trainer_with_the_plugin_equals_one_big_batch(pool):
    results = pool.run(lightning_job, timeout=300)
    assert results[0]["during"] == [["SyncBatchNorm"]] * STEPS
    assert results[0]["after"] == ["BatchNorm2d"]  # reverted at the end of fit
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, g = data(step)
        opt.zero_grad()
        ((model(x) * g).sum() / WORLD).backward()  # DDP averages the ranks' gradients
        opt.step()
    for key, ref in model.state_dict().items():
        for r in results:
            # float64, 2 steps of a 9-layer net: rounding differences of a few ulp, amplified
            # by at most the 1/std factors of 2 BN layers
            torch.testing.assert_close(r["state"][key], ref, rtol=1e-10, atol=1e-12, msg=key)


def test_import_syncbn_does_not_import_lightning():
    code = "import sys, syncbn; syncbn.convert_sync_batchnorm; print('lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_revert_undoes_only_what_apply_did():
    """The plugin's ``revert`` (run at the end of every ``fit``) gives back the layers its
    ``apply`` converted, and leaves the synchronized layers the model was built with as
    they were: their class, process group, fusion and ``state_dict`` keys (a checkpoint
    saved during ``fit`` loads after it; a second ``fit`` syncs over the same group)."""
    import syncbn
    import syncbn.torch.lightning

    group = object()  # a stand-in for the model's own process group: nothing here communicates
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU(0.1),  # fused below, before fit
        nn.BatchNorm2d(4),  # plain: apply converts it
        syncbn.SyncBatchNorm(4, process_group=group),  # built synchronized, on its own group
        syncbn.SyncBatchNormAct(4, activation="elu", activation_param=1.0),  # built fused
    )
    syncbn.fuse_batchnorm_act(model)
    before = dict(model.named_children())
    keys = list(model.state_dict())
    plugin = syncbn.torch.lightning.SyncBatchNorm()
    for _ in range(2):  # two fits
        model = plugin.apply(model)
        assert type(model[3]) is syncbn.SyncBatchNorm
        model = plugin.revert(model)
        assert type(model[3]) is nn.BatchNorm2d
        for i in (1, 2, 4, 5):
            assert model[i] is before[str(i)], i
        assert model[4].process_group is group
        assert list(model.state_dict()) == keys


def test_revert_without_apply_changes_nothing():
    """Lightning's teardown calls ``revert`` after every ``fit``, also one that failed
    before the plugin's ``apply`` ran (the module's ``setup`` hook raised, say): then
    nothing was converted and nothing goes back. ``revert`` took every syncbn layer of
    the model for the plugin's work there and turned the model's own synchronized layers
    into plain ones; likewise a second ``revert`` after one ``apply``."""
    import syncbn
    import syncbn.torch.lightning

    model = nn.Sequential(nn.Conv2d(3, 4, 1), syncbn.SyncBatchNorm(4), nn.BatchNorm2d(4))
    own = model[1]
    plugin = syncbn.torch.lightning.SyncBatchNorm()
    assert plugin.revert(model) is model  # a fit that failed before apply
    assert model[1] is own and type(model[2]) is nn.BatchNorm2d
    model = plugin.revert(plugin.apply(model))  # a fit that ran
    assert model[1] is own and type(model[2]) is nn.BatchNorm2d
    model[2] = syncbn.convert_sync_batchnorm(model[2])  # the user's own conversion, after fit
    converted = model[2]
    assert plugin.revert(model) is model  # nothing applied since the last revert
    assert model[1] is own and model[2] is converted
