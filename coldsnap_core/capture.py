"""Capture: turn live allocations plus the observed model ranges into pack + residual + manifests.

Engine integrations (the vLLM loader's write observer, the level-1 sleep backend) decide *which*
bytes are model bytes; this module only needs the result:

* the allocation map (what the allocations are and which tensors live in them),
* the live allocations (addresses and sizes, read through a copy backend),
* the model ranges: disjoint byte ranges that still hold bytes the loader copied from the checkpoint,
  each with its provenance.

Everything else in the allocations is residual. The pack goes to the node-local cache through the
canonical writer; the blob and both manifests go to the worker's unit capsule; the worker is
registered in ``artifact.json``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.artifact import register_worker, write_capsule, write_manifests
from coldsnap_core.cache import PayloadCache
from coldsnap_core.copy.base import CopyBackend, LiveAllocation
from coldsnap_core.errors import ObserverError
from coldsnap_core.format.allocation import AllocationMap
from coldsnap_core.format.descriptor import WORKERS_DIRNAME, WorkerEntry
from coldsnap_core.format.extents import ExtentProvenance, ModelExtent
from coldsnap_core.format.manifest import (
    RESIDUAL_FILENAME,
    CapturePoint,
    ModelIdentity,
    NativeManifest,
    RecoveryManifest,
    WorkerIdentity,
)
from coldsnap_core.format.pack_layout import PackLayout
from coldsnap_core.pack_writer import write_pack
from coldsnap_core.residual import residual_extents, write_residual

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelRange:
    """A destination byte range that holds checkpoint bytes at capture time.

    Attributes:
        allocation_index: the allocation the range lies in.
        offset_bytes: start within the allocation.
        size_bytes: length, > 0.
        provenance: where the bytes came from.
    """

    allocation_index: int
    offset_bytes: int
    size_bytes: int
    provenance: ExtentProvenance


@dataclass(frozen=True, slots=True)
class CaptureResult:
    """What one worker's capture produced.

    Attributes:
        manifest: the native manifest written to the capsule.
        recovery: the recovery manifest written to the capsule.
        capsule_dir: the unit capsule folder.
        pack_path: the pack object in the node-local cache.
        seconds: wall time of the capture (hashing, pack, blob, manifests).
    """

    manifest: NativeManifest
    recovery: RecoveryManifest
    capsule_dir: Path
    pack_path: Path
    seconds: float


def check_model_ranges(ranges: Sequence[ModelRange], allocations: Sequence[LiveAllocation]) -> None:
    """Model ranges must be sorted, in bounds and disjoint; an observer bug otherwise.

    Raises:
        ObserverError: names the offending range's allocation and offset.
    """
    previous = (0, 0)
    for r in ranges:
        if r.size_bytes <= 0 or r.allocation_index >= len(allocations):
            raise ObserverError(
                "empty model range or unknown allocation", allocation=r.allocation_index, offset_bytes=r.offset_bytes
            )
        if r.offset_bytes + r.size_bytes > allocations[r.allocation_index].size_bytes:
            raise ObserverError(
                "model range ends beyond its allocation", allocation=r.allocation_index, offset_bytes=r.offset_bytes
            )
        if (r.allocation_index, r.offset_bytes) < previous:
            raise ObserverError(
                "model ranges are not sorted and disjoint", allocation=r.allocation_index, offset_bytes=r.offset_bytes
            )
        previous = (r.allocation_index, r.offset_bytes + r.size_bytes)


def hash_ranges(
    ranges: Sequence[ModelRange], allocations: Sequence[LiveAllocation], backend: CopyBackend, *, threads: int | None = None
) -> list[str]:
    """SHA-256 of each range's bytes, computed on ``threads`` threads (default: usable CPUs)."""

    def digest(r: ModelRange) -> str:
        h = hashlib.sha256()
        for chunk in backend.read_chunks(allocations[r.allocation_index], r.offset_bytes, r.size_bytes):
            h.update(chunk)
        return h.hexdigest()

    workers = threads or max(1, len(os.sched_getaffinity(0)))
    if workers == 1:
        return [digest(r) for r in ranges]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coldsnap-digest") as pool:
        # Largest first for balance, results back in input order.
        order = sorted(range(len(ranges)), key=lambda i: -ranges[i].size_bytes)
        futures = {i: pool.submit(digest, ranges[i]) for i in order}
        return [futures[i].result() for i in range(len(ranges))]


