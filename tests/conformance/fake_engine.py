"""A third inference engine, made only for the engine contract's conformance suite (``tests/conformance/suite.py``).

It is shaped like the two real ones where coldsnap meets them, and nothing more: an engine builds a loader by its
load format (``--load-format``: :data:`LOADERS`, ``safetensors`` by default), builds the model, and asks the loader
to fill it (``load_weights(model, model_config)``). Its :class:`DefaultLoader` lists a checkpoint's files with
``_prepare_weights(model_name_or_path)`` and reads them with ``_get_weights_iterator(source)``, which prepares the
files when it is made and yields ``(name, tensor)`` pairs (as vLLM's and SGLang's ``DefaultModelLoader`` do); the
model copies each tensor into its parameter. :func:`start` is one engine start: build, load, serve one forward
pass. Its adapter is ``tests/conformance/fake_adapter.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

VERSION = "1.0"
"""The engine's installed version (what its capsules' ``target.json`` records); a test sets another to play an upgrade."""

SHAPES = {"embed.weight": (64, 16), "layer.weight": (16, 16), "norm.weight": (16,)}
"""The checkpoint's tensors (bf16) and the model's parameters of the same names."""


class TinyModel(torch.nn.Module):
    """Three parameters filled from the checkpoint and a buffer the engine computes (it lands in the residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16, dtype=torch.bfloat16)
        self.layer = torch.nn.Linear(16, 16, bias=False, dtype=torch.bfloat16)
        self.norm = torch.nn.RMSNorm(16, dtype=torch.bfloat16)
        self.register_buffer("rope", torch.arange(8, dtype=torch.float32) * 0.5)
        for parameter in self.parameters():
            parameter.requires_grad_(False)

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.get_parameter(name).data.copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layer(self.embed(ids))).float().sum(-1) + self.rope[: ids.shape[-1]]


@dataclass(frozen=True)
class ModelConfig:
    """The engine's model configuration: ``hf_config`` and ``dtype`` named as vLLM and SGLang name them."""

    path: str
    hf_config: dict
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "safetensors"
    extra_config: dict = field(default_factory=dict)


class DefaultLoader:
    """The engine's own loader (every load format here: safetensors)."""

    def __init__(self, load_config: LoadConfig) -> None:
        if load_config.extra_config:
            raise ValueError(
                f"Unexpected extra config keys for load format {load_config.load_format}: {load_config.extra_config}"
            )
        self.load_config = load_config

    def _prepare_weights(self, model_name_or_path: str) -> tuple[Path, list[Path], bool]:
        folder = Path(model_name_or_path)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        return folder, files, True

    def _get_weights_iterator(self, source: str):
        _, files, _ = self._prepare_weights(source)

        def tensors():
            for path in files:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        yield name, f.get_tensor(name)

        return tensors()

    def load_weights(self, model: TinyModel, model_config: ModelConfig):
        model.load_weights(self._get_weights_iterator(model_config.path))

    def load_model(self, model_config: ModelConfig) -> TinyModel:
        model = TinyModel()
        self.load_weights(model, model_config)
        return model


LOADERS: dict[str, type[DefaultLoader]] = {}
"""Load format -> loader class, for the formats a plugin registered (the adapter registers ``coldsnap``)."""


def write_checkpoint(folder: Path) -> Path:
    """A checkpoint of :class:`TinyModel` in ``folder`` (``config.json``, ``model.safetensors``, bf16, seeded)."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in SHAPES.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"hidden_size": 16, "vocab_size": 64}))
    return folder


def start(model_path: Path, load_format: str = "safetensors", extra_config: dict | None = None) -> TinyModel:
    """One engine start: the loader of ``load_format`` loads the model, which then serves one forward pass."""
    config = ModelConfig(str(model_path), json.loads((model_path / "config.json").read_text()))
    model = LOADERS.get(load_format, DefaultLoader)(LoadConfig(load_format, dict(extra_config or {}))).load_model(config)
    model(torch.arange(8))
    return model
