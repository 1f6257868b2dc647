"""The node-local, content-addressed payload cache.

Layout under a state root (``COLDSNAP_STATE_ROOT``, default ``~/.cache/coldsnap``)::

    model-payloads/sha256/<digest>.pack          the object, mode 0444
    model-payloads/sha256/<digest>.pack.record   its validation record (see coldsnap_core.records)
    model-payloads/locks/<digest>.lock           per-digest filelock (duplicate-work prevention only)
    model-payloads/tmp/<name>.<random>.partial   writes in progress; never eligible
    model-payloads/quarantine/                   objects that failed verification

Safety comes from unique temporary names, fsync, size-then-SHA-256 checks before the rename, the
folder fsync after it, and the validation record; the lock only makes same-host writers converge on
one object (``DESIGN.md``, "The node-local cache and the verifier"; ``reference/anchors.md`` B4, B10).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import filelock

from coldsnap_core._io import fsync_dir, fsync_fd
from coldsnap_core.digests import PAYLOADS_DIRNAME, check_digest
from coldsnap_core.errors import (
    CacheError,
    ColdsnapError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    UnsafePathError,
)

STATE_ROOT_ENV = "COLDSNAP_STATE_ROOT"
DEFAULT_STATE_ROOT = Path("~/.cache/coldsnap")
LOCK_TIMEOUT_SECONDS = 600.0


def resolve_state_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The state root: ``explicit``, else ``$COLDSNAP_STATE_ROOT``, else ``~/.cache/coldsnap``."""
    chosen = explicit if explicit is not None else os.environ.get(STATE_ROOT_ENV) or DEFAULT_STATE_ROOT
    return Path(chosen).expanduser().absolute()


def refuse_symlink(path: Path) -> None:
    """Raise :class:`UnsafePathError` if ``path`` exists as a symbolic link or a non-regular file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError("refusing a symbolic link in the payload cache", file=path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError("refusing a non-regular file in the payload cache", file=path)


class PayloadCache:
    """One state root's ``model-payloads`` cache.

    Args:
        state_root: the state root; see :func:`resolve_state_root`.
    """

    def __init__(self, state_root: str | os.PathLike[str] | None = None) -> None:
        self.state_root = resolve_state_root(state_root)
        self.payloads_dir = self.state_root / PAYLOADS_DIRNAME
        self.objects_dir = self.payloads_dir / "sha256"
        self.locks_dir = self.payloads_dir / "locks"
        self.tmp_dir = self.payloads_dir / "tmp"
        self.quarantine_dir = self.payloads_dir / "quarantine"

    # -- paths -------------------------------------------------------------------------------------

    def _ensure_dirs(self) -> None:
        for folder in (self.objects_dir, self.locks_dir, self.tmp_dir):
            folder.mkdir(parents=True, exist_ok=True)
            for part in (self.payloads_dir, folder):
                if part.is_symlink():
                    raise UnsafePathError("refusing a symbolic link in the payload cache", file=part)

    def object_path(self, digest: str) -> Path:
        """``<state-root>/model-payloads/sha256/<digest>.pack``; the digest is validated first."""
        return self.objects_dir / f"{check_digest(digest)}.pack"

    def record_path(self, digest: str) -> Path:
        return self.objects_dir / f"{check_digest(digest)}.pack.record"

    def lock_path(self, digest: str) -> Path:
        return self.locks_dir / f"{check_digest(digest)}.lock"

    # -- locking and temporaries -------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, digest: str, *, timeout_seconds: float = LOCK_TIMEOUT_SECONDS) -> Iterator[None]:
        """Hold the per-digest lock (``filelock.FileLock``, >= 3.20.3; refuses a symlinked lock file)."""
        self._ensure_dirs()
        path = self.lock_path(digest)
        refuse_symlink(path)
        try:
            with filelock.FileLock(path, timeout=timeout_seconds):
                yield
        except filelock.Timeout as exc:
            raise CacheError(f"timed out after {timeout_seconds} s waiting for the lock", file=path) from exc

    @contextlib.contextmanager
    def temporary(self, label: str) -> Iterator[tuple[int, Path]]:
        """Create a uniquely named temporary file (``O_EXCL | O_NOFOLLOW``, mode 0600).

        Yields ``(fd, path)``. The file is closed and unlinked on exit unless the caller renamed it
        (see :meth:`commit`); a partial file therefore never survives a failure in this process, and
        one left by a killed process is never eligible (it is not at an object path).
        """
        self._ensure_dirs()
        path = self.tmp_dir / f"{label}.{secrets.token_hex(8)}.partial"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            yield fd, path
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # -- commit ------------------------------------------------------------------------------------

    def commit(self, fd: int, temp_path: Path, *, sha256: str, size_bytes: int, expected_sha256: str | None = None) -> Path:
        """Publish a fully written temporary file as the object for ``sha256``.

        ``sha256`` and ``size_bytes`` are what the writer streamed; ``expected_sha256``, when given,
        is the digest the caller must produce (materialization). In order: fsync the file; check
        its size (OCI: size before digest); check the digest; take the digest's lock; if a valid
        object is already there, keep it and drop the temporary; otherwise make the file read-only,
        rename it into place, fsync the folder, and write the validation record.

        Returns:
            The object path.

        Raises:
            PackSizeMismatchError: the file on disk is not ``size_bytes`` long.
            PackDigestMismatchError: ``expected_sha256`` differs from the streamed digest.
            InsufficientSpaceError: fsync reported no space.
        """
        check_digest(sha256)
        fsync_fd(fd, file=temp_path)
        actual_size = os.fstat(fd).st_size
        if actual_size != size_bytes:
            raise PackSizeMismatchError(f"wrote {size_bytes} bytes but the file holds {actual_size}", file=temp_path)
        if expected_sha256 is not None and expected_sha256 != sha256:
            raise PackDigestMismatchError(
                f"materialized pack has SHA-256 {sha256}, the manifest expects {expected_sha256}", file=temp_path
            )
        final = self.object_path(sha256)
        with self.lock(sha256):
            refuse_symlink(final)
            refuse_symlink(self.record_path(sha256))
            if final.exists():
                try:
                    self.admit(sha256, size_bytes)
                except ColdsnapError:
                    self.quarantine(sha256)
                else:
                    return final
            os.fchmod(fd, 0o444)
            os.rename(temp_path, final)
            fsync_dir(self.objects_dir)
            self.write_record(sha256)
        return final

    # -- admission (first-use verification and validation records) ---------------------------------

    def admit(self, digest: str, size_bytes: int | None = None) -> Path:
        """Return the object path of ``digest`` once it is verified for use.

        Accepts the object on a trusted validation record; otherwise hashes it in full, rewrites the
        record on success, and quarantines the object on failure.

        Raises:
            MissingObjectError: no object.
            PackSizeMismatchError / PackDigestMismatchError: the object is corrupt (now quarantined).
            UnsafePathError: the object or record path is a symbolic link.
        """
        from coldsnap_core.records import admit_object

        return admit_object(self, digest, size_bytes)

    def write_record(self, digest: str) -> None:
        from coldsnap_core.records import write_record

        write_record(self, digest)

    def quarantine(self, digest: str) -> Path | None:
        """Move a bad object (and drop its record) out of the eligible path; return where it went."""
        from coldsnap_core.records import quarantine_object

        return quarantine_object(self, digest)
