"""coldsnap_sglang on SGLang's loader contract (the stand-in ``fake_sglang``): registration, the model
identity checks that need many loads of slightly different folders, and setting validation. Capture,
restore, corruption, the server and the refused materialization modes run on the real engine
(``test_sglang_engine.py``).

The model is a small ``nn.Module`` whose parameters come from the real SmolLM2 2-layer checkpoint;
its capture is the real canonical capture (``coldsnap_core.capture.worker.capture_worker``), so the restore
runs the real verifier and hydration. Only SGLang itself is the stand-in.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.payload import ModelRange
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.copy.torch_allocations import enumerate_allocations
from coldsnap_core.errors import ConfigurationError, ExtentDigestMismatchError, ModelIdentityMismatchError, ObserverError
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.format.safetensors_header import read_header
from coldsnap_core.identity.config_digest import model_config_sha256
from coldsnap_core.identity.model_identity import identify_checkpoint
from coldsnap_core.identity.target import collect_target, engine_version

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
    files: str | None = None
    """The folder config and weights are read from when ``model_path`` is a repository id (its snapshot
    in the Hugging Face cache); ``None``: ``model_path``."""
    through_loader: bool = False
    """Read the weights through the loader's own ``_get_all_weights`` (``_prepare_weights`` and
    ``_get_weights_iterator``, which the coldsnap loader observes) instead of :meth:`weights`."""

    def __post_init__(self) -> None:
        import transformers

        self.hf_config = transformers.AutoConfig.from_pretrained(self.files or self.model_path)
        for key, value in self.overrides.items():
            setattr(self.hf_config, key, value)

    def build(self) -> TinyModel:
        return TinyModel()

    def weights(self):
        from safetensors import safe_open

        with safe_open(Path(self.files or self.model_path) / "model.safetensors", framework="pt") as f:
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
    return capture(smollm2_2layer, tmp_path, source=str(smollm2_2layer))


def capture(smollm2_2layer: Path, tmp_path: Path, *, source: str, revision: str | None = None):
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
            source=source,
            revision=revision,
            config_sha256=model_config_sha256(config.hf_config, dtype=config.dtype, quantization=config.quantization),
        ),
        cache=PayloadCache(tmp_path / "state"),
        artifact_dir=tmp_path / "artifact",
        backend=HostCopyBackend(),
        target=collect_target("sglang", engine_version("sglang")),  # what the SGLang loader compares with
    )
    return model, result


def load(
    fake_sglang,
    tmp_path: Path,
    smollm2_2layer: Path,
    *,
    overrides: dict | None = None,
    config: ModelConfig | None = None,
    download_dir: Path | None = None,
    **extra,
) -> tuple[torch.nn.Module, ModelConfig, object]:
    import coldsnap_sglang

    coldsnap_sglang.register()
    options = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "state"), **extra}
    load_config = fake_sglang.LoadConfig(
        load_format="coldsnap",
        model_loader_extra_config=json.dumps(options),
        download_dir=None if download_dir is None else str(download_dir),
    )
    loader = fake_sglang.get_model_loader(load_config)
    config = config or ModelConfig(str(smollm2_2layer), overrides=overrides or {})
    load_weights = loader.load_weights_and_postprocess

    def keep_outcome(*args):  # SGLang ignores what load_weights_and_postprocess returns: the test keeps it
        loader.outcome = load_weights(*args)

    loader.load_weights_and_postprocess = keep_outcome
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


def test_sglang_loads_leave_an_outcome_line(fake_sglang, captured, smollm2_2layer, tmp_path) -> None:
    """The SGLang loader appends one load outcome line per load, like vLLM's: restored, then (the pack
    corrupted) refused under ``native`` and fell back under ``auto``, with the rule and file. Fails if
    an SGLang load leaves no line or a fallback's line lacks its rule."""
    _, result = captured
    log = tmp_path / "outcomes.jsonl"
    load(fake_sglang, tmp_path, smollm2_2layer, restore="native", outcome_log=str(log))
    pack = result.pack_path
    pack.chmod(0o644)
    data = bytearray(pack.read_bytes())
    data[100] ^= 0xFF
    pack.write_bytes(bytes(data))
    with pytest.raises(ExtentDigestMismatchError):
        load(fake_sglang, tmp_path, smollm2_2layer, restore="native", outcome_log=str(log))
    load(fake_sglang, tmp_path, smollm2_2layer, outcome_log=str(log))
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(d["engine"], d["outcome"]) for d in lines] == [
        ("sglang", "restored"),
        ("sglang", "refused"),
        ("sglang", "fell-back"),
    ]
    assert lines[1]["rule"] == "extent-sha256" and lines[2]["rule"] is not None and lines[2]["file"] is not None
    assert lines[0]["pack_sha256"] == result.manifest.pack.sha256  # restored lines name their pack, as vLLM's do


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"restore": "sometimes"}, "'sometimes' is not one of auto, native"),
        ({"inner_load_format": "instanttensor-fast"}, "not a load format served by the engine's default loader"),
    ],
)
def test_refused_settings(fake_sglang, smollm2_2layer, tmp_path, options, message) -> None:
    """Bad values are named (materialization ``async``/``required`` is refused by the real engine,
    ``test_sglang_engine.py``). Fails if a bad setting is silently ignored."""
    with pytest.raises(ConfigurationError, match=message):
        load(fake_sglang, tmp_path, smollm2_2layer, **options)


