"""vLLM's CuMem "weights" segments as coldsnap allocations (the native capture point).

With ``--enable-sleep-mode`` every tensor ``load_model`` creates lives in a segment of vLLM's
``CuMemAllocator`` tagged ``"weights"``. The allocator's ``pointer_to_data: dict[int,
AllocationData]`` is keyed by the segment's base virtual address; ``AllocationData.handle`` is
``(device, aligned_size_bytes, base_address, physical_handle)`` and ``AllocationData.tag`` the tag
(``vllm/device_allocator/__init__.py``, ``cumem.py``). A sleep releases the physical memory and keeps the virtual range; a wake maps new physical
memory at the same address, so the native allocation map records the captured addresses.

This module turns that dictionary into :class:`WeightsSegment` values (sorted by address), maps the
loader's observed model writes (absolute addresses, :class:`coldsnap_vllm.state.ObservedModelWrite`)
onto ``(segment index, offset)`` by bisection, and builds the native allocation map.
"""

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
from coldsnap_vllm.state import ObservedModelWrite

logger = logging.getLogger(__name__)

WEIGHTS_TAG = "weights"
"""The CuMem tag of every allocation made while vLLM loads the model (``gpu_worker.py``)."""


@dataclass(frozen=True, slots=True)
class WeightsSegment:
    """One CuMem segment tagged ``weights``.

    Attributes:
        index: position in address order (the allocation index of the native allocation map).
        address: the segment's base virtual address (its ``pointer_to_data`` key).
        size_bytes: the segment's size, ``handle[1]`` (rounded up to the allocation granularity,
            2 MiB on current GPUs, by ``cumem_allocator.cpp``).
        device: the CUDA device ordinal, ``handle[0]``.
    """

    index: int
    address: int
    size_bytes: int
    device: int

    @property
    def end(self) -> int:
        return self.address + self.size_bytes


def weights_segments(pointer_to_data: Mapping[int, Any], *, tag: str = WEIGHTS_TAG) -> tuple[WeightsSegment, ...]:
    """The allocator's segments with ``tag``, sorted by address (asleep or not).

    Args:
        pointer_to_data: ``CuMemAllocator.pointer_to_data`` (values with ``handle`` and ``tag``).
        tag: the tag to select.

    Raises:
        ObserverError: a handle disagrees with its key, a size is not positive, or two segments
            overlap (the dictionary is not what vLLM's allocator produces).
    """
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
    """The native allocation map: one allocation per segment, tag ``weights``, the captured address,
    the segment's size. The segments host tensors the backend cannot name (it has no model handle),
    so ``tensors`` is empty and the layout fingerprint covers sizes and tags."""
    return AllocationMap(tuple(Allocation(s.index, s.size_bytes, WEIGHTS_TAG, s.address, ()) for s in segments))


@dataclass(frozen=True, slots=True)
class MappedWrites:
    """The observed model writes, located in the weights segments.

    Attributes:
        ranges: the writes that lie in a live segment, as ``(allocation index, offset)`` ranges,
            sorted and disjoint.
        dropped: writes whose address is in no weights segment any more (post-processing replaced
            the parameter and the allocator released its segment); their bytes are not preserved
            by the sleep, so they are no model extent.
    """

    ranges: tuple[ModelRange, ...]
    dropped: tuple[ObservedModelWrite, ...]


def map_writes(writes: Iterable[ObservedModelWrite], segments: Sequence[WeightsSegment]) -> MappedWrites:
    """Locate each write in the segment that contains its first byte (bisection on base addresses).

    Raises:
        ObserverError: a write is empty, starts in a segment and ends beyond it (names the segment
            and the offset), or two writes overlap.
    """
    starts = [s.address for s in segments]
    ranges: list[ModelRange] = []
    dropped: list[ObservedModelWrite] = []
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
