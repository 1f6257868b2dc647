"""Materialization: rebuild a worker's pack from its resident model bytes after a recovery load, without reading the
checkpoint again (``docs/format.md`` §13: the modes ``async``, ``required``, ``off``)."""

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
from coldsnap_core.settings import MATERIALIZE_MODES, MaterializeMode

logger = logging.getLogger(__name__)

BACKGROUND_NICE_INCREMENT = 10
"""The ``async`` writer thread lowers its own scheduling priority by this much (best effort)."""


@dataclass(frozen=True, slots=True)
class MaterializationResult:
    """What a finished materialization produced; ``written``: ``False`` when a valid object was already there."""

    pack: PackRef
    path: Path
    written: bool
    seconds: float


class MaterializationHandle:
    """A materialization in progress (``async``) or done (``required``); ``result`` or ``error`` once finished."""

    def __init__(self, pack: PackRef, mode: MaterializeMode) -> None:
        self.pack = pack
        self.mode = mode
        self._done = threading.Event()
        self.result: MaterializationResult | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def wait(self, timeout_seconds: float | None = None) -> bool:
        """Block until the work is finished (or ``timeout_seconds`` passed); return whether it is (never raises its error)."""
        return self._done.wait(timeout_seconds)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, result: MaterializationResult | None, error: BaseException | None) -> None:
        self.result, self.error = result, error
        self._done.set()

    def __repr__(self) -> str:
        state = "running" if not self.done else ("failed" if self.error is not None else "done")
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
    """Write ``manifest``'s pack into ``cache`` from the resident model bytes, unless a valid one exists; ``keepalive``
    (tensors, a model) is held by the background thread until it is done. Returns ``None`` for ``off``, else a handle.

    Raises:
        ConfigurationError: ``mode`` is not one of the three.
        ``required`` only, and nothing half-written is left behind: ManifestError (a manifest rule or the live layout
        check), PackDigestMismatchError, InsufficientSpaceError, UnsafePathError (a symbolic link in the cache).
    """
    if mode not in MATERIALIZE_MODES:
        raise ConfigurationError(f"mode={mode!r} is not one of {', '.join(MATERIALIZE_MODES)}")
    if mode == "off":
        return None
    handle = MaterializationHandle(manifest.pack, mode)
    if mode == "required":
        handle._finish(_materialize(manifest, allocations, backend, cache), None)
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
