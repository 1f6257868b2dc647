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

from dataclasses import dataclass

from coldsnap_core.format._strict import MAX_OFFSET_BYTES, Fields, is_offset, is_sha256

_PROVENANCE_KEYS = frozenset(
    (
        "checkpoint_file",
        "tensor_name",
        "source_offset_bytes",
        "source_size_bytes",
        "source_run_bytes",
        "source_run_stride_bytes",
        "dtype_converted",
    )
)
_MODEL_EXTENT_KEYS = frozenset(("allocation_index", "offset_bytes", "size_bytes", "pack_offset_bytes", "sha256", "provenance"))
_RESIDUAL_EXTENT_KEYS = frozenset(("allocation_index", "offset_bytes", "size_bytes", "blob_offset_bytes"))


@dataclass(frozen=True, slots=True)
class ExtentProvenance:
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

    checkpoint_file: str
    tensor_name: str
    source_offset_bytes: int
    source_size_bytes: int
    source_run_bytes: int
    source_run_stride_bytes: int
    dtype_converted: bool

    def to_json(self) -> dict[str, object]:
        return {
            "checkpoint_file": self.checkpoint_file,
            "tensor_name": self.tensor_name,
            "source_offset_bytes": self.source_offset_bytes,
            "source_size_bytes": self.source_size_bytes,
            "source_run_bytes": self.source_run_bytes,
            "source_run_stride_bytes": self.source_run_stride_bytes,
            "dtype_converted": self.dtype_converted,
        }

    @classmethod
    def from_plain(cls, raw: object) -> ExtentProvenance | None:
        """:meth:`from_fields`'s result when ``raw`` passes each of its rules, else ``None``."""
        if type(raw) is not dict or raw.keys() != _PROVENANCE_KEYS:
            return None
        provenance = cls(
            raw["checkpoint_file"],
            raw["tensor_name"],
            raw["source_offset_bytes"],
            raw["source_size_bytes"],
            raw["source_run_bytes"],
            raw["source_run_stride_bytes"],
            raw["dtype_converted"],
        )
        if (
            type(provenance.checkpoint_file) is not str
            or not provenance.checkpoint_file
            or type(provenance.tensor_name) is not str
            or not provenance.tensor_name
            or not is_offset(provenance.source_offset_bytes)
            or not is_offset(provenance.source_size_bytes)
            or not is_offset(provenance.source_run_bytes)
            or not is_offset(provenance.source_run_stride_bytes)
            or type(provenance.dtype_converted) is not bool
        ):
            return None
        return provenance

    @classmethod
    def from_fields(cls, f: Fields) -> ExtentProvenance:
        provenance = cls(
            checkpoint_file=f.str("checkpoint_file"),
            tensor_name=f.str("tensor_name"),
            source_offset_bytes=f.int("source_offset_bytes"),
            source_size_bytes=f.int("source_size_bytes"),
            source_run_bytes=f.int("source_run_bytes"),
            source_run_stride_bytes=f.int("source_run_stride_bytes"),
            dtype_converted=f.bool("dtype_converted"),
        )
        f.done()
        return provenance


