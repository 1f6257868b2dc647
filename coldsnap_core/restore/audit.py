"""Verify an artifact: every rule over every byte of every worker's payloads (what ``coldsnap verify`` runs).

Order (each step raises the first failure it finds; ``docs/format.md``, "Verification rules"):

1. for an artifact folder, every capsule folder is listed in ``artifact.json``, its ``model/`` folder holds
   exactly the pinned model files, each of its pinned size and SHA-256
   (:func:`coldsnap_core.artifact.model_files.verify_model_files`), and every capsule's
   recovery manifest names the descriptor's model identity; every model extent comes from a checkpoint
   file of the model identity;
2. per worker, every manifest rule (:func:`coldsnap_core.format.verify.check_manifest`);
3. the cache folders are checked as the cache commands check them (no symbolic link at
   ``model-payloads/`` or below, :meth:`coldsnap_core.cache.payload_cache.PayloadCache.check_dirs`); per distinct pack,
   one full read (:func:`coldsnap_core.format.verify.verify_pack_file`): size, zero padding, every stored
   extent's SHA-256, the file's SHA-256; a symbolic link or non-regular file at the object path is refused;
4. per worker, the residual blob: size, then SHA-256; for a capsule of an artifact with a derived-cache
   seed, its two files against their pins and each archived file against its size and SHA-256
   (:func:`coldsnap_core.artifact.derived_cache.verify_seed`, ``docs/format.md`` §17).

Nothing is written (no validation record either): this is a read-only audit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
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
    """One worker whose pack and residual blob verified.

    Attributes:
        worker: the worker.
        pack: its pack (digest, size in bytes, derived path).
        model_extents: the number of model extents of its native manifest.
        residual_bytes: the size of its residual blob, in bytes.
    """

    worker: WorkerIdentity
    pack: PackRef
    model_extents: int
    residual_bytes: int


@contextlib.contextmanager
def _no_progress(pack: PackRef) -> Iterator[None]:
    yield None


def verify_capsules(
    descriptor: ArtifactDescriptor | None,
    capsules: Sequence[Capsule],
    *,
    cache: PayloadCache,
    artifact_dir: Path | None = None,
    progress_for: ProgressFor | None = None,
) -> list[VerifiedWorker]:
    """Verify ``capsules`` (read with their pins by :func:`coldsnap_core.artifact.capsules.read_worker_capsule`,
    or one capsule read on its own) against ``descriptor`` and the packs in ``cache``; see the module
    docstring for the order. Each distinct pack is read once.

    Args:
        descriptor: the artifact's ``artifact.json`` (``None``: capsules outside an artifact).
        capsules: the capsules, in order.
        cache: where the packs live.
        artifact_dir: the artifact folder (checked for capsule folders ``artifact.json`` does not list).
        progress_for: progress callbacks per pack read.

    Returns:
        One :class:`VerifiedWorker` per capsule, in order.

    Raises:
        ColdsnapError: the first failed rule (names rule, file, allocation and offset).
    """
    progress_for = progress_for or _no_progress
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
    """Verify every worker of the artifact folder ``artifact_dir`` (its ``artifact.json``, every capsule
    and its pins, every pack in ``cache`` and every residual blob); read only.

    Args:
        artifact_dir: the artifact folder.
        cache: where the packs live (default: ``~/.cache/coldsnap``; the environment is read only where a
            plugin or the CLI starts, so a caller with another state root passes its ``PayloadCache``).
        progress_for: progress callbacks per pack read.

    Returns:
        One :class:`VerifiedWorker` per worker listed in ``artifact.json``, in its order.

    Raises:
        MissingObjectError: no ``artifact.json``, a missing capsule file or pack.
        ColdsnapError: the first failed rule (see :func:`verify_capsules`).
    """
    artifact_dir = Path(artifact_dir)
    descriptor = read_descriptor(artifact_dir)
    capsules = [read_worker_capsule(artifact_dir, entry) for entry in descriptor.workers]
    return verify_capsules(
        descriptor, capsules, cache=cache or PayloadCache(), artifact_dir=artifact_dir, progress_for=progress_for
    )
