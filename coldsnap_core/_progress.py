"""Byte progress as plain lines, for logs: what a Kubernetes log or a pipe shows of a long stage, fetch or hash.

A terminal gets tqdm's bar (``coldsnap_core.cli._progress``); anything else gets a :class:`ProgressLines`: tqdm
itself (its counting, its smoothed rate, its ``mininterval``), with :meth:`tqdm.tqdm.display` overridden to hand one
line to ``emit`` (``print`` to stderr, ``logger.info``) instead of redrawing a bar with carriage returns::

    stage 3f2a9c0e1b2d: 1.31GB of 2.62GB (50%), 0.854 GB/s, ETA 00:02
    stage 3f2a9c0e1b2d: 2.62GB of 2.62GB (100%), 0.861 GB/s, done in 00:03

A line is written when the progress starts (at its first ``update``, before counting it), at the first update at
least :data:`LINE_INTERVAL_SECONDS` after the previous line, and when it ends (tqdm's ``close``, with the overall
average rate). A progress that is never updated (the work found nothing to do: a trusted validation record, a pack
already cached) writes no line at all, not a ``0%`` line followed by a ``stopped after`` one.
"""

from __future__ import annotations

import io
from collections.abc import Callable

from tqdm import tqdm

LINE_INTERVAL_SECONDS = 5.0
"""Seconds between two lines while bytes move (tqdm's ``mininterval``, with ``miniters=1`` so every update checks
the time): at any rate that reports bytes at least every 5 s (every store and copy reports per chunk of at most
64 MiB) a line comes at least every 10 s."""


def progress_line(
    desc: str, done_bytes: float, total_bytes: float | None, rate_bytes_per_s: float | None, *, final: bool, elapsed_s: float
) -> str:
    """One progress line: ``desc``, the bytes done (and of how many, with the percentage), the rate in GB/s, and
    the ETA; when ``final``, ``done in`` the elapsed time, or ``stopped after`` it short of ``total_bytes`` (the work
    failed); ``?`` for a rate or ETA not known yet."""
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
    """A tqdm progress over bytes whose every display is one :func:`progress_line` handed to ``emit``.

    Use it as tqdm (``update(n)``, ``close()``, a context manager); like tqdm's, its ``update`` is not thread-safe
    (a caller reporting from several threads holds a lock around it).

    Args:
        desc: what moves (``stage 3f2a9c0e1b2d``).
        total_bytes: the bytes expected, or ``None`` when unknown (no percentage, no ETA).
        emit: called with each line, from the thread that reported the bytes.
        interval_s: seconds between two lines while bytes move (default :data:`LINE_INTERVAL_SECONDS`).
    """

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
