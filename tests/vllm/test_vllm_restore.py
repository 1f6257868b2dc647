"""The portable restore steps (coldsnap_core.restore) on small torch models and real files, no engine.

A tiny model is loaded from a real safetensors file through the write observer and captured with
the canonical writer, exactly as the loader does at the end of ``load_weights``; restores then run
against fresh models. Every refusal of the restore path is produced here: missing artifact or
worker, another model identity, another layout (dtype, layer count, shapes), an unavailable pack,
a corrupt pack (named by extent), a record that vouches for corrupt bytes, inconsistent artifacts.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch
from observer_support import open_checkpoint, tensor_bytes, write_checkpoint

from coldsnap_core.artifact import read_capsule, read_descriptor, replace_file_durably
from coldsnap_core.cache import PayloadCache
from coldsnap_core.capture import CaptureResult, capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import (
    ArtifactError,
    ExtentDigestMismatchError,
    LayoutMismatchError,
    MissingObjectError,
    ModelIdentityMismatchError,
    PayloadUnavailableError,
)
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME, PackRef, WorkerIdentity
from coldsnap_core.model_identity import identify_checkpoint
from coldsnap_core.records import write_record
from coldsnap_core.restore import LoadedModel, WorkerRestore, check_model_identity
from coldsnap_core.torch_allocations import enumerate_allocations
from coldsnap_vllm.observer import WriteObserver, map_to_allocations

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
        model=identify_checkpoint([checkpoint], source=str(checkpoint.parent), root=checkpoint.parent),
        cache=PayloadCache(state),
        artifact_dir=artifact,
        backend=HostCopyBackend(),
    )


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


def test_restore_with_extent_verification(tmp_path: Path, checkpoint: Path, captured) -> None:
    """``COLDSNAP_VERIFY_EXTENTS=1`` hashes every extent while copying; a good pack passes."""
    loaded, _ = captured
    fresh = TinyModel()
    restorer(checkpoint, tmp_path / "artifact", tmp_path / "state", verify_extents=True).run(
        enumerate_allocations(fresh), HostCopyBackend()
    )
    assert fresh.snapshot() == loaded.snapshot()


def test_missing_artifact_and_missing_worker(tmp_path: Path, checkpoint: Path, captured) -> None:
    """No ``artifact.json`` -> MissingObjectError; an artifact without this worker (rank 1 of 2)
    -> MissingObjectError naming the capsule."""
    with pytest.raises(MissingObjectError, match="artifact descriptor does not exist"):
        restorer(checkpoint, tmp_path / "elsewhere", tmp_path / "state").read()
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
    """Another source, another revision, a missing or resized checkpoint file: refused with
    ModelIdentityMismatchError (after the layout check passed) before anything is staged."""
    recorded = read_descriptor(tmp_path / "artifact").model
    folder = checkpoint.parent
    check_model_identity(recorded, LoadedModel.from_config(str(folder), None))
    with pytest.raises(ModelIdentityMismatchError, match="captured from"):
        check_model_identity(recorded, LoadedModel.from_config(str(tmp_path), None))
    with pytest.raises(ModelIdentityMismatchError, match="revision"):
        check_model_identity(recorded, LoadedModel.from_config(str(folder), "abc123"))
    with open(checkpoint, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ModelIdentityMismatchError, match="bytes, the artifact recorded"):
        check_model_identity(recorded, LoadedModel.from_config(str(folder), None))
    checkpoint.unlink()
    with pytest.raises(ModelIdentityMismatchError, match="is missing"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(TinyModel()), HostCopyBackend())


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
    """With ``COLDSNAP_PAYLOAD_DIR`` a pack missing from the node-local cache is fetched, verified and
    committed, then hydrated."""
    loaded, result = captured
    store = tmp_path / "store" / "model-payloads" / "sha256"
    store.mkdir(parents=True)
    shutil.copy(result.pack_path, store / result.pack_path.name)
    os.chmod(result.pack_path, 0o644)
    result.pack_path.unlink()
    monkeypatch.setenv("COLDSNAP_PAYLOAD_DIR", str(tmp_path / "store"))
    fresh = TinyModel()
    restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == loaded.snapshot()
    assert result.pack_path.exists()


def flip_byte(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))
    os.chmod(path, 0o444)


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
    assert not result.pack_path.exists() and attempt.pack_unavailable
    assert raised.value.quarantined_to.parent.name == "quarantine"
    assert fresh.snapshot() == before


def test_record_vouching_for_corrupt_bytes_is_caught_by_extent_verification(tmp_path: Path, checkpoint: Path, captured) -> None:
    """A validation record rewritten after an edit (so the fast path trusts it) cannot hide the edit
    from ``verify_extents``: hydration stops with the extent's error and the object leaves the cache."""
    _, result = captured
    extent = result.manifest.model_extents[0]
    flip_byte(result.pack_path, extent.pack_offset_bytes)
    cache = PayloadCache(tmp_path / "state")
    os.chmod(cache.record_path(result.manifest.pack.sha256), 0o644)
    os.unlink(cache.record_path(result.manifest.pack.sha256))
    write_record(cache, result.manifest.pack.sha256, os.lstat(result.pack_path))
    attempt = restorer(checkpoint, tmp_path / "artifact", tmp_path / "state", verify_extents=True)
    with pytest.raises(ExtentDigestMismatchError):
        attempt.run(enumerate_allocations(TinyModel()), HostCopyBackend())
    assert attempt.pack_unavailable and not result.pack_path.exists()


