"""``syncbn.tools.usage``: how every subcommand refuses a command line it cannot run."""

import argparse
import math
import sys

import pytest

from syncbn.tools import soak, verify
from syncbn.tools.usage import UsageError, positive_float, torch_missing


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


@pytest.mark.parametrize("text, value", [("0.05", 0.05), ("1e-30", 1e-30), ("600", 600.0), ("1.7e308", 1.7e308)])
def test_positive_float_takes_finite_numbers_above_zero(text, value):
    assert positive_float(text) == value


@pytest.mark.parametrize("text, shown", [("0", "0"), ("-0.0", "-0.0"), ("-1", "-1"), ("1e-400", "1e-400"),
                                          ("nan", "nan"), ("NaN", "NaN"), ("inf", "inf"), ("-inf", "-inf"),
                                          ("1e400", "1e400"), ("fast", "'fast'"), ("", "''")])
def test_positive_float_refuses_zero_negative_nan_and_infinity(text, shown):
    """NaN passes a check written as ``value <= 0`` (every comparison with NaN is false), and
    infinity passes ``value > 0``; both are refused, with the text as given."""
    with pytest.raises(argparse.ArgumentTypeError) as info:
        positive_float(text)
    assert str(info.value) == f"expected a finite positive number, got {shown}"


def test_positive_float_names_the_option_and_exits_2(capsys):
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--rate", type=positive_float)
    assert math.isclose(parser.parse_args(["--rate", "0.5"]).rate, 0.5)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--rate", "nan"])
    assert info.value.code == 2
    assert "tool: error: argument --rate: expected a finite positive number, got nan" in capsys.readouterr().err
