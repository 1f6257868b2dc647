"""The node-local, content-addressed payload cache.

Layout under a state root (``COLDSNAP_STATE_ROOT``, default ``~/.cache/coldsnap``)::

    model-payloads/sha256/<digest>.pack          the object, mode 0444
    model-payloads/sha256/<digest>.pack.record   its validation record (see coldsnap_core.cache.records), mode 0444
    model-payloads/locks/<digest>.lock           per-digest filelock (duplicate-work prevention only)
    model-payloads/used/<digest>.use             last use (its mtime) and the loads holding the pack (coldsnap_core.cache.pack_use)
    model-payloads/tmp/<label>.<random>.partial  writes in progress (flock-held by their writer); never eligible
    model-payloads/tmp/<...>.partial.d/          a store download in progress (belongs to the .partial beside it)
    model-payloads/quarantine/<digest>.<random>.pack   objects that failed verification

Internal logic worth knowing (``docs/format.md`` §10 and §11):

* **Digests before paths.** Every path is built by :meth:`PayloadCache.object_path` and friends,
  which validate the digest (64 lowercase hex characters) first; ``../x`` never reaches the file
  system. Temporary-file labels are validated the same way.
* **No symbolic links.** The folders below the state root and the object, record and lock paths
  are ``lstat``-ed and refused (:class:`~coldsnap_core.errors.UnsafePathError`) when they are links
  or of the wrong type; files are opened with ``O_NOFOLLOW``. The state root itself may be a link
  (e.g. ``~/.cache/coldsnap -> /nvme/coldsnap``).
* **Commit order** (containerd ``writer.Commit`` plus the folder fsync it lacks): fsync the file,
  check its size, check its SHA-256 (streamed by the writer or computed by the verifier), make it
  read-only, rename it into place (over an existing object, which is never kept on its record's
  word), fsync the folder, write the validation record bound to the renamed inode.
* **Records are best effort.** A record that cannot be written (read-only file system, no space)
  leaves a valid object without a record; the :class:`PayloadCache` object that verified it
  remembers that in memory, so one process hashes it once, and other processes hash it in full.
* **First use with a layout** (a restore): every stored extent and padding byte is checked against the
  manifest on a pool of threads (:func:`~coldsnap_core.format.verify.pack_matches_layout`) and the
  object is admitted for that layout in this process; the whole-file SHA-256 that a record needs runs
  later, on a daemon thread (:meth:`PayloadCache.record_in_background`), and the record is written only
  if it equals the name.
* **Typed failures.** A state root that is a file, link loops, folders where files belong and other
  ``OSError`` s become :class:`~coldsnap_core.errors.ConfigurationError`,
  :class:`~coldsnap_core.errors.UnsafePathError`, :class:`~coldsnap_core.errors.NotRegularFileError`,
  :class:`~coldsnap_core.errors.CacheError` or :class:`~coldsnap_core.errors.FileAccessError`, so a
  loader's ``auto`` mode can fall back.
* **Locks prevent duplicate work only.** One ``filelock`` lock per digest makes same-host writers
  converge on one object; it is re-entrant per thread. A wait longer than a few seconds is logged at
  INFO with the lock and its holder; the wait is bounded by ``COLDSNAP_LOCK_TIMEOUT``. A reader
  (admission, staging) that times out raises :class:`~coldsnap_core.errors.LockTimeoutError`, so a
  hung holder is seen and ``auto`` falls back. A writer that times out proceeds without the lock
  (with a WARNING): correctness never depends on it, because every
  writer uses a process-unique temporary name (huggingface_hub PR #4306), hashes before the rename,
  and the rename is atomic. The tests prove this with ``flock`` patched into a no-op (the Lustre case).
* **Writer liveness.** A writer holds ``flock`` on its own temporary file for its whole life; the
  kernel drops it when the writer dies (``kill -9`` included), which is how :meth:`PayloadCache.gc`
  tells a stale temporary from a live one (plus an age threshold, for file systems whose ``flock``
  is a no-op).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import filelock

from coldsnap_core._io import (
    close_and_remove,
    fsync_dir,
    fsync_fd,
    lstat_or_none,
    open_regular,
    os_errno,
    os_error,
    refuse_symlink,
    sha256_file,
)
from coldsnap_core.cache.garbage import DEFAULT_GC_AGE_SECONDS, GcBuilder, GcReport, sweep_quarantine, sweep_temporaries
from coldsnap_core.cache.locks import acquire_logged, describe_holder, held_locks
from coldsnap_core.cache.partials import TEMP_SUFFIX, create_locked_partial, list_folder, sweep_dead_partials, writer_gone
from coldsnap_core.cache.records import identity, read_trusted_record, record_verified
from coldsnap_core.digests import PAYLOADS_DIRNAME, check_digest
from coldsnap_core.errors import (
    CacheError,
    ConfigurationError,
    IntegrityError,
    InvalidDigestError,
    LockTimeoutError,
    MissingObjectError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    UnsafePathError,
    ValidationRecordError,
    size_mismatch,
)
from coldsnap_core.format.manifest import PackRef
from coldsnap_core.format.pack_layout import PackEntry, PackLayout
from coldsnap_core.format.verify import admission_threads, pack_matches_layout, verify_pack_file
from coldsnap_core.settings import DEFAULT_STATE_ROOT, LOCK_TIMEOUT_ENV, LOCK_TIMEOUT_SECONDS, expand_path

logger = logging.getLogger(__name__)

ADMIT_ATTEMPTS = 3
"""How often admission starts over when the object is replaced while it is being hashed."""
ADMIT_CHUNK_BYTES = 1 << 20
"""Read size of a first-use verification (1 MiB): each chunk is still in the CPU cache when it is
hashed; with the verifier's default 8 MiB double buffer the same pass measured about 10 % slower
(``benchmarks/verify.py``)."""


_LABEL_RE = re.compile(r"[0-9a-z][0-9a-z.-]{0,99}")
_OBJECT_NAME_RE = re.compile(r"([0-9a-f]{64})\.pack")
_RECORD_NAME_RE = re.compile(r"([0-9a-f]{64})\.pack\.record")

_record_threads: list[threading.Thread] = []
"""The threads :meth:`PayloadCache.record_in_background` started that :meth:`PayloadCache.wait_for_records` has
not seen finish."""

ProgressCallback = Callable[[int], object]
"""Called with a number of bytes processed since the previous call."""
ExtentOwner = Callable[[PackEntry], tuple[int | None, int | None]]
"""Maps a stored pack entry to its destination (allocation index, offset in bytes) for messages."""


def _refuse_non_directory(path: Path) -> bool:
    """True if ``path`` is a real folder, False if absent; raises if it is a link or another type."""
    st = lstat_or_none(path)
    if st is None:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError("refusing a symbolic link as a payload cache folder", file=path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError("a payload cache folder path is not a folder", file=path)
    return True


def check_label(label: str) -> str:
    """Temporary-file labels are a digest or a short lowercase word; anything else never reaches a path.

    Raises:
        InvalidDigestError: ``label`` contains anything but ``[0-9a-z.-]`` or starts with ``.``/``-``.
    """
    if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
        raise InvalidDigestError(f"{label!r} is not a valid temporary-file label ([0-9a-z][0-9a-z.-]{{0,99}})")
    return label


QUARANTINED_REMEDY = (
    "stage the pack again from the payload store (coldsnap stage ARTIFACT --repo STORE); the corrupt copy was quarantined"
)
"""The remedy of a cached pack that failed verification (it is moved to ``quarantine/`` and no longer used)."""


class PayloadCache:
    """One state root's ``model-payloads`` cache.

    Args:
        state_root: the state root, made absolute with ``~`` expanded; ``None`` or blank:
            ``~/.cache/coldsnap``. The environment is not read here: an engine plugin passes its resolved
            ``state_root``, the CLI resolves ``--state-root`` / ``COLDSNAP_STATE_ROOT`` when it starts.
        lock_timeout_seconds: how long to wait for a digest's lock, in seconds (the resolved
            ``lock_timeout`` setting; ``None``: :data:`coldsnap_core.settings.LOCK_TIMEOUT_SECONDS`); see
            :meth:`lock`.
    """

    def __init__(self, state_root: str | os.PathLike[str] | None = None, *, lock_timeout_seconds: float | None = None) -> None:
        given = state_root is not None and str(state_root).strip()
        self.state_root = expand_path(state_root if given else DEFAULT_STATE_ROOT, "the state root")  # type: ignore[arg-type]
        self.payloads_dir = self.state_root / PAYLOADS_DIRNAME
        self.objects_dir = self.payloads_dir / "sha256"
        self.locks_dir = self.payloads_dir / "locks"
        self.tmp_dir = self.payloads_dir / "tmp"
        self.quarantine_dir = self.payloads_dir / "quarantine"
        self.used_dir = self.payloads_dir / "used"
        self.lock_timeout_seconds = LOCK_TIMEOUT_SECONDS if lock_timeout_seconds is None else float(lock_timeout_seconds)
        self._verified_here: dict[str, tuple[int, int, int, int, int]] = {}
        self._verified_here_lock = threading.Lock()
        self._admitted: dict[str, tuple[int, int, int, int, int]] = {}
        self._verified_layouts: dict[str, tuple[tuple[int, int, int, int, int], PackLayout]] = {}
        self._pending_records: dict[str, os.stat_result] = {}

    def __repr__(self) -> str:
        return f"PayloadCache({str(self.state_root)!r})"

    # -- folders and paths -------------------------------------------------------------------------

    def _check_state_root(self) -> bool:
        """Whether the state root exists; it may be a symbolic link, but must lead to a folder.

        Raises:
            ConfigurationError: the state root (or a component of it) is a file, or a link loop.
            CacheError: the state root cannot be examined (``EACCES``, ``EIO``, ...).
        """
        try:
            st = os.stat(self.state_root)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise ConfigurationError(
                    f"the state root (COLDSNAP_STATE_ROOT, --state-root) is not a usable folder: {exc.strerror or exc}",
                    file=self.state_root,
                ) from exc
            raise CacheError(f"cannot examine the state root: {exc.strerror or exc}", file=self.state_root) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigurationError(
                f"the state root (COLDSNAP_STATE_ROOT, --state-root) is not a folder ({stat.filemode(st.st_mode)})",
                file=self.state_root,
            )
        return True

    def ensure_dirs(self) -> None:
        """Create the cache folders (mode 0700 where new) and refuse any that is a symbolic link.

        Raises:
            ConfigurationError: the state root is a file (or a component of it is).
            UnsafePathError: ``model-payloads`` or one of its folders is a link or not a folder.
            InsufficientSpaceError / CacheError: a folder could not be created (no space, read-only
                file system, permissions).
        """
        self._check_state_root()
        try:
            self.state_root.mkdir(parents=True, exist_ok=True)
            for folder in self.folders():
                if not _refuse_non_directory(folder):
                    with contextlib.suppress(FileExistsError):
                        folder.mkdir(mode=0o700)
                    _refuse_non_directory(folder)
        except OSError as exc:
            raise _os_error("cannot create the cache folders", exc, self.payloads_dir) from exc

    def check_dirs(self) -> bool:
        """Refuse linked cache folders without creating anything; return whether ``sha256/`` exists.

        Raises:
            ConfigurationError: the state root is a file (or a component of it is).
            UnsafePathError: a cache folder below the state root is a link or not a folder.
        """
        if not self._check_state_root():
            return False
        present = [_refuse_non_directory(folder) for folder in self.folders()]
        return present[0] and present[1]

    def folders(self) -> tuple[Path, ...]:
        """The cache's folders below the state root, ``model-payloads`` first."""
        return (self.payloads_dir, self.objects_dir, self.locks_dir, self.tmp_dir, self.quarantine_dir, self.used_dir)

    def object_path(self, digest: str) -> Path:
        """``<state-root>/model-payloads/sha256/<digest>.pack``; the digest is validated first."""
        return self.objects_dir / f"{check_digest(digest)}.pack"

    def record_path(self, digest: str) -> Path:
        """``<state-root>/model-payloads/sha256/<digest>.pack.record``; the digest is validated first."""
        return self.objects_dir / f"{check_digest(digest)}.pack.record"

    def lock_path(self, digest: str) -> Path:
        """``<state-root>/model-payloads/locks/<digest>.lock``; the digest is validated first."""
        return self.locks_dir / f"{check_digest(digest)}.lock"

    def use_path(self, digest: str) -> Path:
        """``<state-root>/model-payloads/used/<digest>.use``; the digest is validated first."""
        return self.used_dir / f"{check_digest(digest)}.use"

    def open_use_file(self, digest: str) -> int:
        """Open (create, mode 0600) ``used/<digest>.use`` for reading and writing (``O_NOFOLLOW``); the
        caller closes the descriptor.

        Raises:
            UnsafePathError: the use path or a cache folder is a symbolic link.
            CacheError / InsufficientSpaceError: it cannot be created or opened (read-only file system, permissions).
        """
        self.ensure_dirs()
        path = self.use_path(digest)
        refuse_symlink(path)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            raise _os_error("cannot open the pack's use file", exc, path) from exc

    def mark_used(self, digest: str, fd: int | None = None) -> bool:
        """Set the pack's last use to now: the mtime of ``used/<digest>.use`` (``fd``: already open), set with
        ``os.utime`` from ``time.time_ns()``; the object itself is never touched (its record binds its mtime
        and ctime). Best effort: a use file that cannot be written is logged at INFO and ``False`` returned.

        Raises:
            UnsafePathError: the use path or a cache folder is a symbolic link.
        """
        try:
            own = fd is None
            fd = self.open_use_file(digest) if fd is None else fd
            try:
                now = time.time_ns()
                os.utime(fd, ns=(now, now))
            finally:
                if own:
                    os.close(fd)
        except (OSError, CacheError) as exc:
            logger.info("coldsnap: cannot record the last use of %s (%s)", self.use_path(digest), exc)
            return False
        return True

    # -- locking and temporaries -------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, digest: str, *, timeout_seconds: float | None = None, required: bool = False) -> Iterator[bool]:
        """Hold the per-digest lock (``filelock.FileLock``, >= 3.20.3); re-entrant per thread.

        A wait longer than :data:`~coldsnap_core.cache.locks.LOCK_NOTICE_SECONDS` is logged at INFO with the lock's path and its
        holder (pid and host from the kernel's lock table, where this process can see it), and again
        every :data:`~coldsnap_core.cache.locks.LOCK_NOTICE_REPEAT_SECONDS`.

        Yields ``True`` when the lock is held, ``False`` when the wait timed out (writers, ``required``
        false) or the lock file cannot be created, and the caller proceeds without it (safe: only
        duplicate work may follow). That is logged as a WARNING, except on a read-only file system
        (``EROFS``), where no other writer can exist and the cache is only read: INFO.

        Args:
            digest: the pack's SHA-256.
            timeout_seconds: the wait (default: :attr:`lock_timeout_seconds`).
            required: a reader (admission, staging, ``cache verify``) that waits on a live holder:
                a timeout raises instead of proceeding (a hung holder must be seen, not waited out
                by every restore).

        Raises:
            InvalidDigestError: bad digest (before any path is built).
            UnsafePathError: the lock path or a cache folder is a symbolic link.
            LockTimeoutError: ``required`` and the lock was not had within the timeout; the message
                names the lock, its holder and ``COLDSNAP_LOCK_TIMEOUT``.
        """
        path = self.lock_path(digest)
        key = (os.getpid(), str(path))
        held = held_locks()
        if key in held:
            yield True
            return
        timeout = self.lock_timeout_seconds if timeout_seconds is None else timeout_seconds
        lock = filelock.FileLock(path, timeout=timeout, mode=0o600)
        reason = None
        level = logging.WARNING
        try:
            self.ensure_dirs()
            refuse_symlink(path)
            acquire_logged(lock, path, timeout)
        except filelock.Timeout:
            if required:
                raise LockTimeoutError(
                    f"waited {timeout:g} s for the lock (holder: {describe_holder(path)}); a live process holds it"
                    f" and does not finish. Set {LOCK_TIMEOUT_ENV} to wait longer, or stop the holder",
                    file=path,
                ) from None
            reason = f"waited {timeout:.1f} s for it (holder: {describe_holder(path)})"
        except (OSError, CacheError) as exc:
            reason = f"it cannot be created ({exc})"
            if os_errno(exc) == errno.EROFS:
                level = logging.INFO
        if reason is not None:
            logger.log(level, "coldsnap: %s: %s; proceeding without it (the lock only prevents duplicate work)", path, reason)
            yield False
            return
        held.add(key)
        try:
            yield True
        finally:
            held.discard(key)
            lock.release()

    @contextlib.contextmanager
    def temporary(self, label: str) -> Iterator[tuple[int, Path]]:
        """Create ``tmp/<label>.<random>.partial`` (``O_EXCL | O_NOFOLLOW``, mode 0600), flock-held.

        Yields ``(fd, path)``; ``fd`` is open for writing. The file is closed and unlinked on exit
        unless the caller renamed it (see :meth:`commit`); a partial file therefore never survives
        a failure in this process, and one left by a killed process is never eligible (it is not at
        an object path). This writer removes such leftovers at once (:func:`sweep_dead_partials`:
        their ``flock`` is free); :meth:`gc` removes them too.

        Raises:
            InvalidDigestError: ``label`` is not ``[0-9a-z][0-9a-z.-]*``.
            InsufficientSpaceError / CacheError: the file could not be created.
        """
        check_label(label)
        self.ensure_dirs()
        path = self.tmp_dir / f"{label}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
        try:
            fd = create_locked_partial(path)
        except OSError as exc:
            raise _os_error("cannot create a temporary file", exc, path) from exc
        try:
            sweep_dead_partials(self.tmp_dir, path)  # the caller's own flock on path is what the probe needs
            yield fd, path
        finally:
            close_and_remove(fd, path)
            download_dir = path.with_name(path.name + ".d")
            if download_dir.exists():
                shutil.rmtree(download_dir, ignore_errors=True)

    # -- commit ------------------------------------------------------------------------------------

    def commit(self, fd: int, temp_path: Path, *, sha256: str, size_bytes: int, expected_sha256: str | None = None) -> Path:
        """Publish a fully written temporary file (from :meth:`temporary`) as the object for ``sha256``.

        ``sha256`` and ``size_bytes`` are what the writer streamed (or what the verifier just
        confirmed); ``expected_sha256``, when given, is the digest the caller must produce. In
        order: fsync the file; check its size (OCI: size before digest); check the digest; take the
        digest's lock; make the file read-only, rename it into place (over any object already
        there), fsync the folder, and write the validation record bound to the renamed inode. A
        failed record write is logged and leaves a valid object without a record (see
        :func:`coldsnap_core.cache.records.record_verified`).

        An object already at the path is replaced, not kept: this file's SHA-256 was computed from
        the very bytes written and equals the name, while the existing object is at best vouched
        for by a validation record, which cannot see an in-place edit that restores size, mtime and
        ctime (``docs/format.md`` §11). So a re-capture repairs such an object instead of keeping
        it, and no full hash of the existing object is needed. The rename is atomic; a reader
        holding the old file keeps reading it. (Callers that can avoid the write check first:
        materialization and store fetches admit the existing object under the lock before writing.)

        Returns:
            The object path.

        Raises:
            InvalidDigestError: ``sha256`` or ``expected_sha256`` is not a digest.
            PackSizeMismatchError: the file on disk is not ``size_bytes`` long.
            PackDigestMismatchError: ``expected_sha256`` differs from ``sha256``.
            InsufficientSpaceError: fsync reported no space.
            CacheError: the temporary file was removed or replaced while it was written.
            UnsafePathError: the object or record path is a symbolic link.
        """
        check_digest(sha256)
        if expected_sha256 is not None:
            check_digest(expected_sha256)
        fsync_fd(fd, file=temp_path)
        st = os.fstat(fd)
        if st.st_size != size_bytes:
            raise PackSizeMismatchError(f"wrote {size_bytes} bytes but the file holds {st.st_size}", file=temp_path)
        if expected_sha256 is not None and expected_sha256 != sha256:
            raise PackDigestMismatchError(
                f"the written pack has SHA-256 {sha256}, the manifest expects {expected_sha256}; nothing was kept",
                file=temp_path,
            )
        final = self.object_path(sha256)
        with self.lock(sha256):
            refuse_symlink(self.record_path(sha256))
            if refuse_symlink(final) is not None:
                logger.info("coldsnap: replacing %s with the freshly written and verified copy", final)
            current = refuse_symlink(temp_path)
            if current is None or (current.st_dev, current.st_ino) != (st.st_dev, st.st_ino):
                raise CacheError("the temporary file was removed or replaced while it was written", file=temp_path)
            try:
                os.fchmod(fd, 0o444)
                os.rename(temp_path, final)
                fsync_dir(self.objects_dir)
            except OSError as exc:
                raise _os_error("cannot commit the pack", exc, final) from exc
            record_verified(self, sha256, os.fstat(fd))
            self.mark_used(sha256)
        return final

    # -- what the last admission accepted ------------------------------------------------------------

    def _admitted_at(self, digest: str, st: os.stat_result) -> Path:
        """Remember the identity of the object an admission of ``digest`` just accepted; return its path."""
        with self._verified_here_lock:
            self._admitted[digest] = identity(st)
        return self.object_path(digest)

    def verified_against(self, digest: str, st: os.stat_result, layout: PackLayout) -> bool:
        """Whether an admission by this object checked the inode ``st`` of ``digest`` against ``layout``
        (its size, every padding byte and every stored extent: by extents, or in one pass with the digest),
        so that a reader of that inode need not read its padding again. ``False`` for a pack admitted on
        its record.
        """
        with self._verified_here_lock:
            seen = self._verified_layouts.get(digest)
        return seen is not None and seen[0] == identity(st) and seen[1] == layout

    def admitted_identity(self, digest: str) -> tuple[int, int, int, int, int] | None:
        """``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)`` of the object the latest :meth:`admit`
        of ``digest`` by this object accepted, or ``None``: what a reader that opens the path afterwards
        compares its open file with, since another process may rename other bytes onto the path."""
        with self._verified_here_lock:
            return self._admitted.get(digest)

    # -- verified in this process (when no validation record can be written) -----------------------

    def remember_verified(self, digest: str, st: os.stat_result) -> None:
        """Remember, for this :class:`PayloadCache` object only, that the object ``digest`` with the
        identity of ``st`` (device, inode, size, mtime, ctime) was just verified in full.

        Used when the validation record cannot be written (read-only file system, no space): the
        admissions that follow in this process (staging, then hydration) then accept the object on
        the same binding a record would give, instead of hashing it again each time. Nothing is
        written; another process (or another ``PayloadCache``) hashes the object in full.
        """
        with self._verified_here_lock:
            self._verified_here[check_digest(digest)] = identity(st)

    def verified_here(self, digest: str, st: os.stat_result, layout: PackLayout | None = None) -> bool:
        """Whether :meth:`remember_verified` vouches for ``digest`` at exactly the identity of ``st``
        (a fresh ``lstat`` of the object), whose mode is not group- or world-writable; or, given
        ``layout``, whether an admission by this object checked that inode against ``layout``."""
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
        with self._verified_here_lock:
            if self._verified_here.get(digest) == identity(st):
                return True
            return layout is not None and self._verified_layouts.get(digest) == (identity(st), layout)

    # -- the validation record of a pack admitted by its extents ------------------------------------

    def record_in_background(self) -> list[threading.Thread]:
        """Start hashing, each on a daemon thread, the objects this cache admitted by their extents since
        the last call (:meth:`admit_locked` with a layout), and write each one's validation record if its
        SHA-256 equals its name and its inode is unchanged; return the threads started.

        A restore calls this once its bytes are copied, so the hash is not on the load's critical path. A
        thread cut short (the interpreter exits) leaves no record: the next start checks the extents again.
        """
        with self._verified_here_lock:
            pending, self._pending_records = self._pending_records, {}
        threads = [
            threading.Thread(target=self._record_after_hash, args=item, name=f"coldsnap-record-{item[0][:12]}", daemon=True)
            for item in pending.items()
        ]
        for thread in threads:
            thread.start()
        _record_threads.extend(threads)
        return threads

    @staticmethod
    def wait_for_records(timeout_seconds: float | None = None) -> bool:
        """Wait for the threads of :meth:`record_in_background`, of every cache of this process (at most
        ``timeout_seconds`` in all); return whether every one has finished. For tests and benchmarks, and a
        caller that wants the record before it exits."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        for thread in list(_record_threads):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if not thread.is_alive():
                with contextlib.suppress(ValueError):
                    _record_threads.remove(thread)
        return not _record_threads

    def _record_after_hash(self, digest: str, verified: os.stat_result) -> None:
        """Hash the object (admitted by its extents at ``verified``) in full; write its record if the SHA-256 is its
        name, else log an ERROR and quarantine it. Never raises (a daemon thread's body)."""
        path = self.object_path(digest)
        try:
            with open_regular(path, "pack") as (fd, opened):
                if identity(opened) != identity(verified):
                    logger.info("coldsnap: %s changed after its extents were verified; no validation record written", path)
                    return
                actual, _ = sha256_file(f"/proc/self/fd/{fd}")
            with self.lock(digest):
                current = lstat_or_none(path)
                if current is None or identity(current) != identity(verified):
                    logger.info("coldsnap: %s changed while it was hashed; no validation record written", path)
                    return
                if actual == digest:
                    record_verified(self, digest, verified)
                    return
                with self._verified_here_lock:
                    self._verified_layouts.pop(digest, None)
                error = PackDigestMismatchError(
                    f"the pack's SHA-256 is {actual}, its name says {digest}: its stored extents and padding match"
                    " the manifest, whose pack digest does not describe them; no validation record written",
                    file=path,
                )
                logger.error("coldsnap: %s", error)
                self.quarantine(digest)
        except Exception as exc:  # a daemon thread: no record, and say why
            logger.warning("coldsnap: no validation record written for %s (%s)", path, exc)

    # -- admission: the one door (first-use verification, validation records, quarantine) ----------

    def admit(
        self,
        digest: str,
        size_bytes: int | None = None,
        *,
        progress: ProgressCallback | None = None,
        layout: PackLayout | None = None,
        extent_owner: ExtentOwner | None = None,
        manifest_file: str | None = None,
        log_quarantine: bool = True,
    ) -> Path:
        """Return the object path of ``digest`` once it is verified for use.

        Accepts the object on a trusted validation record (no lock, a few ``stat`` calls: the record
        is read once); otherwise takes the digest's lock (so same-host callers hash it once), hashes
        it in full with :func:`coldsnap_core.format.verify.verify_pack_file`, rewrites the record on success
        and quarantines the object on failure. With ``layout`` the object is instead admitted once every
        stored extent and padding byte matches the layout (:meth:`admit_locked`), and its record waits
        for :meth:`record_in_background`. Every consumer of a cached pack (restore, staging,
        materialization, ``coldsnap cache verify``) comes through here or :meth:`admit_locked`.

        Args:
            digest: the pack's SHA-256.
            size_bytes: the size the pack must have (``None``: whatever size it has).
            progress: called with bytes hashed, during a full verification.
            layout: the manifest's canonical layout (:func:`coldsnap_core.format.verify.check_manifest`):
                the object is checked extent by extent on a pool of threads; a failure is judged by a
                full verification that names the extent of a corrupt byte.
            extent_owner: with ``layout``, maps a stored entry to a destination for error messages
                (:func:`coldsnap_core.format.verify.extent_owner_map`).
            manifest_file: the manifest that gave ``layout``, named by a
                :class:`~coldsnap_core.errors.ManifestPaddingError` or
                :class:`~coldsnap_core.errors.ManifestExtentDigestError` (the object is intact and
                the manifest is wrong about it; the object stays).
            log_quarantine: log a quarantine as a WARNING (``False``: at INFO, for a caller that
                reports it in its own message; a quarantine that fails is a WARNING either way).

        Raises:
            InvalidDigestError: bad digest (no file touched).
            MissingObjectError: no object.
            PackSizeMismatchError / PackDigestMismatchError / NonZeroPaddingError /
                ExtentDigestMismatchError: the object is corrupt; it is quarantined and the error's
                ``quarantined_to`` says where it went (``None``: it could not be moved).
            ManifestPaddingError / ManifestExtentDigestError: as ``manifest_file``.
            UnsafePathError: the object, record or lock path, or a cache folder, is a symbolic link.
            CacheError: the object changed while it was being verified (not admitted).
        """
        check_digest(digest)
        path = self.object_path(digest)
        if not self.check_dirs():
            raise MissingObjectError("pack is not in the node-local cache (the cache is empty)", file=path)
        st = refuse_symlink(path)
        refuse_symlink(self.record_path(digest))
        if st is None:
            raise MissingObjectError("pack is not in the node-local cache", file=path)
        try:
            read_trusted_record(self, digest, st)
        except ValidationRecordError as exc:
            if self.verified_here(digest, st, layout):
                _require_caller_size(path, st.st_size, size_bytes)
                return self._admitted_at(digest, st)
            logger.info("coldsnap: verifying %s (%s)", path, exc.detail)
        else:
            _require_caller_size(path, st.st_size, size_bytes)
            return self._admitted_at(digest, st)
        with self.lock(digest, required=True):
            return self.admit_locked(
                digest,
                size_bytes,
                progress=progress,
                layout=layout,
                extent_owner=extent_owner,
                manifest_file=manifest_file,
                log_quarantine=log_quarantine,
            )

    def admit_locked(
        self,
        digest: str,
        size_bytes: int | None = None,
        *,
        progress: ProgressCallback | None = None,
        trust_record: bool = True,
        layout: PackLayout | None = None,
        extent_owner: ExtentOwner | None = None,
        manifest_file: str | None = None,
        log_quarantine: bool = True,
    ) -> Path:
        """Admission with the digest's lock held (or given up on): re-check the record, else check the bytes.

        An object whose size differs from ``size_bytes`` is quarantined unless a trusted record
        vouches for it at its current size (then only the caller's expectation is wrong). With ``layout``
        (and ``trust_record``) the object may be admitted by its extents (:meth:`_admit_by_extents`); else,
        or when they disagree, the one verifier (:func:`coldsnap_core.format.verify.verify_pack_file`) judges
        the bytes; on an :class:`~coldsnap_core.errors.IntegrityError` the object is quarantined and the error
        re-raised with ``quarantined_to``. The check starts over when the object changes while it is hashed.

        Args:
            trust_record: ``False`` hashes in full whatever the record says (``cache verify --full``).
            others: as :meth:`admit`.

        Raises:
            as :meth:`admit`; CacheError also when the object changed while it was being hashed,
            :data:`ADMIT_ATTEMPTS` times in a row (each change starts the check over).
        """
        path = self.object_path(digest)
        if size_bytes is None and layout is not None:
            size_bytes = layout.size_bytes
        for attempt in range(1, ADMIT_ATTEMPTS + 1):
            st = refuse_symlink(path)
            refuse_symlink(self.record_path(digest))
            if st is None:
                raise MissingObjectError("pack is not in the node-local cache", file=path)
            # the record again under the lock: another same-host caller may have verified it meanwhile
            if trust_record and self._trusted(digest, st, layout):
                _require_caller_size(path, st.st_size, size_bytes)
                return self._admitted_at(digest, st)
            if size_bytes is not None and (
                error := size_mismatch(
                    PackSizeMismatchError, "cached pack", st.st_size, size_bytes, file=path, suffix="; quarantined"
                )
            ):
                error.quarantined_to = self.quarantine(digest, log=log_quarantine)  # type: ignore[attr-defined]
                raise error
            st = _make_read_only(path, st)
            if trust_record and layout is not None and (admitted := self._admit_by_extents(digest, st, layout, progress)):
                return admitted
            try:
                verify_pack_file(
                    path,
                    PackRef.for_digest(digest, st.st_size),
                    layout,
                    progress=progress,
                    extent_owner=extent_owner,
                    chunk_bytes=ADMIT_CHUNK_BYTES,
                    manifest_file=manifest_file,
                )
            except IntegrityError as exc:
                exc.quarantined_to = self.quarantine(digest, log=log_quarantine)  # type: ignore[attr-defined]
                if exc.remedy is None:
                    exc.remedy = QUARANTINED_REMEDY
                    exc.args = (exc._compose(),)
                raise
            after = refuse_symlink(path)
            if after is not None and identity(after) == identity(st):
                if layout is not None:
                    with self._verified_here_lock:
                        self._verified_layouts[digest] = (identity(after), layout)
                record_verified(self, digest, after)
                return self._admitted_at(digest, after)
            # Replaced or touched while being hashed: another writer that did not (or could not) take
            # the lock. What was hashed may not be what is there now, so start over.
            logger.info("coldsnap: %s changed while it was being verified (attempt %d)", path, attempt)
        raise CacheError(
            f"the pack changed while it was being verified, {ADMIT_ATTEMPTS} times in a row; not admitted", file=path
        )

    def _trusted(self, digest: str, st: os.stat_result, layout: PackLayout | None = None) -> bool:
        """Whether a trusted validation record, or this object's verification by this process (against ``layout``),
        vouches for the object at ``st``."""
        try:
            read_trusted_record(self, digest, st)
        except ValidationRecordError:
            return self.verified_here(digest, st, layout)
        return True

    def _admit_by_extents(
        self, digest: str, st: os.stat_result, layout: PackLayout, progress: ProgressCallback | None
    ) -> Path | None:
        """Admit the object (of the identity ``st``) if it is exactly the canonical pack of ``layout``: every stored
        extent's SHA-256 and every padding byte, on :func:`~coldsnap_core.format.verify.admission_threads` threads
        (:func:`~coldsnap_core.format.verify.pack_matches_layout`), and its size. Those bytes are then the pack of the
        manifest, so the object is admitted for ``layout`` in this :class:`PayloadCache` (a later admission with an
        equal layout accepts the same inode without reading it) and queued for :meth:`record_in_background`: no
        record is written until the whole-file SHA-256 equals the name. ``None`` when anything disagrees or the
        object changed meanwhile: the full verification then judges it."""
        path = self.object_path(digest)
        if not stat.S_ISREG(st.st_mode) or st.st_size != layout.size_bytes:
            return None
        with open_regular(path, "pack") as (fd, opened):
            if identity(opened) != identity(st) or not pack_matches_layout(
                fd, layout, file=path, threads=admission_threads(), chunk_bytes=ADMIT_CHUNK_BYTES, progress=progress
            ):
                return None
        after = refuse_symlink(path)
        if after is None or identity(after) != identity(st):
            return None
        with self._verified_here_lock:
            self._verified_layouts[digest] = (identity(after), layout)
            self._pending_records[digest] = after
        return self._admitted_at(digest, after)

    def reverify(self, digest: str, size_bytes: int | None = None, *, progress: ProgressCallback | None = None) -> Path:
        """Like :meth:`admit`, but always hash in full (ignoring any record); used by ``coldsnap cache verify --full``."""
        check_digest(digest)
        with self.lock(digest, required=True):
            return self.admit_locked(digest, size_bytes, progress=progress, trust_record=False)

    def quarantine(self, digest: str, *, log: bool = True) -> Path | None:
        """Move ``<digest>.pack`` into ``quarantine/`` (unique name) and delete its record first.

        Returns where the object went, or ``None`` when there was nothing to move or it cannot be
        moved (e.g. a read-only file system: then it stays at its path, always logged as a WARNING
        naming the path, and every later admission verifies it again and fails again; nothing
        serves it).

        Args:
            log: log a quarantine as a WARNING (``False``: at INFO, for a caller that reports it in
                its own message). A quarantine that fails is a WARNING either way.
        """
        check_digest(digest)
        source = self.object_path(digest)
        try:
            self.ensure_dirs()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.record_path(digest))
            target = self.quarantine_dir / f"{digest}.{secrets.token_hex(8)}.pack"
            try:
                os.rename(source, target)
            except FileNotFoundError:
                return None
            fsync_dir(self.objects_dir)
        except (OSError, CacheError) as exc:
            logger.warning("coldsnap: %s failed verification but cannot be quarantined (%s); it stays in place", source, exc)
            return None
        logger.log(logging.WARNING if log else logging.INFO, "coldsnap: quarantined %s as %s", source, target)
        return target

    # -- listing and garbage collection ------------------------------------------------------------

    def digests(self) -> list[str]:
        """Digests of every ``<digest>.pack`` name in ``sha256/`` (sorted; links included, to be refused on use)."""
        if not self.check_dirs():
            return []
        return sorted(m.group(1) for name in os.listdir(self.objects_dir) if (m := _OBJECT_NAME_RE.fullmatch(name)))

    def foreign_names(self) -> list[str]:
        """Names in ``sha256/`` that are neither objects nor records (never used, never removed)."""
        if not self.check_dirs():
            return []
        return sorted(
            name
            for name in os.listdir(self.objects_dir)
            if not _OBJECT_NAME_RE.fullmatch(name) and not _RECORD_NAME_RE.fullmatch(name)
        )

    def temporaries(self) -> list[Path]:
        """Every entry of ``tmp/`` (writes in progress or left by dead writers)."""
        self.check_dirs()
        return list_folder(self.tmp_dir)

    def abandoned_temporaries(self) -> list[Path]:
        """The ``tmp/*.partial`` files whose writer is gone (their ``flock`` is free): debris that the
        next writer (where ``flock`` works) or :meth:`gc` removes."""
        return [
            p for p in self.temporaries() if p.name.endswith(TEMP_SUFFIX) and stat.S_ISREG(p.lstat().st_mode) and writer_gone(p)
        ]

    def quarantined(self) -> list[Path]:
        """Every entry of ``quarantine/``."""
        self.check_dirs()
        return list_folder(self.quarantine_dir)

    def gc(self, *, older_than_seconds: float = DEFAULT_GC_AGE_SECONDS, dry_run: bool = False) -> GcReport:
        """Remove what no reader can use: stale temporaries, quarantined objects, orphan records.

        * a ``tmp/*.partial`` file is removed when it is older than ``older_than_seconds`` (by
          mtime) **and** its writer is gone (its ``flock`` can be taken); a ``*.partial.d``
          download folder goes with its ``*.partial`` file, or alone once it is old;
        * ``quarantine/*`` entries older than ``older_than_seconds`` (by ctime, i.e. quarantine time);
        * ``sha256/<digest>.pack.record`` whose ``<digest>.pack`` is absent (checked under the lock).

        Objects and lock files are never removed: unlinking a lock file that another process is
        about to lock would let two holders in.

        Raises:
            UnsafePathError: a cache folder is a symbolic link.
        """
        report = GcBuilder()
        if not self.check_dirs():
            return report.freeze()
        now = time.time()
        sweep_temporaries(self.tmp_dir, report, now=now, older_than_seconds=older_than_seconds, dry_run=dry_run)
        sweep_quarantine(self.quarantine_dir, report, now=now, older_than_seconds=older_than_seconds, dry_run=dry_run)
        self._sweep_orphan_records(report, dry_run=dry_run)
        if not dry_run and (report.orphan_records or report.temporaries):
            fsync_dir(self.objects_dir)
        return report.freeze()

    def _sweep_orphan_records(self, report: GcBuilder, *, dry_run: bool) -> None:
        """Remove (or, with ``dry_run``, list) every ``<digest>.pack.record`` whose object is absent,
        checked again under the digest's lock (an admission may be writing both)."""
        for name in sorted(os.listdir(self.objects_dir)):
            match = _RECORD_NAME_RE.fullmatch(name)
            if match is None:
                continue
            digest = match.group(1)
            if os.path.lexists(self.object_path(digest)):
                continue
            with self.lock(digest, timeout_seconds=5.0):
                if os.path.lexists(self.object_path(digest)):
                    continue
                record = self.record_path(digest)
                report.orphan_records.append(record)
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(record)


def _os_error(what: str, exc: OSError, path: Path) -> CacheError:
    """:func:`coldsnap_core._io.os_error` (the one ``OSError`` table) for the cache's own folders and
    files: space errors (``EFBIG`` included) are :class:`~coldsnap_core.errors.InsufficientSpaceError`,
    anything else a :class:`~coldsnap_core.errors.CacheError`."""
    return os_error(what, exc, path, missing=CacheError, other=CacheError)  # type: ignore[return-value]


def _require_caller_size(path: Path, actual: int, expected: int | None) -> None:
    if expected is not None and actual != expected:
        raise PackSizeMismatchError(
            f"cached pack is {actual} bytes and verified against its digest, but {expected} bytes were expected", file=path
        )


def _make_read_only(path: Path, st: os.stat_result) -> os.stat_result:
    """Make this process's own writable object read-only before it is verified; return its ``stat`` after."""
    if st.st_mode & 0o222 and st.st_uid == os.geteuid():
        try:
            os.chmod(path, 0o444)
        except OSError as exc:  # e.g. a read-only file system: the object is still verified after
            logger.info("coldsnap: cannot make %s read-only (%s)", path, exc.strerror or exc)
        st = refuse_symlink(path) or st
    return st
