"""The distributions a user installs: the sdist and the wheel build from a clean tree,
pass ``twine check``, carry the licence, the version from its one source and no pinned
dependency, and the installed wheel runs ``syncbn --version`` and imports each framework
part whose framework is installed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from syncbn._version import __version__

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "torch", "keras", "flax", "tools", "demo", "bench")


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: build with this environment's setuptools, as CI has no index to spare
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return wheels[0], sdists[0]


def test_twine_check_passes(dists):
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_wheel_holds_the_package_the_licence_and_honest_metadata(dists):
    wheel, _ = dists
    assert wheel.name.startswith(f"syncbn-{__version__}-")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(info).decode()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "syncbn/py.typed" in names
    for package in PACKAGES:
        assert f"syncbn/{package}/__init__.py" in names, package
    assert not any(n.startswith("tests/") for n in names)
    assert f"\nVersion: {__version__}\n" in metadata
    assert "\nLicense-Expression: BSD-3-Clause\n" in metadata
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, flags=re.M)
    assert requires, metadata[:2000]
    pinned = [r for r in requires if "==" in r.split(";")[0]]
    assert pinned == [], "an extra must not pin (it would replace a user's accelerator build)"


def test_sdist_holds_the_licence_and_the_changelog(dists):
    _, sdist = dists
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml", "src/syncbn/__init__.py"} <= names


def test_installed_wheel_runs_and_imports_each_installed_part(dists, tmp_path):
    wheel, _ = dists
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                           "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(os.environ, PYTHONPATH=str(target), KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
               JAX_PLATFORMS="cpu")
    version = subprocess.run([str(target / "bin" / "syncbn"), "--version"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert version.returncode == 0 and version.stdout.strip() == f"syncbn {__version__}", version.stdout + version.stderr
    parts = [name for name, needs in (("torch", "torch"), ("keras", "keras"), ("flax", "flax"))
             if importlib.util.find_spec(needs) is not None]
    assert parts, "no framework installed: nothing to import"
    code = ("import importlib, syncbn; print(syncbn.__file__); "
            + "; ".join(f"importlib.import_module('syncbn.{p}')" for p in parts))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith(str(target)), proc.stdout
