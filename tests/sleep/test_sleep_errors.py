"""Every error path of the sleep backend and its capture, each produced once."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import huggingface_hub.constants as hf_constants
import msgspec
import pytest
from slabs import stage_checkpoint
from sleep_fakes import FakeCuMemAllocator, LoadedModel, load_state

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.sleep import ReferenceDigests
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import ConfigurationError, PackDigestMismatchError, WakeError
from coldsnap_core.format.descriptor import WORKERS_DIRNAME
from coldsnap_core.format.manifest import NATIVE_MANIFEST_FILENAME, ModelIdentity, WorkerIdentity
from coldsnap_vllm.sleep import ColdsnapSleepBackend
from coldsnap_vllm.state import WorkerLoadState

WORKER = WorkerIdentity("worker", 0, 1, 0, 1)


def make_backend(
    state: WorkerLoadState | None, allocator: FakeCuMemAllocator, copy: HostCopyBackend | None = None
) -> ColdsnapSleepBackend:
    chosen = copy or HostCopyBackend()
    return ColdsnapSleepBackend(allocator=allocator, backend_factory=lambda device: chosen, load_state=lambda: state)


@pytest.fixture
def state(loaded: LoadedModel, smollm2_identity: ModelIdentity, tmp_path: Path) -> WorkerLoadState:
    return load_state(loaded, smollm2_identity, tmp_path)


def portable_artifact(checkpoint: Path, identity: ModelIdentity, root: Path, worker: WorkerIdentity = WORKER):
    slabs = stage_checkpoint(checkpoint)
    return capture_worker(
        allocation_map=slabs.allocation_map,
        allocations=slabs.allocations,
        model_ranges=slabs.model_ranges,
        worker=worker,
        capture_point="portable",
        model=identity,
        cache=PayloadCache(root / "state"),
        artifact_dir=root / "artifact",
        backend=HostCopyBackend(),
    )


# --- suspend -----------------------------------------------------------------------------------------


def test_no_weights_segments_is_a_configuration_error(state: WorkerLoadState) -> None:
    """An allocator without "weights" segments (sleep mode was not on while loading): refused."""
    empty = FakeCuMemAllocator()
    try:
        empty.allocate(1 << 20, "kv_cache")
        with pytest.raises(ConfigurationError, match="no 'weights' segments"):
            make_backend(state, empty).suspend(1)
        assert empty.calls == []
    finally:
        empty.close()


def test_a_weights_segment_released_behind_the_backend_is_refused(allocator: FakeCuMemAllocator, state: WorkerLoadState) -> None:
    """A weights segment already asleep (discarded by someone else) cannot be captured: refused by
    address and allocation, nothing else released. Fails if released memory would be read."""
    address = allocator.addresses("weights")[3]
    data = allocator.pointer_to_data[address]
    allocator._unmap_and_release(data.handle)
    data.is_asleep = True
    with pytest.raises(ConfigurationError, match=f"weights segment at {address:#x} is already released") as raised:
        make_backend(state, allocator).suspend(1)
    assert raised.value.allocation == 3
    assert allocator.calls == []


def test_a_lying_artifact_manifest_fails_the_capture_before_release(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """The artifact's manifest names a pack digest its extents cannot produce and the cache lacks it:
    rebuilding it from the live bytes gives another digest, PackDigestMismatchError, nothing released."""
    portable = portable_artifact(smollm2_2layer, smollm2_identity, tmp_path)
    path = tmp_path / "artifact" / WORKERS_DIRNAME / WORKER.capsule_name / NATIVE_MANIFEST_FILENAME
    text = path.read_text().replace(portable.manifest.pack.sha256, "ab" * 32)
    path.chmod(0o644)
    path.write_text(text)
    backend = make_backend(load_state(loaded, smollm2_identity, tmp_path), allocator)
    with pytest.raises(PackDigestMismatchError, match="expects abab"):
        backend.suspend(1)
    assert allocator.calls == [] and backend.state() == "RUNNING"


def test_a_corrupt_artifact_manifest_is_no_reference(
    loaded: LoadedModel, smollm2_identity: ModelIdentity, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest that does not parse is ignored with a warning (the checkpoint is the reference)."""
    path = tmp_path / "artifact" / WORKERS_DIRNAME / WORKER.capsule_name / NATIVE_MANIFEST_FILENAME
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="coldsnap_vllm"):
        references = ReferenceDigests(load_state(loaded, smollm2_identity, tmp_path))
    assert references.manifest is None
    assert "ignoring the artifact manifest" in caplog.text


