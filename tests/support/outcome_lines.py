"""The load outcome log lines one engine start appended (``docs/format.md`` §10.3): what every engine plugin
leaves, whatever the engine, so the conformance suite (``tests/conformance/suite.py``) reads each start by them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

from coldsnap_core.settings import OUTCOME_LOG_ENV, ColdsnapSettings


def outcome_log_of(env: Mapping[str, str]) -> Path | None:
    """The outcome log a start with the ``COLDSNAP_*`` variables of ``env`` appends to (the settings' own rule);
    ``None`` when ``env`` names no state root and no log (no test reads the default one, in the home folder)."""
    chosen = {name: env[name] for name in (OUTCOME_LOG_ENV, "COLDSNAP_STATE_ROOT") if env.get(name, "").strip()}
    return ColdsnapSettings.resolve(chosen)[0].outcome_log_path if chosen else None


@contextlib.contextmanager
def appended_lines(log: Path | None) -> Iterator[list[dict]]:
    """The lines appended to ``log`` while the block runs (the list is filled when the block ends)."""
    start = log.stat().st_size if log is not None and log.exists() else 0
    lines: list[dict] = []
    try:
        yield lines
    finally:
        if log is not None and log.exists():
            with open(log, "rb") as f:
                f.seek(start)
                lines.extend(json.loads(line) for line in f.read().splitlines() if line.strip())
