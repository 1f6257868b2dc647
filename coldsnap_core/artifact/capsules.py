"""Reading and writing artifact folders: unit capsules and ``artifact.json``, the root of trust whose pins
:func:`read_pinned_capsule` checks before anything in a capsule is used (``docs/format.md`` §5)."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import filelock
import msgspec

from coldsnap_core._io import (
    fsync_dir,
    lstat_or_none,
    os_error,
    remove_tree,
    replace_file_durably,
    sha256_file,
    write_file_durably,
)
from coldsnap_core.errors import (
    ArtifactError,
    CapsulePinMismatchError,
    ManifestError,
    ManifestMismatchError,
    MissingObjectError,
    NotRegularFileError,
    UnsafePathError,
)
from coldsnap_core.format._strict import MAX_DESCRIPTOR_BYTES, read_document_bytes
from coldsnap_core.format.content_ref import ContentRef
from coldsnap_core.format.descriptor import (
    DESCRIPTOR_FILENAME,
    WORKERS_DIRNAME,
    ArtifactDescriptor,
    CapsuleFile,
    WorkerEntry,
)
from coldsnap_core.format.manifest import (
    CAPSULE_NAME_RE,
    NATIVE_MANIFEST_FILENAME,
    RECOVERY_MANIFEST_FILENAME,
    ModelIdentity,
    NativeManifest,
    PackRef,
    RecoveryManifest,
    WorkerIdentity,
)
from coldsnap_core.format.target import TARGET_FILENAME, TargetIdentity

logger = logging.getLogger(__name__)
T = TypeVar("T")


def replace_dir_atomically(final: Path, fill: Callable[[Path], T]) -> T:
    """Fill a hidden staging folder next to ``final`` (``fill(staging)`` fsyncs each file), swap it in and return
    ``fill``'s result; a previous ``final`` is moved aside, then deleted (a failure leaves it, and no staging folder)."""
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


def descriptor_lock_path(artifact_dir: Path) -> Path:
    """``<artifact_dir>/.artifact.json.lock``: the lock that serializes ``artifact.json`` updates."""
    return artifact_dir / f".{DESCRIPTOR_FILENAME}.lock"


def check_artifact_paths(artifact_dir: Path, worker: WorkerIdentity) -> None:
    """Refuse, before a capture writes, a link at the descriptor lock, ``workers/`` or the capsule lock (the artifact
    folder may be one: ``current -> a``): UnsafePathError (rule ``no-symlinks``), NotRegularFileError, FileAccessError."""
    workers_dir = artifact_dir / WORKERS_DIRNAME
    _refuse_link(descriptor_lock_path(artifact_dir), regular=True)
    _refuse_link(workers_dir, regular=False)
    _refuse_link(_capsule_lock_path(workers_dir, worker.capsule_name), regular=True)


def _refuse_link(path: Path, *, regular: bool) -> None:
    st = lstat_or_none(path)
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError("refusing a symbolic link in the artifact folder", file=path)
    if regular and not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(f"an artifact lock path is not a regular file ({stat.filemode(st.st_mode)})", file=path)
    if not regular and not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError("an artifact folder path is not a folder", file=path)


@contextlib.contextmanager
def _artifact_lock(path: Path) -> Iterator[None]:
    """Hold the ``filelock`` lock at ``path``; a symbolic link there is an ``UnsafePathError``, not ``ELOOP``."""
    _refuse_link(path, regular=True)
    lock = filelock.FileLock(path)
    try:
        lock.acquire()
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the check
            raise UnsafePathError("refusing a symbolic link in the artifact folder", file=path) from exc
        raise os_error("cannot take the artifact lock", exc, path) from exc
    try:
        yield
    finally:
        lock.release()


