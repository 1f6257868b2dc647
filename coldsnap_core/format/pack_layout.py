"""The canonical byte layout of ``model-weights.pack`` (``docs/format.md`` §2, rules 1-5): each distinct
``(sha256, size_bytes)`` content once, in that order, 4096-aligned, zero-padded to a 4096 multiple.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

PACK_ALIGNMENT_BYTES = 4096
"""Alignment of every stored extent and of the pack's end, for direct I/O."""


def align_up(value: int, alignment: int = PACK_ALIGNMENT_BYTES) -> int:
    """The first multiple of ``alignment`` at or after ``value``."""
    return -(-value // alignment) * alignment


@dataclass(frozen=True, slots=True, order=True)
class PackEntry:
    """One stored content of a pack: its SHA-256, its size (> 0) and its offset (a multiple of 4096)."""

    sha256: str
    size_bytes: int
    offset_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


@dataclass(frozen=True, slots=True)
class PackLayout:
    """Where every distinct content goes in a pack, and the pack's size (build one with :meth:`plan`)."""

    entries: tuple[PackEntry, ...]
    size_bytes: int

    @classmethod
    def plan(cls, contents: Iterable[tuple[str, int]]) -> PackLayout:
        """Lay out the distinct ``(sha256, size_bytes)`` contents canonically (rules 1-5)."""
        entries = []
        offset = 0
        for sha256, size_bytes in sorted(set(contents)):
            if size_bytes <= 0:
                raise ValueError(f"pack content {sha256} has size {size_bytes}; extents are never empty")
            entries.append(PackEntry(sha256, size_bytes, offset))
            offset = align_up(offset + size_bytes)
        return cls(tuple(entries), offset)

    def offsets(self) -> dict[tuple[str, int], int]:
        """``(sha256, size_bytes) -> offset_bytes`` for every stored content."""
        return {(e.sha256, e.size_bytes): e.offset_bytes for e in self.entries}

    def padding_ranges(self) -> Iterator[tuple[int, int]]:
        """``(offset_bytes, size_bytes)`` of every zero-padding run, in file order."""
        position = 0
        for entry in self.entries:
            if entry.offset_bytes > position:
                yield position, entry.offset_bytes - position
            position = entry.end_bytes
        if self.size_bytes > position:
            yield position, self.size_bytes - position
