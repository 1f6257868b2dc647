"""CuMem "weights" segments as native allocations, and observed writes located in them."""

from __future__ import annotations

import pytest
from sleep_fakes import AllocationData

from coldsnap_core.errors import ObserverError
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.load_policy import ModelWrite as ObservedModelWrite
from coldsnap_vllm.cumem import WeightsSegment, map_writes, native_allocation_map, weights_segments

MiB = 1 << 20


def data(address: int, size: int, tag: str = "weights", device: int = 0) -> AllocationData:
    return AllocationData((device, size, address, 1), tag)


def write(address: int, size: int, name: str = "t") -> ObservedModelWrite:
    return ObservedModelWrite(address, size, ExtentProvenance("model.safetensors", name, 0, size, size, size, False))


SEGMENTS = (WeightsSegment(0, 0x7000_0000, 4 * MiB, 0), WeightsSegment(1, 0x7080_0000, 2 * MiB, 0))


def test_segments_are_the_weights_tag_sorted_by_address() -> None:
    """Only "weights" segments, in address order, index = position, size = handle[1], device =
    handle[0]. Fails if another tag leaks in or the order follows dict insertion."""
    table = {
        0x9000_0000: data(0x9000_0000, 2 * MiB, device=3),
        0x8000_0000: data(0x8000_0000, 2 * MiB, "kv_cache"),
        0x7000_0000: data(0x7000_0000, 6 * MiB, device=3),
    }
    assert weights_segments(table) == (WeightsSegment(0, 0x7000_0000, 6 * MiB, 3), WeightsSegment(1, 0x9000_0000, 2 * MiB, 3))


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ({0x7000_0000: data(0x7100_0000, 2 * MiB)}, "has handle address"),
        ({0x7000_0000: data(0x7000_0000, 0)}, "has size 0"),
        ({0x7000_0000: data(0x7000_0000, 4 * MiB), 0x7020_0000: data(0x7020_0000, 2 * MiB)}, "overlap"),
    ],
)
def test_inconsistent_allocator_tables_are_refused(table: dict[int, AllocationData], match: str) -> None:
    """A table vLLM's allocator cannot produce (key/handle mismatch, empty or overlapping segments)
    is an ObserverError, never silently mapped."""
    with pytest.raises(ObserverError, match=match):
        weights_segments(table)


def test_writes_are_located_by_bisection() -> None:
    """Writes at a segment's first and last bytes land in that segment at the right offsets. Fails
    on an off-by-one in the bisection (a write at a base address assigned to the previous segment)."""
    mapped = map_writes([write(0x7080_0000, 16), write(0x7000_0000 + 4 * MiB - 8, 8), write(0x7000_0000, 4096)], SEGMENTS)
    assert [(r.allocation_index, r.offset_bytes, r.size_bytes) for r in mapped.ranges] == [
        (0, 0, 4096),
        (0, 4 * MiB - 8, 8),
        (1, 0, 16),
    ]
    assert mapped.dropped == ()


def test_writes_outside_every_live_segment_are_dropped() -> None:
    """A write into a gap between segments, before the first or after the last (its segment was
    released after post-processing replaced the parameter) is not a model extent."""
    gap = write(0x7000_0000 + 4 * MiB, 64)
    before = write(0x1000, 64)
    after = write(0x7080_0000 + 2 * MiB, 64)
    mapped = map_writes([gap, before, after, write(0x7000_0100, 64)], SEGMENTS)
    assert mapped.dropped == (before, gap, after)
    assert [(r.allocation_index, r.offset_bytes) for r in mapped.ranges] == [(0, 0x100)]


def test_a_write_past_its_segment_end_is_an_observer_error() -> None:
    """Naming the segment and the offset. Fails if the write is silently clipped."""
    with pytest.raises(ObserverError, match="ends 8 bytes beyond weights segment 1") as raised:
        map_writes([write(0x7080_0000 + 2 * MiB - 8, 16, "w")], SEGMENTS)
    assert (raised.value.allocation, raised.value.offset_bytes) == (1, 2 * MiB - 8)


@pytest.mark.parametrize(
    ("writes", "match"),
    [
        ([write(0x7000_0000, 64), write(0x7000_0020, 64)], "starts before the end of model range 0"),
        ([write(0x7000_0000, 0)], "is empty"),
    ],
)
def test_overlapping_or_empty_writes_are_observer_errors(writes: list[ObservedModelWrite], match: str) -> None:
    with pytest.raises(ObserverError, match=match):
        map_writes(writes, SEGMENTS)


def test_native_allocation_map_records_captured_addresses_and_sizes() -> None:
    """One allocation per segment: tag weights, the captured address, size handle[1]. The layout
    fingerprint ignores the addresses (golden digest) and changes with a size."""
    allocation_map = native_allocation_map(SEGMENTS)
    assert [(a.index, a.address, a.size_bytes, a.tag, a.tensors) for a in allocation_map.allocations] == [
        (0, 0x7000_0000, 4 * MiB, "weights", ()),
        (1, 0x7080_0000, 2 * MiB, "weights", ()),
    ]
    moved = native_allocation_map([WeightsSegment(0, 0x1_0000_0000, 4 * MiB, 0), WeightsSegment(1, 0x2_0000_0000, 2 * MiB, 0)])
    assert moved.layout_fingerprint() == allocation_map.layout_fingerprint() == GOLDEN_FINGERPRINT
    resized = native_allocation_map([SEGMENTS[0], WeightsSegment(1, 0x7080_0000, 4 * MiB, 0)])
    assert resized.layout_fingerprint() != allocation_map.layout_fingerprint()


GOLDEN_FINGERPRINT = "3c075662baae32cfeaca07303556438d029d52a2b1aabeaf97fc703db88a7fdc"
"""Golden: the layout fingerprint of two weights segments of 4 MiB and 2 MiB (addresses excluded)."""