def write_capsule(artifact_dir: Path, worker: WorkerIdentity, fill: Callable[[Path], T]) -> tuple[Path, T]:
    """Create (or replace) ``workers/<capsule name>`` by :func:`replace_dir_atomically` under its lock; ``(path, result)``."""
    check_artifact_paths(artifact_dir, worker)
    workers_dir = artifact_dir / WORKERS_DIRNAME
    workers_dir.mkdir(parents=True, exist_ok=True)
    final = workers_dir / worker.capsule_name
    with _artifact_lock(_capsule_lock_path(workers_dir, worker.capsule_name)):
        sweep_capsule_debris(workers_dir, worker.capsule_name)
        result = replace_dir_atomically(final, fill)
    return final, result


def _capsule_lock_path(workers_dir: Path, capsule_name: str) -> Path:
    return workers_dir / f".{capsule_name}.lock"


def sweep_capsule_debris(workers_dir: Path, capsule_name: str) -> list[Path]:
    """Remove (and return) the ``.<name>.<hex16>.partial`` / ``.old`` folders a killed writer left; hold its lock."""
    pattern = re.compile(rf"\.{re.escape(capsule_name)}\.[0-9a-f]{{16}}\.(partial|old)")
    removed = []
    for child in sorted(workers_dir.iterdir()):
        if pattern.fullmatch(child.name):
            remove_tree(child)
            removed.append(child)
    if removed:
        logger.info("coldsnap: removed %d stale staging folder(s) of %s: %s", len(removed), capsule_name, removed)
    return removed


def remove_other_worlds(artifact_dir: Path, world_size: int, data_parallel_size: int = 1) -> list[Path]:
    """Remove (and return) every capsule folder of another world size or data parallel size (``docs/format.md`` §5)."""
    workers_dir = artifact_dir / WORKERS_DIRNAME
    if not workers_dir.is_dir():
        return []
    removed = []
    for child in sorted(workers_dir.iterdir()):
        match = CAPSULE_NAME_RE.fullmatch(child.name)
        if match is None or (int(match["world_size"]), int(match["data_parallel_size"] or 1)) == (world_size, data_parallel_size):
            continue
        with _artifact_lock(_capsule_lock_path(workers_dir, child.name)):
            aside = workers_dir / f".{child.name}.{secrets.token_hex(8)}.old"
            try:
                os.rename(child, aside)
            except FileNotFoundError:
                continue
            fsync_dir(workers_dir)
            remove_tree(aside)
        removed.append(child)
    if removed:
        logger.warning(
            "coldsnap: %s: removed the capsules of another world (this capture has world size %d, data parallel size %d): %s",
            artifact_dir,
            world_size,
            data_parallel_size,
            ", ".join(p.name for p in removed),
        )
    return removed


def register_worker(artifact_dir: Path, model: ModelIdentity, entry: WorkerEntry) -> ArtifactDescriptor:
    """Add (or replace) ``entry`` in ``artifact.json`` under the descriptor's lock (``docs/format.md`` §5: another
    model's or an unreadable descriptor is started afresh, another world's capsules go)."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    path = artifact_dir / DESCRIPTOR_FILENAME
    with _artifact_lock(descriptor_lock_path(artifact_dir)):
        existing = None
        if path.exists():
            try:
                existing = ArtifactDescriptor.read(path)
            except ManifestError as exc:
                logger.warning("coldsnap: %s cannot be read (%s); starting a new descriptor", path, exc)
            if existing is not None and existing.model != model:
                logger.warning(
                    "coldsnap: %s described model %s; starting a new descriptor for %s", path, existing.model.source, model.source
                )
                existing = None
        descriptor = existing.with_worker(entry) if existing is not None else ArtifactDescriptor(model, (entry,))
        replace_file_durably(path, descriptor.dumps())
        remove_other_worlds(artifact_dir, entry.worker.world_size, entry.worker.data_parallel_size)
    return descriptor


def pin_file(name: str, data: bytes) -> CapsuleFile:
    """The pin of a capsule file whose whole content is ``data``."""
    return CapsuleFile(name, len(data), hashlib.sha256(data).hexdigest())


@dataclass(frozen=True, slots=True)
class Capsule:
    """A worker's unit capsule as read from disk (``target``: ``None`` for one without ``target.json``, read on its own)."""

    path: Path
    native: NativeManifest
    recovery: RecoveryManifest
    target: TargetIdentity | None = None

    @property
    def blob_path(self) -> Path:
        return self.path / self.native.residual.file

    @property
    def native_manifest_path(self) -> Path:
        return self.path / NATIVE_MANIFEST_FILENAME


