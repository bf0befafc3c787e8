"""``syncbn verify`` on models from MONAI, Hugging Face transformers and mmsegmentation
(tests/torch/zoo_models.py, random init, small widths): on the 4-rank gloo pool, each
synchronized model trains step for step like one process on the concatenated batch.
MONAI's 3-D networks run at batch 1 per rank. A MONAI UNet with one layer the converter
must leave local fails, showing that the check can fail on these models.

With ``-s`` each test prints verify's worst limit ratio and largest difference."""

import io
import os
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

import syncbn
from syncbn.tools import verify

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)

pytestmark = pytest.mark.usefixtures("one_thread")

VOXELS = (1, 1, 16, 16, 16)  # one 16^3 single-channel volume per rank
IMAGE = (1, 3, 32, 32)

# factory in zoo_models -> (input shape per rank, dtype, steps)
MONAI = {
    "monai_unet3d": (VOXELS, "float64", 2),
    "monai_unet3d_syncbatch": (VOXELS, "float64", 2),
    "monai_dynunet3d": (VOXELS, "float64", 2),
    "monai_segresnet3d": (VOXELS, "float64", 2),
}
HF = {
    "hf_resnet": (IMAGE, "float64", 2),
    "hf_upernet_convnext": (IMAGE, "float64", 2),
    "hf_segformer": (IMAGE, "float64", 2),
    "hf_mobilevit": ((1, 3, 64, 64), "float64", 2),
    "hf_dpt": (IMAGE, "float64", 2),
    "hf_levit": (IMAGE, "float64", 2),
}
MMSEG = {
    "mmseg_unet_fcn_syncbn": (IMAGE, "float64", 2),
    "mmseg_unet_fcn_bn": (IMAGE, "float64", 2),
    "mmseg_upernet_r_syncbn": (IMAGE, "float64", 2),
    "mmseg_upernet_r_bn": (IMAGE, "float64", 2),
}
CASES = {**MONAI, **HF, **MMSEG}
LIBRARY = {"monai": "monai", "hf": "transformers", "mmseg": "mmseg"}  # a factory's prefix -> what it needs


def _verify(pool, name, shape, dtype, steps):
    spec = verify.VerifySpec(f"zoo_models:{name}", shape, world_size=pool.world_size, steps=steps, dtype=dtype,
                             sys_path=[TESTS, HERE])
    buf = io.StringIO()
    start = time.perf_counter()
    code = verify.verify(spec, out=buf, pool=pool)
    seconds = time.perf_counter() - start
    out = buf.getvalue()
    print(f"\n{name}: {tuple(shape)} per rank x {pool.world_size} ranks, {dtype}, {steps} steps: exit {code}, "
          f"{_figures(out)}, {seconds:.1f} s")
    return code, out


def _rows(out):
    """verify's table: the columns of each BatchNorm layer's row, by layer name."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("BatchNorm layer")) + 1
    return {row[0]: row[1:] for row in (line.split() for line in lines[first : lines.index("", first)])}


def _figures(out):
    """verify's worst limit ratio, its largest layer difference (outputs and running
    statistics) and its parameter difference."""
    try:
        rows = _rows(out).values()
        params = next(line for line in out.splitlines() if line.startswith("parameters after each step"))
    except (StopIteration, ValueError):
        return "no table"
    layers = max(float(v) for row in rows for v in row[1:4] if v not in ("-", "mismatch"))
    limits = [float(row[4]) for row in rows if row[4] != "mismatch"]
    if "limit " in params:
        limits.append(float(params.rsplit("limit ", 1)[1].rstrip(")")))
    return f"worst limit {max(limits):.1e}, layers {layers:.1e}, parameters {params.split(': ', 1)[1]}"


def _build(name):
    import zoo_models

    return getattr(zoo_models, name)()


def _bn_types(model):
    return [type(m) for m in model.modules() if isinstance(m, _BatchNorm)]


@pytest.mark.parametrize("name", list(CASES))
def test_verify_passes(pool, name):
    pytest.importorskip(LIBRARY[name.split("_")[0]])
    code, out = _verify(pool, name, *CASES[name])
    assert code == 0, out
    assert "PASS: syncbn reproduces one process" in out
    assert "BatchNorm layers local" not in out  # the converter left no layer local
    rows = _rows(out)
    assert len(rows) == len(_bn_types(_build(name)))  # every layer compared
    assert all(row[5] == "yes" for row in rows.values())  # the ranks' running statistics agree


def test_one_layer_left_local_fails(pool):
    """The MONAI 3-D UNet with its first BatchNorm3d of a subclass the converter does not
    know: it normalizes each rank's one volume alone, and verify says so."""
    pytest.importorskip("monai")
    code, out = _verify(pool, "monai_unet3d_one_layer_local", *MONAI["monai_unet3d"])
    assert code == 1, out
    assert "left 1 of 6 BatchNorm layers local" in out
    rows = _rows(out)
    local = rows.pop("model.0.conv.unit0.adn.N")
    assert local[5:] == ["NO", "<--"] and float(local[4]) > 1  # its running statistics differ across ranks
    assert all(float(row[4]) > 1 for row in rows.values())  # and every synchronized layer after it is off
    assert "FAIL: differences above the limit" in out


def test_the_models_hold_what_the_check_is_about():
    """MONAI's norm="syncbatch" builds torch.nn.SyncBatchNorm; mmseg's 'SyncBN' builds
    syncbn.SyncBatchNorm once syncbn.torch.mmengine is imported, 'BN' torch's BatchNorm2d;
    a Hugging Face model's output holds one tensor, the one the loss is on (logits, depth)."""
    for library in LIBRARY.values():
        pytest.importorskip(library)
    types = _bn_types(_build("monai_unet3d_syncbatch"))
    assert types and set(types) == {nn.SyncBatchNorm}
    for name in MMSEG:
        want = syncbn.SyncBatchNorm if name.endswith("_syncbn") else nn.BatchNorm2d
        assert set(_bn_types(_build(name))) == {want}, name
    for name, (shape, _, _) in HF.items():
        torch.manual_seed(0)
        model = _build(name).double()
        output = model(torch.randn((2,) + shape[1:], dtype=torch.float64))
        main = output.logits if "logits" in output else output.predicted_depth
        tensors = verify._output_tensors(output)
        assert len(tensors) == 1 and tensors[0] is main and main.shape[0] == 2, (name, list(output))
