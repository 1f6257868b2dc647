"""The model's non-weight files in the artifact (``<artifact>/model/<name>``, pinned by ``artifact.json``'s
``model_files``, ``docs/format.md`` §5) and a restore into a folder that holds them and no weight file
(``docs/format.md`` §10.1), on real captures of the fake engine (``tests/conformance/fake_engine.py``) through the one
load policy, in this process. The real-engine case is ``test_vllm_serves_from_the_weight_free_model_folder`` in
``tests/vllm/test_vllm_engine.py``."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from coldsnap_core.artifact.capsules import read_descriptor
from coldsnap_core.artifact.model_files import verify_model_files
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.errors import ArtifactError, CapsulePinMismatchError, ManifestValueError, MissingObjectError
from coldsnap_core.format.descriptor import ArtifactDescriptor
from coldsnap_core.identity.model_folder import MAX_MODEL_FILE_BYTES
from coldsnap_core.restore.audit import verify_artifact
from tests.conformance import fake_engine
from tests.conformance.test_fake_engine_conformance import _start
from tests.support.files import flip_byte

MODEL_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
"""What the capture must copy from :func:`_checkpoint`'s folder, sorted."""


def _checkpoint(folder: Path) -> Path:
    """The fake engine's checkpoint with the files a Hugging Face model folder holds besides its weights, and some a
    capture must leave out: a weight index, a hidden file, a name outside ``[A-Za-z0-9._-]+``, a file over the size
    cap (sparse), a subfolder."""
    fake_engine.write_checkpoint(folder)
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (folder / "read me.txt").write_text("a name with a space")
    with open(folder / "huge.txt", "wb") as f:
        f.truncate(MAX_MODEL_FILE_BYTES + 1)
    (folder / "original").mkdir()
    (folder / "original" / "params.json").write_text("{}")
    return folder


def _keys(artifact: Path, **more: str) -> dict[str, str]:
    return {"artifact_dir": str(artifact), "materialize": "off", **more}


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One capture of :func:`_checkpoint` (``model``) into ``artifact`` and ``state``; ``work`` holds them."""
    work = tmp_path_factory.mktemp("model-files")
    model = _checkpoint(work / "checkpoint")
    capture = _start(model, "coldsnap", work / "state", **_keys(work / "artifact", export_model_payload="1"))
    assert capture.served and capture.line["outcome"] == "captured", capture.log
    return {"work": work, "model": model, "artifact": work / "artifact", "state": work / "state"}


def _copy(captured: dict[str, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the captured artifact and state root (a test that changes one works on its own)."""
    artifact = shutil.copytree(captured["artifact"], tmp_path / "artifact")
    return artifact, shutil.copytree(captured["state"], tmp_path / "state")


def _weight_free(artifact: Path, tmp_path: Path) -> Path:
    """The artifact's model files alone in a folder, as ``coldsnap pull`` writes ``<DIR>/model/``."""
    return shutil.copytree(artifact / "model", tmp_path / "weight-free")


def test_the_capture_copies_and_pins_the_model_files(captured: dict[str, Path]) -> None:
    """The capture copies exactly the model's non-weight files into ``model/`` and pins each, sorted, by the size and
    SHA-256 of the checkpoint folder's file, and the artifact verifies. Fails if a file is missing or pinned with other
    bytes, or a weight file, a weight index, a hidden file, a name outside the capsule-file form, a file over the size
    cap or a subfolder's file is copied."""
    artifact = captured["artifact"]
    pins = read_descriptor(artifact).pinned_model_files
    assert [p.name for p in pins] == MODEL_FILES
    assert sorted(os.listdir(artifact / "model")) == MODEL_FILES
    for pin in pins:
        assert (artifact / "model" / pin.name).read_bytes() == (captured["model"] / pin.name).read_bytes()
    verify_model_files(artifact, pins)
    verify_artifact(artifact, cache=PayloadCache(captured["state"]))


