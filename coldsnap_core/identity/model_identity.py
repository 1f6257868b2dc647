"""The pinned model identity (``docs/format.md`` §4.8, §10): produced at capture (:func:`identify_checkpoint`), checked
at restore (:func:`check_model_identity`, before any payload byte is read) against :class:`LoadedModel`."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from coldsnap_core.errors import ModelIdentityMismatchError
from coldsnap_core.format.descriptor import CapsuleFile
from coldsnap_core.format.manifest import CheckpointFile, ModelIdentity
from coldsnap_core.identity.checkpoint_records import CheckpointRecords, RecordState, hash_checkpoint_file
from coldsnap_core.identity.config_digest import config_differences, config_json_sha256
from coldsnap_core.identity.fingerprint import checkpoint_fingerprint
from coldsnap_core.identity.hub_commit import COMMIT_HASH, resolve_hub_commit
from coldsnap_core.identity.model_folder import check_model_file, holds_weight_files

logger = logging.getLogger(__name__)


def identify_checkpoint(
    files: Iterable[Path],
    *,
    source: str,
    revision: str | None = None,
    root: Path | None = None,
    config_sha256: str | None = None,
    records: CheckpointRecords | None = None,
    config_json: str | None = None,
) -> ModelIdentity:
    """Hash every checkpoint file (SHA-256 and :func:`checkpoint_fingerprint`) into a :class:`ModelIdentity`, names
    relative to ``root`` (default: each file's own folder); ``revision``: a repository id's commit hash
    (:func:`resolve_hub_commit`), else ``None``."""
    entries = []
    for path in files:
        path = Path(path)
        digest, size = hash_checkpoint_file(path, records)
        name = str(path.relative_to(root)) if root is not None else path.name
        entries.append(CheckpointFile(name, size, digest, checkpoint_fingerprint(path)))
    if os.path.isdir(source):
        source = os.path.realpath(source)
    if config_json is not None and config_sha256 is None:
        config_sha256 = config_json_sha256(config_json)
    config = msgspec.UNSET if config_json is None else config_json
    return ModelIdentity(source, revision, tuple(sorted(entries, key=lambda c: c.name)), config_sha256, config)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """What the engine is loading, for the model identity check (build it with :meth:`from_config`).

    Attributes:
        revision: for a repository id, the commit its revision resolves to in the local cache, else as given.
        checkpoint_files: for a local folder, the files (relative, ``/``-separated) the engine's loader would read
            now (:func:`engine_checkpoint_files`), or ``None`` when unknown; empty when it holds no weight file.
        checkpoint_files_error: why the engine could not list them; the identity check then fails closed.
    """

    source: str
    revision: str | None
    folder: Path | None
    config_sha256: str | None = None
    requested_revision: str | None = None
    checkpoint_files: tuple[str, ...] | None = None
    checkpoint_files_error: str | None = None
    config_json: str | None = None

    @property
    def checkpoint_absent(self) -> bool:
        """Whether the engine loads a local folder that holds no weight file (``docs/format.md`` §10.1)."""
        return self.folder is not None and self.checkpoint_files == ()

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
        config_json: str | None = None,
    ) -> LoadedModel:
        """The model an engine loads from ``source`` (a folder or a repository id) at ``revision`` (vLLM's may be a
        ``huggingface_hub.ResolvedRevision``); ``cache_dir`` is the engine's ``load_config.download_dir``."""
        requested = None if revision is None else str(revision)
        if os.path.isdir(source):
            files = None if checkpoint_files is None else tuple(sorted(checkpoint_files))
            folder = Path(os.path.realpath(source))
            return cls(source, requested, folder, config_sha256, requested, files, checkpoint_files_error, config_json)
        commit = resolve_hub_commit(source, revision, cache_dir=cache_dir)
        return cls(source, commit if commit is not None else requested, None, config_sha256, requested, None, None, config_json)


def engine_checkpoint_files(
    source: str, engine: str, prepare_weights: Callable[[], Sequence[object]]
) -> tuple[list[str] | None, str | None]:
    """``(checkpoint_files, checkpoint_files_error)`` for :meth:`LoadedModel.from_config` from ``prepare_weights``
    (the engine's ``DefaultModelLoader._prepare_weights``; ``docs/format.md`` §10.1): ``([], None)`` when it finds no
    weights in a folder without weight files, ``(None, None)`` for a repository id, ``(None, why)`` when it raises.

    Raises:
        FileAccessError: the folder cannot be listed.
    """
    if not os.path.isdir(source):
        return None, None
    try:
        folder, files = prepare_weights()[:2]
    except Exception as exc:  # whatever the engine raises, restore must not go ahead
        if not holds_weight_files(Path(source)):
            return [], None
        return None, f"{engine}'s _prepare_weights raised {type(exc).__name__}: {exc}"
    return [Path(os.path.relpath(f, folder)).as_posix() for f in files], None


def check_model_identity(
    recorded: ModelIdentity,
    loaded: LoadedModel,
    *,
    file: str | None = None,
    records: CheckpointRecords | None = None,
    verify_checkpoint: bool = False,
    model_files: tuple[CapsuleFile, ...] = (),
) -> None:
    """The artifact's pinned model must be the one being loaded (``docs/format.md`` rule 32, §10.1: how each kind of
    source is checked), in the order a user fixes them; ``verify_checkpoint``: hash files without a checkpoint record.

    Raises:
        ModelIdentityMismatchError: names what differs.
        UnsafePathError: the checkpoint records folder or a record is a symbolic link.
    """
    if loaded.checkpoint_absent:  # a folder without the checkpoint: its pinned model files, then the configuration digest
        if not model_files:
            raise ModelIdentityMismatchError(
                f"{loaded.folder} holds no checkpoint weights, and the artifact pins no model files to check it by"
                " (artifact.json has no model_files: its capture copied none); serve from the checkpoint folder",
                file=file,
            )
        for pin in model_files:  # before the configuration digest: a changed config.json is named as such
            where = f"the artifact ({file})" if file else "the artifact"
            check_model_file(loaded.folder / pin.name, pin, where=where)
        _check_config(recorded, loaded, file)
        return
    if loaded.folder is None and (
        (recorded.source, recorded.revision) != (loaded.source, loaded.revision)
        or recorded.revision is None
        or COMMIT_HASH.fullmatch(recorded.revision) is None
    ):
        raise ModelIdentityMismatchError(
            _repository_mismatch(recorded, loaded),
            file=file,
            remedy=f"serve {recorded.source!r} at the captured commit (--revision {recorded.revision}), or export the artifact again",
        )
    if loaded.folder is not None and not os.path.isabs(recorded.source):  # a local folder is recorded by its real path
        raise ModelIdentityMismatchError(
            f"the artifact was captured from the Hugging Face repository {recorded.source!r} at revision"
            f" {recorded.revision}, the engine is loading the local folder {loaded.folder}; a folder is not"
            " checked against a repository commit (load the repository id, or capture from the folder)",
            file=file,
        )
    _check_config(recorded, loaded, file)
    if loaded.folder is None:
        return
    if loaded.checkpoint_files_error is not None:
        raise ModelIdentityMismatchError(
            f"the engine cannot say which checkpoint files of {loaded.folder} it would read"
            f" ({loaded.checkpoint_files_error}); a plain load would fail the same way",
            file=file,
        )
    recorded_names = {c.name for c in recorded.files}  # exactly the files the engine would read, when it says
    if loaded.checkpoint_files is not None and set(loaded.checkpoint_files) != recorded_names:
        added = sorted(set(loaded.checkpoint_files) - recorded_names)
        dropped = sorted(recorded_names - set(loaded.checkpoint_files))
        raise ModelIdentityMismatchError(
            f"the engine would read the checkpoint files {list(loaded.checkpoint_files)} of {loaded.folder}, the"
            f" artifact recorded {sorted(recorded_names)}"
            + (f"; not recorded: {added} (a plain load would read them too)" if added else "")
            + (f"; recorded but not read by the engine now: {dropped}" if dropped else ""),
            file=file,
        )
    for checkpoint in recorded.files:
        _check_checkpoint_file(checkpoint, loaded.folder / checkpoint.name, records, verify_checkpoint)


def _check_config(recorded: ModelIdentity, loaded: LoadedModel, file: str | None) -> None:
    """The engine's configuration digest, when it gives one, equals the recorded one (naming the keys that differ)."""
    if loaded.config_sha256 is None or recorded.config_sha256 == loaded.config_sha256:
        return
    both_known = recorded.config is not msgspec.UNSET and loaded.config_json is not None
    differences = config_differences(recorded.config, loaded.config_json) if both_known else []
    if differences:
        what = "; ".join(differences)
    elif recorded.config_sha256 is None:
        what = "the artifact was captured without an engine configuration, so this engine's cannot be checked"
    else:
        what = "a changed config.json, --hf-overrides or --dtype (the artifact records no configuration keys to name)"
    remedy = (
        "start the engine with the model and flags the artifact was exported with (--hf-overrides, --dtype), or export"
        " the artifact again from this configuration"
    )
    if both_known:
        dtypes = (json.loads(loaded.config_json).get("dtype"), json.loads(recorded.config).get("dtype"))
        if dtypes[0] != dtypes[1]:  # the commonest cause, named as the engine flag that fixes it
            remedy = f"start the engine with --dtype {dtypes[1]} (the exported dtype), or export again with --dtype {dtypes[0]}"
    raise ModelIdentityMismatchError(
        f"the engine is loading another model configuration than the artifact's: {what}. The engine loads"
        f" {loaded.source} (configuration digest {loaded.config_sha256}), the artifact was captured from"
        f" {recorded.source} (configuration digest {recorded.config_sha256}); Hugging Face config after overrides,"
        " dtype and quantization must be equal (buffers such as the rotary cache would come back with the captured"
        " values)",
        file=file,
        remedy=remedy,
    )


def _check_checkpoint_file(
    checkpoint: CheckpointFile, path: Path, records: CheckpointRecords | None, verify_checkpoint: bool
) -> None:
    """One recorded checkpoint file: present, its size, then its SHA-256 where known, else its fingerprint."""
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
            " with the same layout and configuration)"
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
