"""The CUDA copy backend's pipeline, driven on CPU through FakeDeviceOps (CUDA's asynchronous
contract over host memory): chunking, double-buffered staging, copies to many allocations in
flight, error naming, capture reads, and the cupy gate."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from sleep_fakes import FakeCuMemAllocator, FakeDeviceOps, LoadedModel, load_state

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.sleep import ReferenceDigests
from coldsnap_core.copy.base import CopyOp
from coldsnap_core.copy.cuda import CudaCopyBackend, cuda_unavailable_reason, plan_chunks
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.errors import ConfigurationError, CopyBackendError, ExtentDigestMismatchError, WakeError
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.manifest import ModelIdentity
from coldsnap_core.restore.hydrate import hydrate, plan_hydration
from coldsnap_vllm.cumem import live_allocations, weights_segments
from coldsnap_vllm.sleep import ColdsnapSleepBackend, SleepCapture, capture_for_sleep

KiB, MiB = 1 << 10, 1 << 20


@dataclass
class Asleep:
    """A captured model whose segments were released and mapped again (garbage), ready to hydrate."""

    capture: SleepCapture
    allocator: FakeCuMemAllocator
    allocations: list[LiveAllocation]
    digests: dict[int, str]

    def fake_ops(self, **kwargs: object) -> FakeDeviceOps:
        starts = [a.address for a in self.allocations]
        return FakeDeviceOps(
            is_device=self.allocator.contains,
            region_of=lambda address: max(i for i, s in enumerate(starts) if s <= address),
            **kwargs,
        )

    def hydrate(self, backend: CudaCopyBackend, **kwargs: object) -> None:
        hydrate(
            self.capture.manifest,
            blob_path=self.capture.blob_path,
            cache=PayloadCache(self.capture.state_root),
            allocations=self.allocations,
            backend=backend,
            **kwargs,
        )


@pytest.fixture
def asleep(loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_identity: ModelIdentity, tmp_path: Path) -> Asleep:
    state = load_state(loaded, smollm2_identity, tmp_path)
    digests = allocator.digests()
    segments = weights_segments(allocator.pointer_to_data)
    capture = capture_for_sleep(state, segments, HostCopyBackend(), ReferenceDigests(state))
    allocator.sleep(("runtime", "cudagraph"))
    allocator.wake_up(None)
    assert allocator.digests() != digests
    return Asleep(capture, allocator, live_allocations(segments), digests)


# --- the plan ----------------------------------------------------------------------------------------


def op(source: str, offset: int, size: int, allocation: int = 0, dest: int = 0, index: int = 0) -> CopyOp:
    return CopyOp(source, offset, allocation, dest, size, None, index)  # type: ignore[arg-type]


def test_chunks_cover_every_op_byte_once_in_bounded_reads() -> None:
    """Every op byte is in exactly one piece, pieces of an op are in order, no chunk exceeds
    chunk_bytes, sources never mix, and a chunk's pieces lie inside it. Fails on a lost or doubled
    byte at a chunk boundary."""
    ops = [
        op("pack", 0, 10 * KiB, 0, 0, 0),
        op("pack", 12 * KiB, 3 * KiB, 1, 64, 1),
        op("pack", 16 * KiB, 40 * KiB, 1, 4096, 2),
        op("blob", 0, 5 * KiB, 0, 20 * KiB, 0),
        op("blob", 5 * KiB, 30 * KiB, 2, 0, 1),
    ]
    chunks = plan_chunks(ops, 16 * KiB, max_gap_bytes=4 * KiB)
    seen: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for chunk in chunks:
        assert chunk.size_bytes <= 16 * KiB
        for piece in chunk.pieces:
            assert piece.op.source == chunk.source
            assert piece.chunk_offset_bytes + piece.size_bytes <= chunk.size_bytes
            assert chunk.file_offset_bytes + piece.chunk_offset_bytes == piece.op.source_offset_bytes + piece.op_offset_bytes
            seen.setdefault((piece.op.source, piece.op.extent_index), []).append((piece.op_offset_bytes, piece.size_bytes))
    for o in ops:
        runs = seen[(o.source, o.extent_index)]
        assert runs[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(runs))
        assert sum(n for _, n in runs) == o.size_bytes
    assert [(c.source, c.file_offset_bytes) for c in chunks[:3]] == [("blob", 0), ("blob", 16 * KiB), ("blob", 32 * KiB)]


def test_near_ops_share_a_read_and_far_ones_do_not() -> None:
    """Ops a padding gap apart share one read (and identical extents one byte range); a gap over
    max_gap_bytes starts a new read. Fails if the pipeline reads every extent separately."""
    ops = [op("pack", 0, 100, 0), op("pack", 4096, 100, 1), op("pack", 4096, 100, 2), op("pack", 1 * MiB, 100, 3)]
    chunks = plan_chunks(ops, 64 * MiB, max_gap_bytes=64 * KiB)
    assert [(c.file_offset_bytes, c.size_bytes, len(c.pieces)) for c in chunks] == [(0, 4196, 3), (1 * MiB, 100, 1)]


# --- hydration through the pipeline ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunk_bytes", "buffers", "threads"),
    [(256 * KiB, 2, 1), (1 * MiB, 3, 4), (64 * MiB, 2, 4)],
)
def test_pipeline_hydrates_every_segment_and_keeps_the_async_contract(
    asleep: Asleep, chunk_bytes: int, buffers: int, threads: int
) -> None:
    """Pack + residual through pinned staging buffers restore every segment's SHA-256. The fake
    runs host-to-device copies only at synchronization and checks their staging bytes did not change
    meanwhile: no violation means no buffer was refilled before its copies completed. With small
    chunks at least two buffers are in flight at once (double buffering: chunk k+1 is read while
    chunk k's copies are pending) with copies to several allocations pending together."""
    ops = asleep.fake_ops()
    backend = CudaCopyBackend(ops=ops, chunk_bytes=chunk_bytes, staging_buffers=buffers, read_threads=threads)
    asleep.hydrate(backend)
    assert ops.violations == []
    assert asleep.allocator.digests() == asleep.digests
    assert 2 <= ops.max_pending_events <= buffers
    assert ops.max_pending_regions >= 2
    backend.close()
    assert ops.pinned == {} and ops.violations == []


def test_the_fake_catches_a_pipeline_that_reuses_a_buffer_too_early(asleep: Asleep) -> None:
    """Sensitivity of the fake itself: if the pipeline's waits did nothing, staging buffers would be
    refilled under pending copies; the fake reports it and the bytes are wrong."""
    ops = asleep.fake_ops()
    ops.synchronize_event = lambda event: None  # type: ignore[method-assign]
    asleep.hydrate(CudaCopyBackend(ops=ops, chunk_bytes=256 * KiB))
    assert any("changed while a copy from them was pending" in v for v in ops.violations)
    assert asleep.allocator.digests() != asleep.digests


def test_verified_hydration_hashes_the_staged_extents(asleep: Asleep) -> None:
    """verify_extents: every model extent is hashed from the staging buffers (split over chunks)."""
    ops = asleep.fake_ops()
    asleep.hydrate(CudaCopyBackend(ops=ops, chunk_bytes=512 * KiB), verify_extents=True)
    assert ops.violations == [] and asleep.allocator.digests() == asleep.digests


def test_device_copy_failure_names_the_extent_and_a_retry_succeeds(asleep: Asleep) -> None:
    """A host-to-device copy failing inside model extent 5 raises CopyBackendError naming it, its
    allocation and the offset; pending copies are drained first (no pinned buffer is in use after
    the error) and the same backend then hydrates correctly. Fails if the error names the wrong
    extent or the pipeline leaves copies in flight."""
    manifest = asleep.capture.manifest
    extent = manifest.model_extents[5]
    base = asleep.allocations[extent.allocation_index].address + extent.offset_bytes
    ops = asleep.fake_ops()
    ops.fail_htod = lambda address, size: base <= address < base + extent.size_bytes
    backend = CudaCopyBackend(ops=ops, chunk_bytes=256 * KiB)
    with pytest.raises(CopyBackendError, match="copying model extent 5 ") as raised:
        asleep.hydrate(backend)
    assert raised.value.allocation == extent.allocation_index
    assert extent.offset_bytes <= raised.value.offset_bytes < extent.end_bytes
    assert all(not q for q in ops.queues.values())
    asleep.hydrate(backend)
    assert ops.violations == [] and asleep.allocator.digests() == asleep.digests


def test_a_source_ending_early_names_the_residual_extent(asleep: Asleep, tmp_path: Path) -> None:
    """A blob shorter than its map (bypassing hydrate's size check): CopyBackendError naming the
    residual extent the file ends in."""
    manifest = asleep.capture.manifest
    blob = tmp_path / "short.blob"
    last = manifest.residual_extents[-1]
    blob.write_bytes(asleep.capture.blob_path.read_bytes()[: last.blob_offset_bytes + 10])
    pack = PayloadCache(asleep.capture.state_root).object_path(manifest.pack.sha256)
    index = len(manifest.residual_extents) - 1
    with pytest.raises(
        CopyBackendError, match=f"blob ended at offset {last.blob_offset_bytes + 10} inside residual extent {index}"
    ):
        CudaCopyBackend(ops=asleep.fake_ops()).fill(
            plan_hydration(manifest), {"pack": pack, "blob": blob}, asleep.allocations, verify_extents=False
        )


def test_a_corrupt_staged_extent_is_an_extent_digest_error(asleep: Asleep, tmp_path: Path) -> None:
    """verify_extents catches a pack whose bytes changed behind the validation record: the error
    names the model extent, its allocation and offset."""
    manifest = asleep.capture.manifest
    extent = manifest.model_extents[2]
    pack = tmp_path / "edited.pack"
    shutil.copyfile(PayloadCache(asleep.capture.state_root).object_path(manifest.pack.sha256), pack)
    with open(pack, "r+b") as f:
        f.seek(extent.pack_offset_bytes + 7)
        byte = f.read(1)
        f.seek(extent.pack_offset_bytes + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    touched = [i for i, e in enumerate(manifest.model_extents) if e.pack_offset_bytes == extent.pack_offset_bytes]
    with pytest.raises(ExtentDigestMismatchError, match=f"model extent {touched[0]} has SHA-256") as raised:
        CudaCopyBackend(ops=asleep.fake_ops()).fill(
            plan_hydration(manifest), {"pack": pack, "blob": asleep.capture.blob_path}, asleep.allocations, verify_extents=True
        )
    assert raised.value.allocation == manifest.model_extents[touched[0]].allocation_index


def test_direct_io_reads_give_the_same_bytes(asleep: Asleep) -> None:
    """O_DIRECT reads (aligned down and up around unaligned blob extents, or the buffered fallback
    where the file system refuses O_DIRECT) restore the same bytes."""
    ops = asleep.fake_ops()
    asleep.hydrate(CudaCopyBackend(ops=ops, chunk_bytes=1 * MiB, direct_io=True))
    assert ops.violations == [] and asleep.allocator.digests() == asleep.digests


# --- capture through device-to-host reads ------------------------------------------------------------


@pytest.mark.parametrize("eager", [True, False], ids=["eager-d2h", "deferred-d2h"])
def test_capture_through_device_reads_equals_the_host_capture(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_identity: ModelIdentity, tmp_path: Path, eager: bool
) -> None:
    """The sleep capture read through read_chunks (small pinned chunks, several hashing threads, the
    pack and blob writers hashing one chunk behind) gives the same manifest, pack and blob as the
    host read. With eager device-to-host copies a buffer the writer still hashes would be
    overwritten at once: fails if read_chunks reuses a chunk's buffer too early."""
    segments = weights_segments(allocator.pointer_to_data)
    state = load_state(loaded, smollm2_identity, tmp_path / "host")
    host = capture_for_sleep(state, segments, HostCopyBackend(), ReferenceDigests(state))
    ops = FakeDeviceOps(is_device=allocator.contains, eager_dtoh=eager)
    device = CudaCopyBackend(ops=ops, read_chunk_bytes=64 * KiB, max_read_lanes=2)
    state = load_state(loaded, smollm2_identity, tmp_path / "device")
    through_device = capture_for_sleep(state, segments, device, ReferenceDigests(state))
    assert ops.violations == []
    assert through_device.manifest == host.manifest
    assert through_device.blob_path.read_bytes() == host.blob_path.read_bytes()
    assert any(entry[0] == "dtoh" for entry in ops.log)


# --- the cupy gate -------------------------------------------------------------------------------------


def test_importing_the_backend_does_not_import_cupy() -> None:
    """cupy is an optional extra: the module imports without it and loads it only on first device use."""
    code = "import sys, coldsnap_core.copy.cuda as c; c.CudaCopyBackend(); print('cupy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


needs_no_cupy = pytest.mark.skipif(cuda_unavailable_reason() is None, reason="a CUDA device and cupy are present")


@needs_no_cupy
def test_without_cupy_or_a_device_the_backend_says_why(asleep: Asleep) -> None:
    """First device use without cupy (or without a GPU) is a ConfigurationError naming the fix."""
    with pytest.raises(ConfigurationError, match=r"cupy|CUDA device"):
        asleep.hydrate(CudaCopyBackend())


@needs_no_cupy
def test_sleep_backend_without_cupy_refuses_before_releasing(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """The default copy backend is the CUDA one; if it cannot run, suspend fails before anything is
    captured or released (the model stays usable)."""
    state = load_state(loaded, smollm2_identity, tmp_path)
    backend = ColdsnapSleepBackend(allocator=allocator, load_state=lambda: state)
    with pytest.raises(ConfigurationError, match=r"cupy|CUDA device"):
        backend.suspend(1)
    assert allocator.calls == [] and backend.state() == "RUNNING"
    assert not os.path.exists(state.state_root / "sleep")


# --- device error paths ----------------------------------------------------------------------------------


class _Runtime:
    def __init__(self, count: int | Exception) -> None:
        self.count = count

    def getDeviceCount(self) -> int:
        if isinstance(self.count, Exception):
            raise self.count
        return self.count

    def getDevice(self) -> int:
        return 0


def _fake_cupy(monkeypatch: pytest.MonkeyPatch, count: int | Exception) -> None:
    from types import SimpleNamespace

    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=_Runtime(count))))


