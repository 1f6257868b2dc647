"""The one (name, size, SHA-256) reference type of the format documents; a subclass declares the name field again,
for its JSON key (``msgspec.field(name=...)``) and its form.
"""

from __future__ import annotations

from typing import TypeVar

from coldsnap_core.format._strict import Offset, Record, Sha256, Text

R = TypeVar("R", bound="ContentRef")


class ContentRef(Record):
    """A file named by its name or path relative to its folder, its size in bytes and the SHA-256 of its content."""

    name: Text
    size_bytes: Offset
    sha256: Sha256

    @classmethod
    def of(cls: type[R], ref: ContentRef) -> R:
        """``ref``'s name, size and digest as a reference of this type (a residual blob's pin)."""
        return cls(ref.name, ref.size_bytes, ref.sha256)
