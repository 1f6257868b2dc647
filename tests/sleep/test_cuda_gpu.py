"""The CUDA copy backend on a real GPU (cupy): skipped cleanly where no GPU or cupy is present.

The same pipeline code runs on CPU in test_cuda_pipeline.py through FakeDeviceOps; these tests check
the cupy binding itself: pinned staging, asynchronous copies on a stream, events, device reads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from slabs import stage_checkpoint

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.cuda import CudaCopyBackend, CupyDeviceOps, cuda_unavailable_reason
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.manifest import ModelIdentity, WorkerIdentity
from coldsnap_core.restore.hydrate import hydrate

REASON = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"no CUDA copy backend here: {REASON}")]


def test_hydrate_into_device_memory_and_read_back(smollm2_2layer: Path, smollm2_identity: ModelIdentity, tmp_path: Path) -> None:
    """A host capture of SmolLM2 hydrated into cudaMalloc'd device buffers (small chunks: many
    staging turns) reads back through read_chunks with every allocation's SHA-256 equal."""
    import cupy

    slabs = stage_checkpoint(smollm2_2layer)
    captured = capture_worker(
        allocation_map=slabs.allocation_map,
        allocations=slabs.allocations,
        model_ranges=slabs.model_ranges,
        worker=WorkerIdentity("worker", 0, 1, 0, 1),
        capture_point="portable",
        model=smollm2_identity,
        cache=PayloadCache(tmp_path / "state"),
        artifact_dir=tmp_path / "artifact",
        backend=HostCopyBackend(),
    )
    buffers = [cupy.full(a.nbytes, 0xA5, dtype=cupy.uint8) for a in slabs.arrays]
    allocations = [LiveAllocation(i, int(b.data.ptr), b.nbytes) for i, b in enumerate(buffers)]
    backend = CudaCopyBackend(ops=CupyDeviceOps(), chunk_bytes=1 << 20, read_chunk_bytes=256 << 10)
    try:
        hydrate(
            captured.manifest,
            blob_path=captured.capsule_dir / captured.manifest.residual.file,
            cache=PayloadCache(tmp_path / "state"),
            allocations=allocations,
            backend=backend,
            verify_extents=True,
        )
        for allocation, array in zip(allocations, slabs.arrays, strict=True):
            h = hashlib.sha256()
            for chunk in backend.read_chunks(allocation, 0, allocation.size_bytes):
                h.update(chunk)
            assert h.hexdigest() == hashlib.sha256(array).hexdigest()
            assert hashlib.sha256(cupy.asnumpy(buffers[allocation.index])).hexdigest() == h.hexdigest()
    finally:
        backend.close()