def test_an_artifact_without_model_files_leaves_the_field_out_and_an_empty_or_unsorted_list_is_refused(
    captured: dict[str, Path],
) -> None:
    """``model_files`` is written only when there is one (a document without it keeps its bytes) and read strictly.
    Fails if an empty list is written or accepted, or an unsorted or repeated one accepted."""
    descriptor = read_descriptor(captured["artifact"])
    without = msgspec.structs.replace(descriptor, model_files=msgspec.UNSET)
    assert b"model_files" not in without.dumps()
    doc = json.loads(descriptor.dumps())
    for files in ([], doc["model_files"][::-1], doc["model_files"][:1] * 2):
        with pytest.raises(ManifestValueError, match="model_files names"):
            ArtifactDescriptor.loads(json.dumps({**doc, "model_files": files}).encode())


@pytest.mark.parametrize("change", ["flip", "remove", "unpinned"])
def test_verify_refuses_a_changed_missing_or_unpinned_model_file(captured: dict[str, Path], tmp_path: Path, change: str) -> None:
    """``coldsnap verify`` (``verify_artifact``) checks ``model/`` against its pins. Fails if one byte changed in a
    model file, a pinned file removed or a file added to ``model/`` goes unnoticed or unnamed."""
    artifact, state = _copy(captured, tmp_path)
    target = artifact / "model" / "tokenizer.json"
    if change == "flip":
        flip_byte(target, 3)
        error, match = CapsulePinMismatchError, r"tokenizer.json is \d+ bytes with SHA-256 [0-9a-f]{64}; artifact.json pins"
    elif change == "remove":
        target.unlink()
        error, match = MissingObjectError, r"a file artifact.json pins does not exist \[file=.*/model/tokenizer.json\]"
    else:
        (artifact / "model" / "vocab.json").write_text("{}")
        error, match = ArtifactError, r"holds files artifact.json does not pin: \['vocab.json'\]"
    with pytest.raises(error, match=match):
        verify_artifact(artifact, cache=PayloadCache(state))


