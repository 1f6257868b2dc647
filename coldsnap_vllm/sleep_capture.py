"""The native capture at a level-1 sleep, over vLLM's CuMem weights segments: the segments are the allocations
(buffers and post-processed weights live there too, so the residual is mandatory at level 1)."""

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
    """Capture the live weights segments (sorted by address) into pack + sleep capsule; nothing is released.

    ``references`` caches (keep one per loaded model); ``capsule_dir`` defaults to an unclaimed
    :func:`~coldsnap_core.artifact.sleep_capsules.sleep_capsule_dir` (for tools and tests).

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
