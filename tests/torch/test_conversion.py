"""convert_sync_batchnorm / revert_sync_batchnorm on a torchvision-like model built here."""

import copy
import gc
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import syncbn
from syncbn.torch import BatchNormNd
from verify_models import BasicBlock  # the same torchvision-style block the verify tests use
from torch_compat import torch_batchnorm


def tiny_resnet():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        BasicBlock(8, 8),
        BasicBlock(8, 16, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.BatchNorm1d(16, affine=False),
        nn.Linear(16, 5),
    )


def _randomize_buffers(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.affine:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)


def test_round_trip_keeps_outputs_and_state():
    model = tiny_resnet()
    _randomize_buffers(model)
    x = torch.randn(4, 3, 8, 8) + 1
    model.eval()
    ref_eval = model(x)
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = {id(p) for p in model.parameters()}

    converted = syncbn.convert_sync_batchnorm(model)
    n_sync = sum(isinstance(m, syncbn.SyncBatchNorm) for m in converted.modules())
    assert n_sync == 7
    assert not any(type(m) in (nn.BatchNorm1d, nn.BatchNorm2d) for m in converted.modules())
    assert {id(p) for p in converted.parameters()} == params_before  # optimizers stay valid
    assert not converted.training
    torch.testing.assert_close(converted(x), ref_eval, rtol=0, atol=0)
    assert list(converted.state_dict()) == list(ref_state)

    converted.train()
    train_out = converted(x)
    reference = tiny_resnet()
    reference.load_state_dict(ref_state)
    reference.train()
    torch.testing.assert_close(train_out, reference(x), rtol=0, atol=0)

    reverted = syncbn.revert_sync_batchnorm(converted)
    kinds = [type(m) for m in reverted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert kinds == [nn.BatchNorm2d] * 6 + [nn.BatchNorm1d]
    reverted.eval()
    reference.eval()
    torch.testing.assert_close(reverted(x), reference(x), rtol=0, atol=0)
    for (k1, v1), (k2, v2) in zip(reverted.state_dict().items(), reference.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


def test_keeps_flags_dtype_and_missing_bias():
    model = nn.Sequential(torch_batchnorm(nn.BatchNorm2d, 4, bias=False), nn.BatchNorm3d(2, track_running_stats=False))
    model = model.double()
    model[0].weight.requires_grad_(False)
    model.eval()
    model[1].train()
    out = syncbn.convert_sync_batchnorm(model)
    assert out[0].bias is None and not out[0].weight.requires_grad
    assert out[0].weight.dtype == torch.float64 and out[0].running_mean.dtype == torch.float64
    assert not out[0].training and out[1].training
    assert out[1].running_mean is None and not out[1].track_running_stats
    back = syncbn.revert_sync_batchnorm(out)
    assert type(back[0]) is nn.BatchNorm2d and type(back[1]) is nn.BatchNorm3d
    assert back[0].bias is None and list(back[0].state_dict()) == list(torch_batchnorm(nn.BatchNorm2d, 4, bias=False).state_dict())


def test_top_level_and_torch_syncbn_are_converted():
    bn = nn.BatchNorm1d(3)
    assert isinstance(syncbn.convert_sync_batchnorm(bn), syncbn.SyncBatchNorm)
    torch_sync = nn.SyncBatchNorm(3, momentum=0.3, eps=1e-3)
    ours = syncbn.convert_sync_batchnorm(torch_sync)
    assert isinstance(ours, syncbn.SyncBatchNorm) and ours.momentum == 0.3 and ours.eps == 1e-3
    assert type(syncbn.revert_sync_batchnorm(ours)) is BatchNormNd  # takes any rank, as it did


class BatchNormAct(nn.BatchNorm2d):
    """Like timm's BatchNormAct2d: BN followed by an activation in the same module."""

    def forward(self, x):
        return F.relu(super().forward(x))


class PlainSubclass(nn.BatchNorm2d):
    pass


def test_subclass_overriding_forward_is_left_with_a_warning():
    model = nn.Sequential(BatchNormAct(4), PlainSubclass(4), BatchNormAct(4), nn.BatchNorm1d(4))
    with pytest.warns(UserWarning, match=r"left 2 of 4 BatchNorm layers local .*2 x test_conversion\.BatchNormAct "):
        out = syncbn.convert_sync_batchnorm(model)
    assert type(out[0]) is BatchNormAct and type(out[2]) is BatchNormAct
    assert isinstance(out[1], syncbn.SyncBatchNorm)
    assert type(syncbn.revert_sync_batchnorm(out)[1]) is PlainSubclass


def test_strict_raises_before_changing_anything():
    model = nn.Sequential(nn.BatchNorm2d(4), BatchNormAct(4))
    with pytest.raises(ValueError, match=r"left 1 of 2 BatchNorm layers local"):
        syncbn.convert_sync_batchnorm(model, strict=True)
    assert type(model[0]) is nn.BatchNorm2d  # untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), strict=True)
    assert isinstance(out[0], syncbn.SyncBatchNorm)


def test_a_batch_norm_in_two_places_stays_one_layer():
    """A layer registered under two parents is converted (and reverted) once: both places
    hold the same module, with one set of parameters and running buffers."""
    bn = nn.BatchNorm2d(4)
    model = nn.ModuleDict({"a": nn.Sequential(bn, nn.ReLU()), "b": nn.Sequential(nn.Conv2d(4, 4, 1), bn)})
    out = syncbn.convert_sync_batchnorm(model)
    assert isinstance(out.a[0], syncbn.SyncBatchNorm) and out.a[0] is out.b[1]
    out.double()  # the moves that split a copied layer's tensors
    out.b(out.a(torch.randn(2, 4, 3, 3, dtype=torch.float64)))
    assert out.a[0].running_mean is out.b[1].running_mean and int(out.a[0].num_batches_tracked) == 2
    back = syncbn.revert_sync_batchnorm(out)
    assert type(back.a[0]) is nn.BatchNorm2d and back.a[0] is back.b[1]


def test_a_scripted_batch_norm_is_named_as_left_local():
    """TorchScript code cannot be rewired: its batch norms are counted as left local (a
    warning, or strict's error), never passed over in silence."""
    scripted = torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)))
    with pytest.warns(UserWarning, match=r"left 1 of 1 BatchNorm layers local .*TorchScript"):
        syncbn.convert_sync_batchnorm(scripted)
    model = nn.Sequential(nn.BatchNorm2d(3), scripted)
    with pytest.raises(ValueError, match=r"left 1 of 2 BatchNorm layers local .*convert the model before"):
        syncbn.convert_sync_batchnorm(model, strict=True)
    assert type(model[0]) is nn.BatchNorm2d  # untouched


class SyncBatchNormRelu(syncbn.SyncBatchNorm):
    def forward(self, x):
        return F.relu(super().forward(x))


