"""Type checkers see the real top-level API: ``syncbn.SyncBatchNorm`` and its friends have
their own types (not ``Any``), and a name that does not exist is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CODE = """\
import syncbn
reveal_type(syncbn.convert_sync_batchnorm)
reveal_type(syncbn.SyncBatchNorm)
syncbn.does_not_exist
"""


def test_mypy_sees_the_top_level_api(tmp_path):
    pytest.importorskip("mypy")
    (tmp_path / "check.py").write_text(CODE)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports", "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), "check.py"],
        cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
        env={"MYPYPATH": str(ROOT / "src"), "PATH": str(Path(sys.executable).parent)},
    )
    out = proc.stdout
    assert 'check.py:2: note: Revealed type is "def (module: torch.nn.modules.module.Module' in out, out
    assert "-> syncbn.torch.batchnorm.SyncBatchNorm" in out, out
    assert 'check.py:4: error: Module has no attribute "does_not_exist"' in out, out
    assert "Any" not in out.splitlines()[0].split("->")[-1], out
