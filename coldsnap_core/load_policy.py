"""The load policy every engine plugin runs, shaped as vLLM's ``BaseModelLoader.load_model``
(``vllm/model_executor/model_loader/base_loader.py``): a **restore** when an artifact is set and export is off, else
(or as its fallback) the observed **checkpoint load** and its **capture**, **materialization** (``docs/format.md``
§13) or **overlay** (§15); the **derived-cache seed** placed (§17); one **outcome line** (§10.3)."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from coldsnap_core.artifact.model_files import attach_model_files
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.load_session import LoadSession, PreparedWeights
from coldsnap_core.capture.materialize import MaterializationHandle, materialize_payload
from coldsnap_core.capture.model_records import ModelRecord
from coldsnap_core.capture.observer import WriteObserver, map_to_allocations
from coldsnap_core.capture.overlay import OverlayCapture, capture_overlay
from coldsnap_core.capture.worker import CaptureResult, capture_loaded_worker
from coldsnap_core.copy.select import copy_backend_for
from coldsnap_core.copy.torch_allocations import TorchAllocations, enumerate_allocations
from coldsnap_core.errors import CheckpointAbsentError, ColdsnapError, ConfigurationError, ObserverError
from coldsnap_core.format.descriptor import CapsuleFile
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import ModelIdentity, PackRef, WorkerIdentity
from coldsnap_core.identity.config_digest import config_json_sha256, engine_model_config
from coldsnap_core.identity.hub_commit import resolve_hub_commit
from coldsnap_core.identity.model_folder import holds_weight_files
from coldsnap_core.identity.model_identity import LoadedModel
from coldsnap_core.identity.target import engine_version as installed_engine_version
from coldsnap_core.metrics import record_load
from coldsnap_core.operator_log import banner, refuse
from coldsnap_core.outcomes import LoadOutcomeLine, Outcome, append_outcome
from coldsnap_core.restore.derived_cache import SeedPlacement
from coldsnap_core.restore.hydrate import HydrationReport
from coldsnap_core.restore.pipeline import WorkerRestore, restore_or_fall_back
from coldsnap_core.settings import SETTINGS, ColdsnapSettings
from coldsnap_core.stores import from_settings as store_from_settings
from coldsnap_core.stores import parse_artifact_ref
from coldsnap_core.stores.pull import pull_into_state_root

__all__ = ["LoadCall", "LoadOutcome", "LoadPolicy", "ModelSource", "ModelWrite", "ObservedLoader"]


@dataclass(frozen=True, slots=True)
class ModelWrite:
    """A range (``address``: host pointer or CUDA virtual address) filled with checkpoint bytes nothing rewrote in the load."""

    address: int
    size_bytes: int
    provenance: ExtentProvenance


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What the engine is loading: a local folder or a Hugging Face repository id, its revision as given, its
    configuration's digest and canonical JSON, and the Hugging Face cache it downloads into (``None``: ``HF_HUB_CACHE``)."""

    path: str
    revision: str | None
    config_sha256: str | None
    download_dir: str | None = None
    config_json: str | None = None

    @classmethod
    def of_engine(cls, model_config: object, path: str, revision: str | None, download_dir: str | None) -> ModelSource:
        """The source an engine's ``ModelConfig`` names, its ``hf_config``, ``dtype`` and ``quantization`` digested
        (``docs/format.md`` §4.8; ``None`` digest without ``hf_config``)."""
        config_json = engine_model_config(model_config)
        config_sha256 = None if config_json is None else config_json_sha256(config_json)
        return cls(path, revision, config_sha256, download_dir, config_json)

    def identity_revision(self) -> str | None:
        """The identity's revision: as given for a folder, else its commit in the Hugging Face cache (as given if unresolved)."""
        requested = None if self.revision is None else str(self.revision)
        if os.path.isdir(self.path):
            return requested
        commit = resolve_hub_commit(self.path, self.revision, cache_dir=self.download_dir)
        return commit if commit is not None else requested


@dataclass(frozen=True, slots=True)
class LoadCall:
    """The inputs of one :meth:`LoadPolicy.load`: the ``torch.nn.Module`` the engine built, what it is loading
    (``None`` when called outside the loader's ``load_model``) and the adapter's own inputs, handed back unread."""

    model: object
    source: ModelSource | None
    engine: Any = None