def read_capsule(path: Path) -> Capsule:
    """Read a capsule on its own, unpinned (``coldsnap verify CAPSULE``): both manifests parse and agree with each other
    and with the folder's name. MissingObjectError (the capsule or a manifest is missing), ManifestError (malformed or
    unsupported), ManifestMismatchError (a disagreement: with each other, the folder or, pinned, the entry; exit 2)."""
    return _read_capsule(path, {})


def _check_pinned_size(path: Path, pin: ContentRef, size_bytes: int, pinned_by: str = DESCRIPTOR_FILENAME) -> None:
    """Before a pinned file is read: its size must be the pinned one (so a huge file is never read)."""
    if size_bytes != pin.size_bytes:
        raise CapsulePinMismatchError(
            f"{path.name} is {size_bytes} bytes; {pinned_by} pins {pin.size_bytes} bytes with SHA-256 {pin.sha256}",
            file=path,
        )


def check_pin(path: Path, size_bytes: int, sha256: str, pin: ContentRef, pinned_by: str = DESCRIPTOR_FILENAME) -> None:
    """Raise ``CapsulePinMismatchError`` (naming both sizes and digests) unless ``size_bytes`` and ``sha256`` are ``pin``'s."""
    if (size_bytes, sha256) != (pin.size_bytes, pin.sha256):
        raise CapsulePinMismatchError(
            f"{path.name} is {size_bytes} bytes with SHA-256 {sha256}; {pinned_by} pins {pin.size_bytes} bytes with"
            f" SHA-256 {pin.sha256}",
            file=path,
        )


def check_pinned_file(path: Path, pin: ContentRef, *, pinned_by: str = DESCRIPTOR_FILENAME) -> None:
    """The regular file at ``path`` has ``pin``'s size (checked first) and SHA-256; ``pinned_by`` names the pin's source.
    MissingObjectError (nothing there), NotRegularFileError (after links), FileAccessError (unreadable), or
    CapsulePinMismatchError (another size or SHA-256, naming both)."""
    _require_present(path, f"a file {pinned_by} pins")
    st = path.stat()
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(f"a pinned file is not a regular file ({stat.filemode(st.st_mode)})", file=path)
    _check_pinned_size(path, pin, st.st_size, pinned_by)
    try:
        digest, size_bytes = sha256_file(path)
    except OSError as exc:
        raise os_error("cannot read a pinned file", exc, path) from exc
    check_pin(path, size_bytes, digest, pin, pinned_by)


_DOCUMENTS = (NATIVE_MANIFEST_FILENAME, RECOVERY_MANIFEST_FILENAME, TARGET_FILENAME)


