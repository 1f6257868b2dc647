"""The packs' life cycle in the node-local cache: a load's hold and the last use (``used/<digest>.use``), removal
and least-recently-used eviction (``docs/format.md`` §10, "Last use and loads in use", "Removal", "Eviction")."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

from coldsnap_core._io import fsync_dir, lstat_or_none, os_error, refuse_symlink
from coldsnap_core.cache.locks import describe_holder
from coldsnap_core.cache.partials import lock_is_free
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.digests import check_digest
from coldsnap_core.errors import CacheError, ColdsnapError, LockTimeoutError, MissingObjectError, PackInUseError
from coldsnap_core.settings import LOCK_TIMEOUT_ENV

logger = logging.getLogger(__name__)

HOLD_POLL_SECONDS = 0.05
"""How often a load retries the shared ``flock`` while a remover holds the exclusive one."""
PROBE_GRACE_SECONDS = 0.5
"""How long a remover asks again for a use file another process's :func:`pack_in_use` probe holds for an instant."""


@dataclass(frozen=True, slots=True)
class PackUsage:
    """One cached pack (``last_used_ns``: :func:`last_used_ns`; ``in_use``: a load held it when it was looked at)."""

    digest: str
    size_bytes: int
    last_used_ns: int
    in_use: bool


@dataclass(frozen=True, slots=True)
class Eviction:
    """What :func:`evict` removed (or, with ``dry_run``, would remove), least recently used first
    (``kept_in_use``: digests due but held by a running load; ``remaining_bytes``: the packs left)."""

    removed: tuple[PackUsage, ...]
    kept_in_use: tuple[str, ...]
    bytes_freed: int
    remaining_bytes: int


def _lock_use_file(cache: PayloadCache, digest: str, operation: int) -> int | None:
    """Take ``flock(operation | LOCK_NB)`` on the use file at its path (opened again when a remover unlinked it
    meanwhile); the descriptor, or ``None`` when another process holds a conflicting ``flock``."""
    path = cache.use_path(digest)
    while True:
        fd = cache.open_use_file(digest)
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            opened, current = os.fstat(fd), lstat_or_none(path)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            return fd
        os.close(fd)


@contextlib.contextmanager
def hold_pack(cache: PayloadCache, digest: str) -> Iterator[bool]:
    """Hold ``digest`` as in use by this load and set its last use to now; yield whether it is held (``docs/format.md``
    §10, "Last use and loads in use"). InvalidDigestError, UnsafePathError (a link), LockTimeoutError when a remover
    held the pack's exclusive ``flock`` for longer than the lock timeout."""
    check_digest(digest)
    deadline = time.monotonic() + cache.lock_timeout_seconds
    fd = None
    try:
        while (fd := _lock_use_file(cache, digest, fcntl.LOCK_SH)) is None:
            if time.monotonic() >= deadline:
                path = cache.use_path(digest)
                raise LockTimeoutError(
                    f"waited {cache.lock_timeout_seconds:g} s while a remover held the pack (holder:"
                    f" {describe_holder(path)}); set {LOCK_TIMEOUT_ENV} to wait longer, or stop the holder",
                    file=path,
                )
            time.sleep(HOLD_POLL_SECONDS)
    except LockTimeoutError:
        raise
    except (OSError, CacheError) as exc:
        logger.info("coldsnap: %s: cannot hold the pack as in use (%s); loading without the hold", cache.use_path(digest), exc)
    if fd is None:
        yield False
        return
    try:
        cache.mark_used(digest, fd)
        yield True
    finally:
        os.close(fd)


def pack_in_use(cache: PayloadCache, digest: str) -> bool:
    """Whether a running load (or a remover) holds ``digest``'s use file now (``False`` without one)."""
    try:
        return not lock_is_free(cache.use_path(digest))
    except FileNotFoundError:
        return False


def last_used_ns(cache: PayloadCache, digest: str, object_st: os.stat_result) -> int:
    """The pack's last use, nanoseconds since the epoch: its use file's mtime, else the object's."""
    used = lstat_or_none(cache.use_path(digest))
    return used.st_mtime_ns if used is not None and stat.S_ISREG(used.st_mode) else object_st.st_mtime_ns


