"""The native capture at a level-1 sleep, over vLLM's CuMem weights segments.

The segments are the allocations (vLLM ``device_allocator/cumem.py``: buffers and post-processed weights
live in the "weights" segments too, so the residual is mandatory at level 1), and the loader's observed
model writes are located in them (:func:`coldsnap_vllm.cumem.map_writes`); the engine-neutral capture
(:func:`coldsnap_core.capture.sleep.capture_native`) does the rest.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.artifact.sleep_capsules import sleep_capsule_dir
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.sleep import NativeCapture, ReferenceDigests, capture_native
from coldsnap_core.copy.base import CopyBackend
from coldsnap_vllm.cumem import WeightsSegment, live_allocations, map_writes, native_allocation_map
from coldsnap_vllm.state import WorkerLoadState

logger = logging.getLogger(__name__)

__all__ = ["SleepCapture", "capture_for_sleep"]


@dataclass(frozen=True, slots=True)
class SleepCapture(NativeCapture):
    """What a level-1 sleep captured (:class:`~coldsnap_core.capture.sleep.NativeCapture`), with the weights
    segments, by allocation index, that a wake maps again and fills."""

    segments: tuple[WeightsSegment, ...] = ()


def capture_for_sleep(
    state: WorkerLoadState,
    segments: Sequence[WeightsSegment],
    backend: CopyBackend,
    references: ReferenceDigests,
    *,
    capsule_dir: Path | None = None,
) -> SleepCapture:
    """Capture the live weights segments into pack + sleep capsule.

    Args:
        state: the loader's published state (worker, writes, model identity, state root).
        segments: the awake weights segments, sorted by address.
        backend: reads the segments (device-to-host on CUDA).
        references: the writes' reference digests (keep one per loaded model; it caches).
        capsule_dir: where the capsule goes: the folder of the caller's
            :class:`~coldsnap_core.artifact.sleep_capsules.SleepCapsuleClaim` (default
            :func:`~coldsnap_core.artifact.sleep_capsules.sleep_capsule_dir`, an unclaimed name, for tools and tests).

    Returns:
        The :class:`SleepCapture`; nothing has been released yet.

    Raises:
        ObserverError: a write straddles a segment end or writes overlap (nothing written); else see
            :func:`~coldsnap_core.capture.sleep.capture_native`.
    """
    captured = capture_native(
        native_allocation_map(segments),
        live_allocations(segments),
        backend,
        map_writes(state.writes, segments).ranges,
        references,
        worker=state.worker,
        model=state.model,
        cache=PayloadCache(state.state_root, lock_timeout_seconds=state.lock_timeout_s),
        capsule_dir=capsule_dir or sleep_capsule_dir(state.state_root, state.worker),
        log=logger,
    )
    fields = {f.name: getattr(captured, f.name) for f in dataclasses.fields(captured)}
    return SleepCapture(**fields, segments=tuple(segments))
