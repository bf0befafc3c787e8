"""Running the code blocks of the user-facing documents (README.md, docs/recipes.md) as
written: finding them, and running a command with a bounded time and a quiet environment."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def blocks(path):
    """``(language, first line, text)`` of every fenced code block of ``path``, in order."""
    text = Path(path).read_text()
    found = re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S)
    return [(lang, body.strip().splitlines()[0], body) for lang, body in found]


def env(**extra):
    out = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               PYTHONUNBUFFERED="1")
    out.pop("TF_CONFIG", None)
    out.update(extra)
    return out


def run(cmd, cwd, environment, timeout=600):
    proc = subprocess.run(cmd, cwd=str(cwd), env=environment, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    return proc