def test_native_without_an_artifact_is_a_refused_start_said_again_after_sglangs_error(
    fake_sglang, smollm2_2layer, tmp_path, caplog
) -> None:
    """``COLDSNAP_RESTORE=native`` without ``COLDSNAP_ARTIFACT_DIR``, raised where SGLang builds the loader: one ERROR
    ``coldsnap: SGLang start refused`` line with rule ``configuration`` and one remedy, said once more right after
    SGLang's own ERROR record of the exception (its scheduler's "Scheduler hit an exception"), the termination log,
    and one outcome line ``refused`` of engine ``sglang``. Fails if the SGLang plugin resolves its settings outside
    :meth:`LoadPolicy.refusing_settings` (a bare exception: no line, no termination log, no outcome line)."""
    termination = tmp_path / "termination-log"
    termination.touch()
    with caplog.at_level(logging.INFO), pytest.raises(ConfigurationError) as raised:
        load(fake_sglang, tmp_path, smollm2_2layer, artifact_dir="", restore="native", termination_log=str(termination))
    logging.getLogger("sglang.srt.managers.scheduler").error("Scheduler hit an exception: %s", raised.value)
    line = f"coldsnap: SGLang start refused for worker-0-of-1 (its coldsnap settings are invalid): {raised.value}"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [line, f"Scheduler hit an exception: {raised.value}", line]
    assert "rule configuration failed" in line and line.count("; remedy: ") == 1
    assert termination.read_text() == line + "\n"
    (outcome,) = [json.loads(t) for t in (tmp_path / "state" / "load-outcomes.jsonl").read_text().splitlines()]
    assert (outcome["engine"], outcome["outcome"], outcome["rule"]) == ("sglang", "refused", "configuration")


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


COMMIT_A = "0123456789abcdef0123456789abcdef01234567"
COMMIT_B = "fedcba9876543210fedcba9876543210fedcba98"


