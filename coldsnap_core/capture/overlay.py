"""The capture of a target-local overlay (``docs/format.md`` §15.3), or of a record that this target is qualified for the
portable capsule, and of the overlay's own derived-cache seed (§17.3)."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from coldsnap_core._io import replace_file_durably, write_file_durably
from coldsnap_core.artifact.capsules import Capsule, _artifact_lock, replace_dir_atomically
from coldsnap_core.artifact.derived_cache import SeedDocument, SeedQualification
from coldsnap_core.artifact.overlay import (
    OVERLAY_FILENAME,
    OverlayDescriptor,
    OverlayKind,
    overlay_dir,
    overlay_lock_path,
    refuse_linked_folders,
)
from coldsnap_core.cache.records import read_private_record
from coldsnap_core.capture.derived_cache import log_captured, with_seed_pins, write_seed_files
from coldsnap_core.capture.payload import ModelRange, plan_payload
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.errors import OverlayError
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.descriptor import SEED_FILENAMES, WorkerEntry
from coldsnap_core.format.manifest import ModelIdentity
from coldsnap_core.format.target import QUALIFYING_FIELDS, TargetIdentity

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OverlayCapture:
    """What :func:`capture_overlay` stored: the overlay folder and its ``overlay.json``."""

    kind: OverlayKind
    path: Path
    descriptor: OverlayDescriptor


def capture_overlay(
    *,
    state_root: Path,
    artifact_dir: Path,
    entry: WorkerEntry,
    portable: Capsule,
    descriptor_sha256: str,
    model: ModelIdentity,
    target: TargetIdentity,
    allocation_map: AllocationMap,
    allocations: Sequence[LiveAllocation],
    model_ranges: Sequence[ModelRange],
    backend: CopyBackend,
) -> OverlayCapture:
    """Capture this worker's residual and manifests for ``target`` as an overlay of the portable capsule (its pack
    referenced, never written), right after a checkpoint load whose model identity was checked; a capture
    byte-identical to the portable capsule is discarded (kind ``qualified``).

    Raises:
        OverlayError: the model payload is not the portable one (not the same model); nothing is stored.
        ObserverError: the model ranges are malformed (:func:`plan_payload`).
        InsufficientSpaceError, FileAccessError: writing failed (nothing half-written is left).
    """
    worker = entry.worker
    plan = plan_payload(allocation_map, allocations, backend, model_ranges)
    contents = set(plan.locate)
    portable_contents = {(e.sha256, e.size_bytes) for e in portable.native.model_extents}
    if contents != portable_contents or plan.layout.size_bytes != entry.payload.size_bytes:
        raise OverlayError(
            f"the loaded model bytes are {len(contents)} distinct contents, the portable capsule's pack"
            f" {entry.payload.sha256} holds {len(portable_contents)} ({len(contents - portable_contents)} not in it):"
            " not the same model; no overlay is stored",
            file=portable.native_manifest_path,
        )
    path = overlay_dir(state_root, artifact_dir, worker, target)
    created_at = datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()

    def fill(staging: Path) -> OverlayDescriptor:
        pins = plan.write_capsule_files(
            staging, capture_point="portable", worker=worker, pack=entry.payload, model=model, target=target
        ).pins
        # the portable capsule's seed pins (docs/format.md §17) are no capsule bytes to compare
        same = {p.name: p for p in pins if p.name != "target.json"} == {
            p.name: p for p in entry.capsule_files if p.name != "target.json" and p.name not in SEED_FILENAMES
        }
        if same:
            for child in staging.iterdir():
                os.unlink(child)
        kind: OverlayKind = "qualified" if same else "overlay"
        pinned = () if same else pins
        descriptor = OverlayDescriptor(
            kind, os.path.realpath(artifact_dir), descriptor_sha256, worker, entry.payload, target, pinned, created_at
        )
        write_file_durably(staging / OVERLAY_FILENAME, descriptor.dumps(), mode=0o444)
        return descriptor

    refuse_linked_folders(state_root, path.parent, create=True)
    with _artifact_lock(overlay_lock_path(path)):
        descriptor = replace_dir_atomically(path, fill)
        os.chmod(path, 0o700)
    if descriptor.kind == "qualified":
        what = (
            "the capture on this target is identical to the portable capsule; discarded it and recorded this target as qualified"
        )
        logger.info("coldsnap: %s: %s (%s)", worker.capsule_name, what, path)
    else:
        pack = descriptor.payload.sha256[:12]
        logger.info("coldsnap: %s: stored a target-local overlay at %s (pack %s stays shared)", worker.capsule_name, path, pack)
    return OverlayCapture(descriptor.kind, path, descriptor)


def attach_overlay_seed(
    capture: OverlayCapture, qualification: SeedQualification, files: list[tuple[str, Path]]
) -> SeedDocument | None:
    """Write a derived-cache seed of ``files`` into the overlay ``capture`` stored and pin it in its ``overlay.json``,
    under the overlay's lock. Returns the seed document, or ``None`` without files.

    Raises:
        OverlayError: the overlay was replaced meanwhile, or ``qualification`` is not for the overlay's target.
        UnsafePathError, FileAccessError, InsufficientSpaceError, ManifestError: reading or writing failed.
    """
    if not files:
        return None
    descriptor, path = capture.descriptor, capture.path
    if any(getattr(qualification, name) != getattr(descriptor.target, name) for name in QUALIFYING_FIELDS):
        raise OverlayError("the seed's qualification is not for the overlay's target; it is not attached", file=path)
    with _artifact_lock(overlay_lock_path(path)):
        if not refuse_linked_folders(path.parents[3], path):
            raise OverlayError("the overlay folder is gone; its seed is not attached", file=path)
        current = read_private_record(path / OVERLAY_FILENAME, OverlayDescriptor)
        if current != descriptor:
            raise OverlayError("the overlay was replaced since this start captured it; its seed is not attached", file=path)
        document, pins = write_seed_files(path, descriptor.worker, qualification, files)
        updated = msgspec.structs.replace(descriptor, capsule_files=with_seed_pins(descriptor.capsule_files, pins))
        replace_file_durably(path / OVERLAY_FILENAME, updated.dumps(), read_only=True)
    log_captured(descriptor.worker.capsule_name, document, f" into the target-local overlay {path}")
    return document
