"""Copy a whole file into a file descriptor in the kernel (``copy_file_range``, else ``sendfile``, else
``read``/``write``), for store fetches and uploads."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

from coldsnap_core._io import SPACE_ERRNOS, write_all
from coldsnap_core.errors import CacheError, InsufficientSpaceError

COPY_CHUNK_BYTES = 64 << 20
"""Bytes per kernel copy call (64 MiB), i.e. per progress update."""

_FALLBACK_ERRNOS = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def copy_fd(
    source_fd: int,
    target_fd: int,
    size_bytes: int,
    *,
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    progress: Callable[[int], object] | None = None,
    landed: Callable[[int, int], object] | None = None,
) -> None:
    """Copy the first ``size_bytes`` bytes of ``source_fd`` to ``target_fd``, ``landed(offset_bytes, size_bytes)``
    after each copy call; ``InsufficientSpaceError`` (no space), or ``CacheError`` (a short source, another error)."""
    done = 0
    method = "copy_file_range"
    while done < size_bytes:
        count = min(COPY_CHUNK_BYTES, size_bytes - done)
        try:
            if method == "copy_file_range":
                n = os.copy_file_range(source_fd, target_fd, count, done, done)
            elif method == "sendfile":
                os.lseek(target_fd, done, os.SEEK_SET)
                n = os.sendfile(target_fd, source_fd, done, count)
            else:
                data = os.pread(source_fd, count, done)
                os.lseek(target_fd, done, os.SEEK_SET)
                write_all(target_fd, data, file=target)
                n = len(data)
        except OSError as exc:
            if exc.errno in SPACE_ERRNOS:
                raise InsufficientSpaceError(f"copy failed at byte {done}: {os.strerror(exc.errno)}", file=target) from exc
            if exc.errno in _FALLBACK_ERRNOS and method != "readwrite":
                method = "sendfile" if method == "copy_file_range" else "readwrite"
                continue
            raise CacheError(f"copying {source} failed at byte {done}: {exc}", file=target) from exc
        if n == 0:
            raise CacheError(f"{source} ended after {done} of {size_bytes} bytes", file=target)
        if landed is not None:
            landed(done, n)
        done += n
        if progress is not None:
            progress(n)


def copy_file(
    source: Path,
    target_fd: int,
    size_bytes: int,
    *,
    target: Path,
    progress: Callable[[int], object] | None = None,
    landed: Callable[[int, int], object] | None = None,
) -> None:
    """Open ``source`` (``O_NOFOLLOW``) and copy its first ``size_bytes`` bytes to ``target_fd`` (:func:`copy_fd`)."""
    source_fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        copy_fd(source_fd, target_fd, size_bytes, source=source, target=target, progress=progress, landed=landed)
    finally:
        os.close(source_fd)
