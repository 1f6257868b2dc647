"""Staging: make each local worker's pack available, verified, in the node-local cache.

Only the payload assigned to each worker is staged, on the host that owns that worker
(``docs/format.md`` §1 and §12). Order of sources:

1. the node-local cache: a trusted validation record (a few ``stat`` calls), else a full SHA-256 by
   the one verifier under the digest's lock; a corrupt object is quarantined;
2. the configured payload store (:mod:`coldsnap_core.stores`): fetched under the digest's lock into a
   unique temporary file, verified by :func:`coldsnap_core.format.verify.verify_pack_file` (size, then
   SHA-256), committed by :meth:`PayloadCache.commit` (fsync, rename, folder fsync, record);
3. otherwise :class:`~coldsnap_core.errors.PayloadUnavailableError` (no source holds the pack) or
   :class:`~coldsnap_core.errors.StoreError` (the store did not answer or failed); on either,
   ``COLDSNAP_RESTORE=auto`` falls back to the safetensors recovery load (it falls back on every
   coldsnap error).

A store object that does not verify is reported as the store's: the error names the object in the
store (:meth:`PayloadStore.location`), not the cache temporary it was fetched into.

Every path is derived from the digest alone; a :class:`PackRef` whose ``path`` is not
``model-payloads/sha256/<sha256>.pack`` is refused before anything is read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from coldsnap_core._progress import ProgressLines
from coldsnap_core.artifact.capsules import find_worker, read_descriptor, read_worker_capsule
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.digests import check_digest, pack_relpath
from coldsnap_core.errors import (
    IntegrityError,
    MissingObjectError,
    PackPathMismatchError,
    PayloadUnavailableError,
    StoreError,
)
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, WorkerEntry
from coldsnap_core.format.manifest import PackRef, WorkerIdentity
from coldsnap_core.format.verify import verify_pack_file
from coldsnap_core.stores.base import PayloadStore

logger = logging.getLogger(__name__)

__all__ = ["stage_artifact", "stage_payload", "worker_entries"]

FETCH_NOTICE_INTERVAL_S = 10.0
"""Seconds a fetch may go without writing a byte before an INFO line says what it waits for (and again
after each further interval): a stalled store is otherwise silent until its client's read timeout and
retries end it, while every other restorer of the digest waits on its lock."""


def _check_pack_ref(pack: PackRef, *, file: str | os.PathLike[str] | None = None) -> None:
    """The digest's form (rule 22), then the pack path derived from it (rule 13); ``file`` is the
    document that names ``pack`` (default: the pack path itself)."""
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
) -> Path:
    """Return the admitted object path of ``pack`` in ``cache``, fetching it from ``store`` if needed.

    Args:
        pack: digest, size (bytes) and derived path of the pack.
        cache: the node-local cache.
        store: where to fetch a missing (or quarantined) pack from; ``None``: the cache only.
        progress: called with a number of bytes after each chunk copied or hashed (a fetch reports
            each byte twice: once copied, once verified).
        fetched: called with a number of bytes after each chunk the store wrote (fetched bytes only; one call
            at a time).

    Returns:
        ``<state-root>/model-payloads/sha256/<sha256>.pack``, verified (record or full hash).

    Raises:
        InvalidDigestError: ``pack.sha256`` is not 64 lowercase hex characters (nothing touched).
        PackPathMismatchError: ``pack.path`` is not derived from the digest (nothing touched).
        PayloadUnavailableError: neither the cache nor the store has the pack; ``auto`` restore
            falls back on this.
        StoreError: the pack is not cached and the store did not answer (unreachable, offline) or
            failed; ``auto`` restore falls back on this too.
        IntegrityError: the cached object is corrupt and no store is configured (it is
            quarantined), or the store's object does not verify (nothing is kept; the error names
            the store object).
        InsufficientSpaceError: the cache's file system filled up during a fetch (nothing is kept).
        UnsafePathError: a symbolic link at an object, record or lock path or a cache folder.
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
        return _fetch(pack, cache, store, progress, fetched)