def hub_snapshot(cache: Path, repo_id: str, commit: str, folder: Path) -> Path:
    """Add ``folder``'s ``config.json`` and ``model.safetensors`` as snapshot ``commit`` of ``repo_id`` to
    the Hugging Face cache ``cache`` (relative links to ``blobs/<sha256>``, the layout ``hf_hub_download``
    leaves) and point ``refs/main`` at it. Returns the snapshot folder."""
    import hashlib
    import os
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name in ("config.json", "model.safetensors"):
        with open(folder / name, "rb") as f:
            blob = repo / "blobs" / hashlib.file_digest(f, "sha256").hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(folder / name, blob)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_moved_main_is_not_restored(fake_sglang, smollm2_2layer, tmp_path, caplog, monkeypatch) -> None:
    """The QA defect on SGLang: a payload captured from ``org/name`` at commit A (no ``--revision``) was
    restored after ``main`` moved to commit B with the same layout and config, because the loader
    compared the revision as given (``None`` with ``None``). Now the loader resolves ``main`` in the
    Hugging Face cache of ``--download-dir`` (catches a loader that ignores ``load_config.download_dir``):
    at A it restores without reading the checkpoint; at B ``native`` raises ModelIdentityMismatchError
    naming both commits and ``auto`` reads the checkpoint with one WARNING."""
    cache = tmp_path / "hf-cache"
    snapshot = hub_snapshot(cache, "org/name", COMMIT_A, smollm2_2layer)
    capture(smollm2_2layer, tmp_path, source="org/name", revision=COMMIT_A)
    monkeypatch.chdir(tmp_path)  # "org/name" is not a local folder

    def hub_config() -> ModelConfig:
        return ModelConfig("org/name", files=str(snapshot))

    _, config, _ = load(fake_sglang, tmp_path, smollm2_2layer, config=hub_config(), download_dir=cache, restore="native")
    assert config.weights_read == 0

    hub_snapshot(cache, "org/name", COMMIT_B, smollm2_2layer)
    with pytest.raises(ModelIdentityMismatchError, match="resolved to another commit") as raised:
        load(fake_sglang, tmp_path, smollm2_2layer, config=hub_config(), download_dir=cache, restore="native")
    assert COMMIT_A in str(raised.value) and COMMIT_B in str(raised.value)
    with caplog.at_level(logging.WARNING, logger="coldsnap_sglang"):
        _, config, _ = load(fake_sglang, tmp_path, smollm2_2layer, config=hub_config(), download_dir=cache)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "rule model-identity failed" in warning and COMMIT_B in warning
    assert config.weights_read == len(NAMES)


def checkpoint_copy(smollm2_2layer: Path, tmp_path: Path) -> Path:
    """A private copy of the 2-layer checkpoint folder that a test may add files to."""
    import shutil

    return Path(shutil.copytree(smollm2_2layer, tmp_path / "checkpoint"))


