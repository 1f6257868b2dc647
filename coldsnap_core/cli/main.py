"""The ``coldsnap`` command line.

Every subcommand lives in its own module under :mod:`coldsnap_core.cli` and exposes
``add_parser(subparsers)``; the parser's ``func`` returns the exit code. A
:class:`~coldsnap_core.errors.ColdsnapError` stops the command with its message on stderr and its
``exit_code`` (0 verified, 1 content mismatch or corruption, 2 malformed or unsupported manifest,
3 missing object, 4 other error; ``docs/format.md``, "Exit codes"). An ``OSError`` that no coldsnap
layer turned into a typed error is reported the same way, as rule ``io``
(:class:`~coldsnap_core.errors.FileAccessError`, naming the file), with exit code 4. A command that needs a module
``pip install coldsnap`` leaves out (torch, an engine) stops with a ``ConfigurationError`` naming the extra that
installs it (:mod:`coldsnap_core.cli._extras`), exit code 4.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from coldsnap_core._io import unexpected_os_error
from coldsnap_core._version import __version__
from coldsnap_core.cli._extras import missing_dependency
from coldsnap_core.errors import EXIT_OTHER, ColdsnapError
from coldsnap_core.format._strict import FORMAT_VERSION
from coldsnap_core.settings import COMMAND_SETTINGS, KEYS, ColdsnapSettings

#: Subcommand modules, in ``--help`` order.
COMMAND_MODULES = (
    "coldsnap_core.cli.inspect_cmd",
    "coldsnap_core.cli.verify_cmd",
    "coldsnap_core.cli.stage_cmd",
    "coldsnap_core.cli.publish_cmd",
    "coldsnap_core.cli.cache_cmd",
    "coldsnap_core.cli.status_cmd",
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors exit 4 ("other error"), not argparse's 2, which means
    "malformed or unsupported manifest" here."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_OTHER, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="coldsnap",
        description="Inspect, verify, stage and publish coldsnap artifacts (format 9).",
        epilog="Exit codes: 0 verified/ok, 1 content mismatch or corruption, 2 malformed or unsupported manifest, "
        "3 missing object, 4 other error, 5 capsule not qualified for this target (a native restore).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    parser.add_argument("--version", action="version", version=f"coldsnap {__version__} (artifact format {FORMAT_VERSION})")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def _resolve_environment(args: argparse.Namespace) -> None:
    """Where the CLI reads the environment, once, as it starts: the settings table's rows the command reads
    (:data:`~coldsnap_core.settings.COMMAND_SETTINGS`), with the options named as their keys (``--state-root``,
    ``--outcome-log``) over the variables, become ``args.settings``; ``args.state_root`` and
    ``args.lock_timeout_s`` are the cache's.

    Raises:
        ConfigurationError: a value is invalid (names the option or variable and the value).
    """
    flags = {key: value for key, value in vars(args).items() if key in KEYS}
    args.settings = ColdsnapSettings.resolve(flags=flags, rows=COMMAND_SETTINGS)[0]
    args.state_root, args.lock_timeout_s = args.settings.state_root, args.settings.lock_timeout_s


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        _resolve_environment(args)
        return int(args.func(args))
    except ColdsnapError as exc:
        print(f"coldsnap {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        error = missing_dependency(exc)
        print(f"coldsnap {args.command}: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"coldsnap {args.command}: interrupted", file=sys.stderr)
        return EXIT_OTHER
    except OSError as exc:
        error = unexpected_os_error(exc)
        print(f"coldsnap {args.command}: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
