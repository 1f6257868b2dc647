"""The residual blob writer (``weights.blob``) and the residual map it follows (``docs/format.md`` §3)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from coldsnap_core._io import fsync_fd, write_hashed
from coldsnap_core.copy.base import CopyBackend, stable_chunks
from coldsnap_core.errors import ResidualSizeMismatchError
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.extents import ResidualExtent
from coldsnap_core.format.manifest import ResidualRef


def residual_extents(allocation_sizes: Sequence[int], model_ranges: Iterable[tuple[int, int, int]]) -> tuple[ResidualExtent, ...]:
    """The complement of ``model_ranges`` (``(allocation_index, offset_bytes, size_bytes)``, sorted and disjoint) over
    allocations of ``allocation_sizes``, stored back to back from blob offset 0."""
    by_allocation: list[list[tuple[int, int]]] = [[] for _ in allocation_sizes]
    for index, offset, size in model_ranges:
        by_allocation[index].append((offset, offset + size))
    extents = []
    blob_offset = 0
    for index, size_bytes in enumerate(allocation_sizes):
        position = 0
        for start, end in [*by_allocation[index], (size_bytes, size_bytes)]:
            if start > position:
                extents.append(ResidualExtent(index, position, start - position, blob_offset))
                blob_offset += start - position
            position = max(position, end)
    return tuple(extents)


def write_residual(
    extents: Sequence[ResidualExtent],
    allocations: Sequence[LiveAllocation],
    backend: CopyBackend,
    path: Path,
) -> ResidualRef:
    """Write the residual bytes to a new file ``path`` and fsync it; returns the blob's :class:`ResidualRef`.
    ResidualSizeMismatchError when the file does not hold the bytes written; InsufficientSpaceError when it is full."""

    def stream() -> Iterator[memoryview]:
        for extent in extents:
            yield from backend.read_chunks(allocations[extent.allocation_index], extent.offset_bytes, extent.size_bytes)

    expected = sum(e.size_bytes for e in extents)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        digest, written = write_hashed(fd, stream, file=path, stable=stable_chunks(backend))
        fsync_fd(fd, file=path)
        size = os.fstat(fd).st_size
        if written != expected or size != expected:
            raise ResidualSizeMismatchError(
                f"the residual extents hold {expected} bytes, {written} were written, the blob holds {size}", file=path
            )
    finally:
        os.close(fd)
    return ResidualRef(path.name, expected, digest)
