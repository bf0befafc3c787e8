"""Every code block of README.md runs as written (small inputs, 2 ranks or devices).

Each block is found by its first line in :data:`HOW`, which says how it runs; a block that
is not there fails the test, so a new block cannot go untested. The harness may give a block
its devices (two host devices for JAX) and run it through a wrapper that checks what the
block leaves behind (the torchrun script: its process group really ended), but never edits
it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import doc_blocks
from demo.demo_checks import check_report
from syncbn.demo.config import DemoConfig
from syncbn.demo.report import format_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent

def blocks():
    """``(language, first line, text)`` of every fenced code block, in order."""
    return doc_blocks.blocks(README)


def _env(**extra):
    return doc_blocks.env(**extra)


def _jax_env():
    return _env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")


def _run(cmd, tmp_path, env, timeout=600, cwd=None):
    return doc_blocks.run(cmd, cwd or tmp_path, env, timeout)


def run_install(body, tmp_path):
    """Each ``pip install ".[extra]"`` line: pip resolves it from the checkout against this
    environment, with no index and nothing installed (``--dry-run``). The extra must exist;
    where its frameworks are installed here, their tested versions must satisfy its ranges.
    (TensorFlow is installed here as ``tensorflow-cpu``, another distribution than the
    ``tensorflow`` that ``[tensorflow]`` names: that line is resolved without dependencies.)"""
    lines = [line.split("#")[0].strip() for line in body.splitlines() if line.strip()]
    assert lines and all(re.fullmatch(r'pip install "\.\[\w+\]"', line) for line in lines), lines
    for line in lines:
        extra = re.search(r"\[(\w+)\]", line).group(1)
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
               "--disable-pip-version-check", f".[{extra}]"]
        if extra == "tensorflow":
            cmd.insert(4, "--no-deps")
        proc = _run(cmd, tmp_path, _env(), cwd=ROOT)
        assert "does not provide the extra" not in proc.stdout + proc.stderr, (extra, proc.stderr)


def run_torchrun(body, tmp_path):
    """The training script, under ``torchrun --standalone --nproc-per-node 2`` (gloo on CPU),
    through a wrapper that then checks that the group it destroyed is really gone
    (:func:`doc_blocks.torchrun_wrapper`)."""
    command = re.search(r"run with\s+(torchrun .*\.py)", body).group(1).split()
    (tmp_path / command[-1]).write_text(body)
    (tmp_path / "_ended.py").write_text(doc_blocks.torchrun_wrapper())
    _run([str(BIN / "torchrun"), *command[1:-1], "_ended.py", command[-1]], tmp_path, _env(), timeout=300)


def run_keras_tensorflow(body, tmp_path):
    """As written: with no GPU here, ``MirroredStrategy()`` has one replica, the CPU."""
    (tmp_path / "block.py").write_text(body)
    _run([sys.executable, "block.py"], tmp_path, _env(KERAS_BACKEND="tensorflow"))


def run_jax(body, tmp_path):
    (tmp_path / "block.py").write_text(body)
    _run([sys.executable, "block.py"], tmp_path, _jax_env())


def run_development(body, tmp_path):
    """``scripts/demo --quick`` runs as written, from the checkout; ``scripts/test`` is what
    CI runs (``.ci/run`` executes exactly it), so this suite does not start itself again.

    This run is also the suite's end-to-end test of the quick demo spawned on this machine
    (4 ranks, ``python -m syncbn demo --quick`` less the install): it writes to the default
    ``--out``, ``syncbn-out/demo`` in the checkout, and that report is checked as the other
    launchers' are (``demo_checks.check_report``). The table printed is that of the file read
    (each run's seconds included), so the file is this run's, not one left by an earlier one."""
    lines = [line.split("#")[0].strip() for line in body.splitlines() if line.strip()]
    assert lines == ["scripts/demo --quick", "scripts/test"], lines
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("exec scripts/test")
    proc = _run(["bash", "-c", lines[0]], tmp_path, _env(), timeout=900, cwd=ROOT)
    out_dir = ROOT / DemoConfig().out
    report = check_report(out_dir, 4, "spawned")
    assert format_table(report) in proc.stdout, "results.json is not the one this run wrote"
    assert "syncbn matches the big batch" in proc.stdout
    for title in ("per-rank BN under DDP", "syncbn under DDP", "one process, batch 8"):
        assert title in proc.stdout


HOW = {
    'pip install ".[torch]"        # PyTorch >= 2.4': run_install,
    "# train.py: run with  torchrun --standalone --nproc-per-node 2 train.py": run_torchrun,
    "import numpy as np": run_keras_tensorflow,
    "import os": run_jax,
    "import jax": run_jax,
    "scripts/demo --quick    # the main job, `syncbn demo` (40 s; without --quick, the full 2-minute run)":
        run_development,
}


def test_every_block_has_a_way_to_run():
    missing = [first for _, first, _ in blocks() if first not in HOW]
    assert missing == []
    assert len(blocks()) >= 6


@pytest.mark.parametrize("index", range(len(blocks())))
def test_block_runs_as_written(index, tmp_path):
    lang, first, body = blocks()[index]
    assert first in HOW, first
    HOW[first](body, tmp_path)


def test_links_point_at_files_that_exist():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert targets and missing == []


def test_anchors_point_at_headings_that_exist():
    """README links into the guides by heading (``docs/torch.md#ending-a-job``); the site
    build checks the guides' own anchors, nothing checked README's, so a renamed heading
    would leave a link that opens the page at its top."""
    slugify = pytest.importorskip("markdown.extensions.toc").slugify  # mkdocs' own slugs

    links = re.findall(r"\]\(([^)#\s]+\.md)#([^)\s]+)\)", README.read_text())
    assert links
    for path, anchor in links:
        text = re.sub(r"^```.*?^```", "", (ROOT / path).read_text(), flags=re.M | re.S)
        headings = re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M)
        assert anchor in {slugify(re.sub(r"[`*]", "", h), "-") for h in headings}, (path, anchor)


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250