@dataclass(frozen=True)
class LoadOutcome:
    """What one :meth:`LoadPolicy.load` did. ``load_seconds``: wall time of the weight loading proper (hydration, or
    the observed checkpoint load); ``fallback``: the error that made ``auto`` fall back to the checkpoint, if any;
    ``checkpoint_copies``: ``copy_`` calls the observer recorded as model bytes; ``writes``: the model writes by
    absolute address, sorted and disjoint (empty when not observed); ``observed``: whether :attr:`writes` says where
    the model bytes are (``False``: nothing may be published); ``capsule_dir``: where the derived-cache seed of the
    capsule chosen for this load is (:func:`_seed_source`); ``stage_seconds``: wall time of staging the pack during
    this load (``None``: the store was not contacted)."""

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
    model: ModelIdentity | None = None
    writes: tuple[ModelWrite, ...] = ()
    pack: PackRef | None = None
    observed: bool = True
    capsule_dir: Path | None = None
    capsule_files: tuple[CapsuleFile, ...] = ()
    derived_cache: SeedPlacement | None = None
    stage_seconds: float | None = None
    fetched_bytes: int = 0
    checkpoint_absent: bool = False

    @property
    def line_kind(self) -> Outcome:
        """The outcome log's word for it (``fell-back`` when ``auto`` fell back)."""
        return "fell-back" if self.fallback is not None else self.kind


