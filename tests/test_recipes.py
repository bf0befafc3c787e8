"""Every code block of docs/recipes.md runs as written: MONAI, Hugging Face transformers
and OpenMMLab under ``torchrun`` with 2 gloo ranks, keras-hub on TensorFlow, Flax in 2
processes under ``jax.distributed``.

Each block is found by its first line in :data:`HOW`; a block that is not there fails the
test. The harness never edits a block: it may run it through a wrapper that first makes
torchvision and mmsegmentation importable here (``tests/torchvision_shim.py``,
``tests/mmcv_shim.py``: this machine's CPU torch and mmcv-lite), and it gives the Flax
processes a free port as the script's argument.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import doc_blocks
import keras_harness

RECIPES = doc_blocks.ROOT / "docs" / "recipes.md"
BIN = Path(sys.executable).parent

WRAPPER = doc_blocks.torchrun_wrapper("""import torchvision_shim, mmcv_shim
torchvision_shim.install()
mmcv_shim.install()""")


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")


def run_torchrun(body, tmp_path):
    """The script under ``torchrun --standalone --nproc-per-node 2`` (gloo on CPU)."""
    command = re.search(r"run with\s+(torchrun .*\.py)", body).group(1).split()
    script = command[-1]
    (tmp_path / script).write_text(body)
    (tmp_path / "_shims.py").write_text(WRAPPER)
    doc_blocks.run([str(BIN / "torchrun"), *command[1:-1], "_shims.py", script], tmp_path, doc_blocks.env(),
                   timeout=420)


def run_monai(body, tmp_path):
    needs("monai")
    run_torchrun(body, tmp_path)
    assert (tmp_path / "unet3d.pt").exists()


def run_transformers(body, tmp_path):
    needs("transformers")
    run_torchrun(body, tmp_path)


def run_mmseg(body, tmp_path):
    needs("mmengine", "mmcv", "mmseg")
    run_torchrun(body, tmp_path)


def run_keras_hub(body, tmp_path):
    """As written: with no GPU here, ``MirroredStrategy()`` has one replica, the CPU
    (``tests/keras/test_keras_hub.py`` checks 2 replicas against one device)."""
    needs("tensorflow", "keras_hub")
    (tmp_path / "block.py").write_text(body)
    doc_blocks.run([sys.executable, "block.py"], tmp_path, doc_blocks.env(KERAS_BACKEND="tensorflow"))
    assert (tmp_path / "deeplab_v3.keras").exists()


def run_flax_processes(body, tmp_path):
    """Two processes, ``python train_flax.py PROCESS_ID HOST:PORT`` with a free port; both
    must print the same running mean (the statistics span both processes)."""
    needs("flax")
    script = re.search(r"python (\S+\.py) PROCESS_ID", body).group(1)
    (tmp_path / script).write_text(body)
    address = f"127.0.0.1:{keras_harness.free_ports(1)[0]}"
    environment = doc_blocks.env(JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, script, str(i), address], cwd=tmp_path, env=environment,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=240))
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, f"--- stdout\n{out[-2000:]}\n--- stderr\n{err[-4000:]}"
    means = [out.strip().splitlines()[-1].split(None, 1) for out, _ in outs]
    assert sorted(m[0] for m in means) == ["0", "1"], means
    assert means[0][1] == means[1][1], means


HOW = {
    "# train_monai.py: run with  torchrun --standalone --nproc-per-node 2 train_monai.py": run_monai,
    "# train_hf.py: run with  torchrun --standalone --nproc-per-node 2 train_hf.py": run_transformers,
    "# train_mmseg.py: run with  torchrun --standalone --nproc-per-node 2 train_mmseg.py": run_mmseg,
    "import numpy as np": run_keras_hub,
    "# train_flax.py: run in each of 2 processes with  python train_flax.py PROCESS_ID 127.0.0.1:12355":
        run_flax_processes,
}


def test_every_block_has_a_way_to_run():
    found = doc_blocks.blocks(RECIPES)
    assert [first for _, first, _ in found if first not in HOW] == []
    assert len(found) == len(HOW)


@pytest.mark.parametrize("first", list(HOW))
def test_recipe_runs_as_written(first, tmp_path):
    body = next(body for _, line, body in doc_blocks.blocks(RECIPES) if line == first)
    HOW[first](body, tmp_path)
