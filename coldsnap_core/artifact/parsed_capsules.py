"""Parsed-capsule records: a pinned capsule's strictly parsed documents, kept in the node-local state
root so that the next engine start that reads the same capsule does not parse them again
(``docs/format.md`` §10.4).

A restore reads its capsule at every start. The strict parse of its two manifests (every field of
about 2,000 JSON objects for SmolLM2-135M: 20 ms of a cached restore's 40 ms outside hydration) gives
the same objects every time the same bytes are read by the same parser. After a pinned read has
parsed and cross-checked the documents, :meth:`ParsedCapsules.put` writes the result to
``<state-root>/parsed-capsules/<key>.record``; a later pinned read whose documents hash to the same
pins takes it from there (:meth:`ParsedCapsules.get`, about 4 ms).

What a record does not change: every capsule file is still read and checked against its pin in
``artifact.json`` (size and SHA-256) before anything is used, so an edited manifest is refused
exactly as before; the checks that involve more than the three documents (the folder name, the
descriptor entry's worker and payload, the residual pin) still run on every read; ``coldsnap verify``
and every unpinned read always parse strictly.

**Key.** SHA-256 of ``coldsnap.parsed-capsule``, the :func:`parser_digest` (SHA-256 of the source of
every module that parses or defines the documents, and Python's version) and the pinned SHA-256 of
the native manifest, the recovery manifest and ``target.json``: another release, an edited parser or
other bytes give another key, never a stale record.

**File.** ``coldsnap.parsed-capsule 1\\n``, the record's key, ``\\n``, the SHA-256 of the body in
lowercase hex, ``\\n``, then the body: a pickle (protocol 5) of ``(NativeManifest, RecoveryManifest,
TargetIdentity | None)`` in which each object is its class called with its fields in order. Mode 0444,
replaced atomically.

**Trust.** A record is used only if it is a regular file (not a symbolic link, in a folder that is not
one) owned by the current user, not group- or world-writable, at most :data:`MAX_RECORD_BYTES`, its
header holds and names the key it is read for (a record renamed or copied under another record's name
holds other documents), its body has the header's SHA-256, it unpickles with no class outside
:data:`RECORD_CLASSES` (so loading one can only build objects of those classes) and it gives the three expected
types. The same rules as a validation record (``docs/format.md`` §11), which names its digest: only this
user could have written it, for this key. Anything else is logged at INFO and the documents are parsed
strictly, whose result then replaces the record. A record that cannot be written (read-only state root)
is logged at DEBUG: a record only saves time. A record used or written is one DEBUG line naming it: the log
says which of the two a start did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import logging
import os
import pickle
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from coldsnap_core._io import refuse_symlink, replace_file_durably
from coldsnap_core.errors import ColdsnapError
from coldsnap_core.format.allocation import Allocation, AllocationMap, TensorPlacement
from coldsnap_core.format.extents import ExtentProvenance, ModelExtent, ResidualExtent
from coldsnap_core.format.manifest import (
    CheckpointFile,
    ModelIdentity,
    NativeManifest,
    PackRef,
    RecoveryManifest,
    ResidualRef,
    WorkerIdentity,
)
from coldsnap_core.format.target import TargetIdentity

logger = logging.getLogger(__name__)

__all__ = [
    "HEADER_BYTES",
    "MAX_RECORD_BYTES",
    "PARSED_CAPSULES_DIRNAME",
    "RECORD_CLASSES",
    "ParsedCapsules",
    "ParsedDocuments",
    "decode",
    "encode",
    "parser_digest",
    "sources_digest",
]

PARSED_CAPSULES_DIRNAME = "parsed-capsules"
"""The records' folder below the state root."""

RECORD_MAGIC = b"coldsnap.parsed-capsule 1\n"
"""A record's first line: its kind and version."""

MAX_RECORD_BYTES = 256 << 20
"""A record is about a third of its two manifests' size; a larger file is refused unread."""

ParsedDocuments = tuple[NativeManifest, RecoveryManifest, TargetIdentity | None]
"""A capsule's three documents as a strict read parses them."""

RECORD_CLASSES: tuple[type, ...] = (
    NativeManifest,
    RecoveryManifest,
    TargetIdentity,
    WorkerIdentity,
    PackRef,
    ResidualRef,
    CheckpointFile,
    ModelIdentity,
    AllocationMap,
    Allocation,
    TensorPlacement,
    ModelExtent,
    ResidualExtent,
    ExtentProvenance,
)
"""Every class a record may hold: the format's frozen dataclasses the documents parse into."""

