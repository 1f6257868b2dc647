"""The ``coldsnap`` command line: one module per subcommand, each with ``add_parser(subparsers)``, whose ``func``
returns the exit code (``docs/format.md`` §8). A ``ColdsnapError`` stops the command with its message on stderr (under
``--json``, a JSON document on stdout) and its ``exit_code``; an untyped ``OSError`` is rule ``io`` and a module
``pip install coldsnap`` leaves out names its extra (:func:`coldsnap_core.cli._output.missing_dependency`), both exit 4."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from coldsnap_core._io import unexpected_os_error
from coldsnap_core._version import __version__
from coldsnap_core.cli._output import command_name, error_json, missing_dependency, print_json, wants_json
from coldsnap_core.errors import EXIT_OTHER, ColdsnapError
from coldsnap_core.format._strict import FORMAT_VERSION
from coldsnap_core.settings import COMMAND_SETTINGS, KEYS, ColdsnapSettings

#: Subcommand modules, in ``--help`` order.
COMMAND_MODULES = tuple(
    f"coldsnap_core.cli.{name}_cmd"
    for name in ("inspect", "verify", "export", "stage", "publish", "pull", "cache", "status", "doctor")
)


class _UsageError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors exit 4, not argparse's 2 (a malformed manifest here): :func:`main` reports them."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="coldsnap",
        description="Export, inspect, verify, stage, publish and pull coldsnap artifacts (format 9).",
        epilog="Exit codes: 0 verified/ok, 1 content mismatch or corruption, 2 malformed or unsupported manifest, "
        "3 missing object, 4 other error, 5 capsule not qualified for this target (a native restore); doctor: 10-15, the "
        "first failed check. Every command takes --json (one JSON document on stdout, an error too).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    parser.add_argument("--version", action="version", version=f"coldsnap {__version__} (artifact format {FORMAT_VERSION})")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def _command_named(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The (sub)command ``argv`` names (``cache verify``), as far as its words name one; ``None`` when none."""
    names: list[str] = []
    for word in (w for w in argv if not w.startswith("-")):
        choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
        if word not in choices:
            break
        names.append(word)
        parser = choices[word]
    return " ".join(names) or None


def _usage_error(error: _UsageError, argv: Sequence[str], parser: argparse.ArgumentParser) -> int:
    """Under ``--json`` the usage error as a document (returns 4); else argparse's usage and message (exits 4)."""
    if "--json" in argv:
        command = _command_named(parser, argv)
        print_json({"command": command, "error": {"rule": "usage", "message": str(error), "exit_code": EXIT_OTHER}})
        return EXIT_OTHER
    error.parser.print_usage(sys.stderr)
    error.parser.exit(EXIT_OTHER, f"{error.parser.prog}: error: {error}\n")


def _failed(args: argparse.Namespace, error: dict[str, object]) -> int:
    """Report ``error`` (:func:`~coldsnap_core.cli._output.error_json`'s shape): a JSON document, or its message on stderr."""
    if wants_json(args):
        print_json({"command": command_name(args), "error": error})
    else:
        print(f"coldsnap {args.command}: {error['message']}", file=sys.stderr)
    return int(error["exit_code"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        return _usage_error(exc, argv, parser)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        flags = {key: value for key, value in vars(args).items() if key in KEYS}  # options over variables
        args.settings = ColdsnapSettings.resolve(flags=flags, rows=COMMAND_SETTINGS)[0]
        args.state_root, args.lock_timeout_s = args.settings.state_root, args.settings.lock_timeout_s
        return int(args.func(args))
    except ColdsnapError as exc:
        return _failed(args, error_json(exc))
    except ModuleNotFoundError as exc:
        return _failed(args, error_json(missing_dependency(exc)))
    except KeyboardInterrupt:
        return _failed(args, {"rule": "interrupted", "message": "interrupted", "exit_code": EXIT_OTHER})
    except OSError as exc:
        return _failed(args, error_json(unexpected_os_error(exc)))


if __name__ == "__main__":
    sys.exit(main())
