"""The package's face (``syncbn/__init__.py``): the PyTorch names, lazily, and nothing else."""

import subprocess
import sys

import pytest

import syncbn
import syncbn.torch


def test_the_face_names_exactly_the_torch_api():
    # syncbn.torch.convert/revert are not repeated at the top level, where syncbn.convert
    # was a module path of syncbn 0.1 (still importable, deprecated): the two would clash
    assert set(syncbn.__all__) - {"__version__"} == set(syncbn.torch.__all__) - {"convert", "revert"}
    for name in syncbn.__all__[:-1]:
        assert getattr(syncbn, name) is getattr(syncbn.torch, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="does_not_exist"):
        syncbn.does_not_exist  # noqa: B018


def test_import_syncbn_imports_no_framework():
    code = ("import sys, syncbn; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'tensorflow', 'keras', 'jax', 'flax')]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_syncbn_after_torch_imports_torch_distributed_nn_first():
    """torch.distributed.nn binds the default group into its functions' default arguments
    at its first import; ``import syncbn`` after torch imports it while no group exists yet,
    so that the script's ``destroy_process_group()`` can free the group later (the
    end-to-end check is the torchrun wrapper of tests/doc_blocks.py)."""
    code = ("import sys, torch; assert 'torch.distributed.nn' not in sys.modules; import syncbn; "
            "import torch.distributed.nn.functional as f; "
            "print(f.all_reduce.__defaults__); sys.exit(0 if 'torch.distributed.nn' in sys.modules else 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ProcessGroup" not in proc.stdout, proc.stdout


def test_the_mismatch_error_is_caught_by_its_top_level_name_without_torch():
    """Keras and Flax raise syncbn.core.fingerprint.LayerMismatchError; a user without torch
    catches it as the documented ``syncbn.LayerMismatchError``, which must not import torch."""
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torch': raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "import syncbn, syncbn.core.fingerprint as core\n"
            "assert syncbn.LayerMismatchError is core.LayerMismatchError\n"
            "assert 'torch' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
