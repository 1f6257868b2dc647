"""Parallel ranged reads of one remote object into a file descriptor, shared by the object-store clients
(S3, OCI registry, GCS, Azure Blob), and the message of a failed request (:func:`request_failure`).

A store gives :func:`fetch_ranges` a function that returns the bytes ``[start, end)`` of the object; the
ranges are read ``concurrency`` at a time and written with ``pwrite`` at their offsets. Nothing here judges
content: the cache verifies the whole file (:func:`coldsnap_core.format.verify.verify_pack_file`) before admitting it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coldsnap_core._io import SPACE_ERRNOS
from coldsnap_core.errors import InsufficientSpaceError, PackDigestMismatchError, PackSizeMismatchError, StoreError
from coldsnap_core.settings import (
    STORE_CONNECT_TIMEOUT_ENV,
    STORE_READ_TIMEOUT_ENV,
    STORE_RETRIES_ENV,
    StoreClientSettings,
)

RANGE_SIZE_BYTES = 64 << 20
"""Bytes per ranged GET (64 MiB)."""
DEFAULT_CONCURRENCY = 8
"""Ranges in flight at once (threads)."""

ReadRange = Callable[[int, int], bytes]
"""``(start, end) -> bytes [start, end)`` of the object."""


def timed_out(exc: BaseException) -> str | None:
    """``"connect"`` or ``"read"`` when ``exc`` (or an exception in its chain) is a client's timeout (botocore's
    ``ConnectTimeoutError``/``ReadTimeoutError``, httpx's and requests' ``ConnectTimeout``/``ReadTimeout``, an
    ``OSError`` "timed out" as azure-core and urllib3 report it), else ``None``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = [cls.__name__ for cls in type(current).__mro__]
        if any("ConnectTimeout" in n for n in names):
            return "connect"
        if any("Timeout" in n for n in names) or "timed out" in str(current).lower():
            return "read"
        current = current.__cause__ or current.__context__
    return None


def request_failure(
    name: str,
    action: str,
    exc: BaseException,
    client: StoreClientSettings,
    *,
    where: str,
    attempts_from: tuple[int, str] | None = None,
) -> StoreError:
    """The :class:`StoreError` of a failed request of store ``name``: ``"<name>: <action> failed: <class>:
    <first line>"``, and for a timeout the timeout that expired, its variable and the attempts made, so a
    stalled store says what ended the wait. ``attempts_from``: ``(attempts, where they came from)`` when the
    client took them from elsewhere than ``COLDSNAP_STORE_RETRIES``."""
    message = str(exc).splitlines()[0] if str(exc) else ""
    text = f"{name}: {action} failed: {type(exc).__name__}: {message}"
    kind = timed_out(exc)
    if kind == "connect":
        text += f" (no connection within the connect timeout of {client.connect_timeout_s:g} s, {STORE_CONNECT_TIMEOUT_ENV}"
    elif kind == "read":
        text += f" (no byte within the read timeout of {client.read_timeout_s:g} s, {STORE_READ_TIMEOUT_ENV}"
    if kind is not None:
        attempts, source = client.retries + 1, STORE_RETRIES_ENV
        if attempts_from is not None:  # a client whose own variable decided the attempts (S3: AWS_MAX_ATTEMPTS)
            attempts, source = attempts_from
        text += f"; at most {attempts} attempt(s), {source})"
    return StoreError(text, file=where)


