"""Reading and writing artifact folders: unit capsules and the ``artifact.json`` descriptor.

Nothing on disk is ever half-valid:

* a capsule is written into a hidden staging folder (``workers/.<name>.<random>.partial``), every file
  fsynced, then renamed into place as a whole (a previous capsule of the same worker is moved
  aside first and deleted after); a crash leaves either the old capsule, the new one, or none
  (then restore falls back), never a mixture;
* ``artifact.json`` is rewritten under a ``filelock`` lock by temporary file, fsync, rename and
  folder fsync, so concurrent tensor parallel ranks all land in one descriptor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import filelock

from coldsnap_core._io import fsync_dir, fsync_fd, write_all
from coldsnap_core.errors import ArtifactError, ManifestMismatchError, MissingObjectError
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, WORKERS_DIRNAME, ArtifactDescriptor, WorkerEntry
from coldsnap_core.format.manifest import (
    NATIVE_MANIFEST_FILENAME,
    RECOVERY_MANIFEST_FILENAME,
    ModelIdentity,
    NativeManifest,
    RecoveryManifest,
    WorkerIdentity,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


def write_file_durably(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write a new small file (``O_EXCL``), fsync it. The caller fsyncs the folder."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        write_all(fd, data, file=path)
        fsync_fd(fd, file=path)
    finally:
        os.close(fd)


def replace_file_durably(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Atomically replace ``path`` with ``data``: unique temporary name, fsync, rename, folder fsync."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    try:
        write_file_durably(temp, data, mode=mode)
        os.rename(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    fsync_dir(path.parent)


def replace_dir_atomically(final: Path, fill: Callable[[Path], T]) -> T:
    """Build a folder in a hidden staging folder next to ``final``, fsync it, and swap it in.

    ``fill`` is called with the staging folder and writes the files (each fsynced). A previous
    ``final`` is moved aside first and deleted after; a failure leaves the previous ``final`` (if
    any) untouched and no staging folder behind. Returns ``fill``'s result.
    """
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    staging = parent / f".{final.name}.{token}.partial"
    staging.mkdir()
    try:
        result = fill(staging)
        fsync_dir(staging)
        old = None
        if final.exists():
            old = parent / f".{final.name}.{token}.old"
            os.rename(final, old)
        os.rename(staging, final)
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return result


def write_capsule(artifact_dir: Path, worker: WorkerIdentity, fill: Callable[[Path], T]) -> tuple[Path, T]:
    """Create (or replace) the unit capsule of ``worker`` as one atomic step, under the capsule's lock.

    Args:
        artifact_dir: the artifact folder.
        worker: whose capsule (``workers/<worker.capsule_name>``).
        fill: called with the staging folder; writes the capsule's files there (each fsynced).

    Returns:
        ``(capsule path, fill's result)``.
    """
    workers_dir = artifact_dir / WORKERS_DIRNAME
    workers_dir.mkdir(parents=True, exist_ok=True)
    final = workers_dir / worker.capsule_name
    with filelock.FileLock(workers_dir / f".{worker.capsule_name}.lock"):
        result = replace_dir_atomically(final, fill)
    return final, result


def register_worker(artifact_dir: Path, model: ModelIdentity, entry: WorkerEntry) -> ArtifactDescriptor:
    """Add (or replace) ``entry`` in ``artifact.json``, under the descriptor's lock.

    A descriptor that names another model identity is started afresh (its workers are stale), with a
    WARNING.
    """
    artifact_dir.mkdir(parents=True, exist_ok=True)
    path = artifact_dir / DESCRIPTOR_FILENAME
    with filelock.FileLock(artifact_dir / f".{DESCRIPTOR_FILENAME}.lock"):
        descriptor = ArtifactDescriptor(model, ())
        if path.exists():
            existing = ArtifactDescriptor.read(path)
            if existing.model == model:
                descriptor = existing
            else:
                logger.warning(
                    "coldsnap: %s described model %s; starting a new descriptor for %s", path, existing.model.source, model.source
                )
        descriptor = descriptor.with_worker(entry)
        replace_file_durably(path, descriptor.dumps())
    return descriptor


@dataclass(frozen=True, slots=True)
class Capsule:
    """A worker's unit capsule as read from disk."""

    path: Path
    native: NativeManifest
    recovery: RecoveryManifest

    @property
    def blob_path(self) -> Path:
        return self.path / self.native.residual.file

    @property
    def native_manifest_path(self) -> Path:
        return self.path / NATIVE_MANIFEST_FILENAME


def read_capsule(path: Path) -> Capsule:
    """Read and strictly parse a capsule's two manifests and check that they agree.

    Raises:
        MissingObjectError: the capsule or a manifest is missing.
        ManifestError: a manifest is malformed or unsupported.
        ManifestMismatchError: the two manifests disagree (worker, layout fingerprint, allocation map,
            residual blob or residual map); an :class:`ArtifactError` with exit code 2.
    """
    if not path.is_dir():
        raise MissingObjectError("capsule folder does not exist", file=path)
    native = NativeManifest.read(path / NATIVE_MANIFEST_FILENAME)
    recovery = RecoveryManifest.read(path / RECOVERY_MANIFEST_FILENAME)
    if (native.worker, native.layout_fingerprint, native.residual, native.residual_extents, native.allocations) != (
        recovery.worker,
        recovery.layout_fingerprint,
        recovery.residual,
        recovery.residual_extents,
        recovery.allocations,
    ):
        raise ManifestMismatchError(
            "the native and recovery manifests disagree on worker, layout, allocations, residual blob or residual map", file=path
        )
    return Capsule(path, native, recovery)


def find_worker(descriptor: ArtifactDescriptor, worker: WorkerIdentity) -> WorkerEntry:
    """The descriptor's entry for ``worker`` (same role, rank, world size and tensor parallel rank).

    Raises:
        MissingObjectError: the artifact has no capsule for this worker.
    """
    for entry in descriptor.workers:
        if entry.worker == worker:
            return entry
    raise MissingObjectError(
        f"the artifact lists no capsule for {worker.capsule_name} (tensor parallel rank {worker.tensor_parallel_rank})"
    )


def read_descriptor(artifact_dir: Path) -> ArtifactDescriptor:
    path = artifact_dir / DESCRIPTOR_FILENAME
    if not path.exists():
        raise MissingObjectError("artifact descriptor does not exist", file=path)
    return ArtifactDescriptor.read(path)


def write_manifests(staging: Path, native: NativeManifest, recovery: RecoveryManifest) -> None:
    """Write both manifests into a capsule staging folder (each fsynced)."""
    write_file_durably(staging / NATIVE_MANIFEST_FILENAME, native.dumps())
    write_file_durably(staging / RECOVERY_MANIFEST_FILENAME, recovery.dumps())


def check_artifact_layout(artifact_dir: Path) -> None:
    """Every capsule folder in ``workers/`` is listed in the descriptor (stale capsules are an error).

    Hidden entries (staging folders ``.<name>.<random>.partial``, locks) are ignored.

    Raises:
        MissingObjectError: no ``artifact.json``.
        ArtifactError: a capsule folder is not listed (names the folder).
    """
    descriptor = read_descriptor(artifact_dir)
    listed = {entry.capsule for entry in descriptor.workers}
    workers_dir = artifact_dir / WORKERS_DIRNAME
    if not workers_dir.is_dir():
        return
    for child in sorted(workers_dir.iterdir()):
        if child.name.startswith("."):
            continue
        if f"{WORKERS_DIRNAME}/{child.name}" not in listed:
            raise ArtifactError("capsule is not listed in artifact.json", file=child)