def _read_capsule(path: Path, pins: dict[str, CapsuleFile | None]) -> Capsule:
    _require_present(path, "capsule folder")
    if not path.is_dir():
        raise MissingObjectError("capsule folder does not exist (a file is in its place)", file=path)
    data = {name: _read_document_bytes(path / name, pins) for name in _DOCUMENTS}
    native = NativeManifest.loads(data[NATIVE_MANIFEST_FILENAME], file=str(path / NATIVE_MANIFEST_FILENAME))
    recovery = RecoveryManifest.loads(data[RECOVERY_MANIFEST_FILENAME], file=str(path / RECOVERY_MANIFEST_FILENAME))
    target_data = data[TARGET_FILENAME]
    target = TargetIdentity.loads(target_data, file=str(path / TARGET_FILENAME)) if target_data is not None else None
    differing = [
        name
        for name in ("worker", "layout_fingerprint", "allocations", "residual", "residual_extents")
        if getattr(native, name) != getattr(recovery, name)
    ]
    if differing:
        raise ManifestMismatchError(f"the native and recovery manifests disagree on {', '.join(differing)}", file=path)
    # the two equal maps are held once (a model with many tensors holds them for the whole restore)
    recovery = msgspec.structs.replace(recovery, allocations=native.allocations, residual_extents=native.residual_extents)
    if path.name != native.worker.capsule_name:
        raise ManifestMismatchError(
            f"the capsule folder is named {path.name!r}, but its manifests belong to {native.worker.capsule_name}"
            f" (rank {native.worker.rank} of {native.worker.world_size}, tensor parallel rank"
            f" {native.worker.tensor_parallel_rank} of {native.worker.tensor_parallel_size})",
            file=path,
        )
    return Capsule(path, native, recovery, target)


def _read_document_bytes(path: Path, pins: dict[str, CapsuleFile | None]) -> bytes | None:
    """A capsule document's bytes, checked against its pin when read with pins; unpinned ``target.json``: ``None`` when absent."""
    if path.name not in pins:
        return None if path.name == TARGET_FILENAME and not os.path.lexists(path) else read_document_bytes(path)
    pin = pins[path.name]
    if pin is None:
        raise CapsulePinMismatchError(f"artifact.json pins no {path.name} for this capsule", file=path)
    if path.name == TARGET_FILENAME:
        _require_present(path, "target identity")
    data = read_document_bytes(path, check_size=functools.partial(_check_pinned_size, path, pin))
    check_pin(path, len(data), hashlib.sha256(data).hexdigest(), pin)
    return data


def read_worker_capsule(artifact_dir: Path, entry: WorkerEntry) -> Capsule:
    """:func:`read_pinned_capsule` of one ``artifact.json`` entry's capsule."""
    return read_pinned_capsule(artifact_dir / entry.capsule, entry)


def read_pinned_capsule(path: Path, entry: WorkerEntry) -> Capsule:
    """Read the capsule at ``path`` pinned by ``entry`` (an artifact's or an overlay's): each manifest matches its pin
    before it is parsed, and folder, manifests and entry name one worker, residual blob and payload. Raises as
    :func:`read_capsule`, and CapsulePinMismatchError when a manifest's or the blob's pin does not match (exit 2)."""
    pins = {name: entry.pin(name) for name in _DOCUMENTS}
    capsule = _read_capsule(path, pins)
    native = capsule.native
    if native.worker != entry.worker:
        raise ManifestMismatchError(
            f"artifact.json lists this capsule for {entry.worker.capsule_name} ({entry.worker.describe()}), its manifests"
            f" belong to {native.worker.capsule_name} ({native.worker.describe()})",
            file=path,
        )
    blob_pin = entry.pin(native.residual.file)
    if blob_pin is None or (blob_pin.size_bytes, blob_pin.sha256) != (native.residual.size_bytes, native.residual.sha256):
        pinned = (
            f"{blob_pin.size_bytes} bytes with SHA-256 {blob_pin.sha256}"
            if blob_pin is not None
            else f"nothing named {native.residual.file}"
        )
        raise CapsulePinMismatchError(
            f"artifact.json pins {pinned} for the residual blob, the native manifest names {native.residual.file}"
            f" ({native.residual.size_bytes} bytes, SHA-256 {native.residual.sha256})",
            file=path / native.residual.file,
        )
    if native.pack != entry.payload:
        raise ManifestMismatchError(
            f"artifact.json names pack {_describe_pack(entry.payload)}, the capsule's native manifest"
            f" {_describe_pack(native.pack)}",
            file=capsule.native_manifest_path,
        )
    return capsule