def test_registered_conversion_round_trip():
    from syncbn.torch.conversion import _CONVERSIONS, _move_state

    def to_sync(layer, group):
        new = SyncBatchNormRelu(layer.num_features, process_group=group, device="meta")
        return _move_state(layer, new)

    def to_plain(layer):
        return _move_state(layer, BatchNormAct(layer.num_features, device="meta"))

    syncbn.register_conversion(BatchNormAct, to_sync, to_plain)
    try:
        model = nn.Sequential(BatchNormAct(3), nn.Sequential(BatchNormAct(3)), PlainSubclass(3))
        _randomize_buffers(model)
        x = torch.randn(4, 3, 2, 2)
        expected = model.eval()(x)
        params = [id(p) for p in model.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = syncbn.convert_sync_batchnorm(model, strict=True)
        assert [type(m) for m in (out[0], out[1][0], out[2])] == [SyncBatchNormRelu, SyncBatchNormRelu, syncbn.SyncBatchNorm]
        assert out[0]._syncbn_origin is BatchNormAct
        torch.testing.assert_close(out(x), expected, rtol=0, atol=0)
        back = syncbn.revert_sync_batchnorm(out)
        assert [type(m) for m in (back[0], back[1][0], back[2])] == [BatchNormAct, BatchNormAct, PlainSubclass]
        assert [id(p) for p in back.parameters()] == params
        torch.testing.assert_close(back(x), expected, rtol=0, atol=0)
    finally:
        del _CONVERSIONS[BatchNormAct]
    with pytest.raises(TypeError):
        syncbn.register_conversion(object, to_sync, to_plain)
    with pytest.raises(TypeError):
        syncbn.register_conversion(BatchNormAct, to_sync, None)


def test_revert_keeps_an_unregistered_subclass_that_overrides_forward():
    layer = nn.Sequential(SyncBatchNormRelu(3))
    with pytest.warns(UserWarning, match=r"0 \(its class SyncBatchNormRelu overrides forward"):
        assert type(syncbn.revert_sync_batchnorm(layer)[0]) is SyncBatchNormRelu


class SquareOnlyBatchNorm(nn.BatchNorm2d):
    """A user's plain subclass: its own ``__init__`` (an extra argument kept as an attribute),
    an input check stricter than torch's (square images only) and its own ``extra_repr``."""

    def __init__(self, num_features, site="stem", **kwargs):
        super().__init__(num_features, **kwargs)
        self.site = site

    def _check_input_dim(self, input):
        if input.dim() != 4 or input.shape[-1] != input.shape[-2]:
            raise ValueError("SquareOnlyBatchNorm takes square images only")

    def extra_repr(self):
        return super().extra_repr() + f", site={self.site}"


class AnyRankNorm(nn.modules.batchnorm._BatchNorm):
    """Written here after the pattern of mmengine's ``_BatchNormXd``: torch's forward on any
    rank, straight under ``_BatchNorm`` (no BatchNorm1d/2d/3d in its bases)."""

    def _check_input_dim(self, input):
        return


def _quiet_round_trip(model):
    """Convert (``strict=True``) and revert the Sequential ``model``, neither of them warning;
    returns the classes of the converted model's layers, and the reverted model."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synced = syncbn.convert_sync_batchnorm(model, strict=True)
        kinds = [type(m) for m in synced]  # before revert, which works in place
        return kinds, syncbn.revert_sync_batchnorm(synced)


def test_a_plain_subclass_comes_back_as_its_own_class():
    """Convert then revert gives back the user's class itself, with its attribute, its input
    check (rejecting what it rejected before), its repr, the same tensors and state_dict, and
    bitwise the outputs it computed, in eval and in training. It came back as
    nn.BatchNorm2d: ``site`` was still there, but the check and repr were torch's."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), SquareOnlyBatchNorm(4, site="head", eps=1e-3), nn.ReLU())
    _randomize_buffers(model)
    x, oblong = torch.randn(2, 3, 5, 5) + 1, torch.randn(2, 3, 5, 4)
    reference = copy.deepcopy(model)
    with pytest.raises(ValueError, match="square images only"):
        model(oblong)
    expected_repr, before = repr(model), {k: v.clone() for k, v in model.state_dict().items()}
    tensors = dict(model.state_dict(keep_vars=True))
    kinds, back = _quiet_round_trip(model)
    assert kinds[1] is syncbn.SyncBatchNorm
    layer = back[1]
    assert type(layer) is SquareOnlyBatchNorm and layer.site == "head" and layer.eps == 1e-3
    assert "_syncbn_origin" not in layer.__dict__
    assert repr(back) == expected_repr
    assert list(back.state_dict()) == list(before)
    for key, value in back.state_dict(keep_vars=True).items():
        assert value is tensors[key] and torch.equal(value, before[key]), key
    with pytest.raises(ValueError, match="square images only"):
        back(oblong)
    for mode in ("eval", "train"):  # the same kernel: equal bit for bit, running buffers too
        getattr(back, mode)()
        getattr(reference, mode)()
        torch.testing.assert_close(back(x), reference(x), rtol=0, atol=0)
    for (key, ours), theirs in zip(back.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(ours, theirs), key
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript; it still runs
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(back.eval())  # scripts as the user's own layer does
    torch.testing.assert_close(scripted(x), reference.eval()(x), rtol=0, atol=0)


def test_a_plain_subclass_comes_back_as_itself_after_fusion():
    """fuse_batchnorm_act then revert: the batch norm is the user's class again, the
    activation the user's module object. It came back as nn.BatchNorm2d."""
    model = _seeded(_stem())
    model[1] = _seeded(nn.Sequential(SquareOnlyBatchNorm(4, site="fused")))[0]
    activation = model[2]
    ref = _fuse_expecting(model, {})
    assert _fused_names(model) == ["1"]
    back = syncbn.revert_sync_batchnorm(model)
    assert type(back[1]) is SquareOnlyBatchNorm and back[1].site == "fused" and back[2] is activation
    back.double()
    torch.testing.assert_close(back(_image(0).double()), ref(_image(0).double()), rtol=0, atol=0)


def test_an_any_rank_batch_norm_comes_back_as_itself():
    """A ``_BatchNorm`` subclass of no rank comes back as itself, taking every rank it took.
    It came back as syncbn.BatchNormNd."""
    model = nn.Sequential(AnyRankNorm(3, momentum=0.3))
    _randomize_buffers(model)
    reference = copy.deepcopy(model)
    _, back = _quiet_round_trip(model)
    assert type(back[0]) is AnyRankNorm and back[0].momentum == 0.3
    for shape in [(4, 3), (4, 3, 5), (2, 3, 2, 2, 3)]:
        x = torch.randn(shape) + 1
        torch.testing.assert_close(back(x), reference(x), rtol=0, atol=0)
    torch.testing.assert_close(back[0].running_mean, reference[0].running_mean, rtol=0, atol=0)


class TorchSyncSubclass(nn.SyncBatchNorm):
    def __init__(self, num_features, **kwargs):
        super().__init__(num_features, **kwargs)
        self.kind = "sync"


@pytest.mark.parametrize("cls", [nn.SyncBatchNorm, TorchSyncSubclass, syncbn.SyncBatchNorm])
def test_a_synchronizing_origin_still_reverts_to_batchnormnd(cls):
    """Revert never gives back a layer that synchronizes: torch's SyncBatchNorm (and a
    subclass of it) and a syncbn SyncBatchNorm built directly become BatchNormNd, as before."""
    _, back = _quiet_round_trip(nn.Sequential(cls(3)))
    assert type(back[0]) is BatchNormNd
    assert back[0].__dict__.get("kind") == ("sync" if cls is TorchSyncSubclass else None)  # attributes travel


def test_a_local_subclass_round_trips_and_one_changed_since_falls_back_with_a_warning():
    """A class defined in a function comes back as itself. One whose class was given a
    ``forward`` after the conversion is no plain batch norm any more: an instance of it made
    of the converted layer's state would not be the layer that was converted, so it comes back
    as its torch base, with a warning naming the class and why."""
    class Local(nn.BatchNorm2d):
        pass

    _, back = _quiet_round_trip(nn.Sequential(Local(3)))
    assert type(back[0]) is Local
    synced = syncbn.convert_sync_batchnorm(nn.Sequential(Local(3)), strict=True)
    Local.forward = lambda self, x: nn.BatchNorm2d.forward(self, x) * 2
    with pytest.warns(UserWarning, match=r"not the class they were converted from: 1 x .*Local as BatchNorm2d "
                                         r"\(its class overrides forward"):
        back = syncbn.revert_sync_batchnorm(synced)
    assert type(back[0]) is nn.BatchNorm2d


class SlottedBatchNorm(nn.BatchNorm2d):
    __slots__ = ("note",)


def test_a_subclass_with_slots_falls_back_with_a_warning():
    """``__slots__`` change the instance layout (and conversion carries only the instance
    dictionary): such a class is not given back, but named in a warning. Conversion keeps
    such layers local now; a layer recorded as converted from one (by an earlier syncbn)
    still reverts."""
    synced = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), strict=True)
    synced[0]._syncbn_origin = SlottedBatchNorm
    with pytest.warns(UserWarning, match=r"1 x .*SlottedBatchNorm as BatchNorm2d \(SlottedBatchNorm declares __slots__"):
        back = syncbn.revert_sync_batchnorm(synced)
    assert type(back[0]) is nn.BatchNorm2d


def test_a_subclass_with_slots_stays_local_and_is_not_fused():
    """Conversion moves the instance ``__dict__``; a slot's value lives outside it, so a
    synchronized layer would come without it (and revert would not bring it back). The
    layer stays as it is, named with the fix; strict raises before anything changes; fusion
    leaves the pair alone likewise."""
    model = nn.Sequential(nn.BatchNorm2d(3), SlottedBatchNorm(3))
    model[1].note = "kept"
    fix = r"SlottedBatchNorm declares __slots__, whose values conversion cannot carry .*drop __slots__"
    with pytest.raises(ValueError, match=r"left 1 of 2 BatchNorm layers local .*1 x test_conversion\.SlottedBatch"
                                         r"Norm \(" + fix + ", or teach the converter with syncbn.register_conv"):
        syncbn.convert_sync_batchnorm(model, strict=True)
    assert type(model[0]) is nn.BatchNorm2d  # nothing changed
    with pytest.warns(UserWarning, match=r"left 1 of 2 BatchNorm layers local .*" + fix):
        out = syncbn.convert_sync_batchnorm(model)
    assert isinstance(out[0], syncbn.SyncBatchNorm)
    assert type(out[1]) is SlottedBatchNorm and out[1].note == "kept"
    pair = nn.Sequential(nn.Conv2d(3, 3, 1), SlottedBatchNorm(3), nn.LeakyReLU(0.1))
    with pytest.warns(UserWarning, match=r"left these batch norms unfused: 1 \(" + fix):
        fused = syncbn.fuse_batchnorm_act(pair)
    assert type(fused[1]) is SlottedBatchNorm and type(fused[2]) is nn.LeakyReLU


class _Carrying(nn.BatchNorm2d):
    """A plain batch norm whose ``__init__`` sets one attribute named like one of syncbn's."""

    def __init__(self, num_features, name, value):
        super().__init__(num_features)
        setattr(self, name, value)


@pytest.mark.parametrize("name", ["inplace", "activation", "activation_param", "process_group"])
def test_an_attribute_named_like_syncbns_own_keeps_the_layer_local(name):
    """syncbn's layers set ``process_group``, ``activation``, ``activation_param`` and
    ``inplace`` themselves; a user's attribute of that name on a plain batch norm used to be
    dropped at conversion (the converted layer held syncbn's value, or none, and revert gave
    the layer back without it). It stays local now, named with the fix, and is not fused."""
    value = object()  # no value syncbn would set
    model = nn.Sequential(nn.BatchNorm2d(3), _Carrying(3, name, value))
    fix = rf"1: its attribute {name} would be lost: syncbn's layers set this name themselves.*rename it"
    with pytest.raises(ValueError, match=r"left 1 of 2 BatchNorm layers local .*test_conversion\._Carrying \(" + fix):
        syncbn.convert_sync_batchnorm(model, strict=True)
    assert type(model[0]) is nn.BatchNorm2d  # nothing changed
    with pytest.warns(UserWarning, match=r"left 1 of 2 BatchNorm layers local .*" + fix):
        out = syncbn.convert_sync_batchnorm(model)
    assert isinstance(out[0], syncbn.SyncBatchNorm)
    assert type(out[1]) is _Carrying and getattr(out[1], name) is value
    back = syncbn.revert_sync_batchnorm(out)
    assert type(back[1]) is _Carrying and getattr(back[1], name) is value
    pair = nn.Sequential(nn.Conv2d(3, 3, 1), _Carrying(3, name, value), nn.LeakyReLU(0.1))
    with pytest.warns(UserWarning, match=rf"left these batch norms unfused: 1 \(its attribute {name} would be lost"):
        fused = syncbn.fuse_batchnorm_act(pair)
    assert type(fused[1]) is _Carrying and getattr(fused[1], name) is value