def test_a_shard_added_to_the_folder_is_not_restored(fake_sglang, smollm2_2layer, tmp_path, caplog) -> None:
    """The vLLM loader's folder check, on SGLang: a safetensors file added to a captured local folder
    (no index, so SGLang's ``_prepare_weights`` would read it too) makes the folder another model.
    ``native`` raises ModelIdentityMismatchError naming the added file; ``auto`` loads the checkpoint with
    one WARNING. Fails if the SGLang loader stops passing the files SGLang would read to the identity
    check (it restored here before)."""
    folder = checkpoint_copy(smollm2_2layer, tmp_path)
    capture(folder, tmp_path, source=str(folder))
    _, config, _ = load(fake_sglang, tmp_path, folder, restore="native")
    assert config.weights_read == 0  # the untouched folder restores

    (folder / "extra.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:4096])
    with pytest.raises(ModelIdentityMismatchError, match=r"extra\.safetensors"):
        load(fake_sglang, tmp_path, folder, restore="native")
    with caplog.at_level(logging.WARNING, logger="coldsnap_sglang"):
        _, config, _ = load(fake_sglang, tmp_path, folder)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "rule model-identity failed" in warning and "extra.safetensors" in warning
    assert config.weights_read == len(NAMES)


def test_a_folder_sglang_cannot_list_is_not_restored(fake_sglang, smollm2_2layer, tmp_path) -> None:
    """An index that lists only a missing shard leaves SGLang no file to read (``_prepare_weights``
    raises RuntimeError; a plain load fails there too): ``native`` raises ModelIdentityMismatchError
    quoting SGLang's error instead of restoring. Fails if a failing ``_prepare_weights`` is taken as
    "cannot tell" and the restore goes ahead."""
    folder = checkpoint_copy(smollm2_2layer, tmp_path)
    capture(folder, tmp_path, source=str(folder))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(ModelIdentityMismatchError, match="_prepare_weights raised RuntimeError: Cannot find any model weights"):
        load(fake_sglang, tmp_path, folder, restore="native")


@pytest.mark.parametrize(
    ("inner", "restores"),
    [
        ("auto", True),
        ("safetensors", True),
        ("fastsafetensors", True),
        ("instanttensor", True),
        ("pt", False),
        ("npcache", False),
    ],
)
def test_each_inner_load_format_lists_the_files_sglang_reads(fake_sglang, smollm2_2layer, tmp_path, inner, restores) -> None:
    """Every inner load format coldsnap accepts for SGLang is handed to SGLang's ``_prepare_weights``:
    the safetensors formats read ``model.safetensors`` (the recorded file) and restore; ``pt`` and
    ``npcache`` find no ``*.pt``/``*.bin`` in a safetensors folder, so SGLang could not load it and
    ``native`` refuses quoting SGLang's error. Fails if the loader lists files for another format
    than the one SGLang will read with, or if an accepted format cannot be listed."""
    from coldsnap_sglang.settings import SGLANG_INNER_LOAD_FORMATS

    assert {"auto", "safetensors", "fastsafetensors", "instanttensor", "pt", "npcache"} == set(SGLANG_INNER_LOAD_FORMATS)
    folder = checkpoint_copy(smollm2_2layer, tmp_path)
    capture(folder, tmp_path, source=str(folder))
    if restores:
        _, config, _ = load(fake_sglang, tmp_path, folder, restore="native", inner_load_format=inner)
        assert config.weights_read == 0
    else:
        with pytest.raises(ModelIdentityMismatchError, match="_prepare_weights raised RuntimeError"):
            load(fake_sglang, tmp_path, folder, restore="native", inner_load_format=inner)


def test_a_restore_outside_load_model_is_refused(fake_sglang, captured, smollm2_2layer, tmp_path, caplog) -> None:
    """``load_weights_and_postprocess`` called on the loader without its ``load_model`` (which records
    the model configuration) cannot check the model identity: ``native`` raises
    ModelIdentityMismatchError saying so, and ``auto`` loads the checkpoint with one WARNING. Fails if
    that call silently loads the checkpoint under ``native`` (a QA finding) or restores unchecked."""
    import coldsnap_sglang

    coldsnap_sglang.register()

    def loader(restore: str):
        options = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "state"), "restore": restore}
        return fake_sglang.get_model_loader(
            fake_sglang.LoadConfig(load_format="coldsnap", model_loader_extra_config=json.dumps(options))
        )

    config = ModelConfig(str(smollm2_2layer))
    with pytest.raises(ModelIdentityMismatchError, match="cannot tell which model SGLang is loading"):
        loader("native").load_weights_and_postprocess(config.build(), config.weights(), "cpu")
    assert config.weights_read == 0
    with caplog.at_level(logging.WARNING, logger="coldsnap_sglang"):
        loader("auto").load_weights_and_postprocess(config.build(), config.weights(), "cpu")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "rule model-identity failed" in warning and "outside its load_model" in warning
    assert config.weights_read == len(NAMES)


def test_an_export_outside_an_observed_load_is_refused(fake_sglang, smollm2_2layer, tmp_path) -> None:
    """``COLDSNAP_EXPORT_MODEL_PAYLOAD=1`` needs the checkpoint files the loader's ``_prepare_weights``
    returned: ``load_weights_and_postprocess`` called outside ``load_model`` raises ObserverError saying so,
    and a load whose weights bypass ``_prepare_weights``/``_get_weights_iterator`` (the stand-in's
    ``load_model`` reads them itself) raises ObserverError naming the unprepared iterator; nothing is
    captured either way. Fails if a capture without pinned checkpoint files is written."""
    import coldsnap_sglang

    coldsnap_sglang.register()
    options = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "state"), "export_model_payload": 1}
    loader = fake_sglang.get_model_loader(
        fake_sglang.LoadConfig(load_format="coldsnap", model_loader_extra_config=json.dumps(options))
    )
    config = ModelConfig(str(smollm2_2layer))
    with pytest.raises(ObserverError, match="load_weights_and_postprocess was called outside it"):
        loader.load_weights_and_postprocess(config.build(), config.weights(), "cpu")
    with pytest.raises(ObserverError, match="the checkpoint iterator was never prepared"):
        load(fake_sglang, tmp_path, smollm2_2layer, export_model_payload=1)
    assert not (tmp_path / "artifact").exists() or not any((tmp_path / "artifact").iterdir())


