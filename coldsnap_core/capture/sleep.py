"""The native capture at a level-1 sleep (``docs/format.md`` §6.2): which observed model writes still hold their
loaded bytes (vLLM's ``process_weights_after_loading`` may have rewritten them), and the capture of the live
allocations through the capture core into a process-local sleep capsule."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from coldsnap_core.artifact.capsules import replace_dir_atomically
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.payload import ModelRange, hash_ranges, plan_payload
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.errors import ColdsnapError
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.descriptor import WORKERS_DIRNAME
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import (
    NATIVE_MANIFEST_FILENAME,
    RESIDUAL_FILENAME,
    ModelIdentity,
    NativeManifest,
    PackRef,
    WorkerIdentity,
)

logger = logging.getLogger(__name__)

_READ_BYTES = 8 << 20


class LoadedWorker(Protocol):
    """What a loader published about the model it loaded (``coldsnap_vllm.state.WorkerLoadState`` is one)."""

    worker: WorkerIdentity
    model: ModelIdentity | None
    pack: PackRef | None
    artifact_dir: Path | None
    hf_cache_dir: Path | None


class ReferenceDigests:
    """The SHA-256 each observed model write had right after ``load_weights`` (``docs/format.md`` §6.2: from the
    artifact's native manifest, else the pinned checkpoint file via ``huggingface_hub.try_to_load_from_cache``)."""

    def __init__(self, state: LoadedWorker) -> None:
        self.state = state
        self.manifest: NativeManifest | None = None
        self._digests: dict[tuple[ExtentProvenance, int], str | None] = {}
        self._files: dict[str, Path | None] = {}
        self._load_manifest()

    def _load_manifest(self) -> None:
        if self.state.artifact_dir is None:
            return
        path = self.state.artifact_dir / WORKERS_DIRNAME / self.state.worker.capsule_name / NATIVE_MANIFEST_FILENAME
        if not path.is_file():
            return
        try:
            manifest = NativeManifest.read(path)
        except ColdsnapError as exc:
            logger.warning("coldsnap: ignoring the artifact manifest as a sleep reference: %s", exc)
            return
        if manifest.worker != self.state.worker:
            logger.warning("coldsnap: %s belongs to %s, not %s; ignored", path, manifest.worker, self.state.worker)
            return
        if self.state.pack is not None and manifest.pack.sha256 != self.state.pack.sha256:
            logger.warning(
                "coldsnap: %s names pack %s, the loader published %s; ignored", path, manifest.pack.sha256, self.state.pack.sha256
            )
            return
        self.manifest = manifest
        for extent in manifest.model_extents:
            self._digests[(extent.provenance, extent.size_bytes)] = extent.sha256

    def expected(self, provenance: ExtentProvenance, size_bytes: int) -> str | None:
        """The digest the write of ``provenance`` (``size_bytes`` destination bytes) had, or ``None``."""
        key = (provenance, size_bytes)
        if key not in self._digests:
            self._digests[key] = self._from_checkpoint(provenance, size_bytes)
        return self._digests[key]

    def _checkpoint_file(self, name: str) -> Path | None:
        if name in self._files:
            return self._files[name]
        path = None
        model: ModelIdentity | None = self.state.model
        entry = next((f for f in model.files if f.name == name), None) if model is not None else None
        if model is not None and entry is not None:
            root = Path(model.source)
            if root.is_dir():
                path = root / name
            else:
                try:
                    import huggingface_hub

                    cached = huggingface_hub.try_to_load_from_cache(
                        model.source, name, cache_dir=self.state.hf_cache_dir, revision=model.revision
                    )
                    path = Path(cached) if isinstance(cached, str) else None
                except Exception as exc:  # an unusable repo id or cache layout: no reference
                    logger.debug("coldsnap: no cached %s of %s: %s", name, model.source, exc)
            if path is not None and (not path.is_file() or path.stat().st_size != entry.size_bytes):
                logger.warning(
                    "coldsnap: checkpoint file %s is missing or not %d bytes; no reference digests from it",
                    path,
                    entry.size_bytes,
                )
                path = None
        self._files[name] = path
        return path

    def _from_checkpoint(self, provenance: ExtentProvenance, size_bytes: int) -> str | None:
        if provenance.dtype_converted or provenance.source_size_bytes != size_bytes or provenance.source_run_bytes <= 0:
            return None
        path = self._checkpoint_file(provenance.checkpoint_file)
        if path is None:
            return None
        digest = hashlib.sha256()
        run_start = provenance.source_offset_bytes
        with open(path, "rb", buffering=0) as f:
            for done in range(0, size_bytes, provenance.source_run_bytes):
                position = run_start
                end = run_start + min(provenance.source_run_bytes, size_bytes - done)
                while position < end:
                    data = os.pread(f.fileno(), min(_READ_BYTES, end - position), position)
                    if not data:
                        return None
                    digest.update(data)
                    position += len(data)
                run_start += provenance.source_run_stride_bytes
        return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class NativeCapture:
    """What a native capture at a level-1 sleep wrote; ``rewritten``: the observed writes that are residual now."""

    capsule_dir: Path
    state_root: Path
    manifest: NativeManifest
    pack_path: Path
    pack_written: bool
    rewritten: tuple[ModelRange, ...]
    seconds: float

    @property
    def blob_path(self) -> Path:
        return self.capsule_dir / RESIDUAL_FILENAME


def capture_native(
    allocation_map: AllocationMap,
    allocations: Sequence[LiveAllocation],
    backend: CopyBackend,
    writes: Sequence[ModelRange],
    references: ReferenceDigests,
    *,
    worker: WorkerIdentity,
    model: ModelIdentity | None,
    cache: PayloadCache,
    capsule_dir: Path,
    log: logging.Logger = logger,
) -> NativeCapture:
    """Capture the live allocations into the pack (the artifact's when the extent contents are its) and the sleep
    capsule at ``capsule_dir`` (``model`` ``None``: no recovery manifest); ``log``: the engine plugin's logger.

    Raises:
        ObserverError: the writes are not sorted, disjoint and in bounds (nothing written).
        PackDigestMismatchError: rebuilding the artifact's pack from live bytes gave other bytes.
        ManifestError: the manifest this capture built fails the verifier (a bug; nothing committed).
        InsufficientSpaceError / CacheError: writing failed (no half-written capsule remains).
    """
    started = time.perf_counter()
    valid: list[tuple[ModelRange, str]] = []  # (range, live digest) of each write that still holds its loaded bytes
    rewritten: list[ModelRange] = []
    for r, digest in zip(writes, hash_ranges(writes, allocations, backend), strict=True):
        if references.expected(r.provenance, r.size_bytes) == digest:
            valid.append((r, digest))
        else:
            rewritten.append(r)
    if rewritten:
        log.info(
            "coldsnap: %d of %d model writes (%d bytes) no longer hold their loaded bytes; they are residual",
            len(rewritten),
            len(writes),
            sum(r.size_bytes for r in rewritten),
        )
    plan = plan_payload(allocation_map, allocations, backend, [r for r, _ in valid], [d for _, d in valid])
    reference, expected = references.manifest, None
    if reference is not None and set(plan.locate) == {(e.sha256, e.size_bytes) for e in reference.model_extents}:
        expected = reference.pack  # the artifact's pack: admitted, or rebuilt with its digest
    pack, pack_written = plan.ensure_pack(cache, expected)
    fill = functools.partial(plan.write_capsule_files, capture_point="native", worker=worker, pack=pack, model=model, target=None)
    manifest = replace_dir_atomically(capsule_dir, fill).native
    capture = NativeCapture(
        capsule_dir,
        cache.state_root,
        manifest,
        cache.object_path(pack.sha256),
        pack_written,
        tuple(rewritten),
        time.perf_counter() - started,
    )
    log.info(
        "coldsnap: native capture of %s: %d allocations, %d model bytes in %d extents (pack %s, %s), %d residual bytes, %.2f s",
        worker.capsule_name,
        len(allocations),
        manifest.model_bytes,
        len(manifest.model_extents),
        pack.sha256[:12],
        "written" if pack_written else "already cached",
        manifest.residual_bytes,
        capture.seconds,
    )
    return capture