def test_the_attributes_a_batchnorm_sets_itself_still_convert():
    """Not refused: ``process_group`` on torch's SyncBatchNorm (its own, taken over) and on
    a syncbn layer fused or converted again, and a lazy layer's own attributes."""
    lazy = nn.LazyBatchNorm2d()
    lazy(torch.randn(2, 3, 2, 2))
    model = nn.Sequential(nn.SyncBatchNorm(3), TorchSyncSubclass(3), syncbn.SyncBatchNorm(3), lazy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synced = syncbn.convert_sync_batchnorm(model, strict=True)
        assert all(isinstance(m, syncbn.SyncBatchNorm) for m in synced)
        again = syncbn.convert_sync_batchnorm(syncbn.revert_sync_batchnorm(synced), strict=True)
        assert all(isinstance(m, syncbn.SyncBatchNorm) for m in again)
        fused = syncbn.fuse_batchnorm_act(nn.Sequential(nn.Conv2d(3, 3, 1), syncbn.SyncBatchNorm(3), nn.ELU()))
        assert isinstance(fused[1], syncbn.SyncBatchNormAct)
        back = syncbn.revert_sync_batchnorm(fused)
        assert "activation" not in back[1].__dict__ and "inplace" not in back[1].__dict__
        assert isinstance(syncbn.convert_sync_batchnorm(back, strict=True)[1], syncbn.SyncBatchNorm)


class _SyncCarrying(syncbn.SyncBatchNorm):
    """A user's synchronized layer (forward unchanged) whose ``__init__`` sets one attribute
    named like one that syncbn's other layers set themselves."""

    def __init__(self, num_features, name, value):
        super().__init__(num_features)
        setattr(self, name, value)


class _SlottedSync(syncbn.SyncBatchNorm):
    __slots__ = ("note",)


class _SlottedSyncAct(syncbn.SyncBatchNormAct):
    __slots__ = ("note",)


def _revert_expecting(model, reason, layer="0"):
    """Revert ``model``, whose ``layer`` must be left as it is with ``reason`` in the warning."""
    with pytest.warns(UserWarning, match=rf"revert_sync_batchnorm left these layers as they are: {layer} \(" + reason):
        return syncbn.revert_sync_batchnorm(model)


@pytest.mark.parametrize("name", ["inplace", "activation", "activation_param"])
def test_revert_leaves_a_synchronized_layer_whose_attribute_the_plain_layer_would_drop(name):
    """A ``SyncBatchNorm`` subclass (built so, or a converted layer given the attribute
    later) holding ``inplace``, ``activation`` or ``activation_param``, names only
    ``SyncBatchNormAct`` sets itself: revert moved every other attribute to the plain layer
    and these not, without a word. It stays synchronized now, its value on it, named with
    the fix; the layers beside it still revert."""
    value = object()
    model = nn.Sequential(_SyncCarrying(3, name, value), syncbn.SyncBatchNorm(3))
    back = _revert_expecting(model, rf"its attribute {name} would be lost: syncbn's layers set this name "
                                    r"themselves, with their own meaning; rename it\)")
    assert type(back[0]) is _SyncCarrying and back[0].__dict__[name] is value
    assert type(back[1]) is BatchNormNd
    converted = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(3)), strict=True)
    setattr(converted[0], name, value)
    back = _revert_expecting(converted, rf"its attribute {name} would be lost: .*rename it, or revert it through a "
                                        r"conversion registered for BatchNorm2d \(syncbn.register_conversion\) whose "
                                        r"to_plain carries it\)")
    assert type(back[0]) is syncbn.SyncBatchNorm and back[0].__dict__[name] is value


@pytest.mark.parametrize("cls", [_SlottedSync, _SlottedSyncAct])
def test_revert_leaves_a_synchronized_layer_whose_class_declares_slots(cls):
    """A slot's value lives outside the instance ``__dict__``, which is all revert moves: a
    ``SyncBatchNorm`` or ``SyncBatchNormAct`` subclass declaring ``__slots__`` came back
    plain without it. It stays as it is now, with its value, named with the fix."""
    layer = cls(3, activation="elu") if cls is _SlottedSyncAct else cls(3)
    layer.note = "kept"
    back = _revert_expecting(nn.Sequential(layer), cls.__qualname__ + r" declares __slots__, whose values conversion "
                                                   r"cannot carry \(it moves the instance __dict__\): drop __slots__\)")
    assert back[0] is layer and layer.note == "kept"


class _Doubling:
    """A user's synchronized layer whose own forward adds work."""

    def forward(self, input):
        return super().forward(input) * 2


class _FrozenSynced:
    """A user's synchronized layer kept in eval mode (a frozen layer)."""

    def train(self, mode=True):
        return super().train(False)


class _SlowMomentum:
    """A user's synchronized layer weighting each batch by its own rule in the running
    buffers: ``_momentum`` is syncbn's, not torch's, and both forwards call it."""

    def _momentum(self, as_tensor, count=True):
        super()._momentum(as_tensor, count)  # num_batches_tracked moves as before
        return 0.5 / (1.0 + float(self.num_batches_tracked))


class _DoublingSync(_Doubling, syncbn.SyncBatchNorm):
    pass


class _FrozenSync(_FrozenSynced, syncbn.SyncBatchNorm):
    pass


class _SlowMomentumSync(_SlowMomentum, syncbn.SyncBatchNorm):
    pass


class _DoublingSyncAct(_Doubling, syncbn.SyncBatchNormAct):
    pass


class _FrozenSyncAct(_FrozenSynced, syncbn.SyncBatchNormAct):
    pass


class _SlowMomentumSyncAct(_SlowMomentum, syncbn.SyncBatchNormAct):
    pass


class _NothingOverriddenSync(syncbn.SyncBatchNorm):
    def extra_repr(self):  # harmless: a plain batch norm keeps it too (it is not the class given back)
        return "mine, " + super().extra_repr()

    def __deepcopy__(self, memo):  # harmless: how a copy is made, not what the layer computes
        return super().__deepcopy__(memo)


class _NothingOverriddenSyncAct(syncbn.SyncBatchNormAct):
    """Overrides only what the plain layers do alike: the text, and the question the input
    check asks (the plain batch norm's own check takes every input this one took)."""

    def extra_repr(self):
        return "mine, " + super().extra_repr()

    def _holds_channels(self):
        return super()._holds_channels()


def _leaving(cls, *methods):
    """The reason revert gives for leaving a layer of ``cls``, which overrides ``methods``."""
    base, plain, does = (("SyncBatchNormAct", "a plain batch norm and activation", "do")
                         if issubclass(cls, syncbn.SyncBatchNormAct) else ("SyncBatchNorm", "a plain batch norm", "does"))
    return (rf"its class {cls.__qualname__} overrides {', '.join(methods)}, which {plain} would drop, and revert has "
            rf"no plain class to give back for a class derived from {base}: replace this layer yourself with {plain} "
            rf"that {does} what {cls.__qualname__} adds\)")


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls, method", [
    (_DoublingSync, "forward"), (_FrozenSync, "train"), (_SlowMomentumSync, "_momentum"),
    (_DoublingSyncAct, "forward"), (_FrozenSyncAct, "train"), (_SlowMomentumSyncAct, "_momentum"),
])
def test_revert_warns_about_a_synchronized_subclass_that_overrides_a_method(cls, method, training):
    """A ``SyncBatchNorm`` or ``SyncBatchNormAct`` subclass overriding ``forward`` (or
    ``train``, or syncbn's own ``_momentum``, which both forwards call) with no registered
    conversion has no plain class to go back to, and the plain layers would drop what it
    adds: revert left a ``SyncBatchNorm`` one synchronized without a word, though the user
    asked for a model without synchronization, and split a ``SyncBatchNormAct`` one into
    ``Sequential(BatchNormNd, LeakyReLU)``, dropping what its class adds without a word. It
    stays as it is (the same object, its outputs unchanged), named by its path in the
    warning with the method and the fix, in train and eval mode alike; the layers beside it
    still revert (a model convert has been run on too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sequential(nn.BatchNorm2d(3), cls(3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the subclass is synchronized already: convert says nothing
        model = syncbn.convert_sync_batchnorm(model, strict=True)
    layer = model[1][1]
    _randomize_buffers(model)
    model.train(training)
    x = torch.randn(4, 3, 2, 2)
    expected = model[1][1](model[1][0](model[0](x)))
    back = _revert_expecting(model, _leaving(cls, method), layer=r"1\.1")
    assert back[1][1] is layer and type(layer) is cls
    assert type(back[1][0]) is nn.BatchNorm2d
    torch.testing.assert_close(back(x), expected, rtol=0, atol=0)


def test_revert_of_a_synchronized_subclass_that_overrides_nothing_says_nothing():
    """A ``SyncBatchNorm`` subclass overriding only what a plain batch norm keeps (here
    ``extra_repr``) reverts to a plain layer, as before, without a warning."""
    layer = _NothingOverriddenSync(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = syncbn.revert_sync_batchnorm(nn.Sequential(layer))
    assert type(back[0]) is BatchNormNd and back[0].weight is layer.weight


def test_revert_of_a_fused_subclass_that_overrides_nothing_says_nothing():
    """A ``SyncBatchNormAct`` subclass overriding only what the plain layers do alike
    (``extra_repr``, ``_holds_channels``) splits into a plain batch norm and its
    activation, as before, without a warning."""
    layer = _NothingOverriddenSyncAct(3, activation="elu", activation_param=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = syncbn.revert_sync_batchnorm(nn.Sequential(layer))
    assert [type(m) for m in back[0]] == [BatchNormNd, nn.ELU] and back[0][1].alpha == 0.5
    assert back[0][0].weight is layer.weight


def test_a_fused_layer_left_for_its_class_keeps_its_activation_placeholder():
    """``fuse_batchnorm_act`` builds ``SyncBatchNormAct`` itself, never a subclass; a fused
    layer whose class became an overriding subclass since is left as it is, and so is the
    placeholder in its activation's place (restoring that activation would apply it twice):
    the model computes what it did, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.LeakyReLU(0.1)).eval()
    _randomize_buffers(model)
    fused = syncbn.fuse_batchnorm_act(model)
    assert type(fused[1]) is syncbn.SyncBatchNormAct
    placeholder = fused[2]
    fused[1].__class__ = _DoublingSyncAct
    x = torch.randn(4, 3, 2, 2)
    expected = fused(x)
    back = _revert_expecting(fused, _leaving(_DoublingSyncAct, "forward"), layer="1")
    assert type(back[1]) is _DoublingSyncAct and back[2] is placeholder
    torch.testing.assert_close(back(x), expected, rtol=0, atol=0)