def test_each_tensor_parallel_rank_is_its_own_worker(fake_sglang, monkeypatch) -> None:
    """Tensor parallel rank logic (SGLang's CPU engine is run at tensor parallel size 1 in these tests):
    the worker identity takes the global rank and world size from ``torch.distributed`` and the tensor
    parallel rank from SGLang's ``LoadConfig.tp_rank``, so rank 2 of 3 is ``worker-2-of-3`` with its own
    capsule, and a process without a process group is ``worker-0-of-1``. Fails if every rank would write
    (or restore) the same capsule."""
    from coldsnap_sglang.loader import worker_identity

    assert worker_identity(fake_sglang.LoadConfig()).capsule_name == "worker-0-of-1"
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 3)
    for rank in range(3):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda rank=rank: rank)
        identity = worker_identity(fake_sglang.LoadConfig(tp_rank=rank))
        assert (identity.capsule_name, identity.tensor_parallel_rank, identity.tensor_parallel_size) == (
            f"worker-{rank}-of-3",
            rank,
            3,
        )


# --- settings from the extra config, and target-local overlays ------------------------------------------


def _observed(smollm2_2layer: Path) -> ModelConfig:
    """A model config whose weights go through the loader's iterator boundary (as SGLang's do)."""
    return ModelConfig(str(smollm2_2layer), through_loader=True)


def test_sglang_honours_lock_timeout_and_verify_extents_from_extra_config(
    fake_sglang, smollm2_2layer, tmp_path, monkeypatch
) -> None:
    """The extra-config keys ``lock_timeout`` and ``verify_extents`` win over their variables on SGLang as
    on vLLM. With ``COLDSNAP_LOCK_TIMEOUT=abc`` in the environment and ``lock_timeout`` set, the capture and
    the restore use the key (a hung lock holder makes ``auto`` fall back after it, rule lock-timeout); with
    ``COLDSNAP_VERIFY_EXTENTS=0`` and ``verify_extents`` set, hydration hashes every extent and a flipped
    pack byte under a vouching record falls back (rule extent-sha256), where ``verify_extents: 0``
    restored it. Fails if the SGLang loader reads either variable below its settings (the capture then
    refused ``abc``, or the flipped byte was served)."""
    from coldsnap_core.cache.records import write_record
    from tests.support.files import flip_byte
    from tests.support.locks import hold_lock

    monkeypatch.setenv("COLDSNAP_LOCK_TIMEOUT", "abc")
    monkeypatch.setenv("COLDSNAP_VERIFY_EXTENTS", "0")
    log = tmp_path / "outcomes.jsonl"
    load(fake_sglang, tmp_path, smollm2_2layer, config=_observed(smollm2_2layer), export_model_payload=1, lock_timeout="1")
    (entry,) = json.loads((tmp_path / "artifact" / "artifact.json").read_text())["workers"]
    digest = entry["payload"]["sha256"]
    cache = PayloadCache(tmp_path / "state")
    cache.record_path(digest).chmod(0o644)
    cache.record_path(digest).unlink()
    holder = hold_lock(tmp_path / "state", digest)
    try:
        load(fake_sglang, tmp_path, smollm2_2layer, outcome_log=str(log), lock_timeout="1")
    finally:
        holder.kill()
        holder.wait()
    (line,) = [json.loads(text) for text in log.read_text().splitlines()]
    assert (line["outcome"], line["rule"]) == ("fell-back", "lock-timeout")

    load(fake_sglang, tmp_path, smollm2_2layer, outcome_log=str(log), lock_timeout="1")  # admits it again, with a record
    assert PayloadCache.wait_for_records(30.0)  # the record follows the load
    pack = cache.object_path(digest)
    native = json.loads((tmp_path / "artifact" / entry["capsule"] / "native-manifest.json").read_text())
    flip_byte(pack, native["model_extents"][0]["pack_offset_bytes"])
    cache.record_path(digest).chmod(0o644)
    cache.record_path(digest).unlink()
    write_record(cache, digest, os.lstat(pack))
    load(fake_sglang, tmp_path, smollm2_2layer, outcome_log=str(log), lock_timeout="1", verify_extents="0")
    load(fake_sglang, tmp_path, smollm2_2layer, outcome_log=str(log), lock_timeout="1", verify_extents="1")
    lines = [json.loads(text) for text in log.read_text().splitlines()]
    assert [(d["outcome"], d["rule"]) for d in lines[1:]] == [
        ("restored", None),
        ("restored", None),  # the flipped byte served: only the setting catches it
        ("fell-back", "extent-sha256"),
    ]


