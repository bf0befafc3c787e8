"""``import syncbn.flax`` (and its nnx part) needs neither torch nor TensorFlow."""

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax")


def test_import_without_torch_or_tensorflow():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'tensorflow'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import syncbn, syncbn.flax, syncbn.flax.nnx\n"
        "assert syncbn.flax.BatchNorm.__name__ == 'BatchNorm'\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
