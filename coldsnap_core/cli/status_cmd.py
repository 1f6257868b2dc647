"""``coldsnap status``: what the recent worker loads did, per artifact, from the load outcome log
(``docs/format.md`` §10.3); ``--format prometheus``: :func:`coldsnap_core.metrics.node_exposition`. Exit codes:
``docs/format.md`` §8 (``--fail-on-fallback`` is for alerting: an alert that cannot see a load must not pass)."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from coldsnap_core._io import os_error
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli._output import add_outcome_log_option, print_json
from coldsnap_core.errors import EXIT_INTEGRITY, FileAccessError, UnsafePathError
from coldsnap_core.metrics import node_exposition
from coldsnap_core.outcomes import OUTCOMES, read_outcomes, summarize
from coldsnap_core.settings import OUTCOME_LOG_ENV

DEFAULT_LAST_LINES = 1000


def _line(doc: dict[str, object]) -> str:
    """One load of the log, with control characters escaped (its fields come from the log and an artifact's author)."""
    text = f"{doc.get('outcome')} {doc.get('time')} {doc.get('engine')} {doc.get('worker')} on {doc.get('host')} ({doc.get('seconds')} s"
    if doc.get("materialization_started"):
        text += ", materialization started"
    text += ")"
    if doc.get("derived_cache") is not None:  # docs/format.md §17.4
        text += f"; derived cache {doc.get('derived_cache')}"
        if doc.get("derived_cache_reason"):
            text += f" ({doc.get('derived_cache_reason')})"
    if doc.get("rule") is not None:
        text += f": rule {doc.get('rule')}, file {doc.get('file')}: {doc.get('detail')}"
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _status(args: argparse.Namespace) -> int:
    path = args.settings.outcome_log_path
    last = args.last or (sys.maxsize if args.format == "prometheus" else DEFAULT_LAST_LINES)
    try:
        lines, skipped = read_outcomes(path, last)
    except OSError as exc:
        if exc.errno == errno.ELOOP and path.is_symlink():  # O_NOFOLLOW: "Too many levels of symbolic links"
            raise UnsafePathError(
                "the load outcome log is a symbolic link, which is not followed; give the log's real path",
                file=path,
            ) from exc
        raise os_error("cannot read the load outcome log", exc, path) from exc
    exists = bool(lines) or skipped > 0 or os.path.lexists(path)  # read_outcomes reads a missing log as empty
    if not exists and args.fail_on_fallback:
        raise FileAccessError(
            f"the load outcome log does not exist ({'nor its folder' if not path.parent.is_dir() else 'no load recorded yet'}):"
            f" --fail-on-fallback cannot tell whether a load fell back; check --outcome-log, ${OUTCOME_LOG_ENV} and the state root",
            file=path,
        )
    if args.fail_on_fallback and not lines and skipped:
        raise FileAccessError(
            f"the load outcome log holds no readable load outcome ({skipped} malformed line(s) in the last"
            f" {last} read): --fail-on-fallback cannot tell whether a load fell back",
            file=path,
        )
    summaries = summarize(lines)
    if args.format == "prometheus":
        sys.stdout.write(node_exposition(lines, PayloadCache(args.state_root, lock_timeout_seconds=args.lock_timeout_s)))
    elif args.format == "json":
        doc = {
            "outcome_log": str(path),
            "exists": exists,
            "lines": len(lines),
            "skipped": skipped,
            "artifacts": [s.to_json() for s in summaries],
        }
        print_json(doc)
    else:
        shown = path if exists else f"{path} (does not exist{'' if path.parent.is_dir() else ', nor its folder'})"
        print(
            f"outcome log: {shown} ({len(lines)} load(s) read" + (f", {skipped} malformed line(s) skipped)" if skipped else ")")
        )
        if not summaries:
            print("no load outcomes recorded")
        for s in summaries:
            counts = ", ".join(f"{s.counts[o]} {o}" for o in OUTCOMES if s.counts[o])
            print(f"{s.artifact_dir or '(no artifact folder)'}: {counts}")
            if s.derived_cache and any(s.derived_cache.values()):
                seeds = ", ".join(f"{n} {v}" for v, n in s.derived_cache.items() if n)
                print(f"  derived-cache seeds: {seeds}")
            print(f"  last: {_line(s.last)}")
            if s.last_failure is not None and s.last_failure is not s.last:
                print(f"  last failure: {_line(s.last_failure)}")
    if args.fail_on_fallback and any(s.last.get("outcome") in ("fell-back", "refused") for s in summaries):
        return EXIT_INTEGRITY
    return 0


def _positive_count(text: str) -> int:
    """``--last``: a whole number >= 1 in ASCII digits."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of loads >= 1")
    return int(text)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="summarize recent worker loads per artifact (restored / captured / fell back)",
        description="Summarize the load outcome log per artifact folder. Exit codes: 0 ok, 1 with --fail-on-fallback "
        "when the latest load of an artifact fell back or was refused, 4 the log cannot be read (with "
        "--fail-on-fallback: also when it does not exist or holds only malformed lines).",
    )
    p.add_argument("--state-root", help="the state root (default: $COLDSNAP_STATE_ROOT or ~/.cache/coldsnap)")
    add_outcome_log_option(p, "the outcome log")
    p.add_argument(
        "--last",
        type=_positive_count,
        metavar="N",
        help=f"read the last N loads, N >= 1 (default {DEFAULT_LAST_LINES}; --format prometheus: every load in the log)",
    )
    p.add_argument(
        "--format",
        choices=("text", "json", "prometheus"),
        default="text",
        help="text (default), json, or prometheus: the node's view (loads per artifact, outcome and rule; cache objects,"
        " bytes and the age of each one's last full verification) for a node exporter's textfile collector",
    )
    p.add_argument("--json", dest="format", action="store_const", const="json", help="print JSON (--format json)")
    p.add_argument(
        "--fail-on-fallback",
        action="store_true",
        help="exit 1 when the latest load of any artifact fell back or was refused, 4 when the log does not exist or"
        " holds only malformed lines",
    )
    p.set_defaults(func=_status)
