"""The ``coldsnap`` load format: vLLM's default loader, observed, with capture and restore.

:class:`ColdsnapModelLoader` is a subclass of vLLM's ``DefaultModelLoader`` registered with
``register_model_loader("coldsnap")`` (vLLM ``model_executor/model_loader/__init__.py``). It keeps the
configured inner loader's I/O: its own ``load_config`` is vLLM's with ``load_format`` replaced by the
inner format (``instanttensor`` on CUDA, ``safetensors`` elsewhere, or ``COLDSNAP_INNER_LOAD_FORMAT``)
and coldsnap's extra-config keys removed (``DefaultModelLoader`` rejects ``coldsnap`` as a format and
unknown keys). ``vllm_config.load_config.load_format`` stays ``coldsnap``, which is harmless.
``__init__`` only parses settings: vLLM builds loaders several times per worker.

``load_weights(model, model_config)`` (vLLM calls it after building the model and before
``process_weights_after_loading``):

* **restore** (an artifact folder is set, export is off): :func:`coldsnap_core.restore.restore_or_fall_back`
  stages this worker's pack, verifies it and hydrates the model's parameter and buffer storages;
  no checkpoint byte is read. On any coldsnap error ``COLDSNAP_RESTORE=auto`` logs one WARNING with
  the error and falls through to the checkpoint load; ``native`` raises it.
* **checkpoint load** (otherwise, or as the fallback): ``DefaultModelLoader.load_weights`` under the
  write observer (:mod:`coldsnap_core.observer`). The iterator boundary is watched by overriding
  ``_prepare_weights`` (the exact file list) and ``_get_weights_iterator`` (each yielded tensor).
  Then:

  * with ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1`` the worker is captured
    (:func:`coldsnap_core.capture.capture_worker`, capture point ``portable``): its pack goes to
    ``<state-root>/model-payloads/sha256/<digest>.pack``, its residual blob and manifests to its
    unit capsule, and ``artifact.json`` lists it;
  * after a fallback whose cause was the pack (no source has it, or the cached object was corrupt
    and is now quarantined) while the capsule and the live layout matched, the pack is
    materialized from the resident bytes (``COLDSNAP_MATERIALIZE``, default ``async``) with the
    canonical writer, so the next restore finds it.

In both cases the loader publishes a :class:`coldsnap_vllm.state.WorkerLoadState` for the level-1 sleep
backend: the model writes by absolute address, and the pinned model identity when it is known (always
when ``--sleep-mode-backend coldsnap`` is enabled).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from coldsnap_core.cache import PayloadCache
from coldsnap_core.capture import CaptureResult
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.copy.select import copy_backend_for
from coldsnap_core.errors import ColdsnapError, ObserverError
from coldsnap_core.format.manifest import ModelIdentity, NativeManifest, PackRef, WorkerIdentity
from coldsnap_core.hydrate import HydrationReport
from coldsnap_core.materialize import MaterializationHandle, materialize_payload
from coldsnap_core.model_identity import (
    LoadedModel,
    engine_checkpoint_files,
    model_config_sha256,
    resolve_hub_commit,
)
from coldsnap_core.observer import LoadSession, ModelRecord, PreparedWeights, WriteObserver, collector_paused, map_to_allocations
from coldsnap_core.outcomes import LoadOutcomeLine, Outcome, append_outcome
from coldsnap_core.overlay import OverlayCapture, capture_overlay
from coldsnap_core.restore import WorkerRestore, capture_loaded_worker, restore_or_fall_back
from coldsnap_core.settings import ColdsnapSettings
from coldsnap_core.target import engine_version
from coldsnap_core.torch_allocations import TorchAllocations, enumerate_allocations
from coldsnap_vllm import compat
from coldsnap_vllm import state as load_state

logger = logging.getLogger(__name__)

ENGINE = "vllm"
"""The engine name recorded in a capsule's ``target.json`` (``docs/format.md`` §15.1)."""

LOAD_FORMAT = "coldsnap"
"""The load format name: ``--load-format coldsnap`` / ``LLM(..., load_format="coldsnap")``."""

