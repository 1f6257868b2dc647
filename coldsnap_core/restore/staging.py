"""Staging: make a worker's pack available, verified, in the node-local cache (``docs/format.md`` §12.4). The cache
first; else the payload store, fetched under the digest's lock into a temporary hashed as it lands (:class:`LandedHash`)
and, in a restore, checked and copied into the allocations as it lands (:class:`LandedFill`), committed only when its
SHA-256 is its name. A store object that does not verify is reported as the store's (:meth:`PayloadStore.location`).
Every path is derived from the digest alone."""

from __future__ import annotations

import bisect
import hashlib
import heapq
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from coldsnap_core._io import HASH_CHUNK_BYTES, os_error
from coldsnap_core._progress import ProgressLines
from coldsnap_core.artifact.capsules import find_worker, read_descriptor, read_worker_capsule
from coldsnap_core.cache.payload_cache import ExtentOwner, PayloadCache
from coldsnap_core.copy.base import CopyOp
from coldsnap_core.digests import check_digest, pack_relpath
from coldsnap_core.errors import (
    CacheError,
    ExtentDigestMismatchError,
    IntegrityError,
    MissingObjectError,
    PackDigestMismatchError,
    PackPathMismatchError,
    PayloadUnavailableError,
    StoreError,
)
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, WorkerEntry
from coldsnap_core.format.manifest import PackRef, WorkerIdentity
from coldsnap_core.format.pack_layout import PackLayout
from coldsnap_core.format.verify import check_pack_padding, verify_pack_file
from coldsnap_core.stores.base import PayloadStore

logger = logging.getLogger(__name__)

__all__ = ["FillAsLanded", "stage_payload", "worker_entries"]

FETCH_NOTICE_INTERVAL_S = 10.0
"""Seconds a fetch may go without writing a byte before an INFO line says what it waits for (and again after each)."""


def _check_pack_ref(pack: PackRef, *, file: str | os.PathLike[str] | None = None) -> None:
    """The digest's form (rule 22), then the pack path derived from it (rule 13); ``file`` names ``pack``."""
    check_digest(pack.sha256)
    if pack.path != pack_relpath(pack.sha256):
        raise PackPathMismatchError(
            f"pack path {pack.path!r} is not the path of its SHA-256 ({pack_relpath(pack.sha256)!r})",
            file=pack.path if file is None else file,
        )


def stage_payload(
    pack: PackRef,
    *,
    cache: PayloadCache,
    store: PayloadStore | None = None,
    progress: Callable[[int], object] | None = None,
    fetched: Callable[[int], object] | None = None,
    layout: PackLayout | None = None,
    extent_owner: ExtentOwner | None = None,
    fill: FillAsLanded | None = None,
) -> Path:
    """The admitted object path of ``pack`` in ``cache`` (verified by its record or a full hash), fetched from ``store``
    (``None``: nowhere) when missing or corrupt (quarantined). ``progress``, ``fetched``: get the bytes of each chunk
    hashed, and written by the store (one call at a time); ``layout``, ``extent_owner``: a fetched object that does
    not hash to its name is refused naming its first bad extent or padding byte; ``fill``: with ``layout``, a fetch
    fills the allocations as the pack lands (sets ``fill.filled``).

    Raises:
        InvalidDigestError, PackPathMismatchError: a malformed digest, or a path not derived from it (nothing touched).
        PayloadUnavailableError: neither the cache nor the store has the pack.
        StoreError: the pack is not cached and the store did not answer or failed.
        IntegrityError: the cached object is corrupt and no store is configured (quarantined), or the store's object
            does not verify (naming it; nothing is kept; with ``fill``, the allocations are partly written).
        InsufficientSpaceError, UnsafePathError: the cache's file system filled up during a fetch (nothing is
            kept); a symbolic link at an object, record or lock path or a cache folder.
    """
    _check_pack_ref(pack)
    digest = pack.sha256
    try:
        return cache.admit(digest, pack.size_bytes, progress=progress)
    except MissingObjectError:
        pass
    except IntegrityError as exc:
        if store is None:
            raise
        logger.warning("coldsnap: cached pack %s is corrupt (%s); fetching it again from %s", digest, exc.detail, store.name)
    if store is None:
        raise PayloadUnavailableError(
            "the pack is not in the node-local cache and no payload store is configured "
            "(set COLDSNAP_PAYLOAD_DIR or COLDSNAP_PAYLOAD_REPO)",
            file=cache.object_path(digest),
        )
    with cache.lock(digest, required=True):
        try:
            return cache.admit_locked(digest, pack.size_bytes, progress=progress)
        except (MissingObjectError, IntegrityError):
            pass  # absent, or corrupt and now quarantined: fetch it
        return _fetch(pack, cache, store, progress, fetched, layout, extent_owner, fill)


