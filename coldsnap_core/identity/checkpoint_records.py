"""Checkpoint records: node-local evidence that a checkpoint file was hashed (``docs/format.md`` §10.1)."""

from __future__ import annotations

import contextlib
import datetime
import enum
import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coldsnap_core._io import replace_file_durably, sha256_file
from coldsnap_core.cache.records import StatBound, read_private_record
from coldsnap_core.cache.records import identity as stat_identity
from coldsnap_core.errors import CacheError, UnsafePathError, ValidationRecordError
from coldsnap_core.format._strict import Sha256, Text

logger = logging.getLogger(__name__)

CHECKPOINT_RECORDS_DIRNAME = "checkpoint-records"


class CheckpointRecord(StatBound, kw_only=True, tag="coldsnap.checkpoint-record"):
    """Evidence that the real path ``path`` had ``sha256`` while it had these ``stat`` fields (UTC ``hashed_at``)."""

    format_version: Literal[1] = 1
    path: Text
    sha256: Sha256
    hashed_at: Text


class RecordState(enum.Enum):
    """What :meth:`CheckpointRecords.lookup` found for a checkpoint file."""

    TRUSTED = "trusted"
    """A trusted record matches the file's ``stat``: its SHA-256 is the file's."""
    STALE = "stale"
    """A trusted record names the file, but the file changed since it was hashed."""
    ABSENT = "absent"
    """No record, or one that cannot be trusted (loose mode, other owner, malformed)."""


@dataclass(frozen=True, slots=True)
class RecordLookup:
    state: RecordState
    sha256: str | None = None
    reason: str = ""


class CheckpointRecords:
    """The node-local checkpoint records of one state root (``docs/format.md`` §10.1: where, and when trusted)."""

    def __init__(self, state_root: str | os.PathLike[str]) -> None:
        self.state_root = Path(state_root)
        self.folder = self.state_root / CHECKPOINT_RECORDS_DIRNAME

    def record_path(self, real_path: str) -> Path:
        key = hashlib.sha256(os.fsencode(real_path)).hexdigest()
        return self.folder / f"{key}.record"

    def _folder_present(self) -> bool:
        try:
            st = os.lstat(self.folder)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError("refusing a symbolic link or non-folder as the checkpoint records folder", file=self.folder)
        return True

    def lookup(self, path: str | os.PathLike[str], st: os.stat_result | None = None) -> RecordLookup:
        """The record state of the checkpoint file ``path`` (its real path; ``st``: a fresh ``os.stat`` of it, if known).

        Raises:
            UnsafePathError: the records folder or the record is a symbolic link.
            FileNotFoundError: the checkpoint file does not exist.
        """
        real = os.path.realpath(path)
        st = os.stat(real) if st is None else st
        if not self._folder_present():
            return RecordLookup(RecordState.ABSENT, reason="no checkpoint records on this node")
        record_path = self.record_path(real)
        try:
            record = read_private_record(record_path, CheckpointRecord)
        except ValidationRecordError as exc:
            return RecordLookup(RecordState.ABSENT, reason=f"checkpoint record {record_path}: {exc.detail}")
        if record.path != real:
            return RecordLookup(RecordState.ABSENT, reason=f"checkpoint record names {record.path!r}")
        if not record.matches(st):
            return RecordLookup(
                RecordState.STALE, record.sha256, reason=f"{real} changed since it was hashed at {record.hashed_at}"
            )
        return RecordLookup(RecordState.TRUSTED, record.sha256)

    def write(self, path: str | os.PathLike[str], sha256: str, hashed: os.stat_result) -> CheckpointRecord:
        """Record, durably, that ``path`` (real path) had ``sha256`` while it had the ``stat`` ``hashed`` (and still has).

        Raises:
            CacheError: the file changed since it was hashed (nothing written), or the write failed.
            InsufficientSpaceError: no space (nothing written).
            UnsafePathError: the records folder is a symbolic link.
        """
        real = os.path.realpath(path)
        current = os.stat(real)
        if stat_identity(current) != stat_identity(hashed):
            raise CacheError("the checkpoint file changed while it was hashed; no checkpoint record written", file=real)
        try:
            self.state_root.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.folder.mkdir(mode=0o700)
            self._folder_present()
        except OSError as exc:
            raise CacheError(f"cannot create the checkpoint records folder: {exc}", file=self.folder) from exc
        record = CheckpointRecord(
            path=real,
            **StatBound.bound(current),
            sha256=sha256,
            hashed_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        )
        final = self.record_path(real)
        try:
            replace_file_durably(final, record.dumps(), mode=0o600, read_only=True)
        except OSError as exc:
            raise CacheError(f"cannot write a checkpoint record: {exc}", file=final) from exc
        return record


def hash_checkpoint_file(path: str | os.PathLike[str], records: CheckpointRecords | None = None) -> tuple[str, int]:
    """SHA-256 and size of a checkpoint file (one read); with ``records``, record the result (a WARNING if it fails)."""
    real = os.path.realpath(path)
    before = os.stat(real)
    digest, size = sha256_file(real)
    if records is not None:
        try:
            records.write(real, digest, before)
        except (OSError, CacheError, UnsafePathError) as exc:
            logger.warning("coldsnap: %s hashed, but its checkpoint record could not be written: %s", real, exc)
    return digest, size
