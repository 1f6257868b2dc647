"""Verify an artifact: every rule over every byte of every worker's payloads (what ``coldsnap verify`` runs), in the
order of ``docs/format.md`` §7 ("Order of checks", **coldsnap verify**), each pack read once. Nothing is written (no
validation record either)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core._io import refuse_symlink
from coldsnap_core.artifact.capsules import (
    Capsule,
    check_artifact_layout,
    check_provenance_in_identity,
    find_worker,
    read_descriptor,
    read_worker_capsule,
)
from coldsnap_core.artifact.derived_cache import verify_seed
from coldsnap_core.artifact.model_files import verify_model_files
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.errors import ManifestMismatchError
from coldsnap_core.format.descriptor import ArtifactDescriptor
from coldsnap_core.format.manifest import PackRef, WorkerIdentity
from coldsnap_core.format.verify import check_manifest, extent_owner_map, verify_blob_file, verify_pack_file

ProgressFor = Callable[[PackRef], AbstractContextManager[Callable[[int], object] | None]]
"""Given a pack about to be read, a context manager yielding a callback for bytes read (or ``None``)."""

__all__ = ["VerifiedWorker", "verify_artifact", "verify_capsules"]


@dataclass(frozen=True, slots=True)
class VerifiedWorker:
    """One worker whose pack and residual blob verified: its pack, number of model extents and residual bytes."""

    worker: WorkerIdentity
    pack: PackRef
    model_extents: int
    residual_bytes: int


def verify_capsules(
    descriptor: ArtifactDescriptor | None,
    capsules: Sequence[Capsule],
    *,
    cache: PayloadCache,
    artifact_dir: Path | None = None,
    progress_for: ProgressFor | None = None,
) -> list[VerifiedWorker]:
    """Verify ``capsules`` against ``descriptor`` (``None``: capsules outside an artifact) and the packs in ``cache``;
    ``artifact_dir`` is checked for capsule folders ``artifact.json`` does not list. Raises the first failed rule's error."""
    progress_for = progress_for or (lambda pack: contextlib.nullcontext())
    if descriptor is not None:
        if artifact_dir is not None:
            check_artifact_layout(artifact_dir)
            verify_model_files(artifact_dir, descriptor.pinned_model_files)
        for capsule in capsules:
            if descriptor.model != capsule.recovery.model:
                raise ManifestMismatchError(
                    "artifact.json names another model identity than the capsule's recovery manifest", file=capsule.path
                )
    for capsule in capsules:
        model = descriptor.model if descriptor is not None else capsule.recovery.model
        check_provenance_in_identity(capsule.native, model, file=str(capsule.native_manifest_path))
    layouts = [check_manifest(c.native, file=str(c.native_manifest_path)) for c in capsules]
    cache.check_dirs()
    verified_packs: set[str] = set()
    verified: list[VerifiedWorker] = []
    for capsule, layout in zip(capsules, layouts, strict=True):
        manifest = capsule.native
        if manifest.pack.sha256 not in verified_packs:
            path = cache.object_path(manifest.pack.sha256)
            refuse_symlink(path)
            with progress_for(manifest.pack) as progress:
                verify_pack_file(
                    path,
                    manifest.pack,
                    layout,
                    progress=progress,
                    extent_owner=extent_owner_map(manifest),
                    manifest_file=str(capsule.native_manifest_path),
                )
            verified_packs.add(manifest.pack.sha256)
        verify_blob_file(capsule.blob_path, manifest.residual)
        if descriptor is not None:  # a derived-cache seed's two pinned files (docs/format.md §17.1)
            verify_seed(capsule.path, find_worker(descriptor, manifest.worker).capsule_files)
        verified.append(VerifiedWorker(manifest.worker, manifest.pack, len(manifest.model_extents), manifest.residual.size_bytes))
    return verified


def verify_artifact(
    artifact_dir: str | Path, *, cache: PayloadCache | None = None, progress_for: ProgressFor | None = None
) -> list[VerifiedWorker]:
    """Verify every worker ``artifact.json`` lists, in order, with the packs in ``cache`` (default ``~/.cache/coldsnap``,
    not the environment's); raises as :func:`verify_capsules` (``MissingObjectError``: a missing file or pack)."""
    artifact_dir = Path(artifact_dir)
    descriptor = read_descriptor(artifact_dir)
    capsules = [read_worker_capsule(artifact_dir, entry) for entry in descriptor.workers]
    return verify_capsules(
        descriptor, capsules, cache=cache or PayloadCache(), artifact_dir=artifact_dir, progress_for=progress_for
    )
