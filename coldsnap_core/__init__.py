"""coldsnap_core: capture a model's weights into a content-addressed payload and restore them, engine neutral.
The public API is :data:`__all__` (README "Using it from Python"); everything else is internal and may change.
Each name is imported on first use, so ``import coldsnap_core`` stays cheap (no vLLM, SGLang or torch).
``examples/restore_without_engine.py`` runs the whole round trip on a small torch model."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS: dict[str, str] = {
    "CaptureResult": "coldsnap_core.capture.worker",
    "CheckpointRecords": "coldsnap_core.identity.checkpoint_records",
    "CheckpointSources": "coldsnap_core.capture.checkpoint_sources",
    "ColdsnapError": "coldsnap_core.errors",
    "ColdsnapSettings": "coldsnap_core.settings",
    "CopyBackend": "coldsnap_core.copy.base",
    "LoadCall": "coldsnap_core.load_policy",
    "LoadOutcome": "coldsnap_core.load_policy",
    "LoadPolicy": "coldsnap_core.load_policy",
    "LoadedModel": "coldsnap_core.identity.model_identity",
    "ModelRange": "coldsnap_core.capture.payload",
    "ModelSource": "coldsnap_core.load_policy",
    "ObservedLoader": "coldsnap_core.load_policy",
    "PayloadCache": "coldsnap_core.cache.payload_cache",
    "PayloadStore": "coldsnap_core.stores.base",
    "RestoreResult": "coldsnap_core.restore.pipeline",
    "WorkerIdentity": "coldsnap_core.format.manifest",
    "WorkerRestore": "coldsnap_core.restore.pipeline",
    "WriteObserver": "coldsnap_core.capture.observer",
    "capture_worker": "coldsnap_core.capture.worker",
    "copy_backend_for": "coldsnap_core.copy.select",
    "engine_checkpoint_files": "coldsnap_core.identity.model_identity",
    "enumerate_allocations": "coldsnap_core.copy.torch_allocations",
    "identify_checkpoint": "coldsnap_core.identity.model_identity",
    "map_to_allocations": "coldsnap_core.capture.observer",
    "read_header": "coldsnap_core.format.safetensors_header",
    "restore_or_fall_back": "coldsnap_core.restore.pipeline",
    "verify_artifact": "coldsnap_core.restore.audit",
}
"""Public name -> the module that defines it."""

__all__ = [
    "CaptureResult",
    "CheckpointRecords",
    "CheckpointSources",
    "ColdsnapError",
    "ColdsnapSettings",
    "CopyBackend",
    "LoadCall",
    "LoadOutcome",
    "LoadPolicy",
    "LoadedModel",
    "ModelRange",
    "ModelSource",
    "ObservedLoader",
    "PayloadCache",
    "PayloadStore",
    "RestoreResult",
    "WorkerIdentity",
    "WorkerRestore",
    "WriteObserver",
    "capture_worker",
    "copy_backend_for",
    "engine_checkpoint_files",
    "enumerate_allocations",
    "identify_checkpoint",
    "map_to_allocations",
    "read_header",
    "restore_or_fall_back",
    "verify_artifact",
]

if TYPE_CHECKING:
    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.capture.checkpoint_sources import CheckpointSources
    from coldsnap_core.capture.observer import WriteObserver, map_to_allocations
    from coldsnap_core.capture.payload import ModelRange
    from coldsnap_core.capture.worker import CaptureResult, capture_worker
    from coldsnap_core.copy.base import CopyBackend
    from coldsnap_core.copy.select import copy_backend_for
    from coldsnap_core.copy.torch_allocations import enumerate_allocations
    from coldsnap_core.errors import ColdsnapError
    from coldsnap_core.format.manifest import WorkerIdentity
    from coldsnap_core.format.safetensors_header import read_header
    from coldsnap_core.identity.checkpoint_records import CheckpointRecords
    from coldsnap_core.identity.model_identity import LoadedModel, engine_checkpoint_files, identify_checkpoint
    from coldsnap_core.load_policy import LoadCall, LoadOutcome, LoadPolicy, ModelSource, ObservedLoader
    from coldsnap_core.restore.audit import verify_artifact
    from coldsnap_core.restore.pipeline import RestoreResult, WorkerRestore, restore_or_fall_back
    from coldsnap_core.settings import ColdsnapSettings
    from coldsnap_core.stores.base import PayloadStore


def __getattr__(name: str) -> object:
    """Import a public name on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'coldsnap_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