def list_packs(cache: PayloadCache) -> list[PackUsage]:
    """Every cached pack that is a regular file, by digest (a link or an object that cannot be examined is left out)."""
    packs = []
    for digest in cache.digests():
        try:
            st = refuse_symlink(cache.object_path(digest))
        except ColdsnapError:
            continue
        if st is not None:
            packs.append(PackUsage(digest, st.st_size, last_used_ns(cache, digest, st), pack_in_use(cache, digest)))
    return packs


def remove_pack(cache: PayloadCache, digest: str, *, force: bool = False) -> PackUsage:
    """Remove one pack, its validation record and its use file (``force``: even while a running load holds it;
    ``docs/format.md`` §10, "Removal"). InvalidDigestError, MissingObjectError (not in the cache), PackInUseError
    (held by a load, no ``force``: nothing removed), LockTimeoutError, UnsafePathError / CacheError."""
    removed = _remove_if_present(cache, check_digest(digest), force=force)
    if removed is None:
        raise MissingObjectError(
            "pack is not in the node-local cache (coldsnap cache ls lists the packs)", file=cache.object_path(digest)
        )
    return removed


def _remove_if_present(cache: PayloadCache, digest: str, *, force: bool) -> PackUsage | None:
    """:func:`remove_pack`, returning ``None`` where the pack is not (or no longer) there."""
    path = cache.object_path(digest)
    if not cache.check_dirs() or refuse_symlink(path) is None:
        return None
    with cache.lock(digest, required=True):
        fd = _lock_use_file(cache, digest, fcntl.LOCK_EX)
        deadline = time.monotonic() + PROBE_GRACE_SECONDS
        while fd is None and not force and time.monotonic() < deadline:
            time.sleep(HOLD_POLL_SECONDS / 5)  # another gc's probe, not a load, if it lets go within the grace
            fd = _lock_use_file(cache, digest, fcntl.LOCK_EX)
        try:
            if fd is None and not force:
                use = cache.use_path(digest)
                raise PackInUseError(
                    f"a running load holds the pack (holder: {describe_holder(use)}); not removed, --force removes it anyway",
                    file=use,
                )
            st = refuse_symlink(path)
            if st is None:
                return None
            usage = PackUsage(digest, st.st_size, last_used_ns(cache, digest, st), fd is None)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(cache.record_path(digest))
                os.unlink(path)
                fsync_dir(cache.objects_dir)
                if fd is not None:
                    os.unlink(cache.use_path(digest))
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise os_error("cannot remove the pack", exc, path, missing=CacheError, other=CacheError) from exc
            return usage
        finally:
            if fd is not None:
                os.close(fd)


def evict(
    cache: PayloadCache, *, unused_for_seconds: float | None = None, max_bytes: int | None = None, dry_run: bool = False
) -> Eviction:
    """Remove packs least recently used first (``docs/format.md`` §10, "Eviction"; ``dry_run``: none). Raises as
    :func:`remove_pack`, but for a pack gone or in use, which is skipped."""
    now_ns = time.time_ns()
    removed: list[PackUsage] = []
    in_use: list[str] = []
    gone: set[str] = set()

    def remaining_bytes() -> int:
        return sum(p.size_bytes for p in list_packs(cache) if p.digest not in gone)

    for pack in sorted(list_packs(cache), key=lambda p: (p.last_used_ns, p.digest)):
        stale = unused_for_seconds is not None and now_ns - pack.last_used_ns > unused_for_seconds * 1e9
        if not stale and (max_bytes is None or remaining_bytes() <= max_bytes):
            break  # least recently used first: every later pack is fresher, and the total already fits
        if dry_run and pack.in_use:
            in_use.append(pack.digest)
            continue
        try:
            usage = pack if dry_run else _remove_if_present(cache, pack.digest, force=False)
        except PackInUseError:
            in_use.append(pack.digest)
            continue
        if usage is not None:
            removed.append(usage)
        gone.add(pack.digest)
    return Eviction(tuple(removed), tuple(in_use), sum(p.size_bytes for p in removed), remaining_bytes())
