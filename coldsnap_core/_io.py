"""Low-level file I/O shared by the writers, the cache and the verifier.

Internal logic worth knowing:

* Writes go through :func:`write_all`, which maps "no space" (``ENOSPC``, ``EDQUOT``) and "file too
  large" (``EFBIG``, what ``RLIMIT_FSIZE`` produces; CPython ignores ``SIGXFSZ``) to
  :class:`~coldsnap_core.errors.InsufficientSpaceError`, so a caller can delete its temporary file and
  report one clear error.
* :func:`os_error` turns an ``OSError`` met while opening or reading a file into the typed error a
  caller reports (missing, not a regular file, no space, anything else ``io``), so no bare ``OSError``
  reaches a loader's ``auto`` fallback or the CLI.
* :func:`write_hashed` writes a stream of chunks while computing its SHA-256 on a helper thread,
  overlapped with the ``write`` system calls (both release the GIL), so writing a pack costs one hash
  pass, not a hash pass plus a write pass. When the chunks are *stable* (views of memory that does
  not change, such as host allocations) the helper walks its own copy of the stream and never waits
  for the writer; otherwise (:class:`HashingWriter`) the two go in lockstep, one chunk at a time,
  because the chunk's buffer is reused for the next one.
* Both also start the device write of what they wrote every :data:`WRITEBACK_WINDOW_BYTES`
  (:class:`Writeback`, Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk writes while
  the rest is still being hashed and written, and the final ``fsync`` waits only for the last window
  instead of for every byte (the kernel otherwise starts writeback only once the dirty pages pass
  ``dirty_background_ratio`` of memory, or after 30 s).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from coldsnap_core.errors import (
    CacheError,
    ColdsnapError,
    FileAccessError,
    InsufficientSpaceError,
    MissingObjectError,
    NotRegularFileError,
    UnsafePathError,
)

HASH_CHUNK_BYTES = 8 << 20
"""Chunk size for hashing and streaming writes (8 MiB)."""

WRITEBACK_WINDOW_BYTES = 32 << 20
"""Bytes written between two starts of writeback in :func:`write_hashed` (32 MiB)."""

SYNC_FILE_RANGE_WRITE = 2
"""``sync_file_range`` flag: start writeback of the range's dirty pages, do not wait (``fs/sync.c``)."""

try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
except (OSError, AttributeError):  # not Linux (or no glibc symbol): writeback stays the kernel's
    _sync_file_range = None


def start_writeback(fd: int, offset_bytes: int, size_bytes: int) -> bool:
    """Ask the kernel to start writing ``[offset_bytes, offset_bytes + size_bytes)`` of ``fd`` to its
    device, without waiting (``sync_file_range(SYNC_FILE_RANGE_WRITE)``). It guarantees nothing about
    durability (the caller still fsyncs); it only moves the device's work earlier. Returns ``False``
    where the call is unavailable or refused (tmpfs and pipes accept it as a no-op or refuse it)."""
    if _sync_file_range is None or size_bytes <= 0:
        return False
    return _sync_file_range(fd, offset_bytes, size_bytes, SYNC_FILE_RANGE_WRITE) == 0


class Writeback:
    """Starts writeback of ``fd`` every :data:`WRITEBACK_WINDOW_BYTES` bytes written from its current offset."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        try:
            self._mark = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:  # a pipe or socket: nothing to write back
            self._mark = -1
        self._pending = 0

    def advance(self, size_bytes: int) -> None:
        """``size_bytes`` more bytes were written."""
        if self._mark < 0:
            return
        self._pending += size_bytes
        if self._pending >= WRITEBACK_WINDOW_BYTES:
            start_writeback(self._fd, self._mark, self._pending)
            self._mark += self._pending
            self._pending = 0


_ZEROS = bytes(1 << 20)
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""The ``errno`` values that mean "no space" everywhere: a full file system, a quota, ``RLIMIT_FSIZE``."""


def os_error(
    what: str,
    exc: OSError,
    path: str | os.PathLike[str] | None,
    *,
    missing: type[ColdsnapError] = MissingObjectError,
    other: type[ColdsnapError] = FileAccessError,
) -> ColdsnapError:
    """The typed error for an ``OSError`` met while accessing ``path`` (raise it ``from exc``): the one
    ``OSError`` table of the package.

    ``ENOSPC``/``EDQUOT``/``EFBIG`` (no space, a quota, ``RLIMIT_FSIZE``):
    :class:`~coldsnap_core.errors.InsufficientSpaceError`, whoever calls; ``ENOENT``/``ENOTDIR``
    (nothing there, or a path component is a file): ``missing``
    (:class:`~coldsnap_core.errors.MissingObjectError` by default); ``EISDIR``:
    :class:`~coldsnap_core.errors.NotRegularFileError`; anything else (``EACCES``, ``ELOOP``,
    ``EIO``, ``EROFS``, ...): ``other`` (:class:`~coldsnap_core.errors.FileAccessError`, rule ``io``,
    by default; the cache passes :class:`~coldsnap_core.errors.CacheError` for its own folders). The
    message is ``"<what>: <the operating system's reason>"`` and names ``path``.
    """
    reason = exc.strerror or str(exc)
    if exc.errno in SPACE_ERRNOS:
        return InsufficientSpaceError(f"{what}: {reason}", file=path)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return missing(f"{what}: {reason}", file=path)
    if exc.errno == errno.EISDIR:
        return NotRegularFileError(f"{what}: it is a folder, not a regular file", file=path)
    return other(f"{what}: {reason}", file=path)


