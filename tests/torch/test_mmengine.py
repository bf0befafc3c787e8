"""OpenMMLab under ``syncbn.torch.mmengine``: mmsegmentation's own model configs with
``norm_cfg=dict(type='SyncBN')`` build syncbn's layer, with the state_dict keys of the
same model built with ``type='BN'``, and run on the CPU; mmengine's
``convert_sync_batchnorm`` (what a runner with ``sync_bn='torch'`` calls) refuses a model
that syncbn already synchronizes, changing nothing.

mmcv-lite has no compiled ops (``mmcv.ops``), and mmsegmentation 1.2.2 imports a few of
them when ``mmseg.models`` is imported (``point_sample``, ``sigmoid_focal_loss``, ...),
though the models built here (UNet + FCN head, ResNetV1c + UPerNet) call none
(``tests/mmcv_shim.py`` stands in for them).
"""

import os
import sys

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

import mmcv_shim
import syncbn
import torchvision_shim

torchvision_shim.install()  # mmseg imports timm, which imports torchvision
pytest.importorskip("mmengine")
pytest.importorskip("mmcv")
mmcv_shim.install()
pytest.importorskip("mmseg")

import mmengine.model  # noqa: E402
from mmcv.cnn import build_norm_layer  # noqa: E402
from mmengine.config import Config  # noqa: E402
from mmengine.registry import MODELS as ROOT  # noqa: E402

import syncbn.torch.mmengine as sm  # noqa: E402 - registers

import mmseg  # noqa: E402
from mmseg.registry import MODELS  # noqa: E402
from mmseg.utils import register_all_modules  # noqa: E402

register_all_modules()
pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = os.path.join(os.path.dirname(mmseg.__file__), ".mim", "configs", "_base_", "models")
# mmseg's config -> (number of BN layers, output channels, output size for a 64x64 input)
MMSEG = {"fcn_unet_s5-d16.py": (24, 2, 64), "upernet_r50.py": (68, 19, 16)}


def _norm_type(cfg, new):
    """``cfg`` with every ``type='SyncBN'`` replaced by ``new``."""
    if isinstance(cfg, dict):
        return {k: new if k == "type" and v == "SyncBN" else _norm_type(v, new) for k, v in cfg.items()}
    if isinstance(cfg, list):
        return [_norm_type(v, new) for v in cfg]
    return cfg


def _config(name):
    cfg = Config.fromfile(os.path.join(CONFIGS, name)).model.to_dict()
    cfg["pretrained"] = None  # random init, nothing downloaded (build never loads weights anyway)
    assert cfg["backbone"]["norm_cfg"] == dict(type="SyncBN", requires_grad=True)
    return cfg


def _bn(model):
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def test_names_build_syncbn_with_the_config_layer_names():
    for name in ("SyncBN", "SyncBatchNorm"):
        assert ROOT.get(name) is syncbn.SyncBatchNorm and MODELS.get(name) is syncbn.SyncBatchNorm
        layer_name, layer = build_norm_layer(dict(type=name, requires_grad=False), 8, postfix=1)
        assert layer_name == "bn1" and type(layer) is syncbn.SyncBatchNorm and layer.num_features == 8
        assert not any(p.requires_grad for p in layer.parameters())
    assert ROOT.get("BN") is nn.BatchNorm2d  # plain BN stays torch's
    if "MMSyncBN" in ROOT.module_dict:  # full mmcv only: builds syncbn's layer from mmcv's arguments
        assert ROOT.get("MMSyncBN") is sm.MMSyncBN
    # idempotent: registering again wraps mmengine's converter no second time
    guarded = mmengine.model.convert_sync_batchnorm
    sm.register()
    assert mmengine.model.convert_sync_batchnorm is guarded and mmengine.model.utils.convert_sync_batchnorm is guarded
    assert ROOT.get("SyncBN") is syncbn.SyncBatchNorm


class _MmcvLayer(nn.Module):
    """Stands in for mmcv's compiled ``mmcv.ops.SyncBatchNorm`` (not in mmcv-lite) in the
    registry, as ``import mmcv.ops`` would have registered it."""


