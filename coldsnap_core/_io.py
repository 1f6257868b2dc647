"""Low-level file I/O shared by the writers, the cache and the verifier.

Internal logic worth knowing:

* Writes go through :func:`write_all`, which maps "no space" (``ENOSPC``, ``EDQUOT``) and "file too
  large" (``EFBIG``, what ``RLIMIT_FSIZE`` produces; CPython ignores ``SIGXFSZ``) to
  :class:`~coldsnap_core.errors.InsufficientSpaceError`, so a caller can delete its temporary file and
  report one clear error.
* :class:`HashingWriter` computes the SHA-256 of what it writes on a helper thread, overlapped with
  the ``write`` system calls (both release the GIL), so writing a pack costs one hash pass, not a
  hash pass plus a write pass.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from coldsnap_core.errors import CacheError, InsufficientSpaceError

HASH_CHUNK_BYTES = 8 << 20
"""Chunk size for hashing and streaming writes (8 MiB)."""

_ZEROS = bytes(1 << 20)
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


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
            if exc.errno in _SPACE_ERRNOS:
                raise InsufficientSpaceError(f"write failed: {os.strerror(exc.errno)}", file=file) from exc
            raise CacheError(f"write failed: {exc}", file=file) from exc
        view = view[written:]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder so that a rename into it is durable (``reference/anchors.md`` B5, B10)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_fd(fd: int, *, file: str | os.PathLike[str]) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno in _SPACE_ERRNOS:
            raise InsufficientSpaceError(f"fsync failed: {os.strerror(exc.errno)}", file=file) from exc
        raise CacheError(f"fsync failed: {exc}", file=file) from exc


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
        self.size_bytes = 0

    def write(self, chunk: memoryview | bytes) -> None:
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), HASH_CHUNK_BYTES):
            piece = view[start : start + HASH_CHUNK_BYTES]
            self._wait()
            self._pending = self._pool.submit(self._hash.update, piece)
            write_all(self._fd, piece, file=self._file)
            self.size_bytes += len(piece)
            if self._progress is not None:
                self._progress(len(piece))

    def write_zeros(self, size_bytes: int) -> None:
        while size_bytes > 0:
            n = min(size_bytes, len(_ZEROS))
            self.write(memoryview(_ZEROS)[:n])
            size_bytes -= n

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
            (the verifier checks padding this way without a second read).
    """
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
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
