"""Restore one worker's weights from its pack and residual blob (the portable capture point), engine neutral: the
vLLM and SGLang loaders call :func:`restore_or_fall_back` after the engine built the model and before its
post-processing. :class:`WorkerRestore` runs each check once (``docs/format.md`` §7, "Order of checks", **Restore**):
1. **read** the capsule; 2. **qualify** its target (§15.4); 3. the model **identity** (§10.1); 4. the live **layout**;
5. the **manifest** rules; 6. **admit** the pack (the cache, else a fetch that fills the model as the pack lands,
§12.4); 7. **hydrate**. Each step raises a :class:`~coldsnap_core.errors.ColdsnapError`; nothing is written into the
model before step 7 (or the fetch of step 6), so a partly written model is never reported restored."""

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
from coldsnap_core.restore.hydrate import HydrationReport, hydrate_admitted, plan_hydration
from coldsnap_core.restore.overlay import Selection, select_capsule
from coldsnap_core.restore.staging import FillAsLanded, stage_payload
from coldsnap_core.settings import ColdsnapSettings
from coldsnap_core.stores import from_settings as store_from_settings
from coldsnap_core.stores.base import PayloadStore

logger = logging.getLogger(__name__)

__all__ = ["RestoreResult", "WorkerRestore", "restore_or_fall_back"]


