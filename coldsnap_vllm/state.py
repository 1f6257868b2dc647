"""Per-process state the loader publishes for the sleep backend: vLLM constructs a sleep-mode backend with no
arguments and no handle on the worker or the model (vLLM ``device_allocator/sleep_mode_backend.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.format.manifest import ModelIdentity, PackRef, WorkerIdentity
from coldsnap_core.load_policy import ModelWrite
from coldsnap_core.settings import LOCK_TIMEOUT_SECONDS


@dataclass(frozen=True, slots=True)
class WorkerLoadState:
    """What the coldsnap loader knows about this worker's model after ``load_weights``: ``writes`` sorted by address
    and disjoint; ``pack`` when one was captured, restored or materialized; ``artifact_dir`` ``None``: the sleep
    backend takes its reference digests from the checkpoint files; ``hf_cache_dir``: ``--download-dir``."""

    worker: WorkerIdentity
    model: ModelIdentity | None
    writes: tuple[ModelWrite, ...]
    pack: PackRef | None
    artifact_dir: Path | None
    state_root: Path
    hf_cache_dir: Path | None = None
    verify_extents: bool = False
    lock_timeout_s: float = LOCK_TIMEOUT_SECONDS


_current: WorkerLoadState | None = None


def publish(state: WorkerLoadState) -> None:
    """Record the state of the model this process just loaded (replaces any earlier one)."""
    global _current
    _current = state


def current() -> WorkerLoadState | None:
    """The state of the model this process loaded last, or ``None``."""
    return _current


def clear() -> None:
    global _current
    _current = None
