"""tqdm byte progress bars for the CLI (quiet when stderr is not a terminal: ``disable=None``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from tqdm import tqdm


@contextlib.contextmanager
def byte_bar(desc: str, total_bytes: int | None) -> Iterator[Callable[[int], object]]:
    """A progress bar over ``total_bytes`` bytes (``None``: unknown); yields its ``update``."""
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False, disable=None) as bar:
        yield bar.update


class BarFactory:
    """Makes bars on demand (``(description, total_bytes) -> update``) and closes them all at once."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def __call__(self, desc: str, total_bytes: int) -> Callable[[int], object]:
        return self._stack.enter_context(byte_bar(desc, total_bytes))

    def close(self) -> None:
        self._stack.close()


def quiet_hub_bars() -> None:
    """Silence ``huggingface_hub``'s own upload and download bars unless stderr is a terminal (its bars,
    unlike ours, print into logs and pipes too)."""
    if not sys.stderr.isatty():
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
