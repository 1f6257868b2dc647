"""The native capture at a level-1 sleep: which writes are model extents, which pack they name."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import msgspec
import pytest
from slabs import stage_checkpoint
from sleep_fakes import FakeCuMemAllocator, LoadedModel, load_state

from coldsnap_core.artifact.capsules import replace_dir_atomically
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.sleep import ReferenceDigests
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import ObserverError
from coldsnap_core.format.manifest import CheckpointFile, ModelIdentity, WorkerIdentity
from coldsnap_core.load_policy import ModelWrite as ObservedModelWrite
from coldsnap_vllm.cumem import weights_segments
from coldsnap_vllm.sleep import ColdsnapSleepBackend, capture_for_sleep
from coldsnap_vllm.state import WorkerLoadState

WORKER = WorkerIdentity("worker", 0, 1, 0, 1)


def portable_capture(checkpoint: Path, identity: ModelIdentity, root: Path, *, converted: str | None = None):
    """What the loader's capture leaves: a portable artifact for this worker, its pack in the cache
    (``converted``: the tensor whose copy the observer saw convert the dtype)."""
    slabs = stage_checkpoint(checkpoint)
    ranges = [
        dataclasses.replace(r, provenance=msgspec.structs.replace(r.provenance, dtype_converted=True))
        if r.provenance.tensor_name == converted
        else r
        for r in slabs.model_ranges
    ]
    return capture_worker(
        allocation_map=slabs.allocation_map,
        allocations=slabs.allocations,
        model_ranges=ranges,
        worker=WORKER,
        capture_point="portable",
        model=identity,
        cache=PayloadCache(root / "state"),
        artifact_dir=root / "artifact",
        backend=HostCopyBackend(),
    )


def sleep_capture(state: WorkerLoadState, allocator: FakeCuMemAllocator):
    segments = weights_segments(allocator.pointer_to_data)
    return capture_for_sleep(state, segments, HostCopyBackend(), ReferenceDigests(state))


def cached_packs(state: WorkerLoadState) -> list[str]:
    return sorted(p.name for p in (state.state_root / "model-payloads" / "sha256").glob("*.pack"))


def test_native_and_portable_captures_share_one_pack(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """The sharing the format is about: the same checkpoint captured at the loader (portable, host
    slabs in another layout) and at the level-1 sleep (CuMem segments at device addresses) names one
    pack digest. Fails if the native capture drifts from the canonical writer or keeps non-checkpoint
    bytes in model extents."""
    portable = portable_capture(smollm2_2layer, smollm2_identity, tmp_path / "portable")
    native = sleep_capture(load_state(loaded, smollm2_identity, tmp_path / "native"), allocator)
    assert native.manifest.pack == portable.manifest.pack
    assert native.manifest.capture_point == "native" and portable.manifest.capture_point == "portable"
    assert {(e.sha256, e.size_bytes) for e in native.manifest.model_extents} == {
        (e.sha256, e.size_bytes) for e in portable.manifest.model_extents
    }


def test_the_artifact_manifest_is_the_reference_and_its_cached_pack_is_reused(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """With the loader's portable capture in the artifact and its pack cached, the sleep takes its
    digests from that manifest (no checkpoint is read: the identity points nowhere) and writes no
    pack. Fails if every sleep rewrites the pack or ignores the artifact."""
    portable = portable_capture(smollm2_2layer, smollm2_identity, tmp_path)
    nowhere = msgspec.structs.replace(smollm2_identity, source=str(tmp_path / "gone"))
    state = load_state(loaded, nowhere, tmp_path, pack=portable.manifest.pack)
    capture = sleep_capture(state, allocator)
    assert not capture.pack_written
    assert capture.manifest.pack == portable.manifest.pack
    assert len(capture.manifest.model_extents) == 20
    assert cached_packs(state) == [f"{portable.manifest.pack.sha256}.pack"]


def test_a_pack_missing_from_the_cache_is_rebuilt_from_live_bytes_with_its_digest(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """The artifact names a pack the cache lost: the sleep materializes it from the live weights with
    the canonical writer and the artifact's digest as the expected one."""
    portable = portable_capture(smollm2_2layer, smollm2_identity, tmp_path)
    os.unlink(PayloadCache(tmp_path / "state").object_path(portable.manifest.pack.sha256))
    capture = sleep_capture(load_state(loaded, smollm2_identity, tmp_path, pack=portable.manifest.pack), allocator)
    assert capture.pack_written
    assert capture.pack_path.is_file()
    assert capture.manifest.pack == portable.manifest.pack


