"""``syncbn.tools.output``: the --out folder of ``syncbn demo`` and ``syncbn bench``,
judged by a real try that leaves nothing behind."""

import os
import sys

import pytest

from syncbn.tools.output import unusable_output

TAIL = "; give a folder that can be created and written"


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_folder_that_can_be_made_or_written_passes_and_nothing_is_left(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.md").write_text("kept")
    before = _listing(tmp_path)
    for out in (tmp_path / "new" / "deeper", tmp_path / "old", tmp_path):
        assert unusable_output(out) is None, out
    assert _listing(tmp_path) == before


def test_a_file_in_the_way_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert unusable_output(blocker) == f"--out {blocker}: exists and is not a folder{TAIL}"
    assert unusable_output(blocker / "out" / "x") == f"--out {blocker / 'out' / 'x'}: {blocker} is not a folder{TAIL}"
    assert unusable_output(blocker, option="--dir").startswith(f"--dir {blocker}: ")


def test_a_dangling_link_is_in_the_way(tmp_path):
    """``os.path.exists`` says False for a link to nothing, so the check saw a folder to
    be made where ``os.makedirs`` then fails with FileExistsError."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    assert unusable_output(link) == f"--out {link}: exists and is not a folder{TAIL}"
    assert unusable_output(link / "out") == f"--out {link / 'out'}: {link} is not a folder{TAIL}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_folder_nobody_may_write_in_is_refused_also_for_root():
    """Permission bits say nothing to root: the check makes a folder there and sees it fail."""
    for out in ("/proc", "/proc/syncbn-out/demo"):
        problem = unusable_output(out)
        assert problem is not None and problem.startswith(f"--out {out}: cannot write in /proc ("), problem


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write in any folder")
def test_a_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        problem = unusable_output(folder / "out")
    finally:
        folder.chmod(0o700)
    assert problem is not None and f"cannot write in {folder} (" in problem, problem


def test_an_empty_path_is_refused_by_name(tmp_path, monkeypatch):
    """``""`` passed the check as the current folder, where ``os.makedirs("")`` (the demo's
    report writer) then raised FileNotFoundError after every run had trained."""
    monkeypatch.chdir(tmp_path)
    assert unusable_output("") == f"--out is empty{TAIL}"
    assert unusable_output("", option="--dir") == f"--dir is empty{TAIL}"
    assert list(tmp_path.iterdir()) == []
