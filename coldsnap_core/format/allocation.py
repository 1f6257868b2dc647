"""The allocation map: which weight allocations a capture preserved and what tensors live in them (fields:
``docs/format.md`` §4.5; an allocation at each capture point: §6.1, §6.2; the layout fingerprint: §4.4).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

from coldsnap_core.errors import ManifestValueError
from coldsnap_core.format._strict import Offset, Record, Text, matching

#: Size in bytes of one element of each dtype a tensor placement may name (torch dtype names).
DTYPE_ITEMSIZE_BYTES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "complex32": 4,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

Tag = matching("[A-Za-z0-9_.-]+")
"""An allocation's tag: ``parameter``, ``buffer``, ``weights``, ..."""
_LAYOUT_FINGERPRINT_DOMAIN = b"coldsnap-layout-v1\n"


class TensorPlacement(Record):
    """One tensor hosted by an allocation: ``shape`` and ``stride`` in elements, ``offset_bytes`` of element 0.

    Raises:
        ManifestValueError: an unknown dtype, or a stride of another rank than the shape.
    """

    name: Text
    dtype: Text
    shape: tuple[Offset, ...]
    stride: tuple[Offset, ...]
    offset_bytes: Offset

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE_BYTES:
            raise ManifestValueError(f"unknown dtype {self.dtype!r}")
        if len(self.shape) != len(self.stride):
            raise ManifestValueError(f"shape {self.shape} and stride {self.stride} differ in rank")

    @property
    def span_bytes(self) -> int:
        """Bytes from element 0 to one past the last element (0 for an empty tensor)."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return 0 if 0 in self.shape else (last + 1) * DTYPE_ITEMSIZE_BYTES[self.dtype]


class Allocation(Record):
    """One preserved weight allocation (``docs/format.md`` §4.5; ``address`` is ``None`` at the portable capture point).

    Raises:
        ManifestValueError: a tensor reaches beyond ``size_bytes``.
    """

    index: Offset
    size_bytes: Offset
    tag: Tag
    address: Offset | None
    tensors: tuple[TensorPlacement, ...]

    def __post_init__(self) -> None:
        for tensor in self.tensors:
            if tensor.offset_bytes + tensor.span_bytes > self.size_bytes:
                raise ManifestValueError(
                    f"tensor {tensor.name} spans bytes [{tensor.offset_bytes}, {tensor.offset_bytes + tensor.span_bytes})"
                    f" beyond the allocation's {self.size_bytes} bytes"
                )


def canonical_layout_json(allocations: tuple[Allocation, ...]) -> str:
    """The text the layout fingerprint hashes (``docs/format.md`` §4.4): what ``json.dumps`` with sorted keys,
    ``(",", ":")`` separators and ASCII escapes writes, written directly."""
    quote = json.encoder.encode_basestring_ascii  # what json.dumps uses with ensure_ascii=True
    parts = []
    for allocation in allocations:
        tensors = ",".join(
            [
                f'{{"dtype":{quote(t.dtype)},"name":{quote(t.name)},"offset_bytes":{t.offset_bytes},'
                f'"shape":[{",".join(map(str, t.shape))}],"stride":[{",".join(map(str, t.stride))}]}}'
                for t in allocation.tensors
            ]
        )
        parts.append(
            f'{{"index":{allocation.index},"size_bytes":{allocation.size_bytes},"tag":{quote(allocation.tag)},'
            f'"tensors":[{tensors}]}}'
        )
    return "[" + ",".join(parts) + "]"


class AllocationMap(tuple[Allocation, ...]):
    """The ordered allocations of one worker: a tuple whose item ``i`` has index ``i``.

    Raises:
        ManifestValueError: an allocation's index is not its position.
    """

    def __new__(cls, allocations: tuple[Allocation, ...] | list[Allocation] = ()) -> AllocationMap:
        self = super().__new__(cls, allocations)
        for position, allocation in enumerate(self):
            if allocation.index != position:
                raise ManifestValueError(f"allocations[{position}] has index {allocation.index}; indices must be 0, 1, 2, ...")
        return self

    @property
    def allocations(self) -> tuple[Allocation, ...]:
        """The allocations in index order (the map itself)."""
        return self

    @property
    def total_bytes(self) -> int:
        return sum(a.size_bytes for a in self)

    def layout_fingerprint(self) -> str:
        """SHA-256 (hex) of the canonical layout (``docs/format.md`` §4.4), computed once per map."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:
        text = canonical_layout_json(self).encode()
        return hashlib.sha256(_LAYOUT_FINGERPRINT_DOMAIN + text).hexdigest()


@dataclass(frozen=True, slots=True)
class LiveAllocation:
    """Where allocation ``index`` of the allocation map lives now (host pointer or CUDA virtual address)."""

    index: int
    address: int
    size_bytes: int