@pytest.fixture
def mmcv_registered():
    """``"MMSyncBN"`` in mmengine's ``MODELS`` as full mmcv registers it, then
    ``register()`` run again (as ``import syncbn.torch.mmengine`` after ``mmcv.ops``);
    taken out again afterwards where the test put it there."""
    ours = "MMSyncBN" not in ROOT.module_dict
    if ours:
        ROOT.register_module(name="MMSyncBN", module=_MmcvLayer)
    sm.register()
    try:
        yield
    finally:
        if ours:
            ROOT.module_dict.pop("MMSyncBN")


class _Group:
    """A stand-in process group: the layers only store it until a training forward."""


def test_mmsyncbn_config_with_mmcv_arguments_builds_syncbn(mmcv_registered):
    group = _Group()
    # mmcv's keywords: group (its process group) and stats_mode='N' (count-weighted, exact)
    cfg = dict(type="MMSyncBN", requires_grad=False, group=group, stats_mode="N", eps=1e-3, momentum=0.01)
    name, layer = build_norm_layer(cfg, 8, postfix=1)
    assert name == "bn1" and type(layer) is syncbn.SyncBatchNorm and layer.num_features == 8
    assert layer.process_group is group and layer.eps == 1e-3 and layer.momentum == 0.01
    assert not any(p.requires_grad for p in layer.parameters())
    assert list(layer.state_dict()) == list(nn.BatchNorm2d(8).state_dict())
    # left out: group None is the default group (mmcv: the world), statistics exact
    name, layer = build_norm_layer(dict(type="MMSyncBN"), 4, postfix="_x")
    assert name == "bn_x" and type(layer) is syncbn.SyncBatchNorm and layer.process_group is None
    assert layer.eps == 1e-5 and layer.momentum == 0.1  # build_norm_layer's eps, mmcv's momentum
    layer = ROOT.build(dict(type="MMSyncBN", num_features=4, affine=False, track_running_stats=False, momentum=None))
    assert type(layer) is syncbn.SyncBatchNorm and layer.weight is None and layer.running_mean is None
    assert layer.momentum is None
    assert ROOT.get("MMSyncBN") is sm.MMSyncBN
    assert MODELS.get("MMSyncBN") is sm.MMSyncBN  # through mmseg's registry, a child of MODELS


def test_mmsyncbn_refuses_a_stats_mode_syncbn_does_not_compute(mmcv_registered):
    # mmcv's 'default' weights every rank's mean equally: not the union's statistics
    # when batch sizes differ, which is what syncbn computes; asked for by name, refused
    with pytest.raises(ValueError, match=r"stats_mode='default'.*exact statistics of the union.*stats_mode='N'"):
        build_norm_layer(dict(type="MMSyncBN", stats_mode="default"), 4)
    for wrong in ("n", "mean", ""):
        with pytest.raises(ValueError, match=r"stats_mode must be 'N'"):
            build_norm_layer(dict(type="MMSyncBN", stats_mode=wrong), 4)
    # torch's keyword is not mmcv's: refused by both layers alike
    with pytest.raises(TypeError, match="process_group"):
        build_norm_layer(dict(type="MMSyncBN", process_group=_Group()), 4)


@pytest.mark.parametrize("name", ["SyncBN", "SyncBatchNorm"])
def test_torch_syncbn_config_keys_reach_the_layer(name):
    """The keywords a config for ``torch.nn.SyncBatchNorm`` can carry reach syncbn's layer
    (``requires_grad`` is build_norm_layer's own, taken out before the layer is built)."""
    group = _Group()
    cfg = dict(type=name, requires_grad=False, process_group=group, eps=1e-4, momentum=None,
               affine=True, track_running_stats=True, dtype=torch.float64)
    layer_name, layer = build_norm_layer(cfg, 6, postfix=3)
    assert layer_name == "bn3" and type(layer) is syncbn.SyncBatchNorm
    assert layer.process_group is group and layer.eps == 1e-4 and layer.momentum is None
    assert layer.weight.dtype == torch.float64 and not layer.weight.requires_grad
    layer = MODELS.build(dict(type=name, num_features=5, affine=False, track_running_stats=False, process_group=group))
    assert type(layer) is syncbn.SyncBatchNorm and layer.process_group is group
    assert layer.weight is None and layer.running_mean is None
    with pytest.raises(TypeError, match="group"):  # mmcv's keyword is not torch's: refused alike
        build_norm_layer(dict(type=name, group=group), 4)


