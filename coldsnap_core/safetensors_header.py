"""Where each tensor's bytes sit in a safetensors file (the library does not expose offsets).

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data;
a tensor's bytes are at file offsets ``[8 + N + begin, 8 + N + end)``
(huggingface/safetensors README; ``reference/vllm.md`` section 2.3). Used for extent provenance only:
the tensor bytes themselves are always read by the safetensors library or the engine's loader.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core.errors import ManifestParseError

MAX_HEADER_BYTES = 100_000_000
"""safetensors caps the header at 100 MB (README); a larger length is a corrupt or hostile file."""

SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
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
}
"""safetensors dtype codes to torch dtype names."""


@dataclass(frozen=True, slots=True)
class TensorLocation:
    """One tensor of a safetensors file.

    Attributes:
        file: the file's path.
        name: the tensor's name in the header.
        dtype: torch dtype name (``bfloat16``).
        shape: shape in elements.
        offset_bytes: absolute file offset of the first data byte.
        size_bytes: number of data bytes.
    """

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int
    size_bytes: int


def read_header(path: str | Path) -> dict[str, TensorLocation]:
    """Parse a safetensors header; return every tensor's location, by name.

    Raises:
        ManifestParseError: the header is truncated, too large or not valid JSON.
    """
    path = Path(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ManifestParseError("truncated safetensors header", file=path)
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ManifestParseError(f"safetensors header length {length} exceeds {MAX_HEADER_BYTES}", file=path)
        raw = f.read(length)
    if len(raw) != length:
        raise ManifestParseError("truncated safetensors header", file=path)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ManifestParseError(f"safetensors header is not JSON: {exc}", file=path) from exc
    base = 8 + length
    locations = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        locations[name] = TensorLocation(
            path,
            name,
            SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"].lower()),
            tuple(entry["shape"]),
            base + begin,
            end - begin,
        )
    return locations
