"""The ``coldsnap`` load format: vLLM's ``DefaultModelLoader`` (``register_model_loader("coldsnap")``, vLLM
``model_executor/model_loader/__init__.py``), observed, with capture and restore. It keeps the inner loader's I/O: its
own ``load_config`` has the inner ``load_format`` and no coldsnap extra-config keys (which ``DefaultModelLoader``
rejects). ``load_weights`` runs :meth:`coldsnap_core.load_policy.LoadPolicy.load` and publishes a
:class:`coldsnap_vllm.state.WorkerLoadState` for the level-1 sleep backend."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import ClassVar, NamedTuple

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.identity.model_identity import engine_checkpoint_files
from coldsnap_core.load_policy import LoadCall, LoadOutcome, LoadPolicy, ModelSource, ObservedLoader
from coldsnap_vllm import compat
from coldsnap_vllm import derived_cache as seeds
from coldsnap_vllm import state as load_state

logger = logging.getLogger(__name__)

ENGINE = "vllm"
"""The engine name recorded in a capsule's ``target.json`` (``docs/format.md`` §15.1)."""

LOAD_FORMAT = "coldsnap"
"""The load format name: ``--load-format coldsnap`` / ``LLM(..., load_format="coldsnap")``."""

__all__ = ["LOAD_FORMAT", "ColdsnapModelLoader", "register_loader"]


class _Inputs(NamedTuple):
    """vLLM's inputs of one ``load_weights`` call: ``vllm_config`` as ``load_model`` was given it, or ``None``."""

    model_config: ModelConfig
    vllm_config: object | None


class _VllmLoad(LoadPolicy):
    """The load policy with vLLM's parts: one per :class:`ColdsnapModelLoader`."""

    engine: ClassVar[str] = ENGINE
    engine_label: ClassVar[str] = "vLLM"
    weights_line: ClassVar[str | None] = "Loading weights took %.2f seconds (%.2f GB/s, restored by coldsnap)"
    """``DefaultModelLoader.load_weights``' line (dashboards key on it), with the restore's rate."""

    def worker_identity(self) -> WorkerIdentity:
        return compat.worker_identity()

    def checkpoint_files(self, call: LoadCall) -> tuple[list[str] | None, str | None]:
        """Through vLLM's ``DefaultModelLoader._prepare_weights`` (with the model's ``fall_back_to_pt_during_load`` and
        ``allow_patterns_overrides``, as ``DefaultModelLoader.Source.init_new`` passes them), not the observed override."""
        source, model = call.source, call.model
        assert source is not None
        return engine_checkpoint_files(
            source.path,
            self.engine_label,
            lambda: DefaultModelLoader._prepare_weights(
                self.loader,
                source.path,
                None,
                source.revision,
                getattr(model, "fall_back_to_pt_during_load", True),
                getattr(model, "allow_patterns_overrides", None),
            ),
        )

    def load_checkpoint(self, call: LoadCall) -> None:
        DefaultModelLoader.load_weights(self.loader, call.model, call.engine.model_config)  # type: ignore[arg-type]

    def place_derived_cache(self, call: LoadCall, outcome: LoadOutcome):
        """The capsule's seed of vLLM's compile cache, placed before vLLM compiles (``docs/format.md`` §17)."""
        assert outcome.capsule_dir is not None and call.source is not None
        return seeds.place(
            call.engine.vllm_config,
            outcome.capsule_dir,
            outcome.capsule_files,
            engine=self.engine,
            engine_version=self.engine_version(),
            config_sha256=call.source.config_sha256,
            enabled=self.settings.derived_cache == "auto",
        )

    def capture_derived_cache(self, call: LoadCall, outcome: LoadOutcome) -> None:
        """vLLM's compile cache into the capsule this load wrote, once vLLM has compiled."""
        assert call.source is not None and self.settings.artifact_dir is not None
        seeds.capture_after_compilation(
            call.model,
            call.engine.vllm_config,
            outcome,
            self.settings.artifact_dir,
            engine=self.engine,
            engine_version=self.engine_version(),
            config_sha256=call.source.config_sha256,
        )

    def wants_model_identity(self, call: LoadCall) -> bool:
        """With ``--sleep-mode-backend coldsnap``: the sleep backend's reference digests need the pinned files."""
        config = call.engine.model_config
        return bool(getattr(config, "enable_sleep_mode", False)) and getattr(config, "sleep_mode_backend", None) == "coldsnap"


class ColdsnapModelLoader(ObservedLoader, DefaultModelLoader):
    """vLLM's default loader with coldsnap capture and restore; ``__init__`` only parses settings (built several times).

    Raises:
        EngineVersionError: this vLLM is not 0.32 or 0.33, or its private loader API moved.
        ConfigurationError: a coldsnap setting is invalid, or the payload store it names is malformed (a refused
            start, :meth:`coldsnap_core.load_policy.LoadPolicy.refusing_settings`).
    """

    def __init__(self, load_config: LoadConfig) -> None:
        compat.require_supported_vllm()
        extra = load_config.model_loader_extra_config
        with _VllmLoad.refusing_settings(os.environ, extra, compat.worker_identity, logger):
            settings, rest = compat.resolve_settings(os.environ, extra)
            inner_format = settings.inner_load_format or compat.default_inner_load_format()
            super().__init__(dataclasses.replace(load_config, load_format=inner_format, model_loader_extra_config=rest))
            self.coldsnap_settings = settings
            self.policy = _VllmLoad(settings, log=logger, loader=self)
        self._vllm_config = None

    def load_model(self, vllm_config, model_config, prefix: str = ""):  # type: ignore[override]
        """vLLM's ``BaseModelLoader.load_model``, keeping ``vllm_config`` (not given to ``load_weights``) for the seed."""
        self._vllm_config = vllm_config
        return super().load_model(vllm_config, model_config, prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> LoadOutcome:  # type: ignore[override]
        """:meth:`LoadPolicy.load` (vLLM ignores the result); raises its ColdsnapError (``native``, a failed export capture)."""
        # a later load (vLLM's reload_weights) replaces the weights: the sleep backend never sees the previous state
        load_state.clear()
        source = ModelSource.of_engine(
            model_config, str(model_config.model), model_config.revision, self.load_config.download_dir
        )
        outcome = self.policy.load(LoadCall(model, source, _Inputs(model_config, self._vllm_config)))
        if not outcome.observed:
            return outcome
        settings = self.policy.settings  # after a pull of COLDSNAP_ARTIFACT_DIR=REF: the folder it pulled
        download_dir = self.load_config.download_dir
        load_state.publish(
            load_state.WorkerLoadState(
                worker=outcome.worker,
                model=outcome.model,
                writes=outcome.writes,
                pack=outcome.pack,
                artifact_dir=settings.artifact_dir,
                state_root=settings.state_root,
                hf_cache_dir=None if download_dir is None else Path(download_dir),
                verify_extents=settings.verify_extents,
                lock_timeout_s=settings.lock_timeout_s,
            )
        )
        return outcome


_registration_lock = threading.Lock()


def register_loader() -> None:
    """Register load format ``coldsnap`` and attach coldsnap's logging to vLLM's (idempotent; no CUDA init; no version check)."""
    from vllm.model_executor import model_loader

    with _registration_lock:
        compat.attach_logging()
        table = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", None)
        if isinstance(table, dict) and table.get(LOAD_FORMAT) is ColdsnapModelLoader:
            return
        model_loader.register_model_loader(LOAD_FORMAT)(ColdsnapModelLoader)
