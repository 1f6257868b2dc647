"""What every command shares: its last options and what it prints on stdout, lines for people or with ``--json``
one JSON document (``docs/format.md`` §8): the result, or ``{"command": ..., "error": {...}}`` (:func:`error_json`).
Progress and warnings stay on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable

from coldsnap_core.errors import ColdsnapError


def add_command_options(
    parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], int], state_root: str = "the cache's state root"
) -> None:
    """``--state-root`` (``state_root`` says what it is), ``--json``, and ``run`` as the command."""
    parser.add_argument("--state-root", help=f"{state_root} (default: $COLDSNAP_STATE_ROOT or ~/.cache/coldsnap)")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout (an error too, with its rule and exit code)"
    )
    parser.set_defaults(func=run)


def add_outcome_log_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--outcome-log", metavar="PATH", help=f"{what} (default: $COLDSNAP_OUTCOME_LOG or <state-root>/load-outcomes.jsonl)"
    )


def seconds(text: str, *, above_zero: bool = False) -> float:
    """An argparse ``type``: a number of seconds >= 0 (> 0 ``above_zero``); ArgumentTypeError naming the text otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 if above_zero else value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds {'>' if above_zero else '>='} 0")
    return value


def positive_seconds(text: str) -> float:
    return seconds(text, above_zero=True)


def wants_json(args: argparse.Namespace) -> bool:
    """Whether the command was asked for JSON: ``--json``, or ``status --format json`` (which its ``--json`` sets)."""
    return bool(getattr(args, "json", False)) or getattr(args, "format", None) == "json"


def print_json(doc: object) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True))


def report(args: argparse.Namespace, doc: object, lines: Iterable[str] = (), done: str | None = None, code: int = 0) -> int:
    """The command's result: ``doc`` under ``--json``, else ``lines`` on stdout and ``done`` on stderr; returns ``code``."""
    if wants_json(args):
        print_json(doc)
        return code
    for line in lines:
        print(line)
    if done is not None:
        print(done, file=sys.stderr)
    return code


def error_json(exc: ColdsnapError) -> dict[str, object]:
    """``exc`` as a JSON object (``None`` for what it does not name), with its ``exit_code``."""
    return {
        "rule": exc.rule,
        "message": str(exc),
        "detail": exc.detail,
        "file": exc.file,
        "allocation": exc.allocation,
        "offset_bytes": exc.offset_bytes,
        "exit_code": exc.exit_code,
    }


def command_name(args: argparse.Namespace) -> str:
    """``stage``, ``cache verify``: the command as typed."""
    action = getattr(args, "cache_command", None)
    return f"{args.command} {action}" if action else str(args.command)