@contextmanager
def _fetch_watch(
    pack: PackRef, store: PayloadStore, progress: Callable[[int], object] | None, fetched: Callable[[int], object] | None
) -> Iterator[tuple[Callable[[int], object], Callable[[int], object]]]:
    """``(counted, hashed)`` callbacks (bytes written, to ``fetched``; hashed, to ``progress``), one call at a time across
    both; meanwhile progress lines, and one line after every :data:`FETCH_NOTICE_INTERVAL_S` without a byte written."""
    written = [0, time.monotonic()]  # bytes so far, monotonic time of the last bytes
    lock = threading.Lock()
    done = threading.Event()
    started = time.monotonic()
    lines = ProgressLines(f"coldsnap: fetching pack {pack.sha256} from {store.name}", pack.size_bytes, logger.info)
    lines.update(0)  # its first line now: the fetch starts, whenever its first bytes come

    def counted(n: int) -> None:
        with lock:  # a ranged store reports from several threads; the counts and the progress line are updated once each
            written[0] += n
            written[1] = time.monotonic()
            lines.update(n)
            if fetched is not None:
                fetched(n)

    def hashed(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    def watch() -> None:
        while not done.wait(FETCH_NOTICE_INTERVAL_S):
            with lock:
                so_far, last = written
            quiet_s = time.monotonic() - last
            if quiet_s >= FETCH_NOTICE_INTERVAL_S:
                logger.info(
                    "coldsnap: still fetching pack %s from %s: %d of %d bytes after %.0f s, none in the last %.0f s"
                    " (waiting for the store to send more, or for its client's timeout)",
                    pack.sha256,
                    store.name,
                    so_far,
                    pack.size_bytes,
                    time.monotonic() - started,
                    quiet_s,
                )

    watcher = threading.Thread(target=watch, name=f"coldsnap-fetch-watch-{pack.sha256[:12]}", daemon=True)
    watcher.start()
    try:
        yield counted, hashed
    finally:
        done.set()
        watcher.join()
        lines.close()


class LandedHash:
    """The SHA-256 of a file being fetched (``path``, ``size_bytes`` long), computed on its own thread in file order as
    the landed prefix grows (``docs/format.md`` §12.4); :meth:`landed` gets each written span, ``progress`` the bytes hashed."""

    def __init__(self, path: Path, size_bytes: int, progress: Callable[[int], object]) -> None:
        self._path, self._size_bytes, self._progress = path, size_bytes, progress
        self._changed = threading.Condition()
        self._prefix_bytes = 0
        self._beyond: list[tuple[int, int]] = []  # a heap of landed (start, end) spans past the prefix
        self._closed = self._abandoned = False
        self._result: str | BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"coldsnap-sha256-{path.name[:12]}", daemon=True)
        self._thread.start()

    def landed(self, offset_bytes: int, size_bytes: int) -> None:
        """``[offset_bytes, offset_bytes + size_bytes)`` is written (spans overlap when a server ignores ``Range``)."""
        with self._changed:
            heapq.heappush(self._beyond, (offset_bytes, offset_bytes + size_bytes))
            prefix = self._prefix_bytes
            while self._beyond and self._beyond[0][0] <= prefix:
                prefix = max(prefix, heapq.heappop(self._beyond)[1])
            if prefix != self._prefix_bytes:
                self._prefix_bytes = prefix
                self._changed.notify()

    def close(self, *, abandon: bool = False) -> None:
        """The fetch is over: wait until the thread has hashed what landed (``abandon``: stop it at its next read)."""
        with self._changed:
            self._closed, self._abandoned = True, abandon
            self._changed.notify()
        self._thread.join()

    def result(self) -> str:
        """The SHA-256 (hex) once closed; raises FileAccessError (a read failed) or CacheError (not every byte landed)."""
        self.close()
        if isinstance(self._result, BaseException):
            raise self._result
        if self._result is None:
            raise CacheError(f"only {self._prefix_bytes} of {self._size_bytes} bytes landed", file=self._path)
        return self._result

    def _run(self) -> None:
        digest, done = hashlib.sha256(), 0
        buffer = memoryview(bytearray(HASH_CHUNK_BYTES))
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                while done < self._size_bytes:
                    with self._changed:
                        while self._prefix_bytes <= done and not self._closed:
                            self._changed.wait()
                        prefix = self._prefix_bytes
                    if prefix <= done:
                        return  # closed before every byte landed: the fetch failed, no hash
                    while done < prefix:
                        if self._abandoned:
                            return
                        n = os.preadv(fd, [buffer[: min(len(buffer), prefix - done)]], done)
                        if n == 0:
                            raise CacheError(f"the file ends at byte {done}, {prefix} bytes landed", file=self._path)
                        digest.update(buffer[:n])
                        done += n
                        self._progress(n)
            finally:
                os.close(fd)
        except OSError as exc:
            self._result = os_error(f"hashing the fetched pack at offset {done} failed", exc, self._path)
            return
        except CacheError as exc:
            self._result = exc
            return
        self._result = digest.hexdigest()


