"""The one (name, size, SHA-256) reference type of the format documents.

Four format types name a file by its name (or relative path), its size in bytes and the SHA-256 of
its whole content; each is a :class:`ContentRef` that differs only in the JSON key of the name, the
form the name must have and, for :class:`~coldsnap_core.format.manifest.CheckpointFile`, one extra
field:

=====================================================  ==========  =========================  ======================
type                                                   name key    where (``docs/format.md``)  name form
=====================================================  ==========  =========================  ======================
:class:`~coldsnap_core.format.manifest.PackRef`        ``path``    §4 ``pack``                 any non-empty string
:class:`~coldsnap_core.format.manifest.ResidualRef`    ``file``    §4 ``residual``             a capsule file name
:class:`~coldsnap_core.format.descriptor.CapsuleFile`  ``name``    §5 ``capsule_files``        a capsule file name
:class:`~coldsnap_core.format.manifest.CheckpointFile` ``name``    §4 ``model.files``          a relative path
=====================================================  ==========  =========================  ======================

The JSON keys are ``size_bytes``, ``sha256`` and the name key (documents are written with sorted
keys, so the order of :meth:`ContentRef.to_json` does not reach the bytes). A reference is read with
:meth:`ContentRef.from_fields` in the order of :attr:`ContentRef.KEYS`, so a document with several bad
fields reports the same first one whichever type reads it. A file's size is compared with a
reference's through :func:`coldsnap_core.errors.size_mismatch`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from coldsnap_core.format._strict import Fields

R = TypeVar("R", bound="ContentRef")


@dataclass(frozen=True, slots=True)
class ContentRef:
    """A file named by name, size and content.

    Attributes:
        name: the file's name or path relative to its folder (JSON key :attr:`NAME_KEY`).
        size_bytes: the file's size in bytes (0 to 2**63 - 1).
        sha256: SHA-256 (64 lowercase hexadecimal characters) of the whole file.
    """

    name: str
    size_bytes: int
    sha256: str

    NAME_KEY: ClassVar[str] = "name"
    """The JSON key of :attr:`name`."""
    NAME_PATTERN: ClassVar[re.Pattern[str] | None] = None
    """The form :attr:`name` must have when read (``None``: any non-empty string)."""
    KEYS: ClassVar[tuple[str, ...]] = ("name", "size_bytes", "sha256")
    """The JSON keys in the order they are read (the first bad one is the one reported)."""

    @classmethod
    def of(cls: type[R], ref: ContentRef) -> R:
        """``ref``'s name, size and digest as a reference of this type (a residual blob's pin)."""
        return cls(ref.name, ref.size_bytes, ref.sha256)

    def to_json(self) -> dict[str, object]:
        return {self.NAME_KEY: self.name, "size_bytes": self.size_bytes, "sha256": self.sha256}

    @classmethod
    def _read(cls, f: Fields) -> dict[str, Any]:
        """The constructor arguments, read from ``f`` in :attr:`KEYS` order (:meth:`Fields.done` not called)."""
        values: dict[str, Any] = {}
        for key in cls.KEYS:
            if key == cls.NAME_KEY:
                values["name"] = f.str(key, pattern=cls.NAME_PATTERN)
            elif key == "size_bytes":
                values["size_bytes"] = f.int(key)
            elif key == "sha256":
                values["sha256"] = f.sha256(key)
            else:
                raise AssertionError(f"{cls.__name__}.KEYS names {key!r}, which ContentRef does not read")
        values.update(cls._read_more(f))
        return values

    @classmethod
    def _read_more(cls, f: Fields) -> dict[str, Any]:
        """A subclass's own fields, read after :attr:`KEYS` (none here)."""
        return {}

    def _check(self, f: Fields) -> None:
        """A subclass's rule on the whole reference, after every key is read (none here)."""

    @classmethod
    def from_fields(cls: type[R], f: Fields) -> R:
        """Read one reference from ``f`` and refuse any other key.

        Raises:
            ManifestSchemaError: a key is missing, mistyped or unknown.
            ManifestValueError: ``size_bytes`` is negative or too large, ``sha256`` is not 64 lowercase
                hexadecimal characters, the name is empty or not of :attr:`NAME_PATTERN`'s form, or a
                subclass's rule fails.
        """
        ref = cls(**cls._read(f))
        f.done()
        ref._check(f)
        return ref

    @classmethod
    def parse(cls: type[R], obj: Mapping[str, Any], *, file: str | None = None, where: str = "") -> R:
        """Read one reference from a parsed JSON object; errors name ``where`` (a JSON path) and ``file``.

        Raises: see :meth:`from_fields`.
        """
        return cls.from_fields(Fields(obj, where, file))
