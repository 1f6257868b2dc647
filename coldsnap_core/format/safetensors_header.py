"""Where each tensor's bytes sit in a safetensors file, for extent provenance (the library does not expose offsets).

A tensor's bytes are at file offsets ``[8 + N + begin, 8 + N + end)``, ``N`` the little-endian ``u64`` header length
(huggingface/safetensors ``README.md``, "Format").
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.errors import ManifestParseError, MissingObjectError
from coldsnap_core.format.allocation import DTYPE_ITEMSIZE_BYTES

MAX_HEADER_BYTES = 100_000_000
"""safetensors caps the header at 100 MB (README); a larger length is a corrupt or hostile file."""

SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
}
"""safetensors dtype codes to torch dtype names."""


@dataclass(frozen=True, slots=True)
class TensorLocation:
    """One tensor of a safetensors file: torch dtype name, shape in elements, absolute file offset and size in bytes."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    size_bytes: int


def read_header(path: str | Path) -> dict[str, TensorLocation]:
    """Parse a safetensors header; return every tensor's location, by name (header order).

    Raises:
        MissingObjectError: no file at ``path``.
        ManifestParseError: the header is truncated, too large, not a JSON object, or an entry is malformed.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) != 8:
                raise ManifestParseError("truncated safetensors header", file=path)
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise ManifestParseError(f"safetensors header length {length} exceeds {MAX_HEADER_BYTES}", file=path)
            raw = f.read(length)
    except FileNotFoundError as exc:
        raise MissingObjectError("checkpoint file does not exist", file=path) from exc
    if len(raw) != length:
        raise ManifestParseError("truncated safetensors header", file=path)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ManifestParseError(f"safetensors header is not JSON: {exc}", file=path) from exc
    if not isinstance(header, dict):
        raise ManifestParseError("safetensors header is not a JSON object", file=path)
    base = 8 + length
    locations = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        locations[name] = _location(path, name, entry, base, file_size)
    return locations


def _location(path: Path, name: str, entry: object, base: int, file_size: int) -> TensorLocation:
    def bad(detail: str) -> ManifestParseError:
        return ManifestParseError(f"safetensors tensor {name!r}: {detail}", file=path)

    if not isinstance(entry, dict):
        raise bad("entry is not an object")
    code = entry.get("dtype")
    if not isinstance(code, str) or not code:
        raise bad(f"dtype {code!r} is not a string")
    # a code this table does not know (F4, F6_E2M3, ...) keeps its lowercased name, its size unchecked
    dtype = SAFETENSORS_DTYPES.get(code, code.lower())
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if base + end > file_size:
        raise bad(f"data ends at file byte {base + end}, beyond the file's {file_size} bytes")
    if dtype in DTYPE_ITEMSIZE_BYTES:
        expected = math.prod(shape) * DTYPE_ITEMSIZE_BYTES[dtype]
        if end - begin != expected:
            raise bad(f"holds {end - begin} bytes, but {dtype}{shape} needs {expected}")
    return TensorLocation(path, name, dtype, tuple(shape), base + begin, end - begin)
