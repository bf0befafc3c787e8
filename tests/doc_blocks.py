"""Running the code blocks of the user-facing documents (README.md, docs/recipes.md, the
guides in docs/) as written: finding them, and running a command with a bounded time and a quiet environment."""

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


def gloo_threads() -> list:
    """The names of this process's threads that are gloo's (Linux names them, e.g.
    ``pt_gloo_runloop``): none once every gloo process group was freed."""
    import glob

    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(name for name in names if "gloo" in name)


def exit_unless_group_freed(script: str) -> None:
    """In a rank process, after ``script`` ran: exit with status 3 (``os._exit``, past
    interpreter shutdown) when the script did not destroy its process group, or when any of
    gloo's threads still runs after it did, that is, when the group was not freed.

    ``destroy_process_group()`` frees the group only when nothing else holds it (a live
    DDP model does; so does ``torch.distributed.nn`` when first imported after
    ``init_process_group``). A group that is not freed keeps gloo's threads running into
    interpreter shutdown, where on torch 2.13 one of them can abort the process, rarely
    (docs/torch.md, "Ending a job"). This check fails every time such a script runs, not
    only on the rare run that aborts (Linux names the threads, e.g. ``pt_gloo_runloop``)."""
    import sys

    import torch.distributed as dist

    def fail(message):
        sys.stderr.write(f"{script} {message}\n")
        sys.stderr.flush()
        os._exit(3)

    if not dist.is_available():
        return
    if dist.is_initialized():
        fail("ended without destroy_process_group(): its group and gloo's threads run into interpreter shutdown")
    left = gloo_threads()
    if left:
        fail(f"destroyed its process group, but it was not freed: gloo's threads {left} still run into "
             "interpreter shutdown (something still holds the group)")


def torchrun_wrapper(prelude: str = "") -> str:
    """A script that runs ``sys.argv[1]`` (or ``-m MODULE``) as ``__main__`` (after
    ``prelude``), keeping what it leaves as its own end would, then
    :func:`exit_unless_group_freed`."""
    return f"""import runpy, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
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
import doc_blocks
doc_blocks.exit_unless_group_freed(script)
sys.exit(status)
"""