def _edit_target(artifact: Path, **fields) -> None:
    """Edit the capsule's ``target.json`` and re-pin it in ``artifact.json`` (a re-signing operator's edit)."""
    import hashlib

    doc = json.loads((artifact / "artifact.json").read_text())
    (entry,) = doc["workers"]
    target = artifact / entry["capsule"] / "target.json"
    target.write_text(json.dumps({**json.loads(target.read_text()), **fields}, indent=2, sort_keys=True) + "\n")
    for pin in entry["capsule_files"]:
        data = (artifact / entry["capsule"] / pin["name"]).read_bytes()
        pin.update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (artifact / "artifact.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def test_overlay_capture_on_sglang_captures_a_target_local_overlay(fake_sglang, smollm2_2layer, tmp_path) -> None:
    """``COLDSNAP_OVERLAY=capture`` on SGLang reads the portable capsule, loads the checkpoint under the
    observer and captures this target's overlay under the state root (outcome ``checkpoint``, no fallback),
    here for a capsule recorded under another SGLang version, which the next load restores through that
    overlay without falling back. Fails if SGLang treats ``capture`` as ``auto`` (it restored, and no overlay was written)."""
    from coldsnap_core.cache.overlays import list_overlays

    load(fake_sglang, tmp_path, smollm2_2layer, config=_observed(smollm2_2layer), export_model_payload=1)
    _edit_target(tmp_path / "artifact", engine_version="0.0.1")
    model, _, loader = load(fake_sglang, tmp_path, smollm2_2layer, config=_observed(smollm2_2layer), overlay="capture")
    assert len(list_overlays(tmp_path / "state")) == 1
    outcome = loader.outcome
    assert outcome.kind == "checkpoint" and outcome.fallback is None and outcome.overlay is not None
    assert model.quant_method.calls == 1  # SGLang's post-processing ran after the capture
    restored, config, loader = load(fake_sglang, tmp_path, smollm2_2layer)
    assert loader.outcome.kind == "restored" and loader.outcome.capsule_source == outcome.overlay.kind  # overlay or qualified
    assert config.weights_read == 0 and torch.equal(restored.norm, model.norm) and torch.equal(restored.rope, model.rope)


def test_a_capsule_of_another_sglang_version_falls_back_once_and_captures_an_overlay(
    fake_sglang, smollm2_2layer, tmp_path
) -> None:
    """Under ``auto`` a capsule recorded under another SGLang version falls back once (rule
    target-qualification), captures a target-local overlay after the checkpoint load, and the next load restores
    through it: SGLang gets what vLLM has after an upgrade. Fails if every SGLang start after an upgrade
    falls back (no overlay)."""
    load(fake_sglang, tmp_path, smollm2_2layer, config=_observed(smollm2_2layer), export_model_payload=1)
    _edit_target(tmp_path / "artifact", engine_version="0.0.1")
    log = tmp_path / "outcomes.jsonl"
    loaded, _, loader = load(fake_sglang, tmp_path, smollm2_2layer, config=_observed(smollm2_2layer), outcome_log=str(log))
    overlay = loader.outcome.overlay
    assert overlay is not None
    restored, config, loader = load(fake_sglang, tmp_path, smollm2_2layer, outcome_log=str(log))
    assert loader.outcome.capsule_source == overlay.kind and config.weights_read == 0
    assert torch.equal(restored.norm, loaded.norm) and torch.equal(restored.attn_norm, loaded.attn_norm)
    lines = [json.loads(text) for text in log.read_text().splitlines()]
    assert [(d["outcome"], d["rule"]) for d in lines] == [("fell-back", "target-qualification"), ("restored", None)]
