"""The payload planner: from model ranges and their digests to the pack layout, both extent maps and
the native manifest.

One function plans every payload coldsnap writes: the capture at load (:mod:`coldsnap_core.capture.worker`),
the native capture at a level-1 sleep (``coldsnap_vllm.sleep_capture``) and the pack rebuilt from
resident bytes after a recovery load (:mod:`coldsnap_core.capture.materialize`). All three therefore agree on

* the canonical pack layout of the distinct ``(sha256, size_bytes)`` contents (``docs/format.md``,
  "Pack layout": sorted, each content once, 4096-byte aligned, zero padded);
* where the pack writer reads each content from: the first model range with that content, in
  (allocation, offset) order;
* the model extents (each range with its pack offset) and the residual extents (the complement of
  the model ranges over every allocation, back to back in the blob: ``docs/format.md``,
  "Residual blob").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coldsnap_core.artifact.residual import residual_extents
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
from coldsnap_core.format.extents import ExtentProvenance, ModelExtent, ResidualExtent
from coldsnap_core.format.manifest import (
    CapturePoint,
    ModelIdentity,
    NativeManifest,
    PackRef,
    RecoveryManifest,
    ResidualRef,
    WorkerIdentity,
)
from coldsnap_core.format.pack_layout import PackLayout

__all__ = ["ModelRange", "PayloadPlan", "plan_manifest_payload", "plan_payload"]


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
class PayloadPlan:
    """Everything about a worker's payload that follows from its model ranges and their digests.

    Attributes:
        layout: the canonical pack layout of the distinct contents.
        locate: ``(sha256, size_bytes) -> (allocation, offset_bytes)``: where the pack writer reads
            each stored content (the first range holding it).
        model_extents: one per model range, in range order, with its pack offset.
        residual_extents: the complement of the model ranges over the allocations, with blob offsets.
    """

    layout: PackLayout
    locate: Mapping[tuple[str, int], tuple[LiveAllocation, int]]
    model_extents: tuple[ModelExtent, ...]
    residual_extents: tuple[ResidualExtent, ...]

    def native_manifest(
        self,
        *,
        capture_point: CapturePoint,
        worker: WorkerIdentity,
        allocations: AllocationMap,
        pack: PackRef,
        residual: ResidualRef,
    ) -> NativeManifest:
        """The native manifest of this plan (``docs/format.md``, "Native manifest"); the layout
        fingerprint is ``allocations.layout_fingerprint()``."""
        return NativeManifest(
            capture_point=capture_point,
            worker=worker,
            layout_fingerprint=allocations.layout_fingerprint(),
            pack=pack,
            residual=residual,
            allocations=allocations,
            model_extents=self.model_extents,
            residual_extents=self.residual_extents,
        )

    def recovery_manifest(
        self, *, worker: WorkerIdentity, allocations: AllocationMap, model: ModelIdentity, residual: ResidualRef
    ) -> RecoveryManifest:
        """The recovery manifest of this plan (``docs/format.md``, "Recovery manifest")."""
        return RecoveryManifest(
            worker=worker,
            layout_fingerprint=allocations.layout_fingerprint(),
            model=model,
            residual=residual,
            allocations=allocations,
            residual_extents=self.residual_extents,
        )


def plan_payload(
    allocations: Sequence[LiveAllocation], model_ranges: Sequence[ModelRange], digests: Sequence[str]
) -> PayloadPlan:
    """Plan the payload of ``model_ranges`` (sorted by (allocation, offset), disjoint, in bounds:
    :func:`coldsnap_core.capture.worker.check_model_ranges`) whose SHA-256 are ``digests`` (same order).

    Args:
        allocations: the live allocations, ``allocations[i].index == i``.
        model_ranges: the model ranges.
        digests: hex SHA-256 of each range's bytes.

    Raises:
        ValueError: ``digests`` and ``model_ranges`` differ in length, or a range is empty.
    """
    contents = [(d, r.size_bytes) for d, r in zip(digests, model_ranges, strict=True)]
    layout = PackLayout.plan(contents)
    offsets = layout.offsets()
    locate: dict[tuple[str, int], tuple[LiveAllocation, int]] = {}
    model_extents = []
    for key, r in zip(contents, model_ranges, strict=True):
        locate.setdefault(key, (allocations[r.allocation_index], r.offset_bytes))
        model_extents.append(ModelExtent(r.allocation_index, r.offset_bytes, r.size_bytes, offsets[key], key[0], r.provenance))
    residual_map = residual_extents(
        [a.size_bytes for a in allocations], ((r.allocation_index, r.offset_bytes, r.size_bytes) for r in model_ranges)
    )
    return PayloadPlan(layout, locate, tuple(model_extents), residual_map)


def plan_manifest_payload(manifest: NativeManifest, allocations: Sequence[LiveAllocation]) -> PayloadPlan:
    """Re-plan the payload a (verified) native manifest describes, reading from ``allocations``.

    The manifest must have passed :func:`coldsnap_core.format.verify.check_manifest` and its allocations
    :func:`coldsnap_core.format.verify.check_live_layout`; the plan then equals the manifest's own maps.
    """
    ranges = [ModelRange(e.allocation_index, e.offset_bytes, e.size_bytes, e.provenance) for e in manifest.model_extents]
    return plan_payload(allocations, ranges, [e.sha256 for e in manifest.model_extents])