@pytest.fixture(scope="module")
def built():
    """{config: (model with SyncBN, the same with BN)}, built once."""
    out = {}
    for name in MMSEG:
        cfg = _config(name)
        torch.manual_seed(0)
        synced = MODELS.build(cfg)
        torch.manual_seed(0)
        plain = MODELS.build(_norm_type(cfg, "BN"))
        out[name] = synced, plain
    return out


@pytest.mark.parametrize("name", sorted(MMSEG))
def test_mmseg_config_builds_syncbn(name, built):
    count, classes, size = MMSEG[name]
    synced, plain = built[name]
    layers = _bn(synced)
    assert len(layers) == count and all(type(m) is syncbn.SyncBatchNorm for m in layers)
    assert [type(m) for m in _bn(plain)] == [nn.BatchNorm2d] * count
    assert all(p.requires_grad for m in layers for p in m.parameters())
    assert list(synced.state_dict()) == list(plain.state_dict())  # bn1, norm1, ... as with BN
    # eval on the CPU: the BN model's weights load as they are, and compute the same
    with torch.no_grad():
        for m in layers:  # running statistics away from their defaults
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.uniform_(0.5, 1.5)
    plain.load_state_dict(synced.state_dict())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        out = synced.eval()(x, mode="tensor")
        ref = plain.eval()(x, mode="tensor")
    assert out.shape == (1, classes, size, size)
    torch.testing.assert_close(out, ref)  # float32: the same torch ops, default tolerances


def test_mmengine_converter_refuses_a_syncbn_model(built):
    synced, _ = built["fcn_unet_s5-d16.py"]
    before = list(synced.named_modules())
    keys = list(synced.state_dict())
    for implementation in ("torch", "mmcv"):
        with pytest.raises(RuntimeError, match=r"already synchronized by syncbn; leave sync_bn unset in the runner config"):
            mmengine.model.convert_sync_batchnorm(synced, implementation=implementation)
    after = list(synced.named_modules())
    assert [(n, id(m)) for n, m in after] == [(n, id(m)) for n, m in before]
    assert all(type(m) is syncbn.SyncBatchNorm for m in _bn(synced)) and list(synced.state_dict()) == keys


def test_every_name_of_the_converter_is_guarded_and_still_converts_plain_bn():
    import mmengine._strategy.distributed as strategy
    import mmengine.runner.runner as runner

    for convert in (runner.convert_sync_batchnorm, strategy.convert_sync_batchnorm,
                    mmengine.model.convert_sync_batchnorm, mmengine.model.utils.convert_sync_batchnorm):
        small = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(syncbn.SyncBatchNorm(4)))
        with pytest.raises(RuntimeError, match=r"already synchronized by syncbn.*first '1\.0'"):
            convert(small, "torch")
        assert type(small[1][0]) is syncbn.SyncBatchNorm
        # a model without syncbn layers: mmengine's conversion, unchanged
        plain = convert(nn.Sequential(nn.Conv2d(3, 4, 1), nn.Sequential(nn.BatchNorm2d(4))), "torch")
        assert type(plain[1][0]) is nn.SyncBatchNorm


def test_register_before_mmcv_is_imported():
    """``import syncbn.torch.mmengine`` first, mmcv after: mmcv's own registration of
    ``SyncBN`` must neither fail on a name taken nor take it back."""
    import subprocess

    code = (
        "import syncbn, syncbn.torch.mmengine, mmcv.cnn; "
        "name, layer = mmcv.cnn.build_norm_layer(dict(type='SyncBN'), 4, postfix=2); "
        "assert name == 'bn2' and type(layer) is syncbn.SyncBatchNorm, (name, type(layer))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