def test_a_manifest_for_another_pack_is_not_a_reference(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """If the loader published a different pack than the artifact's manifest names, the manifest is
    stale: its digests are not trusted (the checkpoint is the reference instead)."""
    portable_capture(smollm2_2layer, smollm2_identity, tmp_path)
    other = msgspec.structs.replace(
        portable_capture(smollm2_2layer, smollm2_identity, tmp_path / "x").manifest.pack, sha256="ab" * 32
    )
    state = load_state(loaded, smollm2_identity, tmp_path, pack=other)
    assert ReferenceDigests(state).manifest is None


def test_without_any_reference_every_write_is_residual(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No artifact and no checkpoint identity: nothing proves a write still holds checkpoint bytes,
    so all of them are residual (an empty pack) and the wake still restores every byte."""
    state = load_state(loaded, None, tmp_path)
    before = allocator.digests()
    backend = ColdsnapSleepBackend(allocator=allocator, backend_factory=lambda d: HostCopyBackend(), load_state=lambda: state)
    with caplog.at_level(logging.INFO, logger="coldsnap_vllm"):
        backend.suspend(1)
    assert backend.capture.manifest.model_extents == ()
    assert backend.capture.manifest.pack.size_bytes == 0
    assert len(backend.capture.rewritten) == 20
    assert "no longer hold their loaded bytes" in caplog.text
    backend.resume(None)
    assert allocator.digests() == before


def test_a_checkpoint_file_of_another_size_gives_no_reference(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """The identity pins each file's size: a file that differs is not read for reference digests."""
    files = tuple(CheckpointFile(f.name, f.size_bytes + 1, f.sha256) for f in smollm2_identity.files)
    state = load_state(loaded, msgspec.structs.replace(smollm2_identity, files=files), tmp_path)
    write = loaded.writes[0]
    assert ReferenceDigests(state).expected(write.provenance, write.size_bytes) is None


def test_dtype_converted_writes_need_the_artifact_manifest(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """A dtype-converting copy has no byte-equal checkpoint source: without a manifest it is residual;
    the artifact's manifest (which recorded the destination digest at load) makes it a model extent."""
    converted = [
        dataclasses.replace(w, provenance=msgspec.structs.replace(w.provenance, dtype_converted=True)) if i == 3 else w
        for i, w in enumerate(loaded.writes)
    ]
    name = converted[3].provenance.tensor_name
    alone = sleep_capture(load_state(loaded, smollm2_identity, tmp_path / "alone", writes=converted), allocator)
    assert [r.provenance.tensor_name for r in alone.rewritten] == [name]
    assert len(alone.manifest.model_extents) == 19
    portable = portable_capture(smollm2_2layer, smollm2_identity, tmp_path / "with", converted=name)
    state = load_state(loaded, smollm2_identity, tmp_path / "with", pack=portable.manifest.pack, writes=converted)
    with_manifest = sleep_capture(state, allocator)
    assert with_manifest.rewritten == ()
    assert with_manifest.manifest.pack == portable.manifest.pack


def test_reference_digests_follow_strided_source_runs(
    loaded: LoadedModel, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """A row-parallel shard reads its source in runs (one per row, a stride apart): the reference is
    the SHA-256 of the runs concatenated. Checked against a write described as 2 runs of half the
    tensor with a stride of half (the same bytes) and against a wrong stride."""
    write = next(w for w in loaded.writes if w.size_bytes % 2 == 0 and w.size_bytes > 4096)
    references = ReferenceDigests(load_state(loaded, smollm2_identity, tmp_path))
    whole = references.expected(write.provenance, write.size_bytes)
    half = write.size_bytes // 2
    runs = msgspec.structs.replace(write.provenance, source_run_bytes=half, source_run_stride_bytes=half)
    skewed = msgspec.structs.replace(write.provenance, source_run_bytes=half, source_run_stride_bytes=half + 2)
    assert whole is not None
    assert references.expected(runs, write.size_bytes) == whole
    assert references.expected(skewed, write.size_bytes) not in (None, whole)


def test_overlapping_writes_stop_the_capture_before_anything_is_written(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """Overlapping observed writes are an observer bug: ObserverError, no capsule, no pack."""
    first = loaded.writes[0]
    bad = [*loaded.writes, ObservedModelWrite(first.address + 16, 32, first.provenance)]
    state = load_state(loaded, smollm2_identity, tmp_path, writes=bad)
    with pytest.raises(ObserverError, match="sorted and disjoint"):
        sleep_capture(state, allocator)
    assert not (state.state_root / "sleep").exists()
    assert cached_packs(state) == []


def test_capsule_replacement_is_all_or_nothing(tmp_path: Path) -> None:
    """A failure while building a new capsule leaves the previous one intact and no staging folder."""
    final = tmp_path / "sleep" / "worker-0-of-1-pid1"
    replace_dir_atomically(final, lambda d: (d / "weights.blob").write_bytes(b"old"))

    def broken(staging: Path) -> None:
        (staging / "weights.blob").write_bytes(b"new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_dir_atomically(final, broken)
    assert (final / "weights.blob").read_bytes() == b"old"
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name]


def test_without_an_artifact_folder_the_checkpoint_files_are_the_reference(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """``--load-format coldsnap`` with no ``COLDSNAP_ARTIFACT_DIR``: the loader publishes
    ``artifact_dir=None``; the sleep reads its reference digests from the pinned checkpoint files and
    still names the same pack as a portable capture. Fails if a missing artifact folder breaks the
    level-1 sleep (it used to be a required path)."""
    state = dataclasses.replace(load_state(loaded, smollm2_identity, tmp_path / "native"), artifact_dir=None)
    native = sleep_capture(state, allocator)
    portable = portable_capture(smollm2_2layer, smollm2_identity, tmp_path / "portable")
    assert native.manifest.pack == portable.manifest.pack
    assert cached_packs(state) == [f"{portable.manifest.pack.sha256}.pack"]
