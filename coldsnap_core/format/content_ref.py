"""The one (name, size, SHA-256) reference type of the format documents.

Five format types name a file by its name (or relative path), its size in bytes and the SHA-256 of
its whole content; each is a :class:`ContentRef` that differs only in the JSON key of the name, the
form the name must have and, for :class:`~coldsnap_core.format.manifest.CheckpointFile`, one extra
field:

==========================================================  ==========  ==========================  =====================
type                                                        name key    where (``docs/format.md``)  name form
==========================================================  ==========  ==========================  =====================
:class:`~coldsnap_core.format.manifest.PackRef`             ``path``    §4 ``pack``                 any non-empty string
:class:`~coldsnap_core.format.manifest.ResidualRef`         ``file``    §4 ``residual``             a capsule file name
:class:`~coldsnap_core.format.descriptor.CapsuleFile`       ``name``    §5 ``capsule_files``        a capsule file name
:class:`~coldsnap_core.format.manifest.CheckpointFile`      ``name``    §4 ``model.files``          a relative path
:class:`~coldsnap_core.artifact.derived_cache.SeedMember`   ``path``    §17.2 ``members``           a seed member path
==========================================================  ==========  ==========================  =====================

A subclass declares its name field again: its JSON key (``msgspec.field(name=...)``) and its form. A file's
size is compared with a reference's through :func:`coldsnap_core.errors.size_mismatch`.
"""

from __future__ import annotations

from typing import TypeVar

from coldsnap_core.format._strict import Offset, Record, Sha256, Text

R = TypeVar("R", bound="ContentRef")


class ContentRef(Record):
    """A file named by name, size and content.

    Attributes:
        name: the file's name or path relative to its folder (JSON key ``name`` unless a subclass renames it).
        size_bytes: the file's size in bytes (0 to 2**63 - 1).
        sha256: SHA-256 (64 lowercase hexadecimal characters) of the whole file.
    """

    name: Text
    size_bytes: Offset
    sha256: Sha256

    @classmethod
    def of(cls: type[R], ref: ContentRef) -> R:
        """``ref``'s name, size and digest as a reference of this type (a residual blob's pin)."""
        return cls(ref.name, ref.size_bytes, ref.sha256)
