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
