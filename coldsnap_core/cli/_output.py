"""What a command prints on stdout: lines for people, or with ``--json`` one JSON document (``docs/format.md`` §8).

Every command takes ``--json`` (:func:`add_json_option`). With it, stdout holds exactly one document: the command's
result, or, when the command stops on an error, ``{"command": ..., "error": {...}}`` (:func:`error_json`: the rule,
the message, the file, allocation and offset, and the exit code, which is the command's exit code either way).
Progress and warnings stay on stderr.
"""

from __future__ import annotations

import argparse
import json

from coldsnap_core.errors import ColdsnapError


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout (an error too, with its rule and exit code)"
    )


def wants_json(args: argparse.Namespace) -> bool:
    """Whether the command was asked for JSON: ``--json``, or ``status --format json`` (which its ``--json`` sets)."""
    return bool(getattr(args, "json", False)) or getattr(args, "format", None) == "json"


def print_json(doc: object) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True))


def error_json(exc: ColdsnapError) -> dict[str, object]:
    """``exc`` as a JSON object: ``rule``, ``message`` (the whole text, as the command prints it), ``detail``,
    ``file``, ``allocation``, ``offset_bytes`` (``None`` when the error names none) and ``exit_code``."""
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
