"""The copy-backend extension point: how bytes move between files and live allocations.

A backend knows one kind of memory (host, CUDA device). :meth:`CopyBackend.fill` runs a hydration plan (byte
ranges of the pack and the residual blob into live allocations, optionally checking each model extent's SHA-256);
:meth:`CopyBackend.read_chunks` reads an allocation back to host memory, in chunks, for capture and
materialization. Optional capability: ``stable_chunks = True`` on the class (read with :func:`stable_chunks`)
promises that the yielded views stay valid after the next one is requested and that several iterations may run at
once on different threads (zero-copy host views), so the writers hash and write on two threads
(``docs/format.md`` §9).
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
    """Whether ``backend`` declares ``stable_chunks = True`` (see the module docstring)."""
    return getattr(backend, "stable_chunks", False) is True
