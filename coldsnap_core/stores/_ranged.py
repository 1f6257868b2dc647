"""The ranged-fetch core of the object stores (S3, OCI, GCS, Azure), :class:`RangedStore`: a backend gives ``stat``,
``open_range`` and ``create``; ``has``, ``fetch`` and ``upload`` follow ``docs/format.md`` §12 ("The ranged fetch")."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import hashlib
import logging
import os
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coldsnap_core._io import SPACE_ERRNOS
from coldsnap_core.errors import (
    ColdsnapError,
    ConfigurationError,
    InsufficientSpaceError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    PayloadUnavailableError,
    StoreError,
    redact_store_spec,
    size_mismatch,
)
from coldsnap_core.settings import (
    STORE_CONNECT_TIMEOUT_ENV,
    STORE_MIN_RATE_ENV,
    STORE_RANGE_DEADLINE_ENV,
    STORE_READ_TIMEOUT_ENV,
    STORE_RETRIES_ENV,
    StoreClientSettings,
)
from coldsnap_core.stores._references import ReferenceIndex
from coldsnap_core.stores.base import NOT_IN_STORE_REMEDY, LandedCallback, ProgressCallback, StoreObject, as_object, wrong_size

logger = logging.getLogger(__name__)

RANGE_SIZE_BYTES = 64 << 20
"""Bytes per ranged GET (64 MiB); ``COLDSNAP_STORE_RANGE_DEADLINE`` is per this many bytes."""
DEFAULT_CONCURRENCY = 8
"""Ranges in flight at once (threads)."""
READ_CHUNK_BYTES = 1 << 20
"""The most bytes one socket read of a range body asks for; it returns what has arrived."""
PROGRESS_STEP_BYTES = 4 << 20
"""Bytes a range reports to the progress callback at once (and at its end)."""
ANSWER_MAX_BYTES = 64 << 10
"""The most bytes of an error answer read (its message is all a store's error needs)."""
_REFERENCE_WRITE_ATTEMPTS = 3
"""Conditional writes of a name tried while other writers keep changing it."""

Sink = Callable[[int, bytes], object]
"""``sink(offset_bytes, chunk)``: the bytes ``[offset_bytes, offset_bytes + len(chunk))`` of the object have landed."""


@dataclass(frozen=True, slots=True)
class ObjectStat:
    """An object's size and what pins every ranged read to it (S3, Azure: ``ETag``; GCS: generation; OCI: ``None``)."""

    size_bytes: int
    version: str | int | None = None


class _Signal(Exception):
    """Between the ranges of one transfer, never out of :class:`RangedStore`."""


class _RangeIgnored(_Signal):
    """A ranged GET was answered with the whole object (``200``)."""


class _Stopped(_Signal):
    """Another range of the same transfer failed: this one stops at its next chunk."""


def failure_kind(exc: BaseException) -> str | None:
    """``"refused"`` for a connection refused in ``exc``'s chain (asked first: urllib3's ``NewConnectionError``
    subclasses its ``ConnectTimeoutError``), else ``"connect"`` or ``"read"`` for a client's timeout, else ``None``."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    if any(
        isinstance(e, ConnectionRefusedError)
        or getattr(e, "errno", None) == errno.ECONNREFUSED
        or "connection refused" in str(e).lower()
        for e in chain
    ):
        return "refused"
    for current in chain:
        names = [cls.__name__ for cls in type(current).__mro__]
        if any("ConnectTimeout" in n for n in names):
            return "connect"
        if any("Timeout" in n for n in names) or "timed out" in str(current).lower():
            return "read"
    return None


def class_named(exc: BaseException, *names: str) -> bool:
    """Whether the class of ``exc`` or a base of it is named one of ``names`` (a client's exception, not imported)."""
    return any(cls.__name__ in names for cls in type(exc).__mro__)


def request_failure(
    name: str,
    action: str,
    exc: BaseException,
    client: StoreClientSettings,
    *,
    where: str,
    attempts_from: tuple[int, str] | None = None,
) -> StoreError:
    """The :class:`StoreError` of a failed request of store ``name``, naming for a timeout the timeout, its variable
    and the attempts (``attempts_from``: ``(attempts, their source)`` other than ``COLDSNAP_STORE_RETRIES``)."""
    message = str(exc).splitlines()[0] if str(exc) else ""
    text = f"{name}: {action} failed: {type(exc).__name__}: {message}"
    kind = failure_kind(exc)
    if kind == "refused":
        return StoreError(
            f"{text} (the connection was refused at once: nothing listens at the store's address)",
            file=where,
            remedy="check the store's endpoint and port, and that the store is running",
        )
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
    """``[(start, end), ...]`` covering ``[0, size_bytes)`` (end exclusive)."""
    return [(start, min(start + step_bytes, size_bytes)) for start in range(0, size_bytes, step_bytes)]


def read1_chunks(raw: Any) -> Iterator[bytes]:
    """The body of a urllib3 response (boto3's, requests') as it arrives: what each socket read brought."""
    return iter(lambda: raw.read1(READ_CHUNK_BYTES, decode_content=False), b"")


class _Pace:
    """The pace one body must keep: the minimum rate over every read-timeout window from its first byte on, its end
    within the range deadline per 64 MiB from the request on."""

    def __init__(self, store: RangedStore, where: str, what: str, length_bytes: int) -> None:
        self._store, self._where, self._what, self._length = store, where, what, length_bytes
        self.started_s = time.monotonic()
        self._deadline_s = store.client_settings.range_deadline_s * max(1.0, length_bytes / RANGE_SIZE_BYTES)
        self._window_start_s: float | None = None
        self._window_bytes = self.done_bytes = 0

    def add(self, n: int) -> None:
        """``n`` more bytes arrived; ``StoreError`` past the deadline or under the minimum rate."""
        limits, now = self._store.client_settings, time.monotonic()
        self.done_bytes += n
        self._window_bytes += n
        if self._window_start_s is None:
            self._window_start_s, self._window_bytes = now, 0
        if now - self.started_s > self._deadline_s:
            rate = self.done_bytes / (now - self.started_s)
            self._fail(f"{rate:,.0f} bytes/s, not all within {self._deadline_s:g} s ({STORE_RANGE_DEADLINE_ENV})")
        window_s = now - self._window_start_s
        if window_s >= limits.read_timeout_s:
            rate = self._window_bytes / window_s
            if rate < limits.min_rate_bytes_per_s:
                self._fail(
                    f"{rate:,.0f} bytes/s over the last {window_s:.1f} s, under the minimum of"
                    f" {limits.min_rate_bytes_per_s:g} bytes/s ({STORE_MIN_RATE_ENV})"
                )
            self._window_start_s, self._window_bytes = now, 0

    def _fail(self, why: str) -> None:
        raise StoreError(
            f"{self._store.name}: {self._what} came at {why}; {self.done_bytes} of {self._length} bytes arrived",
            file=self._where,
        )


def read_answer(store: RangedStore, where: str, chunks: Iterable[bytes], max_bytes: int = ANSWER_MAX_BYTES) -> bytes:
    """At most ``max_bytes + 1`` bytes of a small answer (an error's message, a manifest, a token), at a range's pace."""
    pace, body = _Pace(store, where, "an answer", max_bytes), bytearray()
    for chunk in chunks:
        body += chunk[: max_bytes + 1 - len(body)]
        if len(body) > max_bytes:
            break
        pace.add(len(chunk))
    return bytes(body)


def pwrite_sink(fd: int, file: Path, landed: LandedCallback | None = None) -> Sink:
    """A sink writing each chunk at its offset of ``fd`` (``file``), then calling ``landed(offset_bytes, size_bytes)``;
    raises ``InsufficientSpaceError`` (the file system filled up), ``StoreError`` or what ``landed`` raises."""

    def write(offset: int, chunk: bytes) -> None:
        view, start = memoryview(chunk), offset
        while view:
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as exc:
                if exc.errno in SPACE_ERRNOS:
                    raise InsufficientSpaceError(f"fetch failed at byte {offset}: {os.strerror(exc.errno)}", file=file) from exc
                raise StoreError(f"writing the fetched bytes at {offset} failed: {exc}", file=file) from exc
            view, offset = view[n:], offset + n
        if landed is not None:
            landed(start, len(chunk))

    return write


class RangedStore(ReferenceIndex, ABC):
    """An object store that serves byte ranges; ``name`` is for logs and errors (``s3 bucket/prefix``). Raises
    ``ConfigurationError`` for a size or concurrency under 1."""

    conditional_create = True  # the store can create an object only if absent; else presence is checked first
    hash_before_sending = False  # hash the file before the first byte is sent (the store cannot take bytes back)
    replacement_refused: str | None = None  # the advice of a store that never replaces an object it holds
    prefix = ""  # the key prefix under the bucket or container, without leading or trailing "/"
    url = ""  # what location() puts before an object's key (s3://bucket)

    def __init__(
        self, name: str, *, range_size_bytes: int, concurrency: int, client_settings: StoreClientSettings | None
    ) -> None:
        if range_size_bytes <= 0 or concurrency <= 0:
            raise ConfigurationError(f"{name}: the chunk size ({range_size_bytes}) and concurrency ({concurrency}) must be > 0")
        self.name = name
        self.range_size_bytes = range_size_bytes
        self.concurrency = concurrency
        self.client_settings = client_settings or StoreClientSettings()
        for logger_name in CLIENT_LOGGERS:  # adding the same filter again is a no-op
            logging.getLogger(logger_name).addFilter(_redact_record)

    def key(self, obj: str | StoreObject) -> str:
        """``<prefix>/<relpath>`` of ``obj``; a digest is validated first."""
        relpath = as_object(obj).relpath
        return f"{self.prefix}/{relpath}" if self.prefix else relpath

    def location(self, obj: str | StoreObject) -> str:
        return f"{self.url}/{self.key(obj)}"

    @abstractmethod
    def stat(self, obj: StoreObject) -> ObjectStat | None:
        """The object's size and version, or ``None``; ``StoreError`` when the bucket or container does not exist."""

    @abstractmethod
    def open_range(
        self, obj: StoreObject, stat: ObjectStat, start: int, end: int
    ) -> contextlib.AbstractContextManager[tuple[Iterable[bytes], bool]]:
        """One GET of bytes ``[start, end)`` pinned to ``stat.version``, yielding ``(chunks, whole)`` (``200``: whole);
        ``PayloadUnavailableError``: the object is gone; ``StoreError``: it changed, or the store refused or failed."""

    @abstractmethod
    def create(
        self, path: Path, obj: StoreObject, size_bytes: int, progress: ProgressCallback | None, replacing: ObjectStat | None
    ) -> bool:
        """Write ``path`` as the object only if absent (``replacing`` ``None``), else only if it is still
        ``replacing``; ``False`` when that failed. Raises ``PackDigestMismatchError``/``PackSizeMismatchError`` (the
        file changed after verification: nothing committed) or ``StoreError``."""

    def failure(self, action: str, obj: str | StoreObject, exc: BaseException) -> StoreError:
        """The :class:`StoreError` of ``exc``, raised by the client while ``action``."""
        return request_failure(self.name, action, exc, self.client_settings, where=self.location(obj))

    def missing(self, what: str, obj: str | StoreObject) -> StoreError:
        """The :class:`StoreError` of a bucket or container (``what``) that does not exist."""
        return StoreError(
            f"{self.name}: the {what} does not exist (coldsnap never creates one; check the payload store setting)",
            file=self.location(obj),
        )

    @contextlib.contextmanager
    def typed(self, action: str, obj: str | StoreObject) -> Iterator[None]:
        """Anything but a ``ColdsnapError`` raised in the block becomes :meth:`failure`."""
        try:
            yield
        except (ColdsnapError, _Signal):
            raise
        except Exception as exc:
            raise self.failure(action, obj, exc) from exc

    def has(self, obj: str | StoreObject, size_bytes: int | None = None, *, verify: bool = False) -> bool:
        """:meth:`stat`, by size; ``verify`` hashes the object in full (S3's checksum is composite for a multipart
        object, a registry does not re-hash what it serves)."""
        obj = as_object(obj)
        with self.typed(f"looking up the {obj.what}", obj):
            stat = self.stat(obj)
        if stat is None:
            return False
        where = self.location(obj)
        if wrong_size(obj, stat.size_bytes, size_bytes, file=where):
            return False
        if verify and (hashed := self._hash(obj, stat)) != obj.sha256:
            logger.warning("coldsnap: %s hashes to %s, not its name; treating it as absent", where, hashed)
            return False
        return True

    def fetch(
        self,
        obj: str | StoreObject,
        size_bytes: int,
        fd: int,
        *,
        file: Path,
        progress: ProgressCallback | None = None,
        landed: LandedCallback | None = None,
    ) -> None:
        """:meth:`stat` (a wrong size is ``PackSizeMismatchError`` before a byte is read), then :meth:`transfer`."""
        obj = as_object(obj)
        with self.typed(f"looking up the {obj.what}", obj):
            stat = self.stat(obj)
        where = self.location(obj)
        if stat is None:
            raise PayloadUnavailableError(f"{self.name} does not hold the {obj.what}", file=where, remedy=NOT_IN_STORE_REMEDY)
        if mismatch := size_mismatch(PackSizeMismatchError, f"stored {obj.what}", stat.size_bytes, size_bytes, file=where):
            raise mismatch
        started = time.monotonic()
        self.transfer(obj, stat, pwrite_sink(fd, file, landed), progress)
        seconds = max(time.monotonic() - started, 1e-9)
        logger.info("coldsnap: fetched %s: %d bytes in %.2f s, %.3f GB/s", where, size_bytes, seconds, size_bytes / seconds / 1e9)

    def transfer(self, obj: StoreObject, stat: ObjectStat, sink: Sink, progress: ProgressCallback | None = None) -> None:
        """Every byte of the object to ``sink``: the ranges in parallel, or the whole object once (``Range`` ignored)."""
        lock = threading.Lock()

        def tick(n: int) -> None:
            if progress is not None:
                with lock:
                    progress(n)

        stop, errors = threading.Event(), []  # the first error stops the other ranges at their next chunk

        def one(r: tuple[int, int]) -> None:
            try:
                if not stop.is_set():
                    self._read_range(obj, stat, r[0], r[1], sink, tick, stop)
            except BaseException as exc:
                errors.extend([] if isinstance(exc, _Stopped) else [exc])
                stop.set()

        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            list(pool.map(one, byte_ranges(stat.size_bytes, self.range_size_bytes)))
        if errors and not isinstance(errors[0], _RangeIgnored):
            raise errors[0]
        if errors:
            logger.warning(
                "coldsnap: %s ignores Range (a ranged GET was answered with the whole object); reading %s once, in one stream",
                self.name,
                self.location(obj),
            )
            self._read_range(obj, stat, 0, stat.size_bytes, sink, tick)

    def _read_range(
        self,
        obj: StoreObject,
        stat: ObjectStat,
        start: int,
        end: int,
        sink: Sink,
        progress: Callable[[int], object],
        stop: threading.Event | None = None,
    ) -> None:
        """Stream bytes ``[start, end)`` into ``sink`` at the pace :class:`_Pace` keeps; ``PackSizeMismatchError`` for a
        body longer or shorter than the range, ``_RangeIgnored`` for the whole object sent for a part."""
        where, length, unreported = self.location(obj), end - start, 0
        pace = _Pace(self, where, f"bytes {start}-{end - 1}", length)
        with self.typed(f"reading bytes {start}-{end - 1}", obj), self.open_range(obj, stat, start, end) as (chunks, whole):
            if whole and (start, end) != (0, stat.size_bytes):
                raise _RangeIgnored
            for chunk in chunks:
                if pace.done_bytes + len(chunk) > length:
                    raise PackSizeMismatchError(
                        f"ranged read of bytes {start}-{end - 1} returned more than {length} bytes (a store or proxy that"
                        " does not keep to the range, or the object changed size)",
                        file=where,
                        offset_bytes=start,
                    )
                if stop is not None and stop.is_set():
                    raise _Stopped
                sink(start + pace.done_bytes, chunk)
                pace.add(len(chunk))
                unreported += len(chunk)
                if unreported >= PROGRESS_STEP_BYTES:
                    progress(unreported)
                    unreported = 0
        if pace.done_bytes != length:
            raise PackSizeMismatchError(
                f"ranged read of bytes {start}-{end - 1} returned {pace.done_bytes} bytes (the object changed size)",
                file=where,
                offset_bytes=start,
            )
        if unreported:
            progress(unreported)

    def _read_bytes(self, obj: StoreObject, stat: ObjectStat, start: int, end: int) -> bytearray:
        data = bytearray(end - start)

        def land(offset: int, chunk: bytes) -> None:
            data[offset - start : offset - start + len(chunk)] = chunk

        self._read_range(obj, stat, start, end, land, lambda n: None)
        return data

    def _hash(self, obj: StoreObject, stat: ObjectStat) -> str:
        """The object's SHA-256: ranges read in parallel, hashed in order (or one stream where ``Range`` is ignored)."""
        h = hashlib.sha256()
        try:
            pending: collections.deque[concurrent.futures.Future[bytearray]] = collections.deque()
            with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
                for start, end in byte_ranges(stat.size_bytes, self.range_size_bytes):
                    pending.append(pool.submit(self._read_bytes, obj, stat, start, end))
                    if len(pending) >= self.concurrency:
                        h.update(pending.popleft().result())
                while pending:
                    h.update(pending.popleft().result())
        except _RangeIgnored:
            h = hashlib.sha256()
            self._read_range(obj, stat, 0, stat.size_bytes, lambda _offset, chunk: h.update(chunk), lambda n: None)
        return h.hexdigest()

    def _intact(self, obj: StoreObject, size_bytes: int, stat: ObjectStat | None) -> bool:
        return stat is not None and stat.size_bytes == size_bytes and self._hash(obj, stat) == obj.sha256

    def upload(self, path: Path, obj: str | StoreObject, size_bytes: int, *, progress: ProgressCallback | None = None) -> bool:
        """A conditional create (``docs/format.md`` §12.4): an object already there is hashed in full: the digest's
        bytes are kept (``False``), anything else replaced conditionally on its version or refused (``StoreError``).
        ``PackSizeMismatchError``/``PackDigestMismatchError``: ``path`` is not the digest's bytes (nothing published)."""
        obj = as_object(obj)
        if mismatch := size_mismatch(PackSizeMismatchError, "the file to upload", os.path.getsize(path), size_bytes, file=path):
            raise mismatch
        where, digest = self.location(obj), obj.sha256
        with self.typed(f"uploading the {obj.what}", obj):
            existing = None if self.conditional_create else self.stat(obj)
            if existing is None:
                if self.hash_before_sending:
                    with hashing_reader(path, digest, size_bytes, None) as reader:
                        while reader.read(8 << 20):
                            pass
                if self.create(path, obj, size_bytes, progress, None):
                    logger.info("coldsnap: uploaded %s to %s", where, self.name)
                    return True
                existing = self.stat(obj)
            if self._intact(obj, size_bytes, existing):
                logger.info("coldsnap: %s is already in %s; not uploaded again", where, self.name)
                return False
            if self.replacement_refused is not None:
                raise StoreError(
                    f"{self.name} holds other bytes under sha256:{digest} ({existing.size_bytes if existing else 0} bytes):"
                    f" {self.replacement_refused}",
                    file=where,
                )
            logger.warning("coldsnap: %s exists but is not the digest's bytes; replacing it", where)
            if not self.create(path, obj, size_bytes, progress, existing):
                # another publisher replaced it first: the digest's bytes there now are present (docs/format.md §12.4)
                if self._intact(obj, size_bytes, self.stat(obj)):
                    logger.info("coldsnap: %s was repaired by another publisher; not uploaded again", where)
                    return False
                raise StoreError(f"{self.name}: the object changed while a corrupt copy was replaced", file=where)
        logger.info("coldsnap: replaced %s in %s", where, self.name)
        return True

    def put_reference(self, relpath: str, data: bytes) -> None:
        """Make ``relpath`` hold ``data`` (conditionally, retried while others change it); ``StoreError`` if it kept changing."""
        obj = StoreObject(relpath, hashlib.sha256(data).hexdigest())
        with tempfile.TemporaryDirectory(prefix="coldsnap-ref-") as scratch, self.typed("writing the name", obj):
            path = Path(scratch) / "ref.json"
            path.write_bytes(data)
            existing: ObjectStat | None = None
            for _ in range(_REFERENCE_WRITE_ATTEMPTS):
                if existing is not None and self._intact(obj, len(data), existing):
                    return
                if self.create(path, obj, len(data), None, existing):
                    return
                existing = self.stat(obj)
        raise StoreError(f"{self.name}: the name kept changing while it was written", file=self.location(obj))

    def get_reference(self, relpath: str, max_bytes: int) -> bytes | None:
        """The bytes of ``relpath``, or ``None``; ``StoreError`` when the store failed or it is over ``max_bytes``."""
        obj = StoreObject(relpath, "")
        with self.typed("reading the name", obj):
            stat = self.stat(obj)
        if stat is None:
            return None
        if stat.size_bytes > max_bytes:
            raise StoreError(f"{self.name}: the name is {stat.size_bytes} bytes, over {max_bytes}", file=self.location(obj))
        if not stat.size_bytes:
            return b""
        return bytes(self._read_bytes(obj, stat, 0, stat.size_bytes))


def _redact_record(record: logging.LogRecord) -> bool:
    """A log filter rewriting a record's message with :func:`redact_store_spec` (a presigned URL or a SAS)."""
    record.msg, record.args = redact_store_spec(record.getMessage()), None
    return True


CLIENT_LOGGERS = ("httpx", "httpcore.http11", "httpcore.connection", "urllib3.connectionpool")
"""The loggers of the store clients' HTTP layers that write URLs or response headers."""


@contextlib.contextmanager
def hashing_reader(path: Path, digest: str, size_bytes: int, progress: Callable[[int], object] | None) -> Iterator[HashingReader]:
    """A :class:`HashingReader` whose refusal is raised as itself, not as the client's wrapping."""
    reader = HashingReader(path, digest, size_bytes, progress)
    try:
        yield reader
    except Exception as exc:
        cause = exc.__cause__ or exc.__context__
        if not isinstance(exc, ColdsnapError) and isinstance(cause, PackDigestMismatchError | PackSizeMismatchError):
            raise cause from exc
        raise
    finally:
        reader.close()


class HashingReader:
    """A file object over the first ``size_bytes`` of ``path`` whose read reaching the end raises when the SHA-256 is
    not ``digest`` (so the request completing the upload is never sent)."""

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
