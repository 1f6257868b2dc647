"""Validation records, evidence that a cached pack was fully verified, bound to its inode (``docs/format.md`` §11)."""

from __future__ import annotations

import datetime
import errno
import logging
import os
import stat
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Literal, Protocol

from coldsnap_core._io import open_regular, os_errno, os_error, refuse_symlink, replace_file_durably
from coldsnap_core.errors import (
    CacheError,
    ColdsnapError,
    ManifestError,
    MissingObjectError,
    UnsafePathError,
    ValidationRecordError,
)
from coldsnap_core.format._strict import D, Document, Offset, Sha256, Text, load_document
from coldsnap_core.format.verify import VERIFIER_VERSION

logger = logging.getLogger(__name__)

RECORD_KIND = "coldsnap.validation-record"
RECORD_VERSION = 1
RECORD_MAX_BYTES = 64 << 10
"""A record is a few hundred bytes; anything larger is refused unread."""


def identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """The fields a record binds: ``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


STAT_FIELDS = ("device", "inode", "size_bytes", "mtime_ns", "ctime_ns")
"""The ``stat`` fields a node-local record binds, in :func:`identity` order."""


class StatBound(Document, kw_only=True):
    """The :data:`STAT_FIELDS` of the file a node-local record vouches for (``docs/format.md`` §10.1 and §11)."""

    device: Offset
    inode: Offset
    size_bytes: Offset
    mtime_ns: Offset
    ctime_ns: Offset

    @staticmethod
    def bound(st: os.stat_result) -> dict[str, int]:
        """The bound fields of ``st``, by name (keyword arguments of a record)."""
        return dict(zip(STAT_FIELDS, identity(st), strict=True))

    def mismatch(self, st: os.stat_result) -> str | None:
        """The first bound field that differs from ``st`` (``"inode is 5, the record says 4"``), or ``None``."""
        mine = (self.device, self.inode, self.size_bytes, self.mtime_ns, self.ctime_ns)
        for name, want, have in zip(STAT_FIELDS, mine, identity(st), strict=True):
            if want != have:
                return f"{name} is {have}, the record says {want}"
        return None

    def matches(self, st: os.stat_result) -> bool:
        """Whether every bound field equals ``st``'s."""
        return self.mismatch(st) is None


class ValidationRecord(StatBound, kw_only=True, tag=RECORD_KIND):
    """Evidence that the object at a given inode was fully verified (``docs/format.md`` §11)."""

    format_version: Literal[1] = RECORD_VERSION
    digest: Sha256
    verifier_version: Text
    verified_at: Text


class RecordHost(Protocol):
    """What the record functions need of a cache (:class:`coldsnap_core.cache.payload_cache.PayloadCache` is one)."""

    def object_path(self, digest: str) -> Path: ...
    def record_path(self, digest: str) -> Path: ...
    def temporary(self, label: str) -> AbstractContextManager[tuple[int, Path]]: ...
    def remember_verified(self, digest: str, st: os.stat_result) -> None: ...


def read_private_record(path: Path, kind: type[D]) -> D:
    """Read and strictly parse a node-local record that this user alone could have written (the trust rules of
    ``docs/format.md`` §11, checked on the descriptor): ValidationRecordError names why not; UnsafePathError,
    NotRegularFileError and FileAccessError as :func:`~coldsnap_core._io.open_regular`."""
    with open_regular(path, "record", missing=ValidationRecordError) as (fd, st):
        if st.st_uid != os.geteuid():
            raise ValidationRecordError(f"record belongs to uid {st.st_uid}, not {os.geteuid()}", file=path)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ValidationRecordError(f"record mode {stat.filemode(st.st_mode)} is group- or world-writable", file=path)
        if st.st_size > RECORD_MAX_BYTES:
            raise ValidationRecordError(f"record is {st.st_size} bytes, more than {RECORD_MAX_BYTES}", file=path)
        try:
            data = os.read(fd, RECORD_MAX_BYTES + 1)
        except OSError as exc:
            raise os_error("cannot read the record", exc, path) from exc
    try:
        return load_document(kind, data, file=str(path))
    except ManifestError as exc:
        raise ValidationRecordError(f"record is malformed: {exc.detail}", file=path) from exc


