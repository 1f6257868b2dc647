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

import hashlib
import json
import re
from dataclasses import dataclass, field

from coldsnap_core.format._strict import Fields, is_offset, offset_tuple

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

_TAG_RE = re.compile(r"[A-Za-z0-9_.-]+")
_PLACEMENT_KEYS = frozenset(("name", "dtype", "shape", "stride", "offset_bytes"))
_ALLOCATION_KEYS = frozenset(("index", "size_bytes", "tag", "address", "tensors"))
_LAYOUT_FINGERPRINT_DOMAIN = b"coldsnap-layout-v1\n"


@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """One tensor (a parameter, a buffer, or an alias of one) hosted by an allocation.

    Attributes:
        name: the tensor's qualified name in the model (``model.layers.0.mlp.down_proj.weight``).
        dtype: torch dtype name without the ``torch.`` prefix (a key of :data:`DTYPE_ITEMSIZE_BYTES`).
        shape: the tensor's shape, in elements.
        stride: the tensor's strides, in elements (as ``torch.Tensor.stride()``).
        offset_bytes: byte offset of element 0 within the allocation.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset_bytes: int

    @property
    def itemsize_bytes(self) -> int:
        return DTYPE_ITEMSIZE_BYTES[self.dtype]

    @property
    def span_bytes(self) -> int:
        """Bytes from element 0 to one past the last element (0 for an empty tensor)."""
        last = 0
        for n, s in zip(self.shape, self.stride, strict=True):
            if n == 0:
                return 0
            last += (n - 1) * s
        return (last + 1) * DTYPE_ITEMSIZE_BYTES[self.dtype]

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "offset_bytes": self.offset_bytes,
        }

    @classmethod
    def from_plain(cls, raw: object) -> TensorPlacement | None:
        """:meth:`from_fields`'s result when ``raw`` passes each of its rules, else ``None`` (the fast path
        of :meth:`Fields.list`; no error is built here)."""
        if type(raw) is not dict or raw.keys() != _PLACEMENT_KEYS:
            return None
        name, dtype, offset_bytes = raw["name"], raw["dtype"], raw["offset_bytes"]
        shape, stride = offset_tuple(raw["shape"]), offset_tuple(raw["stride"])
        if (
            type(name) is not str
            or not name
            or type(dtype) is not str
            or dtype not in DTYPE_ITEMSIZE_BYTES
            or not is_offset(offset_bytes)
            or shape is None
            or stride is None
            or len(shape) != len(stride)
        ):
            return None
        return cls(name, dtype, shape, stride, offset_bytes)

    @classmethod
    def from_fields(cls, f: Fields) -> TensorPlacement:
        placement = cls(
            name=f.str("name"),
            dtype=f.str("dtype"),
            shape=f.int_tuple("shape"),
            stride=f.int_tuple("stride"),
            offset_bytes=f.int("offset_bytes"),
        )
        f.done()
        if placement.dtype not in DTYPE_ITEMSIZE_BYTES:
            raise f.error(f"unknown dtype {placement.dtype!r}")
        if len(placement.shape) != len(placement.stride):
            raise f.error(f"shape {placement.shape} and stride {placement.stride} differ in rank")
        return placement


@dataclass(frozen=True, slots=True)
class Allocation:
    """One preserved weight allocation.

    Attributes:
        index: position in the allocation map (0, 1, 2, ... in enumeration order).
        size_bytes: size of the allocation in bytes (the storage's ``nbytes``, or the CuMem
            segment's aligned size ``handle[1]``).
        tag: ``parameter`` or ``buffer`` (portable) or the CuMem tag, ``weights`` (native).
        address: the captured virtual address (native capture point), or ``None`` (portable: host
            addresses are meaningless across processes).
        tensors: the tensors whose storage is this allocation, in enumeration order.
    """

    index: int
    size_bytes: int
    tag: str
    address: int | None
    tensors: tuple[TensorPlacement, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "index": self.index,
            "size_bytes": self.size_bytes,
            "tag": self.tag,
            "address": self.address,
            "tensors": [t.to_json() for t in self.tensors],
        }

    @classmethod
    def from_plain(cls, raw: object) -> Allocation | None:
        """:meth:`from_fields`'s result when ``raw`` passes each of its rules, else ``None`` (the fast path
        of :meth:`Fields.list`)."""
        if type(raw) is not dict or raw.keys() != _ALLOCATION_KEYS:
            return None
        index, size_bytes, tag, address, items = raw["index"], raw["size_bytes"], raw["tag"], raw["address"], raw["tensors"]
        if (
            not is_offset(index)
            or not is_offset(size_bytes)
            or type(tag) is not str
            or _TAG_RE.fullmatch(tag) is None
            or not (address is None or is_offset(address))
            or type(items) is not list
        ):
            return None
        tensors = []
        for item in items:
            tensor = TensorPlacement.from_plain(item)
            if tensor is None or tensor.offset_bytes + tensor.span_bytes > size_bytes:
                return None
            tensors.append(tensor)
        return cls(index, size_bytes, tag, address, tuple(tensors))

    @classmethod
    def from_fields(cls, f: Fields) -> Allocation:
        allocation = cls(
            index=f.int("index"),
            size_bytes=f.int("size_bytes"),
            tag=f.str("tag", pattern=_TAG_RE),
            address=f.opt_int("address"),
            tensors=f.list("tensors", TensorPlacement.from_fields, fast=TensorPlacement.from_plain),
        )
        f.done()
        for tensor in allocation.tensors:
            if tensor.offset_bytes + tensor.span_bytes > allocation.size_bytes:
                raise f.error(
                    f"tensor {tensor.name} spans bytes [{tensor.offset_bytes}, {tensor.offset_bytes + tensor.span_bytes})"
                    f" beyond the allocation's {allocation.size_bytes} bytes"
                )
        return allocation


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


@dataclass(frozen=True, slots=True)
class AllocationMap:
    """The ordered list of preserved allocations of one worker.

    Invariant (checked by :meth:`from_fields` and :meth:`__post_init__`): ``allocations[i].index == i``.
    """

    allocations: tuple[Allocation, ...]
    _fingerprint: str | None = field(default=None, init=False, repr=False, compare=False)
    """:meth:`layout_fingerprint`, once computed (a restore needs it for the manifest and the live model)."""

    def __post_init__(self) -> None:
        for position, allocation in enumerate(self.allocations):
            if allocation.index != position:
                raise ValueError(f"allocation at position {position} has index {allocation.index}")

    def __len__(self) -> int:
        return len(self.allocations)

    def __getitem__(self, index: int) -> Allocation:
        return self.allocations[index]

    @property
    def total_bytes(self) -> int:
        return sum(a.size_bytes for a in self.allocations)

    def layout_fingerprint(self) -> str:
        """SHA-256 (hex) of the canonical layout: every field except the addresses.

        Two captures of the same model built the same way have the same fingerprint in any process
        or on any node; a different dtype, shape, tensor name, tensor order, allocation size or
        tag changes it. Computed once per map (a map is immutable).
        """
        if self._fingerprint is not None:
            return self._fingerprint
        text = canonical_layout_json(self.allocations).encode()
        fingerprint = hashlib.sha256(_LAYOUT_FINGERPRINT_DOMAIN + text).hexdigest()
        object.__setattr__(self, "_fingerprint", fingerprint)  # a frozen dataclass: the memo is not a field value
        return fingerprint

    def to_json(self) -> list[object]:
        return [a.to_json() for a in self.allocations]

    @classmethod
    def from_fields_list(cls, f: Fields, key: str) -> AllocationMap:
        allocations = f.list(key, Allocation.from_fields, fast=Allocation.from_plain)
        for position, allocation in enumerate(allocations):
            if allocation.index != position:
                raise f.error(f"{key}[{position}] has index {allocation.index}; indices must be 0, 1, 2, ...")
        return cls(allocations)