def test_a_kept_synchronized_subclass_is_not_warned_about():
    """The Lightning plugin reverts only what it converted (``_revert``'s ``keep``): a
    subclass overriding ``forward`` that it keeps stays as it is with no warning, and a
    plain batch norm that convert left local (its forward overridden) is nothing to revert."""
    from syncbn.torch.conversion import _revert

    layer = _DoublingSync(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = _revert(nn.Sequential(layer, syncbn.SyncBatchNorm(3)), keep=[layer])
    assert back[0] is layer and type(back[1]) is BatchNormNd
    with pytest.warns(UserWarning, match=r"left 1 of 1 BatchNorm layers local .*it overrides forward"):
        local = syncbn.convert_sync_batchnorm(nn.Sequential(BatchNormAct(3)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(syncbn.revert_sync_batchnorm(local)[0]) is BatchNormAct


@pytest.mark.parametrize("name", ["dump_patches", "_version"])
def test_an_attribute_named_like_a_module_class_attribute_is_not_dropped(name):
    """``_carry`` never moves a name ``nn.Module`` declares on its class (torch's bookkeeping,
    such as ``compile()``'s ``_compiled_call_impl``), so a user's ``_version`` or
    ``dump_patches`` set on the layer was lost by convert, fusion and revert (the new layer
    held torch's class value). Each leaves such a layer as it is now, named with the fix;
    a compiled layer still converts and reverts without a word."""
    value = object()
    reason = rf"its attribute {name} would be lost: torch.nn.Module declares this name on its class, .*rename it"
    model = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3))
    setattr(model[1], name, value)
    with pytest.warns(UserWarning, match=r"left 1 of 2 BatchNorm layers local .*BatchNorm2d \(1: " + reason):
        out = syncbn.convert_sync_batchnorm(model)
    assert isinstance(out[0], syncbn.SyncBatchNorm) and type(out[1]) is nn.BatchNorm2d
    assert out[1].__dict__[name] is value
    pair = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.LeakyReLU(0.1))
    setattr(pair[1], name, value)
    with pytest.warns(UserWarning, match=r"left these batch norms unfused: 1 \(" + reason):
        fused = syncbn.fuse_batchnorm_act(pair)
    assert type(fused[1]) is nn.BatchNorm2d and fused[1].__dict__[name] is value
    for layer in (syncbn.SyncBatchNorm(3), syncbn.SyncBatchNormAct(3, activation="elu")):
        setattr(layer, name, value)
        back = _revert_expecting(nn.Sequential(layer), reason)
        assert back[0] is layer and layer.__dict__[name] is value
    fused = syncbn.fuse_batchnorm_act(_stem())  # a fused layer and its placeholder stay together
    setattr(fused[1], name, value)
    back = _revert_expecting(fused, reason, layer="1")
    assert type(back[1]) is syncbn.SyncBatchNormAct and type(back[2]) is not nn.LeakyReLU
    compiled = nn.Sequential(nn.BatchNorm2d(3))
    compiled[0].compile(backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synced = syncbn.convert_sync_batchnorm(compiled, strict=True)
        assert "_compiled_call_impl" not in synced[0].__dict__
        synced[0].compile(backend="eager")
        assert type(syncbn.revert_sync_batchnorm(synced)[0]) is nn.BatchNorm2d


def test_a_registered_conversion_leaves_a_layer_whose_attribute_its_new_layer_would_not_hold():
    """The converter carries a registered layer's attributes but never one named like
    syncbn's own; a user's ``inplace`` on a layer of a registered class (or on the layer its
    ``to_sync`` made) was lost when the new layer did not hold that name. Such a layer stays
    as it is now (convert: local, ``strict=True`` raises), named with the fix; a name the
    new layer holds is its conversion's to carry."""
    from syncbn.torch.conversion import _CONVERSIONS, _move_state

    def to_sync(layer, group):
        return _move_state(layer, SyncBatchNormRelu(layer.num_features, process_group=group, device="meta"))

    def to_plain(layer):
        return _move_state(layer, BatchNormAct(layer.num_features, device="meta"))

    syncbn.register_conversion(BatchNormAct, to_sync, to_plain)
    try:
        model = nn.Sequential(BatchNormAct(3), BatchNormAct(3))
        model[1].inplace = True
        reason = (r"1: its attribute inplace would be lost: syncbn's layers set this name themselves, with their own "
                  r"meaning; rename it, or have to_sync set the same name on the layer it makes")
        with pytest.raises(ValueError, match=r"left 1 of 2 BatchNorm layers local .*BatchNormAct \(" + reason):
            syncbn.convert_sync_batchnorm(model, strict=True)
        with pytest.warns(UserWarning, match=reason):
            out = syncbn.convert_sync_batchnorm(model)
        assert type(out[0]) is SyncBatchNormRelu and type(out[1]) is BatchNormAct and out[1].inplace is True
        out[0].activation = "mine"
        back = _revert_expecting(out, r"its attribute activation would be lost: .*rename it, or have to_plain set the "
                                      r"same name on the layer it makes\)")
        assert type(back[0]) is SyncBatchNormRelu and back[0].activation == "mine"
        del out[0].activation
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert type(syncbn.revert_sync_batchnorm(out)[0]) is BatchNormAct
    finally:
        del _CONVERSIONS[BatchNormAct]


def test_uninitialized_lazy_batchnorm_is_left_with_a_warning():
    model = nn.Sequential(nn.LazyBatchNorm2d())
    fix = "uninitialized lazy module: run one forward or load a state_dict holding its tensors first"
    with pytest.warns(UserWarning, match=fix):
        syncbn.convert_sync_batchnorm(model)
    with pytest.raises(ValueError, match=fix):
        syncbn.convert_sync_batchnorm(model, strict=True)
    partly = nn.Sequential(nn.LazyBatchNorm2d())  # the running statistics still to come
    partly.load_state_dict({k: v for k, v in _lazy_source(2).state_dict().items() if "running" not in k}, strict=False)
    with pytest.raises(ValueError, match=fix):
        syncbn.convert_sync_batchnorm(partly, strict=True)
    model(torch.randn(2, 3, 4, 4))  # initialized: it is a BatchNorm2d now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = syncbn.convert_sync_batchnorm(model)
    assert isinstance(out[0], syncbn.SyncBatchNorm)


def _lazy_source(rank):
    """A trained-looking batch norm of rank ``rank`` (3 channels), in a Sequential."""
    return _seeded(nn.Sequential(getattr(nn, f"BatchNorm{rank}d")(3)))


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("then", ["nothing", "forward"])
def test_a_lazy_batch_norm_materialized_by_load_state_dict_converts(rank, then):
    """A lazy batch norm whose tensors came from ``load_state_dict`` holds all its state: it
    converts (torch's converter too: to a layer of 0 num_features), with a user's hook,
    computes what it computed and reverts to the torch class its first forward makes of it.
    It was left local as a class overriding ``reset_parameters`` (still lazy until its first
    forward); after a forward (a BatchNorm2d keeping num_features 0) its synchronized layer
    refused every input as having the wrong channel count."""
    lazy = nn.Sequential(getattr(nn, f"LazyBatchNorm{rank}d")())
    lazy.load_state_dict(_lazy_source(rank).state_dict())
    x = torch.randn((4, 3) + (5,) * rank) * 2 + 1
    ref = _lazy_source(rank).eval()
    if then == "forward":
        lazy.eval()(x)
        assert lazy[0].num_features == 0  # torch's doing
    seen = []
    lazy[0].register_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    keys, params = list(lazy.state_dict()), [id(p) for p in lazy.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = syncbn.convert_sync_batchnorm(lazy)
    layer = model[0]
    assert type(layer) is syncbn.SyncBatchNorm and layer.num_features == 3
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert "_initialize_hook" not in layer.__dict__ and len(layer._forward_pre_hooks) == 0
    torch.testing.assert_close(model.eval()(x), ref(x), rtol=0, atol=0)
    assert seen == ["SyncBatchNorm"]
    model.load_state_dict(ref.state_dict())  # no lazy load hook left to run
    back = syncbn.revert_sync_batchnorm(model)
    assert type(back[0]) is getattr(nn, f"BatchNorm{rank}d") and back[0].num_features == 3
    torch.testing.assert_close(back(x), ref(x), rtol=0, atol=0)
    assert seen == ["SyncBatchNorm", f"BatchNorm{rank}d"]


def test_a_lazy_batch_norm_materialized_by_load_state_dict_carries_hooks_and_attributes():
    """As a plain layer does, those hooks that are not in a dictionary holding its own
    shape-inference hooks (which stay with it, see the next two tests)."""
    model = _stem()
    model[1] = nn.LazyBatchNorm2d()
    model.load_state_dict(_seeded(_stem()).state_dict())
    check_hooks_and_attributes_move(model, lambda m: m[1], ("SyncBatchNorm", "BatchNorm2d"), _image,
                                    kinds=("forward", "backward", "state_dict", "load_post"))


def _layer_as_it_is(m):
    """What a module holds: its class, its attributes (the objects), the entries of each
    dictionary among them (hooks, parameters, buffers, children) and its tensors' values."""
    tensors = {name: t.detach().clone() for name, t in [*m._parameters.items(), *m._buffers.items()] if t is not None}
    return type(m), dict(vars(m)), {k: dict(v) for k, v in vars(m).items() if isinstance(v, dict)}, tensors


def _assert_as_it_was(m, before):
    cls, attributes, dictionaries, tensors = _layer_as_it_is(m)
    assert cls is before[0]
    assert attributes.keys() == before[1].keys() and all(attributes[k] is v for k, v in before[1].items())
    assert dictionaries.keys() == before[2].keys()
    for name, entries in before[2].items():
        assert dictionaries[name].keys() == entries.keys(), name
        assert all(dictionaries[name][k] is v for k, v in entries.items()), name
    assert tensors.keys() == before[3].keys() and all(torch.equal(tensors[k], v) for k, v in before[3].items())


@pytest.mark.parametrize("step", ["convert", "fuse"])
def test_converting_a_lazy_batch_norm_leaves_the_layer_the_user_holds_as_it_was(step):
    """The lazy layer (tensors from load_state_dict, no forward yet) that a user still holds
    is neither finished nor unhooked by the conversion: the same class, attributes, hooks
    and values after it; run later, it is still a working lazy layer that its own first
    forward finishes, and the converted layer is not disturbed. The conversion removed its
    shape-inference hooks and gave it its BatchNorm2d class ('BatchNorm2d' is not
    'LazyBatchNorm2d')."""
    model = _seeded(_stem()).eval()
    lazy = _stem()
    lazy[1] = nn.LazyBatchNorm2d()
    lazy.load_state_dict(model.state_dict())
    lazy.eval()
    bn = lazy[1]
    seen = []
    if step == "convert":  # a hook of the user's that moves (a fused layer takes none)
        bn.register_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    before = _layer_as_it_is(bn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if step == "convert":
            converted = syncbn.convert_sync_batchnorm(lazy)
        else:
            converted = syncbn.fuse_batchnorm_act(lazy)
    new = converted[1]
    assert type(new) is (syncbn.SyncBatchNorm if step == "convert" else syncbn.SyncBatchNormAct)
    _assert_as_it_was(bn, before)
    x = _image(0)
    with torch.no_grad():
        expected = model[1](model[0](x))
        torch.testing.assert_close(bn(model[0](x)), expected, rtol=0, atol=0)  # its first forward
        assert type(bn) is nn.BatchNorm2d and "_initialize_hook" not in vars(bn)  # torch's doing
        assert type(new) is not nn.BatchNorm2d and len(new._forward_pre_hooks) == 0
        torch.testing.assert_close(converted(x), model(x), rtol=0, atol=1e-6)
    assert seen == (["BatchNorm2d", "SyncBatchNorm"] if step == "convert" else [])
    back = syncbn.revert_sync_batchnorm(converted)
    assert type(back[1]) is nn.BatchNorm2d


@pytest.mark.parametrize("kind", ["pre_kwargs", "load_pre"])
def test_a_lazy_batch_norm_whose_own_hooks_share_a_dictionary_with_others_stays_local_until_run(kind):
    """A forward-pre or load_state_dict-pre hook lands in the dictionary that holds the lazy
    layer's own shape-inference hook. The converted layer would need that same dictionary
    (the hook's handle holds it) without the lazy hook in it, which only changing the user's
    layer gives: it stays local, with the fix, until one forward has run (torch then
    removes its own hooks). It was converted by taking them out of the user's layer."""
    lazy = nn.Sequential(nn.LazyBatchNorm2d())
    lazy.load_state_dict(_lazy_source(2).state_dict())
    bn = lazy[0]
    seen = []
    handle = _HOOK_KINDS[kind](bn, lambda m, *args: seen.append(type(m).__name__))
    before = _layer_as_it_is(bn)
    fix = r"0: its forward_pre_hooks|0: its load_state_dict_pre_hooks"
    with pytest.raises(ValueError, match=fix):
        syncbn.convert_sync_batchnorm(lazy, strict=True)
    with pytest.warns(UserWarning, match=r"left 1 of 1 .*run one forward before converting"):
        assert syncbn.convert_sync_batchnorm(lazy)[0] is bn
    _assert_as_it_was(bn, before)
    x = torch.randn(4, 3, 2, 2)
    lazy(x)  # the fix
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = syncbn.convert_sync_batchnorm(lazy)
    assert type(model[0]) is syncbn.SyncBatchNorm
    seen.clear()
    model(x)
    model.load_state_dict(model.state_dict())
    assert seen == ["SyncBatchNorm"]
    handle.remove()
    model(x)
    model.load_state_dict(model.state_dict())
    assert seen == ["SyncBatchNorm"]


class _FrozenLazy(nn.LazyBatchNorm2d):
    cls_to_become = None  # set below: _FrozenBN, whose train keeps it in eval mode


def test_a_lazy_batch_norm_becoming_a_class_that_overrides_train_stays_local():
    """Judged by the class its first forward makes of it, as that class itself is."""
    _FrozenLazy.cls_to_become = _FrozenBN
    model = nn.Sequential(_FrozenLazy())
    model.load_state_dict(_lazy_source(2).state_dict())
    with pytest.raises(ValueError, match=r"_FrozenLazy \(it overrides train"):
        syncbn.convert_sync_batchnorm(model, strict=True)


def test_a_lazy_batch_norm_with_nothing_to_materialize_converts_as_torch_runs_it():
    """Without affine parameters or running statistics a lazy batch norm has no state to
    wait for: it converts, and like the BatchNorm2d its first forward makes of it (and
    torch's converter) takes any channel count. It was left local."""
    model = nn.Sequential(nn.LazyBatchNorm2d(affine=False, track_running_stats=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = syncbn.convert_sync_batchnorm(model)
    assert type(model[0]) is syncbn.SyncBatchNorm
    for channels in (3, 5):
        x = torch.randn(4, channels, 2, 2) + 1
        torch.testing.assert_close(model(x), F.batch_norm(x, None, None, training=True), rtol=0, atol=1e-6)


def test_a_lazy_batch_norm_materialized_by_load_state_dict_fuses():
    """Fusion takes it as convert does (it was refused: 'its class overrides reset_parameters')."""
    model = _seeded(_stem())
    lazy = _stem()
    lazy[1] = nn.LazyBatchNorm2d()
    lazy.load_state_dict(model.state_dict())
    ref = _fuse_expecting(lazy, {}, ref=copy.deepcopy(model).double())
    assert _fused_names(lazy) == ["1"]
    _same_as_unfused(lazy, ref, _image)


def test_process_group_is_set():
    marker = object()
    out = syncbn.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(2)), process_group=marker)
    assert out[0].process_group is marker


def test_a_group_given_that_a_layer_synchronized_already_does_not_take_is_named():
    """convert gives a process_group to the layers it converts (torch's SyncBatchNorm
    included), not to syncbn's layers already in the model, which kept their own group
    without a word: a model built with syncbn's layers (an mmseg config's SyncBN) and
    converted with process_group=sync_groups(8) synchronized over the whole world."""
    given, own = object(), object()
    model = nn.Sequential(nn.BatchNorm2d(2), syncbn.SyncBatchNorm(2), nn.SyncBatchNorm(2, process_group=own),
                          syncbn.SyncBatchNorm(2, process_group=given), syncbn.SyncBatchNormAct(2, process_group=own))
    with pytest.warns(UserWarning, match=r"process_group was given, but 2 layer\(s\) synchronized already keep the "
                                         r"group they were built or converted with \('1', '4'\).*"
                                         r"layer\.process_group = process_group"):
        out = syncbn.convert_sync_batchnorm(model, process_group=given)
    assert [m.process_group for m in out] == [given, None, given, given, own]  # kept, as before: named only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: no group given, or every layer on it
        syncbn.convert_sync_batchnorm(model)
        out[1].process_group = out[4].process_group = given
        syncbn.convert_sync_batchnorm(model, process_group=given)


def _groups_named():
    """In a pool worker: the warnings of converting layers on the default group (None) with
    the world group given, and the reverse (one group), then with another group given."""
    import torch.distributed as dist

    from workers import group_of

    said = []
    for built, given in ((None, dist.group.WORLD), (dist.group.WORLD, None), (None, group_of(2))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            syncbn.convert_sync_batchnorm(nn.Sequential(syncbn.SyncBatchNorm(2, process_group=built)),
                                          process_group=given)
        said.append(len([w for w in caught if "process_group was given" in str(w.message)]))
    return said


def test_the_default_group_given_as_none_or_as_the_world_group_is_one_group(pool):
    assert pool.run(_groups_named) == [[0, 0, 1]] * pool.world_size


# ---- issue 13: fusion and conversion that never change what the model computes ----------
# Each model is compared, in training and eval mode, forward and backward, with a float64
# copy of itself left unfused (plain BatchNorm + activation).


def _seeded(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _outputs(o)]


def _same_as_unfused(model, ref64, make_input, steps=2, seed=1):
    """``model`` (maybe fused, float32) and ``ref64`` (its unfused float64 copy) agree on
    every output, the input gradient and every parameter gradient, train and eval."""
    for training in (True, False, True):
        model.train(training)
        ref64.train(training)
        for step in range(steps):
            x0 = make_input(seed + step)
            xs = [x0.clone().requires_grad_(), x0.double().requires_grad_()]
            outs = []
            for m, x in zip((model, ref64), xs):
                torch.manual_seed(seed + step)  # the same dropout masks
                outs.append(_outputs(m(x)))
                sum((o.double() * torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view_as(o)).sum()
                    for o in outs[-1]).backward()
            for a, b in zip(*outs):
                torch.testing.assert_close(a.detach().double(), b.detach(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(xs[0].grad.double(), xs[1].grad, rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), ref64.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-4, msg=name)
    for (name, b), c in zip(model.named_buffers(), ref64.buffers()):
        torch.testing.assert_close(b.double(), c.double(), rtol=1e-5, atol=1e-5, msg=name)


def _image(seed):
    return torch.randn(3, 4, 5, 5, generator=torch.Generator().manual_seed(seed)) + 0.5


def _stem():
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LeakyReLU(0.1), nn.Conv2d(4, 4, 1))


def _fuse_expecting(model, skipped, ref=None):
    """Fuse; every name in ``skipped`` must be in the warning, with its reason. Returns
    the unfused float64 reference (a copy of ``model`` unless given)."""
    ref = copy.deepcopy(model).double() if ref is None else ref
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        syncbn.fuse_batchnorm_act(model)
    text = " ".join(str(w.message) for w in caught)
    for name, reason in skipped.items():
        assert (name is None or f"{name} (" in text) and reason in text, text
    if not skipped:
        assert not caught, text
    return ref


def _fused_names(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, syncbn.SyncBatchNormAct))


@pytest.mark.parametrize("state", ["pruned", "parametrized", "forward_hook", "pre_hook", "state_dict_hook",
                                   "activation_hook"])
def test_group5_fusion_and_conversion_keep_per_module_state(state):
    """Group 5: a pruned or parametrized weight and module hooks are never dropped: the
    batch norm is left unfused, with a warning naming it; conversion leaves a pruned or
    parametrized one local too, and moves a plain layer's hooks to its synchronized form."""
    from torch.nn.utils import parametrize, prune

    class Scale(nn.Module):
        def forward(self, w):
            return w * 0.5

    def build():
        torch.manual_seed(5)
        model = _seeded(_stem())
        bn, act = model[1], model[2]
        if state == "pruned":
            prune.l1_unstructured(bn, "weight", amount=2)
        elif state == "parametrized":
            parametrize.register_parametrization(bn, "weight", Scale())
        elif state == "forward_hook":
            bn.register_forward_hook(lambda m, i, o: o * 2)
        elif state == "pre_hook":
            bn.register_forward_pre_hook(lambda m, i: (i[0] + 1,))
        elif state == "state_dict_hook":
            bn._register_state_dict_hook(lambda m, sd, prefix, local: sd)
        else:
            act.register_forward_hook(lambda m, i, o: o - 1)
        return model

    model = build()
    reason = {"pruned": "pruned", "parametrized": "parametrized", "activation_hook": "its activation 2"}.get(state, "hooks")
    ref = _fuse_expecting(model, {"1": reason}, ref=build().double())
    assert _fused_names(model) == []
    _same_as_unfused(model, ref, _image)
    if state in ("pruned", "parametrized"):
        converted = build()
        with pytest.warns(UserWarning, match=rf"left 1 of 1 BatchNorm layers local .*\(1: .*{reason}"):
            syncbn.convert_sync_batchnorm(converted)
        assert type(converted[1]) is nn.BatchNorm2d or parametrize.is_parametrized(converted[1])
        _same_as_unfused(converted, build().double(), _image)
    elif state != "activation_hook":
        converted = build()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            syncbn.convert_sync_batchnorm(converted)
        assert type(converted[1]) is syncbn.SyncBatchNorm
        _same_as_unfused(converted, build().double(), _image)


class _WalksChildren(nn.Module):
    """Taps every child's output of a Sequential by walking it."""

    def __init__(self):
        super().__init__()
        self.stem = _stem()

    def forward(self, x):
        taps = []
        for m in self.stem:
            x = m(x)
            taps.append(x)
        return x, taps[1]


class _Slices(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = _stem()

    def forward(self, x):
        pre = self.stem[:2](x)
        return self.stem[2:](pre), pre.mean()


class _AuxInTraining(nn.Module):
    """Taps the batch norm's output in one mode only."""

    def __init__(self, when_training=True):
        super().__init__()
        self.stem = _stem()
        self.aux = nn.Conv2d(4, 2, 1)
        self.when_training = when_training

    def tapping(self):
        return self.training == self.when_training

    def forward(self, x):
        h = self.stem[1](self.stem[0](x))
        out = self.stem[3](self.stem[2](h))
        if self.tapping():
            return out, self.aux(h)
        return out


class _Keeps(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.stem = _stem()
        self.how = how
        self.kept = []

    def forward(self, x):
        h = self.stem[1](self.stem[0](x))
        if self.how == "attribute":
            self.last = h
        else:
            self.kept.append(h)
        return self.stem[3](self.stem[2](h))


@pytest.mark.parametrize("model_cls", [_WalksChildren, _Slices, lambda: _AuxInTraining(True),
                                       lambda: _AuxInTraining(False)])
def test_group6_fusion_refuses_a_batch_norm_output_read_elsewhere(model_cls):
    """Group 6: a tap on the batch norm's output seen in either mode's trace keeps the pair unfused."""
    model = _seeded(model_cls())
    expected = {
        _WalksChildren: {"stem.1": "also read by"},
        _Slices: {None: "cannot trace _Slices"},  # fx cannot trace a slice of a Sequential
        _AuxInTraining: {"stem.1": "also read by"},
    }[type(model)]
    ref = _fuse_expecting(model, expected)
    assert _fused_names(model) == []
    _same_as_unfused(model, ref, _image)


@pytest.mark.parametrize("how", ["attribute", "list"])
def test_group6_fusion_refuses_values_kept_outside_the_graph(how):
    model = _seeded(_Keeps(how))
    ref = _fuse_expecting(model, {"stem.1": "stores a traced value" if how == "attribute" else "mutable attribute"})
    assert _fused_names(model) == []
    _same_as_unfused(model, ref, _image)
    kept = (lambda m: m.last) if how == "attribute" else (lambda m: m.kept[-1])  # noqa: E731
    torch.testing.assert_close(kept(model).double(), kept(ref), rtol=1e-4, atol=1e-4)  # the pre-activation


class _Flagged(_AuxInTraining):
    """Taps the batch norm's output when a plain attribute says so."""

    def __init__(self):
        super().__init__()
        self.tap = False

    def tapping(self):
        return self.tap


def test_group6_a_flag_flipped_after_fusion_raises():
    """Group 6: a flag read while tracing is checked by the fused layer."""
    model = _seeded(_Flagged())
    ref = _fuse_expecting(model, {})
    assert _fused_names(model) == ["stem.1"]
    _same_as_unfused(model, ref, _image)
    model.eval()  # (no buffer moves: the reference does not run these calls)
    twin = pickle.loads(pickle.dumps(copy.deepcopy(model)))  # the check goes with the copies
    twin.tap = True
    with pytest.raises(RuntimeError, match="_Flagged.tap was False"):
        twin(_image(0))
    model(_image(0))  # the original is untouched
    model.tap = True
    with pytest.raises(RuntimeError, match="_Flagged.tap was False when fuse_batchnorm_act traced"):
        model(_image(0))
    model.tap = False
    model(_image(0))
    back = syncbn.revert_sync_batchnorm(model)
    back.tap = ref.tap = True
    _same_as_unfused(back, ref, _image)


class _ChangesOutput(nn.Module):
    """Changes the activation's output in place: ``out += x``, or a method on a view."""

    def __init__(self, how):
        super().__init__()
        self.stem = _stem()
        self.how = how

    def forward(self, x):
        out = self.stem[2](self.stem[1](self.stem[0](x)))
        if self.how == "iadd":
            out += x
        else:
            out.flatten(2).mul_(2)
        return self.stem[3](out)


class _DropoutAfterElu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ELU(0.7)
        self.drop = nn.Dropout(0.3, inplace=True)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.drop(self.act(self.bn(self.conv(x)))))


@pytest.mark.parametrize("model_cls,name", [(lambda: _ChangesOutput("iadd"), "stem.1"), (_DropoutAfterElu, "bn"),
                                            (lambda: _ChangesOutput("view"), "stem.1")])
def test_group7_in_place_ops_after_the_activation_keep_the_pair_unfused(model_cls, name):
    """Group 7: ``out += x``, Dropout(inplace=True), an in-place method on a view: the
    model runs as it did (the fused layer keeps its output for backward)."""
    model = _seeded(model_cls())
    ref = _fuse_expecting(model, {name: "changed in place"})
    assert _fused_names(model) == []
    _same_as_unfused(model, ref, _image)


class _Taps:
    """Forward hooks that keep what they see (the tensors themselves)."""

    def __init__(self):
        self.seen = []

    def __call__(self, module, inputs, output):
        self.seen.append(output)


@pytest.mark.parametrize("where", ["around the batch norm", "before the reader", "around the producer"])
def test_group5_hooks_that_fx_bypasses_are_respected(where):
    """torch.fx does not run module hooks: a hooked container ending at the batch norm
    would see its output activated, a pre-hook changing the activation's output in place
    would break the fused backward, and a hooked container ending at the convolution
    keeps the output a fused layer would write over. The first two stay unfused, the third
    is fused without writing over its input; all run as the unfused model does."""
    taps = _Taps()
    if where == "around the batch norm":
        model = _seeded(nn.Sequential(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)),
                                      nn.LeakyReLU(0.1), nn.Conv2d(4, 4, 1)))
        model[0].register_forward_hook(taps)  # (a hook that returns a value is traced: no pair)
    elif where == "before the reader":
        model = _seeded(_stem())
        model[3].register_forward_pre_hook(lambda m, i: (i[0].mul_(2),))
    else:
        model = _seeded(nn.Sequential(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1)), nn.BatchNorm2d(4),
                                      nn.LeakyReLU(0.1), nn.Conv2d(4, 4, 1)))
        model[0].register_forward_hook(taps)
    ref = copy.deepcopy(model).double()
    if where == "around the producer":
        ref = _fuse_expecting(model, {}, ref=ref)
        assert _fused_names(model) == ["1"] and not model[1].inplace
    else:
        ref = _fuse_expecting(model, {"0.1" if where == "around the batch norm" else "1": "has hooks"}, ref=ref)
        assert _fused_names(model) == []
    _same_as_unfused(model, ref, _image)
    if where != "before the reader":
        model.train()
        taps.seen.clear()
        x = _image(7)
        y = model(x)
        seen = model[0][0](x)  # what the hook saw, recomputed
        if where == "around the batch norm":
            seen = model[0][1](seen)
        torch.testing.assert_close(taps.seen[-1], seen, rtol=0, atol=0)
        assert y.shape == seen.shape


