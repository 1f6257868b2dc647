"""Restore one worker's weights from its pack and residual blob (the portable capture point).

Engine neutral: the vLLM loader (``coldsnap_vllm.loader``) and the SGLang loader
(``coldsnap_sglang.loader``) both call :class:`WorkerRestore` instead of reading the checkpoint, after
the engine built the model and before its post-processing (``DESIGN.md``, "Two capture points": "restore replaces ``load_weights``
with hydration, and the engine's own post-processing then runs as usual"). In order, each step
raising a :class:`~coldsnap_core.errors.ColdsnapError` subclass and nothing written before step 7:

1. ``artifact.json`` lists this worker (role, rank, world size, tensor parallel rank and size);
2. its unit capsule's manifests match their pins in ``artifact.json`` (size and SHA-256), parse and
   agree; the folder, the manifests and the entry name this worker; it names the pack
   ``artifact.json`` names and was taken at the portable capture point; every model extent comes
   from a checkpoint file of the model identity;
3. the live model's allocations have the captured layout (fingerprint, then every size): a payload
   captured from another architecture, dtype, layer count or tensor parallel size stops here;
4. the model being loaded is the captured one (:func:`check_model_identity`: a Hugging Face
   repository by id and resolved commit, a local folder by content; the engine's model configuration by
   digest): a payload of the same layout but other weights or another configuration stops here;
5. every manifest rule holds (:func:`coldsnap_core.verify.check_manifest`);
6. the pack is staged: a cached object without a trusted validation record is verified in full
   *with the manifest's layout*, so a corrupt extent is named by allocation and offset; a missing
   one is fetched from the configured payload store (:func:`coldsnap_core.staging.stage_payload`),
   else :class:`~coldsnap_core.errors.PayloadUnavailableError`;
7. :func:`coldsnap_core.hydrate.hydrate` checks the blob and fills every allocation.

Only this worker's payload is staged (seed 000, "Restore").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core._io import unexpected_os_error
from coldsnap_core.artifact import Capsule, check_provenance_in_identity, find_worker, read_descriptor, read_worker_capsule
from coldsnap_core.cache import PayloadCache, refuse_symlink
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.errors import (
    ArtifactError,
    IntegrityError,
    MissingObjectError,
    ModelIdentityMismatchError,
    PayloadUnavailableError,
    StoreError,
    ValidationRecordError,
)
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME
from coldsnap_core.format.manifest import ModelIdentity, NativeManifest, WorkerIdentity
from coldsnap_core.format.pack_layout import PackLayout
from coldsnap_core.hydrate import HydrationReport, hydrate
from coldsnap_core.model_identity import (
    COMMIT_HASH,
    CheckpointRecords,
    RecordState,
    checkpoint_fingerprint,
    hash_checkpoint_file,
    resolve_hub_commit,
)
from coldsnap_core.records import identity, read_trusted_record, record_verified
from coldsnap_core.staging import stage_payload
from coldsnap_core.stores import from_env as store_from_env
from coldsnap_core.torch_allocations import TorchAllocations
from coldsnap_core.verify import check_live_layout, check_manifest, extent_owner_map, verify_pack_file

logger = logging.getLogger(__name__)


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


class _DropQuarantineNotice(logging.Filter):
    """Drops the cache's own "quarantined" WARNING: the loader reports the quarantine in its one
    fallback WARNING (``quarantined_to``) instead of a second line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "quarantined" not in record.getMessage()


def quarantine_quietly(cache: PayloadCache, digest: str) -> Path | None:
    """:meth:`PayloadCache.quarantine` without its log line; return where the object went."""
    records_logger = logging.getLogger("coldsnap_core.records")
    notice = _DropQuarantineNotice()
    records_logger.addFilter(notice)
    try:
        return cache.quarantine(digest)
    finally:
        records_logger.removeFilter(notice)


def verify_untrusted_pack(
    cache: PayloadCache, manifest: NativeManifest, layout: PackLayout, *, manifest_file: str | None = None
) -> Path | None:
    """If the cached pack exists without a trusted validation record, verify it in full with the
    manifest's layout (padding and each stored extent, then the file's SHA-256) and record it.

    This is the verifier's own pass (:func:`coldsnap_core.verify.verify_pack_file`), run with the
    layout so that a corrupt byte is reported as the extent that holds it (allocation and offset),
    not only as a wrong file digest. A corrupt object is quarantined (the error then carries the
    quarantine path in ``quarantined_to``). An absent object is left to staging.

    Raises:
        PackSizeMismatchError, NonZeroPaddingError, ExtentDigestMismatchError,
        PackDigestMismatchError: the object is corrupt (now quarantined).
        ManifestPaddingError, ManifestExtentDigestError: the object is intact (its SHA-256 is its
            name) and ``manifest_file`` is wrong about it; the object stays in the cache.
        UnsafePathError: a symbolic link at the object or record path.
    """
    digest = manifest.pack.sha256
    path = cache.object_path(digest)
    if not cache.check_dirs():
        return
    st = refuse_symlink(path)
    if st is None:
        return
    try:
        read_trusted_record(cache, digest, st)
        return
    except ValidationRecordError as exc:
        logger.info("coldsnap: verifying %s in full against the manifest (%s)", path, exc.detail)
    with cache.lock(digest, required=True):
        st = refuse_symlink(path)
        if st is None:
            return
        try:
            verify_pack_file(path, manifest.pack, layout, extent_owner=extent_owner_map(manifest), manifest_file=manifest_file)
        except IntegrityError as exc:
            exc.quarantined_to = quarantine_quietly(cache, digest)  # type: ignore[attr-defined]
            raise
        after = refuse_symlink(path)
        if after is not None and identity(after) == identity(st):
            record_verified(cache, digest, after)