def os_errno(exc: BaseException) -> int | None:
    """The ``errno`` of an ``OSError``, or of the ``OSError`` a coldsnap error was raised from."""
    if isinstance(exc, OSError):
        return exc.errno
    cause = exc.__cause__
    return cause.errno if isinstance(cause, OSError) else None


def lstat_or_none(path: Path) -> os.stat_result | None:
    """``os.lstat``; ``None`` when nothing is there; other failures as typed errors.

    Raises:
        UnsafePathError: a path component is not a folder (``ENOTDIR``) or a link loop (``ELOOP``).
        FileAccessError: any other failure (``EACCES``, ``EIO``, ...).
    """
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise UnsafePathError(f"a component of the path is not a usable folder: {exc.strerror or exc}", file=path) from exc
        raise FileAccessError(f"cannot examine the path: {exc.strerror or exc}", file=path) from exc


def refuse_symlink(path: Path) -> os.stat_result | None:
    """``lstat`` ``path``; return ``None`` if absent, its stat if a regular file.

    Raises:
        UnsafePathError: ``path`` is a symbolic link, or a path component is not a folder.
        NotRegularFileError: ``path`` is a folder, device or other non-regular file.
        FileAccessError: ``path`` cannot be examined (``EACCES``, ``EIO``, ...).
    """
    st = lstat_or_none(path)
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError("refusing a symbolic link in the node-local state root", file=path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(
            f"refusing a non-regular file ({stat.filemode(st.st_mode)}) in the node-local state root", file=path
        )
    return st


@contextlib.contextmanager
def open_regular(
    path: str | os.PathLike[str],
    what: str,
    *,
    follow_links: bool = False,
    missing: type[ColdsnapError] = MissingObjectError,
) -> Iterator[tuple[int, os.stat_result]]:
    """Open ``path`` for reading and yield ``(fd, fstat of fd)`` of a regular file; the descriptor is
    closed on exit. The one open of every private file (records, overlay descriptors) and capsule file.

    ``O_NONBLOCK``: the open of a named pipe returns at once instead of waiting for a writer (fifo(7));
    ``O_NOCTTY``: a terminal does not become the controlling one; ``O_NOFOLLOW`` unless ``follow_links``
    (capsule files may be links; the node-local state root's files may not). The type is checked with
    ``fstat`` on the descriptor, so what is checked is what is read. Reads of a regular file ignore
    ``O_NONBLOCK``.

    Raises:
        ``missing`` (:class:`~coldsnap_core.errors.MissingObjectError` by default): nothing at ``path``.
        UnsafePathError: a symbolic link at ``path`` and not ``follow_links`` (rule ``no-symlinks``).
        NotRegularFileError: a folder, named pipe, device or socket at ``path`` (rule ``regular-file``).
        FileAccessError: any other failure (:func:`os_error`).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise UnsafePathError(f"the {what} is a symbolic link, which is not followed", file=path) from exc
        if exc.errno == errno.ENXIO:  # a socket (or a device without its driver) cannot be opened as a file
            raise NotRegularFileError(f"the {what} is not a regular file (a socket or device)", file=path) from exc
        if exc.errno == errno.ENOENT:
            raise missing(f"the {what} does not exist", file=path) from exc
        raise os_error(f"cannot open the {what}", exc, path, missing=missing) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(f"the {what} is not a regular file ({stat.filemode(st.st_mode)})", file=path)
        yield fd, st
    finally:
        os.close(fd)


def unexpected_os_error(exc: OSError) -> FileAccessError:
    """An ``OSError`` that no coldsnap layer turned into a typed error, as a rule-style error (rule
    ``io``, exit code 4) naming its file(s); the ``OSError`` is its ``__cause__``. The last line of
    defence of the CLI and of the loaders' ``COLDSNAP_RESTORE=auto`` fallback."""

    def name(value: object) -> str | None:
        return os.fsdecode(value) if isinstance(value, (str, bytes, os.PathLike)) else None

    detail = f"unexpected I/O error: {exc.strerror or exc}"
    if name(exc.filename2) is not None:
        detail += f" (second file: {name(exc.filename2)})"
    error = FileAccessError(detail, file=name(exc.filename))
    error.__cause__ = exc
    return error


def write_all(fd: int, data: memoryview | bytes, *, file: str | os.PathLike[str]) -> None:
    """Write every byte of ``data`` to ``fd``.

    Raises:
        InsufficientSpaceError: the file system is full, a quota or ``RLIMIT_FSIZE`` was hit.
        CacheError: any other write error.
    """
    view = memoryview(data).cast("B")
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            if exc.errno in SPACE_ERRNOS:
                raise InsufficientSpaceError(f"write failed: {os.strerror(exc.errno)}", file=file) from exc
            raise CacheError(f"write failed: {exc}", file=file) from exc
        view = view[written:]


def advise_sequential(fd: int) -> None:
    """Tell the kernel a file is about to be read front to back (``POSIX_FADV_SEQUENTIAL``: a larger
    readahead window). Measured on this project's 2-core machine with the 269 MB SmolLM2 pack evicted
    from the page cache: one reading thread went from 0.5-0.7 GB/s to 2.0 GB/s. Advice only: errors
    (a file system without ``fadvise``) are ignored."""
    with contextlib.suppress(AttributeError, OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder so that a rename into it is durable (POSIX ``rename``: the new name is durable only once its folder is synced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_fd(fd: int, *, file: str | os.PathLike[str]) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno in SPACE_ERRNOS:
            raise InsufficientSpaceError(f"fsync failed: {os.strerror(exc.errno)}", file=file) from exc
        raise CacheError(f"fsync failed: {exc}", file=file) from exc


def write_file_durably(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write a new small file (``O_EXCL | O_NOFOLLOW``, created with ``mode``) and fsync it. The caller
    fsyncs the folder.

    Raises:
        OSError: ``path`` exists (``FileExistsError``) or cannot be created.
        InsufficientSpaceError / CacheError: the write or the fsync failed.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        write_all(fd, data, file=path)
        fsync_fd(fd, file=path)
    finally:
        os.close(fd)


def close_and_remove(fd: int, path: Path) -> None:
    """Close ``fd`` and remove the temporary file ``path``: the end of a temporary file's life, whether it
    was renamed into place (nothing left to remove), closed already, or abandoned after a failure."""
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def sibling_temporary(path: Path, *, mode: int = 0o644) -> Iterator[tuple[int, Path]]:
    """Create ``.<name>.<random>.partial`` beside ``path`` (``O_EXCL | O_NOFOLLOW``, ``mode``); yield
    ``(fd, temporary path)``, open for writing. On exit the descriptor is closed and the file removed
    unless it was renamed.

    Raises:
        OSError: the temporary file cannot be created.
    """
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        yield fd, temp
    finally:
        close_and_remove(fd, temp)


def replace_file_durably(
    path: Path,
    data: bytes,
    *,
    mode: int = 0o644,
    read_only: bool = False,
    temporary: Callable[[], contextlib.AbstractContextManager[tuple[int, Path]]] | None = None,
    before_rename: Callable[[Path], object] | None = None,
) -> None:
    """Atomically and durably replace the small file ``path`` with ``data``: the one replace of
    ``artifact.json``, validation records and checkpoint records.

    Writes a temporary file (``temporary()``, a context manager yielding ``(fd, path)`` open for writing
    that removes the file on exit unless renamed; default :func:`sibling_temporary` with ``mode``), makes
    it mode 0444 when ``read_only``, fsyncs it, calls ``before_rename(path)`` (a last check of the
    target, e.g. refusing a symbolic link), renames it onto ``path`` and fsyncs the folder. A reader sees
    the old file or the new one, never a part.

    Raises:
        OSError: the temporary file cannot be created or renamed.
        InsufficientSpaceError / CacheError: the write or an fsync failed.
        whatever ``before_rename`` raises (nothing renamed).
    """
    opened = temporary() if temporary is not None else sibling_temporary(path, mode=mode)
    with opened as (fd, temp):
        write_all(fd, data, file=temp)
        if read_only:
            os.fchmod(fd, 0o444)
        fsync_fd(fd, file=temp)
        if before_rename is not None:
            before_rename(path)
        os.rename(temp, path)
    fsync_dir(path.parent)


class HashingWriter:
    """Write chunks to a file descriptor while hashing them (SHA-256) on a helper thread.

    The hash of chunk ``k`` runs while chunk ``k`` is written; the writer waits for it before
    hashing chunk ``k + 1``, so the digest covers the bytes in order. Chunks must stay unchanged
    until the next call.

    Args:
        fd: an open, writable file descriptor positioned where writing starts.
        file: the file's path, for error messages.
        progress: called with the number of bytes written after each chunk.
    """

    def __init__(self, fd: int, *, file: str | os.PathLike[str], progress: Callable[[int], object] | None = None) -> None:
        self._fd = fd
        self._file = file
        self._hash = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coldsnap-hash")
        self._pending: Future[None] | None = None
        self._progress = progress
        self._writeback = Writeback(fd)
        self.size_bytes = 0

    def write(self, chunk: memoryview | bytes) -> None:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), HASH_CHUNK_BYTES):
            piece = view[start : start + HASH_CHUNK_BYTES]
            self._wait()
            self._pending = self._pool.submit(self._hash.update, piece)
            write_all(self._fd, piece, file=self._file)
            self._writeback.advance(len(piece))
            self.size_bytes += len(piece)
            if self._progress is not None:
                self._progress(len(piece))

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def finish(self) -> str:
        """Wait for the last hash update and return the SHA-256 (lowercase hex) of all bytes written."""
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)
        return self._hash.hexdigest()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._wait()
        self._pool.shutdown(wait=True)


def zero_chunks(size_bytes: int) -> Iterable[memoryview]:
    """``size_bytes`` zero bytes as read-only views of one shared 1 MiB zero buffer."""
    zeros = memoryview(_ZEROS)
    while size_bytes > 0:
        n = min(size_bytes, len(_ZEROS))
        yield zeros[:n]
        size_bytes -= n


def write_hashed(
    fd: int,
    chunks: Callable[[], Iterable[memoryview | bytes]],
    *,
    file: str | os.PathLike[str],
    stable: bool,
    progress: Callable[[int], object] | None = None,
) -> tuple[str, int]:
    """Write every chunk of ``chunks()`` to ``fd``; return ``(sha256 hex, size_bytes)`` of what was written.

    Args:
        fd: an open, writable file descriptor positioned where writing starts.
        chunks: returns a fresh iterator over the bytes to write, in order.
        file: the file's path, for error messages.
        stable: ``chunks()`` may be iterated twice at once (on two threads) and every chunk stays
            valid and unchanged until both iterations end. Then a helper thread hashes its own
            iteration while this thread writes (no per-chunk hand-off). Otherwise
            :class:`HashingWriter` is used (hash of chunk ``k`` overlapped with its write).
        progress: called with the number of bytes written after each chunk.

    Raises:
        InsufficientSpaceError: the file system is full, a quota or ``RLIMIT_FSIZE`` was hit.
        CacheError: any other write error, or the two iterations did not yield the same number of
            bytes.
    """
    if not stable:
        writer = HashingWriter(fd, file=file, progress=progress)
        try:
            for chunk in chunks():
                writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        return writer.finish(), writer.size_bytes

    stop = threading.Event()

    def hash_stream() -> tuple[str, int]:
        digest = hashlib.sha256()
        hashed = 0
        for chunk in chunks():
            if stop.is_set():
                break
            digest.update(chunk)
            hashed += len(chunk)
        return digest.hexdigest(), hashed

    written = 0
    writeback = Writeback(fd)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="coldsnap-hash") as pool:
        hashing = pool.submit(hash_stream)
        try:
            for chunk in chunks():
                write_all(fd, chunk, file=file)
                writeback.advance(len(chunk))
                written += len(chunk)
                if progress is not None:
                    progress(len(chunk))
        except BaseException:
            stop.set()
            raise
        digest, hashed = hashing.result()
    if hashed != written:
        raise CacheError(f"wrote {written} bytes but hashed {hashed}: the chunk stream is not stable", file=file)
    return digest, written


def sha256_file(
    path: str | os.PathLike[str],
    *,
    progress: Callable[[int], object] | None = None,
    observe: Callable[[int, memoryview], object] | None = None,
) -> tuple[str, int]:
    """Hash a whole file; return ``(sha256 hex, size_bytes)``.

    Args:
        path: the file.
        progress: called with the number of bytes hashed after each chunk.
        observe: called with ``(file_offset_bytes, chunk)`` for each chunk, before it is hashed
            (the chunk's buffer is reused for the next one).

    Memory: one buffer of ``min(8 MiB, file size + 1)`` bytes.
    """
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        # A small file gets a small buffer (bytearray zero-fills, so every page of it is resident).
        buffer = bytearray(max(1, min(HASH_CHUNK_BYTES, os.fstat(f.fileno()).st_size + 1)))
        view = memoryview(buffer)
        while True:
            n = f.readinto(view)
            if not n:
                break
            chunk = view[:n]
            if observe is not None:
                observe(size, chunk)
            digest.update(chunk)
            size += n
            if progress is not None:
                progress(n)
    return digest.hexdigest(), size


def file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def remove_tree(path: Path) -> None:
    """Remove a folder (or a symbolic link or file in its place) without following links."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
