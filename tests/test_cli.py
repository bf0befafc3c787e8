"""The ``syncbn`` command itself (``src/syncbn/cli.py``): what ``syncbn --help`` lists
and what each ``syncbn COMMAND --help`` says, and a bad command line ends with a usage
error naming the problem."""

import sys
from importlib import import_module

import pytest

from syncbn import cli


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_the_top_level_line_is_the_commands_own(name):
    """``syncbn --help`` shows the line kept in COMMANDS (no subcommand is imported for it);
    ``syncbn NAME --help`` shows the module's HELP. They said different things for soak
    ("at W=2" where --world-size takes any W) unless they are kept equal."""
    module_name, line = cli.COMMANDS[name]
    assert import_module(module_name).HELP == line


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_describes_itself(name, capsys):
    """``syncbn soak --help`` printed its options with no word on what the run does or when
    it passes."""
    with pytest.raises(SystemExit) as stop:
        cli.main([name, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # usage, then the description, then the options
    assert not description.startswith(("options:", "positional arguments:")), out
    assert len(description.split()) >= 10, out


def test_an_unknown_command_is_named(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["frobnicate"])
    assert stop.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["verify", "mymodels.py:build", "--input-shape", "2,3,8,8"], ["soak"]])
def test_a_torch_command_without_torch_says_what_is_missing(argv, monkeypatch, capsys):
    """Where torch is not installed (a Keras or Flax user), verify ended in a
    ModuleNotFoundError traceback and soak in its workers dying one by one; both now say
    that they need PyTorch, with exit 2, before starting anything."""
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` meets without torch
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"syncbn {argv[0]}: needs PyTorch" in err and 'pip install "syncbn[torch]"' in err, err


def _no_work(monkeypatch):
    """Make the demo's training and the bench's peers fail the test if they start."""
    from syncbn.bench import runner
    from syncbn.demo import torch as demo_torch

    monkeypatch.setattr(demo_torch, "run", lambda *a, **k: pytest.fail("the demo started training"))
    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the bench started its peers"))


def _unusable(tmp_path, kind):
    """An --out that cannot be used, and the reason both commands give for it."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    if kind == "under a file":
        return blocker / "out", f"{blocker} is not a folder"
    if kind == "a file":
        return blocker, "exists and is not a folder"
    if kind == "a dangling link":
        link = tmp_path / "link"
        link.symlink_to(tmp_path / "gone")
        return link, "exists and is not a folder"
    # an existing folder nobody may write in, root included (permission bits say nothing to root)
    return "/proc", "cannot write in /proc ("


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@pytest.mark.parametrize("kind", ["under a file", "a file", "a dangling link", "an unwritable folder"])
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_an_unusable_output_folder_is_one_usage_line_before_any_work(command, kind, tmp_path, monkeypatch, capsys):
    """``syncbn demo`` and ``syncbn bench`` checked --out in two ways: the demo raised
    SystemExit (exit 1), the bench made the folder (exit 2, other words) and let an
    existing folder it cannot write in (or a dangling link) pass, to fail once its
    peers had run. Both now refuse it alike, before any work, and leave nothing behind."""
    _no_work(monkeypatch)
    out, reason = _unusable(tmp_path, kind)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main([command, "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    prefix = f"syncbn {command}: --out {out}: {reason}"
    assert err.startswith(prefix) and err.endswith("; give a folder that can be created and written\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_an_empty_output_folder_is_a_usage_error_before_any_work(command, tmp_path, monkeypatch, capsys):
    """``--out ""`` was taken for the current folder: the demo trained every run and then
    failed in ``os.makedirs("")``, the bench wrote its report where it was started."""
    _no_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert cli.main([command, "--quick", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert err == f"syncbn {command}: --out is empty; give a folder that can be created and written\n", err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, named", [
    (["--backend", "jax"], "--backend jax is a Keras backend"),
    (["--framework", "keras", "--backend", "gloo"], "--backend gloo is a torch.distributed backend"),
    (["--framework", "flax", "--backend", "tensorflow"], "--framework flax runs on JAX"),
    (["--image-size", "20"], "--image-size must be a multiple of 8"),
    (["--lr", "0"], "--lr must be a finite positive number, got 0.0"),
    (["--lr", "nan"], "--lr must be a finite positive number, got nan"),  # said "must be positive"
    (["--lr", "inf"], "--lr must be a finite positive number, got inf"),
    (["--background-weight", "-1"], "--background-weight must be a finite positive number, got -1.0"),
    (["--background-weight", "nan"], "--background-weight must be a finite positive number, got nan"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda"),
])
def test_a_bad_demo_setting_is_a_usage_error(argv, named, tmp_path, monkeypatch, capsys):
    """The demo's own setting checks raised SystemExit with a string: exit status 1, where
    every other usage error of the command line (argparse's, verify's, bench's, soak's)
    exits 2. They now end as those do: one line on stderr, exit 2, nothing started."""
    _no_work(monkeypatch)
    assert cli.main(["demo", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"syncbn demo: {named}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_machine_without_what_the_demo_asks_for_is_not_a_usage_error(tmp_path, monkeypatch):
    """The arguments are right, this machine lacks what they ask for (the same command
    line runs elsewhere): exit status 1 with the reason, not a usage error."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not under torchrun
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo", "--device", "cuda", "--out", str(tmp_path / "out")])
    # SystemExit with a message: Python prints it on stderr and exits with status 1
    assert stop.value.code == "syncbn demo: --device cuda given but torch sees no CUDA device"


@pytest.mark.parametrize("argv, blocked, named", [
    ([], "torch", "torch"),
    (["--framework", "keras"], "tensorflow", "tensorflow"),
    (["--framework", "keras", "--backend", "jax"], "jax", "jax"),
    (["--framework", "flax"], "flax", "flax"),
    (["--framework", "flax"], "sklearn", "scikit-learn"),
    ([], "matplotlib", "matplotlib"),
])
def test_the_demo_without_a_package_it_needs_says_which(argv, blocked, named, tmp_path, monkeypatch, capsys):
    """``syncbn demo`` where its framework (or scikit-learn, matplotlib, tqdm) is not
    installed ended in a ModuleNotFoundError traceback from deep in the run; it now names
    the missing package and the pip command, exit 2, before anything starts."""
    _no_work(monkeypatch)
    monkeypatch.setitem(sys.modules, blocked, None)  # what the lookup finds where it is not installed
    assert cli.main(["demo", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"syncbn demo: needs {named}, not installed; install it, e.g. pip install {named}\n", err
    assert not (tmp_path / "out").exists()
