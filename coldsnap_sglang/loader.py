"""The SGLang loader: ``DefaultModelLoader`` with coldsnap capture and restore, then SGLang's own
post-processing.

SGLang's ``DefaultModelLoader.load_model`` builds the model, then calls
``self.load_weights_and_postprocess(model, self._get_all_weights(model_config, model), target_device)``
(SGLang 0.5.23 ``python/sglang/srt/model_loader/loader.py``; an instance override is honoured). This
loader overrides it:

* **restore** (``COLDSNAP_ARTIFACT_DIR`` set, export off): :func:`coldsnap_core.restore.restore_or_fall_back`
  checks the layout and the model identity (checkpoint files and the digest of SGLang's model
  configuration, :func:`engine_config_sha256`; for a local folder, the files SGLang's own
  ``_prepare_weights`` would read now, which must be exactly the recorded ones), stages this worker's pack
  only, verifies and hydrates the model's parameter and buffer storages (the portable capture point). The
  checkpoint iterator is never consumed; SGLang's post-processing then runs. ``COLDSNAP_RESTORE=auto``
  falls back to the normal load with one WARNING; ``native`` fails closed.
* **capture** (``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``): SGLang's ``model.load_weights`` runs under the
  engine-neutral write observer (:mod:`coldsnap_core.observer`; the iterator boundary is watched by
  overriding ``_prepare_weights`` and ``_get_weights_iterator``), then
  :func:`coldsnap_core.capture.capture_worker` writes this worker's pack with the canonical writer to
  ``<state-root>/model-payloads/sha256/<digest>.pack`` and its SGLang capsule (residual blob, manifests)
  to the artifact folder, before SGLang's post-processing. The model bytes of a checkpoint are the same
  in SGLang and vLLM, so both engines' captures of one checkpoint name the same pack.

Settings are those of :mod:`coldsnap_core.settings` (environment variables or
``--model-loader-extra-config`` keys, removed before SGLang's loader validates the rest), with
materialization ``off`` by default and the only accepted value (:mod:`coldsnap_sglang.settings`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from sglang.srt.configs.load_config import LoadFormat
from sglang.srt.model_loader.loader import DefaultModelLoader

from coldsnap_core.cache import PayloadCache
from coldsnap_core.capture import CaptureResult
from coldsnap_core.errors import ColdsnapError, EngineVersionError, ObserverError
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.model_identity import (
    LoadedModel,
    engine_checkpoint_files,
    model_config_sha256,
    resolve_hub_commit,
)
from coldsnap_core.observer import LoadSession, PreparedWeights, WriteObserver, collector_paused, map_to_allocations
from coldsnap_core.outcomes import LoadOutcomeLine, Outcome, append_outcome
from coldsnap_core.restore import capture_loaded_worker, restore_or_fall_back
from coldsnap_core.target import engine_version
from coldsnap_core.torch_allocations import enumerate_allocations
from coldsnap_sglang.settings import resolve_sglang_settings

logger = logging.getLogger(__name__)

ENGINE = "sglang"
"""The engine name recorded in a capsule's ``target.json`` (``docs/format.md`` §15.1)."""

if not all(
    hasattr(DefaultModelLoader, name) for name in ("load_weights_and_postprocess", "load_weights_only", "postprocess_weights")
):
    raise EngineVersionError(
        "this SGLang's DefaultModelLoader lacks load_weights_and_postprocess, load_weights_only or postprocess_weights"
        " (SGLang 0.5.23 python/sglang/srt/model_loader/loader.py); coldsnap_sglang supports SGLang 0.5.23"
    )