def read_trusted_record(cache: RecordHost, digest: str, object_st: os.stat_result | None = None) -> ValidationRecord:
    """Return the record of ``digest`` if it may be trusted right now (``object_st``: a fresh ``lstat`` of the object,
    ``docs/format.md`` §11); else ValidationRecordError, MissingObjectError (no object) or UnsafePathError (a link)."""
    path = cache.record_path(digest)
    record = read_private_record(path, ValidationRecord)
    if record.digest != digest:
        raise ValidationRecordError(f"record names digest {record.digest}", file=path)
    if record.verifier_version != VERIFIER_VERSION:
        raise ValidationRecordError(
            f"record was written by {record.verifier_version!r}, this release is {VERIFIER_VERSION!r}", file=path
        )
    object_path = cache.object_path(digest)
    if object_st is None:
        object_st = refuse_symlink(object_path)
    if object_st is None:
        raise MissingObjectError("object does not exist", file=object_path)
    if object_st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValidationRecordError(f"object mode {stat.filemode(object_st.st_mode)} is group- or world-writable", file=path)
    difference = record.mismatch(object_st)
    if difference is not None:
        raise ValidationRecordError(f"record no longer matches the object: {difference}", file=path)
    return record


def record_state(cache: RecordHost, digest: str) -> str:
    """``"trusted"``, or why the record of ``digest`` is not trusted (for ``coldsnap cache ls``)."""
    try:
        read_trusted_record(cache, digest)
    except (ValidationRecordError, MissingObjectError, UnsafePathError) as exc:
        return f"untrusted: {exc.detail}"
    return "trusted"


def last_full_verification(cache: RecordHost, digest: str) -> datetime.datetime | None:
    """When ``digest`` was last hashed in full (its trusted record's ``verified_at``, UTC), else ``None``."""
    try:
        when = datetime.datetime.fromisoformat(read_trusted_record(cache, digest).verified_at)
    except (ColdsnapError, ValueError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.UTC)


def write_record(cache: RecordHost, digest: str, verified: os.stat_result) -> ValidationRecord:
    """Write (replace) the read-only record of a just-verified object still at the inode ``verified`` describes;
    CacheError when it changed since, InsufficientSpaceError without space (neither writes a record), UnsafePathError
    when the object or record path is a symbolic link."""
    object_path = cache.object_path(digest)
    current = refuse_symlink(object_path)
    if current is None or identity(current) != identity(verified):
        raise CacheError("the object changed after it was verified; no validation record written", file=object_path)
    record = ValidationRecord(
        digest=digest,
        **StatBound.bound(current),
        verifier_version=VERIFIER_VERSION,
        verified_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    path = cache.record_path(digest)
    replace_file_durably(
        path,
        record.dumps(),
        read_only=True,
        temporary=lambda: cache.temporary(f"{digest}.record"),
        before_rename=refuse_symlink,
    )
    return record


def record_verified(cache: RecordHost, digest: str, verified: os.stat_result) -> bool:
    """After a full verification of the inode ``verified``: write the record (``True``), else ``cache`` remembers
    the verification and it is logged (``False``; ``docs/format.md`` §10, commit); a link is an UnsafePathError."""
    object_path = cache.object_path(digest)
    current = refuse_symlink(object_path)
    if current is None or identity(current) != identity(verified):
        logger.info("coldsnap: %s changed after it was verified; no validation record written", object_path)
        return False
    try:
        write_record(cache, digest, verified)
    except (OSError, CacheError) as exc:
        cache.remember_verified(digest, verified)
        read_only = os_errno(exc) == errno.EROFS
        logger.log(
            logging.INFO if read_only else logging.WARNING,
            "coldsnap: %s is valid but its validation record could not be written (%s); it is trusted in this"
            " process only, and other processes hash it in full",
            object_path,
            "read-only file system" if read_only else exc,
        )
        return False
    return True