def test_group7_a_truthy_inplace_flag_counts_as_in_place():
    model = _seeded(nn.Sequential(*_stem()[:3], nn.Hardtanh(-1, 1, inplace=1), nn.Conv2d(4, 4, 1)))
    ref = _fuse_expecting(model, {"1": "inplace=1"})
    assert _fused_names(model) == []
    _same_as_unfused(model, ref, _image)


def test_group7_fused_model_eval_then_train_then_backward_and_in_place_only_over_conv_outputs():
    """Group 7: a fused model runs eval, then train, then one backward through both; the
    fused layer after a convolution writes over its output, the one on the model's input
    never (its input may be numpy memory)."""
    import numpy as np

    model = _seeded(nn.Sequential(nn.BatchNorm2d(4), nn.LeakyReLU(0.2), *_stem()))
    ref = _fuse_expecting(model, {})
    assert _fused_names(model) == ["0", "3"] and not model[0].inplace and model[3].inplace
    arr = _image(3).numpy()
    before = arr.copy()
    x = torch.from_numpy(arr)
    model.eval()
    y1 = model(x)
    model.train()
    y2 = model(x)
    assert np.array_equal(arr, before)
    w = torch.linspace(-1, 1, y1.numel()).view_as(y1)
    ((y1 + y2) * w).sum().backward()
    ref.eval()
    r1 = ref(x.double())
    (r1 * w.double()).sum().backward()
    ref.train()
    r2 = ref(x.double())
    (r2 * w.double()).sum().backward()
    torch.testing.assert_close(y1.double(), r1.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y2.double(), r2.detach(), rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_revert_keeps_a_pruned_synchronized_layer():
    from torch.nn.utils import prune

    model = syncbn.convert_sync_batchnorm(_seeded(_stem()))
    prune.l1_unstructured(model[1], "weight", amount=2)
    with pytest.warns(UserWarning, match="revert_sync_batchnorm left these layers as they are: 1 "):
        back = syncbn.revert_sync_batchnorm(model)
    assert isinstance(back[1], syncbn.SyncBatchNorm) and hasattr(back[1], "weight_mask")


# ---- one shape with torch.nn.SyncBatchNorm and with the other frameworks ----------------


def test_torch_sync_batchnorm_classmethod_converts_like_the_function():
    """Code written for torch.nn.SyncBatchNorm calls its classmethod on syncbn's class."""
    import torch.nn as nn

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))

    by_method = syncbn.SyncBatchNorm.convert_sync_batchnorm(model())
    by_function = syncbn.convert_sync_batchnorm(model())
    assert [type(m) for m in by_method.modules()] == [type(m) for m in by_function.modules()]
    assert sum(isinstance(m, syncbn.SyncBatchNorm) for m in by_method.modules()) == 2
    for a, b in zip(by_method.state_dict().values(), by_function.state_dict().values()):
        assert torch.equal(a, b)
    # not a torch.nn.SyncBatchNorm: DDP refuses CPU modules holding one
    assert not issubclass(syncbn.SyncBatchNorm, nn.SyncBatchNorm)