def worker_identity(load_config: object) -> WorkerIdentity:
    """This scheduler process's worker identity: the tensor parallel rank from ``LoadConfig.tp_rank``,
    the global rank and world size from ``torch.distributed`` (rank 0 of 1 when not initialised)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    world = torch.distributed.get_world_size() if distributed else 1
    tp_rank = getattr(load_config, "tp_rank", None)
    tp_rank = rank if tp_rank is None else int(tp_rank)
    tp_size = world
    with contextlib.suppress(ImportError, AssertionError, AttributeError, RuntimeError):
        from sglang.srt.distributed import get_tensor_model_parallel_world_size

        tp_size = get_tensor_model_parallel_world_size()
    return WorkerIdentity("worker", rank, world, tp_rank, max(tp_size, tp_rank + 1))


class ColdsnapModelLoader(DefaultModelLoader):
    """SGLang ``DefaultModelLoader`` with coldsnap capture and restore (see the module docstring).

    Raises:
        ConfigurationError: a coldsnap setting is invalid, or asks for materialization ``async`` or
            ``required`` (:func:`coldsnap_sglang.settings.resolve_sglang_settings`).
    """

    def __init__(self, load_config) -> None:
        self.coldsnap_settings, rest = resolve_sglang_settings(os.environ, load_config.model_loader_extra_config)
        # The parent sees the inner format (SGLang's DefaultModelLoader dispatches its file patterns
        # and iterator on it) and only the extra-config keys it knows (it rejects the others).
        inner = LoadFormat(self.coldsnap_settings.inner_load_format or "auto")
        super().__init__(dataclasses.replace(load_config, load_format=inner, model_loader_extra_config=rest))
        self._model_config = None
        self._session: LoadSession | None = None

    def load_model(self, *, model_config, device_config, **kwargs):
        self._model_config = model_config
        if self.coldsnap_settings.export_model_payload:
            self._session = LoadSession()
        try:
            return super().load_model(model_config=model_config, device_config=device_config, **kwargs)
        finally:
            self._session = None

    # -- the iterator boundary (capture only) ------------------------------------------------------

    def _prepare_weights(self, model_name_or_path, revision, fall_back_to_pt, *args, **kwargs):  # type: ignore[override]
        result = super()._prepare_weights(model_name_or_path, revision, fall_back_to_pt, *args, **kwargs)
        if self._session is not None:
            folder, files, use_safetensors = result[0], result[1], result[2]
            self._session.prepared.append(
                PreparedWeights(str(model_name_or_path), Path(folder), [Path(f) for f in files], bool(use_safetensors))
            )
        return result

    def _get_weights_iterator(self, source, *args, **kwargs):  # type: ignore[override]
        iterator = super()._get_weights_iterator(source, *args, **kwargs)
        if self._session is None:
            return iterator  # update_weights_from_disk and other callers outside an observed load
        return self._session.observe(getattr(source, "prefix", "") or "", iterator)

    # -- load_weights_and_postprocess --------------------------------------------------------------

    def load_weights_and_postprocess(self, model: torch.nn.Module, weights: Iterable, target_device: torch.device):  # type: ignore[override]
        """Capture, or hydrate from the artifact when possible; then SGLang's post-processing; else the
        normal load.

        Appends one line to the load outcome log (:mod:`coldsnap_core.outcomes`): captured, restored, fell
        back, refused (``native``, or a failed capture; the error is raised) or checkpoint (no artifact folder).

        Raises:
            ColdsnapError: ``COLDSNAP_RESTORE=native`` and the restore failed (the verifier's error), or
                the export capture failed.
        """
        started = time.perf_counter()
        settings = self.coldsnap_settings
        worker = worker_identity(self.load_config)
        if settings.export_model_payload:
            try:
                captured = self._capture(model, weights, target_device)
            except ColdsnapError as exc:
                _log_outcome(settings, "refused", worker, time.perf_counter() - started, exc)
                raise
            DefaultModelLoader.postprocess_weights(model, target_device)
            _log_outcome(settings, "captured", worker, time.perf_counter() - started, pack_sha256=captured.manifest.pack.sha256)
            return None
        source = self._loaded_model(model) if settings.artifact_dir is not None else None
        failures: list[ColdsnapError] = []
        try:
            restored_pack = restore_into(model, settings, worker, source, failures=failures)
        except ColdsnapError as exc:
            _log_outcome(settings, "refused", worker, time.perf_counter() - started, exc)
            raise
        if restored_pack is not None:
            DefaultModelLoader.postprocess_weights(model, target_device)
            _log_outcome(settings, "restored", worker, time.perf_counter() - started, pack_sha256=restored_pack)
            return None
        result = DefaultModelLoader.load_weights_and_postprocess(model, weights, target_device)
        kind = "checkpoint" if settings.artifact_dir is None else "fell-back"
        _log_outcome(settings, kind, worker, time.perf_counter() - started, failures[0] if failures else None)
        return result

    def _capture(self, model: torch.nn.Module, weights: Iterable, target_device: torch.device) -> CaptureResult:
        """SGLang's ``DefaultModelLoader.load_weights_only`` (the first half of its
        ``load_weights_and_postprocess``: ``model.load_weights`` on the checkpoint iterator) under the write
        observer, then the capture of this worker, before the post-processing.

        Raises:
            ObserverError: the loader was not entered through ``load_model``, the iterator was never
                prepared, a weight loader rebound a parameter's storage, or an operator wrote into a
                tensor without a data pointer (``WriteObserver.loaded_records``).
        """
        session, model_config, settings = self._session, self._model_config, self.coldsnap_settings
        if session is None or model_config is None:
            raise ObserverError(
                "COLDSNAP_EXPORT_MODEL_PAYLOAD=1 needs the loader's load_model (it watches the checkpoint iterator);"
                " load_weights_and_postprocess was called outside it"
            )
        assert settings.artifact_dir is not None  # ColdsnapSettings.resolve requires it with export
        worker = worker_identity(self.load_config)
        started = time.perf_counter()
        with collector_paused():
            before = enumerate_allocations(model)
            observer = WriteObserver(session.sources, converted_copies=settings.converted_copies)
            with observer:
                DefaultModelLoader.load_weights_only(model, weights, target_device)
            load_seconds = time.perf_counter() - started
            after = enumerate_allocations(model)
            ranges, _ = map_to_allocations(observer.loaded_records(before, after), after)
            identity = session.identify(
                str(model_config.model_path),
                revision=_identity_revision(model_config, getattr(self.load_config, "download_dir", None)),
                config_sha256=engine_config_sha256(model_config),
                state_root=settings.state_root,
            )
            # The capsule records SGLang as its engine (``target.json``, ``docs/format.md`` §15): a
            # vLLM restore refuses it by name, and an SGLang restore qualifies it.
            result = capture_loaded_worker(
                after,
                ranges,
                worker,
                identity,
                cache=PayloadCache(settings.state_root, lock_timeout_seconds=settings.lock_timeout_s),
                artifact_dir=settings.artifact_dir,
                engine=ENGINE,
            )
        logger.info(
            "coldsnap: observed %d checkpoint copies in %.2f s: %d of %d allocation bytes are model bytes",
            observer.checkpoint_copies,
            load_seconds,
            result.manifest.model_bytes,
            after.total_bytes,
        )
        return result

    def _loaded_model(self, model: torch.nn.Module) -> LoadedModel | None:
        """What SGLang is loading, for the model identity check: a repository id is pinned by the commit
        its revision resolves to in the Hugging Face cache SGLang downloads into (``--download-dir``,
        else ``HF_HUB_CACHE``); a local folder by the files SGLang would read from it now, through SGLang's
        ``DefaultModelLoader._prepare_weights(model_name_or_path, revision, fall_back_to_pt)`` (SGLang 0.5.23
        ``model_loader/loader.py``) with the model's ``fall_back_to_pt_during_load``."""
        model_config = self._model_config
        if model_config is None:  # load_weights_and_postprocess called outside load_model
            return None
        path = str(model_config.model_path)
        revision = getattr(model_config, "revision", None)
        files, files_error = engine_checkpoint_files(
            path, "SGLang", lambda: self._prepare_weights(path, revision, getattr(model, "fall_back_to_pt_during_load", True))
        )
        return LoadedModel.from_config(
            path,
            revision,
            engine_config_sha256(model_config),
            cache_dir=getattr(self.load_config, "download_dir", None),
            checkpoint_files=files,
            checkpoint_files_error=files_error,
        )


