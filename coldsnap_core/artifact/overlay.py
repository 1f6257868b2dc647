"""Target-local residual overlays: a node's own capsule for a portable capsule it may not replay.

A portable capsule's residual is replayed only on a target that qualifies (``docs/format.md``
§15.2). When one does not (an engine or driver upgrade), the loader falls back to the checkpoint load
and then captures this worker's residual and manifests for *this* target (:func:`capture_overlay`).
The model payload objects must be the portable capsule's (same owner, role, size and SHA-256): the
pack stays shared and is never copied. If the residual and both manifests are also byte-identical
to the portable capsule's, the capture is discarded and the node records that its target is
qualified for the portable capsule (kind ``qualified``); otherwise it stores the capture (kind
``overlay``). Either way an **overlay descriptor** (``overlay.json``) binds it to the portable
``artifact.json`` by SHA-256, to the exact target identity and to the pins of its files, in the
node-local state root::

    <state-root>/overlays/<artifact-key>/<target-key>/<capsule name>/
        overlay.json            OverlayDescriptor, mode 0444
        native-manifest.json    (kind "overlay" only) the overlay capsule, pinned by overlay.json
        recovery-manifest.json
        target.json
        weights.blob

An ordinary restore selects an overlay (:func:`select_capsule`) only on the exact target it is bound
to and only while the portable ``artifact.json`` is the one it was bound to. Missing, stale or invalid
overlay metadata falls back to the portable artifact (a WARNING for invalid metadata). Overlays are
an acceleration cache, never published (``docs/format.md`` §15.3-16.5).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from coldsnap_core._io import replace_file_durably, write_file_durably
from coldsnap_core.artifact.capsules import (
    Capsule,
    _artifact_lock,
    read_pinned_capsule,
    replace_dir_atomically,
    write_manifests,
)
from coldsnap_core.artifact.derived_cache import (
    TARGET_QUALIFICATION_FIELDS,
    SeedDocument,
    SeedQualification,
    log_captured,
    with_seed_pins,
    write_seed_files,
)
from coldsnap_core.artifact.residual import write_residual
from coldsnap_core.cache.records import read_private_record
from coldsnap_core.capture.payload_plan import ModelRange, PayloadPlan, plan_payload
from coldsnap_core.capture.worker import check_model_ranges, hash_ranges
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.errors import (
    ColdsnapError,
    ManifestValueError,
    MissingObjectError,
    OverlayError,
    TargetMismatchError,
    UnsafePathError,
)
from coldsnap_core.format._strict import Document, Sha256, Text, read_document_bytes
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.descriptor import (
    DESCRIPTOR_FILENAME,
    SEED_FILENAMES,
    WORKERS_DIRNAME,
    CapsuleFile,
    WorkerEntry,
    check_capsule_file_names,
)
from coldsnap_core.format.manifest import (
    RESIDUAL_FILENAME,
    ModelIdentity,
    PackRef,
    WorkerIdentity,
)
from coldsnap_core.format.target import TargetIdentity, describe_differences
from coldsnap_core.identity.target import mismatch_detail

logger = logging.getLogger(__name__)

OVERLAYS_DIRNAME = "overlays"
OVERLAY_KIND = "coldsnap.overlay"
OVERLAY_FILENAME = "overlay.json"

OverlayKind = Literal["overlay", "qualified"]


def artifact_key(artifact_dir: Path) -> str:
    """The folder name of one portable artifact's overlays: SHA-256 of its folder's real path."""
    return hashlib.sha256(os.path.realpath(artifact_dir).encode("utf-8", "surrogateescape")).hexdigest()


def target_key(target: TargetIdentity) -> str:
    """The folder name of one target's overlays: ``sha256(b"coldsnap-target-v1\\n" + canonical JSON)``
    of every field of the target identity (keys sorted, separators ``,`` ``:``, ASCII)."""
    canonical = json.dumps(target.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(b"coldsnap-target-v1\n" + canonical.encode("ascii")).hexdigest()


def overlay_dir(state_root: Path, artifact_dir: Path, worker: WorkerIdentity, target: TargetIdentity) -> Path:
    """``<state_root>/overlays/<artifact_key>/<target_key>/<capsule_name>``."""
    return state_root / OVERLAYS_DIRNAME / artifact_key(artifact_dir) / target_key(target) / worker.capsule_name


def portable_descriptor_sha256(artifact_dir: Path) -> str:
    """SHA-256 of the portable artifact's ``artifact.json`` bytes as they are now.

    Raises:
        MissingObjectError, NotRegularFileError, FileAccessError, ManifestParseError: see
            :func:`coldsnap_core.format._strict.read_document_bytes`.
    """
    return hashlib.sha256(read_document_bytes(artifact_dir / DESCRIPTOR_FILENAME)).hexdigest()


class OverlayDescriptor(Document, tag=OVERLAY_KIND):
    """``overlay.json`` (``docs/format.md`` §15.3).

    Attributes:
        kind: ``overlay`` (the folder holds this target's capsule) or ``qualified`` (the capture was
            identical to the portable capsule: the portable capsule is replayed on this target).
        artifact_dir: the portable artifact folder's real path when the overlay was captured.
        portable_descriptor_sha256: SHA-256 of that ``artifact.json``'s bytes.
        worker: the worker (the model payload's owner and role).
        payload: the model payload, equal to the portable entry's ``payload``.
        target: the exact target identity the overlay is bound to.
        capsule_files: the pins of the overlay capsule's four files, and of its derived-cache seed's two
            when one was captured (:func:`attach_overlay_seed`), sorted by name; ``qualified``: the seed's
            two or nothing.
        created_at: UTC time of the capture, ISO 8601 with seconds.

    Raises:
        ManifestValueError: the pins do not fit the kind (``overlay``: the capsule's four files, its blob
            ``weights.blob``, and optionally a seed's two; ``qualified``: a seed's two or nothing).
    """

    kind: OverlayKind
    artifact_dir: Text
    portable_descriptor_sha256: Sha256
    worker: WorkerIdentity
    payload: PackRef
    target: TargetIdentity
    capsule_files: tuple[CapsuleFile, ...]
    created_at: Text

    def __post_init__(self) -> None:
        names = [p.name for p in self.capsule_files]
        if self.kind == "qualified" and names not in ([], sorted(SEED_FILENAMES)):
            raise ManifestValueError(
                f"capsule_files names {names}; a qualified record pins nothing but its derived-cache seed's two files"
            )
        if self.kind == "overlay":
            # the artifact's rule on a capsule's four pins; an overlay's blob is always weights.blob
            check_capsule_file_names(self.capsule_files)
            if RESIDUAL_FILENAME not in names:
                raise ManifestValueError(f"capsule_files names {names}; the overlay's residual blob is {RESIDUAL_FILENAME}")

    @property
    def seed_files(self) -> tuple[CapsuleFile, ...]:
        """The pins of the overlay's own derived-cache seed (``docs/format.md`` §17), or ``()``."""
        return tuple(p for p in self.capsule_files if p.name in SEED_FILENAMES)

    def entry(self) -> WorkerEntry:
        """The overlay capsule's pins as a worker entry (for :func:`read_pinned_capsule`)."""
        return WorkerEntry(self.worker, f"{WORKERS_DIRNAME}/{self.worker.capsule_name}", self.payload, self.capsule_files)


# -- selection ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Selection:
    """Which capsule a restore on this node uses, and why.

    Attributes:
        source: ``portable`` (its target qualifies), ``qualified`` (this node recorded the portable
            capsule qualified for its target) or ``overlay`` (this node's target-local capsule).
        capsule: the capsule to restore from (the portable one unless ``overlay``).
        reason: why, in words (logged, and shown by ``coldsnap inspect``).
        overlay_path: the overlay folder for ``qualified`` and ``overlay``, else ``None``.
        seed_files: for ``qualified`` and ``overlay``, the pins of the overlay's own derived-cache seed in
            :attr:`overlay_path` (``()`` when it has none); the portable capsule's seed was captured for
            another target and is not used.
    """

    source: Literal["portable", "qualified", "overlay"]
    capsule: Capsule
    reason: str
    overlay_path: Path | None = None
    seed_files: tuple[CapsuleFile, ...] = ()

    @property
    def seed_source(self) -> tuple[Path, tuple[CapsuleFile, ...]] | None:
        """``(folder, pins)`` of the derived-cache seed a restore with this selection places: the overlay's
        for ``qualified`` and ``overlay``, ``None`` for ``portable`` (the portable entry's pins apply)."""
        if self.source == "portable" or self.overlay_path is None:
            return None
        return self.overlay_path, self.seed_files


@dataclass(frozen=True, slots=True)
class Lookup:
    """What this node holds for one (artifact, worker, target).

    Attributes:
        status: ``absent``, ``stale`` (bound to another ``artifact.json``) , ``invalid`` (unreadable,
            a symbolic link, a loose mode, a bad pin, ...) or ``valid``.
        reason: why, in words.
        path: the overlay folder looked at.
        descriptor: the descriptor when ``valid``.
        capsule: the overlay capsule when ``valid`` and of kind ``overlay``.
    """

    status: Literal["absent", "stale", "invalid", "valid"]
    reason: str
    path: Path
    descriptor: OverlayDescriptor | None = None
    capsule: Capsule | None = None


def _refuse_linked_folders(state_root: Path, path: Path) -> bool:
    """Each folder from ``<state_root>/overlays`` down to ``path`` must be a real folder (no symbolic
    link). Returns ``False`` when one is absent.

    Raises:
        UnsafePathError: a symbolic link, or something else than a folder, on the way.
    """
    top = state_root / OVERLAYS_DIRNAME
    chain = [top, *reversed([p for p in path.parents if p != top and top in p.parents]), path]
    for folder in chain:
        try:
            st = os.lstat(folder)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError("refusing a symbolic link or file where an overlay folder belongs", file=folder)
    return True


def find_overlay(
    state_root: Path,
    artifact_dir: Path,
    entry: WorkerEntry,
    current: TargetIdentity,
    descriptor_sha256: str,
) -> Lookup:
    """Look up and validate this node's overlay for ``entry``'s worker on the target ``current``
    (its capsule read by :func:`coldsnap_core.artifact.capsules.read_pinned_capsule`).

    Never raises for what it finds: every problem is a ``stale`` or ``invalid`` :class:`Lookup`.
    """
    path = overlay_dir(state_root, artifact_dir, entry.worker, current)
    try:
        if not _refuse_linked_folders(state_root, path):
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
    """Which capsule restores ``entry``'s worker on the target ``current`` (``docs/format.md`` §15.4).

    The portable capsule when its recorded target qualifies; else this node's valid overlay or
    qualification record for exactly ``current`` (never for another engine: a capsule of another
    engine is refused as such); else nothing. Invalid overlay metadata is logged as a WARNING.

    Raises:
        TargetMismatchError: no capsule qualifies; the message names the differing fields (captured
            and current values) and what this node's overlays hold.
    """
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
    if lookup.status == "valid":
        assert lookup.descriptor is not None
        if lookup.descriptor.kind == "qualified":
            return Selection(
                "qualified",
                portable,
                f"{lookup.reason} ({describe_differences(differences)})",
                lookup.path,
                lookup.descriptor.seed_files,
            )
        assert lookup.capsule is not None
        return Selection(
            "overlay",
            lookup.capsule,
            f"{lookup.reason} ({describe_differences(differences)})",
            lookup.path,
            lookup.descriptor.seed_files,
        )
    if lookup.status == "invalid":
        logger.warning(
            "coldsnap: ignoring the target-local overlay at %s (%s); using the portable artifact", lookup.path, lookup.reason
        )
    elif lookup.status == "stale":
        logger.info(
            "coldsnap: the target-local overlay at %s is stale (%s); using the portable artifact", lookup.path, lookup.reason
        )
    raise TargetMismatchError(f"{detail}; overlay: {lookup.reason}", differences=differences, file=file)


# -- capture -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OverlayCapture:
    """What :func:`capture_overlay` stored.

    Attributes:
        kind: ``overlay`` (a capsule was stored) or ``qualified`` (the capture was identical and discarded).
        path: the overlay folder.
        descriptor: its ``overlay.json``.
    """

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
    """Capture this worker's residual and manifests for ``target`` and store them as an overlay of
    the portable capsule ``portable`` (``docs/format.md`` §15.3).

    Call right after a checkpoint load, with the allocations quiescent, and only after the model
    identity was checked against the portable artifact's (the caller's job: the loaders check it the
    way restore does). The model ranges are hashed (on all usable CPUs) and must hold exactly the
    portable manifest's extent contents, so the pack is the portable one: it is referenced, never
    written or copied.

    Args:
        state_root: the node-local state root.
        artifact_dir: the portable artifact folder.
        entry: this worker's portable ``artifact.json`` entry.
        portable: its portable capsule.
        descriptor_sha256: :func:`portable_descriptor_sha256` when the capsule was read.
        model: the portable artifact's model identity (the overlay's recovery manifest names it).
        target: the current target identity (the overlay is bound to it).
        allocation_map, allocations, model_ranges, backend: as for
            :func:`coldsnap_core.capture.worker.capture_worker`.

    Returns:
        What was stored: ``qualified`` when the residual and both manifests are byte-identical to
        the portable capsule's (the capture is discarded), else ``overlay``.

    Raises:
        OverlayError: the worker differs from the entry's, or the model payload does not (other extent
            contents: not the same model); nothing is stored.
        ObserverError: the model ranges are malformed.
        InsufficientSpaceError, FileAccessError: writing failed (nothing half-written is left).
    """
    worker = entry.worker
    check_model_ranges(model_ranges, allocations)
    plan = plan_payload(allocations, model_ranges, hash_ranges(model_ranges, allocations, backend))
    _require_portable_payload(plan, entry, portable)
    path = overlay_dir(state_root, artifact_dir, worker, target)
    created_at = datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()

    def fill(staging: Path) -> OverlayDescriptor:
        residual = write_residual(plan.residual_extents, allocations, backend, staging / RESIDUAL_FILENAME)
        native = plan.native_manifest(
            capture_point="portable", worker=worker, allocations=allocation_map, pack=entry.payload, residual=residual
        )
        recovery = plan.recovery_manifest(worker=worker, allocations=allocation_map, model=model, residual=residual)
        pins = write_manifests(staging, native, recovery, target)
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

    _make_private_dirs(state_root, path.parent)
    with _artifact_lock(_overlay_lock_path(path)):
        descriptor = replace_dir_atomically(path, fill)
        os.chmod(path, 0o700)
    _log_stored(descriptor, path)
    return OverlayCapture(descriptor.kind, path, descriptor)


def _overlay_lock_path(path: Path) -> Path:
    """``<target folder>/.<capsule>.lock``: serializes an overlay's capture and the attachment of its seed."""
    return path.parent / f".{path.name}.lock"


def attach_overlay_seed(
    capture: OverlayCapture, qualification: SeedQualification, files: list[tuple[str, Path]]
) -> SeedDocument | None:
    """Write a derived-cache seed of ``files`` into the overlay ``capture`` stored and pin it in its
    ``overlay.json`` (``docs/format.md`` §15.3, §17.3): the overlay's own seed, for exactly its target.

    Under the overlay's lock, its ``overlay.json`` must still be the one ``capture`` wrote (a later
    capture replaced it otherwise); both seed files are written (temporary name, fsync, rename), then
    ``overlay.json`` is replaced (mode 0444) with their two pins added to ``capsule_files``.

    Returns:
        The seed document, or ``None`` when ``files`` is empty.

    Raises:
        OverlayError: the overlay was replaced meanwhile, or ``qualification`` is not for the overlay's target.
        UnsafePathError, FileAccessError, InsufficientSpaceError, ManifestError: reading or writing failed.
    """
    if not files:
        return None
    descriptor, path = capture.descriptor, capture.path
    target = descriptor.target
    here = {name: getattr(qualification, name) for name in TARGET_QUALIFICATION_FIELDS}
    if here != {name: getattr(target, name) for name in TARGET_QUALIFICATION_FIELDS}:
        raise OverlayError("the seed's qualification is not for the overlay's target; it is not attached", file=path)
    with _artifact_lock(_overlay_lock_path(path)):
        if not _refuse_linked_folders(path.parents[3], path):
            raise OverlayError("the overlay folder is gone; its seed is not attached", file=path)
        current = read_private_record(path / OVERLAY_FILENAME, OverlayDescriptor)
        if current != descriptor:
            raise OverlayError("the overlay was replaced since this start captured it; its seed is not attached", file=path)
        document, pins = write_seed_files(path, descriptor.worker, qualification, files)
        updated = msgspec.structs.replace(descriptor, capsule_files=with_seed_pins(descriptor.capsule_files, pins))
        replace_file_durably(path / OVERLAY_FILENAME, updated.dumps(), read_only=True)
    log_captured(descriptor.worker.capsule_name, document, f" into the target-local overlay {path}")
    return document


def _require_portable_payload(plan: PayloadPlan, entry: WorkerEntry, portable: Capsule) -> None:
    """The planned payload must be the portable capsule's: the same distinct extent contents and the
    same pack size (so the overlay references the portable pack, never writes one).

    Raises:
        OverlayError: other contents (not the same model), naming the portable native manifest.
    """
    contents = set(plan.locate)
    portable_contents = {(e.sha256, e.size_bytes) for e in portable.native.model_extents}
    if contents != portable_contents or plan.layout.size_bytes != entry.payload.size_bytes:
        raise OverlayError(
            f"the loaded model bytes are {len(contents)} distinct contents, the portable capsule's pack"
            f" {entry.payload.sha256} holds {len(portable_contents)} ({len(contents - portable_contents)} not in it):"
            " not the same model; no overlay is stored",
            file=portable.native_manifest_path,
        )


def _log_stored(descriptor: OverlayDescriptor, path: Path) -> None:
    """One INFO line: the target recorded as qualified, or the overlay stored at ``path``."""
    if descriptor.kind == "qualified":
        logger.info(
            "coldsnap: %s: the capture on this target is identical to the portable capsule; discarded it and recorded"
            " this target as qualified (%s)",
            descriptor.worker.capsule_name,
            path,
        )
    else:
        logger.info(
            "coldsnap: %s: stored a target-local overlay at %s (pack %s stays shared)",
            descriptor.worker.capsule_name,
            path,
            descriptor.payload.sha256[:12],
        )


def _make_private_dirs(state_root: Path, folder: Path) -> None:
    """Create ``folder`` and the folders above it up to ``<state_root>/overlays`` with mode 0700,
    refusing a symbolic link on the way."""
    state_root.mkdir(parents=True, exist_ok=True)
    top = state_root / OVERLAYS_DIRNAME
    for p in [top, *reversed([p for p in folder.parents if top in p.parents]), folder]:
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, 0o700)
        if not stat.S_ISDIR(os.lstat(p).st_mode):
            raise UnsafePathError("refusing a symbolic link or file where an overlay folder belongs", file=p)