def test_a_recapture_of_the_same_folder_writes_nothing_and_a_changed_folder_is_repinned_with_a_warning(
    captured: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every worker of a capture copies the same files: the first one writes them, the next one finds them pinned and
    intact and writes nothing; a capture from a folder whose model files changed replaces ``model/`` whole and its
    pins, with one WARNING naming the files, and sweeps a killed writer's staging folder. Fails if an unchanged
    ``model/`` is rewritten, a changed one is kept, or the staging folder stays."""
    artifact, state = _copy(captured, tmp_path)
    model = shutil.copytree(captured["model"], tmp_path / "checkpoint")
    keys = _keys(artifact, export_model_payload="1")
    assert _start(model, "coldsnap", state, **keys).line["outcome"] == "captured"  # another folder: written anew
    inode = os.stat(artifact / "model").st_ino
    assert _start(model, "coldsnap", state, **keys).line["outcome"] == "captured"
    assert os.stat(artifact / "model").st_ino == inode
    (model / "tokenizer_config.json").write_text('{"chat_template": "{{ other }}"}')
    (artifact / ".model.0123456789abcdef.partial").mkdir()
    with caplog.at_level(logging.WARNING, logger="coldsnap_core"):
        assert _start(model, "coldsnap", state, **keys).line["outcome"] == "captured"
    assert "the model files tokenizer_config.json differ from those artifact.json pinned" in caplog.text
    assert (artifact / "model" / "tokenizer_config.json").read_text() == '{"chat_template": "{{ other }}"}'
    assert not (artifact / ".model.0123456789abcdef.partial").exists()
    verify_artifact(artifact, cache=PayloadCache(state))


def test_a_weight_free_folder_holding_the_pinned_files_restores_with_the_checkpoint_absent(
    captured: dict[str, Path], tmp_path: Path
) -> None:
    """A folder with the artifact's model files and no weight file (what ``coldsnap pull`` writes) restores every
    model byte from the pack: the weights equal the plain load's, and the outcome line says ``"checkpoint":
    "absent"``. Fails if the identity check asks for the checkpoint's files there, or the line does not say so."""
    artifact, state = _copy(captured, tmp_path)
    plain = _start(captured["model"], "safetensors")
    restore = _start(_weight_free(artifact, tmp_path), "coldsnap", state, **_keys(artifact, restore="native"))
    assert restore.served, restore.log
    assert restore.weights == plain.weights
    assert (restore.line["outcome"], restore.line.get("checkpoint")) == ("restored", "absent")


@pytest.mark.parametrize("mode", ["auto", "native"])
@pytest.mark.parametrize("change", ["tokenizer", "config", "missing-pack"])
def test_a_failing_restore_in_a_weight_free_folder_stops_the_start_under_either_mode(
    captured: dict[str, Path], tmp_path: Path, mode: str, change: str
) -> None:
    """Where no checkpoint is on the node a failed restore cannot fall back: the start stops with
    ``CheckpointAbsentError`` naming the failed rule (a changed pinned file, another configuration: the file; a pack
    no source holds) and saying no checkpoint is there, and its refused line records that rule (not
    ``checkpoint-absent``) and says the checkpoint was absent. Fails if
    ``auto`` tries the checkpoint load (the fake engine would raise its own FileNotFoundError) or serves, or the
    message does not name the file or rule."""
    artifact, state = _copy(captured, tmp_path)
    folder = _weight_free(artifact, tmp_path)
    if change == "tokenizer":
        flip_byte(folder / "tokenizer.json", 3)
        match = "model file tokenizer.json has SHA-256"
    elif change == "config":
        (folder / "config.json").write_text(json.dumps({"hidden_size": 16, "vocab_size": 64, "rope_theta": 1.0}))
        match = "model file config.json is "
    else:
        shutil.rmtree(state / "model-payloads")
        match = "rule payload-available"
    start = _start(folder, "coldsnap", state, **_keys(artifact, restore=mode))
    assert not start.served
    assert "CheckpointAbsentError: rule checkpoint-absent failed" in start.log
    assert match in start.log and "no checkpoint is on this node to load instead" in start.log
    # the outcome line names the rule that failed (a dashboard tells a corrupt pack from a changed file), not 45
    cause_rule = "payload-available" if change == "missing-pack" else "model-identity"
    assert (start.line["outcome"], start.line["rule"], start.line.get("checkpoint")) == ("refused", cause_rule, "absent")


def test_a_weight_free_folder_and_an_artifact_without_model_files_is_refused(captured: dict[str, Path], tmp_path: Path) -> None:
    """An artifact that pins no model files gives nothing to check a weight-free folder by. Fails if such a restore
    goes ahead on the configuration digest alone."""
    artifact, state = _copy(captured, tmp_path)
    folder = _weight_free(artifact, tmp_path)
    descriptor = read_descriptor(artifact)
    (artifact / "artifact.json").write_bytes(msgspec.structs.replace(descriptor, model_files=msgspec.UNSET).dumps())
    shutil.rmtree(artifact / "model")
    start = _start(folder, "coldsnap", state, **_keys(artifact, restore="native"))
    assert not start.served and "the artifact pins no model files to check it by" in start.log


def test_a_folder_with_weight_files_of_another_fine_tune_is_refused_as_before(captured: dict[str, Path], tmp_path: Path) -> None:
    """The pinned model files beside another fine-tune's weights: the checkpoint is present, so the identity is its
    files as before, and ``auto`` falls back to it. Fails if pinned model files let another checkpoint pass, or if
    the absent-checkpoint rule stops a folder that has weights."""
    artifact, state = _copy(captured, tmp_path)
    folder = _weight_free(artifact, tmp_path)
    tensors = {name: torch.ones(shape, dtype=torch.bfloat16) for name, shape in fake_engine.SHAPES.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    native = _start(folder, "coldsnap", state, **_keys(artifact, restore="native"))
    assert not native.served and "ModelIdentityMismatchError: rule model-identity failed" in native.log
    auto = _start(folder, "coldsnap", state, **_keys(artifact))
    assert auto.served and (auto.line["outcome"], auto.line["rule"]) == ("fell-back", "model-identity")
    assert "checkpoint" not in auto.line
