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

from coldsnap_core.artifact.capsules import check_artifact_paths, register_worker, write_capsule, write_manifests
from coldsnap_core.artifact.residual import write_residual
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.pack_writer import write_pack
from coldsnap_core.capture.payload_plan import ModelRange, plan_payload
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.errors import ObserverError
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.descriptor import WORKERS_DIRNAME, CapsuleFile, WorkerEntry
from coldsnap_core.format.manifest import (
    RESIDUAL_FILENAME,
    CapturePoint,
    ModelIdentity,
    NativeManifest,
    RecoveryManifest,
    WorkerIdentity,
)
from coldsnap_core.format.target import TargetIdentity
from coldsnap_core.identity.target import collect_target

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CaptureResult:
    """What one worker's capture produced.

    Attributes:
        manifest: the native manifest written to the capsule.
        recovery: the recovery manifest written to the capsule.
        capsule_dir: the unit capsule folder.
        pack_path: the pack object in the node-local cache.
        seconds: wall time of the capture (hashing, pack, blob, manifests, descriptor).
        phase_seconds: wall time of each phase, in order: ``extent_digests`` (SHA-256 of every
            model range, on all usable CPUs), ``pack`` (stream, hash and commit the pack: fsync,
            rename, folder fsync, validation record), ``capsule`` (residual blob and manifests, each
            fsynced) and ``descriptor`` (``artifact.json`` under its lock).
    """

    manifest: NativeManifest
    recovery: RecoveryManifest
    capsule_dir: Path
    pack_path: Path
    seconds: float
    phase_seconds: tuple[tuple[str, float], ...] = ()