@dataclass
class WorkerRestore:
    """One restore attempt of one worker (see the module docstring for the steps).

    Args:
        artifact_dir: the artifact folder.
        worker: this worker's identity.
        loaded: the model being loaded.
        cache: the node-local cache (its state root also holds the checkpoint records).
        verify_extents: hash every model extent while hydrating.
        verify_checkpoint: hash local checkpoint files this node has no checkpoint record of
            (``COLDSNAP_VERIFY_CHECKPOINT=1``).

    Attributes:
        capsule: this worker's capsule, once read (step 2); ``None`` before.
        layout_matches: whether the live layout matched the manifest (step 4 passed).
        pack_unavailable: whether the attempt failed because the pack cannot be served: no source
            has it, or the cached object proved corrupt and was quarantined. After a recovery load
            the loader then materializes it.
    """

    artifact_dir: Path
    worker: WorkerIdentity
    loaded: LoadedModel
    cache: PayloadCache
    verify_extents: bool = False
    verify_checkpoint: bool = False
    capsule: Capsule | None = None
    layout_matches: bool = False
    pack_unavailable: bool = False
    _recorded_model: ModelIdentity | None = None

    @property
    def manifest(self) -> NativeManifest | None:
        return self.capsule.native if self.capsule is not None else None

    def read(self) -> Capsule:
        """Steps 1-2: find and read this worker's capsule.

        Raises:
            MissingObjectError: no ``artifact.json``, no entry for this worker, or a missing capsule file.
            CapsulePinMismatchError: a manifest does not match its pin in ``artifact.json``.
            ManifestMismatchError: the capsule disagrees with itself, its folder name or its entry
                (worker, payload), or a model extent names a file the model identity does not list.
            ArtifactError: the capsule was captured at the native capture point.
            ManifestError: a document is malformed.
        """
        descriptor = read_descriptor(self.artifact_dir)
        entry = find_worker(descriptor, self.worker)
        capsule = read_worker_capsule(self.artifact_dir, entry)
        manifest_file = str(capsule.native_manifest_path)
        check_provenance_in_identity(capsule.native, descriptor.model, file=manifest_file)
        if capsule.native.capture_point != "portable":
            raise ArtifactError(
                f"the capsule was captured at the {capsule.native.capture_point} capture point; the loader restores"
                " portable captures only (a native capture is restored by the level-1 wake)",
                file=manifest_file,
            )
        self.capsule = capsule
        self._recorded_model = descriptor.model
        return capsule

    def run(self, allocations: TorchAllocations, backend: CopyBackend) -> HydrationReport:
        """Steps 1-7. On return every byte of every allocation holds the captured bytes.

        Raises:
            ColdsnapError: the subclass of the first failed check (see the module docstring); an
                ``OSError`` no layer typed is raised as ``FileAccessError`` (rule ``io``), so the
                loaders' ``COLDSNAP_RESTORE=auto`` fallback sees only typed errors.
        """
        try:
            return self._run(allocations, backend)
        except OSError as exc:
            raise unexpected_os_error(exc) from exc

    def _run(self, allocations: TorchAllocations, backend: CopyBackend) -> HydrationReport:
        capsule = self.capsule or self.read()
        manifest = capsule.native
        manifest_file = str(capsule.native_manifest_path)
        check_live_layout(
            manifest.allocations,
            allocations.allocation_map,
            allocations.live,
            file=manifest_file,
            manifest_fingerprint=manifest.layout_fingerprint,
        )
        self.layout_matches = True
        assert self._recorded_model is not None
        check_model_identity(
            self._recorded_model,
            self.loaded,
            file=str(self.artifact_dir / DESCRIPTOR_FILENAME),
            records=CheckpointRecords(self.cache.state_root),
            verify_checkpoint=self.verify_checkpoint,
        )
        layout = check_manifest(manifest, file=manifest_file)
        try:
            verify_untrusted_pack(self.cache, manifest, layout, manifest_file=manifest_file)
            stage_payload(manifest.pack, cache=self.cache, store=store_from_env())
        except (PayloadUnavailableError, StoreError):
            self.pack_unavailable = True
            raise
        except MissingObjectError as exc:
            self.pack_unavailable = True
            raise PayloadUnavailableError(exc.detail, file=exc.file) from exc
        except IntegrityError:
            self.pack_unavailable = not self.cache.object_path(manifest.pack.sha256).exists()
            raise
        try:
            return hydrate(
                manifest,
                blob_path=capsule.blob_path,
                cache=self.cache,
                allocations=allocations.live,
                backend=backend,
                live_layout=allocations.allocation_map,
                verify_extents=self.verify_extents,
                manifest_file=manifest_file,
            )
        except IntegrityError as exc:
            # hydrate re-verifies an admitted pack whose padding or extent disagreed and quarantines
            # it when it is proven corrupt (an edit in place that a validation record cannot see).
            if getattr(exc, "quarantined_to", None) is not None:
                self.pack_unavailable = True
            raise
