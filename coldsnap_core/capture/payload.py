"""The capture core, which every capture runs so that a pack is byte-identical whichever wrote it (``docs/format.md``
§2, §3, §13): plan the payload of a quiescent model's live bytes (:func:`plan_payload`), write or admit the pack
(:meth:`PayloadPlan.ensure_pack`, :func:`write_pack`), then residual and manifests (:meth:`PayloadPlan.write_capsule_files`)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core._io import write_hashed, zero_chunks
from coldsnap_core.artifact.capsules import write_manifests
from coldsnap_core.artifact.residual import residual_extents, write_residual
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.copy.base import CopyBackend, stable_chunks
from coldsnap_core.errors import IntegrityError, MissingObjectError, ObserverError, PackSizeMismatchError
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.descriptor import CapsuleFile
from coldsnap_core.format.extents import ExtentProvenance, ModelExtent, ResidualExtent
from coldsnap_core.format.manifest import (
    NATIVE_MANIFEST_FILENAME,
    RESIDUAL_FILENAME,
    CapturePoint,
    ModelIdentity,
    NativeManifest,
    PackRef,
    RecoveryManifest,
    WorkerIdentity,
)
from coldsnap_core.format.pack_layout import PackLayout
from coldsnap_core.format.target import TargetIdentity
from coldsnap_core.format.verify import check_live_layout, check_manifest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelRange:
    """A destination byte range (``size_bytes > 0`` at ``offset_bytes`` of an allocation) that holds checkpoint bytes."""

    allocation_index: int
    offset_bytes: int
    size_bytes: int
    provenance: ExtentProvenance


def check_model_ranges(ranges: Sequence[ModelRange], allocations: Sequence[LiveAllocation]) -> None:
    """Model ranges must be non-empty, in bounds, sorted by (allocation, offset) and disjoint (else ``ObserverError``)."""
    previous = (0, 0)
    for i, r in enumerate(ranges):
        problem = None
        if r.size_bytes <= 0 or r.offset_bytes < 0:
            problem = f"has offset {r.offset_bytes} and size {r.size_bytes} bytes; ranges are non-empty and start at >= 0"
        elif not 0 <= r.allocation_index < len(allocations):
            problem = f"names allocation {r.allocation_index}, but there are {len(allocations)}"
        elif r.offset_bytes + r.size_bytes > allocations[r.allocation_index].size_bytes:
            problem = (
                f"ends at byte {r.offset_bytes + r.size_bytes}, beyond its allocation's"
                f" {allocations[r.allocation_index].size_bytes} bytes"
            )
        elif (r.allocation_index, r.offset_bytes) < previous:
            problem = f"starts before the end of model range {i - 1}; ranges must be sorted and disjoint"
        if problem is not None:
            raise ObserverError(f"model range {i} {problem}", allocation=r.allocation_index, offset_bytes=r.offset_bytes)
        previous = (r.allocation_index, r.offset_bytes + r.size_bytes)


def hash_ranges(ranges: Sequence[ModelRange], allocations: Sequence[LiveAllocation], backend: CopyBackend) -> list[str]:
    """SHA-256 of each range's bytes, on one thread per usable CPU, largest first."""

    def digest(r: ModelRange) -> str:
        h = hashlib.sha256()
        for chunk in backend.read_chunks(allocations[r.allocation_index], r.offset_bytes, r.size_bytes):
            h.update(chunk)
        return h.hexdigest()

    workers = max(1, len(os.sched_getaffinity(0)))
    if workers == 1:
        return [digest(r) for r in ranges]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coldsnap-digest") as pool:
        order = sorted(range(len(ranges)), key=lambda i: -ranges[i].size_bytes)
        futures = {i: pool.submit(digest, ranges[i]) for i in order}
        return [futures[i].result() for i in range(len(ranges))]