@dataclass
class FillAsLanded:
    """What a one-pass fetch fills as the pack lands (:class:`LandedFill`): the model extents' ``ops`` and ``fill(ops,
    pack_path)``, a copy backend's ``fill`` with ``verify_extents=True``. ``filled``: committed with every op copied."""

    ops: Sequence[CopyOp]
    fill: Callable[[Sequence[CopyOp], Path], object]
    filled: bool = False


class LandedFill:
    """Checks and copies a pack as it is fetched into ``path`` (``docs/format.md`` §12.4): each stored extent of
    ``layout`` once it has landed (the ops ready together in one ``fill`` call), each padding run checked zero. Runs on
    its own thread; the first failure stops it, and every later :meth:`landed` raises it, which stops the fetch."""

    def __init__(self, path: Path, layout: PackLayout, fill: FillAsLanded) -> None:
        by_offset: dict[int, list[CopyOp]] = {}
        for op in fill.ops:
            by_offset.setdefault(op.source_offset_bytes, []).append(op)
        # (start, end, ops of the stored extent there; None: a padding run), in pack order
        self._pending: list[tuple[int, int, list[CopyOp] | None]] = sorted(
            [(e.offset_bytes, e.end_bytes, by_offset.get(e.offset_bytes, [])) for e in layout.entries]
            + [(start, start + size, None) for start, size in layout.padding_ranges()]
        )
        self._path, self._layout, self._fill = path, layout, fill.fill
        self._spans: list[tuple[int, int]] = []  # landed, merged, sorted
        self._new: list[tuple[int, int]] = []
        self._changed = threading.Condition()
        self._closed = self._abandoned = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"coldsnap-fill-{path.name[:12]}", daemon=True)
        self._thread.start()

    def landed(self, offset_bytes: int, size_bytes: int) -> None:
        """Bytes ``[offset_bytes, offset_bytes + size_bytes)`` are written. Raises the first failure found so far."""
        with self._changed:
            if self.error is not None:
                raise self.error
            self._new.append((offset_bytes, offset_bytes + size_bytes))
            self._changed.notify()

    def close(self, *, abandon: bool = False) -> None:
        """The fetch is over: wait until what landed is checked and copied (``abandon``: stop before the next batch).

        Raises (not with ``abandon``):
            ExtentDigestMismatchError, NonZeroPaddingError: an extent's SHA-256 or a padding byte does not match.
            CacheError, CopyBackendError: the fetch ended before every extent landed; a copy failed.
        """
        with self._changed:
            self._closed, self._abandoned = True, abandon
            self._changed.notify()
        self._thread.join()
        if abandon:
            return
        if self.error is not None:
            raise self.error
        if self._pending:
            raise CacheError(f"the fetch ended with the pack range from offset {self._pending[0][0]} not landed", file=self._path)

    def _run(self) -> None:
        try:
            while self._pending:
                with self._changed:
                    while not self._new and not self._closed:
                        self._changed.wait()
                    new, self._new = self._new, []
                    if self._abandoned or not new:
                        return
                spans = self._spans = _merged(self._spans + new)
                starts = [start for start, _ in spans]
                ready, waiting = [], []
                for item in self._pending:
                    (ready if _covered(spans, starts, item[0], item[1]) else waiting).append(item)
                self._pending = waiting
                padding = [(start, end - start) for start, end, ops in ready if ops is None]
                if padding:
                    check_pack_padding(self._path, self._layout, padding)
                ops = [op for _, _, extent_ops in ready if extent_ops for op in extent_ops]
                if ops:
                    try:
                        self._fill(ops, self._path)
                    except ExtentDigestMismatchError as exc:
                        where = (exc.allocation, exc.offset_bytes)
                        op = next((op for op in ops if (op.allocation_index, op.offset_bytes) == where), None)
                        if op is None:
                            raise
                        raise ExtentDigestMismatchError(
                            f"the extent stored at pack offset {op.source_offset_bytes} ({op.size_bytes} bytes) does not"
                            f" match the manifest: {exc.detail}",
                            file=exc.file,
                            allocation=exc.allocation,
                            offset_bytes=exc.offset_bytes,
                        ) from exc
        except BaseException as exc:  # handed to the fetch's threads by landed() and close()
            with self._changed:
                self.error = exc


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` as sorted, disjoint, non-touching spans."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(spans: list[tuple[int, int]], starts: list[int], start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies within one of the merged ``spans`` (whose starts are ``starts``)."""
    i = bisect.bisect_right(starts, start) - 1
    return i >= 0 and spans[i][1] >= end


def _fetch(
    pack: PackRef,
    cache: PayloadCache,
    store: PayloadStore,
    progress: Callable[[int], object] | None,
    fetched: Callable[[int], object] | None,
    layout: PackLayout | None,
    extent_owner: ExtentOwner | None,
    fill: FillAsLanded | None = None,
) -> Path:
    """Under the digest's lock: fetch ``pack`` into a temporary, hashed (and with ``fill`` and ``layout``, filled) as it
    lands; commit it with the validation record of that hash when it is the pack's name, else raise keeping nothing."""
    digest = pack.sha256
    started = time.monotonic()
    with cache.temporary(digest) as (fd, temp):
        try:
            with _fetch_watch(pack, store, progress, fetched) as (counted, hashed):
                hasher = LandedHash(temp, pack.size_bytes, hashed)
                filler = LandedFill(temp, layout, fill) if fill is not None and layout is not None else None

                def landed(offset_bytes: int, size_bytes: int) -> None:
                    hasher.landed(offset_bytes, size_bytes)
                    if filler is not None:
                        filler.landed(offset_bytes, size_bytes)

                try:
                    store.fetch(digest, pack.size_bytes, fd, file=temp, progress=counted, landed=landed)
                    if filler is not None:
                        filler.close()
                except BaseException as exc:
                    hasher.close(abandon=True)
                    if filler is not None:
                        filler.close(abandon=True)
                        if filler.error is not None and filler.error is not exc:
                            raise filler.error from exc  # the store stopped on it: report the check that failed
                    raise
                hasher.close()
        except StoreError as exc:
            raise StoreError(
                f"the pack is not in the node-local cache and cannot be fetched: {exc.detail}",
                file=exc.file,
                remedy=exc.remedy,
            ) from exc
        except IntegrityError as exc:
            if exc.file != str(temp):
                raise  # the store's own check (a truncated or extended object) names its object already
            where = f"checked as it landed in the cache temporary {temp}"
            raise _store_copy_error(
                exc, store, digest, f"{where}; nothing was kept, and the allocations it was copied into are not restored"
            ) from exc
        sha256 = hasher.result()
        if sha256 != digest:
            _refuse_fetched(pack, store, temp, sha256, layout, extent_owner, every_extent_verified=filler is not None)
        path = cache.commit(fd, temp, sha256=sha256, size_bytes=pack.size_bytes, expected_sha256=digest)
    seconds = max(time.monotonic() - started, 1e-9)
    if fill is None or filler is None:
        logger.info("coldsnap: staged pack %s from %s (hashed as it landed)", digest, store.name)
        return path
    fill.filled = True
    logger.info(
        "coldsnap: staged pack %s from %s in one pass (hashed as it landed; every extent checked and copied into the"
        " allocations as it landed): %d bytes in %.2f s, %.3f GB/s",
        digest,
        store.name,
        pack.size_bytes,
        seconds,
        pack.size_bytes / seconds / 1e9,
    )
    return path


def _refuse_fetched(
    pack: PackRef,
    store: PayloadStore,
    temp: Path,
    sha256: str,
    layout: PackLayout | None,
    extent_owner: ExtentOwner | None,
    *,
    every_extent_verified: bool,
) -> NoReturn:
    """Refuse a fetched temporary whose SHA-256 is ``sha256``, not its name, naming the store's object (after a one-pass
    fetch: the manifest's pack digest is wrong; otherwise read once more to name the first bad extent or padding)."""
    if every_extent_verified:
        raise PackDigestMismatchError(
            f"every extent of {store.name}'s copy of the pack matched its SHA-256 in the manifest, its padding is zero"
            f" and its size exact, but its SHA-256 is {sha256}, not the manifest's pack digest: the manifest's pack"
            " digest disagrees with its own extents (or the object changed while it landed); nothing was kept",
            file=store.location(pack.sha256),
        )
    try:
        verify_pack_file(temp, pack, layout, extent_owner=extent_owner)
        raise PackDigestMismatchError(f"the fetched pack's SHA-256 is {sha256}, not its name", file=temp)
    except IntegrityError as exc:
        raise _store_copy_error(exc, store, pack.sha256, f"checked in the cache temporary {temp}; nothing was kept") from exc


def _store_copy_error(exc: IntegrityError, store: PayloadStore, digest: str, how: str) -> IntegrityError:
    """``exc``, found in a fetched temporary, as the store's: naming its object and ``how`` it was found."""
    return type(exc)(
        f"{store.name} holds a corrupt copy of the pack: {exc.detail} ({how})",
        file=store.location(digest),
        allocation=exc.allocation,
        offset_bytes=exc.offset_bytes,
    )


def worker_entries(artifact_dir: Path, workers: Sequence[WorkerIdentity]) -> list[WorkerEntry]:
    """The descriptor entries of ``workers``, after checking that each capsule's manifest names the same pack.

    Raises:
        MissingObjectError, ManifestError, CapsulePinMismatchError, ManifestMismatchError: as
            :func:`~coldsnap_core.artifact.capsules.read_worker_capsule` (a capsule names another pack: the latter).
        InvalidDigestError, PackPathMismatchError: ``artifact.json`` names a pack by a malformed digest or path.
    """
    artifact_dir = Path(artifact_dir)
    descriptor = read_descriptor(artifact_dir)
    entries = [find_worker(descriptor, worker) for worker in workers]
    for entry in entries:
        read_worker_capsule(artifact_dir, entry)  # pins, worker and payload (ManifestMismatchError)
        _check_pack_ref(entry.payload, file=artifact_dir / DESCRIPTOR_FILENAME)
    return entries
