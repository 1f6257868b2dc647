"""Byte progress as plain lines, for logs (a terminal gets tqdm's bar, :func:`coldsnap_core.cli._output.byte_bar`)::

    stage 3f2a9c0e1b2d: 1.31GB of 2.62GB (50%), 0.854 GB/s, ETA 00:02
    stage 3f2a9c0e1b2d: 2.62GB of 2.62GB (100%), 0.861 GB/s, done in 00:03

A line at the first ``update``, then at most every :data:`LINE_INTERVAL_SECONDS`, and at ``close``; a progress
never updated writes none."""

from __future__ import annotations

import io
from collections.abc import Callable

from tqdm import tqdm

LINE_INTERVAL_SECONDS = 5.0
"""Seconds between two lines while bytes move (tqdm's ``mininterval``)."""


def progress_line(
    desc: str, done_bytes: float, total_bytes: float | None, rate_bytes_per_s: float | None, *, final: bool, elapsed_s: float
) -> str:
    """One progress line; ``final``: ``done in`` the elapsed time (``stopped after`` short of ``total_bytes``); ``?``: unknown."""
    size = tqdm.format_sizeof
    text = f"{desc}: {size(done_bytes, 'B', 1000)}"
    if total_bytes:
        text += f" of {size(total_bytes, 'B', 1000)} ({100 * done_bytes / total_bytes:.0f}%)"
    text += f", {rate_bytes_per_s / 1e9:.3f} GB/s" if rate_bytes_per_s else ", ? GB/s"
    if final:
        ended = "stopped after" if total_bytes and done_bytes < total_bytes else "done in"
        return text + f", {ended} {tqdm.format_interval(elapsed_s)}"
    if total_bytes and rate_bytes_per_s:
        return text + f", ETA {tqdm.format_interval(max(total_bytes - done_bytes, 0) / rate_bytes_per_s)}"
    return text + (", ETA ?" if total_bytes else "")


class ProgressLines(tqdm):
    """A tqdm byte progress whose every display is one :func:`progress_line` to ``emit`` (``update``: not thread-safe)."""

    monitor_interval = 0  # no tqdm monitor thread: with miniters=1 every update checks the interval itself

    def __init__(
        self, desc: str, total_bytes: int | None, emit: Callable[[str], object], *, interval_s: float | None = None
    ) -> None:
        self._emit = emit
        self._started = False  # no line until the first update
        super().__init__(
            desc=desc,
            total=total_bytes,
            unit="B",
            mininterval=LINE_INTERVAL_SECONDS if interval_s is None else interval_s,
            miniters=1,
            file=io.StringIO(),  # tqdm's own bar text and its closing newline go nowhere: display() writes the lines
            leave=True,
            disable=False,
        )

    def update(self, n: float | None = 1) -> bool | None:
        if not self._started:  # the first line, with what was done before this update (nothing)
            self._started = True
            self.display()
        return super().update(n)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "" or not self._started:  # tqdm clearing its bar (nothing to clear in a log), or nothing done yet
            return True
        d = self.format_dict
        final = self.disable  # close() disables the progress before its last display
        rate = d["rate"] or (d["n"] / d["elapsed"] if d["elapsed"] else None)
        self._emit(progress_line(d["prefix"] or "", d["n"], d["total"], rate, final=final, elapsed_s=d["elapsed"]))
        return True
