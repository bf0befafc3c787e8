"""``syncbn.tools.usage``: how every subcommand refuses a command line it cannot run."""

import sys

from syncbn.tools import soak, verify
from syncbn.tools.usage import UsageError, torch_missing


def test_without_torch_the_command_is_named_with_the_install_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` meets without torch
    assert torch_missing("verify") is True
    err = capsys.readouterr().err
    assert err.startswith("syncbn verify: needs PyTorch (") and err.count("\n") == 1, err
    assert err.endswith('; install it, e.g. pip install "syncbn[torch]"\n'), err


def test_with_torch_nothing_is_said(capsys):
    assert torch_missing("soak") is False
    assert capsys.readouterr().err == ""


def test_verify_and_soak_share_the_one_helper_and_error():
    """verify's workers raise the UsageError that verify catches and the demo catches."""
    assert verify.UsageError is UsageError and issubclass(UsageError, ValueError)
    assert verify.torch_missing is torch_missing and soak.torch_missing is torch_missing
