"""The module paths of syncbn 0.1 that moved (``syncbn._moved``) still import, warn once
with both paths, and give the very module of the new path (one set of classes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from syncbn._moved import MOVED

# one fresh process imports every old path (the Keras and Flax demo models import Keras
# and JAX: not in the pytest process), recording what each import warned and gave
SCRIPT = r"""
import importlib, json, pickle, sys, warnings
import torchvision_shim  # syncbn.lightning imports lightning, which imports torchvision
torchvision_shim.install()
import syncbn
from syncbn._moved import MOVED
out = {}
for old, new in MOVED.items():
    try:  # an optional framework this environment lacks (lightning, keras, flax): named, not checked
        importlib.import_module(new)
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] == "syncbn":
            raise
        out[old] = {"missing": error.name}
        continue
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope = {}
        exec(compile(f"import {old} as module", "<user code>", "exec"), scope)  # an import statement
        module = scope["module"]
        again = importlib.import_module(old)  # cached: warns no more
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning) and "has moved" in str(w.message)]
    out[old] = {
        "same": module is importlib.import_module(new) and again is module and sys.modules[old] is module,
        "warnings": [str(w.message) for w in deprecations],
        "where": [w.filename for w in deprecations],
    }
# an object pickled under an old path (protocol 0: module and name as text) loads
cls = pickle.loads(b"csyncbn.batchnorm\nSyncBatchNorm\n.")
out["pickle"] = cls is syncbn.SyncBatchNorm
print(json.dumps(out))
"""


def _run():
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_old_paths_import_the_new_modules_with_one_warning():
    out = _run()
    assert out.pop("pickle") is True
    assert set(out) == set(MOVED)
    missing = {old: out[old]["missing"] for old in MOVED if "missing" in out[old]}
    for old, new in MOVED.items():
        got = out[old]
        if old in missing:
            continue
        assert got["same"], old
        if old == "syncbn.functional":  # also the package's own name: not deprecated
            assert got["warnings"] == [], old
        else:
            assert len(got["warnings"]) == 1, (old, got["warnings"])
            assert old in got["warnings"][0] and new in got["warnings"][0]
            # the warning points at the import in the user's code, not at importlib
            assert got["where"] == ["<user code>"], (old, got["where"])
    if missing:  # every other path passed; these need a framework that is not installed here
        pytest.skip(f"not installed, so not checked: {sorted(set(missing.values()))} (for {sorted(missing)})")


def test_new_paths_do_not_warn():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import syncbn, syncbn.torch, syncbn.tools.verify, syncbn.tools.launch, syncbn.demo.torch\n"
            "from syncbn.torch.functional import sync_batch_norm\n"
            "syncbn.SyncBatchNorm, syncbn.convert_sync_batchnorm, syncbn.functional.sync_batch_norm\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