__all__ = ["LOAD_FORMAT", "ColdsnapModelLoader", "LoadOutcome", "engine_config_sha256", "last_outcome", "register_loader"]


@dataclass(frozen=True)
class LoadOutcome:
    """What the last ``load_weights`` of this process did (for logs, tests and benchmarks).

    Attributes:
        kind: ``restored`` (from pack + residual), ``captured`` (checkpoint load + capture) or
            ``checkpoint`` (checkpoint load only, possibly after a fallback).
        worker: the worker's identity.
        load_seconds: wall time of the weight loading proper (hydration, or the checkpoint load
            under the observer), in seconds.
        total_seconds: wall time of the whole ``load_weights`` call, in seconds.
        fallback: the error that made ``auto`` fall back to the checkpoint, if any.
        hydration: the hydration report (``restored``).
        capture: the capture result (``captured``).
        materialization: the materialization handle, when one was started after a fallback.
        capsule_source: ``restored``: which capsule (``portable``, ``overlay``, ``qualified``:
            :class:`coldsnap_core.overlay.Selection`).
        overlay: the target-local overlay captured after this checkpoint load, if any.
        model_bytes: destination bytes classified as model bytes (restored: the manifest's).
        checkpoint_copies: ``copy_`` calls recorded as model bytes by the observer.
    """

    kind: Literal["restored", "captured", "checkpoint"]
    worker: WorkerIdentity
    load_seconds: float
    total_seconds: float
    fallback: ColdsnapError | None = None
    hydration: HydrationReport | None = None
    capture: CaptureResult | None = None
    materialization: MaterializationHandle | None = None
    capsule_source: str | None = None
    overlay: OverlayCapture | None = None
    model_bytes: int = 0
    checkpoint_copies: int = 0


_outcome_lock = threading.Lock()
_last_outcome: LoadOutcome | None = None


def last_outcome() -> LoadOutcome | None:
    """The :class:`LoadOutcome` of this process's last coldsnap ``load_weights``, or ``None``."""
    with _outcome_lock:
        return _last_outcome


def _set_outcome(outcome: LoadOutcome | None) -> None:
    global _last_outcome
    with _outcome_lock:
        _last_outcome = outcome


