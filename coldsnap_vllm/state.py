"""Per-process state shared by the loader and the sleep backend.

vLLM constructs a sleep-mode backend with no arguments and gives it no handle on the worker or the
model (vLLM ``device_allocator/sleep_mode_backend.py``), so the loader publishes what it observed here, in the same
worker process, and the backend reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import ModelIdentity, PackRef, WorkerIdentity


@dataclass(frozen=True, slots=True)
class ObservedModelWrite:
    """A destination byte range that the loader filled from the checkpoint and nothing rewrote
    before the end of ``load_weights``.

    Attributes:
        address: absolute address of the first destination byte (host pointer, or CUDA virtual
            address inside a CuMem "weights" segment).
        size_bytes: length of the range.
        provenance: the checkpoint source of the bytes.
    """

    address: int
    size_bytes: int
    provenance: ExtentProvenance


@dataclass(frozen=True, slots=True)
class WorkerLoadState:
    """What the coldsnap loader knows about this worker's model after ``load_weights``.

    Attributes:
        worker: the worker's identity.
        model: the pinned model identity (``None`` if it could not be determined).
        writes: the observed model writes, sorted by address, disjoint.
        pack: the worker's pack, when one was captured, restored or materialized.
        artifact_dir: the artifact folder in use, or ``None`` (no ``COLDSNAP_ARTIFACT_DIR``: the sleep
            backend then takes its reference digests from the checkpoint files).
        state_root: the state root of the node-local cache.
        hf_cache_dir: the Hugging Face cache vLLM downloads into (``--download-dir``,
            ``load_config.download_dir``), or ``None`` for ``HF_HUB_CACHE``: where the sleep backend
            finds a repository's checkpoint files.
    """

    worker: WorkerIdentity
    model: ModelIdentity | None
    writes: tuple[ObservedModelWrite, ...]
    pack: PackRef | None
    artifact_dir: Path | None
    state_root: Path
    hf_cache_dir: Path | None = None


_lock = threading.Lock()
_current: WorkerLoadState | None = None


def publish(state: WorkerLoadState) -> None:
    """Record the state of the model this process just loaded (replaces any earlier one)."""
    global _current
    with _lock:
        _current = state


def current() -> WorkerLoadState | None:
    """The state of the model this process loaded last, or ``None``."""
    with _lock:
        return _current


def clear() -> None:
    global _current
    with _lock:
        _current = None
