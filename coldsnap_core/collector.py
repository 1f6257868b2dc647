"""Pausing Python's cyclic garbage collector around bookkeeping of many small objects."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (slow in an engine process); vLLM runs ``gc.collect()`` right after
    ``load_weights`` (``vllm/model_executor/model_loader/base_loader.py``), so nothing accumulates."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
