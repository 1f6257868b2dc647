"""coldsnap_sglang on SGLang's loader contract: registration, restore instead of the checkpoint
read, SGLang's post-processing afterwards, fallback, and the refusals (materialization, capture).

The model is a small ``nn.Module`` whose parameters come from the real SmolLM2 2-layer checkpoint;
its capture is the real canonical capture (``coldsnap_core.capture.capture_worker``), so the restore
runs the real verifier and hydration. Only SGLang itself is the stand-in of ``fake_sglang``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from coldsnap_core.cache import PayloadCache
from coldsnap_core.capture import ModelRange, capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import ConfigurationError, ExtentDigestMismatchError, ModelIdentityMismatchError
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.model_identity import identify_checkpoint, model_config_sha256
from coldsnap_core.safetensors_header import read_header
from coldsnap_core.torch_allocations import enumerate_allocations

NAMES = {"norm": "model.norm.weight", "attn_norm": "model.layers.0.input_layernorm.weight"}


class QuantMethod:
    """SGLang calls ``process_weights_after_loading`` after the weights are in (section 2)."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, module: torch.nn.Module) -> None:
        self.calls += 1


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.zeros(576, dtype=torch.bfloat16), requires_grad=False)
        self.attn_norm = torch.nn.Parameter(torch.zeros(576, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("rope", torch.arange(32, dtype=torch.float32) * 0.5)
        self.quant_method = QuantMethod()

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            for attribute, checkpoint_name in NAMES.items():
                if name == checkpoint_name:
                    getattr(self, attribute).data.copy_(tensor)


@dataclass
class ModelConfig:
    """SGLang's ``ModelConfig`` as the loader reads it (``model_path``, ``revision``, ``hf_config``
    after ``--json-model-override-args``, ``dtype``, ``quantization``) plus the two steps the
    stand-in's ``DefaultModelLoader`` delegates (building the model, the weights iterator)."""

    model_path: str
    revision: str | None = None
    weights_read: int = 0
    overrides: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.bfloat16
    quantization: str | None = None

    def __post_init__(self) -> None:
        import transformers

        self.hf_config = transformers.AutoConfig.from_pretrained(self.model_path)
        for key, value in self.overrides.items():
            setattr(self.hf_config, key, value)

    def build(self) -> TinyModel:
        return TinyModel()

    def weights(self):
        from safetensors import safe_open

        with safe_open(Path(self.model_path) / "model.safetensors", framework="pt") as f:
            for name in NAMES.values():
                self.weights_read += 1
                yield name, f.get_tensor(name)


@dataclass
class DeviceConfig:
    device: str = "cpu"


@pytest.fixture
def captured(smollm2_2layer: Path, tmp_path: Path):
    """A real capture of TinyModel loaded from the checkpoint: the two norms are model extents (their
    provenance from the safetensors header), the buffer is residual."""
    config = ModelConfig(str(smollm2_2layer))
    model = config.build()
    model.load_weights(config.weights())
    allocations = enumerate_allocations(model)
    header = read_header(smollm2_2layer / "model.safetensors")
    ranges = []
    for allocation in allocations.allocation_map.allocations:
        tensor = allocation.tensors[0]
        if tensor.name in NAMES:
            loc = header[NAMES[tensor.name]]
            provenance = ExtentProvenance(
                "model.safetensors", loc.name, loc.offset_bytes, loc.size_bytes, loc.size_bytes, loc.size_bytes, False
            )
            ranges.append(ModelRange(allocation.index, 0, allocation.size_bytes, provenance))
    result = capture_worker(
        allocation_map=allocations.allocation_map,
        allocations=allocations.live,
        model_ranges=ranges,
        worker=WorkerIdentity("worker", 0, 1, 0, 1),
        capture_point="portable",
        model=identify_checkpoint(
            [smollm2_2layer / "model.safetensors"],
            source=str(smollm2_2layer),
            config_sha256=model_config_sha256(config.hf_config, dtype=config.dtype, quantization=config.quantization),
        ),
        cache=PayloadCache(tmp_path / "state"),
        artifact_dir=tmp_path / "artifact",
        backend=HostCopyBackend(),
    )
    return model, result


def load(
    fake_sglang, tmp_path: Path, smollm2_2layer: Path, *, overrides: dict | None = None, **extra
) -> tuple[torch.nn.Module, ModelConfig, object]:
    import coldsnap_sglang

    coldsnap_sglang.register()
    options = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "state"), **extra}
    load_config = fake_sglang.LoadConfig(load_format="coldsnap", model_loader_extra_config=json.dumps(options))
    loader = fake_sglang.get_model_loader(load_config)
    config = ModelConfig(str(smollm2_2layer), overrides=overrides or {})
    return loader.load_model(model_config=config, device_config=DeviceConfig()), config, loader