class LoadPolicy(abc.ABC):
    """The engine-neutral load policy, subclassed by each engine adapter; a malformed payload store is a ConfigurationError."""

    engine: ClassVar[str]
    """The engine name a capsule's ``target.json`` records (``vllm``, ``sglang``; ``docs/format.md`` §15.1)."""
    engine_label: ClassVar[str]
    """The engine's name in messages (``vLLM``, ``SGLang``)."""
    weights_line: ClassVar[str | None] = None
    """The engine loader's own line after the weights (a format of the seconds and GB/s), logged after a restore."""
    weights_call: ClassVar[str] = "load_weights"
    """The engine's loader method that runs :meth:`load`, for messages."""

    def __init__(self, settings: ColdsnapSettings, *, log: logging.Logger, loader: Any = None) -> None:
        self.settings = settings
        self.log = log
        self.loader = loader  # the engine's loader object whose methods the adapter's steps call
        self.store = store_from_settings(settings.store)
        self.session: LoadSession | None = None  # the observed load, while load_checkpoint runs under the observer

    @abc.abstractmethod
    def worker_identity(self) -> WorkerIdentity:
        """This worker's identity."""

    @abc.abstractmethod
    def checkpoint_files(self, call: LoadCall) -> tuple[list[str] | None, str | None]:
        """:func:`coldsnap_core.engine_checkpoint_files` of ``call.source`` (not ``None``)."""

    @abc.abstractmethod
    def load_checkpoint(self, call: LoadCall) -> None:
        """Run the engine's checkpoint load into ``call.model``."""

    def engine_version(self) -> str | None:
        """The engine's installed version (:func:`coldsnap_core.identity.target.engine_version`)."""
        return installed_engine_version(self.engine)

    def wants_model_identity(self, call: LoadCall) -> bool:
        """Whether a plain checkpoint load pins the model identity too (vLLM: its sleep backend needs it)."""
        return False

    def place_derived_cache(self, call: LoadCall, outcome: LoadOutcome) -> SeedPlacement | None:
        """Place ``outcome.capsule_dir``'s seed before the engine compiles; ``None``: no compile cache. Must not raise."""
        return None

    def capture_derived_cache(self, call: LoadCall, outcome: LoadOutcome) -> None:
        """Attach the engine's compile cache to the capsule this load wrote once it compiled. Must not raise."""
        return None

    @classmethod
    @contextlib.contextmanager
    def refusing_settings(
        cls,
        environ: Mapping[str, str],
        extra_config: Mapping[str, object] | str | None,
        worker: Callable[[], WorkerIdentity],
        log: logging.Logger,
    ) -> Iterator[None]:
        """Around an engine plugin's resolution of its settings and construction of its policy: a ConfigurationError
        there is reported as every refused start is, then raised (``extra_config``: a mapping or its JSON text)."""
        try:
            yield
        except ConfigurationError as exc:
            settings = _report_settings(environ, extra_config)
            try:
                name = worker().capsule_name
            except Exception:  # the refusal is reported whatever the engine's state
                name = WorkerIdentity("worker", 0, 1, 0, 1).capsule_name
            _report(settings, LoadOutcomeLine("refused", cls.engine, name, None, 0.0, error=exc))
            why = "its coldsnap settings are invalid"
            refuse(f"coldsnap: {cls.engine_label} start refused for {name} ({why}): {exc}", settings, log, cause=str(exc))
            raise

    def load(self, call: LoadCall) -> LoadOutcome:
        """Restore or load ``call.model``, then append one outcome line; a ColdsnapError is reported as refused, raised."""
        started = time.perf_counter()
        banner(self.settings, self.engine_label, self.log)
        worker = self.worker_identity()
        try:
            with _collector_paused():
                outcome = self._load(call, worker, started)
        except ColdsnapError as exc:
            absent = isinstance(exc, CheckpointAbsentError)
            # no checkpoint on the node: the outcome line, the metrics and the refusal line name the cause's rule
            cause = exc.__cause__ if absent and isinstance(exc.__cause__, ColdsnapError) else exc
            line = self._line("refused", worker, time.perf_counter() - started, error=cause, checkpoint_absent=absent)
            _report(self.settings, line)
            refuse(self._refusal(worker, cause, checkpoint_absent=absent), self.settings, self.log, cause=str(exc))
            raise
        if outcome.capsule_dir is not None:
            outcome = dataclasses.replace(outcome, derived_cache=self.place_derived_cache(call, outcome))
        seed = outcome.derived_cache
        line = self._line(
            outcome.line_kind,
            worker,
            outcome.total_seconds,
            error=outcome.fallback,
            materialization_started=outcome.materialization is not None,
            pack_sha256=None if outcome.kind == "checkpoint" or outcome.pack is None else outcome.pack.sha256,
            derived_cache=None if seed is None else seed.status,
            derived_cache_reason=None if seed is None else seed.reason,
            checkpoint_absent=outcome.checkpoint_absent,
        )
        _report(self.settings, line, outcome)
        if self.settings.derived_cache == "auto" and (outcome.capture is not None or outcome.overlay is not None):
            self.capture_derived_cache(call, outcome)
        return outcome

    def _refusal(self, worker: WorkerIdentity, exc: ColdsnapError, *, checkpoint_absent: bool = False) -> str:
        """The one line of a refused start: the engine, the worker, why coldsnap refuses, the error."""
        settings = self.settings
        if settings.export_model_payload:
            why = "COLDSNAP_EXPORT_MODEL_PAYLOAD=1: the capture failed"
        elif settings.overlay == "capture":
            why = "COLDSNAP_OVERLAY=capture: the overlay capture failed"
        else:
            artifact = settings.artifact_ref or settings.artifact_dir
            why = f"COLDSNAP_RESTORE={settings.restore}: " + (
                "no artifact configured" if artifact is None else f"not restored from {artifact}"
            )
            if checkpoint_absent:
                why += ", and no checkpoint on this node to load instead"
        return f"coldsnap: {self.engine_label} start refused for {worker.capsule_name} ({why}): {exc}"

    def _load(self, call: LoadCall, worker: WorkerIdentity, started: float) -> LoadOutcome:
        cache = PayloadCache(self.settings.state_root, lock_timeout_seconds=self.settings.lock_timeout_s)
        if self.settings.artifact_ref is not None:
            try:
                self._pull_artifact()
            except ColdsnapError as exc:
                if self.settings.restore == "native":
                    raise
                self._require_checkpoint(call, exc)
                self.log.warning("coldsnap: could not pull %s: %s; loading the checkpoint", self.settings.artifact_ref, exc)
                return self._load_checkpoint(call, worker, cache, None, exc, None, started)
        settings = self.settings
        if settings.artifact_dir is None and not settings.export_model_payload:
            no_artifact = ConfigurationError(
                f"{self.engine_label} runs the coldsnap load format without an artifact (COLDSNAP_ARTIFACT_DIR is not set),"
                " so it loads the checkpoint and restores nothing",
                remedy="set COLDSNAP_ARTIFACT_DIR (or the extra-config key artifact_dir) to the artifact folder or REF, or"
                " COLDSNAP_EXPORT_MODEL_PAYLOAD=1 to capture one",
            )
            self._require_checkpoint(call, no_artifact)
            if not self.wants_model_identity(call):
                self.log.warning("coldsnap: loading the checkpoint (COLDSNAP_RESTORE=%s): %s", settings.restore, no_artifact)
                return self._load_checkpoint(call, worker, cache, None, no_artifact, None, started)
        if settings.artifact_dir is None or settings.export_model_payload:
            return self._load_checkpoint(call, worker, cache, None, None, None, started)
        loaded = self._loaded_model(call)
        if settings.overlay == "capture":
            # an explicit overlay capture: a capsule that cannot be read (or an unknown model) stops here
            if loaded is None:
                raise ObserverError(
                    f"the loader cannot tell which model {self.engine_label} is loading: {self.weights_call} was called"
                    " outside its load_model"
                )
            attempt = WorkerRestore.for_settings(settings, worker, loaded, cache, self.engine, self.engine_version(), self.store)
            attempt.read()
            return self._load_checkpoint(call, worker, cache, attempt, None, None, started)
        result = restore_or_fall_back(
            call.model,
            settings,
            worker,
            loaded,
            cache=cache,
            engine=self.engine_label,
            target_engine=self.engine,
            engine_version=self.engine_version(),
            log=self.log,
            store=self.store,
        )
        attempt = result.attempt
        if result.restored:
            assert attempt is not None and result.allocations is not None and result.report is not None
            outcome = self._restored(attempt, result.allocations, result.report, started)
        else:
            outcome = self._load_checkpoint(call, worker, cache, attempt, result.fallback, result.allocations, started)
        if attempt is None or attempt.stage_seconds is None:
            return outcome
        return dataclasses.replace(outcome, stage_seconds=attempt.stage_seconds, fetched_bytes=attempt.fetched_bytes)

    def _require_checkpoint(self, call: LoadCall, cause: ColdsnapError) -> None:
        """Before a checkpoint load that ``cause`` makes the only load: a model folder without weight files (what
        ``coldsnap pull`` writes, ``docs/format.md`` §10.1) is a CheckpointAbsentError from ``cause``."""
        source = call.source
        if source is None or not os.path.isdir(source.path) or holds_weight_files(Path(source.path)):
            return
        if isinstance(cause, ConfigurationError) and self.settings.artifact_ref is None:
            cause = ConfigurationError(
                f"{self.engine_label} runs the coldsnap load format without an artifact (COLDSNAP_ARTIFACT_DIR is not set)",
                remedy=f"set COLDSNAP_ARTIFACT_DIR to the pulled artifact folder (the one that holds {source.path})",
            )
        raise CheckpointAbsentError(
            f"{cause.detail} (rule {cause.rule} failed), and no checkpoint is on this node to load instead: {source.path}"
            " holds the model's non-weight files and no weight file, so the start stops rather than serve unfilled"
            " weights",
            file=source.path,
            remedy=cause.remedy,
        ) from cause

    def _pull_artifact(self) -> None:
        """Pull ``COLDSNAP_ARTIFACT_DIR``'s REF into the state root (its store stages the packs when none is configured)."""
        ref = self.settings.artifact_ref
        assert ref is not None
        store, name = parse_artifact_ref(ref, client=self.settings.store.client)
        pulled = pull_into_state_root(store, name, self.settings.state_root, lock_timeout_seconds=self.settings.lock_timeout_s)
        self.log.info("coldsnap: %s is artifact %s, pulled into %s", ref, pulled.sha256, pulled.path)
        self.settings = dataclasses.replace(self.settings, artifact_dir=pulled.path, artifact_ref=None)
        self.store = self.store if self.store is not None else store

    def _loaded_model(self, call: LoadCall) -> LoadedModel | None:
        source = call.source
        if source is None:
            return None
        files, files_error = self.checkpoint_files(call)
        return LoadedModel.from_config(
            source.path,
            source.revision,
            source.config_sha256,
            cache_dir=source.download_dir,
            checkpoint_files=files,
            checkpoint_files_error=files_error,
            config_json=source.config_json,
        )

    def _restored(
        self, attempt: WorkerRestore, allocations: TorchAllocations, report: HydrationReport, started: float
    ) -> LoadOutcome:
        assert attempt.capsule is not None
        manifest = attempt.capsule.native
        writes = sorted(
            (
                ModelWrite(allocations.live[e.allocation_index].address + e.offset_bytes, e.size_bytes, e.provenance)
                for e in manifest.model_extents
            ),
            key=lambda w: w.address,
        )
        total = time.perf_counter() - started
        gb_per_s = (report.model_bytes + report.residual_bytes) / max(total, 1e-9) / 1e9
        self.log.info(
            "coldsnap: restored %s from pack %s in %.2f s, %.2f GB/s (%d model bytes, %d residual bytes; no checkpoint read)",
            attempt.worker.capsule_name,
            manifest.pack.sha256[:12],
            total,
            gb_per_s,
            report.model_bytes,
            report.residual_bytes,
        )
        if self.weights_line is not None:
            self.log.info(self.weights_line, total, gb_per_s)
        return LoadOutcome(
            "restored",
            attempt.worker,
            load_seconds=report.check_seconds + report.copy_seconds,
            total_seconds=total,
            hydration=report,
            capsule_source=attempt.selection.source if attempt.selection is not None else None,
            model_bytes=manifest.model_bytes,
            model=attempt.capsule.recovery.model,
            writes=tuple(writes),
            pack=manifest.pack,
            checkpoint_absent=attempt.loaded.checkpoint_absent,
            **_seed_source(attempt),
        )

    def _load_checkpoint(
        self,
        call: LoadCall,
        worker: WorkerIdentity,
        cache: PayloadCache,
        attempt: WorkerRestore | None,
        fallback: ColdsnapError | None,
        before: TorchAllocations | None,
        started: float,
    ) -> LoadOutcome:
        """The observed checkpoint load and what follows it: capture, materialization, overlay."""
        settings = self.settings
        observed = self._observe_checkpoint_load(call, worker, fallback, before, started)
        if isinstance(observed, LoadOutcome):
            return observed
        session, observer, after, records, load_seconds = observed
        ranges, kept = map_to_allocations(records, after)
        model_bytes = sum(r.size_bytes for r in ranges)
        self.log.info(
            "coldsnap: observed %d checkpoint copies in %.2f s: %d of %d allocation bytes are model bytes"
            " (%d tensors without provenance)",
            observer.checkpoint_copies,
            load_seconds,
            model_bytes,
            after.total_bytes,
            len(session.sources.unknown),
        )
        capture: CaptureResult | None = None
        handle: MaterializationHandle | None = None
        identity = attempt.capsule.recovery.model if attempt is not None and attempt.capsule is not None else None
        pack: PackRef | None = None
        if settings.export_model_payload:
            assert settings.artifact_dir is not None
            identity = self._identify(session, call)
            capture = capture_loaded_worker(
                after,
                ranges,
                worker,
                identity,
                cache=cache,
                artifact_dir=settings.artifact_dir,
                engine=self.engine,
                engine_version=self.engine_version(),
            )
            primary = session.primary(call.source.path)  # type: ignore[union-attr]
            assert primary is not None  # _identify pinned its files
            attach_model_files(settings.artifact_dir, primary.folder)
            pack = capture.manifest.pack
        elif fallback is not None and attempt is not None and attempt.pack_unavailable and attempt.layout_matches:
            handle = self._materialize(attempt, after, cache)
            if handle is not None and handle.done and handle.result is not None:
                pack = handle.result.pack
        overlay = self._capture_overlay(attempt, after, ranges) if self._wants_overlay(attempt, fallback) else None
        if identity is None and self.wants_model_identity(call):
            identity = self._identify(session, call)
        return LoadOutcome(
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
            model=identity,
            writes=tuple(ModelWrite(r.address, r.size_bytes, r.provenance()) for r in kept),
            pack=pack,
            **(_seed_source(attempt) if fallback is not None else {}),
        )

    def _observe_checkpoint_load(
        self,
        call: LoadCall,
        worker: WorkerIdentity,
        fallback: ColdsnapError | None,
        before: TorchAllocations | None,
        started: float,
    ) -> tuple[LoadSession, WriteObserver, TorchAllocations, list[ModelRecord], float] | LoadOutcome:
        """The engine's checkpoint load under the write observer: ``(session, observer, allocations after, model
        records, load seconds)``, or the outcome of a load that could not be observed or classified (``before``: the
        restore attempt's allocations, reused); under export that is an ObserverError instead."""
        export = self.settings.export_model_payload
        if export and call.source is None:
            raise ObserverError(
                "COLDSNAP_EXPORT_MODEL_PAYLOAD=1 needs the loader's load_model (it watches the checkpoint iterator);"
                f" {self.weights_call} was called outside it"
            )
        try:
            before = enumerate_allocations(call.model) if before is None else before  # type: ignore[arg-type]
        except ObserverError as exc:
            if export:
                raise
            self.log.info("coldsnap: not observing this load (%s)", exc.detail)
            self.load_checkpoint(call)
            seconds = time.perf_counter() - started
            return LoadOutcome("checkpoint", worker, seconds, seconds, fallback, observed=False)
        session = LoadSession()
        observer = WriteObserver(session.sources, converted_copies=self.settings.converted_copies)
        load_started = time.perf_counter()
        self.session = session
        try:
            with observer:
                self.load_checkpoint(call)
        finally:
            self.session = None
        load_seconds = time.perf_counter() - load_started
        try:
            after = enumerate_allocations(call.model)  # type: ignore[arg-type]
            records = observer.loaded_records(before, after)
        except ObserverError as problem:
            if export:
                raise
            self.log.info("coldsnap: %s; nothing is published for the sleep backend", problem.detail)
            return LoadOutcome("checkpoint", worker, load_seconds, time.perf_counter() - started, fallback, observed=False)
        return session, observer, after, records, load_seconds

    def _identify(self, session: LoadSession, call: LoadCall) -> ModelIdentity:
        """The model identity of this load (the checkpoint files just loaded, hashed and recorded)."""
        source = call.source
        assert source is not None
        return session.identify(
            source.path,
            revision=source.identity_revision(),
            config_sha256=source.config_sha256,
            state_root=self.settings.state_root,
            config_json=source.config_json,
        )

    def _materialize(
        self, attempt: WorkerRestore, allocations: TorchAllocations, cache: PayloadCache
    ) -> MaterializationHandle | None:
        assert attempt.manifest is not None
        mode = self.settings.materialize
        if mode == "off":
            return None
        self.log.info(
            "coldsnap: materializing pack %s from the loaded weights (COLDSNAP_MATERIALIZE=%s)",
            attempt.manifest.pack.sha256[:12],
            mode,
        )
        # keepalive: vLLM's CPU post-processing replaces every linear weight; the writer reads the loaded bytes
        return materialize_payload(
            attempt.manifest, allocations.live, copy_backend_for(allocations.device), cache, mode=mode, keepalive=allocations
        )

    def _wants_overlay(self, attempt: WorkerRestore | None, fallback: ColdsnapError | None) -> bool:
        """Capture an overlay: ``overlay=capture``, or ``auto`` after a target fallback from a capsule this engine captured."""
        if attempt is None or attempt.portable_capsule is None:
            return False
        mode = self.settings.overlay
        if mode == "capture":
            return True
        portable = attempt.portable_capsule
        return (
            mode == "auto"
            and fallback is not None
            and fallback is attempt.target_mismatch
            and portable.target is not None
            and portable.target.engine == self.engine
        )

    def _capture_overlay(self, attempt: WorkerRestore | None, after: TorchAllocations, ranges) -> OverlayCapture | None:
        """The overlay of the loaded model, after the identity check; a failure is raised under ``capture``, else a WARNING."""
        settings = self.settings
        assert attempt is not None and settings.artifact_dir is not None
        assert attempt.portable_capsule is not None and attempt.entry is not None
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
            self.log.warning("coldsnap: %s: no target-local overlay captured: %s", attempt.worker.capsule_name, exc)
            return None

    def _line(self, outcome: Outcome, worker: WorkerIdentity, seconds: float, **fields: Any) -> LoadOutcomeLine:
        """This load's outcome line (``fields``: the optional ones of :class:`LoadOutcomeLine`)."""
        artifact_dir = None if self.settings.artifact_dir is None else str(self.settings.artifact_dir)
        return LoadOutcomeLine(outcome, self.engine, worker.capsule_name, artifact_dir, seconds, **fields)