def byte_ranges(size_bytes: int, step_bytes: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``[0, size_bytes)`` in steps of ``step_bytes`` (end exclusive)."""
    return [(start, min(start + step_bytes, size_bytes)) for start in range(0, size_bytes, step_bytes)]


def run_all(function: Callable[[Any], object], items: list[Any], concurrency: int) -> None:
    """Run ``function(item)`` for every item on ``concurrency`` threads; the first error is raised once the
    items not yet started are cancelled (those in flight finish)."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(function, item) for item in items]
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def checked_range(data: bytes, start: int, end: int, *, where: str) -> bytes:
    """``data`` when it has ``end - start`` bytes.

    Raises:
        PackSizeMismatchError: a short or long range (the object changed size), naming ``where`` and ``start``.
    """
    if len(data) != end - start:
        raise PackSizeMismatchError(
            f"ranged read of bytes {start}-{end - 1} returned {len(data)} bytes (the object changed size)",
            file=where,
            offset_bytes=start,
        )
    return data


def fetch_ranges(
    read: ReadRange,
    size_bytes: int,
    fd: int,
    *,
    file: Path,
    range_size_bytes: int = RANGE_SIZE_BYTES,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Write ``[0, size_bytes)`` of an object to ``fd`` (``file``): ``read`` per range, in parallel, ``pwrite`` each.

    Raises:
        InsufficientSpaceError: the cache's file system filled up.
        StoreError: writing into ``file`` failed otherwise.
        whatever ``read`` raises (the first error; the other ranges stop being started).
    """
    lock = threading.Lock()

    def one(r: tuple[int, int]) -> None:
        view = memoryview(read(r[0], r[1]))
        offset = r[0]
        while view:
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as exc:
                if exc.errno in SPACE_ERRNOS:
                    raise InsufficientSpaceError(f"fetch failed at byte {offset}: {os.strerror(exc.errno)}", file=file) from exc
                raise StoreError(f"writing the fetched bytes at {offset} failed: {exc}", file=file) from exc
            view = view[n:]
            offset += n
        if progress is not None:
            with lock:
                progress(r[1] - r[0])

    run_all(one, byte_ranges(size_bytes, range_size_bytes), concurrency)


def hash_ranges(
    read: ReadRange, size_bytes: int, *, range_size_bytes: int = RANGE_SIZE_BYTES, concurrency: int = DEFAULT_CONCURRENCY
) -> str:
    """The SHA-256 (lowercase hex) of ``[0, size_bytes)`` of an object, read in parallel ranges (in order,
    at most ``concurrency`` ranges ahead of the hash)."""
    h = hashlib.sha256()
    pending: collections.deque[concurrent.futures.Future[bytes]] = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for start, end in byte_ranges(size_bytes, range_size_bytes):
            pending.append(pool.submit(read, start, end))
            if len(pending) >= concurrency:
                h.update(pending.popleft().result())
        while pending:
            h.update(pending.popleft().result())
    return h.hexdigest()


def check_file_digest(path: Path, digest: str, size_bytes: int) -> None:
    """Hash ``path`` (sequentially, 8 MiB reads) before any byte of it is sent to a store that cannot take back
    what it was sent (an OCI upload session, Azure's staged blocks).

    Raises:
        PackDigestMismatchError: the file does not have ``size_bytes`` bytes hashing to ``digest`` (it changed
            after verification).
    """
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            done += len(chunk)
    if done != size_bytes or h.hexdigest() != digest:
        raise PackDigestMismatchError(
            f"the file to upload ({done} bytes) does not hash to its digest; it changed after verification", file=path
        )


def read_file_checked(path: Path, digest: str, size_bytes: int) -> bytes:
    """The whole of ``path`` when it has ``size_bytes`` bytes hashing to ``digest`` (a single-request upload).

    Raises:
        PackDigestMismatchError: the file changed after verification (other size or other bytes).
    """
    data = path.read_bytes()
    if len(data) != size_bytes or hashlib.sha256(data).hexdigest() != digest:
        raise PackDigestMismatchError("the file to upload does not hash to its digest; it changed after verification", file=path)
    return data


class HashingReader:
    """A file object over the first ``size_bytes`` of ``path`` that hashes what is read and raises on the read
    that reaches the end when the SHA-256 is not ``digest`` (so the request completing the upload is never sent)."""

    def __init__(self, path: Path, digest: str, size_bytes: int, progress: Callable[[int], object] | None) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        self._path, self._digest, self._size, self._progress = path, digest, size_bytes, progress
        self._hash = hashlib.sha256()
        self._done = 0

    def read(self, n: int = -1) -> bytes:
        want = self._size - self._done if n is None or n < 0 else min(n, self._size - self._done)
        data = self._file.read(want)
        self._hash.update(data)
        self._done += len(data)
        if want and not data:
            raise PackSizeMismatchError(f"the file ended at byte {self._done} of {self._size} during the upload", file=self._path)
        if self._done == self._size and data and self._hash.hexdigest() != self._digest:
            raise PackDigestMismatchError(
                f"the bytes read for upload hash to {self._hash.hexdigest()}, not {self._digest}; the file changed after verification",
                file=self._path,
            )
        if self._progress is not None and data:
            self._progress(len(data))
        return data

    def tell(self) -> int:
        return self._done

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._file.close()
