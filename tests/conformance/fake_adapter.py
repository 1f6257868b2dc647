"""The coldsnap adapter of the fake engine (``tests/conformance/fake_engine.py``): everything a third engine
supplies to the engine contract (README "Adding an engine"), and nothing more.

The engine keeps no compile cache, so the adapter supplies no derived-cache step; its only inner load format is
``safetensors``, so ``COLDSNAP_INNER_LOAD_FORMAT`` (or the key ``inner_load_format``) naming another one stops the
start where the engine builds the loader. Importing this module registers the ``coldsnap`` load format.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import ClassVar

from coldsnap_core import (
    ColdsnapSettings,
    LoadCall,
    LoadOutcome,
    LoadPolicy,
    ModelSource,
    ObservedLoader,
    WorkerIdentity,
    engine_checkpoint_files,
)
from tests.conformance import fake_engine

logger = logging.getLogger(__name__)

ENGINE = "fake-engine"
"""The engine name the capsules' ``target.json`` and the outcome lines record."""

INNER_LOAD_FORMATS = ("safetensors",)
"""The load formats the fake engine's default loader serves."""


class _FakeLoad(LoadPolicy):
    """The load policy with the fake engine's parts; a call's ``engine`` is the engine's model configuration."""

    engine: ClassVar[str] = ENGINE
    engine_label: ClassVar[str] = "FakeEngine"

    def __init__(self, loader: ColdsnapLoader, settings: ColdsnapSettings) -> None:
        super().__init__(settings, log=logger)
        self.loader = loader

    def worker_identity(self) -> WorkerIdentity:
        return WorkerIdentity("worker", 0, 1, 0, 1)  # the fake engine has no parallelism

    def engine_version(self) -> str | None:
        return fake_engine.VERSION  # no installed distribution is named after it

    def checkpoint_files(self, call: LoadCall) -> tuple[list[str] | None, str | None]:
        path = call.source.path  # type: ignore[union-attr]
        prepare = fake_engine.DefaultLoader._prepare_weights
        return engine_checkpoint_files(path, self.engine_label, lambda: prepare(self.loader, path))

    def load_checkpoint(self, call: LoadCall) -> None:
        fake_engine.DefaultLoader.load_weights(self.loader, call.model, call.engine)  # type: ignore[arg-type]


class ColdsnapLoader(ObservedLoader, fake_engine.DefaultLoader):
    """The fake engine's default loader with coldsnap capture and restore.

    Raises:
        ConfigurationError: a coldsnap setting is invalid or names an inner load format the engine lacks (a refused
            start, reported as one: :meth:`LoadPolicy.refusing_settings`).
    """

    def __init__(self, load_config: fake_engine.LoadConfig) -> None:
        extra = load_config.extra_config
        with _FakeLoad.refusing_settings(os.environ, extra, lambda: WorkerIdentity("worker", 0, 1, 0, 1), logger):
            settings, rest = ColdsnapSettings.resolve(os.environ, extra, inner_load_formats=INNER_LOAD_FORMATS)
            super().__init__(dataclasses.replace(load_config, load_format="safetensors", extra_config=rest))
            self.policy = _FakeLoad(self, settings)

    def load_weights(self, model: fake_engine.TinyModel, model_config: fake_engine.ModelConfig) -> LoadOutcome:
        source = ModelSource.of_engine(model_config, model_config.path, None, None)
        return self.policy.load(LoadCall(model, source, model_config))


fake_engine.LOADERS["coldsnap"] = ColdsnapLoader
