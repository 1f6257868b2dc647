"""Target-local residual overlays: the documents and paths of a node's own capsule (``docs/format.md`` §15.3)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Literal

from coldsnap_core.errors import ManifestValueError, UnsafePathError
from coldsnap_core.format._strict import Document, Sha256, Text, read_document_bytes
from coldsnap_core.format.descriptor import (
    DESCRIPTOR_FILENAME,
    SEED_FILENAMES,
    WORKERS_DIRNAME,
    CapsuleFile,
    WorkerEntry,
    check_capsule_file_names,
)
from coldsnap_core.format.manifest import RESIDUAL_FILENAME, PackRef, WorkerIdentity
from coldsnap_core.format.target import TargetIdentity

OVERLAYS_DIRNAME = "overlays"
OVERLAY_KIND = "coldsnap.overlay"
OVERLAY_FILENAME = "overlay.json"

OverlayKind = Literal["overlay", "qualified"]


def artifact_key(artifact_dir: Path) -> str:
    """The folder name of one portable artifact's overlays: SHA-256 of its folder's real path."""
    return hashlib.sha256(os.path.realpath(artifact_dir).encode("utf-8", "surrogateescape")).hexdigest()


def target_key(target: TargetIdentity) -> str:
    """``sha256(b"coldsnap-target-v1\\n" + canonical JSON of the target identity)``: the folder name of one target's overlays."""
    canonical = json.dumps(target.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(b"coldsnap-target-v1\n" + canonical.encode("ascii")).hexdigest()


def overlay_dir(state_root: Path, artifact_dir: Path, worker: WorkerIdentity, target: TargetIdentity) -> Path:
    """``<state_root>/overlays/<artifact_key>/<target_key>/<capsule_name>``."""
    return state_root / OVERLAYS_DIRNAME / artifact_key(artifact_dir) / target_key(target) / worker.capsule_name


def portable_descriptor_sha256(artifact_dir: Path) -> str:
    """SHA-256 of the portable artifact's ``artifact.json`` bytes as they are now (raises as ``read_document_bytes``)."""
    return hashlib.sha256(read_document_bytes(artifact_dir / DESCRIPTOR_FILENAME)).hexdigest()


class OverlayDescriptor(Document, tag=OVERLAY_KIND):
    """``overlay.json`` (``docs/format.md`` §15.3): kind ``overlay`` (the folder holds this target's capsule) or
    ``qualified`` (the portable capsule is replayed on this target), bound to the portable ``artifact.json``'s bytes;
    ManifestValueError when the pins do not fit the kind."""

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


def refuse_linked_folders(state_root: Path, path: Path, *, create: bool = False) -> bool:
    """Each folder from ``<state_root>/overlays`` down to ``path`` must be a real folder (else UnsafePathError); with
    ``create``, each absent one is made (mode 0700). Returns ``False`` when one is absent."""
    top = state_root / OVERLAYS_DIRNAME
    if create:
        state_root.mkdir(parents=True, exist_ok=True)
    for folder in [top, *reversed([p for p in path.parents if p != top and top in p.parents]), path]:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o700)
        try:
            st = os.lstat(folder)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError("refusing a symbolic link or file where an overlay folder belongs", file=folder)
    return True


def overlay_lock_path(path: Path) -> Path:
    """``<target folder>/.<capsule>.lock``: serializes an overlay's capture and the attachment of its seed."""
    return path.parent / f".{path.name}.lock"