_BY_NAME = {(cls.__module__, cls.__qualname__): cls for cls in RECORD_CLASSES}
_INIT_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls) if f.init) for cls in RECORD_CLASSES}

_PARSER_SOURCES = ("digests.py", "errors.py", "artifact/capsules.py", "artifact/parsed_capsules.py")
"""Besides every module of ``coldsnap_core/format/``: the sources :func:`parser_digest` covers."""


def parser_digest() -> str | None:
    """:func:`sources_digest` of this installation as this process imported it: read when this module is
    imported (about 130 KB of source, 0.3-1.5 ms), right after the format modules it imports, so that a
    source upgraded in place while an engine runs cannot key that engine's older parse with the new
    parser's digest."""
    return _PARSER_DIGEST


def sources_digest(package_dir: Path) -> str | None:
    """SHA-256 over Python's major and minor version and the source of every module of
    ``package_dir`` (a ``coldsnap_core`` folder) that parses the capsule documents or defines their
    classes: ``format/*.py`` and :data:`_PARSER_SOURCES`, by relative path. ``None`` when a source cannot
    be read (an install without sources: records are then not used)."""
    digest = hashlib.sha256(f"python {sys.version_info[0]}.{sys.version_info[1]}\n".encode())
    format_sources = sorted(package_dir.joinpath("format").glob("*.py"))
    if not format_sources:
        return None
    try:
        for path in format_sources + [package_dir / name for name in _PARSER_SOURCES]:
            data = path.read_bytes()
            digest.update(f"{path.relative_to(package_dir).as_posix()} {len(data)}\n".encode() + data)
    except OSError:
        return None
    return digest.hexdigest()


_PARSER_DIGEST = sources_digest(Path(__file__).parent.parent)


def _reduce(obj: object) -> tuple[type, tuple[object, ...]]:
    cls = type(obj)
    return cls, tuple([getattr(obj, name) for name in _INIT_FIELDS[cls]])


class _RecordUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type:
        cls = _BY_NAME.get((module, name))
        if cls is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not a class a parsed-capsule record may hold")
        return cls


HEADER_BYTES = len(RECORD_MAGIC) + 65 + 65
"""A record's header: :data:`RECORD_MAGIC`, its key and its body's SHA-256, each of those two a line of 64
lowercase hex."""