def test_register_is_idempotent_and_swaps_the_string_for_the_loader_class(fake_sglang) -> None:
    """``--load-format coldsnap`` passes argparse once registered, and ``LoadConfig`` turns the string
    into the loader class in every process (the hook), however often ``register()`` runs. Fails if the
    hook is registered twice or the choice is added twice."""
    import coldsnap_sglang
    from coldsnap_sglang.loader import ColdsnapModelLoader

    with pytest.raises(ValueError):
        fake_sglang.LoadConfig(load_format="coldsnap")  # what SGLang does without the plugin
    coldsnap_sglang.register()
    coldsnap_sglang.register()
    assert fake_sglang.LOAD_FORMAT_CHOICES.count("coldsnap") == 1
    assert fake_sglang.HookRegistry.applied == ["sglang.srt.configs.load_config.LoadConfig._verify_load_format"]
    assert fake_sglang.LoadConfig(load_format="COLDSNAP").load_format is ColdsnapModelLoader
    assert fake_sglang.LoadConfig(load_format="safetensors").load_format is fake_sglang.LoadFormat.SAFETENSORS


def test_restore_reads_no_checkpoint_and_runs_sglang_post_processing(fake_sglang, captured, smollm2_2layer, tmp_path) -> None:
    """Restore: every parameter and buffer byte equals the captured model's, the checkpoint iterator is
    never consumed, and SGLang's own post-processing still runs once. Fails if the loader reads the
    checkpoint, skips post-processing, or hydrates the wrong bytes."""
    reference, _ = captured
    model, config, _ = load(fake_sglang, tmp_path, smollm2_2layer, restore="native")
    assert config.weights_read == 0
    assert model.quant_method.calls == 1
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_auto_without_an_artifact_loads_the_checkpoint_with_one_warning(fake_sglang, smollm2_2layer, tmp_path, caplog) -> None:
    """``auto`` and nothing captured: one WARNING naming the missing descriptor, then SGLang's normal
    load from the checkpoint. Fails if the fallback is silent or does not load the weights."""
    with caplog.at_level(logging.WARNING, logger="coldsnap_sglang"):
        model, config, _ = load(fake_sglang, tmp_path, smollm2_2layer)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "artifact descriptor does not exist" in warnings[0].getMessage()
    assert config.weights_read == len(NAMES) and model.norm.abs().sum() > 0


def test_native_fails_closed_on_a_corrupt_pack(fake_sglang, captured, smollm2_2layer, tmp_path) -> None:
    """``native`` and a flipped pack byte (mtime changed, so no record vouches for it): the verifier's
    error, naming the corrupt extent's allocation, reaches the caller and nothing is loaded. Fails if
    SGLang would serve a corrupt payload."""
    _, result = captured
    pack = result.pack_path
    pack.chmod(0o644)
    data = bytearray(pack.read_bytes())
    data[100] ^= 0xFF
    pack.write_bytes(bytes(data))
    with pytest.raises(ExtentDigestMismatchError, match=r"allocation=\d+, offset_bytes=0"):
        load(fake_sglang, tmp_path, smollm2_2layer, restore="native")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"materialize": "async"}, "COLDSNAP_MATERIALIZE=async is not supported with SGLang"),
        ({"materialize": "required"}, "COLDSNAP_MATERIALIZE=required is not supported with SGLang"),
        ({"export_model_payload": "1"}, "COLDSNAP_EXPORT_MODEL_PAYLOAD=1 is not supported with SGLang"),
        ({"restore": "sometimes"}, "'sometimes' is not one of auto, native"),
        ({"inner_load_format": "instanttensor-fast"}, "not a load format served by the engine's default loader"),
    ],
)
def test_refused_settings(fake_sglang, smollm2_2layer, tmp_path, options, message) -> None:
    """SGLang accepts materialization ``off`` only and cannot capture; bad values are named. Fails if
    an unsupported mode is silently ignored."""
    with pytest.raises(ConfigurationError, match=message):
        load(fake_sglang, tmp_path, smollm2_2layer, **options)


def test_materialize_defaults_to_off_and_other_keys_reach_sglang(fake_sglang, smollm2_2layer, tmp_path) -> None:
    """The SGLang default is ``off``; coldsnap's keys are removed and the others reach SGLang's loader,
    which rejects the unknown ones. Fails if coldsnap's keys leak into SGLang's validation."""
    _, _, loader = load(fake_sglang, tmp_path, smollm2_2layer, num_threads=2)
    assert loader.coldsnap_settings.materialize == "off"
    assert loader.load_config.model_loader_extra_config == {"num_threads": 2}
    with pytest.raises(ValueError, match="Unexpected extra config keys"):
        load(fake_sglang, tmp_path, smollm2_2layer, pack_name="mine")


def test_another_model_configuration_is_not_restored(fake_sglang, captured, smollm2_2layer, tmp_path, caplog) -> None:
    """QA defect 2 on SGLang: the same checkpoint with another rotary base in ``hf_config`` (a changed
    config.json or ``--json-model-override-args``; the layout is the same) is refused under ``native``
    with ModelIdentityMismatchError, and ``auto`` loads the checkpoint with one WARNING naming the
    configuration instead of restoring the captured buffers."""
    with pytest.raises(ModelIdentityMismatchError, match="model configuration"):
        load(fake_sglang, tmp_path, smollm2_2layer, overrides={"rope_theta": 5000.0}, restore="native")
    with caplog.at_level(logging.WARNING, logger="coldsnap_sglang"):
        _, config, _ = load(fake_sglang, tmp_path, smollm2_2layer, overrides={"rope_theta": 5000.0})
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "rule model-identity failed" in warning and "model configuration" in warning
    assert config.weights_read == len(NAMES)