def test_torch_names_convert_and_revert_are_the_torch_functions():
    import syncbn.torch

    assert syncbn.torch.convert is syncbn.convert_sync_batchnorm
    assert syncbn.torch.revert is syncbn.revert_sync_batchnorm


def _ddp_accepts(subclass_of_torch_sync: bool):
    """In a pool worker: can DDP wrap a CPU model holding a syncbn-like layer?"""
    import torch.nn as nn

    base = nn.SyncBatchNorm if subclass_of_torch_sync else syncbn.SyncBatchNorm

    class Layer(base):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Layer(4))
    try:
        nn.parallel.DistributedDataParallel(model)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_why_syncbn_is_not_a_torch_sync_batchnorm_subclass(pool):
    """The reason SyncBatchNorm is not a subclass of torch.nn.SyncBatchNorm: DDP refuses a
    CPU module holding any instance of that class, and syncbn's layer trains on CPUs."""
    as_subclass = pool.run(_ddp_accepts, True)
    as_ours = pool.run(_ddp_accepts, False)
    assert all("SyncBatchNorm layers only work with GPU modules" in r for r in as_subclass), as_subclass
    assert as_ours == ["accepted"] * len(as_ours)


@pytest.mark.parametrize("cleared", [("running_mean", "running_var"), ("num_batches_tracked",)])
def test_buffers_set_to_none_stay_none_through_convert_and_revert(cleared):
    """torch's BN normalizes with batch statistics in eval mode once its running buffers are
    set to None; the converted and the reverted layer hold None there too (as torch's own
    converter gives), not the empty placeholders the new layer was built with."""
    bn = nn.BatchNorm2d(3)
    for name in cleared:
        setattr(bn, name, None)
    x = torch.randn(4, 3, 2, 2) * 2 + 1
    expected = bn.eval()(x)
    synced = syncbn.convert_sync_batchnorm(nn.Sequential(bn))[0]
    back = syncbn.revert_sync_batchnorm(nn.Sequential(synced))[0]
    for layer in (synced, back):
        for name in cleared:
            assert getattr(layer, name) is None, (type(layer).__name__, name)
        assert all(t.device.type == "cpu" for t in layer.state_dict().values())
        assert list(layer.state_dict()) == list(bn.state_dict())
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def _state_dict_hook(bn, post):
    """Register ``post`` as a state_dict post-hook of ``bn`` (called with the module
    first); the handle. torch 2.4 has no public method: there its private predecessor
    fills the same dict with the same calls."""
    if hasattr(bn, "register_state_dict_post_hook"):
        return bn.register_state_dict_post_hook(post)
    return bn._register_state_dict_hook(post)


