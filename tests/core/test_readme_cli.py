"""README's "The `coldsnap` command" section names every option of every subcommand, as ``--help`` has them
(read from the real parser, ``coldsnap_core.cli.main.build_parser``), so the README cannot fall behind the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

from coldsnap_core.cli.main import build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, list[str]]:
    """Every (sub)command path with its long options, ``--help`` excluded."""
    found: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_commands(sub, f"{prefix} {name}".strip()))
    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]
    found[prefix or "coldsnap"] = options
    return found


def test_every_cli_option_is_in_the_readme() -> None:
    """Fails naming each ``command --option`` that ``--help`` lists and the README's command block does not show
    on that command's own line (``coldsnap stage ARTIFACT ... --node-rank K``), or a command without a line."""
    section = _section(README.read_text(encoding="utf-8"), "## The `coldsnap` command")
    opening = section.index("```bash\n")
    block = section[opening : section.index("```\n", opening + 8)].splitlines()
    missing = []
    for command, options in _commands(build_parser()).items():
        start = "coldsnap [" if command == "coldsnap" else f"coldsnap {command} "
        shown = [line.split("#")[0] for line in block if line.startswith(start)]
        if not shown:
            if options:
                missing.append(f"{command} (no line)")
            continue
        missing += [f"{command} {option}" for option in options if option not in shown[0]]
    assert not missing, f"README 'The `coldsnap` command' lacks: {', '.join(missing)}"
