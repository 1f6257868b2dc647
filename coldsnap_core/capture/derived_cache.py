"""The capture of a derived-cache seed (``docs/format.md`` §17.3): a worker's compile cache files (:func:`collect_files`)
written into its captured capsule and pinned in ``artifact.json`` (:func:`attach_seed`), or into an overlay."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
import tarfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from coldsnap_core._io import fsync_fd, sha256_file, sibling_temporary
from coldsnap_core.artifact.capsules import (
    _artifact_lock,
    _capsule_lock_path,
    descriptor_lock_path,
    pin_file,
    replace_file_durably,
)
from coldsnap_core.artifact.derived_cache import (
    MEMBER_RE,
    SEED_ARCHIVE_FILENAME,
    SEED_DOCUMENT_FILENAME,
    SeedDocument,
    SeedMember,
    SeedQualification,
)
from coldsnap_core.errors import ManifestMismatchError, MissingObjectError
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, SEED_FILENAMES, WORKERS_DIRNAME, ArtifactDescriptor, CapsuleFile
from coldsnap_core.format.manifest import WorkerIdentity

logger = logging.getLogger(__name__)


def collect_files(
    roots: Mapping[str, Path], folders: Iterable[tuple[str, str]], *, since_ns: int | None = None
) -> list[tuple[str, Path]]:
    """``(member path, file path)`` of every regular file below each ``(root name, folder below the root)`` (with
    ``since_ns``: modified at or after it), sorted; no lock files, temporaries or hidden files, no links followed."""
    found: dict[str, Path] = {}
    for root_name, folder in folders:
        base = roots[root_name]
        start = base / folder
        if not start.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(start, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d != "locks" and not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith(".") or name.endswith(".lock") or name.endswith(".tmp"):
                    continue
                path = Path(dirpath) / name
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or (since_ns is not None and st.st_mtime_ns < since_ns):
                    continue
                member = f"{root_name}/{path.relative_to(base).as_posix()}"
                if MEMBER_RE.fullmatch(member):
                    found[member] = path
    return sorted(found.items())


def attach_seed(
    artifact_dir: Path,
    worker: WorkerIdentity,
    pack_sha256: str,
    qualification: SeedQualification,
    files: list[tuple[str, Path]],
) -> SeedDocument | None:
    """Write a seed of ``files`` into ``worker``'s capsule (still the one that names pack ``pack_sha256``) and pin it in
    its ``artifact.json`` entry, each under its lock. Returns the document, or ``None`` without files.

    Raises:
        MissingObjectError: the artifact has no entry for ``worker``.
        ManifestMismatchError: the entry names another pack (the capsule was replaced meanwhile).
        UnsafePathError, FileAccessError, InsufficientSpaceError: writing failed.
    """
    if not files:
        return None
    capsule_dir = artifact_dir / WORKERS_DIRNAME / worker.capsule_name
    descriptor_path = artifact_dir / DESCRIPTOR_FILENAME
    with _artifact_lock(_capsule_lock_path(artifact_dir / WORKERS_DIRNAME, worker.capsule_name)):
        _require_entry(ArtifactDescriptor.read(descriptor_path), worker, pack_sha256, descriptor_path)
        document, pins = write_seed_files(capsule_dir, worker, qualification, files)
        with _artifact_lock(descriptor_lock_path(artifact_dir)):
            descriptor = ArtifactDescriptor.read(descriptor_path)
            entry = _require_entry(descriptor, worker, pack_sha256, descriptor_path)
            entry = msgspec.structs.replace(entry, capsule_files=with_seed_pins(entry.capsule_files, pins))
            replace_file_durably(descriptor_path, descriptor.with_worker(entry).dumps())
    log_captured(capsule_dir.name, document)
    return document


def write_seed_files(
    folder: Path, worker: WorkerIdentity, qualification: SeedQualification, files: list[tuple[str, Path]]
) -> tuple[SeedDocument, tuple[CapsuleFile, CapsuleFile]]:
    """Write ``derived-cache.tar`` (an uncompressed tar, owner and times zeroed) and ``derived-cache.json`` into
    ``folder`` (temporary name, fsync, rename; the caller holds its lock); returns the document and the two pins.

    Raises:
        UnsafePathError, FileAccessError, InsufficientSpaceError: writing failed.
    """
    members = []
    with sibling_temporary(folder / SEED_ARCHIVE_FILENAME) as (fd, temp):
        with os.fdopen(fd, "wb", closefd=False) as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for member_path, source in files:
                    data = source.read_bytes()
                    info = tarfile.TarInfo(member_path)
                    info.size, info.mode, info.mtime = len(data), 0o644, 0
                    tar.addfile(info, io.BytesIO(data))
                    members.append(SeedMember(member_path, len(data), hashlib.sha256(data).hexdigest()))
            f.flush()
            fsync_fd(f.fileno(), file=temp)
        digest, size = sha256_file(temp)
        archive = CapsuleFile(SEED_ARCHIVE_FILENAME, size, digest)
        document = SeedDocument(worker, qualification, archive, tuple(members))
        os.rename(temp, folder / SEED_ARCHIVE_FILENAME)
    data = document.dumps()
    replace_file_durably(folder / SEED_DOCUMENT_FILENAME, data)
    return document, (pin_file(SEED_DOCUMENT_FILENAME, data), archive)


def with_seed_pins(capsule_files: Iterable[CapsuleFile], pins: Iterable[CapsuleFile]) -> tuple[CapsuleFile, ...]:
    """``capsule_files`` without any seed pin, plus ``pins``, sorted by name."""
    kept = [p for p in capsule_files if p.name not in SEED_FILENAMES]
    return tuple(sorted([*kept, *pins], key=lambda p: p.name))


def log_captured(capsule_name: str, document: SeedDocument, where: str = "") -> None:
    """The one INFO line of a captured seed (``where``: e.g. `` into the target-local overlay``)."""
    logger.info(
        "coldsnap: %s: derived-cache seed captured%s: %d files, %d bytes (archive %s)",
        capsule_name,
        where,
        len(document.members),
        document.size_bytes,
        document.archive.sha256[:12],
    )


def _require_entry(descriptor: ArtifactDescriptor, worker: WorkerIdentity, pack_sha256: str, file: Path):
    entry = next((e for e in descriptor.workers if e.worker == worker), None)
    if entry is None:
        raise MissingObjectError(f"the artifact lists no capsule for {worker.capsule_name} to attach a seed to", file=file)
    if entry.payload.sha256 != pack_sha256:
        raise ManifestMismatchError(
            f"{worker.capsule_name} now names pack {entry.payload.sha256}, this capture wrote {pack_sha256}: the capsule"
            " was replaced meanwhile; its seed is not attached",
            file=file,
        )
    return entry
