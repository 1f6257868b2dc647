"""Validation records: evidence that a cached pack was fully verified, bound to its inode.

A record (``<digest>.pack.record``, JSON, mode 0444) binds the digest to the object's device, inode,
size and mtime (ns) as seen right after a full SHA-256 verification, plus the verifier version and
the time. A later restore accepts the object without re-hashing only while (seed 000, "Recovery
read-through cache"; ``DESIGN.md``):

* the record is a regular file (not a symlink) owned by the current user and not group- or
  world-writable,
* it parses strictly, names this digest and this verifier version,
* and every bound field equals a fresh ``lstat`` of the object (itself a regular file, not a symlink).

Anything else means a full re-hash: success rewrites the record, failure quarantines the object.

**Limit.** A record cannot see an in-place edit that restores the size and the mtime (e.g. a
``dd conv=notrunc`` followed by ``touch -d``). Per-extent SHA-256 verification during hydration
(``hydrate(..., verify_extents=True)``, ``COLDSNAP_VERIFY_EXTENTS=1``) is the answer to that.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coldsnap_core._io import fsync_dir
from coldsnap_core.digests import SHA256_HEX_RE, check_digest
from coldsnap_core.errors import (
    ColdsnapError,
    IntegrityError,
    ManifestError,
    MissingObjectError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    ValidationRecordError,
)
from coldsnap_core.format._strict import Fields, dump_document, parse_document
from coldsnap_core.verify import VERIFIER_VERSION

if TYPE_CHECKING:
    from coldsnap_core.cache import PayloadCache

logger = logging.getLogger(__name__)

RECORD_KIND = "coldsnap.validation-record"
RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class ValidationRecord:
    """Evidence that the object at a given inode was fully verified.

    Attributes:
        digest: the object's SHA-256 (lowercase hex).
        device: ``st_dev`` of the object.
        inode: ``st_ino`` of the object.
        size_bytes: ``st_size`` of the object.
        mtime_ns: ``st_mtime_ns`` of the object.
        verifier_version: :data:`coldsnap_core.verify.VERIFIER_VERSION` of the verifying release.
        verified_at: UTC time of the verification, ISO 8601.
    """

    digest: str
    device: int
    inode: int
    size_bytes: int
    mtime_ns: int
    verifier_version: str
    verified_at: str

    def to_json(self) -> dict[str, object]:
        return {
            "format": RECORD_KIND,
            "format_version": RECORD_VERSION,
            "digest": self.digest,
            "device": self.device,
            "inode": self.inode,
            "size_bytes": self.size_bytes,
            "mtime_ns": self.mtime_ns,
            "verifier_version": self.verifier_version,
            "verified_at": self.verified_at,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> ValidationRecord:
        if f.str("format") != RECORD_KIND:
            raise f.error("not a validation record")
        if f.int("format_version") != RECORD_VERSION:
            raise f.error("unsupported validation record version")
        record = cls(
            digest=f.str("digest", pattern=SHA256_HEX_RE),
            device=f.int("device"),
            inode=f.int("inode"),
            size_bytes=f.int("size_bytes"),
            mtime_ns=f.int("mtime_ns"),
            verifier_version=f.str("verifier_version"),
            verified_at=f.str("verified_at"),
        )
        f.done()
        return record

    def matches(self, st: os.stat_result) -> bool:
        return (self.device, self.inode, self.size_bytes, self.mtime_ns) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _lstat_regular(path: Path) -> os.stat_result | None:
    from coldsnap_core.cache import refuse_symlink

    refuse_symlink(path)
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def read_trusted_record(cache: PayloadCache, digest: str) -> ValidationRecord:
    """Return the record of ``digest`` if it may be trusted right now.

    Raises:
        ValidationRecordError: absent, loose mode, other owner, unparsable, or a bound field differs.
        UnsafePathError: the record or object path is a symbolic link.
    """
    path = cache.record_path(digest)
    st = _lstat_regular(path)
    if st is None:
        raise ValidationRecordError("no validation record", file=path)
    if st.st_uid != os.geteuid():
        raise ValidationRecordError(f"record belongs to uid {st.st_uid}, not {os.geteuid()}", file=path)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValidationRecordError(f"record mode {stat.filemode(st.st_mode)} is group- or world-writable", file=path)
    try:
        record = parse_document(path.read_bytes(), ValidationRecord.from_fields, file=str(path))
    except ManifestError as exc:
        raise ValidationRecordError(f"record is malformed: {exc.detail}", file=path) from exc
    if record.digest != digest or record.verifier_version != VERIFIER_VERSION:
        raise ValidationRecordError("record names another digest or verifier version", file=path)
    object_st = _lstat_regular(cache.object_path(digest))
    if object_st is None:
        raise MissingObjectError("object does not exist", file=cache.object_path(digest))
    if not record.matches(object_st):
        raise ValidationRecordError("record no longer matches the object's device, inode, size or mtime", file=path)
    return record


def write_record(cache: PayloadCache, digest: str) -> ValidationRecord:
    """Write (replace) the read-only record of a just-verified object."""
    object_path = cache.object_path(digest)
    st = _lstat_regular(object_path)
    if st is None:
        raise MissingObjectError("object does not exist", file=object_path)
    record = ValidationRecord(
        digest=digest,
        device=st.st_dev,
        inode=st.st_ino,
        size_bytes=st.st_size,
        mtime_ns=st.st_mtime_ns,
        verifier_version=VERIFIER_VERSION,
        verified_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    path = cache.record_path(digest)
    _lstat_regular(path)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.partial")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
    try:
        os.write(fd, dump_document(record.to_json()))
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.rename(temp, path)
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
    fsync_dir(path.parent)
    return record


def quarantine_object(cache: PayloadCache, digest: str) -> Path | None:
    """Move ``<digest>.pack`` into ``quarantine/`` (unique name) and delete its record."""
    check_digest(digest)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(cache.record_path(digest))
    source = cache.object_path(digest)
    cache.quarantine_dir.mkdir(parents=True, exist_ok=True)
    target = cache.quarantine_dir / f"{digest}.{secrets.token_hex(8)}.pack"
    try:
        os.rename(source, target)
    except FileNotFoundError:
        return None
    fsync_dir(cache.objects_dir)
    logger.warning("coldsnap: quarantined %s as %s", source, target)
    return target


def admit_object(cache: PayloadCache, digest: str, size_bytes: int | None = None) -> Path:
    """See :meth:`coldsnap_core.cache.PayloadCache.admit`."""
    from coldsnap_core.format.manifest import PackRef
    from coldsnap_core.verify import verify_pack_file

    path = cache.object_path(digest)
    st = _lstat_regular(path)
    _lstat_regular(cache.record_path(digest))
    if st is None:
        raise MissingObjectError("pack is not in the node-local cache", file=path)
    if size_bytes is not None and st.st_size != size_bytes:
        cache.quarantine(digest)
        state = "truncated" if st.st_size < size_bytes else "extended"
        raise PackSizeMismatchError(f"cached pack is {st.st_size} bytes, expected {size_bytes} ({state}); quarantined", file=path)
    try:
        read_trusted_record(cache, digest)
        return path
    except ValidationRecordError as exc:
        logger.info("coldsnap: verifying %s in full (%s)", path, exc.detail)
    try:
        verify_pack_file(path, PackRef.for_digest(digest, st.st_size))
    except IntegrityError:
        cache.quarantine(digest)
        raise
    except ColdsnapError:
        raise
    write_record(cache, digest)
    return path


__all__ = [
    "PackDigestMismatchError",
    "ValidationRecord",
    "admit_object",
    "quarantine_object",
    "read_trusted_record",
    "write_record",
]