def write_pack(
    layout: PackLayout,
    locate: Mapping[tuple[str, int], tuple[LiveAllocation, int]],
    backend: CopyBackend,
    cache: PayloadCache,
    *,
    expected_sha256: str | None = None,
) -> PackRef:
    """The canonical pack writer, the only code that produces a ``model-weights.pack``: the pack of ``layout`` streamed
    into ``cache`` from where ``locate`` says, never through a whole-model buffer; returns its reference.

    Raises:
        PackDigestMismatchError: ``expected_sha256`` given and not produced (nothing is kept).
        InsufficientSpaceError: the file system filled up (the temporary file is removed).
    """

    def stream() -> Iterator[memoryview]:
        position = 0
        for entry in layout.entries:
            yield from zero_chunks(entry.offset_bytes - position)
            allocation, offset_bytes = locate[(entry.sha256, entry.size_bytes)]
            yield from backend.read_chunks(allocation, offset_bytes, entry.size_bytes)
            position = entry.end_bytes
        yield from zero_chunks(layout.size_bytes - position)

    with cache.temporary(expected_sha256 or "capture") as (fd, temp_path):
        digest, _ = write_hashed(fd, stream, file=temp_path, stable=stable_chunks(backend))
        cache.commit(fd, temp_path, sha256=digest, size_bytes=layout.size_bytes, expected_sha256=expected_sha256)
    return PackRef.for_digest(digest, layout.size_bytes)


@dataclass(frozen=True, slots=True)
class StagedCapsule:
    """What :meth:`PayloadPlan.write_capsule_files` wrote, with the pins of its files sorted by name."""

    native: NativeManifest
    recovery: RecoveryManifest | None
    pins: tuple[CapsuleFile, ...]


@dataclass(frozen=True, slots=True)
class PayloadPlan:
    """A worker's payload planned from its live allocations, model ranges and their digests; ``locate``: where the pack
    writer reads each stored ``(sha256, size_bytes)`` (the first range holding it)."""

    allocation_map: AllocationMap
    allocations: Sequence[LiveAllocation]
    backend: CopyBackend
    layout: PackLayout
    locate: Mapping[tuple[str, int], tuple[LiveAllocation, int]]
    model_extents: tuple[ModelExtent, ...]
    residual_extents: tuple[ResidualExtent, ...]

    def ensure_pack(self, cache: PayloadCache, expected: PackRef | None = None) -> tuple[PackRef, bool]:
        """This plan's pack in ``cache``, and whether this call wrote it; with ``expected``, a valid cached object is
        admitted under its digest's lock, else (a corrupt one with a WARNING) written with that digest expected.

        Raises:
            PackDigestMismatchError: the live bytes do not produce ``expected``'s digest (nothing is kept).
            PackSizeMismatchError: a verified cached object, or the pack written, is not ``expected``'s size.
            InsufficientSpaceError / CacheError / UnsafePathError: writing failed.
        """
        if expected is None:
            return write_pack(self.layout, self.locate, self.backend, cache), True
        with cache.lock(expected.sha256):
            try:
                cache.admit_locked(expected.sha256, expected.size_bytes)
                return expected, False
            except MissingObjectError:
                pass
            except IntegrityError as exc:
                if isinstance(exc, PackSizeMismatchError) and cache.object_path(expected.sha256).exists():
                    raise  # a verified object of another size: the manifest is wrong, not the cache
                logger.warning("coldsnap: cached pack %s was corrupt (%s); rewriting it", expected.sha256, exc.detail)
            written = write_pack(self.layout, self.locate, self.backend, cache, expected_sha256=expected.sha256)
        if written.size_bytes != expected.size_bytes:
            raise PackSizeMismatchError(
                f"materialized pack is {written.size_bytes} bytes, the manifest records {expected.size_bytes}",
                file=cache.object_path(expected.sha256),
            )
        return written, True

    def write_capsule_files(
        self,
        staging: Path,
        *,
        capture_point: CapturePoint,
        worker: WorkerIdentity,
        pack: PackRef,
        model: ModelIdentity | None,
        target: TargetIdentity | None,
    ) -> StagedCapsule:
        """Write the residual blob, the native manifest (verified first), the recovery manifest when ``model`` is given
        and ``target.json`` when ``target`` is, into ``staging`` (``docs/format.md`` §4).

        Raises:
            ManifestError: the native manifest breaks a manifest rule (a bug; nothing is committed).
            ResidualSizeMismatchError / InsufficientSpaceError: writing the blob failed.
        """
        residual = write_residual(self.residual_extents, self.allocations, self.backend, staging / RESIDUAL_FILENAME)
        shared = {
            "worker": worker,
            "layout_fingerprint": self.allocation_map.layout_fingerprint(),
            "residual": residual,
            "allocations": self.allocation_map,
            "residual_extents": self.residual_extents,
        }
        native = NativeManifest(capture_point=capture_point, pack=pack, model_extents=self.model_extents, **shared)
        check_manifest(native, file=str(staging / NATIVE_MANIFEST_FILENAME))
        recovery = None if model is None else RecoveryManifest(model=model, **shared)
        return StagedCapsule(native, recovery, write_manifests(staging, native, recovery, target))