def test_cupy_without_a_driver_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """cupy imports but the CUDA runtime fails (no driver): ConfigurationError with cupy's message."""
    from coldsnap_core.copy.cuda import CupyDeviceOps

    _fake_cupy(monkeypatch, RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient"))
    with pytest.raises(ConfigurationError, match=r"no usable CUDA device.*InsufficientDriver"):
        CupyDeviceOps()


def test_a_device_ordinal_beyond_the_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from coldsnap_core.copy.cuda import CupyDeviceOps

    _fake_cupy(monkeypatch, 2)
    with pytest.raises(ConfigurationError, match="CUDA device 5 does not exist"):
        CupyDeviceOps(5)


def test_failed_pinned_allocation_frees_what_it_got(asleep: Asleep) -> None:
    """The second staging buffer cannot be pinned: CopyBackendError, the first one freed again."""
    ops = asleep.fake_ops()
    real = ops.alloc_pinned
    calls = []

    def alloc(size: int) -> int:
        calls.append(size)
        if len(calls) == 2:
            raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
        return real(size)

    ops.alloc_pinned = alloc  # type: ignore[method-assign]
    with pytest.raises(CopyBackendError, match="allocating 2 pinned staging buffers"):
        asleep.hydrate(CudaCopyBackend(ops=ops, chunk_bytes=1 * MiB))
    assert ops.pinned == {}


def test_unreadable_sources_are_copy_errors(asleep: Asleep, tmp_path: Path) -> None:
    """A missing source file and a source that cannot be read (a folder): CopyBackendError naming
    the file, and for the read the extent."""
    manifest = asleep.capture.manifest
    ops = plan_hydration(manifest)
    backend = CudaCopyBackend(ops=asleep.fake_ops())
    with pytest.raises(CopyBackendError, match="cannot open the source") as raised:
        backend.fill(
            ops, {"pack": tmp_path / "missing.pack", "blob": asleep.capture.blob_path}, asleep.allocations, verify_extents=False
        )
    assert raised.value.file == str(tmp_path / "missing.pack")
    with pytest.raises(CopyBackendError, match=r"reading pack bytes \[0, .*\) for model extent \d+ failed"):
        backend.fill(ops, {"pack": tmp_path, "blob": asleep.capture.blob_path}, asleep.allocations, verify_extents=False)


def test_failing_synchronization_is_a_copy_error(asleep: Asleep) -> None:
    """An error surfacing at an event wait (a copy of an earlier chunk failed on the device) names
    the chunk's extents; one surfacing at the final stream synchronization is reported too."""
    ops = asleep.fake_ops()
    ops.synchronize_event = lambda event: (_ for _ in ()).throw(RuntimeError("cudaErrorIllegalAddress"))  # type: ignore[method-assign]
    with pytest.raises(CopyBackendError, match=r"the host-to-device copies of (model|residual) extent \d+"):
        asleep.hydrate(CudaCopyBackend(ops=ops, chunk_bytes=256 * KiB))
    ops = asleep.fake_ops()
    ops.synchronize_stream = lambda stream: (_ for _ in ()).throw(RuntimeError("cudaErrorIllegalAddress"))  # type: ignore[method-assign]
    with pytest.raises(CopyBackendError, match="the host-to-device copies failed: cudaErrorIllegalAddress"):
        asleep.hydrate(CudaCopyBackend(ops=ops, chunk_bytes=64 * MiB))


def test_failing_device_reads_name_the_allocation_and_offset(asleep: Asleep) -> None:
    """A device-to-host copy failing in the third chunk names the allocation and that chunk's offset."""
    ops = asleep.fake_ops()
    real = ops.memcpy_dtoh_async
    seen = []

    def dtoh(host: int, device: int, size: int, stream: int) -> None:
        seen.append(device)
        if len(seen) == 3:
            raise RuntimeError("cudaErrorIllegalAddress")
        real(host, device, size, stream)

    ops.memcpy_dtoh_async = dtoh  # type: ignore[method-assign]
    allocation = asleep.allocations[0]
    backend = CudaCopyBackend(ops=ops, read_chunk_bytes=64 * KiB)
    with pytest.raises(CopyBackendError, match="to the host failed: cudaErrorIllegalAddress") as raised:
        list(backend.read_chunks(allocation, 0, allocation.size_bytes))
    assert (raised.value.allocation, raised.value.offset_bytes) == (0, 2 * 64 * KiB)
    ops.synchronize_event = lambda event: (_ for _ in ()).throw(RuntimeError("cudaErrorLaunchFailure"))  # type: ignore[method-assign]
    with pytest.raises(CopyBackendError, match="the device-to-host copy of 65536 bytes failed"):
        list(backend.read_chunks(allocation, 0, allocation.size_bytes))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"staging_buffers": 1}, "at least 2 staging buffers"), ({"chunk_bytes": 1000}, "multiples of 4096")],
)
def test_invalid_pipeline_settings_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CudaCopyBackend(ops=FakeDeviceOps(), **kwargs)


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        plan_chunks([op("pack", 0, 10)], 0)


