"""The canonical byte layout of ``model-weights.pack``.

Rules (``docs/format.md`` §2, "The pack"):

1. The pack stores each distinct extent content once. Two extents are the same content when their
   SHA-256 and size are equal; every destination holding that content references one stored copy.
2. Stored contents are ordered by ``(sha256 hex string, size_bytes)`` ascending, so neither the
   allocation order nor the addresses can change the pack.
3. The first stored content starts at offset 0; each next one starts at the first multiple of
   :data:`PACK_ALIGNMENT_BYTES` (4096) at or after the end of the previous one.
4. Every byte between stored contents is zero (padding).
5. End-of-file rule: the file ends at the end of the last stored content rounded up to a multiple of
   4096, the tail padded with zeros; an empty pack (no model extents) is a 0-byte file.

So the pack's SHA-256 is a function of the *set* of model extent contents alone.
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
    """One stored content of a pack.

    Attributes:
        sha256: SHA-256 (lowercase hex) of the content.
        size_bytes: length of the content, > 0.
        offset_bytes: where it starts in the pack; a multiple of 4096.
    """

    sha256: str
    size_bytes: int
    offset_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


@dataclass(frozen=True, slots=True)
class PackLayout:
    """Where every distinct content goes in a pack, and the pack's size.

    Build one with :meth:`plan` (from contents) and compare with what a manifest claims with
    :meth:`entry_for`.
    """

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
