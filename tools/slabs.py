"""Engine-free staging of a safetensors checkpoint into allocate-once host slabs (tests and benchmarks).

Not part of the shipped package (it needs numpy, which the product does not): the tests import it
from ``tools/`` (``tests/conftest.py`` puts ``tools/`` on ``sys.path``) and so do the benchmarks
(``benchmarks/_common.py``). The reference "loader" for code that needs real weights without an
engine: slabs are allocated once, each tensor is read from the checkpoint
straight into a view of its slab (no ``torch.cat``, no whole-model buffer), and order is contract (the
allocation map records the resulting name-to-offset layout). Between tensors each slab holds a few
*non-checkpoint* bytes (a deterministic pattern standing in for buffers, padding and allocator slack)
that capture must classify as residual.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coldsnap_core.capture.payload import ModelRange
from coldsnap_core.format.allocation import DTYPE_ITEMSIZE_BYTES, Allocation, AllocationMap, LiveAllocation, TensorPlacement
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.safetensors_header import TensorLocation, read_header

TENSOR_ALIGNMENT_BYTES = 256
"""Each tensor starts on a 256-byte boundary within its slab."""


@dataclass(frozen=True)
class Slabs:
    """A checkpoint staged into host slabs.

    Attributes:
        allocation_map: one allocation (tag ``slab``) per slab with its tensor placements.
        arrays: the slabs (``numpy.uint8`` arrays; keep them alive while ``allocations`` is used).
        model_ranges: one range per tensor, with its checkpoint provenance, sorted.
    """

    allocation_map: AllocationMap
    arrays: tuple[np.ndarray, ...]
    model_ranges: tuple[ModelRange, ...]

    @property
    def allocations(self) -> list[LiveAllocation]:
        return [LiveAllocation(i, int(a.ctypes.data), a.nbytes) for i, a in enumerate(self.arrays)]

    def fingerprints(self) -> dict[str, tuple[tuple[int, ...], str, str]]:
        """``name -> (shape, dtype, sha256 of the tensor's bytes)`` for every hosted tensor."""
        out = {}
        for allocation, array in zip(self.allocation_map.allocations, self.arrays, strict=True):
            for t in allocation.tensors:
                data = array[t.offset_bytes : t.offset_bytes + t.span_bytes]
                out[t.name] = (t.shape, t.dtype, hashlib.sha256(data).hexdigest())
        return out


def checkpoint_files(checkpoint_dir: Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint folder, sorted by name."""
    return sorted(Path(checkpoint_dir).glob("*.safetensors"))


def _gap_pattern(slab: int, position: int, size: int) -> np.ndarray:
    return ((np.arange(position, position + size, dtype=np.uint64) * 131 + slab * 7 + 1) & 0xFF).astype(np.uint8)


def plan_slabs(locations: Sequence[TensorLocation], slab_count: int, gap_bytes: int) -> AllocationMap:
    """Lay tensors out in ``slab_count`` slabs, in the given order, with ``gap_bytes`` around them.

    Each tensor starts on a 256-byte boundary at least ``gap_bytes`` after the previous one's end (or
    the slab's start); each slab ends ``gap_bytes`` after its last tensor. Strides are contiguous.
    """
    per_slab = -(-len(locations) // slab_count)
    allocations = []
    for slab in range(slab_count):
        members = locations[slab * per_slab : (slab + 1) * per_slab]
        if not members:
            break
        placements = []
        position = gap_bytes
        for loc in members:
            position = -(-position // TENSOR_ALIGNMENT_BYTES) * TENSOR_ALIGNMENT_BYTES
            stride = tuple(int(np.prod(loc.shape[i + 1 :], dtype=np.int64)) for i in range(len(loc.shape)))
            placements.append(TensorPlacement(loc.name, loc.dtype, tuple(loc.shape), stride, position))
            position += loc.size_bytes + gap_bytes
        allocations.append(Allocation(len(allocations), position, "slab", None, tuple(placements)))
    return AllocationMap(tuple(allocations))


def allocate(allocation_map: AllocationMap) -> tuple[np.ndarray, ...]:
    """Fresh zero-filled slabs with the sizes of ``allocation_map`` (hydration targets)."""
    return tuple(np.zeros(a.size_bytes, dtype=np.uint8) for a in allocation_map.allocations)


def stage_checkpoint(checkpoint_dir: Path, *, slab_count: int = 4, gap_bytes: int = 512, reverse: bool = False) -> Slabs:
    """Read every tensor of a safetensors checkpoint into allocate-once slabs.

    Tensors are taken in (file name, file offset) order (reversed with ``reverse``), split into
    ``slab_count`` runs of ``ceil(n / slab_count)`` tensors, and placed in their slab with
    ``gap_bytes`` pattern bytes before the first, between each two and after the last, each tensor
    starting on a :data:`TENSOR_ALIGNMENT_BYTES` (256-byte) boundary. Each tensor's bytes are read
    with ``os.preadv`` straight into its slab view (no ``torch.cat``, no second copy of the model).
    The layout is a pure function of the checkpoint headers and the arguments, so the layout
    fingerprint and the residual bytes are reproducible (pinned in ``tests/core``).

    Args:
        checkpoint_dir: folder with ``*.safetensors`` files.
        slab_count: number of slabs (allocations), >= 1; fewer when there are fewer tensors.
        gap_bytes: non-checkpoint bytes before, between and after tensors (>= 0), filled with a
            deterministic pattern that capture must classify as residual.
        reverse: lay tensors out in reverse order (a different allocation order and layout
            holding the same model bytes).

    Returns:
        The slabs (``numpy.uint8`` arrays, tag ``slab``), their allocation map, and one model range
        per non-empty tensor with its provenance (file, tensor name, absolute source offset).

    Raises:
        ValueError: ``slab_count`` < 1, ``gap_bytes`` < 0, a dtype without a known item size, or a
            file ends inside a tensor.
        ManifestParseError: a safetensors header is malformed (see :func:`read_header`).
    """
    if slab_count < 1 or gap_bytes < 0:
        raise ValueError(f"slab_count ({slab_count}) must be >= 1 and gap_bytes ({gap_bytes}) >= 0")
    locations = [loc for f in checkpoint_files(checkpoint_dir) for loc in read_header(f).values()]
    locations.sort(key=lambda loc: (loc.file.name, loc.offset_bytes), reverse=reverse)
    for loc in locations:
        if loc.dtype not in DTYPE_ITEMSIZE_BYTES:
            raise ValueError(f"{loc.file}: tensor {loc.name} has dtype {loc.dtype!r}, which staging does not support")
        expected = int(np.prod(loc.shape, dtype=np.int64)) * DTYPE_ITEMSIZE_BYTES[loc.dtype]
        if expected != loc.size_bytes:
            raise ValueError(f"{loc.file}: tensor {loc.name} has {loc.size_bytes} bytes, its shape needs {expected}")
    allocation_map = plan_slabs(locations, slab_count, gap_bytes)
    arrays = tuple(np.empty(a.size_bytes, dtype=np.uint8) for a in allocation_map.allocations)
    by_name = {loc.name: loc for loc in locations}
    ranges = []
    fds: dict[Path, int] = {}
    try:
        for allocation, array in zip(allocation_map.allocations, arrays, strict=True):
            position = 0
            for t in allocation.tensors:
                array[position : t.offset_bytes] = _gap_pattern(allocation.index, position, t.offset_bytes - position)
                loc = by_name[t.name]
                if loc.file not in fds:
                    fds[loc.file] = os.open(loc.file, os.O_RDONLY | os.O_CLOEXEC)
                fd = fds[loc.file]
                view = memoryview(array[t.offset_bytes : t.offset_bytes + loc.size_bytes])
                done = 0
                while done < loc.size_bytes:
                    n = os.preadv(fd, [view[done:]], loc.offset_bytes + done)
                    if n == 0:
                        raise ValueError(f"{loc.file} ends inside tensor {loc.name}")
                    done += n
                provenance = ExtentProvenance(
                    loc.file.name, loc.name, loc.offset_bytes, loc.size_bytes, loc.size_bytes, loc.size_bytes, False
                )
                if loc.size_bytes:
                    ranges.append(ModelRange(allocation.index, t.offset_bytes, loc.size_bytes, provenance))
                position = t.offset_bytes + loc.size_bytes
            array[position:] = _gap_pattern(allocation.index, position, allocation.size_bytes - position)
    finally:
        for fd in fds.values():
            os.close(fd)
    return Slabs(allocation_map, arrays, tuple(ranges))
