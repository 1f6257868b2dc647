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


class _Extent(Record):
    """A destination byte range of allocation ``allocation_index``, and where its bytes are stored."""

    allocation_index: Offset
    offset_bytes: Offset
    size_bytes: Count

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes

    def _check_ends(self, source_field: str) -> None:
        """Raises ManifestValueError when the destination's or the source's end does not fit a signed 64-bit offset."""
        for field in ("offset_bytes", source_field):
            end = getattr(self, field) + self.size_bytes
            if end > MAX_OFFSET_BYTES:
                raise ManifestValueError(f"{field} + size_bytes = {end} overflows a signed 64-bit offset")


class ModelExtent(_Extent):
    """A destination byte range filled from ``model-weights.pack`` at ``pack_offset_bytes``."""

    pack_offset_bytes: Offset
    sha256: Sha256
    provenance: ExtentProvenance

    def __post_init__(self) -> None:
        self._check_ends("pack_offset_bytes")


class ResidualExtent(_Extent):
    """A destination byte range filled from the worker's ``weights.blob`` at ``blob_offset_bytes``."""

    blob_offset_bytes: Offset

    def __post_init__(self) -> None:
        self._check_ends("blob_offset_bytes")