@dataclass
class WorkerRestore:
    """One restore attempt of one worker (the steps: module docstring): ``store`` is where a pack missing from the
    ``cache`` is fetched from (``None``: nowhere); ``target`` defaults to the one of the allocations' device. The steps
    set ``capsule`` (the portable one once read, this node's overlay once selected), ``descriptor_sha256`` (of the
    ``artifact.json`` bytes parsed; overlays bind to it), ``target_mismatch`` (step 2's error), ``layout_matches``
    (step 4 passed), ``pack_unavailable`` (no source has the pack, or the cached one was quarantined as corrupt),
    ``stage_seconds`` (staging from ``store``, also when it failed; ``None``: not contacted) and ``fetched_bytes``."""

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
    recorded_model: ModelIdentity | None = None
    entry: WorkerEntry | None = None
    _model_files: tuple[CapsuleFile, ...] = ()

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
        """The attempt the resolved ``settings`` ask for, by ``engine`` at ``engine_version``, fetching from ``store``."""
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
    def manifest(self) -> NativeManifest | None:
        return self.capsule.native if self.capsule is not None else None

    def read(self) -> Capsule:
        """Step 1: find and read this worker's capsule. Raises as :func:`~coldsnap_core.artifact.capsules.read_worker_capsule`,
        ``ManifestMismatchError`` for a model extent naming a file the identity lacks, ``ArtifactError`` for a native capture."""
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
        self.recorded_model = descriptor.model
        self._model_files = descriptor.pinned_model_files
        self.entry = entry
        return capsule

    def current_target(self, allocations: TorchAllocations) -> TargetIdentity:
        """The target this restore runs on (``target``, else collected once for the allocations' device)."""
        if self.target is None:
            self.target = collect_target(self.engine, self.engine_version, device=allocations.device)
        return self.target

    def qualify(self, capsule: Capsule, allocations: TorchAllocations) -> Capsule:
        """Step 2: choose the capsule whose residual qualifies for this target (:func:`select_capsule`).

        Raises:
            TargetMismatchError: no capsule qualifies (names the differing fields); also kept in :attr:`target_mismatch`.
            ManifestMismatchError: an overlay's model extent names a file the model identity lacks.
        """
        current = self.current_target(allocations)
        assert self.entry is not None and self.recorded_model is not None
        try:
            selection = select_capsule(
                artifact_dir=self.artifact_dir,
                entry=self.entry,
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
                selection.capsule.native, self.recorded_model, file=str(selection.capsule.native_manifest_path)
            )
        if selection.source != "portable":
            logger.info(
                "coldsnap: %s: restoring with %s (%s)", self.worker.capsule_name, selection.overlay_path, selection.reason
            )
        self.selection = selection
        self.capsule = selection.capsule
        return selection.capsule

    def check_identity(self) -> None:
        """Step 3: the model being loaded is the one the artifact pins (raises as :func:`check_model_identity`)."""
        assert self.recorded_model is not None
        check_model_identity(
            self.recorded_model,
            self.loaded,
            file=str(self.artifact_dir / DESCRIPTOR_FILENAME),
            records=CheckpointRecords(self.cache.state_root),
            verify_checkpoint=self.verify_checkpoint,
            model_files=self._model_files,
        )

    def run(self, allocations: TorchAllocations, backend: CopyBackend) -> HydrationReport:
        """Steps 1-7, filling every allocation; raises the failed check's ColdsnapError, an ``OSError`` as FileAccessError."""
        try:
            return self._run(allocations, backend)
        except OSError as exc:
            raise unexpected_os_error(exc) from exc

    def _run(self, allocations: TorchAllocations, backend: CopyBackend) -> HydrationReport:
        capsule = self.qualify(self.portable_capsule or self.read(), allocations)
        manifest = capsule.native
        manifest_file = str(capsule.native_manifest_path)
        # the model before its layout (docs/format.md §7): another model is named as such, not by an allocation size
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
                try:
                    return hydrate_admitted(
                        manifest,
                        pack_path,
                        layout,
                        blob_path=capsule.blob_path,
                        cache=self.cache,
                        allocations=allocations.live,
                        backend=backend,
                        verify_extents=self.verify_extents,
                        manifest_file=manifest_file,
                        filled_seconds=self.stage_seconds if onepass.filled else None,
                    )
                except IntegrityError as exc:
                    # hydrate quarantined an admitted pack proven corrupt (an edit in place a record cannot see)
                    if getattr(exc, "quarantined_to", None) is not None:
                        self.pack_unavailable = True
                    raise
        finally:
            # a pack admitted by its extents gets its whole-file hash and record now, off the load's path
            self.cache.record_in_background()

    def _admit(self, manifest: NativeManifest, layout: PackLayout, manifest_file: str, onepass: FillAsLanded) -> Path:
        """Step 6: the cache admits the pack once (a quarantine is reported in the loader's fallback line); a pack it
        lacks, or just quarantined while a store is configured, is fetched, filling the allocations (``onepass``)."""
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
        """:func:`~coldsnap_core.restore.staging.stage_payload` of the pack, timed and its fetched bytes counted."""
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
    """What :func:`restore_or_fall_back` did: the ``attempt`` and the ``allocations`` it enumerated (``None``: none, or
    it failed), the hydration ``report`` when restored, else under ``auto`` the ``fallback`` error (load the checkpoint)."""

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
    """Restore ``model`` (a ``torch.nn.Module``) from ``settings.artifact_dir`` under the ``COLDSNAP_RESTORE`` policy:
    no attempt without an artifact folder or with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``; on a ColdsnapError ``native``
    raises it, ``auto`` logs one WARNING (on ``log``) and returns it as :attr:`RestoreResult.fallback`. ``loaded``:
    ``None`` when the loader cannot tell what the engine loads (rule ``model-identity`` fails); ``target_engine``,
    ``engine_version``: what the target identity records (``docs/format.md`` §15.1); ``store``: default
    ``settings.store``'s.

    Raises:
        ConfigurationError: the store ``settings`` configure is malformed (under ``auto`` too).
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
    """Raise ``CheckpointAbsentError`` naming ``exc`` and the folder where the engine loads a model folder without
    weight files (``docs/format.md`` §10.1): a failed restore has no checkpoint to fall back to, under ``auto`` too."""
    if loaded is not None and loaded.checkpoint_absent:
        raise CheckpointAbsentError(
            f"the restore from {settings.artifact_dir} failed (rule {exc.rule} failed: {exc.detail}), and no checkpoint is"
            f" on this node to load instead: {loaded.folder} holds the model's non-weight files and no weight file, so"
            f" COLDSNAP_RESTORE={settings.restore} stops the start rather than serve unfilled weights",
            file=exc.file,
            remedy=exc.remedy,
        ) from exc
