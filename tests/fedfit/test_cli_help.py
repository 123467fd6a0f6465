"""`fedfit --help` and every subcommand's help read as plain text: no reStructuredText or Markdown backticks."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from fedfit.cli import _parser, main


def _helps(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """Each parser's command line and its help text, the parser's own first, then its subcommands' (recursively)."""
    yield " ".join(("fedfit", *path)), parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _helps(sub, (*path, name))


def test_every_help_is_plain_text() -> None:
    helps = dict(_helps(_parser()))
    # The walk reaches every command and the broker's own subcommands.
    assert {"fedfit", "fedfit sim", "fedfit compare", "fedfit plan", "fedfit coordinator", "fedfit agent",
            "fedfit broker", "fedfit broker init", "fedfit broker add-device"} <= set(helps)
    for command, text in helps.items():
        assert "`" not in text, f"{command} --help prints a backtick:\n{text}"


def test_fedfit_help_as_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    # the module docstring's first paragraph, plainly (however argparse wraps it)
    assert "The fedfit command: coordinator and agent daemons" in " ".join(out.split())
    assert "`" not in out