def plan_payload(
    allocation_map: AllocationMap,
    allocations: Sequence[LiveAllocation],
    backend: CopyBackend,
    model_ranges: Sequence[ModelRange],
    digests: Sequence[str] | None = None,
) -> PayloadPlan:
    """Check, hash (unless ``digests`` are given) and plan the payload of ``model_ranges`` in ``allocations``.

    Raises:
        ObserverError: the allocation map does not describe the live allocations, or the model ranges are not sorted,
            disjoint, non-empty and in bounds (nothing is read).
        ValueError: ``digests`` and ``model_ranges`` differ in length.
    """
    if len(allocation_map) != len(allocations):
        raise ObserverError(f"the allocation map has {len(allocation_map)} allocations, the live model {len(allocations)}")
    for recorded, live in zip(allocation_map.allocations, allocations, strict=True):
        if live.index != recorded.index or live.size_bytes != recorded.size_bytes:
            raise ObserverError(
                f"live allocation {live.index} ({live.size_bytes} bytes) is not allocation {recorded.index}"
                f" of the allocation map ({recorded.size_bytes} bytes)",
                allocation=recorded.index,
            )
    check_model_ranges(model_ranges, allocations)
    if digests is None:
        digests = hash_ranges(model_ranges, allocations, backend)
    contents = [(d, r.size_bytes) for d, r in zip(digests, model_ranges, strict=True)]
    layout = PackLayout.plan(contents)
    offsets = layout.offsets()
    locate: dict[tuple[str, int], tuple[LiveAllocation, int]] = {}
    model_extents = []
    for key, r in zip(contents, model_ranges, strict=True):
        locate.setdefault(key, (allocations[r.allocation_index], r.offset_bytes))
        model_extents.append(ModelExtent(r.allocation_index, r.offset_bytes, r.size_bytes, offsets[key], key[0], r.provenance))
    residual_map = residual_extents(
        [a.size_bytes for a in allocations], ((r.allocation_index, r.offset_bytes, r.size_bytes) for r in model_ranges)
    )
    return PayloadPlan(allocation_map, allocations, backend, layout, locate, tuple(model_extents), residual_map)


def plan_manifest_payload(manifest: NativeManifest, allocations: Sequence[LiveAllocation], backend: CopyBackend) -> PayloadPlan:
    """Re-plan the payload a native manifest describes; ``ManifestError`` when a manifest rule or the live layout fails."""
    check_manifest(manifest)
    check_live_layout(manifest.allocations, None, allocations)
    ranges = [ModelRange(e.allocation_index, e.offset_bytes, e.size_bytes, e.provenance) for e in manifest.model_extents]
    return plan_payload(manifest.allocations, allocations, backend, ranges, [e.sha256 for e in manifest.model_extents])
