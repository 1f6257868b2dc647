"""vLLM's CuMem "weights" segments as coldsnap allocations (the native capture point): with ``--enable-sleep-mode``
every tensor ``load_model`` creates lives in a ``CuMemAllocator`` segment tagged ``"weights"``; ``pointer_to_data`` is
keyed by the segment's base address and ``AllocationData.handle`` is ``(device, aligned_size_bytes, base_address,
physical_handle)`` (``vllm/device_allocator/cumem.py``). A wake maps new memory at the same address, so the native
allocation map records the captured addresses."""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coldsnap_core.capture.payload import ModelRange, check_model_ranges
from coldsnap_core.errors import ObserverError
from coldsnap_core.format.allocation import Allocation, AllocationMap, LiveAllocation
from coldsnap_core.load_policy import ModelWrite

logger = logging.getLogger(__name__)

WEIGHTS_TAG = "weights"
"""The CuMem tag of every allocation made while vLLM loads the model (``gpu_worker.py``)."""


@dataclass(frozen=True, slots=True)
class WeightsSegment:
    """One CuMem segment tagged ``weights``: ``index`` in address order (its allocation index), base ``address``,
    ``size_bytes`` (``handle[1]``, a multiple of the allocation granularity), CUDA ``device`` (``handle[0]``)."""

    index: int
    address: int
    size_bytes: int
    device: int

    @property
    def end(self) -> int:
        return self.address + self.size_bytes


def weights_segments(pointer_to_data: Mapping[int, Any], *, tag: str = WEIGHTS_TAG) -> tuple[WeightsSegment, ...]:
    """The segments of ``CuMemAllocator.pointer_to_data`` with ``tag``, sorted by address (asleep or not); raises
    ``ObserverError`` where a handle disagrees with its key, a size is not positive, or two segments overlap."""
    found = []
    for address, data in pointer_to_data.items():
        if data.tag != tag:
            continue
        device, size_bytes, base = int(data.handle[0]), int(data.handle[1]), int(data.handle[2])
        if base != address:
            raise ObserverError(f"CuMem segment keyed {address:#x} has handle address {base:#x}")
        if size_bytes <= 0:
            raise ObserverError(f"CuMem segment at {address:#x} has size {size_bytes}")
        found.append((address, size_bytes, device))
    found.sort()
    segments = tuple(WeightsSegment(i, a, s, d) for i, (a, s, d) in enumerate(found))
    for previous, segment in itertools.pairwise(segments):
        if segment.address < previous.end:
            raise ObserverError(
                f"CuMem {tag} segments at {previous.address:#x} ({previous.size_bytes} bytes) and {segment.address:#x} overlap",
                allocation=segment.index,
            )
    return segments


def live_allocations(segments: Sequence[WeightsSegment]) -> list[LiveAllocation]:
    """The segments as copy-backend allocations (index, device address, size)."""
    return [LiveAllocation(s.index, s.address, s.size_bytes) for s in segments]


def native_allocation_map(segments: Sequence[WeightsSegment]) -> AllocationMap:
    """One allocation per segment (tag ``weights``, address, size), no ``tensors``: the fingerprint covers sizes and tags."""
    return AllocationMap(tuple(Allocation(s.index, s.size_bytes, WEIGHTS_TAG, s.address, ()) for s in segments))


@dataclass(frozen=True, slots=True)
class MappedWrites:
    """The observed model writes in live segments as ``ranges`` (sorted, disjoint), and those in no weights segment
    any more (``dropped``: post-processing replaced the parameter; no model extent)."""

    ranges: tuple[ModelRange, ...]
    dropped: tuple[ModelWrite, ...]


def map_writes(writes: Iterable[ModelWrite], segments: Sequence[WeightsSegment]) -> MappedWrites:
    """Each write in the segment holding its first byte; ObserverError: an empty, straddling or overlapping write."""
    starts = [s.address for s in segments]
    ranges: list[ModelRange] = []
    dropped: list[ModelWrite] = []
    for write in sorted(writes, key=lambda w: w.address):
        if write.size_bytes <= 0:
            raise ObserverError(f"model write at {write.address:#x} ({write.provenance.tensor_name}) is empty")
        i = bisect.bisect_right(starts, write.address) - 1
        if i < 0 or write.address >= segments[i].end:
            dropped.append(write)
            continue
        segment = segments[i]
        offset = write.address - segment.address
        if write.address + write.size_bytes > segment.end:
            raise ObserverError(
                f"model write of {write.provenance.tensor_name} at {write.address:#x} ({write.size_bytes} bytes) ends"
                f" {write.address + write.size_bytes - segment.end} bytes beyond weights segment {i} at {segment.address:#x}",
                allocation=i,
                offset_bytes=offset,
            )
        ranges.append(ModelRange(i, offset, write.size_bytes, write.provenance))
    check_model_ranges(ranges, live_allocations(segments))
    if dropped:
        logger.info(
            "coldsnap: %d model writes (%d bytes) lie in no live weights segment any more; they are not model extents",
            len(dropped),
            sum(w.size_bytes for w in dropped),
        )
    return MappedWrites(tuple(ranges), tuple(dropped))
