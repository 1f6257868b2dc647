"""The pinned model identity: checkpoint files, the engine's model configuration, checkpoint records.

A :class:`~coldsnap_core.format.manifest.ModelIdentity` says which model an artifact was captured
from; this module produces it (capture) and checks it (:func:`check_model_identity`, which restore
runs before any payload byte is read, against :class:`LoadedModel`, what the engine is loading), because the layout fingerprint only sees
shapes, dtypes and names: another fine-tune, a replaced checkpoint file of the same size, or another
rotary base (``rope_theta``, a buffer computed at build time and restored from the residual blob)
all have the same layout.

Four parts:

* **Repository commit** (:func:`resolve_hub_commit`): a model loaded from a Hugging Face repository
  id is pinned by the commit its revision (``main`` when none is given) resolves to in the local
  Hugging Face cache, so an artifact captured from ``org/name`` is refused once ``main`` moves.
* **Checkpoint files** (:func:`identify_checkpoint`): every file's name, size and SHA-256, hashed
  once at capture, and its content fingerprint (:func:`checkpoint_fingerprint`: a few MiB sampled
  from the file, ``docs/format.md`` §10.2), cheap enough to re-check on every restore.
* **Model configuration** (:func:`model_config_sha256`): a digest of the engine's effective model
  configuration (the Hugging Face config after overrides, the dtype, the quantization method), as
  canonical JSON without the keys that vary with the path or the library version.
* **Checkpoint records** (:class:`CheckpointRecords`): node-local evidence that a checkpoint file was
  hashed, bound to its real path, device, inode, size, mtime and ctime, like the payload cache's
  validation records (``docs/format.md`` §11). Written whenever coldsnap hashes a checkpoint file
  (capture; a restore that had to hash one). Restore does not read the checkpoint (that is what it
  exists to avoid): a file whose record still matches a fresh ``stat`` has the recorded SHA-256; a
  file whose record no longer matches is hashed again (and re-recorded); a file without a record
  (another node) is compared by its content fingerprint, or hashed in full with
  ``COLDSNAP_VERIFY_CHECKPOINT=1``.

**Limit.** Without a record, a checkpoint file whose content differs only outside the fingerprint's
sampled blocks (an edit of a few tensors) is not seen unless ``COLDSNAP_VERIFY_CHECKPOINT=1`` (one
SHA-256 pass over the checkpoint per restore, then recorded). A record cannot see an in-place edit
that restores size, mtime and ctime (the same limit as the payload cache's records).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import hashlib
import json
import logging
import math
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core._io import fsync_dir, fsync_fd, os_error, sha256_file, write_all
from coldsnap_core.errors import CacheError, ModelIdentityMismatchError, UnsafePathError, ValidationRecordError
from coldsnap_core.format._strict import Fields, dump_document
from coldsnap_core.format.manifest import CheckpointFile, ModelIdentity
from coldsnap_core.records import identity as stat_identity
from coldsnap_core.records import read_private_record

logger = logging.getLogger(__name__)

# --- the repository commit -------------------------------------------------------------------------

COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
"""A Hugging Face commit hash: 40 lowercase hex digits (``huggingface_hub``'s ``REGEX_COMMIT_HASH``)."""

_CACHE_PROBE_FILENAME = "config.json"


def _resolved_by_api(repo_id: str, revision: str | None, cache_dir: str | os.PathLike[str] | None, repo_type: str) -> str:
    """``HfApi.resolve_revision(..., local_files_only=True)``: the ``refs/<revision>`` entry of the
    repository's cache folder; a ``ResolvedRevision`` already resolved for this repository (vLLM's
    ``model_config.revision``) is returned as is. Raises when the cache has no such entry."""
    import huggingface_hub

    resolved = huggingface_hub.HfApi().resolve_revision(
        repo_id, repo_type=repo_type, revision=revision, cache_dir=cache_dir, local_files_only=True
    )
    return resolved.resolved


def _resolved_by_snapshot(
    repo_id: str, revision: str | None, cache_dir: str | os.PathLike[str] | None, repo_type: str
) -> str | None:
    """For a ``huggingface_hub`` without ``HfApi.resolve_revision``: the ``snapshots/<commit>/`` folder
    of the cached ``config.json`` that ``try_to_load_from_cache`` returns for ``revision``."""
    import huggingface_hub

    cached = huggingface_hub.try_to_load_from_cache(
        repo_id, _CACHE_PROBE_FILENAME, cache_dir=cache_dir, revision=revision, repo_type=repo_type
    )
    if not isinstance(cached, str):
        return None
    snapshot = Path(cached).parent
    return snapshot.name if snapshot.parent.name == "snapshots" else None


def resolve_hub_commit(
    repo_id: str, revision: str | None, *, cache_dir: str | os.PathLike[str] | None = None, repo_type: str = "model"
) -> str | None:
    """The commit hash the local Hugging Face cache resolves ``revision or "main"`` of ``repo_id`` to.

    No network call: the cache's ``refs/<revision>`` entry is read through ``huggingface_hub``
    (``HfApi.resolve_revision(..., local_files_only=True)``; with an older ``huggingface_hub``, the
    ``snapshots/<commit>/`` folder of ``try_to_load_from_cache(repo_id, "config.json")``, the cache
    layout documented in huggingface_hub's "Understand caching" guide). The engine has already
    fetched the model's ``config.json`` when this is called (online that updates ``refs/main`` to the
    current upstream commit), and vLLM 0.32 resolves ``model_config.revision`` to a
    ``huggingface_hub.ResolvedRevision`` whose commit is returned as is.

    Args:
        repo_id: the repository id (``org/name``).
        revision: a branch, tag or commit; ``None`` means ``main``. A 40-hex commit is returned as is.
        cache_dir: the Hugging Face cache folder (vLLM's ``--download-dir``); ``None`` means
            ``HF_HUB_CACHE``.
        repo_type: ``"model"``, ``"dataset"`` or ``"space"``.

    Returns:
        The commit hash (40 lowercase hex digits), or ``None`` when the cache cannot resolve the
        revision (no cache folder for the repository, no ``refs`` entry, an invalid repository id, a
        ``refs`` entry that is not a commit hash).

    Raises:
        FileAccessError: the cache exists but cannot be read (anything but "no such file"), naming the file.
    """
    if revision is not None and not hasattr(revision, "resolved") and COMMIT_HASH.fullmatch(str(revision)):
        return str(revision)  # a ResolvedRevision goes through huggingface_hub, which reads its .resolved
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    resolution_error = getattr(hf_errors, "RevisionResolutionError", ValueError)
    try:
        if hasattr(huggingface_hub.HfApi, "resolve_revision"):
            commit = _resolved_by_api(repo_id, revision, cache_dir, repo_type)
        else:
            commit = _resolved_by_snapshot(repo_id, revision, cache_dir, repo_type)
    except (resolution_error, ValueError, FileNotFoundError, NotADirectoryError) as exc:
        logger.debug("coldsnap: the Hugging Face cache does not resolve %s@%s: %s", repo_id, revision or "main", exc)
        return None
    except OSError as exc:
        # Only an absent cache entry means "no commit": a cache that cannot be read (EACCES, EIO) is named,
        # instead of the misleading "does not resolve to a commit" later.
        raise os_error(
            f"the Hugging Face cache entry of {repo_id}@{revision or 'main'} cannot be read", exc, exc.filename or cache_dir
        ) from exc
    return commit if commit is not None and COMMIT_HASH.fullmatch(commit) else None


# --- the engine's model configuration --------------------------------------------------------------

CONFIG_DIGEST_DOMAIN = b"coldsnap-model-config-v1\n"
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version"})
"""Keys left out of the configuration digest besides every key that starts with ``_`` (such as
``_name_or_path``, ``_commit_hash``, ``_attn_implementation_internal``): they name the path the
config was read from or the library version, not the model."""


def _canonical(value: object) -> object:
    """``value`` as plain JSON data, deterministically (no addresses, sorted sets)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, Mapping):
        return {
            str(k): _canonical(v)
            for k, v in value.items()
            if not (isinstance(k, str) and (k.startswith("_") or k in VOLATILE_CONFIG_KEYS))
        }
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if hasattr(value, "to_dict") and hasattr(value, "__dict__"):
        # A (nested) Hugging Face config: its public attributes as set (what model code reads), not
        # ``to_dict()``, whose output follows each transformers version's serialization rules.
        return _canonical(vars(value))
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def canonical_model_config(hf_config: object, *, dtype: object, quantization: object = None) -> str:
    """The canonical JSON whose SHA-256 is :func:`model_config_sha256` (sorted keys, no spaces, ASCII)."""
    document = {"hf_config": _canonical(hf_config), "dtype": _canonical(dtype), "quantization": _canonical(quantization)}
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def model_config_sha256(hf_config: object, *, dtype: object, quantization: object = None) -> str:
    """SHA-256 (lowercase hex) of an engine's effective model configuration.

    ``sha256(b"coldsnap-model-config-v1\\n" + canonical_json)`` where ``canonical_json`` is
    ``{"hf_config": ..., "dtype": ..., "quantization": ...}`` with sorted keys: ``hf_config`` is every
    public attribute of the Hugging Face config object (nested configs likewise) or the mapping given,
    without :data:`VOLATILE_CONFIG_KEYS` and ``_``-prefixed keys; torch dtypes are written by name
    (``bfloat16``).

    Args:
        hf_config: the engine's Hugging Face config after overrides (vLLM ``model_config.hf_config``,
            which has ``--hf-overrides`` applied; SGLang ``model_config.hf_config``), or a mapping.
        dtype: the engine's model dtype (a ``torch.dtype`` or its name).
        quantization: the engine's quantization method, or ``None``.
    """
    text = canonical_model_config(hf_config, dtype=dtype, quantization=quantization).encode("ascii")
    return hashlib.sha256(CONFIG_DIGEST_DOMAIN + text).hexdigest()


# --- the content fingerprint -----------------------------------------------------------------------

FINGERPRINT_DOMAIN = b"coldsnap-checkpoint-fingerprint-v1\n"
FINGERPRINT_BLOCK_BYTES = 128 * 1024
FINGERPRINT_BLOCK_COUNT = 16
"""The fingerprint samples ``FINGERPRINT_BLOCK_COUNT`` blocks of ``FINGERPRINT_BLOCK_BYTES`` (2 MiB in
all) from the data region of each checkpoint file (``docs/format.md`` §10.2)."""
_HEADER_LENGTH_BYTES = 8
_MAX_SAFETENSORS_HEADER_BYTES = 100_000_000  # safetensors' own cap (huggingface/safetensors README)


def fingerprint_ranges(size_bytes: int, header_length_bytes: int | None) -> list[tuple[int, int]]:
    """The ``(offset_bytes, size_bytes)`` ranges of a file that :func:`checkpoint_fingerprint` hashes, in order.

    Args:
        size_bytes: the file's size.
        header_length_bytes: the little-endian ``u64`` at offset 0 of a safetensors file (its JSON
            header's length ``N``), or ``None`` for a file too short to hold one.

    The header region is ``[0, 8 + N)`` when ``8 + N <= size_bytes`` and ``N <= 100,000,000``, else
    empty (not a safetensors file: a ``.bin`` or ``.pt`` checkpoint). The data region is the rest: hashed
    whole when it is at most ``FINGERPRINT_BLOCK_COUNT * FINGERPRINT_BLOCK_BYTES`` (2 MiB), else as
    ``FINGERPRINT_BLOCK_COUNT`` blocks of ``FINGERPRINT_BLOCK_BYTES`` at
    ``data_start + (i * (data_size - FINGERPRINT_BLOCK_BYTES)) // (FINGERPRINT_BLOCK_COUNT - 1)`` for
    ``i`` in ``0..FINGERPRINT_BLOCK_COUNT - 1`` (the first block starts the data, the last one ends the file).
    """
    header_end = 0
    if (
        header_length_bytes is not None
        and header_length_bytes <= _MAX_SAFETENSORS_HEADER_BYTES
        and _HEADER_LENGTH_BYTES + header_length_bytes <= size_bytes
    ):
        header_end = _HEADER_LENGTH_BYTES + header_length_bytes
    ranges = [(0, header_end)] if header_end else []
    data_size = size_bytes - header_end
    if data_size <= FINGERPRINT_BLOCK_COUNT * FINGERPRINT_BLOCK_BYTES:
        return [(0, size_bytes)] if size_bytes else []
    span = data_size - FINGERPRINT_BLOCK_BYTES
    for i in range(FINGERPRINT_BLOCK_COUNT):
        ranges.append((header_end + (i * span) // (FINGERPRINT_BLOCK_COUNT - 1), FINGERPRINT_BLOCK_BYTES))
    return ranges


def checkpoint_fingerprint(path: str | os.PathLike[str]) -> str:
    """The content fingerprint of a checkpoint file (``docs/format.md`` §10.2), lowercase hex.

    ``sha256(b"coldsnap-checkpoint-fingerprint-v1\\n" + u64le(size_bytes) + bytes of each range of
    fingerprint_ranges(size_bytes, N))``: the safetensors header (every tensor's name, dtype, shape and
    offsets, and the metadata) and 16 blocks of 128 KiB spread evenly over the data, or the whole file
    when it is small. It reads at most the header plus 2 MiB with ``os.pread``, so restore can check it on
    every start; it sees any change of the header or the size and any change that touches a sampled
    block, which a different fine-tune of the same base does (every tensor differs), but not an edit
    confined to bytes between the blocks (the full SHA-256 sees that).

    Raises:
        OSError: the file cannot be opened or read (``FileNotFoundError`` when it is missing).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER_LENGTH_BYTES, 0)
        header_length = int.from_bytes(head, "little") if len(head) == _HEADER_LENGTH_BYTES else None
        digest = hashlib.sha256(FINGERPRINT_DOMAIN + size.to_bytes(8, "little"))
        ranges = fingerprint_ranges(size, header_length)
        for offset, length in ranges:
            # Start every read at once: on a cold file the blocks then come in one round of
            # parallel disk reads instead of one seek after another.
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        for offset, length in ranges:
            while length:
                chunk = os.pread(fd, min(length, 8 * 1024 * 1024), offset)
                if not chunk:  # the file shrank while it was read: what was read is not this size's content
                    raise OSError(f"{os.fspath(path)} shrank while its fingerprint was read")
                digest.update(chunk)
                offset += len(chunk)
                length -= len(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


# --- checkpoint records ----------------------------------------------------------------------------

CHECKPOINT_RECORDS_DIRNAME = "checkpoint-records"
CHECKPOINT_RECORD_KIND = "coldsnap.checkpoint-record"
CHECKPOINT_RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """Evidence that the checkpoint file at ``path`` had ``sha256`` while it had this ``stat``.

    Attributes:
        path: the file's real path (``os.path.realpath``).
        device: ``st_dev``.
        inode: ``st_ino``.
        size_bytes: ``st_size``, bytes.
        mtime_ns: ``st_mtime_ns``, nanoseconds since the epoch.
        ctime_ns: ``st_ctime_ns``, nanoseconds since the epoch.
        sha256: SHA-256 (lowercase hex) of the whole file.
        hashed_at: UTC time of the hash, ISO 8601 with seconds.
    """

    path: str
    device: int
    inode: int
    size_bytes: int
    mtime_ns: int
    ctime_ns: int
    sha256: str
    hashed_at: str

    def matches(self, st: os.stat_result) -> bool:
        return (self.device, self.inode, self.size_bytes, self.mtime_ns, self.ctime_ns) == stat_identity(st)

    def to_json(self) -> dict[str, object]:
        return {
            "format": CHECKPOINT_RECORD_KIND,
            "format_version": CHECKPOINT_RECORD_VERSION,
            "path": self.path,
            "device": self.device,
            "inode": self.inode,
            "size_bytes": self.size_bytes,
            "mtime_ns": self.mtime_ns,
            "ctime_ns": self.ctime_ns,
            "sha256": self.sha256,
            "hashed_at": self.hashed_at,
        }

    @classmethod
    def from_fields(cls, f: Fields) -> CheckpointRecord:
        if f.str("format") != CHECKPOINT_RECORD_KIND:
            raise f.error("not a checkpoint record")
        if f.int("format_version") != CHECKPOINT_RECORD_VERSION:
            raise f.error("unsupported checkpoint record version")
        record = cls(
            path=f.str("path"),
            device=f.int("device"),
            inode=f.int("inode"),
            size_bytes=f.int("size_bytes"),
            mtime_ns=f.int("mtime_ns"),
            ctime_ns=f.int("ctime_ns"),
            sha256=f.sha256("sha256"),
            hashed_at=f.str("hashed_at"),
        )
        f.done()
        return record


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
    """The node-local checkpoint records of one state root: ``<state_root>/checkpoint-records/``.

    Each record is ``<sha256 of the file's real path>.record`` (JSON, mode 0444), trusted only while
    it is a regular file of at most 64 KiB owned by the current user and not group- or
    world-writable, parses strictly and names the file's real path. The folder is created 0700 and
    refused if it is a symbolic link (rule ``no-symlinks``).

    Args:
        state_root: the state root (``COLDSNAP_STATE_ROOT``).
    """

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
        """The record state of the checkpoint file ``path`` (its real path is used).

        Args:
            path: the checkpoint file (a symbolic link is resolved, as the engine's open does).
            st: a fresh ``os.stat`` of the file, if the caller has one.

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
            record = read_private_record(record_path, CheckpointRecord.from_fields)
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
        """Record that ``path`` (real path) had ``sha256`` while it had the ``stat`` ``hashed``.

        Written only if the file still has exactly that device, inode, size, mtime and ctime:
        temporary file (``O_EXCL | O_NOFOLLOW``), fsync, mode 0444, rename, folder fsync.

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
            if not self._folder_present():
                with contextlib.suppress(FileExistsError):
                    self.folder.mkdir(mode=0o700)
                self._folder_present()
        except OSError as exc:
            raise CacheError(f"cannot create the checkpoint records folder: {exc}", file=self.folder) from exc
        record = CheckpointRecord(
            path=real,
            device=current.st_dev,
            inode=current.st_ino,
            size_bytes=current.st_size,
            mtime_ns=current.st_mtime_ns,
            ctime_ns=current.st_ctime_ns,
            sha256=sha256,
            hashed_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        )
        final = self.record_path(real)
        temp = final.with_name(f".{final.name}.{secrets.token_hex(8)}.partial")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise CacheError(f"cannot create a checkpoint record: {exc}", file=temp) from exc
        try:
            try:
                write_all(fd, dump_document(record.to_json()), file=temp)
                os.fchmod(fd, 0o444)
                fsync_fd(fd, file=temp)
            finally:
                os.close(fd)
            os.rename(temp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        fsync_dir(self.folder)
        return record


def hash_checkpoint_file(path: str | os.PathLike[str], records: CheckpointRecords | None = None) -> tuple[str, int]:
    """SHA-256 and size of a checkpoint file (one read); with ``records``, record the result.

    A record that cannot be written is logged as a WARNING (the hash is still returned): without it,
    a later restore on this node checks the file by its content fingerprint only.
    """
    real = os.path.realpath(path)
    before = os.stat(real)
    digest, size = sha256_file(real)
    if records is not None:
        try:
            records.write(real, digest, before)
        except (OSError, CacheError, UnsafePathError) as exc:
            logger.warning("coldsnap: %s hashed, but its checkpoint record could not be written: %s", real, exc)
    return digest, size


def identify_checkpoint(
    files: Iterable[Path],
    *,
    source: str,
    revision: str | None = None,
    root: Path | None = None,
    config_sha256: str | None = None,
    records: CheckpointRecords | None = None,
) -> ModelIdentity:
    """Hash every checkpoint file (SHA-256, one pass each, and its :func:`checkpoint_fingerprint`)
    into a :class:`ModelIdentity`.

    Args:
        files: the checkpoint files.
        source: the Hugging Face repository id or the local folder the model was loaded from; a local
            folder is recorded by its real path (a trailing ``/`` or a symbolic link does not matter).
        revision: the repository revision, if any: for a repository id the commit hash it resolved
            to (:func:`resolve_hub_commit`), ``None`` for a local folder.
        root: names are recorded relative to this folder (default: each file's own folder).
        config_sha256: :func:`model_config_sha256` of the engine's model configuration, if known.
        records: write a checkpoint record for each file hashed (see :class:`CheckpointRecords`).
    """
    entries = []
    for path in files:
        path = Path(path)
        digest, size = hash_checkpoint_file(path, records)
        name = str(path.relative_to(root)) if root is not None else path.name
        entries.append(CheckpointFile(name, size, digest, checkpoint_fingerprint(path)))
    if os.path.isdir(source):
        source = os.path.realpath(source)
    return ModelIdentity(source, revision, tuple(sorted(entries, key=lambda c: c.name)), config_sha256)


# -- checked at restore: the model being loaded against the recorded identity ---------------------------


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """What the engine is loading, for the model identity check.

    Attributes:
        source: the engine's model (vLLM ``model_config.model``, SGLang ``model_config.model_path``):
            a repository id or a local folder.
        revision: for a repository id, the commit hash the engine's revision resolves to in the local
            Hugging Face cache (:func:`~coldsnap_core.model_identity.resolve_hub_commit`), else the
            engine's revision as given (``None`` when none; always the given value for a local folder).
        folder: the local checkpoint folder's real path when ``source`` is one, else ``None``.
        config_sha256: :func:`coldsnap_core.model_identity.model_config_sha256` of the engine's
            effective model configuration, or ``None`` when the caller has no engine configuration.
        requested_revision: the engine's revision as given (``None``: the default branch), for messages.
        checkpoint_files: for a local folder, the names (relative to ``folder``, ``/``-separated) of
            every checkpoint file the engine's own loader would read now (vLLM
            ``DefaultModelLoader._prepare_weights``: its glob and its index filter), or ``None`` when
            the caller cannot tell.
        checkpoint_files_error: why the engine could not list those files (a safetensors index
            naming a missing shard, malformed JSON, ...); the identity check then fails closed.
    """

    source: str
    revision: str | None
    folder: Path | None
    config_sha256: str | None = None
    requested_revision: str | None = None
    checkpoint_files: tuple[str, ...] | None = None
    checkpoint_files_error: str | None = None

    @classmethod
    def from_config(
        cls,
        source: str,
        revision: str | None,
        config_sha256: str | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        checkpoint_files: Iterable[str] | None = None,
        checkpoint_files_error: str | None = None,
    ) -> LoadedModel:
        """The model an engine loads from ``source`` at ``revision``.

        Args:
            source: a local folder or a Hugging Face repository id.
            revision: the engine's revision (vLLM ``model_config.revision``, a
                ``huggingface_hub.ResolvedRevision`` in vLLM 0.32; SGLang ``model_config.revision``).
            config_sha256: the engine's model configuration digest, if known.
            cache_dir: the Hugging Face cache the engine downloads into (vLLM/SGLang
                ``load_config.download_dir``); ``None`` means ``HF_HUB_CACHE``.
            checkpoint_files: for a local folder, the checkpoint files the engine would read (see
                ``checkpoint_files``); ignored for a repository id.
            checkpoint_files_error: why the engine could not list them, if it failed.
        """
        requested = None if revision is None else str(revision)
        if os.path.isdir(source):
            files = None if checkpoint_files is None else tuple(sorted(checkpoint_files))
            folder = Path(os.path.realpath(source))
            return cls(source, requested, folder, config_sha256, requested, files, checkpoint_files_error)
        commit = resolve_hub_commit(source, revision, cache_dir=cache_dir)
        return cls(source, commit if commit is not None else requested, None, config_sha256, requested)


def engine_checkpoint_files(
    source: str, engine: str, prepare_weights: Callable[[], Sequence[object]]
) -> tuple[list[str] | None, str | None]:
    """For a local checkpoint folder: the files the engine's own loader would read now, for
    :meth:`LoadedModel.from_config` (``checkpoint_files``, ``checkpoint_files_error``), so restore
    refuses a folder that gained or lost a shard.

    Args:
        source: the engine's model (a local folder or a repository id).
        engine: the engine's name, for the error text (``"vLLM"``, ``"SGLang"``).
        prepare_weights: calls the engine's ``DefaultModelLoader._prepare_weights`` (vLLM and SGLang:
            a glob of the folder for the load format and the safetensors index filter; no tensor is
            read), which returns ``(folder, files, ...)`` with ``files`` as paths in ``folder``.

    Returns:
        ``(names relative to the folder, "/"-separated, None)``; ``(None, None)`` for a repository id
        (its commit is checked instead); ``(None, why)`` when the engine cannot list them (an index
        naming a missing shard, a malformed index, no weights): the identity check then fails
        closed, as a plain load would.
    """
    if not os.path.isdir(source):
        return None, None
    try:
        folder, files = prepare_weights()[:2]
    except Exception as exc:  # whatever the engine raises, restore must not go ahead
        return None, f"{engine}'s _prepare_weights raised {type(exc).__name__}: {exc}"
    return [Path(os.path.relpath(f, folder)).as_posix() for f in files], None


def check_model_identity(
    recorded: ModelIdentity,
    loaded: LoadedModel,
    *,
    file: str | None = None,
    records: CheckpointRecords | None = None,
    verify_checkpoint: bool = False,
) -> None:
    """The artifact's pinned model must be the one being loaded.

    * A Hugging Face repository (``loaded.folder is None``): the same id and the same commit. Capture
      records the commit the revision (``main`` when none is given) resolved to in the local Hugging
      Face cache, and :meth:`LoadedModel.from_config` resolves the engine's revision the same way, so
      a repository whose ``main`` moved to another commit (same layout and config, other weights) is
      refused, and so is an engine whose cache cannot resolve a commit, or an artifact that recorded
      no commit (fail closed).
    * A local folder, by content and not by path (another node may mount it elsewhere; ``$M`` and
      ``$M/`` are one folder): every recorded checkpoint file exists with its size, and its SHA-256,
      where this node knows it, is the recorded one. It is known from a checkpoint record
      (:class:`~coldsnap_core.model_identity.CheckpointRecords`) that still matches the file's
      ``stat``; a file that changed since its record was written is hashed again (one read of that
      file, then recorded); a file without a record is hashed only with ``verify_checkpoint``
      (``COLDSNAP_VERIFY_CHECKPOINT=1``), else compared by its content fingerprint
      (:func:`~coldsnap_core.model_identity.checkpoint_fingerprint`: header plus 2 MiB sampled; an
      artifact that recorded none is accepted on name and size). When the engine says
      which files it would read (``loaded.checkpoint_files``), they must be exactly the recorded ones:
      a shard added to the folder (which a plain load would read too) or one the engine would no
      longer read is refused, and so is a folder whose files the engine cannot list. An artifact
      captured from a repository id is never restored into a local folder.
    * The engine's model configuration digest, when the engine gives one, equals the recorded one (an
      artifact captured without one is refused then).

    Raises:
        ModelIdentityMismatchError: names what differs (source, commit, configuration, a missing,
            resized or rewritten checkpoint file).
        UnsafePathError: the checkpoint records folder or a record is a symbolic link.
    """
    recorded_from_folder = os.path.isabs(recorded.source)  # a local folder is recorded by its real path
    if loaded.folder is None and (
        (recorded.source, recorded.revision) != (loaded.source, loaded.revision)
        or recorded.revision is None
        or COMMIT_HASH.fullmatch(recorded.revision) is None
    ):
        raise ModelIdentityMismatchError(_repository_mismatch(recorded, loaded), file=file)
    if loaded.folder is not None and not recorded_from_folder:
        raise ModelIdentityMismatchError(
            f"the artifact was captured from the Hugging Face repository {recorded.source!r} at revision"
            f" {recorded.revision}, the engine is loading the local folder {loaded.folder}; a folder is not"
            " checked against a repository commit (load the repository id, or capture from the folder)",
            file=file,
        )
    if loaded.config_sha256 is not None and recorded.config_sha256 != loaded.config_sha256:
        raise ModelIdentityMismatchError(
            f"the engine's model configuration (Hugging Face config after overrides, dtype, quantization) has digest"
            f" {loaded.config_sha256}, the artifact recorded {recorded.config_sha256} (a changed config.json,"
            " --hf-overrides or --dtype; buffers such as the rotary cache would come back with the captured values)",
            file=file,
        )
    if loaded.folder is None:
        return
    if loaded.checkpoint_files_error is not None:
        raise ModelIdentityMismatchError(
            f"the engine cannot say which checkpoint files of {loaded.folder} it would read"
            f" ({loaded.checkpoint_files_error}); a plain load would fail the same way",
            file=file,
        )
    if loaded.checkpoint_files is not None:
        recorded_names = {c.name for c in recorded.files}
        added = sorted(set(loaded.checkpoint_files) - recorded_names)
        dropped = sorted(recorded_names - set(loaded.checkpoint_files))
        if added or dropped:
            raise ModelIdentityMismatchError(
                f"the engine would read the checkpoint files {list(loaded.checkpoint_files)} of {loaded.folder}, the"
                f" artifact recorded {sorted(recorded_names)}"
                + (f"; not recorded: {added} (a plain load would read them too)" if added else "")
                + (f"; recorded but not read by the engine now: {dropped}" if dropped else ""),
                file=file,
            )
    for checkpoint in recorded.files:
        path = loaded.folder / checkpoint.name
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise ModelIdentityMismatchError(
                f"checkpoint file {checkpoint.name} recorded by the artifact is missing", file=path
            ) from None
        if st.st_size != checkpoint.size_bytes:
            raise ModelIdentityMismatchError(
                f"checkpoint file {checkpoint.name} is {st.st_size} bytes, the artifact recorded {checkpoint.size_bytes}",
                file=path,
            )
        digest, how = _checkpoint_digest(path, st, records, verify_checkpoint)
        if digest is not None and digest != checkpoint.sha256:
            raise ModelIdentityMismatchError(
                f"checkpoint file {checkpoint.name} has SHA-256 {digest} ({how}), the artifact recorded {checkpoint.sha256}:"
                " the file was replaced with other content of the same size",
                file=path,
            )
        if digest is None and checkpoint.fingerprint_sha256 is not None:
            # No full hash known on this node: the sampled fingerprint (docs/format.md §10.2) is what
            # tells two checkpoints with the same names and sizes apart (two fine-tunes of one base).
            fingerprint = checkpoint_fingerprint(path)
            if fingerprint != checkpoint.fingerprint_sha256:
                raise ModelIdentityMismatchError(
                    f"checkpoint file {checkpoint.name} has content fingerprint {fingerprint} (no checkpoint record on"
                    f" this node), the artifact recorded {checkpoint.fingerprint_sha256}: another checkpoint with the same"
                    " file names and sizes (a swapped fine-tune, a flipped symbolic link)",
                    file=path,
                )


def _repository_mismatch(recorded: ModelIdentity, loaded: LoadedModel) -> str:
    """Why a repository-id model identity differs (source, commit, or a revision without a commit)."""
    captured = f"the artifact was captured from {recorded.source!r} at revision {recorded.revision}"
    requested = loaded.requested_revision or "main"
    if recorded.source != loaded.source:
        return f"{captured}, the engine is loading {loaded.source!r} (revision {loaded.revision})"
    recorded_commit = recorded.revision is not None and COMMIT_HASH.fullmatch(recorded.revision) is not None
    loaded_commit = loaded.revision is not None and COMMIT_HASH.fullmatch(loaded.revision) is not None
    if recorded_commit and loaded_commit:
        return (
            f"{captured}, but the engine's {loaded.source!r} revision {requested} resolved to another commit,"
            f" {loaded.revision}, in the local Hugging Face cache: the repository moved (its weights may differ"
            " with the same layout and configuration); capture the artifact again or pin the captured commit"
            " with --revision"
        )
    if recorded_commit:
        return (
            f"{captured}, but the engine's {loaded.source!r} revision {requested} does not resolve to a commit in"
            " the local Hugging Face cache, so the commit being loaded cannot be checked"
        )
    if loaded_commit:
        return (
            f"{captured}, which is not a commit hash (an artifact captured before repository commits were"
            f" recorded, or from a revision the cache could not resolve); the engine's {loaded.source!r} revision"
            f" {requested} resolved to {loaded.revision}; capture the artifact again"
        )
    return f"{captured}, the engine is loading {loaded.source!r} at revision {loaded.revision} (no commit in the local cache)"


def _checkpoint_digest(
    path: Path, st: os.stat_result, records: CheckpointRecords | None, verify_checkpoint: bool
) -> tuple[str | None, str]:
    """The file's SHA-256 where it is known without trusting names and sizes, and how it is known."""
    lookup = records.lookup(path, st) if records is not None else None
    if lookup is not None and lookup.state is RecordState.TRUSTED:
        return lookup.sha256, "from this node's checkpoint record"
    if lookup is not None and lookup.state is RecordState.STALE:
        logger.info("coldsnap: %s; hashing it again", lookup.reason)
        return hash_checkpoint_file(path, records)[0], "hashed again: it changed since its checkpoint record"
    if verify_checkpoint:
        logger.info("coldsnap: hashing checkpoint file %s (COLDSNAP_VERIFY_CHECKPOINT=1)", path)
        return hash_checkpoint_file(path, records)[0], "hashed: COLDSNAP_VERIFY_CHECKPOINT=1"
    return None, "no checkpoint record on this node"