def _load_state_dict_pre_hook(bn, load_pre):
    """Register ``load_pre`` as a load_state_dict pre-hook of ``bn`` (called with the module
    first); the handle (torch 2.4: as :func:`_state_dict_hook`)."""
    if hasattr(bn, "register_state_dict_post_hook"):
        return bn.register_load_state_dict_pre_hook(load_pre)
    return bn._register_load_state_dict_pre_hook(load_pre, with_module=True)


# the hooks check_hooks_and_attributes_move puts on a layer, in the order they fire
_HOOK_KINDS = {
    "pre_kwargs": lambda bn, hook: bn.register_forward_pre_hook(hook, with_kwargs=True),
    "forward": lambda bn, hook: bn.register_forward_hook(hook),
    "backward": lambda bn, hook: bn.register_full_backward_hook(hook),
    "state_dict": _state_dict_hook,
    "load_pre": _load_state_dict_pre_hook,
    "load_post": lambda bn, hook: bn.register_load_state_dict_post_hook(hook),
}


def check_hooks_and_attributes_move(model, find, layer_types, make_input, kinds=tuple(_HOOK_KINDS)):
    """Hook the layer ``find(model)`` (forward, forward-pre with kwargs, full backward,
    state_dict and load_state_dict hooks: those of ``kinds``), set an attribute and a child
    module on it, then convert and revert: at each step the layer (of ``layer_types[i]``)
    is replaced, nothing is left local, each hook fires once on the new layer, the
    attribute and the state_dict keys stay, and an optimizer built before keeps training
    the same parameters. The handles still remove the hooks at the end."""
    bn = find(model)
    seen = []

    def note(kind):
        return lambda m, *args: seen.append((kind, type(m).__name__))

    handles = [_HOOK_KINDS[kind](bn, note(kind)) for kind in kinds]
    bn.freeze_at_epoch = 3
    bn.observer = nn.Linear(1, 1)  # holds state: it shows in the state_dict
    keys = list(model.state_dict())
    del bn  # the replaced layer goes: a hook torch holds with a weak reference to it still runs
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = [kind for kind in _HOOK_KINDS if kind in kinds]
    for step, layer_type in zip((syncbn.convert_sync_batchnorm, syncbn.revert_sync_batchnorm), layer_types):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing left local
            model = step(model)
        gc.collect()
        layer = find(model)
        assert type(layer).__name__ == layer_type
        assert layer.freeze_at_epoch == 3 and list(model.state_dict()) == keys, layer_type
        seen.clear()
        model.train()
        model(make_input(0).requires_grad_()).sum().backward()
        model.load_state_dict(model.state_dict())
        assert seen == [(kind, layer_type) for kind in expected]
        before = layer.weight.detach().clone()
        optimizer.step()
        assert not torch.equal(layer.weight, before) and torch.isfinite(layer.weight).all()
    for handle in handles:
        handle.remove()
    seen.clear()
    model(make_input(1).requires_grad_()).sum().backward()
    model.load_state_dict(model.state_dict())
    assert seen == []


def test_hooks_on_a_batch_norm_move_with_it_through_convert_and_revert():
    """A framework's hooks on a batch norm fire on the synchronized layer and again on the
    reverted one, and the handles that registered them still remove them."""
    check_hooks_and_attributes_move(_seeded(_stem()), lambda m: m[1], ("SyncBatchNorm", "BatchNorm2d"), _image)


def _registered_relu():
    """Register BatchNormAct <-> SyncBatchNormRelu as a user would; returns the unregister."""
    from syncbn.torch.conversion import _CONVERSIONS, _move_state

    syncbn.register_conversion(
        BatchNormAct,
        lambda layer, group: _move_state(layer, SyncBatchNormRelu(layer.num_features, process_group=group,
                                                                  device="meta")),
        lambda layer: _move_state(layer, BatchNormAct(layer.num_features, device="meta")),
    )
    return lambda: _CONVERSIONS.pop(BatchNormAct)


def test_hooks_on_a_layer_of_a_registered_class_move_as_on_a_plain_one():
    """A registered conversion moves the layer's tensors; the converter moves its hooks,
    attributes and child modules as for a plain layer, through convert and revert. Such a
    layer was left local with a warning ('it has hooks')."""
    unregister = _registered_relu()
    try:
        model = _seeded(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), BatchNormAct(4), nn.Conv2d(4, 4, 1)))
        check_hooks_and_attributes_move(model, lambda m: m[1], ("SyncBatchNormRelu", "BatchNormAct"), _image)
    finally:
        unregister()


def test_a_registered_conversion_that_wraps_or_hooks_its_layer_keeps_every_hook_once():
    """A ``to_sync`` returning a module that holds the old layer leaves that layer's hooks
    where they are (moved to the wrapper too, they ran twice); hooks ``to_sync`` put on
    its new layer (here of another kind than the user's) run beside the moved ones, and
    both the user's handles and ``to_sync``'s still remove theirs."""
    from syncbn.torch.conversion import _CONVERSIONS

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    seen = []
    handles = []

    def hooked(layer, group):
        new = SyncBatchNormRelu(layer.num_features, process_group=group)
        handles.append(new.register_forward_hook(lambda m, args, out: seen.append("to_sync's")))
        return new

    for to_sync, expected in ((lambda layer, group: Wrapper(layer), ["user's"]),
                              (hooked, ["user's", "to_sync's"])):
        syncbn.register_conversion(BatchNormAct, to_sync, lambda layer: layer)
        try:
            model = nn.Sequential(BatchNormAct(3))
            handles[:] = [model[0].register_forward_pre_hook(lambda m, args: seen.append("user's"))]
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                model = syncbn.convert_sync_batchnorm(model)
            for left in (expected, expected[1:], []):
                seen.clear()
                model(torch.randn(4, 3, 2, 2))
                assert seen == left
                if handles:
                    handles.pop(0).remove()
        finally:
            del _CONVERSIONS[BatchNormAct]


def test_a_registered_conversion_hooking_its_layer_as_the_user_did_leaves_the_layer_as_it_is():
    """Hooks of one kind on the old layer (the user's) and on the layer ``to_sync`` or
    ``to_plain`` made (its own) need one dictionary on the new layer, and a handle removes
    its hook from the dictionary it was registered in: one set of handles would stop
    working. The layer stays as it is, named with the fix (strict=True refuses before any
    change). The user's dictionary took in to_sync's hooks, and to_sync's handle no longer
    removed its hook."""
    from syncbn.torch.conversion import _CONVERSIONS, _move_state

    seen = []

    def hooking(make):  # a to_sync or to_plain that hooks the layer it makes
        def convert(layer, *group):
            new = make(layer.num_features)
            new.register_forward_hook(lambda m, args, out: seen.append("conversion's"))
            return _move_state(layer, new)
        return convert

    fix = "remove these hooks before and register them on the new layer after"
    syncbn.register_conversion(BatchNormAct, hooking(SyncBatchNormRelu), lambda layer: layer)
    try:
        model = nn.Sequential(BatchNormAct(3))
        old = model[0]
        handle = old.register_forward_hook(lambda m, args, out: seen.append("user's"))
        before = _layer_as_it_is(old)
        with pytest.raises(ValueError, match=r"left 1 of 1 .*0: its forward_hooks cannot move to the layer to_sync"):
            syncbn.convert_sync_batchnorm(model, strict=True)
        with pytest.warns(UserWarning, match=fix):
            assert syncbn.convert_sync_batchnorm(model)[0] is old
        _assert_as_it_was(old, before)
        seen.clear()
        model(torch.randn(4, 3, 2, 2))
        assert seen == ["user's"]
        handle.remove()  # the fix
        model = syncbn.convert_sync_batchnorm(model, strict=True)
        assert type(model[0]) is SyncBatchNormRelu
    finally:
        del _CONVERSIONS[BatchNormAct]
    synced = model[0]
    synced.register_forward_hook(lambda m, args, out: seen.append("user's"))
    syncbn.register_conversion(BatchNormAct, hooking(SyncBatchNormRelu), hooking(BatchNormAct))
    try:
        before = _layer_as_it_is(synced)
        with pytest.warns(UserWarning, match=r"left these layers as they are: 0 \(its forward_hooks .*to_plain"):
            assert syncbn.revert_sync_batchnorm(model)[0] is synced
        _assert_as_it_was(synced, before)
    finally:
        del _CONVERSIONS[BatchNormAct]


def test_a_hooked_sync_batchnorm_act_is_left_as_it_is_by_revert():
    """A hook on a fused layer sees the activated output: neither the batch norm nor the
    activation it reverts to computes that, so it stays, with a warning; fusion likewise
    leaves a hooked batch norm unfused (its hook would see the activated output)."""
    model = _seeded(_stem())
    syncbn.fuse_batchnorm_act(model)
    model[1].register_forward_hook(lambda m, args, out: None)
    with pytest.warns(UserWarning, match=r"left these layers as they are: 1 \(it has hooks \(forward_hooks\)\)"):
        back = syncbn.revert_sync_batchnorm(model)
    assert type(back[1]) is syncbn.SyncBatchNormAct