def engine_config_sha256(model_config) -> str | None:
    """:func:`coldsnap_core.model_identity.model_config_sha256` of SGLang's effective model configuration:
    ``model_config.hf_config`` (SGLang applies ``--json-model-override-args`` to it), ``model_config.dtype``
    and ``model_config.quantization``; ``None`` when the config has no ``hf_config``."""
    hf_config = getattr(model_config, "hf_config", None)
    if hf_config is None:
        return None
    return model_config_sha256(
        hf_config, dtype=getattr(model_config, "dtype", None), quantization=getattr(model_config, "quantization", None)
    )


def _identity_revision(model_config, download_dir: str | None) -> str | None:
    """The revision the model identity records: for a local folder SGLang's ``model_config.revision`` as
    given; for a Hugging Face repository id the commit it resolves to in the cache SGLang downloads into
    (:func:`coldsnap_core.model_identity.resolve_hub_commit`), or the revision as given when the cache cannot
    resolve it (a restore then refuses the artifact: fail closed)."""
    revision = getattr(model_config, "revision", None)
    requested = None if revision is None else str(revision)
    if os.path.isdir(str(model_config.model_path)):
        return requested
    commit = resolve_hub_commit(str(model_config.model_path), revision, cache_dir=download_dir)
    return commit if commit is not None else requested


