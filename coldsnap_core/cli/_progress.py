"""Byte progress for the CLI on stderr: tqdm's bar on a terminal, else lines (:class:`coldsnap_core._progress.ProgressLines`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from tqdm import tqdm

from coldsnap_core._progress import ProgressLines


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