@dataclass(frozen=True, slots=True)
class ModelExtent:
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

    allocation_index: int
    offset_bytes: int
    size_bytes: int
    pack_offset_bytes: int
    sha256: str
    provenance: ExtentProvenance

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes

    def to_json(self) -> dict[str, object]:
        return {
            "allocation_index": self.allocation_index,
            "offset_bytes": self.offset_bytes,
            "size_bytes": self.size_bytes,
            "pack_offset_bytes": self.pack_offset_bytes,
            "sha256": self.sha256,
            "provenance": self.provenance.to_json(),
        }

    @classmethod
    def from_plain(cls, raw: object) -> ModelExtent | None:
        """:meth:`from_fields`'s result when ``raw`` passes each of its rules, else ``None`` (the fast path
        of :meth:`Fields.list`)."""
        if type(raw) is not dict or raw.keys() != _MODEL_EXTENT_KEYS:
            return None
        placed = _plain_placement(raw, "pack_offset_bytes")
        if placed is None or not is_sha256(raw["sha256"]):
            return None
        provenance = ExtentProvenance.from_plain(raw["provenance"])
        if provenance is None:
            return None
        return cls(*placed, raw["sha256"], provenance)

    @classmethod
    def from_fields(cls, f: Fields) -> ModelExtent:
        extent = cls(
            allocation_index=f.int("allocation_index"),
            offset_bytes=f.int("offset_bytes"),
            size_bytes=f.int("size_bytes", minimum=1),
            pack_offset_bytes=f.int("pack_offset_bytes"),
            sha256=f.sha256("sha256"),
            provenance=f.obj("provenance", ExtentProvenance.from_fields),
        )
        f.done()
        _check_end(f, extent.offset_bytes, extent.size_bytes, "offset_bytes + size_bytes")
        _check_end(f, extent.pack_offset_bytes, extent.size_bytes, "pack_offset_bytes + size_bytes")
        return extent


@dataclass(frozen=True, slots=True)
class ResidualExtent:
    """A destination byte range filled from the worker's ``weights.blob``.

    Attributes:
        allocation_index: the allocation (index in the allocation map) the range lies in.
        offset_bytes: start of the range within the allocation.
        size_bytes: length of the range, > 0.
        blob_offset_bytes: where the range's bytes start in the blob. Residual extents are stored
            back to back, in map order, without padding.
    """

    allocation_index: int
    offset_bytes: int
    size_bytes: int
    blob_offset_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes

    def to_json(self) -> dict[str, object]:
        return {
            "allocation_index": self.allocation_index,
            "offset_bytes": self.offset_bytes,
            "size_bytes": self.size_bytes,
            "blob_offset_bytes": self.blob_offset_bytes,
        }

    @classmethod
    def from_plain(cls, raw: object) -> ResidualExtent | None:
        """:meth:`from_fields`'s result when ``raw`` passes each of its rules, else ``None`` (the fast path
        of :meth:`Fields.list`)."""
        if type(raw) is not dict or raw.keys() != _RESIDUAL_EXTENT_KEYS:
            return None
        placed = _plain_placement(raw, "blob_offset_bytes")
        return None if placed is None else cls(*placed)

    @classmethod
    def from_fields(cls, f: Fields) -> ResidualExtent:
        extent = cls(
            allocation_index=f.int("allocation_index"),
            offset_bytes=f.int("offset_bytes"),
            size_bytes=f.int("size_bytes", minimum=1),
            blob_offset_bytes=f.int("blob_offset_bytes"),
        )
        f.done()
        _check_end(f, extent.offset_bytes, extent.size_bytes, "offset_bytes + size_bytes")
        _check_end(f, extent.blob_offset_bytes, extent.size_bytes, "blob_offset_bytes + size_bytes")
        return extent


def _plain_placement(raw: dict, stored_at: str) -> tuple[int, int, int, int] | None:
    """``(allocation_index, offset_bytes, size_bytes, raw[stored_at])`` of an extent's JSON object when each
    passes :meth:`Fields.int` (``size_bytes`` at least 1) and both ends fit a signed 64-bit offset, else ``None``:
    the part of the extents' fast paths that the two kinds share."""
    index, offset, size, stored = raw["allocation_index"], raw["offset_bytes"], raw["size_bytes"], raw[stored_at]
    if (
        not is_offset(index)
        or not is_offset(offset)
        or not is_offset(size, 1)
        or not is_offset(stored)
        or offset + size > MAX_OFFSET_BYTES
        or stored + size > MAX_OFFSET_BYTES
    ):
        return None
    return index, offset, size, stored


def _check_end(f: Fields, start: int, size: int, what: str) -> None:
    if start + size > MAX_OFFSET_BYTES:
        raise f.error(f"{what} = {start + size} overflows a signed 64-bit offset")
