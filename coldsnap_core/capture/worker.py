"""The capture of a worker into an artifact: its pack in the node-local cache, its unit capsule (residual
blob, both manifests, ``target.json``) in the artifact folder, its entry in ``artifact.json``.

Engine integrations (the loaders' write observer) decide *which* bytes are model bytes; the capture core
(:mod:`coldsnap_core.capture.payload`) checks, hashes and plans them, writes the pack through the canonical
writer and the capsule's files. Here: the capsule is renamed into place as a whole under its lock
(:func:`coldsnap_core.artifact.capsules.write_capsule`) and the worker is registered in ``artifact.json``
with the pins of its files.
"""

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

    In order: every check (the capture point's address rule, the artifact paths, then
    :func:`coldsnap_core.capture.payload.plan_payload`'s), every model range's SHA-256, the canonical pack
    into ``cache``, the capsule (blob, both manifests and ``target.json``, renamed into place as a whole),
    then ``artifact.json`` with the pins of the capsule's four files; each step is a phase of
    :attr:`CaptureResult.phase_seconds`. A capture whose model bytes are less than half the allocation
    bytes logs a WARNING naming the likely cause (:func:`warn_if_few_model_bytes`).

    Args:
        allocation_map, allocations, model_ranges, backend: the quiescent model, as
            :func:`~coldsnap_core.capture.payload.plan_payload` takes it.
        worker: the worker identity (names the capsule).
        capture_point: ``portable`` (no allocation has an address) or ``native`` (every one has).
        model: the pinned model identity (recovery manifest and descriptor).
        cache: where the pack object goes.
        artifact_dir: the artifact folder (capsule and ``artifact.json``).
        target: the target the capture runs on, recorded as the capsule's ``target.json`` (the engine
            plugins pass theirs); default: :func:`coldsnap_core.identity.target.collect_target` without an
            engine, on the CPU.

    Raises:
        ObserverError: the allocation map's addresses do not fit the capture point, or see
            :func:`~coldsnap_core.capture.payload.plan_payload`; raised before anything is written.
        UnsafePathError: a symbolic link at the artifact's descriptor lock, ``workers/`` or the
            capsule's lock (rule ``no-symlinks``); raised before anything is written.
        InsufficientSpaceError / CacheError: writing failed (nothing half-written remains: the pack
            is committed only once complete, the capsule only as a whole).
    """
    started = time.perf_counter()
    _check_addresses(allocation_map, capture_point)
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
    phases = (  # each step's wall time: the outcome line's phases
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


def _check_addresses(allocation_map: AllocationMap, capture_point: CapturePoint) -> None:
    """The native capture point records the address of every allocation, the portable one none.

    Raises:
        ObserverError: names the first allocation that breaks the rule.
    """
    for recorded in allocation_map.allocations:
        if (recorded.address is None) == (capture_point == "native"):
            rule = "the address of every allocation" if capture_point == "native" else "no addresses (null)"
            raise ObserverError(
                f"allocation {recorded.index} has address {recorded.address}; the {capture_point} capture point records {rule}",
                allocation=recorded.index,
            )


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
    """The portable capture of a worker an engine plugin just loaded under the write observer (every plugin,
    on ``COLDSNAP_EXPORT_MODEL_PAYLOAD=1``): :func:`capture_worker` of ``allocations`` (after the checkpoint
    load, before any post-processing) with the copy backend of their device and the target identity of
    this worker with ``engine`` (``vllm``, ``sglang``) and ``engine_version`` as its engine (``target.json``,
    ``docs/format.md`` §15.1: a restore by another engine refuses the capsule by name, one by the same engine
    qualifies it).

    An artifact that already holds this worker's capsule is captured again, with a WARNING naming the export flag:
    left on, it makes every start load the checkpoint and capture instead of restoring.

    Raises:
        ColdsnapError: see :func:`capture_worker`.
    """
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
    """The capture's INFO line, and the WARNING of :func:`warn_if_few_model_bytes`."""
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
    warn_if_few_model_bytes(native, worker)


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
