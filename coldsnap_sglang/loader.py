"""The SGLang loader: ``DefaultModelLoader`` that hydrates from pack + residual instead of reading
the checkpoint, then runs SGLang's own post-processing.

SGLang's ``DefaultModelLoader.load_model`` builds the model, then calls
``self.load_weights_and_postprocess(model, weights, target_device)`` (SGLang
``srt/model_loader/loader.py``; an instance override is honoured, SGLang's own tests rely on it). This loader overrides it:
when ``COLDSNAP_ARTIFACT_DIR`` lists this worker, :func:`coldsnap_core.restore.restore_or_fall_back` checks
the layout and the model identity (checkpoint files and the digest of SGLang's model configuration,
:func:`engine_config_sha256`; for a local folder, the files SGLang's own ``_prepare_weights`` would
read now, which must be exactly the recorded ones), stages this worker's pack only, verifies and
hydrates the model's parameter and buffer storages (the portable capture point); the checkpoint iterator is never
consumed, and the post-processing then runs on an empty weights iterator. ``COLDSNAP_RESTORE=auto``
falls back to the normal load with one WARNING; ``native`` fails closed.

Settings are those of :mod:`coldsnap_core.settings` (environment variables or
``--model-loader-extra-config`` keys, removed before SGLang's loader validates the rest), with
materialization ``off`` by default and the only accepted value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable

import torch
from sglang.srt.configs.load_config import LoadFormat
from sglang.srt.model_loader.loader import DefaultModelLoader

from coldsnap_core.errors import ColdsnapError, EngineVersionError
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.model_identity import model_config_sha256
from coldsnap_core.outcomes import LoadOutcomeLine, Outcome, append_outcome
from coldsnap_core.restore import LoadedModel, engine_checkpoint_files, restore_or_fall_back
from coldsnap_sglang.settings import resolve_sglang_settings

logger = logging.getLogger(__name__)

if not hasattr(DefaultModelLoader, "load_weights_and_postprocess"):
    raise EngineVersionError(
        "this SGLang's DefaultModelLoader has no load_weights_and_postprocess; coldsnap_sglang supports SGLang 0.5.18-0.5.23"
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
    """SGLang ``DefaultModelLoader`` with coldsnap restore (see the module docstring).

    Raises:
        ConfigurationError: a coldsnap setting is invalid, or asks for materialization or capture.
    """

    def __init__(self, load_config) -> None:
        self.coldsnap_settings, rest = resolve_sglang_settings(os.environ, load_config.model_loader_extra_config)
        # The parent sees the inner format (SGLang's DefaultModelLoader dispatches its file patterns
        # and iterator on it) and only the extra-config keys it knows (it rejects the others).
        inner = LoadFormat(self.coldsnap_settings.inner_load_format or "auto")
        super().__init__(dataclasses.replace(load_config, load_format=inner, model_loader_extra_config=rest))
        self._model_config = None

    def load_model(self, *, model_config, device_config, **kwargs):
        self._model_config = model_config
        return super().load_model(model_config=model_config, device_config=device_config, **kwargs)

    def load_weights_and_postprocess(self, model: torch.nn.Module, weights: Iterable, target_device: torch.device):  # type: ignore[override]
        """Hydrate from the artifact when possible, then SGLang's post-processing; else the normal load.

        Appends one line to the load outcome log (:mod:`coldsnap_core.outcomes`): restored, fell back,
        refused (``native``; the error is raised) or checkpoint (no artifact folder)."""
        started = time.perf_counter()
        settings = self.coldsnap_settings
        worker = worker_identity(self.load_config)
        source = self._loaded_model(model) if settings.artifact_dir is not None else None
        failures: list[ColdsnapError] = []
        try:
            restored = restore_into(model, settings, worker, source, failures=failures)
        except ColdsnapError as exc:
            _log_outcome(settings, "refused", worker, time.perf_counter() - started, exc)
            raise
        if restored:
            result = DefaultModelLoader.load_weights_and_postprocess(model, iter(()), target_device)
            _log_outcome(settings, "restored", worker, time.perf_counter() - started)
            return result
        result = DefaultModelLoader.load_weights_and_postprocess(model, weights, target_device)
        kind = "checkpoint" if settings.artifact_dir is None else "fell-back"
        _log_outcome(settings, kind, worker, time.perf_counter() - started, failures[0] if failures else None)
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


def _log_outcome(settings, outcome: Outcome, worker: WorkerIdentity, seconds: float, error: ColdsnapError | None = None) -> None:
    append_outcome(
        settings.outcome_log_path,
        LoadOutcomeLine(
            outcome,
            "sglang",
            worker.capsule_name,
            None if settings.artifact_dir is None else str(settings.artifact_dir),
            seconds,
            error=error,
        ),
    )


def restore_into(
    model: torch.nn.Module,
    settings,
    worker: WorkerIdentity,
    source: LoadedModel | None,
    *,
    failures: list[ColdsnapError] | None = None,
) -> bool:
    """Restore ``model`` from the artifact; ``True`` when restored, ``False`` to load the checkpoint
    (under ``auto`` the error that made it fall back is appended to ``failures``).

    The ``COLDSNAP_RESTORE`` policy is :func:`coldsnap_core.restore.restore_or_fall_back`'s. ``source``
    is ``None`` when the loader does not know the model being loaded (called outside ``load_model``,
    which records the model configuration): that fails the identity check (rule ``model-identity``)
    like any other mismatch.

    Raises:
        ColdsnapError: ``COLDSNAP_RESTORE=native`` and the restore failed (the verifier's error).
    """
    result = restore_or_fall_back(model, settings, worker, source, engine="SGLang", log=logger)
    if not result.restored:
        if result.fallback is not None and failures is not None:
            failures.append(result.fallback)
        return False
    assert result.attempt is not None and result.attempt.capsule is not None and result.report is not None
    logger.info(
        "coldsnap: restored %s from pack %s (%d model bytes, %d residual bytes; no checkpoint read)",
        worker.capsule_name,
        result.attempt.capsule.native.pack.sha256[:12],
        result.report.model_bytes,
        result.report.residual_bytes,
    )
    return True
