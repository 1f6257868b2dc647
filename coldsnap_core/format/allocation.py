"""The allocation map: which weight allocations a capture preserved and what tensors live in them.

An *allocation* is one contiguous byte range that a worker owns for its weights:

* portable capture point: one parameter or buffer storage (``torch.UntypedStorage``) of the model,
  enumerated in a deterministic order (``docs/format.md`` §6.1);
* native capture point: one CuMem "weights" segment at its captured virtual address
  (vLLM ``device_allocator/cumem.py``, ``CuMemAllocator.pointer_to_data``; ``docs/format.md`` §6.2).

Every byte of every allocation is covered by exactly one model extent or one residual extent
(:mod:`coldsnap_core.format.extents`). The *layout fingerprint* identifies the layout without the
addresses, so the same model built again (in another process, on another node) has the same
fingerprint, and a different model, dtype or layer count has another one.
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
    """One tensor (a parameter, a buffer, or an alias of one) hosted by an allocation.

    Attributes:
        name: the tensor's qualified name in the model (``model.layers.0.mlp.down_proj.weight``).
        dtype: torch dtype name without the ``torch.`` prefix (a key of :data:`DTYPE_ITEMSIZE_BYTES`).
        shape: the tensor's shape, in elements.
        stride: the tensor's strides, in elements (as ``torch.Tensor.stride()``), as many as ``shape``.
        offset_bytes: byte offset of element 0 within the allocation.

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
        last = 0
        for n, s in zip(self.shape, self.stride, strict=True):
            if n == 0:
                return 0
            last += (n - 1) * s
        return (last + 1) * DTYPE_ITEMSIZE_BYTES[self.dtype]


class Allocation(Record):
    """One preserved weight allocation.

    Attributes:
        index: position in the allocation map (0, 1, 2, ... in enumeration order).
        size_bytes: size of the allocation in bytes (the storage's ``nbytes``, or the CuMem
            segment's aligned size ``handle[1]``).
        tag: ``parameter`` or ``buffer`` (portable) or the CuMem tag, ``weights`` (native).
        address: the captured virtual address (native capture point), or ``None`` (portable: host
            addresses are meaningless across processes).
        tensors: the tensors whose storage is this allocation, in enumeration order.

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
    """The text the layout fingerprint hashes (``docs/format.md`` §4.4): exactly
    ``json.dumps(canonical, sort_keys=True, separators=(",", ":"))`` (ASCII, escapes as ``json`` writes
    them) of ``[{"index", "size_bytes", "tag", "tensors": [TensorPlacement.to_json(), ...]}, ...]``,
    written directly (half the time of building the dictionaries and sorting their keys). Every number
    is a Python ``int``, as the strict parser and the enumeration make them."""
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

    A manifest's ``allocations`` field is read as a tuple and held as this type (its ``__post_init__``).

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
        """SHA-256 (hex) of the canonical layout: every field except the addresses.

        Two captures of the same model built the same way have the same fingerprint in any process
        or on any node; a different dtype, shape, tensor name, tensor order, allocation size or
        tag changes it. Computed once per map (a map is immutable).
        """
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:
        text = canonical_layout_json(self).encode()
        return hashlib.sha256(_LAYOUT_FINGERPRINT_DOMAIN + text).hexdigest()


@dataclass(frozen=True, slots=True)
class LiveAllocation:
    """A weight allocation of the running process, as a copy backend sees it
    (:mod:`coldsnap_core.copy.base`): where allocation ``index`` of the allocation map lives now.

    Attributes:
        index: the allocation's index in the allocation map.
        address: the allocation's base address (host pointer or CUDA virtual address).
        size_bytes: the allocation's size in bytes.
    """

    index: int
    address: int
    size_bytes: int
