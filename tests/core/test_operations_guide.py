"""docs/operations.md cannot rot: every ``coldsnap`` command line it shows names a (sub)command and options of the
real parser (``coldsnap_core.cli.main.build_parser``), every ``COLDSNAP_*`` name it uses is a variable of the
settings table (``coldsnap_core.settings.SETTINGS``), and every link it makes goes to a file of the repository and,
into docs/format.md, to one of its headings."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from coldsnap_core.cli.main import build_parser
from coldsnap_core.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "operations.md"

_CODE = re.compile(r"```[a-z]*\n(.*?)```|`([^`\n]+)`", re.DOTALL)
_SEGMENT_END = re.compile(r"&&|\|\||;|\$\(|\)|\s>\s|\n")
_VARIABLE = re.compile(r"\bCOLDSNAP_[A-Z0-9_]+\b")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _code(text: str) -> list[str]:
    """Every fenced block and inline code span of ``text``, in order."""
    return [block or span for block, span in _CODE.findall(text)]


def _segments(code: str) -> list[list[str]]:
    """``code`` cut into shell commands (at ``&&``, ``;``, ``$(``, a redirection, a line end, and a pipe outside
    ``[...]``: ``[--json | --format F]`` is one synopsis), each as its words with leading ``VAR=value`` dropped."""
    depth, cut = 0, []
    for char in code:
        depth += (char == "[") - (char == "]")
        cut.append("\n" if char == "|" and depth == 0 else char)
    segments = []
    for piece in _SEGMENT_END.split("".join(cut)):
        words = piece.split("#")[0].split()
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
            words.pop(0)
        segments.append(words)
    return segments


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def command_problems(text: str, parser: argparse.ArgumentParser) -> tuple[list[str], int]:
    """Each ``coldsnap`` command line in ``text``'s code whose (sub)command or option ``parser`` lacks, as
    ``"<line>: <what>"``, and how many command lines were checked. A line is one whose first word (after
    ``VAR=value`` assignments) is ``coldsnap``; an option before the command is the top-level parser's
    (``-v``), after it the (sub)command's; ``--opt=value`` is ``--opt``; ``...``, ``[``, ``]`` and ``|`` inside
    brackets are synopsis punctuation; after a bare ``--`` the words are another program's."""
    problems, checked = [], 0
    for code in _code(text):
        for words in _segments(code):
            if not words or words[0] != "coldsnap":
                continue
            checked += 1
            line, current, named = " ".join(words), parser, False
            for word in words[1:]:
                word = word.strip("[]")
                if word == "--":  # what follows is another program's command line (an engine's start command)
                    break
                if word.startswith("-"):
                    option = word.split("=")[0]
                    if option not in _options(current):
                        where = current.prog if named else "coldsnap (before the command)"
                        problems.append(f"{line}: {where} has no option {option}")
                    continue
                choices = _subparsers(current)
                if choices and word not in choices:
                    problems.append(f"{line}: {current.prog} has no command {word!r} (it has {', '.join(choices)})")
                    break
                if choices:
                    current, named = choices[word], True
            else:
                if _subparsers(current) and not any(w in ("--help", "-h", "--version") for w in words):
                    problems.append(f"{line}: names no command of {current.prog}")
    return problems, checked


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_command_line_in_the_guide_exists_in_the_cli() -> None:
    """Fails naming each ``coldsnap`` line of docs/operations.md with a misspelled, removed or renamed command,
    subcommand or option (``coldsnap cache gc --older-then``), or that names no command; and when the guide's code
    holds fewer than 10 command lines (the extraction stopped finding them)."""
    problems, checked = command_problems(GUIDE.read_text(encoding="utf-8"), build_parser())
    assert not problems, "docs/operations.md names what the CLI lacks:\n" + "\n".join(problems)
    assert checked >= 10, f"only {checked} coldsnap command lines found in docs/operations.md"


@pytest.mark.parametrize(
    ("line", "wanted"),
    [
        ("`coldsnap cache gc --older-then 60`", "coldsnap cache gc has no option --older-then"),
        ("`coldsnap cache prune`", "has no command 'prune'"),
        ("```\nCOLDSNAP_STATE_ROOT=/s coldsnap stauts --json\n```", "has no command 'stauts'"),
        ("`coldsnap --verbos stage ART`", "coldsnap (before the command) has no option --verbos"),
        ("`coldsnap stage ART --fail-on-fallback`", "coldsnap stage has no option --fail-on-fallback"),
        ("`coldsnap cache`", "names no command of coldsnap cache"),
    ],
)
def test_the_check_sees_a_misspelled_command_or_option(line: str, wanted: str) -> None:
    """The extraction itself: each misspelling is reported (fails if the check stopped reading a shape of line
    that the guide uses: an inline span, a fenced block with a variable before the command, a global option)."""
    problems, checked = command_problems(line, build_parser())
    assert checked == 1 and any(wanted in p for p in problems), problems


def test_the_check_passes_synopses_pipelines_and_engine_commands() -> None:
    """A synopsis (``[--json | --format F]``), a pipeline into another program and an engine command after ``--``
    (``coldsnap export ... -- vllm serve ...``) are not misread as options of coldsnap (fails if a pipe inside
    brackets cut the line, or jq's or vLLM's options were charged to coldsnap)."""
    text = "`coldsnap status [--json | --format prometheus] --last 10` `coldsnap cache ls --json | jq -r .x --raw`"
    assert command_problems(text, build_parser()) == ([], 2)
    # after a bare --, an engine's own options: yet the options before it are still checked
    text = "`coldsnap status --last 3 -- vllm serve M --load-format coldsnap` `coldsnap status --lats 3 -- x`"
    problems, checked = command_problems(text, build_parser())
    assert checked == 2 and len(problems) == 1 and "has no option --lats" in problems[0], problems


def test_every_setting_named_in_the_guide_is_in_the_settings_table() -> None:
    """Fails naming each ``COLDSNAP_*`` name of docs/operations.md that no row of the settings table declares."""
    variables = {s.variable for s in SETTINGS if s.variable}
    named = set(_VARIABLE.findall(GUIDE.read_text(encoding="utf-8")))
    assert named, "docs/operations.md names no COLDSNAP_* setting"
    assert not named - variables, f"not in coldsnap_core.settings.SETTINGS: {sorted(named - variables)}"


def test_every_link_in_the_guide_resolves() -> None:
    """Fails naming each relative link of docs/operations.md to a missing file, and each ``format.md#anchor``
    that is no heading of docs/format.md (a renumbered section)."""
    anchors = {
        _slug(line.lstrip("#"))
        for line in (ROOT / "docs" / "format.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    }
    broken = []
    for target in _LINK.findall(GUIDE.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        resolved = (GUIDE.parent / path).resolve() if path else GUIDE
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.name == "format.md" and anchor not in anchors:
            broken.append(f"{target}: no heading of docs/format.md has the anchor {anchor!r}")
    assert not broken, "docs/operations.md links nowhere:\n" + "\n".join(broken)
