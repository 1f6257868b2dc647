"""The capture core: from a quiescent model's live bytes to its pack, residual blob and manifests.

Every capture runs these steps, written once here, in this order:

1. **check** (:func:`plan_payload`): the allocation map describes the live allocations (count, index,
   size) and the model ranges are non-empty, in bounds, sorted by (allocation, offset) and disjoint;
2. **hash**: the SHA-256 of each model range, on all usable CPUs (:func:`hash_ranges`), unless the
   caller already has them;
3. **plan**: the canonical pack layout of the distinct ``(sha256, size_bytes)`` contents
   (``docs/format.md``, "Pack layout": sorted, each content once, 4096-byte aligned, zero padded); where
   the pack writer reads each content (the first model range holding it, in (allocation, offset) order);
   the model extents; the residual extents (the complement of the model ranges over every allocation,
   back to back in the blob: ``docs/format.md``, "Residual blob");
4. **pack** (:meth:`PayloadPlan.ensure_pack`): written by the canonical writer
   (:func:`coldsnap_core.capture.pack_writer.write_pack`), or, when the caller expects a known pack, admitted
   from the cache or rebuilt from the live bytes with its digest as the one it must have;
5. **residual and manifests** (:meth:`PayloadPlan.write_capsule_files`): the blob and the manifests,
   each fsynced, into a staging folder that the caller's atomic folder swap puts in place as a whole.

Its callers: the capture of a worker into an artifact (:mod:`coldsnap_core.capture.worker`); the
target-local overlay, which references the portable pack and writes none
(:mod:`coldsnap_core.capture.overlay`); the native capture at a level-1 sleep
(:mod:`coldsnap_core.capture.sleep`); materialization, which re-plans a native manifest after a recovery
load (:mod:`coldsnap_core.capture.materialize`). So a pack is byte-identical whichever of them wrote it
(``docs/format.md`` §13). The allocations must not change while the steps run: their bytes are read
more than once (digests, pack, blob).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.artifact.capsules import write_manifests
from coldsnap_core.artifact.residual import residual_extents, write_residual
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.pack_writer import write_pack
from coldsnap_core.copy.base import CopyBackend
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

__all__ = [
    "ModelRange",
    "PayloadPlan",
    "StagedCapsule",
    "check_model_ranges",
    "hash_ranges",
    "plan_manifest_payload",
    "plan_payload",
]


@dataclass(frozen=True, slots=True)
class ModelRange:
    """A destination byte range that holds checkpoint bytes at capture time.

    Attributes:
        allocation_index: the allocation the range lies in.
        offset_bytes: start within the allocation.
        size_bytes: length, > 0.
        provenance: where the bytes came from.
    """

    allocation_index: int
    offset_bytes: int
    size_bytes: int
    provenance: ExtentProvenance


def check_model_ranges(ranges: Sequence[ModelRange], allocations: Sequence[LiveAllocation]) -> None:
    """Model ranges must be non-empty, in bounds, sorted by (allocation, offset) and disjoint.

    Anything else is an observer bug, refused before a byte is written.

    Raises:
        ObserverError: names the offending range's allocation and offset.
    """
    previous = (0, 0)
    for i, r in enumerate(ranges):
        if r.size_bytes <= 0 or r.offset_bytes < 0:
            raise ObserverError(
                f"model range {i} has offset {r.offset_bytes} and size {r.size_bytes} bytes; ranges are non-empty and start at >= 0",
                allocation=r.allocation_index,
                offset_bytes=r.offset_bytes,
            )
        if not 0 <= r.allocation_index < len(allocations):
            raise ObserverError(
                f"model range {i} names allocation {r.allocation_index}, but there are {len(allocations)}",
                allocation=r.allocation_index,
                offset_bytes=r.offset_bytes,
            )
        if r.offset_bytes + r.size_bytes > allocations[r.allocation_index].size_bytes:
            raise ObserverError(
                f"model range {i} ends at byte {r.offset_bytes + r.size_bytes}, beyond its allocation's"
                f" {allocations[r.allocation_index].size_bytes} bytes",
                allocation=r.allocation_index,
                offset_bytes=r.offset_bytes,
            )
        if (r.allocation_index, r.offset_bytes) < previous:
            raise ObserverError(
                f"model range {i} starts before the end of model range {i - 1}; ranges must be sorted and disjoint",
                allocation=r.allocation_index,
                offset_bytes=r.offset_bytes,
            )
        previous = (r.allocation_index, r.offset_bytes + r.size_bytes)


def _check_allocations(allocation_map: AllocationMap, allocations: Sequence[LiveAllocation]) -> None:
    """The allocation map describes the live allocations: the same count, and each the same index and size.

    Raises:
        ObserverError: names the first allocation that differs.
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


