"""The safetensors header reader (extent provenance and engine-free staging) against the safetensors
library on the real checkpoints, and its refusal of malformed headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors import deserialize

from coldsnap_core.errors import ManifestParseError, MissingObjectError
from coldsnap_core.format.safetensors_header import read_header


def test_offsets_match_the_safetensors_library(smollm2_2layer_3shards: Path) -> None:
    """Catches a wrong data base offset (the 8-byte length prefix plus the header) or dtype mapping:
    the bytes at every reported location, in every shard, equal what the safetensors library returns."""
    files = sorted(smollm2_2layer_3shards.glob("*.safetensors"))
    assert len(files) == 3
    for path in files:
        data = path.read_bytes()
        locations = read_header(path)
        reference = dict(deserialize(data))
        assert set(locations) == set(reference)
        for name, loc in locations.items():
            assert data[loc.offset_bytes : loc.offset_bytes + loc.size_bytes] == reference[name]["data"], name
            assert list(loc.shape) == reference[name]["shape"] and loc.dtype == "bfloat16"


def _file(tmp_path: Path, header: object, data: bytes = b"", *, raw: bytes | None = None) -> Path:
    body = raw if raw is not None else json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


GOOD = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "words"),
    [
        ([], b"", "not a JSON object"),
        ({"t": [1]}, b"", "entry is not an object"),
        ({"t": {**GOOD, "dtype": 7}}, b"\0" * 8, "not a string"),
        ({"t": {**GOOD, "shape": [-2]}}, b"\0" * 8, "shape"),
        ({"t": {**GOOD, "shape": [True]}}, b"\0" * 8, "shape"),
        ({"t": {**GOOD, "data_offsets": [8, 0]}}, b"\0" * 8, "data_offsets"),
        ({"t": {**GOOD, "data_offsets": [0]}}, b"\0" * 8, "data_offsets"),
        ({"t": {**GOOD, "data_offsets": [0, True]}}, b"\0" * 8, "data_offsets"),
        ({"t": GOOD}, b"\0" * 7, "beyond the file"),
        ({"t": {**GOOD, "shape": [3]}}, b"\0" * 8, "needs 12"),
    ],
    ids=["list", "entry", "dtype-type", "negative-shape", "bool-shape", "reversed", "one-offset", "bool-offset", "short", "size"],
)
def test_malformed_entries_are_refused(tmp_path: Path, header: object, data: bytes, words: str) -> None:
    """Catches an entry that would place a tensor outside the file or give it a size its dtype and
    shape cannot have (a KeyError/TypeError would escape untyped)."""
    with pytest.raises(ManifestParseError) as info:
        read_header(_file(tmp_path, header, data))
    assert words in str(info.value) and "bad.safetensors" in str(info.value)


def test_truncated_oversized_and_non_json_headers_are_refused(tmp_path: Path) -> None:
    """Catches reading a length prefix blindly (a 2**64-1 header length would allocate the world)."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\1\2\3")
    with pytest.raises(ManifestParseError, match="truncated"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 1 << 63))
    with pytest.raises(ManifestParseError, match="exceeds"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(ManifestParseError, match="truncated"):
        read_header(path)
    with pytest.raises(ManifestParseError, match="not JSON"):
        read_header(_file(tmp_path, None, raw=b"{nope"))
    with pytest.raises(MissingObjectError):
        read_header(tmp_path / "missing.safetensors")
    assert read_header(_file(tmp_path, {"__metadata__": {"a": "b"}, "t": GOOD}, b"\0" * 8))["t"].size_bytes == 8


def test_unknown_dtype_code_is_kept_for_provenance(tmp_path: Path) -> None:
    """Catches provenance (read for every checkpoint the vLLM loader opens) failing on a dtype code
    this table does not list, e.g. the sub-byte ``F4``: the code is kept, lowercased, and the size is
    not checked against the shape; staging such a tensor is refused with a clear ValueError."""
    from slabs import stage_checkpoint

    path = _file(tmp_path, {"t": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, b"\0" * 2)
    assert read_header(path)["t"].dtype == "f4"
    with pytest.raises(ValueError, match="'f4'"):
        stage_checkpoint(tmp_path)