def encode(documents: ParsedDocuments, key: str) -> bytes:
    """A record's bytes for ``documents`` under ``key`` (the file format in the module docstring)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=5)
    # Each object as its constructor call: unpickling then costs one __init__ per object rather than
    # dataclasses' generic __setstate__ (3.8 ms instead of 8.3 ms for SmolLM2-135M).
    pickler.dispatch_table = dict.fromkeys(RECORD_CLASSES, _reduce)  # type: ignore[assignment]
    pickler.dump(documents)
    body = buffer.getvalue()
    return RECORD_MAGIC + key.encode() + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def decode(data: bytes, key: str) -> ParsedDocuments:
    """The documents a record's bytes hold, if it was written for ``key``.

    Raises:
        ValueError: another kind or version, another key (a record renamed or copied under this one's
            name: it holds other documents), a body whose SHA-256 is not the header's, a class outside
            :data:`RECORD_CLASSES`, anything else unpickling raises, or other types than
            :data:`ParsedDocuments`.
    """
    start = len(RECORD_MAGIC)
    if (
        not data.startswith(RECORD_MAGIC)
        or data[start + 64 : start + 65] != b"\n"
        or data[HEADER_BYTES - 1 : HEADER_BYTES] != b"\n"
    ):
        raise ValueError("it does not start with the parsed-capsule record header")
    if data[start : start + 64] != key.encode():
        raise ValueError(f"it was written for key {data[start : start + 64].decode(errors='replace')}, not {key}")
    body = data[HEADER_BYTES:]
    if hashlib.sha256(body).hexdigest().encode() != data[start + 65 : HEADER_BYTES - 1]:
        raise ValueError("its body does not have the SHA-256 its header names")
    try:
        documents = _RecordUnpickler(io.BytesIO(body)).load()
    except Exception as exc:  # a record only saves time: whatever unpickling raises means "parse strictly"
        raise ValueError(f"its body does not unpickle: {type(exc).__name__}: {exc}") from exc
    if not (
        type(documents) is tuple
        and len(documents) == 3
        and type(documents[0]) is NativeManifest
        and type(documents[1]) is RecoveryManifest
        and (documents[2] is None or type(documents[2]) is TargetIdentity)
    ):
        raise ValueError("it does not hold a native manifest, a recovery manifest and a target identity")
    return documents


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedCapsules:
    """The parsed-capsule records of one state root (``<state-root>/parsed-capsules/``).

    Attributes:
        folder: the records' folder.
    """

    folder: Path

    @classmethod
    def in_state_root(cls, state_root: Path) -> ParsedCapsules:
        return cls(Path(state_root) / PARSED_CAPSULES_DIRNAME)

    def key(self, pinned_sha256: Sequence[str | None]) -> str | None:
        """The record key of a capsule whose native manifest, recovery manifest and ``target.json`` are
        pinned with these SHA-256s (``None``: no ``target.json``); ``None`` when records are not used
        (:func:`parser_digest` is ``None``)."""
        parser = parser_digest()
        if parser is None:
            return None
        text = "\n".join(["coldsnap.parsed-capsule", parser, *(sha or "-" for sha in pinned_sha256)])
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.record"

    def get(self, key: str) -> ParsedDocuments | None:
        """The documents of record ``key``, or ``None`` when there is none that may be used (the reason
        is logged at INFO unless the record is simply absent). Never raises for the record's sake."""
        path = self.path(key)
        try:
            data = self._read_private(path)
            if data is None:
                return None
            documents = decode(data, key)
        except (ColdsnapError, OSError, ValueError) as exc:
            logger.info("coldsnap: not using the parsed-capsule record %s (%s); parsing the capsule strictly", path, exc)
            return None
        logger.debug("coldsnap: parsed-capsule record %s used (the capsule's documents were not parsed)", path)
        return documents

    def _read_private(self, path: Path) -> bytes | None:
        try:
            folder_st = os.lstat(self.folder)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(folder_st.st_mode):  # a symbolic link included
            raise ValueError(f"{self.folder} is not a folder ({stat.filemode(folder_st.st_mode)})")
        try:
            # O_NONBLOCK: a FIFO put in the record's place cannot hang the restore; the checks below are
            # made on what was opened (fstat), not on what the path named a moment earlier.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError("it is a symbolic link (refused in the node-local state root)") from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"it is not a regular file ({stat.filemode(st.st_mode)})")
            if st.st_uid != os.geteuid():
                raise ValueError(f"it belongs to uid {st.st_uid}, not {os.geteuid()}")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise ValueError(f"its mode {stat.filemode(st.st_mode)} is group- or world-writable")
            if st.st_size > MAX_RECORD_BYTES:
                raise ValueError(f"it is {st.st_size} bytes, more than {MAX_RECORD_BYTES}")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)

    def put(self, key: str, documents: ParsedDocuments) -> None:
        """Write (or replace) record ``key`` for ``documents``, which a strict read just parsed and
        cross-checked. Never raises: a record that cannot be written is logged at DEBUG."""
        try:
            data = encode(documents, key)
            if os.path.islink(self.folder):
                raise ValueError(f"{self.folder} is a symbolic link")
            self.folder.mkdir(mode=0o700, exist_ok=True)
            replace_file_durably(self.path(key), data, read_only=True, before_rename=refuse_symlink)
        except (ColdsnapError, OSError, ValueError, pickle.PicklingError) as exc:
            logger.debug("coldsnap: parsed-capsule record %s not written: %s", self.path(key), exc)
            return
        logger.debug("coldsnap: parsed-capsule record %s written (%d bytes)", self.path(key), len(data))

    def sweep(self, *, older_than_seconds: float, dry_run: bool = False) -> list[tuple[Path, int]]:
        """``coldsnap cache gc``'s sweep: remove (or, with ``dry_run``, only list) every file in the folder
        (records and the temporaries of writers that died) not modified for ``older_than_seconds``; a
        record in use is written again by the next restore that reads its capsule. Nothing is followed
        through a symbolic link (a linked folder is left as it is).

        Returns:
            ``(path, size in bytes)`` of each file removed (or that would be).
        """
        try:
            if not stat.S_ISDIR(os.lstat(self.folder).st_mode):
                return []
            names = sorted(os.listdir(self.folder))
        except FileNotFoundError:
            return []
        now = time.time()
        removed = []
        for name in names:
            path = self.folder / name
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode) or now - st.st_mtime < older_than_seconds:
                continue
            removed.append((path, st.st_size))
            if not dry_run:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return removed
