"""The native capture taken at a level-1 sleep: pack (shared) + residual and manifest (a sleep capsule).

At ``suspend(level=1)`` the weights segments still hold the live model. This module

1. locates the loader's observed model writes in the segments (:func:`coldsnap_vllm.cumem.map_writes`);
2. hashes each write's live bytes and compares the digest with what the write held when the loader
   wrote it (:class:`ReferenceDigests`: the worker's manifest in the artifact, else the pinned
   checkpoint file's bytes). A write that still matches is a model extent; one that post-processing
   rewrote (or whose original digest cannot be established) becomes residual;
3. makes sure the pack of the model extents exists in the node-local cache: when the artifact's
   manifest has exactly the same extent contents, its pack is that pack (admitted, or rebuilt from
   the live bytes with its digest as the expected one); otherwise the canonical writer
   (:func:`coldsnap_core.capture.pack_writer.write_pack`) writes it from the live bytes;
4. writes the residual of every weights segment (all bytes not in a model extent) and the native
   manifest (capture point ``native``, the segments' captured addresses) into a process-local sleep
   capsule, ``<state_root>/sleep/<capsule_name>-pid<pid>-<hex16>/`` (unique to the process instance,
   held under its owner's lock: :mod:`coldsnap_core.artifact.sleep_capsules`), replaced as a whole.

Facts: ``docs/format.md`` §6.2 (the native capture point: hydration first remaps the captured
allocations at their addresses); vLLM ``model_executor/model_loader/utils.py``
(``process_weights_after_loading`` rewrites weight bytes after loading) and
``device_allocator/cumem.py`` (buffers and post-processed weights live in the "weights" segments, so
the residual is mandatory at level 1).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from coldsnap_core._io import write_file_durably
from coldsnap_core.artifact.capsules import replace_dir_atomically
from coldsnap_core.artifact.residual import write_residual
from coldsnap_core.artifact.sleep_capsules import sleep_dir
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.pack_writer import write_pack
from coldsnap_core.capture.payload_plan import ModelRange, PayloadPlan, plan_payload
from coldsnap_core.capture.worker import hash_ranges
from coldsnap_core.copy.base import CopyBackend, LiveAllocation
from coldsnap_core.errors import ColdsnapError, IntegrityError, MissingObjectError
from coldsnap_core.format.descriptor import WORKERS_DIRNAME
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import (
    NATIVE_MANIFEST_FILENAME,
    RECOVERY_MANIFEST_FILENAME,
    RESIDUAL_FILENAME,
    ModelIdentity,
    NativeManifest,
    PackRef,
    WorkerIdentity,
)
from coldsnap_core.format.verify import check_manifest
from coldsnap_vllm.cumem import WeightsSegment, live_allocations, map_writes, native_allocation_map
from coldsnap_vllm.state import WorkerLoadState

logger = logging.getLogger(__name__)
T = TypeVar("T")

_READ_BYTES = 8 << 20


def sleep_capsule_dir(state_root: Path, worker: WorkerIdentity) -> Path:
    """A fresh, unclaimed sleep capsule path ``<state_root>/sleep/<capsule_name>-pid<pid>-<hex16>``
    (:mod:`coldsnap_core.artifact.sleep_capsules`). Nobody holds its lock, so a sweep may remove it: the sleep
    backend captures into the folder of a :class:`~coldsnap_core.artifact.sleep_capsules.SleepCapsuleClaim`."""
    return sleep_dir(state_root) / f"{worker.capsule_name}-pid{os.getpid()}-{secrets.token_hex(8)}"


# --- what each write held when the loader wrote it ---------------------------------------------------


class ReferenceDigests:
    """The SHA-256 each observed model write had right after ``load_weights``.

    Sources, in order:

    1. the worker's native manifest in the artifact (``<artifact_dir>/workers/<capsule_name>/``),
       written by the loader's capture or restore: its model extents are keyed by provenance. It is
       used only when it names the pack the loader published (when one is published);
    2. the pinned checkpoint file (``ModelIdentity``: a local folder, or the Hugging Face cache vLLM
       downloads into, ``--download-dir`` else ``HF_HUB_CACHE``, via
       ``huggingface_hub.try_to_load_from_cache``) with the size the identity records: the write's
       source runs are read and hashed. A dtype-converting copy has no byte-equal source, so it has
       no reference from this source.

    A write with no reference is treated as rewritten (residual): that keeps non-checkpoint bytes out
    of the shared pack. Digests from checkpoint files are computed once and cached.

    Args:
        state: the loader's published state.
    """

    def __init__(self, state: WorkerLoadState) -> None:
        self.state = state
        self.manifest: NativeManifest | None = None
        self._by_source: dict[tuple[ExtentProvenance, int], str] = {}
        self._checkpoint_cache: dict[tuple[ExtentProvenance, int], str | None] = {}
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
            self._by_source[(extent.provenance, extent.size_bytes)] = extent.sha256

    def expected(self, provenance: ExtentProvenance, size_bytes: int) -> str | None:
        """The digest the write of ``provenance`` (``size_bytes`` destination bytes) had, or ``None``."""
        found = self._by_source.get((provenance, size_bytes))
        if found is not None:
            return found
        key = (provenance, size_bytes)
        if key not in self._checkpoint_cache:
            self._checkpoint_cache[key] = self._from_checkpoint(provenance, size_bytes)
        return self._checkpoint_cache[key]

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
        remaining = size_bytes
        run_start = provenance.source_offset_bytes
        with open(path, "rb", buffering=0) as f:
            while remaining > 0:
                run = min(provenance.source_run_bytes, remaining)
                position = run_start
                while position < run_start + run:
                    data = os.pread(f.fileno(), min(_READ_BYTES, run_start + run - position), position)
                    if not data:
                        return None
                    digest.update(data)
                    position += len(data)
                remaining -= run
                run_start += provenance.source_run_stride_bytes
        return digest.hexdigest()


# --- the capture -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SleepCapture:
    """What a level-1 sleep captured.

    Attributes:
        capsule_dir: the process-local sleep capsule.
        state_root: the state root whose node-local cache holds the pack.
        blob_path: the residual blob in it.
        manifest: the native manifest (capture point ``native``).
        segments: the weights segments, by allocation index.
        pack_path: the pack in the node-local cache.
        pack_written: whether this capture wrote the pack (``False``: an existing one was admitted).
        rewritten: observed writes whose live bytes no longer match their reference (residual now).
        seconds: wall time of the capture.
    """

    capsule_dir: Path
    state_root: Path
    blob_path: Path
    manifest: NativeManifest
    segments: tuple[WeightsSegment, ...]
    pack_path: Path
    pack_written: bool
    rewritten: tuple[ModelRange, ...]
    seconds: float


def capture_for_sleep(
    state: WorkerLoadState,
    segments: Sequence[WeightsSegment],
    backend: CopyBackend,
    references: ReferenceDigests,
    *,
    capsule_dir: Path | None = None,
) -> SleepCapture:
    """Capture the live weights segments into pack + sleep capsule (see the module docstring).

    Args:
        state: the loader's published state (worker, writes, artifact, state root).
        segments: the awake weights segments, sorted by address.
        backend: reads the segments (device-to-host on CUDA).
        references: the writes' reference digests (keep one per loaded model; it caches).
        capsule_dir: where the capsule goes: the folder of the caller's
            :class:`~coldsnap_core.artifact.sleep_capsules.SleepCapsuleClaim` (default :func:`sleep_capsule_dir`,
            an unclaimed name, for tools and tests).

    Returns:
        The :class:`SleepCapture`; nothing has been released yet.

    Raises:
        ObserverError: a write straddles a segment end or writes overlap (nothing written).
        PackDigestMismatchError: rebuilding the artifact's pack from live bytes gave other bytes.
        ManifestError: the manifest this capture built fails the verifier (a bug; nothing committed).
        InsufficientSpaceError / CacheError: writing failed (no half-written capsule remains).
    """
    started = time.perf_counter()
    allocations = live_allocations(segments)
    valid, rewritten = _still_loaded(map_writes(state.writes, segments).ranges, allocations, backend, references)
    plan = plan_payload(allocations, [r for r, _ in valid], [d for _, d in valid])
    cache = PayloadCache(state.state_root, lock_timeout_seconds=state.lock_timeout_s)
    pack, pack_written = _ensure_pack(plan, backend, cache, references.manifest)
    allocation_map = native_allocation_map(segments)
    final = capsule_dir or sleep_capsule_dir(state.state_root, state.worker)

    def fill(staging: Path) -> NativeManifest:
        residual = write_residual(plan.residual_extents, allocations, backend, staging / RESIDUAL_FILENAME)
        manifest = plan.native_manifest(
            capture_point="native", worker=state.worker, allocations=allocation_map, pack=pack, residual=residual
        )
        check_manifest(manifest, file=str(final / NATIVE_MANIFEST_FILENAME))
        write_file_durably(staging / NATIVE_MANIFEST_FILENAME, manifest.dumps())
        if state.model is not None:
            recovery = plan.recovery_manifest(
                worker=state.worker, allocations=allocation_map, model=state.model, residual=residual
            )
            write_file_durably(staging / RECOVERY_MANIFEST_FILENAME, recovery.dumps())
        return manifest

    manifest = replace_dir_atomically(final, fill)
    capture = SleepCapture(
        capsule_dir=final,
        state_root=cache.state_root,
        blob_path=final / RESIDUAL_FILENAME,
        manifest=manifest,
        segments=tuple(segments),
        pack_path=cache.object_path(pack.sha256),
        pack_written=pack_written,
        rewritten=tuple(rewritten),
        seconds=time.perf_counter() - started,
    )
    logger.info(
        "coldsnap: sleep capture of %s: %d weights segments, %d model bytes in %d extents (pack %s, %s), %d residual bytes, %.2f s",
        state.worker.capsule_name,
        len(segments),
        manifest.model_bytes,
        len(plan.model_extents),
        pack.sha256[:12],
        "written" if pack_written else "already cached",
        manifest.residual_bytes,
        capture.seconds,
    )
    return capture


def _still_loaded(
    ranges: Sequence[ModelRange], allocations: Sequence[LiveAllocation], backend: CopyBackend, references: ReferenceDigests
) -> tuple[list[tuple[ModelRange, str]], list[ModelRange]]:
    """``(range, live digest)`` of each of the loader's model writes that still holds its loaded bytes (its live
    SHA-256 is the reference's), and the ranges rewritten since, which are residual (one INFO line says how many)."""
    valid: list[tuple[ModelRange, str]] = []
    rewritten: list[ModelRange] = []
    for r, digest in zip(ranges, hash_ranges(ranges, allocations, backend), strict=True):
        if references.expected(r.provenance, r.size_bytes) == digest:
            valid.append((r, digest))
        else:
            rewritten.append(r)
    if rewritten:
        logger.info(
            "coldsnap: %d of %d model writes (%d bytes) no longer hold their loaded bytes; they are residual",
            len(rewritten),
            len(ranges),
            sum(r.size_bytes for r in rewritten),
        )
    return valid, rewritten


def _ensure_pack(
    plan: PayloadPlan, backend: CopyBackend, cache: PayloadCache, reference: NativeManifest | None
) -> tuple[PackRef, bool]:
    """The pack of ``plan``: the reference manifest's (admitted, or rebuilt with its digest as the
    expected one) when it has the same contents, else a new one from the live bytes."""
    contents = {(e.sha256, e.size_bytes) for e in plan.layout.entries}
    if reference is not None and contents == {(e.sha256, e.size_bytes) for e in reference.model_extents}:
        pack = reference.pack
        try:
            cache.admit(pack.sha256, pack.size_bytes)
            return pack, False
        except (MissingObjectError, IntegrityError) as exc:
            logger.info(
                "coldsnap: pack %s is not usable in the cache (%s); rebuilding it from the live weights", pack.sha256, exc
            )
        return write_pack(plan.layout, plan.locate, backend, cache, expected_sha256=pack.sha256), True
    return write_pack(plan.layout, plan.locate, backend, cache), True
