"""Restore one worker's weights from its pack and residual blob (the portable capture point).

Engine neutral: the vLLM loader (``coldsnap_vllm.loader``) and the SGLang loader
(``coldsnap_sglang.loader``) both call :func:`restore_or_fall_back` instead of reading the checkpoint,
after the engine built the model and before its post-processing (vLLM
``DefaultModelLoader.load_weights`` runs before ``process_weights_after_loading``; SGLang
``DefaultModelLoader.load_weights_and_postprocess``), so the engine's own post-processing then runs as
usual. :class:`WorkerRestore` is one linear pipeline; every check runs once and hands its result to
the next step, each step raises a :class:`~coldsnap_core.errors.ColdsnapError` subclass, and nothing
is written into the model before step 7 (or the fetch of step 6, which fills the model as the pack lands):

1. **read**: ``artifact.json`` lists this worker (role, rank, world size, tensor parallel rank and
   size); its unit capsule's manifests match their pins in ``artifact.json`` (size and SHA-256), parse
   and agree; the folder, the manifests and the entry name this worker; it names the pack
   ``artifact.json`` names and was taken at the portable capture point; every model extent comes from
   a checkpoint file of the model identity;
2. **qualify**: the capsule's residual qualifies for this target (:meth:`WorkerRestore.qualify`,
   :func:`coldsnap_core.restore.overlay.select_capsule`: engine, engine version, torch and its CUDA version,
   device type, accelerator model and NVIDIA driver equal to the ones ``target.json`` records, else
   this node's target-local overlay for exactly this target): a capsule captured by another engine or
   another runtime stops here, before its layout is compared (``docs/format.md`` §15); the pack is
   never refused for this (model bytes are target independent);
3. **identity**: the model being loaded is the captured one
   (:func:`coldsnap_core.identity.model_identity.check_model_identity`: a Hugging Face repository by id and
   resolved commit, a local folder by content; the engine's model configuration by digest), before the layout,
   so another model (another layer count, another fine-tune) is named by both models' sources and configuration;
4. **layout**: the live model's allocations have the captured layout (fingerprint, then every size):
   the same model built another way (dtype, tensor parallel size) stops here
   (:func:`coldsnap_core.format.verify.check_live_layout`);
5. **manifest**: every manifest rule holds (:func:`coldsnap_core.format.verify.check_manifest`), which
   gives the pack's canonical layout;
6. **admit**: the cache's one door (:meth:`coldsnap_core.cache.payload_cache.PayloadCache.admit`) accepts the pack on
   a trusted validation record, or checks every stored extent and padding byte against *the manifest's
   layout* on a pool of threads (a failure is judged by the full verification, which names a corrupt
   extent by allocation and offset and quarantines the pack; the whole-file SHA-256 and the record
   follow after the copy, on a daemon thread: :meth:`~coldsnap_core.cache.payload_cache.PayloadCache.record_in_background`); a pack the cache lacks, or
   one it just quarantined, is fetched from the configured payload store (:func:`coldsnap_core.restore.staging.stage_payload`), else
   :class:`~coldsnap_core.errors.PayloadUnavailableError`;
7. **hydrate**: :func:`coldsnap_core.restore.hydrate.hydrate` checks the residual blob and the pack's padding
   and fills every allocation from the admitted pack (no second manifest, layout or record check). A pack
   fetched in step 6 is hydrated in the same pass instead: the fetch copies each stored extent into its
   allocations and checks its SHA-256 as soon as its bytes have landed, and each padding run as it lands
   (:class:`coldsnap_core.restore.staging.FillAsLanded`, ``docs/format.md`` §12.4), then commits the pack on its
   whole-file SHA-256; :func:`coldsnap_core.restore.hydrate.hydrate_residual` then checks and copies the blob. A
   refused fetch leaves the allocations partly written and raises, so the attempt is never reported restored
   (``auto`` falls back to a load that overwrites every byte).

Only this worker's payload is staged (``docs/format.md``: each worker's capsule names its own pack).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core._io import unexpected_os_error
from coldsnap_core.artifact.capsules import (
    Capsule,
    check_provenance_in_identity,
    find_worker,
    read_descriptor_bytes,
    read_worker_capsule,
)
from coldsnap_core.cache.pack_use import hold_pack
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.copy.select import copy_backend_for
from coldsnap_core.copy.torch_allocations import TorchAllocations, enumerate_allocations
from coldsnap_core.errors import (
    ArtifactError,
    CheckpointAbsentError,
    ColdsnapError,
    IntegrityError,
    MissingObjectError,
    ModelIdentityMismatchError,
    PayloadUnavailableError,
    StoreError,
    TargetMismatchError,
)
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, CapsuleFile, WorkerEntry
from coldsnap_core.format.manifest import ModelIdentity, NativeManifest, WorkerIdentity
from coldsnap_core.format.pack_layout import PackLayout
from coldsnap_core.format.target import TargetIdentity
from coldsnap_core.format.verify import check_live_layout, check_manifest, extent_owner_map
from coldsnap_core.identity.checkpoint_records import CheckpointRecords
from coldsnap_core.identity.model_identity import LoadedModel, check_model_identity
from coldsnap_core.identity.target import ENGINE_NONE, collect_target
from coldsnap_core.restore.hydrate import AdmittedPack, HydrationReport, hydrate_admitted, hydrate_residual, plan_hydration
from coldsnap_core.restore.overlay import Selection, select_capsule
from coldsnap_core.restore.staging import FillAsLanded, stage_payload
from coldsnap_core.settings import ColdsnapSettings
from coldsnap_core.stores import from_settings as store_from_settings
from coldsnap_core.stores.base import PayloadStore

logger = logging.getLogger(__name__)

__all__ = [
    "RestoreResult",
    "WorkerRestore",
    "restore_or_fall_back",
]


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
        engine: the engine restoring (``vllm``, ``sglang``; :data:`~coldsnap_core.identity.target.ENGINE_NONE`
            without one), for the target identity.
        engine_version: its version string.
        target: the current target identity; default: :func:`coldsnap_core.identity.target.collect_target`
            of ``engine`` on the allocations' device, collected in :meth:`run`.
        use_overlays: select this node's target-local overlays (``COLDSNAP_OVERLAY`` is not ``off``).
        store: where a pack missing from the cache is fetched from (the store the resolved settings
            configure, :func:`coldsnap_core.stores.from_settings`); ``None`` (the default): nowhere.

    Attributes:
        capsule: the capsule restored from: the portable one once read (step 1), this node's overlay
            once step 2 selected it; ``None`` before.
        portable_capsule: the artifact's capsule of this worker, once read.
        selection: which capsule step 2 chose and why (:class:`coldsnap_core.restore.overlay.Selection`).
        descriptor_sha256: SHA-256 of the ``artifact.json`` bytes step 1 parsed (overlays bind to it).
        target_mismatch: the qualification error when step 2 refused the capsule (the loader then
            captures a target-local overlay after its checkpoint load), else ``None``.
        layout_matches: whether the live layout matched the manifest (step 4 passed).
        pack_unavailable: whether the attempt failed because the pack cannot be served: no source
            has it, or the cached object proved corrupt and was quarantined. After a recovery load
            the loader then materializes it.
        stage_seconds: wall time of staging the pack from :attr:`store` (the cache lacked it), seconds, also
            when staging failed; ``None`` when the store was not contacted.
        fetched_bytes: bytes the store wrote into the cache's temporary file while staging.
    """

    artifact_dir: Path
    worker: WorkerIdentity
    loaded: LoadedModel
    cache: PayloadCache
    verify_extents: bool = False
    verify_checkpoint: bool = False
    engine: str = ENGINE_NONE
    engine_version: str | None = None
    target: TargetIdentity | None = None
    use_overlays: bool = True
    store: PayloadStore | None = None
    capsule: Capsule | None = None
    portable_capsule: Capsule | None = None
    selection: Selection | None = None
    descriptor_sha256: str | None = None
    target_mismatch: TargetMismatchError | None = None
    layout_matches: bool = False
    pack_unavailable: bool = False
    stage_seconds: float | None = None
    fetched_bytes: int = 0
    _recorded_model: ModelIdentity | None = None
    _model_files: tuple[CapsuleFile, ...] = ()
    _entry: WorkerEntry | None = None

    @classmethod
    def for_settings(
        cls,
        settings: ColdsnapSettings,
        worker: WorkerIdentity,
        loaded: LoadedModel,
        cache: PayloadCache,
        engine: str,
        engine_version: str | None,
        store: PayloadStore | None,
    ) -> WorkerRestore:
        """The attempt the resolved ``settings`` ask for (artifact folder, verification flags, overlay
        use), by ``engine`` at ``engine_version``, fetching a missing pack from ``store``."""
        assert settings.artifact_dir is not None
        return cls(
            settings.artifact_dir,
            worker,
            loaded,
            cache,
            verify_extents=settings.verify_extents,
            verify_checkpoint=settings.verify_checkpoint,
            engine=engine,
            engine_version=engine_version,
            use_overlays=settings.overlay != "off",
            store=store,
        )

    @property
    def entry(self) -> WorkerEntry | None:
        """This worker's ``artifact.json`` entry, once read."""
        return self._entry

    @property
    def recorded_model(self) -> ModelIdentity | None:
        """The artifact's pinned model identity, once read."""
        return self._recorded_model

    @property
    def manifest(self) -> NativeManifest | None:
        return self.capsule.native if self.capsule is not None else None

    def read(self) -> Capsule:
        """Step 1: find and read this worker's capsule.

        Raises:
            MissingObjectError: no ``artifact.json``, no entry for this worker, or a missing capsule file.
            CapsulePinMismatchError: a manifest does not match its pin in ``artifact.json``.
            ManifestMismatchError: the capsule disagrees with itself, its folder name or its entry
                (worker, payload), or a model extent names a file the model identity does not list.
            ArtifactError: the capsule was captured at the native capture point.
            ManifestError: a document is malformed.
        """
        descriptor, self.descriptor_sha256 = read_descriptor_bytes(self.artifact_dir)
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
        self.capsule = self.portable_capsule = capsule
        self._recorded_model = descriptor.model
        self._model_files = descriptor.pinned_model_files
        self._entry = entry
        return capsule

    def current_target(self, allocations: TorchAllocations) -> TargetIdentity:
        """The target this restore runs on (``target``, else collected once for the allocations' device)."""
        if self.target is None:
            self.target = collect_target(self.engine, self.engine_version, device=allocations.device)
        return self.target

    def qualify(self, capsule: Capsule, allocations: TorchAllocations) -> Capsule:
        """Step 2: choose the capsule whose residual qualifies for this target, before any byte is
        written (:func:`coldsnap_core.restore.overlay.select_capsule`): the portable capsule when its
        ``target.json`` qualifies, else this node's target-local overlay or qualification record for
        exactly this target. Sets :attr:`selection` and :attr:`capsule`.

        Raises:
            TargetMismatchError: no capsule qualifies (the differing fields are named with both
                values; another engine first); also kept in :attr:`target_mismatch`.
            ManifestMismatchError: an overlay's model extent names a file the model identity lacks.
        """
        current = self.current_target(allocations)
        assert self._entry is not None and self._recorded_model is not None
        try:
            selection = select_capsule(
                artifact_dir=self.artifact_dir,
                entry=self._entry,
                portable=capsule,
                current=current,
                state_root=self.cache.state_root,
                descriptor_sha256=self.descriptor_sha256 or "",
                use_overlays=self.use_overlays,
            )
        except TargetMismatchError as exc:
            self.target_mismatch = exc
            raise
        if selection.source == "overlay":
            check_provenance_in_identity(
                selection.capsule.native, self._recorded_model, file=str(selection.capsule.native_manifest_path)
            )
        if selection.source != "portable":
            logger.info(
                "coldsnap: %s: restoring with %s (%s)", self.worker.capsule_name, selection.overlay_path, selection.reason
            )
        self.selection = selection
        self.capsule = selection.capsule
        return selection.capsule

    def check_identity(self) -> None:
        """Step 3: the model being loaded is the one the artifact pins (:func:`check_model_identity`).

        Raises:
            ModelIdentityMismatchError: see :func:`check_model_identity`.
        """
        assert self._recorded_model is not None
        check_model_identity(
            self._recorded_model,
            self.loaded,
            file=str(self.artifact_dir / DESCRIPTOR_FILENAME),
            records=CheckpointRecords(self.cache.state_root),
            verify_checkpoint=self.verify_checkpoint,
            model_files=self._model_files,
        )

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
        capsule = self.qualify(self.portable_capsule or self.read(), allocations)
        manifest = capsule.native
        manifest_file = str(capsule.native_manifest_path)
        # the model before its layout: another model (30 layers against 2) is named as such, by its sources and
        # configuration, not by the first allocation whose size happens to differ
        self.check_identity()
        check_live_layout(
            manifest.allocations,
            allocations.allocation_map,
            allocations.live,
            file=manifest_file,
            manifest_fingerprint=manifest.layout_fingerprint,
        )
        self.layout_matches = True
        layout = check_manifest(manifest, file=manifest_file)
        # held from admission (or staging) until the copy ends: `coldsnap cache rm` and gc leave the pack
        try:
            with hold_pack(self.cache, manifest.pack.sha256):
                ops = [op for op in plan_hydration(manifest) if op.source == "pack"]
                onepass = FillAsLanded(
                    ops, lambda ops, pack: backend.fill(ops, {"pack": pack}, allocations.live, verify_extents=True)
                )
                pack_path = self._admit(manifest, layout, manifest_file, onepass)
                if onepass.filled:
                    assert self.stage_seconds is not None
                    return hydrate_residual(
                        manifest,
                        blob_path=capsule.blob_path,
                        allocations=allocations.live,
                        backend=backend,
                        pack_seconds=self.stage_seconds,
                    )
                try:
                    return hydrate_admitted(
                        manifest,
                        AdmittedPack(pack_path, layout),
                        blob_path=capsule.blob_path,
                        cache=self.cache,
                        allocations=allocations.live,
                        backend=backend,
                        verify_extents=self.verify_extents,
                        manifest_file=manifest_file,
                    )
                except IntegrityError as exc:
                    # hydrate re-verifies an admitted pack whose padding or extent disagreed and quarantines
                    # it when it is proven corrupt (an edit in place that a validation record cannot see).
                    if getattr(exc, "quarantined_to", None) is not None:
                        self.pack_unavailable = True
                    raise
        finally:
            # a pack admitted by its extents gets its whole-file hash and record now, off the load's path
            self.cache.record_in_background()

    def _admit(self, manifest: NativeManifest, layout: PackLayout, manifest_file: str, onepass: FillAsLanded) -> Path:
        """Step 6: the cache admits the pack once (record or full verification with the layout;
        quarantine on failure, reported in the loader's fallback line rather than a second WARNING);
        a pack the cache lacks, or one it just quarantined while a payload store is configured, goes to the store,
        whose fetch fills the allocations as it lands (``onepass``)."""
        pack = manifest.pack
        try:
            try:
                return self.cache.admit(
                    pack.sha256,
                    pack.size_bytes,
                    layout=layout,
                    extent_owner=extent_owner_map(manifest),
                    manifest_file=manifest_file,
                    log_quarantine=False,
                )
            except MissingObjectError:
                return self._stage(manifest, layout, onepass)
            except IntegrityError as exc:
                if self.store is None or self.cache.object_path(pack.sha256).exists():
                    raise
                # quarantined: the store's copy replaces it in this start, as `coldsnap stage` does
                logger.warning(
                    "coldsnap: cached pack %s is corrupt (%s; quarantined as %s); fetching it again from %s",
                    pack.sha256,
                    exc.detail,
                    getattr(exc, "quarantined_to", None),
                    self.store.name,
                )
                return self._stage(manifest, layout, onepass)
        except PayloadUnavailableError as exc:
            self.pack_unavailable = True
            if "remedy" not in vars(exc):  # the raise site knew none better than the class's: name this artifact
                exc.with_remedy(self._stage_remedy())
            raise
        except StoreError:
            self.pack_unavailable = True
            raise
        except MissingObjectError as exc:
            self.pack_unavailable = True
            raise PayloadUnavailableError(exc.detail, file=exc.file, remedy=exc.remedy or self._stage_remedy()) from exc
        except IntegrityError:
            self.pack_unavailable = not self.cache.object_path(pack.sha256).exists()
            raise

    def _stage_remedy(self) -> str:
        """The remedy of a pack no source has: stage it, naming this artifact."""
        where = (
            "or set COLDSNAP_PAYLOAD_REPO to the store that holds it"
            if self.store is None
            else "or check that COLDSNAP_PAYLOAD_REPO / COLDSNAP_PAYLOAD_DIR names the store (and prefix) it was published to"
        )
        return f"stage the pack on this node: `coldsnap stage {self.artifact_dir} --repo STORE`, {where}"

    def _stage(self, manifest: NativeManifest, layout: PackLayout, onepass: FillAsLanded) -> Path:
        """:func:`~coldsnap_core.restore.staging.stage_payload` of the pack, timed (:attr:`stage_seconds`) and its
        fetched bytes counted (:attr:`fetched_bytes`): a fetch checks each extent and padding run of ``layout`` and
        copies the extents into the allocations as they land (``onepass``), and refuses a store's corrupt copy
        naming its first bad extent or padding byte."""
        started = time.perf_counter()
        try:
            return stage_payload(
                manifest.pack,
                cache=self.cache,
                store=self.store,
                fetched=self._count_fetched,
                layout=layout,
                extent_owner=extent_owner_map(manifest),
                fill=onepass,
            )
        finally:
            if self.store is not None:  # without a store the missing pack fails at once: nothing was staged
                self.stage_seconds = time.perf_counter() - started

    def _count_fetched(self, size_bytes: int) -> None:
        self.fetched_bytes += size_bytes


