"""The capture of a worker into an artifact: its pack in the node-local cache, its capsule renamed into place as a
whole, and its entry in ``artifact.json`` with the pins of its files (``docs/format.md`` §4, §5)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.artifact.capsules import check_artifact_paths, register_worker, write_capsule
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.payload import ModelRange, plan_payload
from coldsnap_core.copy.base import CopyBackend
from coldsnap_core.copy.select import copy_backend_for
from coldsnap_core.copy.torch_allocations import TorchAllocations
from coldsnap_core.errors import ObserverError
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.descriptor import WORKERS_DIRNAME, WorkerEntry
from coldsnap_core.format.manifest import CapturePoint, ModelIdentity, NativeManifest, RecoveryManifest, WorkerIdentity
from coldsnap_core.format.target import TargetIdentity
from coldsnap_core.identity.target import collect_target

logger = logging.getLogger(__name__)

LOW_MODEL_BYTES_FRACTION = 0.5
"""Below this fraction of model bytes among the allocation bytes, capture logs a WARNING."""


@dataclass(frozen=True, slots=True)
class CaptureResult:
    """What one worker's capture produced; ``phase_seconds``: the wall time of each step, in order."""

    manifest: NativeManifest
    recovery: RecoveryManifest
    capsule_dir: Path
    pack_path: Path
    seconds: float
    phase_seconds: tuple[tuple[str, float], ...] = ()


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
    """Capture one worker (all checks first): its pack into ``cache``, its capsule and ``artifact.json`` entry into
    ``artifact_dir``; ``target`` defaults to :func:`collect_target` without an engine.

    Raises:
        ObserverError: the addresses do not fit ``capture_point``, or see :func:`plan_payload` (nothing written).
        UnsafePathError: a symbolic link at an artifact lock path or ``workers/`` (rule ``no-symlinks``; nothing written).
        InsufficientSpaceError / CacheError: writing failed (nothing half-written remains).
    """
    started = time.perf_counter()
    for recorded in allocation_map.allocations:  # an address at the portable capture point, or none at the native
        if (recorded.address is None) == (capture_point == "native"):
            rule = "the address of every allocation" if capture_point == "native" else "no addresses (null)"
            raise ObserverError(
                f"allocation {recorded.index} has address {recorded.address}; the {capture_point} capture point records {rule}",
                allocation=recorded.index,
            )
    check_artifact_paths(artifact_dir, worker)  # a link at a lock path is refused before anything is written
    target = target if target is not None else collect_target()
    plan = plan_payload(allocation_map, allocations, backend, model_ranges)
    hashed = time.perf_counter()
    pack, _ = plan.ensure_pack(cache)
    packed = time.perf_counter()
    fill = functools.partial(
        plan.write_capsule_files, capture_point=capture_point, worker=worker, pack=pack, model=model, target=target
    )
    capsule_dir, staged = write_capsule(artifact_dir, worker, fill)
    written = time.perf_counter()
    entry = WorkerEntry(worker, f"{WORKERS_DIRNAME}/{worker.capsule_name}", pack, staged.pins)
    register_worker(artifact_dir, model, entry)
    finished = time.perf_counter()
    phases = (
        ("extent_digests", hashed - started),
        ("pack", packed - hashed),
        ("capsule", written - packed),
        ("descriptor", finished - written),
    )
    result = CaptureResult(
        staged.native, staged.recovery, capsule_dir, cache.object_path(pack.sha256), finished - started, phases
    )
    _log_captured(result, worker)
    return result


def capture_loaded_worker(
    allocations: TorchAllocations,
    model_ranges: Sequence[ModelRange],
    worker: WorkerIdentity,
    model: ModelIdentity,
    *,
    cache: PayloadCache,
    artifact_dir: Path,
    engine: str,
    engine_version: str | None,
) -> CaptureResult:
    """The portable :func:`capture_worker` of a worker an engine plugin just loaded; a WARNING when it replaces a capsule."""
    existing = artifact_dir / WORKERS_DIRNAME / worker.capsule_name
    if existing.is_dir():
        logger.warning(
            "coldsnap: COLDSNAP_EXPORT_MODEL_PAYLOAD=1 and %s already holds %s: this start loaded the checkpoint and"
            " captures it again instead of restoring from the artifact; remedy: unset COLDSNAP_EXPORT_MODEL_PAYLOAD"
            " after the export (left on, every start exports)",
            artifact_dir,
            worker.capsule_name,
        )
    return capture_worker(
        allocation_map=allocations.allocation_map,
        allocations=allocations.live,
        model_ranges=model_ranges,
        worker=worker,
        capture_point="portable",
        model=model,
        cache=cache,
        artifact_dir=artifact_dir,
        backend=copy_backend_for(allocations.device),
        target=collect_target(engine, engine_version, device=allocations.device),
    )


def _log_captured(result: CaptureResult, worker: WorkerIdentity) -> None:
    """The capture's INFO line, and a WARNING naming the likely cause when the model bytes are few."""
    native = result.manifest
    logger.info(
        "coldsnap: captured %s: %d model bytes in %d extents (pack %s, %d bytes), %d residual bytes, %.2f s",
        worker.capsule_name,
        native.model_bytes,
        len(native.model_extents),
        native.pack.sha256,
        native.pack.size_bytes,
        native.residual_bytes,
        result.seconds,
    )
    total = native.allocations.total_bytes
    if total == 0 or native.model_bytes >= LOW_MODEL_BYTES_FRACTION * total:
        return
    logger.warning(
        "coldsnap: %s: only %d of %d allocation bytes (%.1f%%) are model bytes; the rest (%d bytes) went into the"
        " residual blob, which is this worker's own and not shared. Likely cause: the engine converted the"
        " checkpoint's dtype while loading (e.g. --dtype float32 for a bfloat16 checkpoint) with the loader's"
        " extra-config key converted_copies=residual set (remove it to share converted copies), or the model"
        " rewrites its weights after copying them",
        worker.capsule_name,
        native.model_bytes,
        total,
        100 * native.model_bytes / total,
        total - native.model_bytes,
    )
