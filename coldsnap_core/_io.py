"""Low-level file I/O shared by the writers, the cache and the verifier. :func:`os_error` is the one ``OSError``
table (an ``OSError`` becomes a typed error, so none reaches a loader's ``auto`` fallback or the CLI bare);
:func:`write_hashed` hashes beside the writes and starts writeback every :data:`WRITEBACK_WINDOW_BYTES`, so the final
``fsync`` waits only for the last window."""

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
    """Start writing back the range of ``fd`` without waiting (the caller still fsyncs); ``False``: unavailable or refused."""
    if _sync_file_range is None or size_bytes <= 0:
        return False
    return _sync_file_range(fd, offset_bytes, size_bytes, SYNC_FILE_RANGE_WRITE) == 0


class Writeback:
    """Writes chunks to ``fd`` (:func:`write_all`), starting writeback every :data:`WRITEBACK_WINDOW_BYTES`."""

    def __init__(self, fd: int, *, file: str | os.PathLike[str], progress: Callable[[int], object] | None = None) -> None:
        self._fd = fd
        self._file = file
        self._progress = progress
        self.size_bytes = 0
        try:
            self._mark = os.lseek(fd, 0, os.SEEK_CUR)
        except OSError:  # a pipe or socket: nothing to write back
            self._mark = -1
        self._pending = 0

    def write(self, chunk: memoryview | bytes) -> None:
        write_all(self._fd, chunk, file=self._file)
        self.size_bytes += len(chunk)
        if self._mark >= 0:
            self._pending += len(chunk)
            if self._pending >= WRITEBACK_WINDOW_BYTES:
                start_writeback(self._fd, self._mark, self._pending)
                self._mark += self._pending
                self._pending = 0
        if self._progress is not None:
            self._progress(len(chunk))


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
    """The typed error, ``"<what>: <the operating system's reason>"`` naming ``path``, for an ``OSError`` met while
    accessing ``path`` (raise it ``from exc``): :data:`SPACE_ERRNOS`: ``InsufficientSpaceError``;
    ``ENOENT``/``ENOTDIR``: ``missing``; ``EISDIR``: ``NotRegularFileError``; anything else: ``other``."""
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
    """``os.lstat``; ``None`` when nothing is there; UnsafePathError on ``ENOTDIR``/``ELOOP``, else FileAccessError."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise UnsafePathError(f"a component of the path is not a usable folder: {exc.strerror or exc}", file=path) from exc
        raise FileAccessError(f"cannot examine the path: {exc.strerror or exc}", file=path) from exc


def refuse_symlink(path: Path, *, folder: bool = False) -> os.stat_result | None:
    """:func:`lstat_or_none` of a regular file (``folder``: a payload cache folder); UnsafePathError on a symbolic
    link (or, ``folder``, not a folder), NotRegularFileError on a non-regular file."""
    st = lstat_or_none(path)
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        where = "as a payload cache folder" if folder else "in the node-local state root"
        raise UnsafePathError(f"refusing a symbolic link {where}", file=path)
    if folder and not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError("a payload cache folder path is not a folder", file=path)
    if not folder and not stat.S_ISREG(st.st_mode):
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
    """Open ``path`` for reading and yield ``(fd, fstat of fd)`` of a regular file, closed on exit (``O_NONBLOCK``:
    a named pipe does not wait for a writer, fifo(7)). Raises ``missing``: nothing there; UnsafePathError: a symbolic
    link and not ``follow_links``; NotRegularFileError: not a regular file; FileAccessError: any other failure."""
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
    """An untyped ``OSError`` as a FileAccessError naming its file(s), caused by it: the CLI's and ``auto``'s last defence."""

    def name(value: object) -> str | None:
        return os.fsdecode(value) if isinstance(value, (str, bytes, os.PathLike)) else None

    detail = f"unexpected I/O error: {exc.strerror or exc}"
    if name(exc.filename2) is not None:
        detail += f" (second file: {name(exc.filename2)})"
    error = FileAccessError(detail, file=name(exc.filename))
    error.__cause__ = exc
    return error


def write_all(fd: int, data: memoryview | bytes, *, file: str | os.PathLike[str]) -> None:
    """Write every byte of ``data`` to ``fd``; InsufficientSpaceError (:data:`SPACE_ERRNOS`) or CacheError."""
    view = memoryview(data).cast("B")
    while view:
        try:
            written = os.write(fd, view)
        except OSError as exc:
            raise _write_error("write", exc, file) from exc
        view = view[written:]


def _write_error(what: str, exc: OSError, file: str | os.PathLike[str]) -> CacheError:
    if exc.errno in SPACE_ERRNOS:
        return InsufficientSpaceError(f"{what} failed: {os.strerror(exc.errno)}", file=file)
    return CacheError(f"{what} failed: {exc}", file=file)


def advise_sequential(fd: int) -> None:
    """Tell the kernel a file is about to be read front to back (``POSIX_FADV_SEQUENTIAL``); errors are ignored."""
    with contextlib.suppress(AttributeError, OSError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder so that a rename into it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_fd(fd: int, *, file: str | os.PathLike[str]) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise _write_error("fsync", exc, file) from exc


def write_file_durably(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write a new small file (``O_EXCL | O_NOFOLLOW``, ``mode``) and fsync it (not its folder); ``OSError`` when it
    cannot be created, InsufficientSpaceError / CacheError when the write or fsync fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        write_all(fd, data, file=path)
        fsync_fd(fd, file=path)
    finally:
        os.close(fd)


def close_and_remove(fd: int, path: Path) -> None:
    """Close ``fd`` and remove the temporary file ``path`` if it is still there."""
    with contextlib.suppress(OSError):
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def sibling_temporary(path: Path, *, mode: int = 0o644) -> Iterator[tuple[int, Path]]:
    """Create ``.<name>.<random>.partial`` beside ``path`` (``O_EXCL | O_NOFOLLOW``, ``mode``; ``OSError`` if it
    cannot be); yield ``(fd, temporary path)`` open for writing; on exit close it and remove it unless renamed."""
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
    """Atomically and durably replace the small file ``path`` with ``data``: write ``temporary()`` (default
    :func:`sibling_temporary`), fsync it, call ``before_rename(path)``, rename it onto ``path``, fsync the folder.
    Raises ``OSError`` (create, rename), InsufficientSpaceError / CacheError (write, fsync), or what ``before_rename`` does."""
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
    """Write chunks to ``fd`` while hashing them (SHA-256) on a helper thread: the hash of chunk ``k`` runs while
    chunk ``k`` is written, so a chunk must stay unchanged until the next call. ``progress`` gets the bytes written."""

    def __init__(self, fd: int, *, file: str | os.PathLike[str], progress: Callable[[int], object] | None = None) -> None:
        self._hash = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coldsnap-hash")
        self._pending: Future[None] | None = None
        self._out = Writeback(fd, file=file, progress=progress)

    def write(self, chunk: memoryview | bytes) -> None:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), HASH_CHUNK_BYTES):
            piece = view[start : start + HASH_CHUNK_BYTES]
            self._wait()
            self._pending = self._pool.submit(self._hash.update, piece)
            self._out.write(piece)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def finish(self) -> tuple[str, int]:
        """Wait for the last hash update; return ``(sha256 hex, size_bytes)`` of all bytes written."""
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)
        return self._hash.hexdigest(), self._out.size_bytes

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
    """Write every chunk of ``chunks()`` (a fresh iterator per call) to ``fd``; return ``(sha256 hex, size_bytes)``.
    ``stable``: ``chunks()`` may be iterated twice at once, each chunk unchanged until both end, so a helper thread
    hashes its own iteration (else :class:`HashingWriter`). Raises as :func:`write_all`, or CacheError: sizes differ."""
    if not stable:
        writer = HashingWriter(fd, file=file, progress=progress)
        try:
            for chunk in chunks():
                writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        return writer.finish()

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

    out = Writeback(fd, file=file, progress=progress)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="coldsnap-hash") as pool:
        hashing = pool.submit(hash_stream)
        try:
            for chunk in chunks():
                out.write(chunk)
        except BaseException:
            stop.set()
            raise
        digest, hashed = hashing.result()
    if hashed != out.size_bytes:
        raise CacheError(f"wrote {out.size_bytes} bytes but hashed {hashed}: the chunk stream is not stable", file=file)
    return digest, out.size_bytes


def sha256_file(
    path: str | os.PathLike[str],
    *,
    progress: Callable[[int], object] | None = None,
    observe: Callable[[int, memoryview], object] | None = None,
) -> tuple[str, int]:
    """Hash a whole file; return ``(sha256 hex, size_bytes)``. ``progress`` gets the bytes hashed after each
    chunk; ``observe`` gets ``(file_offset_bytes, chunk)`` before it is hashed (the buffer is reused)."""
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