class ColdsnapModelLoader(DefaultModelLoader):
    """vLLM's default loader with coldsnap capture and restore (see the module docstring).

    Args:
        load_config: vLLM's load config (``load_format="coldsnap"``).

    Raises:
        EngineVersionError: this vLLM is not 0.32 or 0.33, or its private loader API moved.
        ConfigurationError: a coldsnap setting is invalid (:meth:`ColdsnapSettings.resolve`).
    """

    def __init__(self, load_config: LoadConfig) -> None:
        compat.require_supported_vllm()
        settings, rest = ColdsnapSettings.resolve(os.environ, load_config.model_loader_extra_config)
        inner_format = settings.inner_load_format or compat.default_inner_load_format()
        super().__init__(dataclasses.replace(load_config, load_format=inner_format, model_loader_extra_config=rest))
        self.coldsnap_settings = settings
        self._session: LoadSession | None = None
        self._restored_pack: str | None = None

    # -- the iterator boundary ---------------------------------------------------------------------

    def _prepare_weights(self, model_name_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides):  # type: ignore[override]
        result = super()._prepare_weights(model_name_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides)
        if self._session is not None:
            folder, files, use_safetensors = result[0], result[1], result[2]
            self._session.prepared.append(
                PreparedWeights(str(model_name_or_path), Path(folder), [Path(f) for f in files], bool(use_safetensors))
            )
        return result

    def _get_weights_iterator(self, source):  # type: ignore[override]
        iterator = super()._get_weights_iterator(source)
        if self._session is None:
            return iterator  # reload_weights and other callers outside an observed load
        return self._session.observe(source.prefix, iterator)

    def _checkpoint_files_now(self, model: nn.Module, model_config: ModelConfig) -> tuple[list[str] | None, str | None]:
        """:func:`coldsnap_core.model_identity.engine_checkpoint_files` through vLLM's
        ``DefaultModelLoader._prepare_weights`` (with the model's ``fall_back_to_pt_during_load`` and
        ``allow_patterns_overrides``, as ``DefaultModelLoader.Source.init_new`` passes them)."""
        return engine_checkpoint_files(
            model_config.model,
            "vLLM",
            lambda: DefaultModelLoader._prepare_weights(
                self,
                model_config.model,
                None,
                model_config.revision,
                getattr(model, "fall_back_to_pt_during_load", True),
                getattr(model, "allow_patterns_overrides", None),
            ),
        )

    # -- load_weights ------------------------------------------------------------------------------

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Restore from the artifact, or load from the checkpoint (observed; captured on export).

        Every call appends one line to the load outcome log (:mod:`coldsnap_core.outcomes`):
        restored, captured, fell back, refused (the error is raised) or checkpoint.

        Raises:
            ColdsnapError: ``COLDSNAP_RESTORE=native`` and the restore failed (the verifier's error),
                or the export capture failed.
        """
        started = time.perf_counter()
        try:
            self._load_weights(model, model_config, started)
        except ColdsnapError as exc:
            self._log_outcome("refused", compat.worker_identity(), time.perf_counter() - started, error=exc)
            raise
        outcome = last_outcome()
        if outcome is not None:
            kind = "fell-back" if outcome.fallback is not None else outcome.kind
            pack = None
            if outcome.hydration is not None and self._restored_pack is not None:
                pack = self._restored_pack
            elif outcome.capture is not None:
                pack = outcome.capture.manifest.pack.sha256
            self._log_outcome(
                kind,  # type: ignore[arg-type]
                outcome.worker,
                outcome.total_seconds,
                error=outcome.fallback,
                materialization_started=outcome.materialization is not None,
                pack_sha256=pack,
            )

    def _log_outcome(
        self,
        outcome: Outcome,
        worker: WorkerIdentity,
        seconds: float,
        *,
        error: ColdsnapError | None = None,
        materialization_started: bool = False,
        pack_sha256: str | None = None,
    ) -> None:
        settings = self.coldsnap_settings
        append_outcome(
            settings.outcome_log_path,
            LoadOutcomeLine(
                outcome,
                "vllm",
                worker.capsule_name,
                None if settings.artifact_dir is None else str(settings.artifact_dir),
                seconds,
                materialization_started=materialization_started,
                error=error,
                pack_sha256=pack_sha256,
            ),
        )

    def _load_weights(self, model: nn.Module, model_config: ModelConfig, started: float) -> None:
        self._restored_pack = None
        _set_outcome(None)
        # A later load in this process (vLLM's reload_weights, a second load_weights) replaces the weights:
        # what the sleep backend works from is this load's state or none, never the previous load's.
        load_state.clear()
        settings = self.coldsnap_settings
        worker = compat.worker_identity()
        cache = PayloadCache(settings.state_root, lock_timeout_seconds=settings.lock_timeout_s)
        attempt: WorkerRestore | None = None
        fallback: ColdsnapError | None = None
        if settings.artifact_dir is not None and not settings.export_model_payload:
            checkpoint_files, checkpoint_files_error = self._checkpoint_files_now(model, model_config)
            loaded = LoadedModel.from_config(
                model_config.model,
                model_config.revision,
                engine_config_sha256(model_config),
                cache_dir=self.load_config.download_dir,
                checkpoint_files=checkpoint_files,
                checkpoint_files_error=checkpoint_files_error,
            )
            if settings.overlay == "capture":
                # An operator's explicit overlay capture: read the portable capsule, load the
                # checkpoint, capture (in _load_checkpoint); a capsule that cannot be read stops here.
                attempt = WorkerRestore(
                    settings.artifact_dir,
                    worker,
                    loaded,
                    cache,
                    verify_extents=settings.verify_extents,
                    verify_checkpoint=settings.verify_checkpoint,
                    engine=ENGINE,
                    engine_version=engine_version(ENGINE),
                )
                attempt.read()
                with collector_paused():
                    self._load_checkpoint(model, model_config, worker, cache, attempt, None, started)
                return
            with collector_paused():
                result = restore_or_fall_back(
                    model,
                    settings,
                    worker,
                    loaded,
                    cache=cache,
                    engine="vLLM",
                    target_engine=ENGINE,
                    engine_version=engine_version(ENGINE),
                    log=logger,
                )
            if result.restored:
                assert result.attempt is not None and result.allocations is not None and result.report is not None
                self._restored(result.attempt, result.allocations, result.report, started)
                return
            attempt, fallback = result.attempt, result.fallback
        with collector_paused():
            self._load_checkpoint(model, model_config, worker, cache, attempt, fallback, started)

    def _restored(self, attempt: WorkerRestore, allocations: TorchAllocations, report: HydrationReport, started: float) -> None:
        assert attempt.capsule is not None
        manifest = attempt.capsule.native
        self._restored_pack = manifest.pack.sha256
        writes = tuple(
            load_state.ObservedModelWrite(
                allocations.live[e.allocation_index].address + e.offset_bytes, e.size_bytes, e.provenance
            )
            for e in manifest.model_extents
        )
        self._publish(attempt.worker, attempt.capsule.recovery.model, sorted(writes, key=lambda w: w.address), manifest.pack)
        total = time.perf_counter() - started
        logger.info(
            "coldsnap: restored %s from pack %s in %.2f s (%d model bytes, %d residual bytes; no checkpoint read)",
            attempt.worker.capsule_name,
            manifest.pack.sha256[:12],
            total,
            report.model_bytes,
            report.residual_bytes,
        )
        _set_outcome(
            LoadOutcome(
                "restored",
                attempt.worker,
                load_seconds=report.check_seconds + report.copy_seconds,
                total_seconds=total,
                hydration=report,
                capsule_source=attempt.selection.source if attempt.selection is not None else None,
                model_bytes=manifest.model_bytes,
            )
        )

    def _load_checkpoint(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        worker: WorkerIdentity,
        cache: PayloadCache,
        attempt: WorkerRestore | None,
        fallback: ColdsnapError | None,
        started: float,
    ) -> None:
        settings = self.coldsnap_settings
        try:
            before = enumerate_allocations(model)
        except ObserverError as exc:
            if settings.export_model_payload:
                raise
            logger.info("coldsnap: not observing this load (%s)", exc.detail)
            super().load_weights(model, model_config)
            _set_outcome(
                LoadOutcome("checkpoint", worker, time.perf_counter() - started, time.perf_counter() - started, fallback)
            )
            return
        session = LoadSession()
        observer = WriteObserver(session.sources, converted_copies=settings.converted_copies)
        self._session = session
        load_started = time.perf_counter()
        try:
            with observer:
                super().load_weights(model, model_config)
        finally:
            self._session = None
        load_seconds = time.perf_counter() - load_started
        try:
            after = enumerate_allocations(model)
            records = observer.loaded_records(before, after)
        except ObserverError as problem:
            # The weights are loaded; only their classification is unknown, so the engine serves them
            # and nothing is captured or published (an export asked for a capture: it fails loudly).
            if settings.export_model_payload:
                raise
            logger.info("coldsnap: %s; nothing is published for the sleep backend", problem.detail)
            _set_outcome(LoadOutcome("checkpoint", worker, load_seconds, time.perf_counter() - started, fallback))
            return
        ranges, kept = map_to_allocations(records, after)
        model_bytes = sum(r.size_bytes for r in ranges)
        logger.info(
            "coldsnap: observed %d checkpoint copies: %d of %d allocation bytes are model bytes (%d tensors without provenance)",
            observer.checkpoint_copies,
            model_bytes,
            after.total_bytes,
            len(session.sources.unknown),
        )
        capture: CaptureResult | None = None
        handle: MaterializationHandle | None = None
        identity: ModelIdentity | None = attempt.capsule.recovery.model if attempt and attempt.capsule else None
        pack: PackRef | None = None
        if settings.export_model_payload:
            assert settings.artifact_dir is not None
            identity = self._identify(session, model_config, settings.state_root, self.load_config.download_dir)
            capture = capture_loaded_worker(
                after, ranges, worker, identity, cache=cache, artifact_dir=settings.artifact_dir, engine=ENGINE
            )
            pack = capture.manifest.pack
        elif fallback is not None and attempt is not None and attempt.pack_unavailable and attempt.layout_matches:
            assert attempt.manifest is not None
            handle = self._materialize(attempt.manifest, after, copy_backend_for(after.device), cache)
            if handle is not None and handle.done and handle.result is not None:
                pack = handle.result.pack
        overlay: OverlayCapture | None = None
        if attempt is not None and attempt.portable_capsule is not None and self._wants_overlay(attempt, fallback):
            overlay = self._capture_overlay(attempt, after, ranges)
        if identity is None and _coldsnap_sleep_enabled(model_config):
            # The level-1 sleep backend takes its reference digests from the pinned checkpoint files.
            identity = self._identify(session, model_config, settings.state_root, self.load_config.download_dir)
        self._publish(worker, identity, kept, pack)
        _set_outcome(
            LoadOutcome(
                "captured" if capture is not None else "checkpoint",
                worker,
                load_seconds=load_seconds,
                total_seconds=time.perf_counter() - started,
                fallback=fallback,
                capture=capture,
                materialization=handle,
                overlay=overlay,
                model_bytes=model_bytes,
                checkpoint_copies=observer.checkpoint_copies,
            )
        )

    def _wants_overlay(self, attempt: WorkerRestore, fallback: ColdsnapError | None) -> bool:
        """Capture a target-local overlay after this checkpoint load: on ``COLDSNAP_OVERLAY=capture``,
        or (``auto``) after a fallback caused by target qualification of a capsule vLLM captured (a
        capsule of another engine gets no overlay: that engine's artifact is captured with it)."""
        mode = self.coldsnap_settings.overlay
        if mode == "capture":
            return True
        portable = attempt.portable_capsule
        return (
            mode == "auto"
            and fallback is not None
            and fallback is attempt.target_mismatch
            and portable is not None
            and portable.target is not None
            and portable.target.engine == ENGINE
        )

    def _capture_overlay(self, attempt: WorkerRestore, after: TorchAllocations, ranges) -> OverlayCapture | None:
        """:func:`coldsnap_core.overlay.capture_overlay` of the loaded model, after the model identity
        check restore would have run. ``auto``: a failure is one WARNING (the load stands);
        ``capture``: it raises."""
        settings = self.coldsnap_settings
        assert settings.artifact_dir is not None and attempt.portable_capsule is not None and attempt.entry is not None
        try:
            attempt.check_identity()
            return capture_overlay(
                state_root=settings.state_root,
                artifact_dir=settings.artifact_dir,
                entry=attempt.entry,
                portable=attempt.portable_capsule,
                descriptor_sha256=attempt.descriptor_sha256 or "",
                model=attempt.recorded_model,
                target=attempt.current_target(after),
                allocation_map=after.allocation_map,
                allocations=after.live,
                model_ranges=ranges,
                backend=copy_backend_for(after.device),
            )
        except ColdsnapError as exc:
            if settings.overlay == "capture":
                raise
            logger.warning("coldsnap: %s: no target-local overlay captured: %s", attempt.worker.capsule_name, exc)
            return None

    def _materialize(
        self, manifest: NativeManifest, allocations: TorchAllocations, backend: CopyBackend, cache: PayloadCache
    ) -> MaterializationHandle | None:
        mode = self.coldsnap_settings.materialize
        logger.info(
            "coldsnap: materializing pack %s from the loaded weights (COLDSNAP_MATERIALIZE=%s)", manifest.pack.sha256[:12], mode
        )
        # ``allocations`` holds the storages: vLLM's CPU post-processing replaces every linear weight,
        # and the background writer must still read the loaded bytes.
        return materialize_payload(manifest, allocations.live, backend, cache, mode=mode, keepalive=allocations)

    @staticmethod
    def _identify(
        session: LoadSession, model_config: ModelConfig, state_root: Path, download_dir: str | None = None
    ) -> ModelIdentity:
        """The model identity: the checkpoint files just loaded (hashed, and recorded in the state
        root's checkpoint records), the engine's model configuration digest and, for a repository id,
        the commit :func:`hub_revision` resolves."""
        return session.identify(
            str(model_config.model),
            revision=hub_revision(model_config, download_dir),
            config_sha256=engine_config_sha256(model_config),
            state_root=state_root,
        )

    def _publish(
        self,
        worker: WorkerIdentity,
        identity: ModelIdentity | None,
        writes: list[ModelRecord] | list[load_state.ObservedModelWrite],
        pack: PackRef | None,
    ) -> None:
        settings = self.coldsnap_settings
        observed = tuple(
            w
            if isinstance(w, load_state.ObservedModelWrite)
            else load_state.ObservedModelWrite(w.address, w.size_bytes, w.provenance())
            for w in writes
        )
        load_state.publish(
            load_state.WorkerLoadState(
                worker=worker,
                model=identity,
                writes=observed,
                pack=pack,
                artifact_dir=settings.artifact_dir,
                state_root=settings.state_root,
                hf_cache_dir=None if self.load_config.download_dir is None else Path(self.load_config.download_dir),
            )
        )


def engine_config_sha256(model_config: ModelConfig) -> str:
    """:func:`coldsnap_core.model_identity.model_config_sha256` of vLLM's effective model configuration:
    ``model_config.hf_config`` (``--hf-overrides`` already applied by ``ModelConfig.__post_init__``),
    ``model_config.dtype`` and ``model_config.quantization``."""
    return model_config_sha256(
        model_config.hf_config, dtype=model_config.dtype, quantization=getattr(model_config, "quantization", None)
    )


def hub_revision(model_config: ModelConfig, download_dir: str | None = None) -> str | None:
    """The revision the model identity records for vLLM's model.

    A local folder: ``model_config.revision`` as given (a string, or ``None``). A Hugging Face
    repository id: the commit hash its revision resolves to
    (:func:`coldsnap_core.model_identity.resolve_hub_commit`: vLLM 0.32's ``ModelConfig`` already
    resolved ``model_config.revision`` to a ``huggingface_hub.ResolvedRevision``, whose commit is
    used; else the ``refs`` entry of ``--download-dir`` or ``HF_HUB_CACHE``), or the revision as given
    when the cache cannot resolve it (restore then refuses the artifact, fail closed).
    """
    revision = model_config.revision
    requested = None if revision is None else str(revision)
    if os.path.isdir(str(model_config.model)):
        return requested
    commit = resolve_hub_commit(str(model_config.model), revision, cache_dir=download_dir)
    return commit if commit is not None else requested


def _coldsnap_sleep_enabled(model_config: ModelConfig) -> bool:
    """Whether this engine runs with ``--enable-sleep-mode --sleep-mode-backend coldsnap``."""
    return bool(getattr(model_config, "enable_sleep_mode", False)) and (
        getattr(model_config, "sleep_mode_backend", None) == "coldsnap"
    )


_registration_lock = threading.Lock()


def register_loader() -> None:
    """Register :class:`ColdsnapModelLoader` as load format ``coldsnap`` (idempotent; no CUDA init).

    Also sends coldsnap's log lines to vLLM's handlers (:func:`coldsnap_vllm.compat.attach_logging`).
    The vLLM version is checked when the loader is built, so a process that never selects
    ``coldsnap`` is not affected by an unsupported vLLM.
    """
    from vllm.model_executor import model_loader

    with _registration_lock:
        compat.attach_logging()
        table = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", None)
        if isinstance(table, dict) and table.get(LOAD_FORMAT) is ColdsnapModelLoader:
            return
        model_loader.register_model_loader(LOAD_FORMAT)(ColdsnapModelLoader)
