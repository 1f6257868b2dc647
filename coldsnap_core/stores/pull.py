"""Pull a published artifact by its name: the artifact folder, every file it pins checked (``docs/format.md`` §12.9).

Under the lock ``.<DIR>.lock``, a destination holding that artifact intact is kept, else every file is fetched into
a temporary sibling ``.<DIR>.pull-<random>``, fsynced and renamed into place; packs are staged separately.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import filelock

from coldsnap_core._io import fsync_dir, os_error, remove_tree, sha256_file
from coldsnap_core.artifact.capsules import check_pinned_file, read_descriptor_bytes
from coldsnap_core.cache.locks import acquire_logged
from coldsnap_core.errors import (
    ArtifactError,
    CapsulePinMismatchError,
    ConfigurationError,
    FileAccessError,
    LockTimeoutError,
)
from coldsnap_core.format.content_ref import ContentRef
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, ArtifactDescriptor
from coldsnap_core.stores.base import ARTIFACTS_DIRNAME, PayloadStore, PublishedArtifact, artifact_object

logger = logging.getLogger(__name__)

PULL_LOCK_TIMEOUT_SECONDS = 600.0
"""How long a pull waits for another pull of the same folder (which fetches the same files) before it gives up."""


@dataclass(frozen=True, slots=True)
class PulledArtifact:
    """What :func:`pull_artifact` left at ``path``, with the files and bytes fetched (0: the folder held it)."""

    path: Path
    sha256: str
    descriptor: ArtifactDescriptor
    fetched_files: int
    fetched_bytes: int


def pull_into_state_root(
    store: PayloadStore, name: str, state_root: Path, *, lock_timeout_seconds: float = PULL_LOCK_TIMEOUT_SECONDS
) -> PulledArtifact:
    """:func:`pull_artifact` into ``<state_root>/artifacts/sha256/<artifact SHA-256>/`` (``COLDSNAP_ARTIFACT_DIR=REF``)."""
    published = store.resolve_artifact(name)
    dest = Path(state_root) / ARTIFACTS_DIRNAME / "sha256" / published.sha256
    return pull_artifact(store, name, dest, lock_timeout_seconds=lock_timeout_seconds, published=published)


def pull_artifact(
    store: PayloadStore,
    name: str,
    dest: Path,
    *,
    lock_timeout_seconds: float = PULL_LOCK_TIMEOUT_SECONDS,
    published: PublishedArtifact | None = None,
) -> PulledArtifact:
    """Make ``dest`` the artifact ``store`` names ``name``; ``published``: what the name was already resolved to.

    Raises:
        ConfigurationError: ``name`` is not an artifact name.
        PayloadUnavailableError: the store records no artifact under ``name``, or lacks one of its files.
        CapsulePinMismatchError: a fetched file (or one at ``dest``) does not match its pin (nothing is put in place).
        ArtifactError: ``dest`` holds another artifact (another ``artifact.json``): it is never replaced.
        ManifestError: the fetched ``artifact.json`` is malformed.
        LockTimeoutError: another pull of ``dest`` held the lock past ``lock_timeout_seconds``.
        StoreError, FileAccessError, InsufficientSpaceError: the store or the local file system (the lock file) failed.
    """
    if not str(dest).strip():
        # Path("") is the current folder: an empty DIR (an unset variable in a script) would pull into it
        raise ConfigurationError("the artifact folder to pull into is empty", remedy="name the folder: coldsnap pull REF DIR")
    published = published or store.resolve_artifact(name)
    dest = Path(dest).absolute()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error("cannot create the folder the artifact is pulled into", exc, dest.parent) from exc
    lock_path = dest.parent / f".{dest.name}.lock"
    with contextlib.ExitStack() as held:
        lock = filelock.FileLock(lock_path)
        try:
            acquire_logged(lock, lock_path, lock_timeout_seconds)
        except filelock.Timeout as exc:
            raise LockTimeoutError(
                f"another pull of this folder held its lock for {lock_timeout_seconds:g} s", file=lock_path
            ) from exc
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            raise FileAccessError(
                f"cannot create the lock file of this pull beside {dest.name} ({name}: {exc.strerror or exc})",
                file=lock_path,
                remedy="pull into a folder this user can create files in (DIR of `coldsnap pull REF DIR`; for"
                " COLDSNAP_ARTIFACT_DIR=REF, COLDSNAP_STATE_ROOT)",
            ) from exc
        held.callback(lock.release)
        with contextlib.suppress(OSError):
            dest.rmdir()  # an empty folder made for the pull is no artifact; anything else stays and is checked
        if dest.exists():
            return _kept(dest, published.sha256)
        for stale in dest.parent.glob(f".{dest.name}.pull-*"):  # what a killed pull left (we hold the lock)
            remove_tree(stale)
        temp = dest.parent / f".{dest.name}.pull-{secrets.token_hex(4)}"
        try:
            pulled = _fetch_all(store, published.sha256, published.size_bytes, temp)
            os.rename(temp, dest)
        except BaseException:
            remove_tree(temp)
            raise
        fsync_dir(dest.parent)
    logger.info("coldsnap: pulled %s (%d files, %d bytes) from %s into %s", name, *pulled, store.name, dest)
    descriptor, _ = read_descriptor_bytes(dest)
    return PulledArtifact(dest, published.sha256, descriptor, *pulled)


_NEVER_REPLACED = "pull into a new folder, or remove this one first (a pull never writes into an existing folder)"


def _kept(dest: Path, artifact_sha256: str) -> PulledArtifact:
    """``dest`` as it is, when it holds the artifact ``artifact_sha256`` intact; else ``ArtifactError`` (another
    artifact, or none) or ``CapsulePinMismatchError`` (a pinned file changed)."""
    if not (dest / DESCRIPTOR_FILENAME).is_file():
        raise ArtifactError(
            "the destination exists and is not an artifact folder (no artifact.json in it)", file=dest, remedy=_NEVER_REPLACED
        )
    descriptor, sha256 = read_descriptor_bytes(dest)
    if sha256 != artifact_sha256:
        raise ArtifactError(
            f"the folder holds another artifact (artifact.json SHA-256 {sha256}, the name designates {artifact_sha256});"
            " it is never replaced",
            file=dest / DESCRIPTOR_FILENAME,
            remedy=_NEVER_REPLACED,
        )
    for path, pin in descriptor.pinned_files():
        try:
            check_pinned_file(dest / path, pin)
        except CapsulePinMismatchError as exc:
            # the class remedy says "pull it again", which would find this same folder and refuse again
            exc.with_remedy(f"remove {dest} and pull again (a pull never replaces the files of an existing folder)")
            raise
    logger.info("coldsnap: %s already holds artifact %s; nothing fetched", dest, artifact_sha256)
    return PulledArtifact(dest, artifact_sha256, descriptor, 0, 0)


def _fetch_all(store: PayloadStore, artifact_sha256: str, size_bytes: int, temp: Path) -> tuple[int, int]:
    """Fetch ``artifact.json`` and every file it pins into the new folder ``temp``, each checked; ``(files, bytes)``."""
    try:
        temp.mkdir(mode=0o755)
    except OSError as exc:
        raise os_error("cannot create the pull's temporary folder", exc, temp) from exc
    _fetch_file(store, temp, ContentRef(DESCRIPTOR_FILENAME, size_bytes, artifact_sha256), artifact_sha256, "the name")
    descriptor, _ = read_descriptor_bytes(temp)
    files, total = 1, size_bytes
    for path, pin in descriptor.pinned_files():
        _fetch_file(store, temp, ContentRef(path, pin.size_bytes, pin.sha256), artifact_sha256, DESCRIPTOR_FILENAME)
        files, total = files + 1, total + pin.size_bytes
    for folder in sorted({p.parent for p in temp.rglob("*") if p.is_file()}, key=lambda p: -len(p.parts)):
        fsync_dir(folder)
    return files, total


def _fetch_file(store: PayloadStore, temp: Path, pin: ContentRef, artifact_sha256: str, pinned_by: str) -> None:
    """Fetch the artifact's file ``pin.name`` into ``temp``, fsynced, and check it against ``pin`` (from ``pinned_by``)."""
    obj = artifact_object(artifact_sha256, pin.name, pin.sha256)
    path = temp / pin.name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        raise os_error("cannot create a pulled file", exc, path) from exc
    try:
        store.fetch(obj, pin.size_bytes, fd, file=path)
        os.fsync(fd)
    finally:
        os.close(fd)
    digest, size = sha256_file(path)
    if (size, digest) != (pin.size_bytes, pin.sha256):
        raise CapsulePinMismatchError(
            f"{pin.name} fetched from {store.name} is {size} bytes with SHA-256 {digest}; {pinned_by} pins"
            f" {pin.size_bytes} bytes with SHA-256 {pin.sha256} (nothing was put in place)",
            file=store.location(obj),
        )
