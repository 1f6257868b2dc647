"""Per-process state shared by the loader and the sleep backend.

vLLM constructs a sleep-mode backend with no arguments and gives it no handle on the worker or the
model (vLLM ``device_allocator/sleep_mode_backend.py``), so the loader publishes what it observed here, in the same
worker process, and the backend reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.format.manifest import ModelIdentity, PackRef, WorkerIdentity
from coldsnap_core.load_policy import ModelWrite
from coldsnap_core.settings import LOCK_TIMEOUT_SECONDS

ObservedModelWrite = ModelWrite
"""A destination byte range that the loader filled from the checkpoint and nothing rewrote before the
end of ``load_weights`` (:class:`coldsnap_core.load_policy.ModelWrite`: ``address``, ``size_bytes``,
``provenance``)."""


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
        verify_extents: the loader's resolved ``verify_extents`` setting (``COLDSNAP_VERIFY_EXTENTS`` or
            the extra-config key): the sleep backend hashes every model extent while waking.
        lock_timeout_s: the loader's resolved ``lock_timeout`` setting, in seconds: how long the sleep
            backend's cache waits for a pack's lock.
    """

    worker: WorkerIdentity
    model: ModelIdentity | None
    writes: tuple[ObservedModelWrite, ...]
    pack: PackRef | None
    artifact_dir: Path | None
    state_root: Path
    hf_cache_dir: Path | None = None
    verify_extents: bool = False
    lock_timeout_s: float = LOCK_TIMEOUT_SECONDS


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