# -- listing and gc ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OverlayListing:
    """One overlay folder of the state root, for ``coldsnap cache ls`` and ``gc``.

    Attributes:
        path: the overlay folder.
        status: ``current`` (its portable ``artifact.json`` exists with the bound SHA-256), ``stale``
            (that descriptor is gone or changed), ``invalid`` (its ``overlay.json`` is not trusted) or
            ``unreadable`` (that descriptor exists or may exist but cannot be read now: kept by ``gc``).
        reason: why, in words.
        descriptor: the parsed descriptor (``None`` when invalid).
        size_bytes: the bytes of its files.
    """

    path: Path
    status: Literal["current", "stale", "invalid", "unreadable"]
    reason: str
    descriptor: OverlayDescriptor | None
    size_bytes: int


def list_overlays(state_root: Path) -> list[OverlayListing]:
    """Every overlay folder (``overlays/<artifact>/<target>/<capsule>``) of ``state_root``, sorted by path.

    Raises:
        UnsafePathError: ``<state_root>/overlays`` is a symbolic link.
    """
    top = state_root / OVERLAYS_DIRNAME
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError("refusing a symbolic link or file where the overlays folder belongs", file=top)
    listings = []
    for path in sorted(p for p in top.glob("*/*/*") if not p.name.startswith(".")):
        size = sum(f.lstat().st_size for f in path.iterdir()) if path.is_dir() and not path.is_symlink() else 0
        try:
            if not _refuse_linked_folders(state_root, path):
                continue
            descriptor = read_private_record(path / OVERLAY_FILENAME, OverlayDescriptor)
        except (ColdsnapError, OSError) as exc:
            listings.append(OverlayListing(path, "invalid", str(exc), None, size))
            continue
        try:
            now = portable_descriptor_sha256(Path(descriptor.artifact_dir))
        except MissingObjectError as exc:
            listings.append(
                OverlayListing(path, "stale", f"its portable {DESCRIPTOR_FILENAME} is gone ({exc.detail})", descriptor, size)
            )
            continue
        except ColdsnapError as exc:
            # Only a missing descriptor is gone: one that cannot be read now (EACCES, an NFS outage, EIO) may
            # still be there, and removing its overlay would wipe every overlay of a node on a transient error.
            listings.append(
                OverlayListing(path, "unreadable", f"its portable {DESCRIPTOR_FILENAME} cannot be read ({exc})", descriptor, size)
            )
            continue
        if now != descriptor.portable_descriptor_sha256:
            listings.append(OverlayListing(path, "stale", f"its portable {DESCRIPTOR_FILENAME} changed", descriptor, size))
        else:
            listings.append(OverlayListing(path, "current", "bound to the portable artifact as it is", descriptor, size))
    return listings