@contextmanager
def _fetch_watch(
    pack: PackRef, store: PayloadStore, progress: Callable[[int], object] | None, fetched: Callable[[int], object] | None
) -> Iterator[Callable[[int], object]]:
    """A progress callback for ``store.fetch`` that counts the bytes written (and passes them on to
    ``progress`` and ``fetched``) and, while the fetch runs, logs at INFO: a progress line (bytes, GB/s, ETA;
    :class:`coldsnap_core._progress.ProgressLines`) when it starts, at least every 10 s while bytes arrive and when
    it ends, and one line after every :data:`FETCH_NOTICE_INTERVAL_S` without a byte written: the pack, the store,
    the bytes so far and how long nothing arrived."""
    written = [0, time.monotonic()]  # bytes so far, monotonic time of the last bytes
    lock = threading.Lock()
    done = threading.Event()
    started = time.monotonic()
    lines = ProgressLines(f"coldsnap: fetching pack {pack.sha256} from {store.name}", pack.size_bytes, logger.info)

    def counted(n: int) -> None:
        with lock:  # a ranged store reports from several threads; the counts and the progress line are updated once each
            written[0] += n
            written[1] = time.monotonic()
            lines.update(n)
            if fetched is not None:
                fetched(n)
            if progress is not None:
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
        yield counted
    finally:
        done.set()
        watcher.join()
        lines.close()


def _fetch(
    pack: PackRef,
    cache: PayloadCache,
    store: PayloadStore,
    progress: Callable[[int], object] | None,
    fetched: Callable[[int], object] | None,
) -> Path:
    digest = pack.sha256
    with cache.temporary(digest) as (fd, temp):
        try:
            with _fetch_watch(pack, store, progress, fetched) as counted:
                store.fetch(digest, pack.size_bytes, fd, file=temp, progress=counted)
        except StoreError as exc:
            raise StoreError(
                f"the pack is not in the node-local cache and cannot be fetched: {exc.detail}", file=exc.file
            ) from exc
        try:
            verify_pack_file(temp, pack, progress=progress)
        except IntegrityError as exc:
            raise type(exc)(
                f"{store.name} holds a corrupt copy of the pack: {exc.detail} (checked in the cache temporary {temp};"
                " nothing was kept)",
                file=store.location(digest),
                allocation=exc.allocation,
                offset_bytes=exc.offset_bytes,
            ) from exc
        path = cache.commit(fd, temp, sha256=digest, size_bytes=pack.size_bytes, expected_sha256=digest)
    logger.info("coldsnap: staged pack %s from %s", digest, store.name)
    return path


def worker_entries(artifact_dir: Path, workers: Sequence[WorkerIdentity]) -> list[WorkerEntry]:
    """The descriptor entries of ``workers``, after checking that each capsule's manifest names the same pack.

    Raises:
        MissingObjectError: no descriptor, or no capsule for a worker.
        ManifestError: a capsule's manifest is malformed.
        InvalidDigestError, PackPathMismatchError: ``artifact.json`` names a pack by a malformed
            digest or by a path that is not derived from its digest.
        CapsulePinMismatchError: a capsule's manifest does not match its pin in ``artifact.json``.
        ManifestMismatchError: a capsule names another worker or pack than ``artifact.json`` (an
            ``ArtifactError``, exit code 2).
    """
    artifact_dir = Path(artifact_dir)
    descriptor = read_descriptor(artifact_dir)
    entries = [find_worker(descriptor, worker) for worker in workers]
    for entry in entries:
        read_worker_capsule(artifact_dir, entry)  # pins, worker and payload (ManifestMismatchError)
        _check_pack_ref(entry.payload, file=artifact_dir / DESCRIPTOR_FILENAME)
    return entries


def stage_artifact(
    artifact_dir: Path,
    workers: Sequence[WorkerIdentity],
    *,
    cache: PayloadCache,
    store: PayloadStore | None = None,
) -> dict[WorkerIdentity, Path]:
    """Stage the packs of ``workers`` (the workers on this host) from ``artifact_dir``; each digest once.

    Args:
        artifact_dir: the artifact folder (``artifact.json``, ``workers/``).
        workers: the workers whose packs this host needs; other workers' packs are not touched.
        cache: the node-local cache.
        store: the payload store, or ``None``.

    Returns:
        For each worker, the admitted object path of its pack (workers that share a digest share
        the path).

    Raises:
        MissingObjectError: the artifact has no descriptor, or lists no capsule for a worker.
        CapsulePinMismatchError, ManifestMismatchError: as :func:`worker_entries`.
        PayloadUnavailableError, IntegrityError, ...: as :func:`stage_payload`.
    """
    entries = worker_entries(artifact_dir, workers)
    staged: dict[str, Path] = {}
    result: dict[WorkerIdentity, Path] = {}
    for worker, entry in zip(workers, entries, strict=True):
        digest = entry.payload.sha256
        if digest not in staged:
            staged[digest] = stage_payload(entry.payload, cache=cache, store=store)
        result[worker] = staged[digest]
    return result