# --- the sleep backend on the CUDA pipeline ----------------------------------------------------------------


def test_sleep_backend_on_the_cuda_pipeline_with_a_failing_copy_and_a_retry(
    loaded: LoadedModel, allocator: FakeCuMemAllocator, smollm2_identity: ModelIdentity, tmp_path: Path
) -> None:
    """The whole level-1 cycle through the CUDA copy backend: capture reads the segments with
    device-to-host copies, the staging buffers are pinned at suspend (the wake allocates no pinned
    memory), a host-to-device copy failing inside model extent 11 fails the wake with a WakeError
    naming it, and the retry restores every segment's SHA-256 with the asynchronous contract kept."""
    state = load_state(loaded, smollm2_identity, tmp_path)
    before = allocator.digests()
    ops = FakeDeviceOps(is_device=allocator.contains)
    copy = CudaCopyBackend(ops=ops, chunk_bytes=1 * MiB, read_chunk_bytes=256 * KiB)
    backend = ColdsnapSleepBackend(allocator=allocator, backend_factory=lambda device: copy, load_state=lambda: state)
    backend.suspend(1)
    staging = [entry for entry in ops.log if entry[0] == "alloc_pinned" and entry[2] == 1 * MiB + 8 * KiB]
    assert len(staging) == 2
    extent = backend.capture.manifest.model_extents[11]
    segment = backend.capture.segments[extent.allocation_index]
    start = segment.address + extent.offset_bytes
    ops.fail_htod = lambda address, size: start <= address < start + extent.size_bytes
    mark = len(ops.log)
    with pytest.raises(WakeError, match="copying model extent 11 ") as raised:
        backend.resume(None)
    assert raised.value.allocation == extent.allocation_index
    assert backend.state() == "SUSPENDED"
    backend.resume(None)
    assert backend.state() == "RUNNING"
    assert allocator.digests() == before
    assert ops.violations == []
    assert not any(entry[0] == "alloc_pinned" for entry in ops.log[mark:])
    backend.close()
    assert ops.pinned == {} and ops.violations == []
