"""The portable restore steps (coldsnap_core.restore.pipeline) on small torch models and real files, no engine.

A tiny model is loaded from a real safetensors file through the write observer and captured with
the canonical writer, exactly as the loader does at the end of ``load_weights``; restores then run
against fresh models. Every refusal of the restore path is produced here: missing artifact or
worker, another model identity, another layout (dtype, layer count, shapes), an unavailable pack,
a corrupt pack (named by extent), a record that vouches for corrupt bytes, inconsistent artifacts.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from coldsnap_core._io import replace_file_durably
from coldsnap_core.artifact.capsules import read_capsule, read_descriptor
from coldsnap_core.cache.pack_use import remove_pack
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import write_record
from coldsnap_core.capture.observer import WriteObserver, map_to_allocations
from coldsnap_core.capture.worker import CaptureResult, capture_loaded_worker, capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.copy.torch_allocations import enumerate_allocations
from coldsnap_core.errors import (
    ArtifactError,
    CapsulePinMismatchError,
    ExtentDigestMismatchError,
    LayoutMismatchError,
    ManifestMismatchError,
    ManifestValueError,
    MissingObjectError,
    ModelIdentityMismatchError,
    PackInUseError,
    PayloadUnavailableError,
)
from coldsnap_core.format.allocation import AllocationMap
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME, CapsuleFile
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME, RECOVERY_MANIFEST_FILENAME, PackRef, WorkerIdentity
from coldsnap_core.format.verify import check_manifest
from coldsnap_core.identity.checkpoint_records import CheckpointRecords, RecordState
from coldsnap_core.identity.config_digest import canonical_model_config, config_json_sha256
from coldsnap_core.identity.model_identity import LoadedModel, check_model_identity, identify_checkpoint
from coldsnap_core.restore.pipeline import WorkerRestore
from tests.support.files import flip_byte
from tests.support.observer_support import open_checkpoint, tensor_bytes, write_checkpoint

RANK0 = WorkerIdentity("worker", 0, 1, 0, 1)


class TinyModel(torch.nn.Module):
    """Embedding, ``layers`` x (stacked qkv, o), a float32 rotary-like buffer."""

    def __init__(self, layers: int = 2, dtype: torch.dtype = torch.bfloat16, rows: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(10, 8, dtype=dtype), requires_grad=False)
        self.qkv = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(rows + 8, 8, dtype=dtype), requires_grad=False) for _ in range(layers)]
        )
        self.o = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype), requires_grad=False) for _ in range(layers)]
        )
        self.register_buffer("rope", torch.arange(6, dtype=torch.float32) / 7)

    def load(self, checkpoint: Path, *, shift: int = 0) -> WriteObserver:
        """What a vLLM weight loader does: copies into views, narrowed sources, stacked shards."""
        with open_checkpoint(checkpoint) as (sources, t), WriteObserver(sources) as observer:
            self.embed.data.copy_(t["embed.weight"])
            for qkv, o in zip(self.qkv, self.o, strict=True):
                qkv.data.narrow(0, 0, 8).copy_(t["q.weight"])
                qkv.data.narrow(0, 8, 4).copy_(t["k.weight"])
                qkv.data.narrow(0, 12, 4).copy_(t["v.weight"])
                o.data.copy_(t["down.weight"].narrow(1, shift, 8))
        return observer

    def snapshot(self) -> list[bytes]:
        return [tensor_bytes(t) for _, t in [*self.named_parameters(), *self.named_buffers()]]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    return write_checkpoint(folder)


def capture(
    model: TinyModel, checkpoint: Path, artifact: Path, state: Path, worker: WorkerIdentity = RANK0, shift: int = 0
) -> CaptureResult:
    observer = model.load(checkpoint, shift=shift)
    allocations = enumerate_allocations(model)
    ranges, _ = map_to_allocations(observer.model_records(), allocations)
    return capture_worker(
        allocation_map=allocations.allocation_map,
        allocations=allocations.live,
        model_ranges=ranges,
        worker=worker,
        capture_point="portable",
        model=identify_checkpoint(
            [checkpoint], source=str(checkpoint.parent), root=checkpoint.parent, records=CheckpointRecords(state)
        ),
        cache=PayloadCache(state),
        artifact_dir=artifact,
        backend=HostCopyBackend(),
    )


def _flip_a_pack_byte_under_a_vouching_record(result: CaptureResult, state: Path):
    """Flip the first byte of the first model extent in the cached pack and rewrite its validation record
    to vouch for the edited file (so admission trusts it); returns that extent."""
    extent = result.manifest.model_extents[0]
    flip_byte(result.pack_path, extent.pack_offset_bytes)
    cache = PayloadCache(state)
    os.chmod(cache.record_path(result.manifest.pack.sha256), 0o644)
    os.unlink(cache.record_path(result.manifest.pack.sha256))
    write_record(cache, result.manifest.pack.sha256, os.lstat(result.pack_path))
    return extent


def restorer(checkpoint: Path, artifact: Path, state: Path, worker: WorkerIdentity = RANK0, **kwargs) -> WorkerRestore:
    return WorkerRestore(artifact, worker, LoadedModel.from_config(str(checkpoint.parent), None), PayloadCache(state), **kwargs)


@pytest.fixture
def captured(tmp_path: Path, checkpoint: Path) -> tuple[TinyModel, CaptureResult]:
    model = TinyModel()
    return model, capture(model, checkpoint, tmp_path / "artifact", tmp_path / "state")


def test_restore_fills_every_byte(tmp_path: Path, checkpoint: Path, captured) -> None:
    """A fresh model restored from pack + residual is byte-identical to the loaded one, buffers
    included (the fresh buffer was zeroed: its bytes come from the residual blob)."""
    loaded, result = captured
    fresh = TinyModel()
    with torch.no_grad():
        fresh.rope.zero_()
    report = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == loaded.snapshot()
    assert report.model_bytes == result.manifest.model_bytes > 0
    assert report.residual_bytes == result.manifest.residual_bytes > 0


class _ProbingBackend(HostCopyBackend):
    """The host backend, which first tries, while the restore copies, what ``coldsnap cache rm`` and gc do."""

    def __init__(self, cache: PayloadCache, digest: str) -> None:
        super().__init__()
        self.cache, self.digest, self.refused = cache, digest, None

    def fill(self, ops, sources, allocations, **kwargs):
        with pytest.raises(PackInUseError) as info:
            remove_pack(self.cache, self.digest)
        self.refused = info.value
        return super().fill(ops, sources, allocations, **kwargs)


def test_a_restore_holds_its_pack_while_it_copies_and_records_its_last_use(tmp_path: Path, checkpoint: Path, captured) -> None:
    """While the restore copies, removing its pack is refused (rule pack-in-use), and the restore sets the pack's
    last use (catches a restore that does not hold the pack, or holds it only around admission)."""
    loaded, result = captured
    cache = PayloadCache(tmp_path / "state")
    digest = result.manifest.pack.sha256
    os.utime(cache.use_path(digest), ns=(10**9, 10**9))  # last used in 1970
    backend = _ProbingBackend(cache, digest)
    fresh = TinyModel()
    restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(fresh), backend)
    assert fresh.snapshot() == loaded.snapshot()
    assert backend.refused is not None and backend.refused.file == str(cache.use_path(digest))
    assert os.stat(cache.use_path(digest)).st_mtime_ns > 10**9
    assert remove_pack(cache, digest).digest == digest  # released at the end of the restore


def test_the_verify_extents_setting_reaches_hydration(tmp_path: Path, checkpoint: Path, captured) -> None:
    """``verify_extents`` from the resolved settings (here the extra-config key, as an engine plugin passes
    it to ``restore_or_fall_back``) makes hydration hash every model extent: with a pack byte flipped
    under a validation record rewritten to vouch for it (so admission trusts the file), the setting off
    restores the flipped byte, the setting on falls back under ``auto`` with ``ExtentDigestMismatchError``
    naming the extent. Fails if the setting is dropped on its way from the settings to ``hydrate``."""
    from coldsnap_core.restore.pipeline import restore_or_fall_back
    from coldsnap_core.settings import ColdsnapSettings

    loaded, result = captured
    extent = _flip_a_pack_byte_under_a_vouching_record(result, tmp_path / "state")
    source = LoadedModel.from_config(str(checkpoint.parent), None)
    extra = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "state")}

    unverified = TinyModel()
    settings = ColdsnapSettings.resolve({}, {**extra, "verify_extents": "0"})[0]
    assert restore_or_fall_back(unverified, settings, RANK0, source).restored
    assert unverified.snapshot() != loaded.snapshot()  # the flipped byte was served: only the setting catches it

    settings = ColdsnapSettings.resolve({}, {**extra, "verify_extents": "1"})[0]
    assert settings.verify_extents
    outcome = restore_or_fall_back(TinyModel(), settings, RANK0, source)
    assert not outcome.restored and isinstance(outcome.fallback, ExtentDigestMismatchError)
    assert extent.sha256 in str(outcome.fallback) or str(extent.pack_offset_bytes) in str(outcome.fallback)


def test_missing_artifact_and_missing_worker(tmp_path: Path, checkpoint: Path, captured) -> None:
    """No ``artifact.json`` -> MissingObjectError whose remedy says where an artifact comes from (the setting,
    pull, export); an artifact without this worker (rank 1 of 2) -> MissingObjectError naming the capsule."""
    with pytest.raises(MissingObjectError, match="artifact descriptor does not exist") as missing:
        restorer(checkpoint, tmp_path / "elsewhere", tmp_path / "state").read()
    assert str(missing.value).endswith(
        "; remedy: check COLDSNAP_ARTIFACT_DIR (the artifact folder, or a REF), or write the artifact there:"
        " coldsnap pull REF DIR, or coldsnap export -- ENGINE COMMAND"
    )
    with pytest.raises(MissingObjectError, match="worker-1-of-2"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state", WorkerIdentity("worker", 1, 2, 1, 2)).read()


@pytest.mark.parametrize(
    ("model", "what"),
    [
        (lambda: TinyModel(dtype=torch.float16), "dtype"),
        (lambda: TinyModel(layers=3), "layer count"),
        (lambda: TinyModel(rows=16), "shape"),
    ],
)
def test_layout_check_refuses_another_layout(tmp_path: Path, checkpoint: Path, captured, model, what: str) -> None:
    """A payload captured from a model with another dtype, layer count or shapes is refused by the
    layout fingerprint before anything is staged or written; the live model is untouched."""
    fresh = model()
    before = fresh.snapshot()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state")
    with pytest.raises(LayoutMismatchError) as raised:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert raised.value.rule == "layout-fingerprint", what
    assert NATIVE_MANIFEST_FILENAME in str(raised.value)
    assert fresh.snapshot() == before
    assert not attempt.layout_matches and not attempt.pack_unavailable


def test_model_identity_is_checked(tmp_path: Path, checkpoint: Path, captured) -> None:
    """Another repository or revision, a missing or resized checkpoint file: refused with
    ModelIdentityMismatchError (before the layout is compared) before anything is staged."""
    recorded = read_descriptor(tmp_path / "artifact").model
    folder = checkpoint.parent
    check_model_identity(recorded, LoadedModel.from_config(str(folder), None))
    commit, other_commit = "1" * 40, "2" * 40
    hub = msgspec.structs.replace(recorded, source="org/tiny", revision=commit)
    check_model_identity(hub, LoadedModel.from_config("org/tiny", commit))
    with pytest.raises(ModelIdentityMismatchError, match="captured from"):
        check_model_identity(hub, LoadedModel.from_config("org/other", commit))
    with pytest.raises(ModelIdentityMismatchError, match="revision"):
        check_model_identity(hub, LoadedModel.from_config("org/tiny", other_commit))
    # QA pass 3, defect 4: the same revision that is not a commit (a branch the cache cannot resolve)
    # on both sides is no pin at all: refused.
    branch = msgspec.structs.replace(recorded, source="org/tiny", revision="dev")
    with pytest.raises(ModelIdentityMismatchError, match="no commit in the local cache"):
        check_model_identity(branch, LoadedModel.from_config("org/tiny", "dev", cache_dir=tmp_path / "no-cache"))
    # QA pass 3, defect 1: an artifact captured from a repository is never restored into a local folder
    # (here the very folder the files came from, under the repository's name).
    with pytest.raises(ModelIdentityMismatchError, match="local folder"):
        check_model_identity(hub, LoadedModel.from_config(str(folder), None))
    with pytest.raises(ModelIdentityMismatchError, match="is missing"):
        check_model_identity(recorded, LoadedModel.from_config(str(tmp_path), None))
    with open(checkpoint, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ModelIdentityMismatchError, match="bytes, the artifact recorded"):
        check_model_identity(recorded, LoadedModel.from_config(str(folder), None))
    checkpoint.unlink()
    with pytest.raises(ModelIdentityMismatchError, match="is missing"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(TinyModel()), HostCopyBackend())


def test_another_spelling_of_the_local_folder_is_the_same_model(tmp_path: Path, checkpoint: Path, captured) -> None:
    """QA defect 5: captured with ``$M``, restored with ``$M/``, through a symbolic link, or from a copy
    of the folder at another path (another node's mount): the same content is the same model, and the
    restore succeeds. Fails if the identity compares path strings."""
    loaded, _ = captured
    folder = checkpoint.parent
    link = tmp_path / "link"
    link.symlink_to(folder)
    copy = tmp_path / "mounted-elsewhere"
    shutil.copytree(folder, copy)
    for spelling in (f"{folder}/", str(link), f"{folder}/../{folder.name}", str(copy)):
        fresh = TinyModel()
        attempt = WorkerRestore(
            tmp_path / "artifact", RANK0, LoadedModel.from_config(spelling, None), PayloadCache(tmp_path / "state")
        )
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
        assert fresh.snapshot() == loaded.snapshot(), spelling


def _rewrite_same_size(checkpoint: Path) -> None:
    """Replace the checkpoint's tensors with other values of the same shapes (the same file size)."""
    from safetensors.torch import load_file, save_file

    tensors = {name: (t.float() + 1).to(t.dtype) for name, t in load_file(str(checkpoint)).items()}
    size = checkpoint.stat().st_size
    save_file(tensors, str(checkpoint), metadata={"format": "pt"})
    assert checkpoint.stat().st_size == size


def test_checkpoint_replaced_with_same_size_content_is_refused(tmp_path: Path, checkpoint: Path, captured) -> None:
    """QA defect 3: the checkpoint rewritten with other tensors of the same size was restored with the
    old weights. Capture recorded the file's digest in this node's checkpoint records; the rewrite
    changes the file's ``stat``, so restore hashes it again, finds another SHA-256 and refuses the
    payload (``auto`` then loads the new checkpoint). The next restore refuses it from the renewed
    record without reading the file again. Nothing is written into the model."""
    _rewrite_same_size(checkpoint)
    fresh = TinyModel()
    before = fresh.snapshot()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state")
    with pytest.raises(ModelIdentityMismatchError, match="hashed again: it changed since its checkpoint record") as refused:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert "replaced with other content of the same size" in str(refused.value)
    assert "remedy: serve the model" in str(refused.value)
    assert fresh.snapshot() == before and not attempt.pack_unavailable
    with pytest.raises(ModelIdentityMismatchError, match="from this node's checkpoint record"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(TinyModel()), HostCopyBackend())


def test_touched_checkpoint_is_hashed_once_and_restored(tmp_path: Path, checkpoint: Path, captured) -> None:
    """A checkpoint file whose ``stat`` changed but whose bytes did not (``touch``, a re-download of the
    same file) is hashed again once, its record renewed, and the restore goes on: no fallback on
    every later start."""
    loaded, _ = captured
    os.utime(checkpoint, ns=(1, 1))
    records = CheckpointRecords(tmp_path / "state")
    assert records.lookup(checkpoint).state is RecordState.STALE
    fresh = TinyModel()
    restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == loaded.snapshot()
    assert records.lookup(checkpoint).state is RecordState.TRUSTED


def test_a_different_checkpoint_with_the_same_file_names_and_sizes_is_served_the_old_weights(
    tmp_path: Path, checkpoint: Path
) -> None:
    """Reliability defect: a blue/green flip of ``current -> A`` to ``current -> B``, where B is another
    fine-tune with the same file names, sizes and config, on a node without a checkpoint record for B,
    restored A's weights. The artifact now records each file's content fingerprint and restore compares
    it where no record applies: B is refused (rule ``model-identity``, naming the fingerprint), nothing is
    written into the model, and the pack is not blamed. Fails if the fingerprint is not recorded at
    capture or not compared without a record."""
    blue = checkpoint.parent
    green = tmp_path / "green"
    shutil.copytree(blue, green)
    _rewrite_same_size(green / checkpoint.name)
    current = tmp_path / "current"
    current.symlink_to(blue)
    model = TinyModel()
    capture(model, current / checkpoint.name, tmp_path / "artifact", tmp_path / "state")
    current.unlink()
    current.symlink_to(green)  # the flip
    other_node = tmp_path / "other-node"
    shutil.copytree(tmp_path / "state" / "model-payloads", other_node / "model-payloads")
    for state in (tmp_path / "state", other_node):  # the capturing node has no record for B either
        fresh = TinyModel()
        before = fresh.snapshot()
        attempt = WorkerRestore(tmp_path / "artifact", RANK0, LoadedModel.from_config(str(current), None), PayloadCache(state))
        with pytest.raises(ModelIdentityMismatchError, match=r"content fingerprint .*no checkpoint record") as refused:
            attempt.run(enumerate_allocations(fresh), HostCopyBackend())
        assert "a swapped fine-tune" in str(refused.value)
        assert "remedy: serve the model (checkpoint, revision, engine flags) the artifact was exported from" in str(refused.value)
        assert fresh.snapshot() == before and not attempt.pack_unavailable
    # with COLDSNAP_VERIFY_CHECKPOINT=1 the full SHA-256 still decides (and is recorded)
    attempt = WorkerRestore(
        tmp_path / "artifact",
        RANK0,
        LoadedModel.from_config(str(current), None),
        PayloadCache(other_node),
        verify_checkpoint=True,
    )
    with pytest.raises(ModelIdentityMismatchError, match="COLDSNAP_VERIFY_CHECKPOINT=1"):
        attempt.run(enumerate_allocations(TinyModel()), HostCopyBackend())
    # flipped back to A: restored from the fingerprint on the node without a record
    current.unlink()
    current.symlink_to(blue)
    fresh = TinyModel()
    WorkerRestore(tmp_path / "artifact", RANK0, LoadedModel.from_config(str(current), None), PayloadCache(other_node)).run(
        enumerate_allocations(fresh), HostCopyBackend()
    )
    assert fresh.snapshot() == model.snapshot()


def test_model_configuration_digest_is_compared(tmp_path: Path, checkpoint: Path, captured) -> None:
    """QA defect 2: an engine whose model configuration (config.json, ``--hf-overrides``, dtype) has
    another digest than the captured one is refused before anything is staged, as is an engine
    restoring an artifact captured without a configuration digest; equal digests restore."""
    artifact = tmp_path / "artifact"
    recorded = read_descriptor(artifact).model
    assert recorded.config_sha256 is None  # this capture ran without an engine configuration
    folder = str(checkpoint.parent)
    with pytest.raises(ModelIdentityMismatchError, match="captured without an engine configuration"):
        check_model_identity(recorded, LoadedModel.from_config(folder, None, "a" * 64))
    pinned = msgspec.structs.replace(recorded, config_sha256="a" * 64)
    check_model_identity(pinned, LoadedModel.from_config(folder, None, "a" * 64))
    with pytest.raises(ModelIdentityMismatchError, match=r"model configuration .*configuration digest b{64}"):
        check_model_identity(pinned, LoadedModel.from_config(folder, None, "b" * 64))


def _capture_with_config(checkpoint: Path, tmp_path: Path, layers: int, *, record_config: bool = True) -> str:
    """A capture of a ``layers``-layer TinyModel from ``checkpoint`` whose engine configuration says ``layers``
    (recorded as the artifact's configuration keys unless ``record_config`` is false); returns that configuration."""
    config_json = canonical_model_config({"num_hidden_layers": layers, "rope_theta": 10000.0}, dtype="bfloat16")
    model = TinyModel(layers=layers)
    observer = model.load(checkpoint)
    allocations = enumerate_allocations(model)
    ranges, _ = map_to_allocations(observer.model_records(), allocations)
    identity = identify_checkpoint(
        [checkpoint],
        source=str(checkpoint.parent),
        root=checkpoint.parent,
        config_sha256=config_json_sha256(config_json),
        config_json=config_json if record_config else None,
    )
    capture_worker(
        allocation_map=allocations.allocation_map,
        allocations=allocations.live,
        model_ranges=ranges,
        worker=RANK0,
        capture_point="portable",
        model=identity,
        cache=PayloadCache(tmp_path / "state"),
        artifact_dir=tmp_path / "artifact",
        backend=HostCopyBackend(),
    )
    return config_json


@pytest.mark.parametrize("record_config", [True, False], ids=["config-recorded", "config-not-recorded"])
def test_another_model_is_named_by_both_models_before_the_layout(tmp_path: Path, record_config: bool) -> None:
    """Catches the layout rule running before the model identity: the 30-layer model started against a 2-layer
    artifact was refused as ``layout differs at allocation 13`` (a tensor of the same size in both). The identity
    comes first and names both models (their sources and configuration digests) and, where the artifact records
    its configuration keys, the key that differs with both values (an artifact from before they were recorded says
    so); the remedy is named; nothing is written."""
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir(), large.mkdir()
    recorded_json = _capture_with_config(write_checkpoint(small), tmp_path, 2, record_config=record_config)
    loaded_json = canonical_model_config({"num_hidden_layers": 3, "rope_theta": 10000.0}, dtype="bfloat16")
    write_checkpoint(large)
    fresh = TinyModel(layers=3)
    before = fresh.snapshot()
    loaded = LoadedModel.from_config(str(large), None, config_json_sha256(loaded_json), config_json=loaded_json)
    attempt = WorkerRestore(tmp_path / "artifact", RANK0, loaded, PayloadCache(tmp_path / "state"))
    with pytest.raises(ModelIdentityMismatchError) as raised:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    message = str(raised.value)
    assert f"engine loads {large}" in message and f"captured from {small}" in message
    assert config_json_sha256(loaded_json) in message and config_json_sha256(recorded_json) in message
    if record_config:
        assert "hf_config.num_hidden_layers: 3 (engine) vs 2 (artifact)" in message
        assert "rope_theta" not in message  # only the keys that differ
    else:
        assert "records no configuration keys" in message
    assert "remedy: start the engine with the model and flags the artifact was exported with" in message
    assert "layout" not in message and fresh.snapshot() == before


def test_another_dtype_names_both_dtypes_and_the_flag(tmp_path: Path, checkpoint: Path) -> None:
    """Catches a dtype mismatch refused without the engine flag that fixes it: the configuration difference names
    both dtypes and the remedy is ``--dtype`` of the export (or an export at the engine's dtype)."""
    recorded_json = _capture_with_config(checkpoint, tmp_path, 2)
    recorded = read_descriptor(tmp_path / "artifact").model
    loaded_json = recorded_json.replace('"dtype":"bfloat16"', '"dtype":"float16"')
    loaded = LoadedModel.from_config(str(checkpoint.parent), None, config_json_sha256(loaded_json), config_json=loaded_json)
    with pytest.raises(ModelIdentityMismatchError) as refused:
        check_model_identity(recorded, loaded)
    message = str(refused.value)
    assert 'dtype: "float16" (engine) vs "bfloat16" (artifact)' in message
    assert "remedy: start the engine with --dtype bfloat16 (the exported dtype), or export again with --dtype float16" in message


def test_recorded_configuration_must_match_its_digest(tmp_path: Path, checkpoint: Path) -> None:
    """Catches a configuration record that is not bound to the digest it explains: ``model.config`` is the canonical
    configuration whose digest is ``config_sha256``, so an edited one (or one without a digest) cannot be written
    or read, and an artifact captured without it reads as before."""
    _capture_with_config(checkpoint, tmp_path, 2)
    recorded = read_descriptor(tmp_path / "artifact").model
    assert config_json_sha256(recorded.config) == recorded.config_sha256
    with pytest.raises(ManifestValueError, match="config is not the canonical configuration"):
        msgspec.structs.replace(recorded, config=recorded.config.replace('"num_hidden_layers":2', '"num_hidden_layers":3'))
    with pytest.raises(ManifestValueError, match="config is not the canonical configuration"):
        msgspec.structs.replace(recorded, config_sha256=None)
    assert "config" not in msgspec.structs.replace(recorded, config=msgspec.UNSET).to_json()


def test_an_export_flag_left_on_over_an_existing_artifact_is_named(tmp_path: Path, checkpoint: Path, caplog) -> None:
    """Catches an export flag left on going unnoticed: every start then loads the checkpoint and captures again
    instead of restoring. The export capture of a worker whose capsule the artifact already holds logs one WARNING
    naming COLDSNAP_EXPORT_MODEL_PAYLOAD, the artifact and the capsule, with the remedy; the first export does not."""
    for _ in range(2):
        model = TinyModel()
        observer = model.load(checkpoint)
        allocations = enumerate_allocations(model)
        ranges, _ = map_to_allocations(observer.model_records(), allocations)
        identity = identify_checkpoint([checkpoint], source=str(checkpoint.parent), root=checkpoint.parent)
        with caplog.at_level(logging.WARNING, logger="coldsnap_core"):
            capture_loaded_worker(
                allocations,
                ranges,
                RANK0,
                identity,
                cache=PayloadCache(tmp_path / "state"),
                artifact_dir=tmp_path / "artifact",
                engine="none",
                engine_version=None,
            )
    flagged = [r.getMessage() for r in caplog.records if "COLDSNAP_EXPORT_MODEL_PAYLOAD=1" in r.getMessage()]
    assert len(flagged) == 1, flagged
    assert str(tmp_path / "artifact") in flagged[0] and "worker-0-of-1" in flagged[0]
    assert "remedy: unset COLDSNAP_EXPORT_MODEL_PAYLOAD" in flagged[0]


def test_unavailable_pack(tmp_path: Path, checkpoint: Path, captured) -> None:
    """The pack is in neither the cache nor a store: PayloadUnavailableError (``auto`` falls back and
    then materializes: the layout matched and the pack is what is missing). Nothing is written."""
    _, result = captured
    os.chmod(result.pack_path, 0o644)
    result.pack_path.unlink()
    fresh = TinyModel()
    before = fresh.snapshot()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state")
    with pytest.raises(PayloadUnavailableError):
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert attempt.layout_matches and attempt.pack_unavailable
    assert fresh.snapshot() == before


def test_pack_is_staged_from_the_configured_store(tmp_path: Path, checkpoint: Path, captured, monkeypatch) -> None:
    """With ``COLDSNAP_PAYLOAD_DIR`` (read where the caller starts, :func:`coldsnap_core.stores.from_env`,
    and handed to the attempt) a pack missing from the node-local cache is fetched, verified and
    committed, then hydrated."""
    from coldsnap_core.stores import from_env

    loaded, result = captured
    store = tmp_path / "store" / "model-payloads" / "sha256"
    store.mkdir(parents=True)
    shutil.copy(result.pack_path, store / result.pack_path.name)
    os.chmod(result.pack_path, 0o644)
    result.pack_path.unlink()
    monkeypatch.setenv("COLDSNAP_PAYLOAD_DIR", str(tmp_path / "store"))
    fresh = TinyModel()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state", store=from_env())
    attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == loaded.snapshot()
    assert result.pack_path.exists()


def test_flipped_pack_byte_is_named_by_extent_and_quarantined(tmp_path: Path, checkpoint: Path, captured) -> None:
    """One flipped byte in the cached pack: its validation record no longer matches, the pack is
    verified in full against the manifest's layout, and the error names the rule ``extent-sha256``,
    the destination allocation and offset of the damaged extent; the object is quarantined so a
    recovery load can materialize it again. Nothing is written into the model."""
    _, result = captured
    extent = max(result.manifest.model_extents, key=lambda e: e.size_bytes)
    flip_byte(result.pack_path, extent.pack_offset_bytes + 3)
    fresh = TinyModel()
    before = fresh.snapshot()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state")
    with pytest.raises(ExtentDigestMismatchError) as raised:
        attempt.run(enumerate_allocations(fresh), HostCopyBackend())
    owners = {(e.allocation_index, e.offset_bytes) for e in result.manifest.model_extents if e.sha256 == extent.sha256}
    assert (raised.value.allocation, raised.value.offset_bytes) in owners
    assert "rule extent-sha256 failed" in str(raised.value)
    assert "remedy: stage the pack again from the payload store" in str(raised.value)
    assert not result.pack_path.exists() and attempt.pack_unavailable
    assert raised.value.quarantined_to.parent.name == "quarantine"
    assert fresh.snapshot() == before


def test_record_vouching_for_corrupt_bytes_is_caught_by_extent_verification(tmp_path: Path, checkpoint: Path, captured) -> None:
    """A validation record rewritten after an edit (so the fast path trusts it) cannot hide the edit
    from ``verify_extents``: hydration stops with the extent's error and the object leaves the cache."""
    _, result = captured
    _flip_a_pack_byte_under_a_vouching_record(result, tmp_path / "state")
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state", verify_extents=True)
    with pytest.raises(ExtentDigestMismatchError):
        attempt.run(enumerate_allocations(TinyModel()), HostCopyBackend())
    assert attempt.pack_unavailable and not result.pack_path.exists()


def test_capsule_naming_another_pack_is_refused(tmp_path: Path, checkpoint: Path, captured) -> None:
    """``artifact.json`` and the capsule's native manifest disagree on the pack: ManifestMismatchError
    (rule manifests-agree, exit code 2), the same rule ``coldsnap verify`` reports (QA defect 9)."""
    artifact = tmp_path / "artifact"
    descriptor = read_descriptor(artifact)
    entry = msgspec.structs.replace(descriptor.workers[0], payload=PackRef.for_digest("0" * 64, 4096))
    replace_file_durably(artifact / DESCRIPTOR_FILENAME, msgspec.structs.replace(descriptor, workers=(entry,)).dumps())
    with pytest.raises(ManifestMismatchError, match="names pack 0000") as raised:
        restorer(checkpoint, artifact, tmp_path / "state").read()
    assert (raised.value.rule, raised.value.exit_code) == ("manifests-agree", 2)


def _rewrite_capsule(artifact: Path, native=None, recovery=None) -> None:
    """Replace worker 0's manifests and re-pin them in artifact.json (a consistent rewrite of both)."""
    capsule_dir = artifact / "workers" / RANK0.capsule_name
    written = {}
    for name, document in ((NATIVE_MANIFEST_FILENAME, native), (RECOVERY_MANIFEST_FILENAME, recovery)):
        if document is not None:
            data = document.dumps()
            replace_file_durably(capsule_dir / name, data)
            written[name] = CapsuleFile(name, len(data), hashlib.sha256(data).hexdigest())
    descriptor = read_descriptor(artifact)
    pins = tuple(written.get(p.name, p) for p in descriptor.workers[0].capsule_files)
    entry = msgspec.structs.replace(descriptor.workers[0], capsule_files=pins)
    replace_file_durably(artifact / DESCRIPTOR_FILENAME, msgspec.structs.replace(descriptor, workers=(entry,)).dumps())


def test_native_capture_point_is_not_restored_by_the_loader(tmp_path: Path, checkpoint: Path, captured) -> None:
    """A capsule captured at the native (level-1 sleep) capture point holds CuMem segments, not
    parameter storages: the loader refuses it with ArtifactError."""
    capsule = read_capsule(tmp_path / "artifact" / "workers" / RANK0.capsule_name)
    addressed = AllocationMap(tuple(msgspec.structs.replace(a, address=4096 * (a.index + 1)) for a in capsule.native.allocations))
    _rewrite_capsule(
        tmp_path / "artifact",
        native=msgspec.structs.replace(capsule.native, capture_point="native", allocations=addressed),
        recovery=msgspec.structs.replace(capsule.recovery, allocations=addressed),
    )
    with pytest.raises(ArtifactError, match="native capture point"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").read()


def test_self_consistent_manifest_edit_is_refused_by_its_pin(tmp_path: Path, checkpoint: Path, captured) -> None:
    """QA defect 1: two model extents of equal size swap SHA-256, pack offset and provenance. The
    manifest stays consistent with itself and with the pack (every rule of the verifier passes), and a
    native restore served each destination the other's bytes. Now the manifest no longer matches its
    pin in artifact.json: CapsulePinMismatchError (exit code 2) before anything is written."""
    _, result = captured
    extents = list(result.manifest.model_extents)
    i, j = next(
        (i, j)
        for i in range(len(extents))
        for j in range(i + 1, len(extents))
        if extents[i].size_bytes == extents[j].size_bytes and extents[i].sha256 != extents[j].sha256
    )
    a, b = extents[i], extents[j]
    extents[i] = msgspec.structs.replace(a, sha256=b.sha256, pack_offset_bytes=b.pack_offset_bytes, provenance=b.provenance)
    extents[j] = msgspec.structs.replace(b, sha256=a.sha256, pack_offset_bytes=a.pack_offset_bytes, provenance=a.provenance)
    swapped = msgspec.structs.replace(result.manifest, model_extents=tuple(extents))
    check_manifest(swapped)  # the edit is invisible to the manifest rules
    replace_file_durably(result.capsule_dir / NATIVE_MANIFEST_FILENAME, swapped.dumps())
    fresh = TinyModel()
    before = fresh.snapshot()
    with pytest.raises(CapsulePinMismatchError, match=r"artifact\.json pins") as raised:
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(fresh), HostCopyBackend())
    assert (raised.value.rule, raised.value.exit_code) == ("capsule-pin", 2)
    assert NATIVE_MANIFEST_FILENAME in str(raised.value) and "remedy: the artifact was changed after its export" in str(
        raised.value
    )
    assert fresh.snapshot() == before


def test_worker_of_the_capsule_must_be_the_entrys(tmp_path: Path, checkpoint: Path, captured) -> None:
    """QA defect 4b: both manifests of a rank-0-of-1 capsule rewritten to say world size 2 (and re-pinned)
    restored natively. Now the entry (and folder) and the manifests disagree: ManifestMismatchError."""
    capsule = read_capsule(tmp_path / "artifact" / "workers" / RANK0.capsule_name)
    other = WorkerIdentity("worker", 0, 2, 0, 2)
    _rewrite_capsule(
        tmp_path / "artifact",
        native=msgspec.structs.replace(capsule.native, worker=other),
        recovery=msgspec.structs.replace(capsule.recovery, worker=other),
    )
    with pytest.raises(ManifestMismatchError, match="belong to worker-0-of-2"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").read()


def test_provenance_outside_the_model_identity_is_refused(tmp_path: Path, checkpoint: Path, captured) -> None:
    """A model extent whose provenance names a checkpoint file the model identity does not list (bytes
    attributed to another model) is refused, naming the extent's allocation and offset."""
    _, result = captured
    first = result.manifest.model_extents[0]
    moved = msgspec.structs.replace(
        first, provenance=msgspec.structs.replace(first.provenance, checkpoint_file="other.safetensors")
    )
    _rewrite_capsule(
        tmp_path / "artifact",
        native=msgspec.structs.replace(result.manifest, model_extents=(moved, *result.manifest.model_extents[1:])),
    )
    with pytest.raises(ManifestMismatchError, match=r"other\.safetensors") as raised:
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").read()
    assert (raised.value.allocation, raised.value.offset_bytes) == (first.allocation_index, first.offset_bytes)


def test_each_tensor_parallel_rank_restores_only_its_own_pack(tmp_path: Path, checkpoint: Path, monkeypatch) -> None:
    """Two tensor parallel ranks with different shards write two capsules (``worker-0-of-2``,
    ``worker-1-of-2``) and two packs into one artifact; restoring rank 1 from a store stages rank 1's
    pack only. Fails if ranks share a capsule name or staging fetches other ranks' payloads."""
    from coldsnap_core.stores import from_env

    artifact, state = tmp_path / "artifact", tmp_path / "capture-state"
    ranks = [WorkerIdentity("worker", r, 2, r, 2) for r in range(2)]
    models = [TinyModel() for _ in ranks]
    results = [capture(m, checkpoint, artifact, state, worker=w, shift=8 * w.rank) for m, w in zip(models, ranks, strict=True)]
    assert [w.capsule for w in read_descriptor(artifact).workers] == ["workers/worker-0-of-2", "workers/worker-1-of-2"]
    assert results[0].manifest.pack.sha256 != results[1].manifest.pack.sha256
    monkeypatch.setenv("COLDSNAP_PAYLOAD_DIR", str(state))
    node = tmp_path / "node-state"
    fresh = TinyModel()
    restorer(checkpoint, artifact, node, ranks[1], store=from_env()).run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == models[1].snapshot() != models[0].snapshot()
    assert sorted(p.name for p in (node / "model-payloads" / "sha256").glob("*.pack")) == [results[1].pack_path.name]


def _capture_replicas(tmp_path: Path, checkpoint: Path) -> tuple[list[WorkerIdentity], list[TinyModel], list[CaptureResult]]:
    """Two data parallel replicas of one tensor parallel 1 model, captured concurrently into one artifact and
    one state root: the same model bytes, a residual (the rope buffer) that tells them apart."""
    replicas = [WorkerIdentity("worker", 0, 1, 0, 1, d, 2) for d in range(2)]
    models = [TinyModel() for _ in replicas]
    with torch.no_grad():
        models[1].rope.add_(1)
    results = [
        capture(m, checkpoint, tmp_path / "artifact", tmp_path / "state", worker=w) for m, w in zip(models, replicas, strict=True)
    ]
    return replicas, models, results


def test_data_parallel_replicas_write_two_capsules_sharing_one_pack(tmp_path: Path, checkpoint: Path) -> None:
    """Two data parallel replicas write two capsules (``worker-0-of-1-dp-0-of-2``, ``worker-0-of-1-dp-1-of-2``)
    naming one pack digest, and the state root holds that pack once. Fails if the capsule name drops the data
    parallel rank (both replicas would write ``worker-0-of-1``: one capsule, the second capture replacing the first)
    or if the second replica's capture removes the first's capsule as another world."""
    replicas, _models, results = _capture_replicas(tmp_path, checkpoint)
    descriptor = read_descriptor(tmp_path / "artifact")
    assert [w.capsule for w in descriptor.workers] == ["workers/worker-0-of-1-dp-0-of-2", "workers/worker-0-of-1-dp-1-of-2"]
    assert [w.worker for w in descriptor.workers] == replicas
    assert sorted(p.name for p in (tmp_path / "artifact" / "workers").iterdir() if not p.name.startswith(".")) == [
        "worker-0-of-1-dp-0-of-2",
        "worker-0-of-1-dp-1-of-2",
    ]
    assert results[0].manifest.pack == results[1].manifest.pack
    assert [p.pack for p in [results[0].manifest, results[1].manifest]] == list(descriptor.distinct_payloads()) * 2
    assert sorted(p.name for p in (tmp_path / "state" / "model-payloads" / "sha256").glob("*.pack")) == [
        results[0].pack_path.name
    ]
    assert results[0].manifest.residual.sha256 != results[1].manifest.residual.sha256


@pytest.mark.parametrize("replica", [0, 1])
def test_each_data_parallel_replica_restores_its_own_capsule(tmp_path: Path, checkpoint: Path, replica: int) -> None:
    """Each replica restores from its own replica's capsule: the rope buffer (residual) it gets is its own.
    Fails if restore picks a capsule by rank alone (both replicas have rank 0) or swaps the data parallel ranks."""
    replicas, models, _results = _capture_replicas(tmp_path, checkpoint)
    fresh = TinyModel()
    restorer(checkpoint, tmp_path / "artifact", tmp_path / "state", replicas[replica]).run(
        enumerate_allocations(fresh), HostCopyBackend()
    )
    assert fresh.snapshot() == models[replica].snapshot() != models[1 - replica].snapshot()


def test_worker_without_its_data_parallel_rank_finds_no_capsule(tmp_path: Path, checkpoint: Path) -> None:
    """A worker that does not know its data parallel rank (identity ``worker-0-of-1``) finds no capsule in a
    data parallel artifact, and a replica of another data parallel size finds none either, rather than being
    served some replica's capsule. Fails if the lookup ignores the data parallel fields."""
    _capture_replicas(tmp_path, checkpoint)
    with pytest.raises(MissingObjectError, match=r"no capsule for worker-0-of-1 \(tensor parallel rank 0 of 1\)"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state", RANK0).read()
    other = WorkerIdentity("worker", 0, 1, 0, 1, 1, 3)
    with pytest.raises(MissingObjectError, match=r"worker-0-of-1-dp-1-of-3.*data parallel rank 1 of 3"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state", other).read()


def test_capture_without_data_parallel_replaces_the_replicas(tmp_path: Path, checkpoint: Path) -> None:
    """Capturing the artifact again without data parallel starts another world: both replica capsules and
    entries go, ``worker-0-of-1`` is the only one left (so ``coldsnap verify`` passes). Fails if the world
    ignores the data parallel size (the stale replica capsules would stay beside the new one)."""
    _capture_replicas(tmp_path, checkpoint)
    capture(TinyModel(), checkpoint, tmp_path / "artifact", tmp_path / "state")
    assert [w.capsule for w in read_descriptor(tmp_path / "artifact").workers] == ["workers/worker-0-of-1"]
    assert sorted(p.name for p in (tmp_path / "artifact" / "workers").iterdir() if not p.name.startswith(".")) == [
        "worker-0-of-1"
    ]


def test_quarantine_warning_not_swallowed_when_corrupt_pack_cannot_be_quarantined(
    tmp_path: Path, checkpoint: Path, captured, caplog: pytest.LogCaptureFixture
) -> None:
    """A corrupt cached pack that cannot be moved into ``quarantine/`` (here: its folder is made
    immutable, or read-only for a non-root user) stays in the cache; the operator must then see one
    WARNING naming the object path. Fails if the restore's quiet quarantine filters that WARNING
    together with the routine "quarantined" notice (the loader reports a successful quarantine in its
    own fallback line, never a failed one)."""
    _, result = captured
    extent = max(result.manifest.model_extents, key=lambda e: e.size_bytes)
    flip_byte(result.pack_path, extent.pack_offset_bytes + 3)
    objects_dir = result.pack_path.parent
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(objects_dir)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported here; as root nothing else makes a rename fail")
        undo = ["chattr", "-i", str(objects_dir)]
    else:
        objects_dir.chmod(0o555)
        undo = ["chmod", "0755", str(objects_dir)]
    try:
        with caplog.at_level(logging.INFO), pytest.raises(ExtentDigestMismatchError) as raised:
            restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(
                enumerate_allocations(TinyModel()), HostCopyBackend()
            )
    finally:
        subprocess.run(undo, check=True)
    assert result.pack_path.exists() and getattr(raised.value, "quarantined_to", None) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cannot be quarantined" in m and str(result.pack_path) in m for m in warnings), warnings


def _count_calls(run, names: tuple[str, ...]) -> collections.Counter[str]:
    """Call ``run()`` with a profile hook counting entries into the ``coldsnap_core`` functions ``names``."""
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_name in names and frame.f_globals.get("__name__", "").startswith("coldsnap_core"):
            counts[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return counts


def test_one_restore_runs_each_check_once(tmp_path: Path, checkpoint: Path, captured) -> None:
    """The restore is linear: the manifest rules, the live layout and the validation record are each
    checked once per restore and their results passed forward (staging and hydration do not re-check
    or re-admit). Fails if a step goes back to repeating a check (``hydrate`` re-running
    ``check_manifest``/``check_live_layout`` or re-admitting the pack, a second record lookup)."""
    loaded, _ = captured
    fresh = TinyModel()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state")
    allocations = enumerate_allocations(fresh)
    names = ("check_manifest", "check_live_layout", "read_trusted_record", "admit", "verify_pack_file")
    counts = _count_calls(lambda: attempt.run(allocations, HostCopyBackend()), names)
    assert fresh.snapshot() == loaded.snapshot()
    assert counts == {"check_manifest": 1, "check_live_layout": 1, "read_trusted_record": 1, "admit": 1}


def test_restore_or_fall_back_uses_the_store_of_the_settings(tmp_path: Path, checkpoint: Path, captured, monkeypatch) -> None:
    """``restore_or_fall_back`` (both engine plugins' policy) restores from the payload store the
    settings name, here from the extra-config key ``payload_dir`` with no ``COLDSNAP_PAYLOAD_DIR`` in
    the environment; under ``auto`` a failure comes back as ``fallback`` with one WARNING, under
    ``native`` it is raised. Fails if the store is looked up in the environment only (the extra-config
    store was then ignored and the pack unavailable) or if ``auto`` raises."""
    from coldsnap_core.restore.pipeline import restore_or_fall_back
    from coldsnap_core.settings import ColdsnapSettings

    loaded, result = captured
    store = tmp_path / "store" / "model-payloads" / "sha256"
    store.mkdir(parents=True)
    shutil.copy(result.pack_path, store / result.pack_path.name)
    os.chmod(result.pack_path, 0o644)
    result.pack_path.unlink()
    monkeypatch.delenv("COLDSNAP_PAYLOAD_DIR", raising=False)
    extra = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "state")}
    source = LoadedModel.from_config(str(checkpoint.parent), None)
    fresh = TinyModel()
    settings = ColdsnapSettings.resolve({}, {**extra, "payload_dir": str(tmp_path / "store")})[0]
    outcome = restore_or_fall_back(fresh, settings, RANK0, source)
    assert outcome.restored and outcome.fallback is None and fresh.snapshot() == loaded.snapshot()
    os.chmod(result.pack_path, 0o644)
    result.pack_path.unlink()
    without_store = ColdsnapSettings.resolve({}, extra)[0]
    outcome = restore_or_fall_back(TinyModel(), without_store, RANK0, source)
    assert not outcome.restored and isinstance(outcome.fallback, PayloadUnavailableError)
    assert outcome.attempt is not None and outcome.attempt.pack_unavailable
    with pytest.raises(PayloadUnavailableError):
        restore_or_fall_back(TinyModel(), ColdsnapSettings.resolve({}, {**extra, "restore": "native"})[0], RANK0, source)


@pytest.mark.parametrize(
    "variable", ["AWS_ENDPOINT_URL=not-a-url", "AWS_PROFILE=coldsnap-no-such-profile", "AWS_MAX_ATTEMPTS=abc"]
)
def test_an_s3_client_that_cannot_be_built_falls_back_under_auto(
    tmp_path: Path, checkpoint: Path, captured, monkeypatch, caplog, variable: str
) -> None:
    """The pack is not cached and the store is ``s3://``, but the environment cannot make an S3 client:
    botocore's ``ValueError`` / ``ProfileNotFound`` used to escape the restore (vLLM died with "Invalid
    endpoint" and no outcome line). Now it is a ``ConfigurationError`` naming the variable, so ``auto`` falls
    back with its one WARNING and ``native`` raises it. Fails if any untyped botocore error escapes."""
    from coldsnap_core.errors import ConfigurationError
    from coldsnap_core.restore.pipeline import restore_or_fall_back
    from coldsnap_core.settings import ColdsnapSettings

    _, result = captured
    os.chmod(result.pack_path, 0o644)
    result.pack_path.unlink()
    name, _, value = variable.partition("=")
    monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    extra = {"artifact_dir": str(tmp_path / "artifact"), "state_root": str(tmp_path / "state"), "payload_repo": "s3://packs"}
    source = LoadedModel.from_config(str(checkpoint.parent), None)
    with caplog.at_level(logging.WARNING, logger="coldsnap_core"):
        outcome = restore_or_fall_back(TinyModel(), ColdsnapSettings.resolve({}, extra)[0], RANK0, source)
    assert not outcome.restored and isinstance(outcome.fallback, ConfigurationError)
    assert f"{name}=" in str(outcome.fallback)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    with pytest.raises(ConfigurationError, match=name):
        restore_or_fall_back(TinyModel(), ColdsnapSettings.resolve({}, {**extra, "restore": "native"})[0], RANK0, source)


class _SwappingBackend(HostCopyBackend):
    """The real host copy backend, but right before it copies, another process's re-export is simulated:
    same-size files with other bytes are renamed onto the blob's and the pack's paths."""

    def __init__(self, blob: Path, pack: Path) -> None:
        super().__init__()
        self.targets = (blob, pack)

    def fill(self, ops, sources, allocations, *, verify_extents: bool) -> None:
        for path in self.targets:
            other = path.with_name(path.name + ".other")
            other.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
            os.replace(other, path)
        super().fill(ops, sources, allocations, verify_extents=verify_extents)


def test_the_bytes_copied_are_the_bytes_verified_when_the_files_are_replaced(tmp_path: Path, checkpoint: Path, captured) -> None:
    """A re-capture into the same artifact folder (or a swap on NFS) renames other bytes of the same size
    onto ``weights.blob`` and the pack between verification and copy: the restore still fills exactly
    the verified bytes, because both are copied through the descriptors they were verified through.
    Fails if the copy backend opens the paths again (it then served a blob its manifest does not pin)."""
    loaded, result = captured
    fresh = TinyModel()
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state")
    blob = result.capsule_dir / "weights.blob"
    attempt.run(enumerate_allocations(fresh), _SwappingBackend(blob, result.pack_path))
    assert fresh.snapshot() == loaded.snapshot()


def test_a_pack_replaced_after_its_admission_is_not_copied(tmp_path: Path, checkpoint: Path, captured) -> None:
    """Other bytes renamed onto the pack's path right after admission accepted it: hydration compares the
    file it opened with the admitted inode and refuses (``CacheError``) before copying a byte. Fails if
    an unadmitted file can reach the allocations."""
    from coldsnap_core.errors import CacheError
    from coldsnap_core.restore.hydrate import hydrate

    _, result = captured

    class SwapAfterAdmission(PayloadCache):
        def admit(self, digest, size_bytes=None, **kwargs):
            path = super().admit(digest, size_bytes, **kwargs)
            other = path.with_name("other.partial")
            other.write_bytes(path.read_bytes())
            os.chmod(other, 0o444)
            os.replace(other, path)
            return path

    fresh = TinyModel()
    allocations = enumerate_allocations(fresh)
    with pytest.raises(CacheError, match="replaced after it was admitted"):
        hydrate(
            result.manifest,
            blob_path=result.capsule_dir / "weights.blob",
            cache=SwapAfterAdmission(tmp_path / "state"),
            allocations=allocations.live,
            backend=HostCopyBackend(),
            live_layout=allocations.allocation_map,
        )
    assert all(b == 0 for b in fresh.embed.detach().view(torch.uint8).flatten().tolist())
