"""The payload cache under ``<state-root>/model-payloads/`` (``docs/format.md`` §10 and §11); ``OSError`` s become
typed errors, so a loader's ``auto`` mode can fall back."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
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
    remove_tree,
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
"""Read size of a first-use verification (1 MiB: each chunk is still in the CPU cache when it is hashed)."""


_LABEL_RE = re.compile(r"[0-9a-z][0-9a-z.-]{0,99}")
_OBJECT_NAME_RE = re.compile(r"([0-9a-f]{64})\.pack")
_RECORD_NAME_RE = re.compile(r"([0-9a-f]{64})\.pack\.record")
_OBJECT_OR_RECORD_RE = re.compile(r"[0-9a-f]{64}\.pack(?:\.record)?")

_record_threads: list[threading.Thread] = []
"""The threads of :meth:`PayloadCache.record_in_background` not yet seen finished."""

ProgressCallback = Callable[[int], object]
"""Called with a number of bytes processed since the previous call."""
ExtentOwner = Callable[[PackEntry], tuple[int | None, int | None]]
"""Maps a stored pack entry to its destination (allocation index, offset in bytes) for messages."""


QUARANTINED_REMEDY = (
    "stage the pack again from the payload store (coldsnap stage ARTIFACT --repo STORE); the corrupt copy was quarantined"
)
"""The remedy of a cached pack that failed verification."""


class PayloadCache:
    """One state root's ``model-payloads`` cache (``state_root``: ``~`` expanded, made absolute; ``None`` or blank:
    ``~/.cache/coldsnap``, never the environment; ``lock_timeout_seconds``: ``None`` is the settings' default)."""

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

    def _check_state_root(self) -> bool:
        """Whether the state root exists (it may be a link to a folder); ConfigurationError when it or a component of it
        is a file, or a link loop; CacheError when it cannot be examined (``EACCES``, ``EIO``, ...)."""
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
        """Create the cache folders (mode 0700 where new): ConfigurationError as :meth:`_check_state_root`,
        UnsafePathError when one is a link or not a folder, InsufficientSpaceError / CacheError when one cannot be made."""
        self._check_state_root()
        try:
            self.state_root.mkdir(parents=True, exist_ok=True)
            for folder in self.folders():
                if refuse_symlink(folder, folder=True) is None:
                    with contextlib.suppress(FileExistsError):
                        folder.mkdir(mode=0o700)
                    refuse_symlink(folder, folder=True)
        except OSError as exc:
            raise _os_error("cannot create the cache folders", exc, self.payloads_dir) from exc

    def check_dirs(self) -> bool:
        """Refuse linked cache folders as :meth:`ensure_dirs` does, creating nothing; return whether ``sha256/`` exists."""
        if not self._check_state_root():
            return False
        present = [refuse_symlink(folder, folder=True) is not None for folder in self.folders()]
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
        """Open (create, mode 0600, ``O_NOFOLLOW``) ``used/<digest>.use``; the caller closes the descriptor.
        UnsafePathError when it or a cache folder is a link; CacheError / InsufficientSpaceError when it cannot be opened."""
        self.ensure_dirs()
        path = self.use_path(digest)
        refuse_symlink(path)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            raise _os_error("cannot open the pack's use file", exc, path) from exc

    def mark_used(self, digest: str, fd: int | None = None) -> bool:
        """Set the pack's last use (the mtime of ``used/<digest>.use``; ``fd``: already open) to now. Best effort: a
        use file that cannot be written is logged at INFO, ``False``; a symbolic link is an UnsafePathError."""
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

    @contextlib.contextmanager
    def lock(self, digest: str, *, timeout_seconds: float | None = None, required: bool = False) -> Iterator[bool]:
        """Hold the per-digest lock, re-entrant per thread, waiting at most ``timeout_seconds`` (default
        :attr:`lock_timeout_seconds`); yield whether it is held (if not, the caller proceeds: ``docs/format.md`` §10,
        "Lock waits"). InvalidDigestError, UnsafePathError (a link), LockTimeoutError when ``required`` and not had in time."""
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
        """Create ``tmp/<label>.<random>.partial`` (``O_EXCL | O_NOFOLLOW``, mode 0600), flock-held, and yield
        ``(fd, path)``, removed on exit (with its ``.partial.d``) unless :meth:`commit` renamed it. InvalidDigestError
        when ``label`` is not ``[0-9a-z][0-9a-z.-]*``; InsufficientSpaceError / CacheError when it cannot be created."""
        if not isinstance(label, str) or not _LABEL_RE.fullmatch(label):
            raise InvalidDigestError(f"{label!r} is not a valid temporary-file label ([0-9a-z][0-9a-z.-]{{0,99}})")
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
            remove_tree(path.with_name(path.name + ".d"))

    def commit(self, fd: int, temp_path: Path, *, sha256: str, size_bytes: int, expected_sha256: str | None = None) -> Path:
        """Publish a fully written temporary file (from :meth:`temporary`) as the object for ``sha256`` (what the
        writer streamed), in the commit order of ``docs/format.md`` §10; return the object path. InvalidDigestError,
        PackSizeMismatchError (not ``size_bytes`` long), PackDigestMismatchError (not ``expected_sha256``),
        InsufficientSpaceError, CacheError (the temporary was replaced meanwhile), UnsafePathError."""
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

    def _admitted_at(self, digest: str, st: os.stat_result) -> Path:
        """Remember the identity of the object an admission of ``digest`` just accepted; return its path."""
        with self._verified_here_lock:
            self._admitted[digest] = identity(st)
        return self.object_path(digest)

    def verified_against(self, digest: str, st: os.stat_result, layout: PackLayout) -> bool:
        """Whether an admission by this object checked the inode ``st`` of ``digest`` against ``layout`` (not on its record)."""
        with self._verified_here_lock:
            return self._verified_layouts.get(digest) == (identity(st), layout)

    def admitted_identity(self, digest: str) -> tuple[int, int, int, int, int] | None:
        """:func:`~coldsnap_core.cache.records.identity` of the object the latest :meth:`admit` of ``digest`` accepted."""
        with self._verified_here_lock:
            return self._admitted.get(digest)

    def remember_verified(self, digest: str, st: os.stat_result) -> None:
        """Trust, in this object only, ``digest`` at the identity of ``st`` (its record could not be written, §10)."""
        with self._verified_here_lock:
            self._verified_here[check_digest(digest)] = identity(st)

    def verified_here(self, digest: str, st: os.stat_result, layout: PackLayout | None = None) -> bool:
        """Whether :meth:`remember_verified` (or, given ``layout``, :meth:`verified_against`) vouches for
        ``digest`` at the identity of ``st``, whose mode is not group- or world-writable."""
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
        with self._verified_here_lock:
            if self._verified_here.get(digest) == identity(st):
                return True
        return layout is not None and self.verified_against(digest, st, layout)

    def record_in_background(self) -> list[threading.Thread]:
        """Hash, each on a daemon thread, the objects admitted by their extents since the last call, and write
        each one's record if its SHA-256 is its name (``docs/format.md`` §10, first use); return the threads."""
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
        """Wait at most ``timeout_seconds`` in all for this process's :meth:`record_in_background` threads; whether all ended."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        for thread in list(_record_threads):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if not thread.is_alive():
                with contextlib.suppress(ValueError):
                    _record_threads.remove(thread)
        return not _record_threads

    def _record_after_hash(self, digest: str, verified: os.stat_result) -> None:
        """Hash the object; write its record if the SHA-256 is its name, else log an ERROR and quarantine it. Never raises."""
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
        """Return the object path of ``digest`` once it is verified for use (``docs/format.md`` §10, admission): on a
        trusted record without the lock, else under it. ``size_bytes``: the size the pack must have; ``progress``: gets
        bytes hashed; ``layout``: the manifest's canonical layout, checked extent by extent first; ``manifest_file``:
        the manifest that gave it, named by a ManifestPaddingError / ManifestExtentDigestError (the object stays).
        IntegrityError: the object is corrupt (size, digest, padding, extent) and quarantined (``quarantined_to``: where;
        ``None``: it could not be moved). Also InvalidDigestError (no file touched), MissingObjectError, UnsafePathError
        (a link), CacheError (the object changed while it was being verified)."""
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
            if not self.verified_here(digest, st, layout):
                logger.info("coldsnap: verifying %s (%s)", path, exc.detail)
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
        _require_caller_size(path, st.st_size, size_bytes)
        return self._admitted_at(digest, st)

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
        """:meth:`admit` with the lock held (or given up on); ``trust_record=False`` hashes in full (``cache verify --full``)."""
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
            # replaced or touched while being hashed (a writer without the lock): start over
            logger.info("coldsnap: %s changed while it was being verified (attempt %d)", path, attempt)
        raise CacheError(
            f"the pack changed while it was being verified, {ADMIT_ATTEMPTS} times in a row; not admitted", file=path
        )

    def _trusted(self, digest: str, st: os.stat_result, layout: PackLayout | None = None) -> bool:
        """Whether a trusted record, or this object's own verification (:meth:`verified_here`), vouches for ``st``."""
        try:
            read_trusted_record(self, digest, st)
        except ValidationRecordError:
            return self.verified_here(digest, st, layout)
        return True

    def _admit_by_extents(
        self, digest: str, st: os.stat_result, layout: PackLayout, progress: ProgressCallback | None
    ) -> Path | None:
        """Admit the object at ``st`` if it is exactly the canonical pack of ``layout`` (``docs/format.md`` §10, first
        use) and queue its record; ``None`` when anything disagrees or it changed meanwhile."""
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
        """Move ``<digest>.pack`` into ``quarantine/`` (its record deleted first) and return where, or ``None`` (nothing
        to move, or it stays, with a WARNING); the quarantine is logged as a WARNING (``log=False``: INFO)."""
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

    def digests(self) -> list[str]:
        """Digests of every ``<digest>.pack`` name in ``sha256/`` (sorted; links included, to be refused on use)."""
        if not self.check_dirs():
            return []
        return sorted(m.group(1) for name in os.listdir(self.objects_dir) if (m := _OBJECT_NAME_RE.fullmatch(name)))

    def foreign_names(self) -> list[str]:
        """Names in ``sha256/`` that are neither objects nor records (never used, never removed)."""
        if not self.check_dirs():
            return []
        return sorted(name for name in os.listdir(self.objects_dir) if not _OBJECT_OR_RECORD_RE.fullmatch(name))

    def temporaries(self) -> list[Path]:
        """Every entry of ``tmp/`` (writes in progress or left by dead writers)."""
        self.check_dirs()
        return list_folder(self.tmp_dir)

    def abandoned_temporaries(self) -> list[Path]:
        """The ``tmp/*.partial`` files whose writer is gone (their ``flock`` is free)."""
        return [
            p for p in self.temporaries() if p.name.endswith(TEMP_SUFFIX) and stat.S_ISREG(p.lstat().st_mode) and writer_gone(p)
        ]

    def quarantined(self) -> list[Path]:
        """Every entry of ``quarantine/``."""
        self.check_dirs()
        return list_folder(self.quarantine_dir)

    def gc(self, *, older_than_seconds: float = DEFAULT_GC_AGE_SECONDS, dry_run: bool = False) -> GcReport:
        """Remove stale temporaries, quarantined objects, orphan records (``docs/format.md`` §10, gc); links: UnsafePathError."""
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
        """Remove (or list) every record whose object is absent, checked again under the digest's lock."""
        for name in sorted(os.listdir(self.objects_dir)):
            match = _RECORD_NAME_RE.fullmatch(name)
            if match is None or os.path.lexists(self.object_path(match.group(1))):
                continue
            digest = match.group(1)
            with self.lock(digest, timeout_seconds=5.0):
                if os.path.lexists(self.object_path(digest)):
                    continue
                record = self.record_path(digest)
                report.orphan_records.append(record)
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(record)


def _os_error(what: str, exc: OSError, path: Path) -> CacheError:
    """:func:`coldsnap_core._io.os_error` for the cache's own files: a space error, else a CacheError."""
    return os_error(what, exc, path, missing=CacheError, other=CacheError)  # type: ignore[return-value]


def _require_caller_size(path: Path, actual: int, expected: int | None) -> None:
    if expected is not None and actual != expected:
        raise PackSizeMismatchError(
            f"cached pack is {actual} bytes and verified against its digest, but {expected} bytes were expected", file=path
        )


def _make_read_only(path: Path, st: os.stat_result) -> os.stat_result:
    """Make this process's own writable object read-only; return its ``stat`` after."""
    if st.st_mode & 0o222 and st.st_uid == os.geteuid():
        try:
            os.chmod(path, 0o444)
        except OSError as exc:  # e.g. a read-only file system: the object is still verified after
            logger.info("coldsnap: cannot make %s read-only (%s)", path, exc.strerror or exc)
        st = refuse_symlink(path) or st
    return st
