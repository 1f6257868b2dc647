"""The two extent maps that together cover every preserved allocation byte exactly once: model extents (bytes the
loader wrote from the checkpoint, stored in the pack) and residual extents (every other byte, stored in the worker's
blob). Fields: ``docs/format.md`` §4.6 and §4.7.
"""

from __future__ import annotations

from coldsnap_core.errors import ManifestValueError
from coldsnap_core.format._strict import MAX_OFFSET_BYTES, Count, Offset, Record, Sha256, Text


class ExtentProvenance(Record):
    """Where a model extent's bytes came from in the checkpoint (informational, never trusted; ``docs/format.md``
    §4.6): a row-parallel shard (``narrow`` on dim 1) is read in one run per row."""

    checkpoint_file: Text
    tensor_name: Text
    source_offset_bytes: Offset
    source_size_bytes: Offset
    source_run_bytes: Offset
    source_run_stride_bytes: Offset
    dtype_converted: bool


class ModelExtent(Record):
    """A destination byte range filled from ``model-weights.pack`` at ``pack_offset_bytes``."""

    allocation_index: Offset
    offset_bytes: Offset
    size_bytes: Count
    pack_offset_bytes: Offset
    sha256: Sha256
    provenance: ExtentProvenance

    def __post_init__(self) -> None:
        _check_end(self.offset_bytes, self.size_bytes, "offset_bytes + size_bytes")
        _check_end(self.pack_offset_bytes, self.size_bytes, "pack_offset_bytes + size_bytes")

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


class ResidualExtent(Record):
    """A destination byte range filled from the worker's ``weights.blob`` at ``blob_offset_bytes``."""

    allocation_index: Offset
    offset_bytes: Offset
    size_bytes: Count
    blob_offset_bytes: Offset

    def __post_init__(self) -> None:
        _check_end(self.offset_bytes, self.size_bytes, "offset_bytes + size_bytes")
        _check_end(self.blob_offset_bytes, self.size_bytes, "blob_offset_bytes + size_bytes")

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


def _check_end(start: int, size: int, what: str) -> None:
    """Raises ManifestValueError when a range's end does not fit a signed 64-bit offset."""
    if start + size > MAX_OFFSET_BYTES:
        raise ManifestValueError(f"{what} = {start + size} overflows a signed 64-bit offset")
