"""The copy-backend extension point: how bytes move between files and live allocations of one kind of memory.

:meth:`CopyBackend.fill` runs a hydration plan; :meth:`CopyBackend.read_chunks` reads an allocation back to host
memory for capture and materialization. A class may declare ``stable_chunks = True`` (read with
:func:`stable_chunks`; its meaning: ``docs/format.md`` §9).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from coldsnap_core.errors import CopyBackendError
from coldsnap_core.format.allocation import LiveAllocation

SourceName = Literal["pack", "blob"]


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy ``size_bytes`` (> 0) bytes of ``source`` at ``source_offset_bytes`` to ``offset_bytes`` of allocation
    ``allocation_index``. ``sha256``: a model extent's digest (checked under ``verify_extents``), ``None`` for a
    residual extent; ``extent_index``: its position in its map, for error messages."""

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
        """Copy every op's source bytes into its allocation (``ops`` sorted by source and offset, in bounds and
        disjoint; ``allocations[i].index == i``; ``verify_extents``: hash each op with a ``sha256`` and compare).

        Raises:
            ExtentDigestMismatchError: ``verify_extents`` and a copied extent's SHA-256 differs.
            CopyBackendError: a read or copy failed (names the op's allocation and offset).
        """
        ...

    def read_chunks(self, allocation: LiveAllocation, offset_bytes: int, size_bytes: int) -> Iterator[memoryview]:
        """Yield the allocation's bytes ``[offset_bytes, offset_bytes + size_bytes)`` as host memory (each chunk
        valid until the next one is requested)."""
        ...


def stable_chunks(backend: object) -> bool:
    """Whether ``backend`` declares ``stable_chunks = True``."""
    return getattr(backend, "stable_chunks", False) is True


def check_range(allocation: LiveAllocation, offset_bytes: int, size_bytes: int) -> None:
    """Raise ``CopyBackendError`` (naming the allocation and offset) unless the range lies within ``allocation``."""
    if offset_bytes < 0 or size_bytes < 0 or offset_bytes + size_bytes > allocation.size_bytes:
        raise CopyBackendError(
            f"range [{offset_bytes}, {offset_bytes + size_bytes}) is outside the allocation's {allocation.size_bytes} bytes",
            allocation=allocation.index,
            offset_bytes=offset_bytes,
        )