class ObservedLoader:
    """A mixin an engine adapter lists before its engine's ``DefaultModelLoader`` (vLLM's and SGLang's share both
    methods): while :attr:`LoadPolicy.session` is set, each prepared source and each yielded tensor is recorded."""

    policy: LoadPolicy

    def _prepare_weights(self, model_name_or_path, *args, **kwargs):
        result = super()._prepare_weights(model_name_or_path, *args, **kwargs)  # type: ignore[misc]
        session = self.policy.session
        if session is not None:
            folder, files, use_safetensors = result[0], result[1], result[2]
            session.prepared.append(
                PreparedWeights(str(model_name_or_path), Path(folder), [Path(f) for f in files], bool(use_safetensors))
            )
        return result

    def _get_weights_iterator(self, source, *args, **kwargs):
        iterator = super()._get_weights_iterator(source, *args, **kwargs)  # type: ignore[misc]
        session = self.policy.session
        return iterator if session is None else session.observe(getattr(source, "prefix", "") or "", iterator)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (slow in an engine process) around the load's bookkeeping of many small
    objects; vLLM runs ``gc.collect()`` right after ``load_weights`` (``vllm/model_executor/model_loader/base_loader.py``),
    so nothing accumulates."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _report(settings: ColdsnapSettings, line: LoadOutcomeLine, outcome: LoadOutcome | None = None) -> None:
    """The one report of a load: its outcome line and its metrics (``outcome``: ``None`` for a refusal)."""
    append_outcome(settings.outcome_log_path, line)
    if outcome is None:
        record_load(line)
        return
    hydration = outcome.hydration
    record_load(
        line,
        stage_seconds=outcome.stage_seconds,
        hydrated_bytes=0 if hydration is None else hydration.model_bytes + hydration.residual_bytes,
        fetched_bytes=outcome.fetched_bytes,
    )