def test_another_workers_manifest_is_no_reference(
    loaded: LoadedModel, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest of tensor parallel rank 1 found at rank 0's capsule path is not trusted."""
    other = WorkerIdentity("worker", 1, 2, 1, 2)
    portable_artifact(smollm2_2layer, smollm2_identity, tmp_path, other)
    mine = tmp_path / "artifact" / WORKERS_DIRNAME / WORKER.capsule_name
    mine.mkdir(parents=True)
    shutil.copy(tmp_path / "artifact" / WORKERS_DIRNAME / other.capsule_name / NATIVE_MANIFEST_FILENAME, mine)
    with caplog.at_level(logging.WARNING, logger="coldsnap_vllm"):
        references = ReferenceDigests(load_state(loaded, smollm2_identity, tmp_path))
    assert references.manifest is None
    assert "belongs to" in caplog.text


def test_checkpoint_references_come_from_the_hugging_face_cache(
    loaded: LoadedModel, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repository id as the model source: the checkpoint file is found through
    huggingface_hub.try_to_load_from_cache at the pinned revision (a cache laid out as the library
    does: models--org--name/snapshots/<revision>/); absent from the cache, there is no reference.
    The cache is vLLM's ``--download-dir`` when the loader published one (``hf_cache_dir``), else
    ``HF_HUB_CACHE``: fails if the backend looks only in ``HF_HUB_CACHE``."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    identity = msgspec.structs.replace(smollm2_identity, source=repo, revision=revision)
    write = loaded.writes[5]
    local = ReferenceDigests(load_state(loaded, smollm2_identity, tmp_path / "b")).expected(write.provenance, write.size_bytes)
    assert local is not None
    default_cache, download_dir = tmp_path / "hf", tmp_path / "download-dir"
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(default_cache))
    for cache, hf_cache_dir, label in ((default_cache, None, "d"), (download_dir, download_dir, "e")):
        snapshot = cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / revision
        snapshot.mkdir(parents=True)
        state = load_state(loaded, identity, tmp_path / f"{label}-absent", hf_cache_dir=hf_cache_dir)
        assert ReferenceDigests(state).expected(write.provenance, write.size_bytes) is None
        for f in smollm2_2layer.glob("*.safetensors"):
            (snapshot / f.name).symlink_to(f)
        state = load_state(loaded, identity, tmp_path / label, hf_cache_dir=hf_cache_dir)
        assert ReferenceDigests(state).expected(write.provenance, write.size_bytes) == local, label


def test_a_source_range_past_the_file_end_is_no_reference(
    loaded: LoadedModel, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """A provenance that reads beyond the checkpoint file gives no reference digest (never a digest
    of fewer bytes)."""
    write = loaded.writes[0]
    beyond = msgspec.structs.replace(write.provenance, source_offset_bytes=smollm2_identity.files[0].size_bytes - 10)
    assert ReferenceDigests(load_state(loaded, smollm2_identity, tmp_path)).expected(beyond, write.size_bytes) is None


# --- resume ------------------------------------------------------------------------------------------


def test_a_weights_segment_the_capture_does_not_know_is_a_wake_error(
    allocator: FakeCuMemAllocator, state: WorkerLoadState
) -> None:
    """A weights segment that appeared while asleep holds nothing the capsule can restore: refused."""
    backend = make_backend(state, allocator)
    backend.suspend(1)
    address = allocator.allocate(1 << 20, "weights")
    allocator.pointer_to_data[address].is_asleep = True
    with pytest.raises(WakeError, match=f"weights segment at {address:#x} was not captured"):
        backend.resume(None)
    assert backend.state() == "SUSPENDED"


def test_a_captured_segment_that_is_gone_is_a_wake_error(allocator: FakeCuMemAllocator, state: WorkerLoadState) -> None:
    backend = make_backend(state, allocator)
    backend.suspend(1)
    address = allocator.addresses("weights")[4]
    allocator.pointer_to_data.pop(address)
    with pytest.raises(WakeError, match=f"captured weights segment at {address:#x} is gone") as raised:
        backend.resume(None)
    assert raised.value.allocation == 4


def test_a_segment_the_allocator_left_asleep_is_a_wake_error(
    allocator: FakeCuMemAllocator, state: WorkerLoadState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If wake_up returned without mapping a weights segment, nothing is written to it."""
    backend = make_backend(state, allocator)
    backend.suspend(1)
    monkeypatch.setattr(allocator, "wake_up", lambda tags=None: None)
    with pytest.raises(WakeError, match="is still asleep after wake_up") as raised:
        backend.resume(None)
    assert raised.value.allocation == 0


def test_an_unexpected_copy_exception_is_a_wake_error(allocator: FakeCuMemAllocator, state: WorkerLoadState) -> None:
    """Any exception from the copy backend (here a RuntimeError of a device) becomes a WakeError
    that keeps the cause, and the backend stays SUSPENDED."""

    class Broken(HostCopyBackend):
        def fill(self, *args, **kwargs):  # type: ignore[override]
            raise RuntimeError("cudaErrorLaunchFailure")

    backend = make_backend(state, allocator, Broken())
    backend.suspend(1)
    with pytest.raises(WakeError, match="cudaErrorLaunchFailure"):
        backend.resume(None)
    assert backend.state() == "SUSPENDED"


def test_a_failing_wake_of_other_tags_leaves_the_backend_suspended(
    allocator: FakeCuMemAllocator, state: WorkerLoadState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kv_cache-only wake whose allocator call fails propagates the error and is not RUNNING."""
    backend = make_backend(state, allocator)
    backend.suspend(1)

    def fail(tags=None):
        raise RuntimeError("CUDA Error: out of memory")

    monkeypatch.setattr(allocator, "wake_up", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        backend.resume(["kv_cache"])
    assert backend.state() == "SUSPENDED"