def test_capsule_naming_another_pack_is_refused(tmp_path: Path, checkpoint: Path, captured) -> None:
    """``artifact.json`` and the capsule's native manifest disagree on the pack: ArtifactError."""
    artifact = tmp_path / "artifact"
    descriptor = read_descriptor(artifact)
    entry = dataclasses.replace(descriptor.workers[0], payload=PackRef.for_digest("0" * 64, 4096))
    replace_file_durably(artifact / DESCRIPTOR_FILENAME, dataclasses.replace(descriptor, workers=(entry,)).dumps())
    with pytest.raises(ArtifactError, match="names pack 0000"):
        restorer(checkpoint, artifact, tmp_path / "state").read()


def test_native_capture_point_is_not_restored_by_the_loader(tmp_path: Path, checkpoint: Path, captured) -> None:
    """A capsule captured at the native (level-1 sleep) capture point holds CuMem segments, not
    parameter storages: the loader refuses it with ArtifactError."""
    capsule = read_capsule(tmp_path / "artifact" / "workers" / RANK0.capsule_name)
    native = dataclasses.replace(capsule.native, capture_point="native")
    replace_file_durably(capsule.native_manifest_path, native.dumps())
    with pytest.raises(ArtifactError, match="native capture point"):
        restorer(checkpoint, tmp_path / "artifact", tmp_path / "state").read()


def test_each_tensor_parallel_rank_restores_only_its_own_pack(tmp_path: Path, checkpoint: Path, monkeypatch) -> None:
    """Two tensor parallel ranks with different shards write two capsules (``worker-0-of-2``,
    ``worker-1-of-2``) and two packs into one artifact; restoring rank 1 from a store stages rank 1's
    pack only. Fails if ranks share a capsule name or staging fetches other ranks' payloads."""
    artifact, state = tmp_path / "artifact", tmp_path / "capture-state"
    ranks = [WorkerIdentity("worker", r, 2, r, 2) for r in range(2)]
    models = [TinyModel() for _ in ranks]
    results = [capture(m, checkpoint, artifact, state, worker=w, shift=8 * w.rank) for m, w in zip(models, ranks, strict=True)]
    assert [w.capsule for w in read_descriptor(artifact).workers] == ["workers/worker-0-of-2", "workers/worker-1-of-2"]
    assert results[0].manifest.pack.sha256 != results[1].manifest.pack.sha256
    monkeypatch.setenv("COLDSNAP_PAYLOAD_DIR", str(state))
    node = tmp_path / "node-state"
    fresh = TinyModel()
    restorer(checkpoint, artifact, node, ranks[1]).run(enumerate_allocations(fresh), HostCopyBackend())
    assert fresh.snapshot() == models[1].snapshot() != models[0].snapshot()
    assert sorted(p.name for p in (node / "model-payloads" / "sha256").glob("*.pack")) == [results[1].pack_path.name]