def _report_settings(environ: Mapping[str, str], extra_config: Mapping[str, object] | str | None) -> ColdsnapSettings:
    """The settings a refusal of invalid settings is reported with: the state root, the outcome log and the
    termination log, each resolved alone (its default where its own value is invalid)."""
    if isinstance(extra_config, str):
        try:
            extra_config = json.loads(extra_config or "{}")
        except ValueError:
            extra_config = None
    extra = extra_config if isinstance(extra_config, Mapping) else None
    values: dict[str, object] = {}
    for row in SETTINGS:
        if row.field in ("state_root", "outcome_log", "termination_log"):
            with contextlib.suppress(ColdsnapError):
                values[row.field] = getattr(ColdsnapSettings.resolve(environ, extra, rows=(row,))[0], row.field)
    return ColdsnapSettings(**values)  # type: ignore[arg-type]


def _seed_source(attempt: WorkerRestore | None) -> dict[str, object]:
    """``capsule_dir`` and ``capsule_files`` of the derived-cache seed for the capsule ``attempt`` chose: a selected
    overlay's own (``docs/format.md`` §15.4, §17.4), else the portable capsule's; nothing when it read none."""
    if attempt is None or attempt.portable_capsule is None or attempt.entry is None:
        return {}
    overlay_seed = attempt.selection.seed_source if attempt.selection is not None else None
    if overlay_seed is not None:
        return {"capsule_dir": overlay_seed[0], "capsule_files": overlay_seed[1]}
    return {"capsule_dir": attempt.portable_capsule.path, "capsule_files": attempt.entry.capsule_files}
