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


def torchrun_wrapper(prelude: str = "") -> str:
    """A script that runs ``sys.argv[1]`` (or ``-m MODULE``) as ``__main__`` (after ``prelude``), then checks
    that a process group the script destroyed is really gone.

    ``destroy_process_group()`` frees the group only when nothing else holds it (a live
    DDP model does; so does ``torch.distributed.nn`` when first imported after
    ``init_process_group``). A group that is not freed keeps gloo's threads running into
    interpreter shutdown, where on torch 2.13 one of them can abort the process, rarely
    (docs/torch.md, "Ending a job"). The check fails every time such a script runs, not
    only on the rare run that aborts: once the script has ended its group, no thread of
    the process may be one of gloo's (Linux names them, e.g. ``pt_gloo_runloop``)."""
    return f"""import glob, os, runpy, sys
{prelude}
status = 0
try:
    if sys.argv[1] == "-m":  # python -m MODULE ARGS...
        script = sys.argv[2]
        sys.argv = sys.argv[2:]
        left_by_script = runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        script = sys.argv[1]
        sys.argv = sys.argv[1:]
        left_by_script = runpy.run_path(script, run_name="__main__")  # kept: as at the script's own end
except SystemExit as done:
    status = done.code
import torch.distributed as dist
if dist.is_available() and not dist.is_initialized():
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:
            pass
    left = sorted(name for name in names if "gloo" in name)
    if left:
        sys.stderr.write(f"{{script}} destroyed its process group, but it was not freed: gloo's threads "
                         f"{{left}} still run into interpreter shutdown (something still holds the group)\\n")
        sys.stderr.flush()
        os._exit(3)
sys.exit(status)
"""