def _describe_pack(pack: PackRef) -> str:
    return f"{pack.sha256} ({pack.size_bytes} bytes, path {pack.path!r})"


def check_provenance_in_identity(manifest: NativeManifest, model: ModelIdentity, *, file: str | None = None) -> None:
    """Raise ``ManifestMismatchError`` for the first model extent whose ``checkpoint_file`` the identity does not list."""
    names = {f.name for f in model.files}
    for i, extent in enumerate(manifest.model_extents):
        if extent.provenance.checkpoint_file not in names:
            raise ManifestMismatchError(
                f"model extent {i} comes from checkpoint file {extent.provenance.checkpoint_file!r}, which the model"
                f" identity does not list ({', '.join(sorted(names))})",
                file=file,
                allocation=extent.allocation_index,
                offset_bytes=extent.offset_bytes,
            )


def find_worker(descriptor: ArtifactDescriptor, worker: WorkerIdentity) -> WorkerEntry:
    """The descriptor's entry for ``worker`` (equal in every identity field); MissingObjectError when it has none."""
    for entry in descriptor.workers:
        if entry.worker == worker:
            return entry
    raise MissingObjectError(f"the artifact lists no capsule for {worker.capsule_name} ({worker.describe()})")


def read_descriptor(artifact_dir: Path) -> ArtifactDescriptor:
    """Read and strictly parse ``<artifact_dir>/artifact.json``: MissingObjectError when absent, NotRegularFileError
    or FileAccessError (a link loop: rule ``io``) when it cannot be read, ManifestError when malformed."""
    return read_descriptor_bytes(artifact_dir)[0]


def read_descriptor_bytes(artifact_dir: Path) -> tuple[ArtifactDescriptor, str]:
    """:func:`read_descriptor` and the SHA-256 of the very bytes parsed (what an overlay binds to, ``docs/format.md`` §15.3)."""
    path = artifact_dir / DESCRIPTOR_FILENAME
    _require_present(path, "artifact descriptor")
    data = read_document_bytes(path, max_bytes=MAX_DESCRIPTOR_BYTES)
    return ArtifactDescriptor.loads(data, file=str(path)), hashlib.sha256(data).hexdigest()


_NO_ARTIFACT_REMEDY = (
    "check COLDSNAP_ARTIFACT_DIR (the artifact folder, or a REF), or write the artifact there:"
    " coldsnap pull REF DIR, or coldsnap export -- ENGINE COMMAND"
)


def _require_present(path: Path, what: str) -> None:
    """``MissingObjectError`` if nothing is at ``path`` (``artifact.json``: with a remedy); typed if it cannot be examined."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        remedy = _NO_ARTIFACT_REMEDY if path.name == DESCRIPTOR_FILENAME else None
        raise MissingObjectError(f"{what} does not exist", file=path, remedy=remedy) from exc
    except OSError as exc:
        raise os_error(f"{what} cannot be examined", exc, path) from exc


def write_manifests(
    staging: Path, native: NativeManifest, recovery: RecoveryManifest | None, target: TargetIdentity | None
) -> tuple[CapsuleFile, ...]:
    """Write each given document into a capsule staging folder (fsynced); return their and the blob's pins, by name."""
    pins = [CapsuleFile.of(native.residual)]
    for name, document in ((NATIVE_MANIFEST_FILENAME, native), (RECOVERY_MANIFEST_FILENAME, recovery), (TARGET_FILENAME, target)):
        if document is not None:
            data = document.dumps()
            write_file_durably(staging / name, data)
            pins.append(pin_file(name, data))
    return tuple(sorted(pins, key=lambda p: p.name))


def check_artifact_layout(artifact_dir: Path) -> None:
    """Every non-hidden folder of ``workers/`` is listed in ``artifact.json`` (else ArtifactError; none: MissingObjectError)."""
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
