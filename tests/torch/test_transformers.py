"""Hugging Face transformers models with syncbn's layers, in one process (docs/torch.md,
"Hugging Face transformers"): checkpoints written by ``save_pretrained`` from a converted
model, and the documented way to keep the running statistics moving once a step under
transformers' activation checkpointing. Models come from configs (tests/torch/zoo_models.py);
nothing is downloaded."""

import contextlib
import copy
import os
import sys

import pytest
import torch
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn
from syncbn.torch.recompute import recomputation

pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo_models  # noqa: E402
from test_revert_ranks import stir_batch_norms  # noqa: E402


@pytest.mark.parametrize("name", ["hf_resnet", "hf_mobilevit", "hf_levit"])
def test_save_pretrained_of_a_converted_model_loads_into_the_plain_and_a_converting_class(tmp_path, name):
    torch.manual_seed(0)
    converted = stir_batch_norms(syncbn.convert_sync_batchnorm(getattr(zoo_models, name)()), 7)
    converted.save_pretrained(tmp_path)
    plain_class = type(converted)

    class Converting(plain_class):  # converts in __init__: from_pretrained fills syncbn's layers
        def __init__(self, config):
            super().__init__(config)
            syncbn.convert_sync_batchnorm(self)

    want = converted.state_dict()
    for cls, layer_type in ((plain_class, None), (Converting, syncbn.SyncBatchNorm)):
        loaded, info = cls.from_pretrained(tmp_path, output_loading_info=True)
        assert not any(info.values()), info  # nothing missing, unexpected or mismatched
        got = loaded.state_dict()
        assert list(got) == list(want)
        assert all(torch.equal(got[key], want[key]) for key in want), cls
        types = {type(m) for m in loaded.modules() if isinstance(m, _BatchNorm)}
        assert types == {layer_type} if layer_type else syncbn.SyncBatchNorm not in types


def _step(model, x):
    model.train()
    model(pixel_values=x).logits.square().mean().backward()
    return model


def test_marked_activation_checkpointing_moves_the_running_statistics_once():
    """transformers recomputes a checkpointed layer under plain torch.utils.checkpoint, so
    unmarked, some running buffers move twice in one step; with the context_fn of the docs
    the step ends with the buffers and gradients of the step without checkpointing."""
    torch.manual_seed(0)
    model = syncbn.convert_sync_batchnorm(zoo_models.hf_mobilevit()).double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    plain = _step(copy.deepcopy(model), x)

    unmarked = copy.deepcopy(model)
    unmarked.activation_checkpointing_enable()
    _step(unmarked, x)
    counts = {int(v) for k, v in unmarked.state_dict().items() if k.endswith("num_batches_tracked")}
    assert counts == {1, 2}  # transformers' own: the recomputed layers counted twice

    marked = copy.deepcopy(model)
    marked.activation_checkpointing_enable(activation_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), recomputation())})
    _step(marked, x)
    want, got = plain.state_dict(), marked.state_dict()
    assert all(torch.equal(got[key], want[key]) for key in want)  # buffers, bit for bit
    # the recomputation repeats the first forward's float64 ops in the same order: the
    # gradients agree to rounding (observed bit-equal)
    for (name, p), q in zip(plain.named_parameters(), marked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)
