"""The copy-backend extension point: how bytes move between files and live allocations.

A backend knows one kind of memory (host memory, CUDA device memory). It does two things:

* :meth:`CopyBackend.fill`: execute a hydration plan, i.e. copy byte ranges of source files (the
  pack, the residual blob) into live allocations, optionally checking each model extent's SHA-256
  on the way;
* :meth:`CopyBackend.read_chunks`: read a byte range of a live allocation back to host memory, in
  chunks, for capture and materialization.

The shared code (planning, verification, the canonical writers) never touches memory directly.

Optional capability: a backend whose class sets ``stable_chunks = True`` promises that the views
:meth:`CopyBackend.read_chunks` yields stay valid and unchanged after the next one is requested and
that several ``read_chunks`` iterations may run at once on different threads (true of zero-copy
views of host memory). The canonical writers then hash and write the stream on two threads without
a per-chunk hand-off (:func:`coldsnap_core._io.write_hashed`). Backends that reuse a staging buffer
(device-to-host copies) leave it unset. It is read with :func:`stable_chunks`, not part of the
Protocol, so existing backends need not declare it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from coldsnap_core.format.allocation import LiveAllocation

SourceName = Literal["pack", "blob"]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy ``size_bytes`` bytes from ``source`` at ``source_offset_bytes`` into an allocation.

    Attributes:
        source: ``pack`` or ``blob``.
        source_offset_bytes: where the bytes start in the source file.
        allocation_index: destination allocation.
        offset_bytes: destination offset within the allocation.
        size_bytes: number of bytes, > 0.
        sha256: for a model extent, its SHA-256 (checked when the plan is run with
            ``verify_extents``); ``None`` for residual extents (the blob is hashed whole beforehand).
        extent_index: position of the extent in its map, for error messages.
    """

    source: SourceName
    source_offset_bytes: int
    allocation_index: int
    offset_bytes: int
    size_bytes: int
    sha256: str | None
    extent_index: int


@runtime_checkable
class CopyBackend(Protocol):
    """One kind of memory a worker's weight allocations live in."""

    name: str

    def fill(
        self,
        ops: Sequence[CopyOp],
        sources: Mapping[SourceName, Path],
        allocations: Sequence[LiveAllocation],
        *,
        verify_extents: bool,
    ) -> None:
        """Copy every op's source bytes into its allocation.

        Args:
            ops: the plan, sorted by (source, source_offset_bytes); already verified to be in bounds
                and disjoint.
            sources: the file behind each source name.
            allocations: the live allocations, ``allocations[i].index == i``.
            verify_extents: hash each op that has a ``sha256`` while copying and compare.

        Raises:
            ExtentDigestMismatchError: ``verify_extents`` and a copied extent's SHA-256 differs.
            CopyBackendError: a read or copy failed (names the op's allocation and offset).
        """
        ...

    def read_chunks(self, allocation: LiveAllocation, offset_bytes: int, size_bytes: int) -> Iterator[memoryview]:
        """Yield the allocation's bytes ``[offset_bytes, offset_bytes + size_bytes)`` as host memory.

        Each chunk is valid until the next one is requested.
        """
        ...


def stable_chunks(backend: object) -> bool:
    """Whether ``backend`` declares ``stable_chunks = True`` (see the module docstring)."""
    return getattr(backend, "stable_chunks", False) is True
