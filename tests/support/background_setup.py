"""Wait for a set-up step that ``scripts/test.sh`` runs in the background while the tests already run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

_TIMED_OUT: dict[Path, str] = {}
"""The background steps this process already waited the whole timeout for, with the message it failed with."""


def wait_for_setup(what: str, status: Path, log: Path | None, *, timeout_s: float, poll_s: float = 1.0) -> None:
    """Wait until the background step ``what`` (a script's name, for the messages) has ended: it writes its exit
    status to ``status`` when it ends (polled every ``poll_s`` seconds). Returns when that status is ``0``.

    Raises:
        pytest.fail.Exception: the step failed (the message has the end of its output, ``log``), or ``status``
            did not appear within ``timeout_s`` seconds (or an earlier wait of this process for it timed out: the
            later ones fail at once). What it set up is then half made, and the calling test
            would otherwise fail, or skip, for a reason that is not its own.
    """
    if status in _TIMED_OUT:  # one deadline per build: a later test of the same worker does not wait it out again
        pytest.fail(_TIMED_OUT[status], pytrace=False)
    deadline = time.monotonic() + timeout_s
    while not status.exists():
        if time.monotonic() > deadline:
            _TIMED_OUT[status] = f"{what} has not ended after {timeout_s:.0f} s ({status} is absent)"
            pytest.fail(_TIMED_OUT[status], pytrace=False)
        time.sleep(poll_s)
    code = status.read_text().strip()
    if code != "0":
        output = log.read_text(errors="replace")[-6000:] if log is not None and log.exists() else "(no output)"
        pytest.fail(f"{what} failed (exit status {code}); its output:\n{output}", pytrace=False)
