"""The README and docs/ hold together: links resolve inside the repository, every docs page is reachable from the
README, the README stays a front door (under 200 lines), every `fedfit` command line they show parses with the real
command line parser, and every `make` target the README names exists."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from fedfit.cli import _parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
SHELLS = {"sh", "bash", "shell", "console"}
#: Where one shell command ends and the next may begin.
CONTROL = {";", "&", "&&", "|", "||", "(", ")", "do", "then", "else", "{", "}"}


def _prose(text: str) -> str:
    """The page without its fenced blocks and inline code, where brackets and parentheses are code, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation (backticks included) dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    anchors: set[str] = set()
    for heading in headings:
        slug, n = _slug(heading), 1
        while slug in anchors:  # GitHub numbers repeated headings: slug, slug-1, slug-2...
            slug, n = f"{_slug(heading)}-{n}", n + 1
        anchors.add(slug)
    return anchors


def _links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: lead out by intent


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_point_at_files_in_the_repository(page: Path) -> None:
    problems = []
    for target in _links(page):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if path_part.startswith("../") or not destination.is_relative_to(ROOT):
            problems.append(f"outside the repository: {target}")
        elif not destination.exists():
            problems.append(f"a missing file: {target}")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            problems.append(f"a missing heading: {target}")
    assert not problems, f"{page.relative_to(ROOT)} links to " + "; ".join(problems)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    assert DOCS, "docs/ holds no page"
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(README)}
    missing = [page.name for page in DOCS if page.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().count("\n")
    assert lines < 200, f"README.md has {lines} lines; the reference belongs in docs/"


def _command_lines(page: Path) -> list[str]:
    """Every line of the page's fenced shell blocks, continuation lines joined."""
    lines: list[str] = []
    for language, body in FENCE.findall(page.read_text()):
        if language in SHELLS:
            lines += body.replace("\\\n", " ").splitlines()
    return lines


def _fedfit_commands(line: str) -> list[list[str]]:
    """The arguments of each `fedfit` command on one shell line (a command starts the line or follows ; & | do...)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    tokens = list(lexer)
    commands: list[list[str]] = []
    start = True
    for i, token in enumerate(tokens):
        if start and Path(token).name == "fedfit":
            arguments = []
            for argument in tokens[i + 1:]:
                if argument in CONTROL:
                    break
                # A shell variable (the walkthrough's loop variable $i, say) stands for a value the page's shell
                # sets; it is given one (0, valid wherever a number or a name is expected), not skipped.
                arguments.append(re.sub(r"\$\{?\w+\}?", "0", argument))
            commands.append(arguments)
        start = token in CONTROL or (start and token in {"sudo", "exec", "time", "nice"})
    return commands


def _shown_commands() -> list[tuple[str, list[str]]]:
    return [(f"{page.relative_to(ROOT)}: fedfit {' '.join(arguments)}", arguments)
            for page in PAGES for line in _command_lines(page) for arguments in _fedfit_commands(line)]


def test_the_pages_show_fedfit_commands() -> None:
    shown = _shown_commands()
    assert any(page.startswith("README.md") for page, _ in shown)
    assert any(args[:2] == ["broker", "init"] for _, args in shown)


@pytest.mark.parametrize(("shown", "arguments"), _shown_commands(), ids=[shown for shown, _ in _shown_commands()])
def test_every_fedfit_command_shown_parses(shown: str, arguments: list[str]) -> None:
    parser = _parser()
    if arguments in (["--version"], ["-V"]):
        # main() answers these before parsing (and the parser's action would ask git): the option must exist.
        assert arguments[0] in parser._option_string_actions
        return
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parsed = parser.parse_args(arguments)
    except SystemExit:
        pytest.fail(f"{shown}\ndoes not parse: {errors.getvalue().strip()}")
    assert isinstance(parsed, argparse.Namespace) and parsed.command == arguments[0]


def test_make_targets_named_in_the_readme_exist() -> None:
    text = README.read_text()
    named = set(re.findall(r"`make ([\w-]+)", text))
    for language, body in FENCE.findall(text):
        if language in SHELLS:
            named |= set(re.findall(r"^\s*make ([\w-]+)", body, re.MULTILINE))
    assert {"demo", "test"} <= named, "the README's two commands are make demo and make test"
    targets = set(re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.MULTILINE))
    assert named <= targets, f"make targets the Makefile lacks: {sorted(named - targets)}"