def test_user_attributes_and_non_persistent_buffers_survive_convert_fuse_and_revert():
    """Attributes a user or a framework set on a batch norm (torch's converter drops them)
    and a buffer kept out of the state_dict stay as they were through every conversion."""
    model = _seeded(_stem())
    bn = model[1]
    bn.freeze_at_epoch = 3
    bn._framework_tag = ("backbone", 1)
    bn._non_persistent_buffers_set.add("num_batches_tracked")
    keys = list(model.state_dict())
    for step in (syncbn.convert_sync_batchnorm, syncbn.fuse_batchnorm_act, syncbn.revert_sync_batchnorm):
        model = step(model)
        layer = model[1]
        assert (layer.freeze_at_epoch, layer._framework_tag) == (3, ("backbone", 1)), step.__name__
        assert list(model.state_dict()) == keys, step.__name__
    assert type(model[1]) is nn.BatchNorm2d and "process_group" not in model[1].__dict__


def test_a_module_attached_to_a_batch_norm_and_its_hook_go_along():
    """A child module on a batch norm, called by a hook (as eager quantization attaches an
    observer), stays in the converted and in the reverted layer, with its state_dict keys."""
    model = _seeded(_stem())
    model[1].observer = nn.Linear(1, 1)  # holds state: it shows in the state_dict
    model[1].register_forward_hook(lambda m, args, out: out + m.observer.bias.sum())
    keys, expected = list(model.state_dict()), model.eval()(_image(0))
    for step in (syncbn.convert_sync_batchnorm, syncbn.revert_sync_batchnorm):
        model = step(model)
        assert list(model.state_dict()) == keys, step.__name__
        torch.testing.assert_close(model(_image(0)), expected, rtol=0, atol=0)


def test_a_batch_norm_compiled_on_its_own_converts_to_a_layer_running_its_own_forward():
    """``bn.compile()`` keeps a compiled ``bn._call_impl`` on the instance: carried over
    with the other attributes, every call of the synchronized (and the reverted) layer ran
    the old layer, whose training flag no longer follows the model's."""
    model = _seeded(_stem())
    model[1].compile(backend="eager")  # compiles lazily: nothing is traced unless it is called
    for step in (syncbn.convert_sync_batchnorm, syncbn.revert_sync_batchnorm):
        model = step(model).eval()
        bn = model[1]
        with torch.no_grad():
            expected = model[3](model[2](F.batch_norm(
                model[0](_image(0)), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)))
            torch.testing.assert_close(model(_image(0)), expected, rtol=0, atol=1e-6, msg=step.__name__)
        model.train()


def test_a_method_replaced_on_a_batch_norm_instance_keeps_it_local():
    """A method set on the instance (here ``train`` wrapped to log the mode) is bound to
    that layer: carried to the new layer, ``model.eval()`` would set the old layer's flag
    and leave the synchronized one training. Such a layer stays local, as one whose
    ``forward`` is replaced does."""
    model = _seeded(_stem())
    bn, modes = model[1], []
    original_train = bn.train
    bn.train = lambda mode=True: modes.append(mode) or original_train(mode)
    with pytest.warns(UserWarning, match=r"left 1 of 1 .*its train is replaced on the instance"):
        model = syncbn.convert_sync_batchnorm(model)
    model.eval()
    assert model[1] is bn and not bn.training and modes == [False]
    relaxed = _stem()
    relaxed[1]._check_input_dim = lambda x: None  # as harmless on the instance as in a subclass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(syncbn.convert_sync_batchnorm(relaxed)[1]) is syncbn.SyncBatchNorm
    synced = syncbn.convert_sync_batchnorm(_stem())
    synced[1].train = lambda mode=True: synced[1]
    with pytest.warns(UserWarning, match=r"left these layers as they are: 1 \(its train is replaced on the instance"):
        assert type(syncbn.revert_sync_batchnorm(synced)[1]) is syncbn.SyncBatchNorm


class _FrozenBN(nn.BatchNorm2d):
    """A frozen batch norm as detection codebases write it: always in eval mode."""

    def train(self, mode=True):
        return super().train(False)


def test_a_subclass_overriding_more_than_forward_stays_local():
    """torch's converter turns every BatchNorm subclass into a plain SyncBatchNorm; one that
    overrides ``train`` (kept frozen) would then start updating and synchronizing its
    statistics. It stays local, named with the method, and is not fused either."""
    model = nn.Sequential(nn.Conv2d(4, 4, 1), _FrozenBN(4), nn.LeakyReLU(0.1), nn.BatchNorm2d(4))
    with pytest.warns(UserWarning, match=r"left 1 of 2 .*_FrozenBN \(it overrides train; teach"):
        model = syncbn.convert_sync_batchnorm(model)
    assert type(model[1]) is _FrozenBN and isinstance(model[3], syncbn.SyncBatchNorm)
    with pytest.raises(ValueError, match="overrides train"):
        syncbn.convert_sync_batchnorm(nn.Sequential(_FrozenBN(4)), strict=True)
    with pytest.warns(UserWarning, match=r"1 \(its class overrides train\)"):
        syncbn.fuse_batchnorm_act(model)
    before = model[1].running_mean.clone()
    model.train()
    model(_image(0))
    assert not model[1].training and torch.equal(model[1].running_mean, before)


def test_fusion_keeps_a_synchronized_subclass_with_its_own_momentum_unfused():
    """``_momentum`` is syncbn's (the running-buffer weight both forwards call), not torch's:
    a SyncBatchNorm subclass redefining it was fused into a plain SyncBatchNormAct, which
    weights its batches by the default rule. It stays unfused, named with the method."""
    model = nn.Sequential(nn.Conv2d(4, 4, 1), _SlowMomentumSync(4), nn.LeakyReLU(0.1))
    with pytest.warns(UserWarning, match=r"1 \(its class overrides _momentum\)"):
        fused = syncbn.fuse_batchnorm_act(model)
    assert type(fused[1]) is _SlowMomentumSync and type(fused[2]) is nn.LeakyReLU
    fused.train()
    with torch.no_grad():
        fused(_image(0))
        batch_mean = fused[0](_image(0)).mean(dim=(0, 2, 3))
    # the subclass's weight after one batch, 0.5 / (1 + 1); the default rule's would be 0.1
    torch.testing.assert_close(fused[1].running_mean, 0.25 * batch_mean, rtol=1e-5, atol=1e-6)


def _two_pairs(second_activation):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LeakyReLU(0.1),
                         nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), second_activation).double()


@pytest.mark.parametrize("activation", [nn.LeakyReLU(float("inf")), nn.ELU(float("inf"))], ids=["leaky_relu", "elu"])
def test_fusion_leaves_an_activation_parameter_the_fused_layer_refuses(activation):
    """An infinite slope or alpha (torch's modules take it; SyncBatchNormAct refuses it) keeps
    its pair as it is, and the pairs before it still fuse. Fusion raised on it, after it had
    already put the first pair's fused layer in place with its LeakyReLU still behind it."""
    model = _two_pairs(activation).eval()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: such an activation is no candidate
        syncbn.fuse_batchnorm_act(model)
    assert isinstance(model[1], syncbn.SyncBatchNormAct) and type(model[4]) is nn.BatchNorm2d
    assert model[5] is activation
    torch.testing.assert_close(model(x), expected, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_fusion_that_fails_leaves_the_model_as_it_was(monkeypatch):
    """Every fused layer is built before the model is changed: a failure building the second
    leaves the first pair in place too (not a fused layer followed by its activation again)."""
    from syncbn.torch import conversion

    model = _two_pairs(nn.ELU(0.5)).eval()
    before = list(model)
    built = []

    def failing(*args, **kwargs):
        built.append(args[0])
        if len(built) == 2:
            raise RuntimeError("cannot build")
        return fuse(*args, **kwargs)

    fuse = conversion._fuse
    monkeypatch.setattr(conversion, "_fuse", failing)
    with pytest.raises(RuntimeError, match="cannot build"):
        syncbn.fuse_batchnorm_act(model)
    assert list(model) == before


class _SixDimHead(nn.Module):
    """A model whose batch norm sees (N, 3, 2, 2, 2, 2) inputs: torch.nn.SyncBatchNorm takes
    them (any rank from 2), so such a model exists before conversion."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(5, 48)
        self.bn = nn.SyncBatchNorm(3)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x):
        return self.act(self.bn(self.lin(x).view(x.shape[0], 3, 2, 2, 2, 2)))


def _six_dim_data(sizes):
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(n, 5, generator=gen, dtype=torch.float64) * 2 + 1 for n in sizes]
    dys = [torch.randn(n, 3, 2, 2, 2, 2, generator=gen, dtype=torch.float64) for n in sizes]
    return xs, dys


def _six_dim_job(world, sizes, fuse):
    from workers import group_of, in_group

    group = group_of(world)
    if not in_group(world):
        return None
    rank = torch.distributed.get_rank()
    xs, dys = _six_dim_data(sizes)
    model = _SixDimHead().double()
    model = (syncbn.fuse_batchnorm_act if fuse else syncbn.convert_sync_batchnorm)(model, process_group=group)
    layer = model.bn
    y = model(xs[rank])
    y.backward(dys[rank])
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.eval()
    evaluated = model(xs[rank])
    reverted = syncbn.revert_sync_batchnorm(model)
    return {"type": type(layer).__name__, "y": y.detach(), "grads": grads, "eval": evaluated.detach(),
            "reverted_eval": reverted(xs[rank]).detach(), "reverted": type(reverted.bn).__name__,
            "buffers": {k: v.clone() for k, v in reverted.bn.named_buffers()}}


@pytest.mark.parametrize("fuse", [False, True])
def test_a_model_feeding_six_dims_converts_and_trains_on_two_ranks(pool, fuse):
    """convert_sync_batchnorm (and fuse_batchnorm_act) of a model whose torch.nn.SyncBatchNorm
    gets 6-D inputs: trained on 2 ranks it matches the unconverted model on the whole batch in
    one process (float64, bound 1e-10 relative), eval and the reverted model too (the
    layers refused such inputs before)."""
    sizes = (3, 2)
    results = pool.run(_six_dim_job, 2, sizes, fuse)[:2]
    xs, dys = _six_dim_data(sizes)
    ref = _SixDimHead().double()
    y = ref(torch.cat(xs))
    y.backward(torch.cat(dys))
    ref.eval()

    def close(got, expect):
        assert got.shape == expect.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-10 * max(1.0, float(expect.abs().max())))

    close(torch.cat([r["y"] for r in results]), y.detach())
    for name, p in ref.named_parameters():
        close(sum(r["grads"][name] for r in results), p.grad)
    for r, x in zip(results, xs):
        assert r["type"] == ("SyncBatchNormAct" if fuse else "SyncBatchNorm")
        assert r["reverted"] == "BatchNormNd"
        expect = ref(x).detach()
        close(r["eval"], expect)
        close(r["reverted_eval"], expect)
        for name, buffer in ref.bn.named_buffers():
            close(r["buffers"][name].double(), buffer.double())