def capture_worker(
    *,
    allocation_map: AllocationMap,
    allocations: Sequence[LiveAllocation],
    model_ranges: Sequence[ModelRange],
    worker: WorkerIdentity,
    capture_point: CapturePoint,
    model: ModelIdentity,
    cache: PayloadCache,
    artifact_dir: Path,
    backend: CopyBackend,
) -> CaptureResult:
    """Capture one worker: write its pack (shared), residual blob and manifests (its capsule).

    Args:
        allocation_map: the allocations' layout; ``allocation_map[i].size_bytes`` must equal
            ``allocations[i].size_bytes``.
        allocations: the live allocations, by index.
        model_ranges: the observed model ranges, sorted by (allocation, offset) and disjoint.
        worker: the worker identity (names the capsule).
        capture_point: ``portable`` or ``native``.
        model: the pinned model identity (recovery manifest and descriptor).
        cache: where the pack object goes.
        artifact_dir: the artifact folder (capsule and ``artifact.json``).
        backend: reads the allocations.

    Raises:
        ObserverError: the model ranges are not sorted, disjoint and in bounds, or the allocation
            map disagrees with the live allocations.
        InsufficientSpaceError / CacheError: writing failed (nothing half-written remains).
    """
    started = time.perf_counter()
    if [a.size_bytes for a in allocation_map.allocations] != [a.size_bytes for a in allocations]:
        raise ObserverError("the allocation map's sizes differ from the live allocations'")
    check_model_ranges(model_ranges, allocations)

    digests = hash_ranges(model_ranges, allocations, backend)
    layout = PackLayout.plan((d, r.size_bytes) for d, r in zip(digests, model_ranges, strict=True))
    offsets = layout.offsets()
    locate: dict[tuple[str, int], tuple[LiveAllocation, int]] = {}
    model_extents = []
    for d, r in zip(digests, model_ranges, strict=True):
        key = (d, r.size_bytes)
        locate.setdefault(key, (allocations[r.allocation_index], r.offset_bytes))
        model_extents.append(ModelExtent(r.allocation_index, r.offset_bytes, r.size_bytes, offsets[key], d, r.provenance))
    residual_map = residual_extents(
        [a.size_bytes for a in allocations], ((r.allocation_index, r.offset_bytes, r.size_bytes) for r in model_ranges)
    )

    pack = write_pack(layout, locate, backend, cache)
    fingerprint = allocation_map.layout_fingerprint()

    def fill(staging: Path) -> tuple[NativeManifest, RecoveryManifest]:
        residual = write_residual(residual_map, allocations, backend, staging / RESIDUAL_FILENAME)
        native = NativeManifest(
            capture_point=capture_point,
            worker=worker,
            layout_fingerprint=fingerprint,
            pack=pack,
            residual=residual,
            allocations=allocation_map,
            model_extents=tuple(model_extents),
            residual_extents=residual_map,
        )
        recovery = RecoveryManifest(
            worker=worker,
            layout_fingerprint=fingerprint,
            model=model,
            residual=residual,
            allocations=allocation_map,
            residual_extents=residual_map,
        )
        write_manifests(staging, native, recovery)
        return native, recovery

    capsule_dir, (native, recovery) = write_capsule(artifact_dir, worker, fill)
    register_worker(artifact_dir, model, WorkerEntry(worker, f"{WORKERS_DIRNAME}/{worker.capsule_name}", pack))
    seconds = time.perf_counter() - started
    logger.info(
        "coldsnap: captured %s: %d model bytes in %d extents (pack %s, %d bytes), %d residual bytes, %.2f s",
        worker.capsule_name,
        native.model_bytes,
        len(model_extents),
        pack.sha256,
        pack.size_bytes,
        native.residual_bytes,
        seconds,
    )
    return CaptureResult(native, recovery, capsule_dir, cache.object_path(pack.sha256), seconds)
