"""Materialization: rebuild a worker's pack from its resident model bytes after a recovery load.

After a safetensors (recovery) load the model extents of the worker's native manifest hold exactly
the bytes they held at capture, so the capture core (:mod:`coldsnap_core.capture.payload`, the one capture
uses) re-plans the manifest and rebuilds the byte-identical pack from memory, without reading the
checkpoint again (``docs/format.md`` §13). Modes (``COLDSNAP_MATERIALIZE``):

* ``async`` (vLLM default): a background thread (at a lower CPU priority) writes the pack while the
  engine serves; the first token is not delayed. It never raises into the caller: a failure is
  logged as a WARNING and kept on the handle.
* ``required``: the same work before the call returns; failures raise.
* ``off``: nothing.

Only the worker that owns the payload writes it: the function writes only the pack named by the
given manifest, from the given live allocations (the caller passes its own capsule's manifest).
Same-host duplicates (data-parallel workers sharing a digest) converge on one object through the
digest's lock: the first writes, the others find a valid object and skip. The lock prevents
duplicate work only; a writer that proceeds without it still cannot publish a wrong or partial file
(unique temporary names, SHA-256 checked against the manifest before the rename).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.payload import plan_manifest_payload
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.errors import ConfigurationError
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.manifest import NativeManifest, PackRef
from coldsnap_core.settings import MATERIALIZE_ENV, MATERIALIZE_MODES, MaterializeMode

logger = logging.getLogger(__name__)

BACKGROUND_NICE_INCREMENT = 10
"""The ``async`` writer thread lowers its own scheduling priority by this much (Linux, best effort)."""

__all__ = [
    "MATERIALIZE_ENV",
    "MATERIALIZE_MODES",
    "MaterializationHandle",
    "MaterializationResult",
    "MaterializeMode",
    "materialize_payload",
]


@dataclass(frozen=True, slots=True)
class MaterializationResult:
    """What a finished materialization produced.

    Attributes:
        pack: the pack (digest, size in bytes, derived path).
        path: the admitted object in the node-local cache.
        written: ``True`` if this call wrote the object, ``False`` if a valid one was already there.
        seconds: wall time of the work, in seconds.
    """

    pack: PackRef
    path: Path
    written: bool
    seconds: float


class MaterializationHandle:
    """A materialization in progress (``async``) or done (``required``).

    Attributes:
        pack: the pack being materialized.
        mode: ``async`` or ``required``.
    """

    def __init__(self, pack: PackRef, mode: MaterializeMode) -> None:
        self.pack = pack
        self.mode = mode
        self._done = threading.Event()
        self._result: MaterializationResult | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def wait(self, timeout_seconds: float | None = None) -> bool:
        """Block until the work is finished (or ``timeout_seconds`` passed); return whether it is finished.

        Never raises the work's error; read :attr:`error`.
        """
        return self._done.wait(timeout_seconds)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def result(self) -> MaterializationResult | None:
        """The result once finished successfully, else ``None``."""
        return self._result

    @property
    def error(self) -> BaseException | None:
        """The error once finished unsuccessfully, else ``None``."""
        return self._error

    def _finish(self, result: MaterializationResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done else ("failed" if self._error is not None else "done")
        return f"MaterializationHandle({self.pack.sha256[:12]}, mode={self.mode}, {state})"


def _materialize(
    manifest: NativeManifest, allocations: Sequence[LiveAllocation], backend: CopyBackend, cache: PayloadCache
) -> MaterializationResult:
    started = time.perf_counter()
    pack, written = plan_manifest_payload(manifest, allocations, backend).ensure_pack(cache, manifest.pack)
    seconds = time.perf_counter() - started
    if written:
        logger.info("coldsnap: materialized pack %s (%d bytes) in %.2f s", pack.sha256, pack.size_bytes, seconds)
    return MaterializationResult(pack, cache.object_path(pack.sha256), written, seconds)


def materialize_payload(
    manifest: NativeManifest,
    allocations: Sequence[LiveAllocation],
    backend: CopyBackend,
    cache: PayloadCache,
    *,
    mode: MaterializeMode,
    keepalive: object = None,
) -> MaterializationHandle | None:
    """Write ``manifest``'s pack into ``cache`` from the resident model bytes, unless a valid one exists.

    Args:
        manifest: this worker's native manifest (its model extents say where each stored content
            is resident; its ``pack`` is the digest the result must have).
        allocations: the live allocations, ``allocations[i].index == i``, sizes as in the manifest.
        backend: reads the allocations (host memory, or device-to-host copies).
        cache: the node-local cache.
        mode: ``async``, ``required`` or ``off``.
        keepalive: any object (tensors, a model) the background thread holds until it is done, so
            the memory behind ``allocations`` stays valid; released when the work finishes.

    Returns:
        ``None`` for ``off``; otherwise a handle (finished, for ``required``).

    Raises:
        ConfigurationError: ``mode`` is not one of the three.
        ``required`` only, and nothing half-written is left behind:
        ManifestError: a manifest rule or the live layout check failed.
        PackDigestMismatchError: the resident bytes do not produce the manifest's digest (they were
            changed after loading, or the manifest belongs to another model); nothing is kept.
        InsufficientSpaceError: the cache's file system filled up.
        UnsafePathError: a symbolic link in the cache.
    """
    if mode not in MATERIALIZE_MODES:
        raise ConfigurationError(f"mode={mode!r} is not one of {', '.join(MATERIALIZE_MODES)}")
    if mode == "off":
        return None
    handle = MaterializationHandle(manifest.pack, mode)
    if mode == "required":
        try:
            result = _materialize(manifest, allocations, backend, cache)
        except BaseException as exc:
            handle._finish(None, exc)
            raise
        handle._finish(result, None)
        return handle

    def run() -> None:
        nonlocal keepalive
        with contextlib.suppress(OSError, AttributeError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE_INCREMENT))
        try:
            result = _materialize(manifest, allocations, backend, cache)
        except BaseException as exc:
            logger.warning(
                "coldsnap: background materialization of pack %s failed; the next recovery load will retry: %s",
                manifest.pack.sha256,
                exc,
            )
            handle._finish(None, exc)
        else:
            handle._finish(result, None)
        finally:
            keepalive = None

    thread = threading.Thread(target=run, name=f"coldsnap-materialize-{manifest.pack.sha256[:12]}", daemon=True)
    handle._thread = thread
    thread.start()
    return handle