def _log_outcome(
    settings,
    outcome: Outcome,
    worker: WorkerIdentity,
    seconds: float,
    error: ColdsnapError | None = None,
    *,
    pack_sha256: str | None = None,
) -> None:
    append_outcome(
        settings.outcome_log_path,
        LoadOutcomeLine(
            outcome,
            "sglang",
            worker.capsule_name,
            None if settings.artifact_dir is None else str(settings.artifact_dir),
            seconds,
            error=error,
            pack_sha256=pack_sha256,
        ),
    )


def restore_into(
    model: torch.nn.Module,
    settings,
    worker: WorkerIdentity,
    source: LoadedModel | None,
    *,
    failures: list[ColdsnapError] | None = None,
) -> str | None:
    """Restore ``model`` from the artifact; the SHA-256 of the pack restored from, or ``None`` to load the
    checkpoint (under ``auto`` the error that made it fall back is appended to ``failures``).

    The ``COLDSNAP_RESTORE`` policy is :func:`coldsnap_core.restore.restore_or_fall_back`'s. ``source``
    is ``None`` when the loader does not know the model being loaded (called outside ``load_model``,
    which records the model configuration): that fails the identity check (rule ``model-identity``)
    like any other mismatch.

    Raises:
        ColdsnapError: ``COLDSNAP_RESTORE=native`` and the restore failed (the verifier's error).
    """
    result = restore_or_fall_back(
        model,
        settings,
        worker,
        source,
        engine="SGLang",
        target_engine=ENGINE,
        engine_version=engine_version(ENGINE),
        log=logger,
    )
    if not result.restored:
        if result.fallback is not None and failures is not None:
            failures.append(result.fallback)
        return None
    assert result.attempt is not None and result.attempt.capsule is not None and result.report is not None
    logger.info(
        "coldsnap: restored %s from pack %s (%d model bytes, %d residual bytes; no checkpoint read)",
        worker.capsule_name,
        result.attempt.capsule.native.pack.sha256[:12],
        result.report.model_bytes,
        result.report.residual_bytes,
    )
    return result.attempt.capsule.native.pack.sha256