class _FromSettings:
    """:func:`restore_or_fall_back`'s ``store`` default: the store of ``settings.store``."""


_FROM_SETTINGS = _FromSettings()


@dataclass(frozen=True, slots=True)
class RestoreResult:
    """What :func:`restore_or_fall_back` did.

    Attributes:
        attempt: the restore attempt (``None``: none was made: no artifact folder, or export is on).
        allocations: the model's allocations as enumerated for the attempt (``None`` when the
            enumeration itself failed or no attempt was made).
        report: the hydration report when the model was restored, else ``None``.
        fallback: under ``COLDSNAP_RESTORE=auto``, the error that made the attempt fail (the caller
            then loads the checkpoint), else ``None``.
    """

    attempt: WorkerRestore | None = None
    allocations: TorchAllocations | None = None
    report: HydrationReport | None = None
    fallback: ColdsnapError | None = None

    @property
    def restored(self) -> bool:
        """Whether every allocation now holds the captured bytes (no checkpoint load is needed)."""
        return self.report is not None


def restore_or_fall_back(
    model: object,
    settings: ColdsnapSettings,
    worker: WorkerIdentity,
    loaded: LoadedModel | None,
    *,
    cache: PayloadCache | None = None,
    engine: str = "the engine",
    target_engine: str = ENGINE_NONE,
    engine_version: str | None = None,
    log: logging.Logger | None = None,
    backend_for: Callable[[object], CopyBackend] = copy_backend_for,  # type: ignore[assignment]
    store: PayloadStore | _FromSettings | None = _FROM_SETTINGS,
) -> RestoreResult:
    """Restore ``model`` (a ``torch.nn.Module``) from ``settings.artifact_dir``, or say why not: the
    ``COLDSNAP_RESTORE`` policy of both engine plugins, in one place.

    No attempt is made without an artifact folder, or with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1`` (the
    load captures instead). Otherwise the allocations are enumerated
    (:func:`coldsnap_core.copy.torch_allocations.enumerate_allocations`) and :meth:`WorkerRestore.run` fills
    them with the copy backend for their device. On a :class:`~coldsnap_core.errors.ColdsnapError`,
    ``native`` raises it; ``auto`` logs one WARNING naming the worker, the artifact folder, the error
    (its rule, file, allocation and offset) and where a corrupt pack was quarantined, and returns the
    error as :attr:`RestoreResult.fallback` so the caller loads the checkpoint.

    Args:
        model: the model the engine built (parameters and buffers allocated, not loaded).
        settings: the resolved settings (artifact folder, restore mode, verification flags, store).
        worker: this worker's identity.
        loaded: what the engine is loading; ``None`` when the loader cannot tell (the identity check
            then fails, rule ``model-identity``).
        cache: the node-local cache (default: the one at ``settings.state_root``).
        engine: the engine's name, for messages.
        target_engine: the engine name its target identity records (``vllm``, ``sglang``,
            ``docs/format.md`` §15.1), compared with the capsule's ``target.json`` (step 2).
        engine_version: the engine's version string, likewise.
        log: the logger of the fallback WARNING (the engine plugin's own, whose records reach the
            engine's log; default this module's).
        backend_for: the copy backend for the allocations' device
            (:func:`coldsnap_core.copy.select.copy_backend_for`).
        store: where a missing pack is fetched from (``None``: nowhere); default: the store
            ``settings.store`` configures, built before the attempt.

    Raises:
        ConfigurationError: the store ``settings`` configure is malformed (under ``auto`` too: it is
            parsed before the attempt, never a reason to fall back).
        ColdsnapError: ``COLDSNAP_RESTORE=native`` and the restore failed; either mode: :func:`_no_fallback`'s.
    """
    if settings.artifact_dir is None or settings.export_model_payload:
        return RestoreResult()
    cache = PayloadCache(settings.state_root, lock_timeout_seconds=settings.lock_timeout_s) if cache is None else cache
    if isinstance(store, _FromSettings):
        store = store_from_settings(settings.store)
    attempt: WorkerRestore | None = None
    allocations: TorchAllocations | None = None
    try:
        if loaded is None:
            raise ModelIdentityMismatchError(
                f"the loader cannot tell which model {engine} is loading (its weights were requested outside its"
                " load_model, which records the model configuration), so its identity cannot be checked against"
                " the artifact",
                file=settings.artifact_dir,
            )
        attempt = WorkerRestore.for_settings(settings, worker, loaded, cache, target_engine, engine_version, store)
        allocations = enumerate_allocations(model)  # type: ignore[arg-type]
        report = attempt.run(allocations, backend_for(allocations.device))
    except ColdsnapError as exc:
        _no_fallback(settings, loaded, exc)
        if settings.restore == "native":
            raise
        quarantined = getattr(exc, "quarantined_to", None)
        (log or logger).warning(
            "coldsnap: could not restore %s from %s; loading the checkpoint instead (COLDSNAP_RESTORE=auto): %s%s",
            worker.capsule_name,
            settings.artifact_dir,
            exc,
            f" (the corrupt pack was quarantined as {quarantined})" if quarantined else "",
        )
        return RestoreResult(attempt, allocations, None, exc)
    return RestoreResult(attempt, allocations, report, None)


def _no_fallback(settings: ColdsnapSettings, loaded: LoadedModel | None, exc: ColdsnapError) -> None:
    """Where the engine loads a model folder without weight files
    (:attr:`~coldsnap_core.identity.model_identity.LoadedModel.checkpoint_absent`, ``docs/format.md`` §10.1) a failed
    restore has no checkpoint to fall back to, under ``auto`` too.

    Raises:
        CheckpointAbsentError: there, naming ``exc`` (its rule, file and message) and the folder.
    """
    if loaded is not None and loaded.checkpoint_absent:
        raise CheckpointAbsentError(
            f"the restore from {settings.artifact_dir} failed (rule {exc.rule} failed: {exc.detail}), and no checkpoint is"
            f" on this node to load instead: {loaded.folder} holds the model's non-weight files and no weight file, so"
            f" COLDSNAP_RESTORE={settings.restore} stops the start rather than serve unfilled weights",
            file=exc.file,
            remedy=exc.remedy,
        ) from exc
