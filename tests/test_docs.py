"""The documentation site builds without a warning (``mkdocs build --strict``), and its API
reference holds every public name of each framework part, with its docstring."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# page -> names that must be documented there (each a heading of the reference)
PAGES = {
    "api/torch": ["syncbn.torch.SyncBatchNorm", "syncbn.torch.SyncBatchNormAct", "syncbn.torch.convert_sync_batchnorm",
                  "syncbn.torch.revert_sync_batchnorm", "syncbn.torch.functional.sync_batch_norm"],
    "api/keras": ["syncbn.keras.SyncBatchNormalization", "syncbn.keras.convert", "syncbn.keras.revert"],
    "api/flax": ["syncbn.flax.BatchNorm", "syncbn.flax.convert", "syncbn.flax.revert", "syncbn.flax.nnx.BatchNorm",
                 "syncbn.flax.nnx.convert", "syncbn.flax.nnx.revert"],
    "api/cli": ["syncbn.cli", "syncbn.tools.verify.verify"],
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    return out


def test_every_guide_and_measured_page_is_built(site):
    for page in ("index.html", "torch/index.html", "keras/index.html", "flax/index.html", "disagreement/index.html",
                 "verify/index.html", "demo/index.html", "benchmarks/index.html", "gpu-check-h200/index.html",
                 "changelog/index.html"):
        assert (site / page).is_file(), page


@pytest.mark.parametrize("page", sorted(PAGES))
def test_api_reference_documents_the_public_names(site, page):
    html = (site / page / "index.html").read_text()
    for name in PAGES[page]:
        assert f'id="{name}"' in html, name


def test_docstrings_are_rendered(site):
    html = (site / "api" / "torch" / "index.html").read_text()
    assert "Batch normalization over the union of all ranks" in html  # SyncBatchNorm's docstring
    changelog = (site / "changelog" / "index.html").read_text()
    assert "Unreleased" in changelog  # the snippet included CHANGELOG.md


DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])


def test_code_blocks_are_shell_or_python_that_compiles():
    """Each Python block parses, in every document, and each block says its language
    (``text`` for a tree or an output). The blocks run as written in test_readme (README),
    test_recipes (docs/recipes.md) and test_guides (the other guides); the pages not run
    there (CONTRIBUTING, the measured pages) are at least parsed here."""
    import doc_blocks

    for path in DOCUMENTS:
        for lang, first, body in doc_blocks.blocks(path):
            assert lang in ("python", "bash", "text"), (path.name, first)
            if lang == "python":
                compile(body, f"{path.name}: {first}", "exec")


def test_command_lines_use_options_that_exist():
    """Every ``--option`` written after ``syncbn COMMAND`` (or ``scripts/demo``), in a block
    or in the text, is one that command takes: a renamed option cannot stay in the docs."""
    import re

    from syncbn import cli

    def options(command):
        parser = cli.build_parser(command)
        child = parser._subparsers._group_actions[0].choices[command]
        return {s for action in child._actions for s in action.option_strings}

    seen = 0
    for path in DOCUMENTS:
        text = path.read_text().replace("\\\n", " ")
        for match in re.finditer(r"(?:\bsyncbn|scripts/demo)\s+(demo|bench|verify|soak)?([^`\n#]*)", text):
            command = match.group(1) or ("demo" if match.group(0).startswith("scripts/demo") else None)
            if command is None:
                continue
            used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(2)))
            seen += len(used)
            assert used <= options(command), (path.name, match.group(0), used - options(command))
    assert seen >= 10