def hash_ranges(
    ranges: Sequence[ModelRange], allocations: Sequence[LiveAllocation], backend: CopyBackend, *, threads: int | None = None
) -> list[str]:
    """SHA-256 of each range's bytes, computed on ``threads`` threads (default: usable CPUs)."""

    def digest(r: ModelRange) -> str:
        h = hashlib.sha256()
        for chunk in backend.read_chunks(allocations[r.allocation_index], r.offset_bytes, r.size_bytes):
            h.update(chunk)
        return h.hexdigest()

    workers = threads or max(1, len(os.sched_getaffinity(0)))
    if workers == 1:
        return [digest(r) for r in ranges]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coldsnap-digest") as pool:
        # Largest first for balance, results back in input order.
        order = sorted(range(len(ranges)), key=lambda i: -ranges[i].size_bytes)
        futures = {i: pool.submit(digest, ranges[i]) for i in order}
        return [futures[i].result() for i in range(len(ranges))]


@dataclass(frozen=True, slots=True)
class StagedCapsule:
    """What :meth:`PayloadPlan.write_capsule_files` wrote into a staging folder.

    Attributes:
        native: the native manifest.
        recovery: the recovery manifest, or ``None`` when none was written (no model identity).
        pins: the pins of the files written, sorted by name (both manifests, ``target.json`` when
            written, and the residual blob), for an ``artifact.json`` entry or an ``overlay.json``.
    """

    native: NativeManifest
    recovery: RecoveryManifest | None
    pins: tuple[CapsuleFile, ...]


@dataclass(frozen=True, slots=True)
class PayloadPlan:
    """Everything about a worker's payload that follows from its live allocations, its model ranges and
    their digests, with what reads the allocations.

    Attributes:
        allocation_map: the allocations' layout, as the manifests record it.
        allocations: the live allocations, ``allocations[i].index == i``.
        backend: reads them (host views, or device-to-host copies).
        layout: the canonical pack layout of the distinct contents.
        locate: ``(sha256, size_bytes) -> (allocation, offset_bytes)``: where the pack writer reads
            each stored content (the first range holding it).
        model_extents: one per model range, in range order, with its pack offset.
        residual_extents: the complement of the model ranges over the allocations, with blob offsets.
    """

    allocation_map: AllocationMap
    allocations: Sequence[LiveAllocation]
    backend: CopyBackend
    layout: PackLayout
    locate: Mapping[tuple[str, int], tuple[LiveAllocation, int]]
    model_extents: tuple[ModelExtent, ...]
    residual_extents: tuple[ResidualExtent, ...]

    def ensure_pack(self, cache: PayloadCache, expected: PackRef | None = None) -> tuple[PackRef, bool]:
        """This plan's pack in ``cache``, and whether this call wrote it.

        Without ``expected``, the canonical writer writes it from the live bytes. With ``expected`` (the pack
        a native manifest names, whose extents this plan holds), under that digest's lock: a valid cached
        object is admitted; a missing one, or a corrupt one (with a WARNING), is written from the live bytes
        with ``expected``'s digest as the one it must have.

        Raises:
            PackDigestMismatchError: the live bytes do not produce ``expected``'s digest (nothing is kept).
            PackSizeMismatchError: a verified cached object of that digest, or the pack written, is not
                ``expected``'s size.
            InsufficientSpaceError / CacheError / UnsafePathError: writing failed (the temporary is removed).
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
        """Write this plan's residual blob (``weights.blob``), its native manifest, its recovery manifest
        when ``model`` is given and ``target.json`` when ``target`` is, into the staging folder ``staging``
        (each fsynced; ``docs/format.md``, "Native manifest", "Recovery manifest"). The native manifest must
        pass the verifier before it is written.

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
    """Check, hash and plan the payload of ``model_ranges`` in ``allocations`` (steps 1 to 3 of the module
    docstring).

    Args:
        allocation_map: the allocations' layout; ``allocation_map[i].size_bytes`` must equal
            ``allocations[i].size_bytes``.
        allocations: the live allocations, ``allocations[i].index == i``.
        backend: reads them.
        model_ranges: the model ranges, sorted by (allocation, offset) and disjoint.
        digests: hex SHA-256 of each range's bytes, when the caller has them; default: hashed here.

    Raises:
        ObserverError: the allocation map does not describe the live allocations, or the model ranges
            are not sorted, disjoint, non-empty and in bounds (nothing is read).
        ValueError: ``digests`` and ``model_ranges`` differ in length.
    """
    _check_allocations(allocation_map, allocations)
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
    """Re-plan the payload a native manifest describes, reading from ``allocations`` (materialization).

    The manifest is checked first (:func:`coldsnap_core.format.verify.check_manifest`, and its allocations
    against the live ones: :func:`coldsnap_core.format.verify.check_live_layout`); the plan then equals
    the manifest's own layout and maps.

    Raises:
        ManifestError: a manifest rule or the live layout check failed.
    """
    check_manifest(manifest)
    check_live_layout(manifest.allocations, None, allocations)
    ranges = [ModelRange(e.allocation_index, e.offset_bytes, e.size_bytes, e.provenance) for e in manifest.model_extents]
    return plan_payload(manifest.allocations, allocations, backend, ranges, [e.sha256 for e in manifest.model_extents])
