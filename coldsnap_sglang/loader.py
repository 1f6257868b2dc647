"""The SGLang loader: ``DefaultModelLoader`` with coldsnap capture and restore, then SGLang's own post-processing.
SGLang's ``DefaultModelLoader.load_model`` builds the model, then calls ``self.load_weights_and_postprocess``
(SGLang 0.5.23 ``python/sglang/srt/model_loader/loader.py``), which this loader overrides: its checkpoint load is
``load_weights_only``, so a capture is taken before SGLang's ``postprocess_weights``. SGLang keeps no compile cache."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterable
from typing import ClassVar

import torch
from sglang.srt.configs.load_config import LoadFormat
from sglang.srt.model_loader.loader import DefaultModelLoader

from coldsnap_core.errors import EngineVersionError
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.identity.model_identity import engine_checkpoint_files
from coldsnap_core.load_policy import LoadCall, LoadOutcome, LoadPolicy, ModelSource, ObservedLoader
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
    """This scheduler process's worker identity: the tensor parallel rank from ``LoadConfig.tp_rank``, the global
    rank and world size from ``torch.distributed`` (rank 0 of 1 when not initialised)."""
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


class _SglangLoad(LoadPolicy):
    """The load policy with SGLang's parts; a call's ``engine`` is ``(weights, target_device)``."""

    engine: ClassVar[str] = ENGINE
    engine_label: ClassVar[str] = "SGLang"
    weights_call: ClassVar[str] = "load_weights_and_postprocess"

    def worker_identity(self) -> WorkerIdentity:
        return worker_identity(self.loader.load_config)

    def checkpoint_files(self, call: LoadCall) -> tuple[list[str] | None, str | None]:
        """Through SGLang's ``DefaultModelLoader._prepare_weights`` with the model's ``fall_back_to_pt_during_load``."""
        source = call.source
        assert source is not None
        fall_back_to_pt = getattr(call.model, "fall_back_to_pt_during_load", True)
        return engine_checkpoint_files(
            source.path,
            self.engine_label,
            lambda: DefaultModelLoader._prepare_weights(self.loader, source.path, source.revision, fall_back_to_pt),
        )

    def load_checkpoint(self, call: LoadCall) -> None:
        weights, target_device = call.engine
        DefaultModelLoader.load_weights_only(call.model, weights, target_device)


class ColdsnapModelLoader(ObservedLoader, DefaultModelLoader):
    """SGLang ``DefaultModelLoader`` with coldsnap capture and restore.

    Raises:
        ConfigurationError: a coldsnap setting is invalid (:func:`coldsnap_sglang.settings.resolve_sglang_settings`)
            or names a malformed payload store: a refused start (:meth:`LoadPolicy.refusing_settings`).
    """

    def __init__(self, load_config) -> None:
        extra = load_config.model_loader_extra_config
        with _SglangLoad.refusing_settings(os.environ, extra, lambda: worker_identity(load_config), logger):
            self.coldsnap_settings, rest = resolve_sglang_settings(os.environ, extra)
            # the parent sees the inner format (it picks file patterns and iterator by it) and only its own keys
            inner = LoadFormat(self.coldsnap_settings.inner_load_format or "auto")
            super().__init__(dataclasses.replace(load_config, load_format=inner, model_loader_extra_config=rest))
            self.policy = _SglangLoad(self.coldsnap_settings, log=logger, loader=self)
        self._model_config = None

    def load_model(self, *, model_config, device_config, **kwargs):
        self._model_config = model_config
        try:
            return super().load_model(model_config=model_config, device_config=device_config, **kwargs)
        finally:
            self._model_config = None

    def load_weights_and_postprocess(self, model: torch.nn.Module, weights: Iterable, target_device: torch.device):  # type: ignore[override]
        """:meth:`coldsnap_core.load_policy.LoadPolicy.load` (SGLang ignores what it returns), then SGLang's post-processing;
        raises its ColdsnapError (``COLDSNAP_RESTORE=native``, or a failed export or overlay capture)."""
        config = self._model_config  # None: called outside load_model, so the loader cannot tell the model
        source = None
        if config is not None:
            download_dir = getattr(self.load_config, "download_dir", None)
            source = ModelSource.of_engine(config, str(config.model_path), getattr(config, "revision", None), download_dir)
        outcome: LoadOutcome = self.policy.load(LoadCall(model, source, (weights, target_device)))
        DefaultModelLoader.postprocess_weights(model, target_device)
        return outcome
