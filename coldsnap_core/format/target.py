"""The target identity document (``target.json``): the runtime a capsule's residual was captured on (``docs/format.md``
§15)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from coldsnap_core.format._strict import (
    FORMAT_VERSION,
    Offset,
    Record,
    Text,
    dump_document,
    load_document,
    matching,
    read_document,
)

TARGET_KIND = "coldsnap.target"
TARGET_FILENAME = "target.json"

Engine = matching("[a-z][a-z0-9_-]*")
"""An engine name: ``vllm``, ``sglang``, or ``none`` for a capture without an engine."""

QUALIFYING_FIELDS: tuple[str, ...] = (
    "engine",
    "engine_version",
    "torch_version",
    "torch_cuda_version",
    "device_type",
    "accelerator_model",
    "nvidia_driver_version",
)
"""Fields that must be equal for a residual to be replayed (``docs/format.md`` §15.1 says why for each)."""

INFORMATIONAL_FIELDS: tuple[str, ...] = ("coldsnap_version", "accelerator_count", "host")
"""Recorded, shown by ``coldsnap inspect``, never compared for replay (``docs/format.md`` §15.1)."""


class TargetIdentity(Record):
    """The runtime one worker ran on (``docs/format.md`` §15.1 gives every field)."""

    engine: Engine
    engine_version: Text | None
    coldsnap_version: Text
    torch_version: Text
    torch_cuda_version: Text | None
    device_type: Engine
    accelerator_model: Text | None
    accelerator_count: Offset
    nvidia_driver_version: Text | None
    host: Text

    def dumps(self) -> bytes:
        """``target.json``'s bytes: the header and every field."""
        return dump_document(_TargetDocument(**msgspec.structs.asdict(self)))

    def differences(
        self, other: TargetIdentity, names: tuple[str, ...] = QUALIFYING_FIELDS
    ) -> tuple[tuple[str, object, object], ...]:
        """``(field, self's value, other's value)`` for each of ``names`` that differs, in ``names`` order."""
        return tuple((n, getattr(self, n), getattr(other, n)) for n in names if getattr(self, n) != getattr(other, n))

    @classmethod
    def loads(cls, data: str | bytes, *, file: str | None = None) -> TargetIdentity:
        """Parse ``target.json`` strictly (:func:`~coldsnap_core.format._strict.load_document`)."""
        return _TargetDocument.identity(load_document(_TargetDocument, data, file=file))

    @classmethod
    def read(cls, path: str | Path) -> TargetIdentity:
        return _TargetDocument.identity(read_document(path, _TargetDocument))


class _TargetDocument(TargetIdentity, kw_only=True, tag_field="format", tag=TARGET_KIND):
    """``target.json``: a :class:`TargetIdentity` with the document header (an overlay descriptor holds it without)."""

    format_version: Literal[9] = FORMAT_VERSION

    def identity(self) -> TargetIdentity:
        return TargetIdentity(**{name: getattr(self, name) for name in TargetIdentity.__struct_fields__})


def describe_differences(differences: tuple[tuple[str, object, object], ...]) -> str:
    """``field: old -> new`` for each difference, joined with ``; ``."""
    return "; ".join(f"{name}: {old!r} -> {new!r}" for name, old, new in differences)