def gc_overlays(state_root: Path, *, dry_run: bool = False) -> tuple[list[OverlayListing], list[OverlayListing]]:
    """Remove every stale or invalid overlay folder (:func:`list_overlays`), then empty parent folders.

    Returns what was (or, with ``dry_run``, would be) removed, and the unreadable overlays that were kept
    (their portable descriptor could not be read: ``coldsnap cache gc`` then exits 4). Current overlays
    are kept too."""
    listings = list_overlays(state_root)
    removed = [o for o in listings if o.status in ("stale", "invalid")]
    unreadable = [o for o in listings if o.status == "unreadable"]
    if dry_run:
        return removed, unreadable
    for o in removed:
        shutil.rmtree(o.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(_overlay_lock_path(o.path))
        for parent in (o.path.parent, o.path.parent.parent):
            with contextlib.suppress(OSError):
                parent.rmdir()  # only when empty
    return removed, unreadable


__all__ = [
    "OVERLAYS_DIRNAME",
    "OVERLAY_FILENAME",
    "Lookup",
    "OverlayCapture",
    "OverlayDescriptor",
    "OverlayListing",
    "Selection",
    "attach_overlay_seed",
    "capture_overlay",
    "find_overlay",
    "gc_overlays",
    "list_overlays",
    "overlay_dir",
    "portable_descriptor_sha256",
    "select_capsule",
]
