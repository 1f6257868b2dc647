"""The target identity document (``target.json``): the runtime a capsule's residual was captured on.

A unit capsule holds, besides its manifests and residual blob, ``target.json``: which engine (name
and version), coldsnap, torch (and the CUDA version torch was built with), device type, accelerator
model and count, NVIDIA driver and host produced the residual. ``artifact.json`` pins it like every
capsule file. Restore compares the *qualifying* fields (:data:`QUALIFYING_FIELDS`) with the current
worker's target before any byte is written (``docs/format.md`` §15); the others are informational.

The values are collected by :func:`coldsnap_core.identity.target.collect_target`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

from coldsnap_core.format._strict import Fields, dump_document, parse_document, read_document

TARGET_KIND = "coldsnap.target"
TARGET_FILENAME = "target.json"

ENGINE_RE = re.compile(r"[a-z][a-z0-9_-]*")
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


@dataclass(frozen=True, slots=True)
class TargetIdentity:
    """The runtime one worker ran on (``docs/format.md`` §15.1 gives every field).

    Attributes:
        engine: ``vllm``, ``sglang``, or ``none`` (captured or restored without an engine).
        engine_version: the engine's version string (``vllm.__version__``, ``sglang.__version__``), or
            ``None`` without an engine.
        coldsnap_version: the installed coldsnap distribution's version.
        torch_version: ``torch.__version__``.
        torch_cuda_version: ``torch.version.cuda`` (the CUDA toolkit torch was built with), or ``None``.
        device_type: the type of the device the weights live on (``cpu``, ``cuda``).
        accelerator_model: ``torch.cuda.get_device_name`` of this worker's device, or ``None`` on CPU.
        accelerator_count: the number of accelerators of ``device_type`` this worker sees (0 on CPU).
        nvidia_driver_version: the installed NVIDIA kernel driver version, or ``None`` where there is none.
        host: this host's name (``socket.gethostname()``).
    """

    engine: str
    engine_version: str | None
    coldsnap_version: str
    torch_version: str
    torch_cuda_version: str | None
    device_type: str
    accelerator_model: str | None
    accelerator_count: int
    nvidia_driver_version: str | None
    host: str

    def to_json(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def document(self) -> dict[str, object]:
        """``target.json``'s content: the header and every field."""
        return {"format": TARGET_KIND, "format_version": 9, **self.to_json()}

    def dumps(self) -> bytes:
        return dump_document(self.document())

    def differences(
        self, other: TargetIdentity, names: tuple[str, ...] = QUALIFYING_FIELDS
    ) -> tuple[tuple[str, object, object], ...]:
        """``(field, self's value, other's value)`` for each of ``names`` that differs, in ``names`` order."""
        return tuple((n, getattr(self, n), getattr(other, n)) for n in names if getattr(self, n) != getattr(other, n))

    def qualifies(self, other: TargetIdentity) -> bool:
        """Whether a residual captured on ``self`` may be replayed on ``other`` (every qualifying field equal)."""
        return not self.differences(other)

    @classmethod
    def body_from_fields(cls, f: Fields) -> TargetIdentity:
        """The fields without the header (the ``target`` object of an overlay descriptor)."""
        target = cls(
            engine=f.str("engine", pattern=ENGINE_RE),
            engine_version=f.opt_str("engine_version"),
            coldsnap_version=f.str("coldsnap_version"),
            torch_version=f.str("torch_version"),
            torch_cuda_version=f.opt_str("torch_cuda_version"),
            device_type=f.str("device_type", pattern=ENGINE_RE),
            accelerator_model=f.opt_str("accelerator_model"),
            accelerator_count=f.int("accelerator_count"),
            nvidia_driver_version=f.opt_str("nvidia_driver_version"),
            host=f.str("host"),
        )
        f.done()
        return target

    @classmethod
    def from_fields(cls, f: Fields) -> TargetIdentity:
        f.header(TARGET_KIND)
        return cls.body_from_fields(f)

    @classmethod
    def loads(cls, text: str | bytes, *, file: str | None = None) -> TargetIdentity:
        return parse_document(text, cls.from_fields, file=file)

    @classmethod
    def read(cls, path: str | Path) -> TargetIdentity:
        return read_document(path, cls.from_fields)


def describe_differences(differences: tuple[tuple[str, object, object], ...]) -> str:
    """``field: old -> new`` for each difference, joined with ``; ``."""
    return "; ".join(f"{name}: {old!r} -> {new!r}" for name, old, new in differences)
