"""The two extent maps that together cover every preserved allocation byte exactly once.

* :class:`ModelExtent`: a byte range that the loader wrote from the checkpoint and that still held
  those bytes when the capture was taken. Its bytes are stored in ``model-weights.pack`` at
  ``pack_offset_bytes`` (shared, content addressed).
* :class:`ResidualExtent`: every other byte (buffers, vocabulary padding, bytes rewritten after
  loading, allocator slack). Its bytes are stored in ``weights.blob`` at ``blob_offset_bytes``
  (target specific, never shared).

Source: ``docs/format.md`` §4.6 and §4.7.
"""

from __future__ import annotations

from coldsnap_core.errors import ManifestValueError
from coldsnap_core.format._strict import MAX_OFFSET_BYTES, Count, Offset, Record, Sha256, Text


class ExtentProvenance(Record):
    """Where a model extent's bytes came from in the checkpoint (informational, never trusted).

    The source is described as ``source_size_bytes`` bytes read from ``checkpoint_file`` in runs of
    ``source_run_bytes`` bytes, the first starting at file offset ``source_offset_bytes`` and each
    next one ``source_run_stride_bytes`` further. A contiguous source has
    ``source_run_bytes == source_run_stride_bytes == source_size_bytes``; a row-parallel shard
    (``narrow`` on dim 1) has one run per row.

    Attributes:
        checkpoint_file: the safetensors file name, relative to the checkpoint folder.
        tensor_name: the tensor's name in that file's header (before any engine renaming).
        source_offset_bytes: absolute file offset of the first source byte (header included).
        source_size_bytes: number of source bytes the copy read.
        source_run_bytes: length of each contiguous source run.
        source_run_stride_bytes: distance between the starts of consecutive runs.
        dtype_converted: whether the copy converted the dtype (then the destination bytes are a
            function of the source bytes, not equal to them).
    """

    checkpoint_file: Text
    tensor_name: Text
    source_offset_bytes: Offset
    source_size_bytes: Offset
    source_run_bytes: Offset
    source_run_stride_bytes: Offset
    dtype_converted: bool


class ModelExtent(Record):
    """A destination byte range filled from ``model-weights.pack``.

    Attributes:
        allocation_index: the allocation (index in the allocation map) the range lies in.
        offset_bytes: start of the range within the allocation.
        size_bytes: length of the range, > 0.
        pack_offset_bytes: where the range's bytes start in the pack; a multiple of 4096.
            Identical extents (same SHA-256 and size) share one ``pack_offset_bytes``.
        sha256: SHA-256 (lowercase hex) of the range's bytes.
        provenance: the checkpoint source of the bytes.
    """

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
    """A destination byte range filled from the worker's ``weights.blob``.

    Attributes:
        allocation_index: the allocation (index in the allocation map) the range lies in.
        offset_bytes: start of the range within the allocation.
        size_bytes: length of the range, > 0.
        blob_offset_bytes: where the range's bytes start in the blob. Residual extents are stored
            back to back, in map order, without padding.
    """

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
    """Raises ValueError when a range's end does not fit a signed 64-bit offset."""
    if start + size > MAX_OFFSET_BYTES:
        raise ManifestValueError(f"{what} = {start + size} overflows a signed 64-bit offset")
