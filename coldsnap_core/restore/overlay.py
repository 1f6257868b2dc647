"""Which capsule a restore on this node uses: the portable one when its target qualifies, else this node's
target-local overlay or qualification record for exactly this target (``docs/format.md`` §15.4; the documents:
:mod:`coldsnap_core.artifact.overlay`)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coldsnap_core.artifact.capsules import Capsule, read_pinned_capsule
from coldsnap_core.artifact.overlay import (
    OVERLAY_FILENAME,
    OVERLAYS_DIRNAME,
    OverlayDescriptor,
    artifact_key,
    overlay_dir,
    refuse_linked_folders,
)
from coldsnap_core.cache.records import read_private_record
from coldsnap_core.errors import ColdsnapError, TargetMismatchError
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, CapsuleFile, WorkerEntry
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.format.target import TargetIdentity, describe_differences
from coldsnap_core.identity.target import mismatch_detail

logger = logging.getLogger(__name__)

__all__ = ["Lookup", "Selection", "find_overlay", "select_capsule"]


@dataclass(frozen=True, slots=True)
class Selection:
    """Which capsule a restore on this node uses (``source``: ``portable``, its target qualifies; ``qualified``, this
    node recorded it qualified for its target; ``overlay``, this node's target-local capsule), and the ``reason`` in
    words; for the latter two, the overlay folder and the pins of its own derived-cache seed."""

    source: Literal["portable", "qualified", "overlay"]
    capsule: Capsule
    reason: str
    overlay_path: Path | None = None
    seed_files: tuple[CapsuleFile, ...] = ()

    @property
    def seed_source(self) -> tuple[Path, tuple[CapsuleFile, ...]] | None:
        """``(folder, pins)`` of the overlay's derived-cache seed; ``None`` for ``portable`` (the entry's pins apply)."""
        if self.source == "portable" or self.overlay_path is None:
            return None
        return self.overlay_path, self.seed_files


@dataclass(frozen=True, slots=True)
class Lookup:
    """What this node holds for one (artifact, worker, target) at ``path``: ``status`` ``absent``, ``stale`` (bound to
    another ``artifact.json``), ``invalid`` (unreadable, a link, a loose mode, a bad pin, ...) or ``valid`` (with the
    ``descriptor``, and the ``capsule`` of kind ``overlay``), and the ``reason`` in words."""

    status: Literal["absent", "stale", "invalid", "valid"]
    reason: str
    path: Path
    descriptor: OverlayDescriptor | None = None
    capsule: Capsule | None = None


def find_overlay(
    state_root: Path,
    artifact_dir: Path,
    entry: WorkerEntry,
    current: TargetIdentity,
    descriptor_sha256: str,
) -> Lookup:
    """This node's overlay of ``entry``'s worker for ``current``, validated; a problem is a ``stale``/``invalid`` Lookup."""
    path = overlay_dir(state_root, artifact_dir, entry.worker, current)
    try:
        if not refuse_linked_folders(state_root, path):
            return Lookup("absent", _absent_reason(state_root, artifact_dir, entry.worker, current), path)
        descriptor = read_private_record(path / OVERLAY_FILENAME, OverlayDescriptor)
    except ColdsnapError as exc:
        return Lookup("invalid", f"its {OVERLAY_FILENAME} is not trusted: {exc}", path)
    if descriptor.artifact_dir != os.path.realpath(artifact_dir) or descriptor.target != current:
        return Lookup("invalid", f"its {OVERLAY_FILENAME} is bound to another artifact folder or target than its path", path)
    if descriptor.worker != entry.worker or descriptor.payload != entry.payload:
        return Lookup("stale", "it names another worker or model payload than the portable artifact's entry", path)
    if descriptor.portable_descriptor_sha256 != descriptor_sha256:
        return Lookup(
            "stale",
            f"the portable {DESCRIPTOR_FILENAME} changed since it was captured (bound to SHA-256"
            f" {descriptor.portable_descriptor_sha256}, now {descriptor_sha256})",
            path,
        )
    if descriptor.kind == "qualified":
        return Lookup("valid", "this node recorded the portable capsule qualified for this target", path, descriptor)
    try:
        capsule = read_pinned_capsule(path, descriptor.entry())
    except ColdsnapError as exc:
        return Lookup("invalid", f"its capsule does not match {OVERLAY_FILENAME}: {exc}", path)
    if capsule.native.pack != entry.payload or capsule.target != current or capsule.native.capture_point != "portable":
        return Lookup("invalid", "its capsule names another pack, target or capture point than its descriptor", path)
    return Lookup("valid", "this node's target-local overlay for this target", path, descriptor, capsule)


def _absent_reason(state_root: Path, artifact_dir: Path, worker: WorkerIdentity, current: TargetIdentity) -> str:
    """ "no overlay for this target", naming how the targets of this worker's other overlays differ."""
    others = []
    base = state_root / OVERLAYS_DIRNAME / artifact_key(artifact_dir)
    with contextlib.suppress(OSError):
        for candidate in sorted(base.glob(f"*/{worker.capsule_name}/{OVERLAY_FILENAME}")):
            with contextlib.suppress(ColdsnapError, OSError):
                other = read_private_record(candidate, OverlayDescriptor).target
                differences = other.differences(current, tuple(other.to_json()))
                others.append(describe_differences(differences))
    if not others:
        return "this node has no overlay for this target"
    return f"this node has no overlay for this target (its overlays of this worker are for other targets: {' | '.join(others)})"


def select_capsule(
    *,
    artifact_dir: Path,
    entry: WorkerEntry,
    portable: Capsule,
    current: TargetIdentity,
    state_root: Path,
    descriptor_sha256: str,
    use_overlays: bool = True,
) -> Selection:
    """Which capsule restores ``entry``'s worker on the target ``current`` (``docs/format.md`` §15.4; never an
    overlay for another engine; invalid overlay metadata is a WARNING). Raises ``TargetMismatchError`` when none
    qualifies, naming the differing fields and what this node's overlays hold."""
    file = str(portable.path / "target.json")
    recorded = portable.target
    if recorded is None:
        raise TargetMismatchError("the capsule records no target.json; its target cannot be checked", file=file)
    detail = mismatch_detail(recorded, current)
    if detail is None:
        return Selection("portable", portable, "the portable capsule's target qualifies for this one")
    differences = recorded.differences(current)
    if recorded.engine != current.engine or not use_overlays:
        raise TargetMismatchError(detail, differences=differences, file=file)
    lookup = find_overlay(state_root, artifact_dir, entry, current, descriptor_sha256)
    if lookup.status == "valid" and lookup.descriptor is not None:
        reason = f"{lookup.reason} ({describe_differences(differences)})"
        # a qualification record has no capsule of its own: the portable one is replayed
        capsule = lookup.capsule or portable
        return Selection(lookup.descriptor.kind, capsule, reason, lookup.path, lookup.descriptor.seed_files)
    if lookup.status == "invalid":
        logger.warning(
            "coldsnap: ignoring the target-local overlay at %s (%s); using the portable artifact", lookup.path, lookup.reason
        )
    elif lookup.status == "stale":
        logger.info(
            "coldsnap: the target-local overlay at %s is stale (%s); using the portable artifact", lookup.path, lookup.reason
        )
    raise TargetMismatchError(f"{detail}; overlay: {lookup.reason}", differences=differences, file=file)