def check_model_ranges(ranges: Sequence[ModelRange], allocations: Sequence[LiveAllocation]) -> None:
    """Model ranges must be non-empty, in bounds, sorted by (allocation, offset) and disjoint.

    Anything else is an observer bug, refused before a byte is written.

    Raises:
        ObserverError: names the offending range's allocation and offset.
    """
    previous = (0, 0)
    for i, r in enumerate(ranges):
        if r.size_bytes <= 0 or r.offset_bytes < 0:
            raise ObserverError(
                f"model range {i} has offset {r.offset_bytes} and size {r.size_bytes} bytes; ranges are non-empty and start at >= 0",
                allocation=r.allocation_index,
                offset_bytes=r.offset_bytes,
            )
        if not 0 <= r.allocation_index < len(allocations):
            raise ObserverError(
                f"model range {i} names allocation {r.allocation_index}, but there are {len(allocations)}",
                allocation=r.allocation_index,
                offset_bytes=r.offset_bytes,
            )
        if r.offset_bytes + r.size_bytes > allocations[r.allocation_index].size_bytes:
            raise ObserverError(
                f"model range {i} ends at byte {r.offset_bytes + r.size_bytes}, beyond its allocation's"
                f" {allocations[r.allocation_index].size_bytes} bytes",
                allocation=r.allocation_index,
                offset_bytes=r.offset_bytes,
            )
        if (r.allocation_index, r.offset_bytes) < previous:
            raise ObserverError(
                f"model range {i} starts before the end of model range {i - 1}; ranges must be sorted and disjoint",
                allocation=r.allocation_index,
                offset_bytes=r.offset_bytes,
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
    target: TargetIdentity | None = None,
) -> CaptureResult:
    """Capture one worker: write its pack (shared), residual blob and manifests (its capsule).

    Order: every model range's SHA-256 (on all usable CPUs; the pack order needs them all), then the
    canonical pack into ``cache`` (:func:`coldsnap_core.capture.pack_writer.write_pack`), then the capsule
    (blob and both manifests, each fsynced, renamed into place as a whole), then ``artifact.json``
    with the pins (size and SHA-256) of the capsule's four files (both manifests, ``target.json``, the blob).
    The allocations must not change while this runs (the model is quiescent): their bytes are read
    more than once (extent digests, pack, blob).

    Long: the checks that must all pass before anything is written (the allocation map against the live
    allocations, the capture point's address rule, the model ranges, the artifact paths), then the steps in
    their one order, timed as the phases the outcome line reports (extent digests, pack, capsule, descriptor).

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
        target: the target the capture runs on, recorded as the capsule's ``target.json``
            (the engine plugins pass theirs); default: :func:`coldsnap_core.identity.target.collect_target`
            without an engine, on the CPU.

    Returns:
        The manifests written, the capsule folder, the pack's object path, and the wall time of the
        capture and of each phase.

    Raises:
        ObserverError: the model ranges are not sorted, disjoint, non-empty and in bounds, the
            allocation map disagrees with the live allocations (count, index or size), or its
            addresses do not fit the capture point (``native``: every allocation has one;
            ``portable``: none has); raised before anything is written.
        UnsafePathError: a symbolic link at the artifact's descriptor lock, ``workers/`` or the
            capsule's lock (rule ``no-symlinks``); raised before anything is written.

    A capture whose model bytes are less than half the allocation bytes logs a WARNING naming the
    likely cause (:func:`warn_if_few_model_bytes`).
        InsufficientSpaceError / CacheError: writing failed (nothing half-written remains: the pack
            is committed only once complete, the capsule only as a whole).
    """
    started = time.perf_counter()
    if len(allocation_map) != len(allocations):
        raise ObserverError(f"the allocation map has {len(allocation_map)} allocations, the live model {len(allocations)}")
    for recorded, live in zip(allocation_map.allocations, allocations, strict=True):
        if live.index != recorded.index or live.size_bytes != recorded.size_bytes:
            raise ObserverError(
                f"live allocation {live.index} ({live.size_bytes} bytes) is not allocation {recorded.index}"
                f" of the allocation map ({recorded.size_bytes} bytes)",
                allocation=recorded.index,
            )
    for recorded in allocation_map.allocations:
        if (recorded.address is None) == (capture_point == "native"):
            rule = "the address of every allocation" if capture_point == "native" else "no addresses (null)"
            raise ObserverError(
                f"allocation {recorded.index} has address {recorded.address}; the {capture_point} capture point records {rule}",
                allocation=recorded.index,
            )
    check_model_ranges(model_ranges, allocations)
    check_artifact_paths(artifact_dir, worker)  # a link at a lock path is refused before anything is written
    target = target if target is not None else collect_target()

    digests = hash_ranges(model_ranges, allocations, backend)
    hashed = time.perf_counter()
    plan = plan_payload(allocations, model_ranges, digests)

    pack = write_pack(plan.layout, plan.locate, backend, cache)
    packed = time.perf_counter()

    def fill(staging: Path) -> tuple[NativeManifest, RecoveryManifest, tuple[CapsuleFile, ...]]:
        residual = write_residual(plan.residual_extents, allocations, backend, staging / RESIDUAL_FILENAME)
        native = plan.native_manifest(
            capture_point=capture_point, worker=worker, allocations=allocation_map, pack=pack, residual=residual
        )
        recovery = plan.recovery_manifest(worker=worker, allocations=allocation_map, model=model, residual=residual)
        pins = write_manifests(staging, native, recovery, target)
        return native, recovery, pins

    capsule_dir, (native, recovery, pins) = write_capsule(artifact_dir, worker, fill)
    written = time.perf_counter()
    register_worker(artifact_dir, model, WorkerEntry(worker, f"{WORKERS_DIRNAME}/{worker.capsule_name}", pack, pins))
    finished = time.perf_counter()
    seconds = finished - started
    phases = (
        ("extent_digests", hashed - started),
        ("pack", packed - hashed),
        ("capsule", written - packed),
        ("descriptor", finished - written),
    )
    logger.info(
        "coldsnap: captured %s: %d model bytes in %d extents (pack %s, %d bytes), %d residual bytes, %.2f s",
        worker.capsule_name,
        native.model_bytes,
        len(plan.model_extents),
        pack.sha256,
        pack.size_bytes,
        native.residual_bytes,
        seconds,
    )
    warn_if_few_model_bytes(native, worker)
    return CaptureResult(native, recovery, capsule_dir, cache.object_path(pack.sha256), seconds, phases)


LOW_MODEL_BYTES_FRACTION = 0.5
"""Below this fraction of model bytes among the allocation bytes, capture logs a WARNING: most of the
weights then live in the worker's residual blob, which is neither shared nor content addressed."""


def warn_if_few_model_bytes(manifest: NativeManifest, worker: WorkerIdentity) -> bool:
    """Log a WARNING (and return ``True``) when the model bytes are less than
    :data:`LOW_MODEL_BYTES_FRACTION` of the allocation bytes, naming the likely cause."""
    total = manifest.allocations.total_bytes
    if total == 0 or manifest.model_bytes >= LOW_MODEL_BYTES_FRACTION * total:
        return False
    logger.warning(
        "coldsnap: %s: only %d of %d allocation bytes (%.1f%%) are model bytes; the rest (%d bytes) went into the"
        " residual blob, which is this worker's own and not shared. Likely cause: the engine converted the"
        " checkpoint's dtype while loading (e.g. --dtype float32 for a bfloat16 checkpoint) with the loader's"
        " extra-config key converted_copies=residual set (remove it to share converted copies), or the model"
        " rewrites its weights after copying them",
        worker.capsule_name,
        manifest.model_bytes,
        total,
        100 * manifest.model_bytes / total,
        total - manifest.model_bytes,
    )
    return True
