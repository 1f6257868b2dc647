"""The verifier: every rule a payload must pass before a single byte of it is served.

One set of functions serves the CLI (``coldsnap verify``), the loaders (hydration), staging, the
cache's first-use admission and publication (``DESIGN.md``, "The node-local cache and the verifier").

* :func:`check_manifest`: the manifest alone (no files): fingerprint, pack path, extent bounds,
  order, disjointness, coverage, canonical pack and blob layout.
* :func:`check_live_layout`: the manifest against the live allocations (layout fingerprint, sizes).
* :func:`verify_pack_file`: the pack object: size first, then one streaming pass that computes the
  file's SHA-256, checks the zero padding and, given a layout, each stored extent's SHA-256 (on a
  second thread).
* :func:`verify_blob_file`: the residual blob: size, then SHA-256.
* :func:`check_pack_padding`: the padding of an already admitted pack (a few KiB of reads).

Each failure raises its own :mod:`coldsnap_core.errors` class naming file, allocation, offset, rule.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coldsnap_core._io import HASH_CHUNK_BYTES
from coldsnap_core.copy.base import LiveAllocation
from coldsnap_core.digests import pack_relpath
from coldsnap_core.errors import (
    AllocationSizeMismatchError,
    CoverageGapError,
    ExtentBoundsError,
    ExtentDigestMismatchError,
    ExtentOrderError,
    ExtentOverlapError,
    LayoutMismatchError,
    MissingObjectError,
    NonZeroPaddingError,
    PackDigestMismatchError,
    PackLayoutError,
    PackPathMismatchError,
    PackSizeMismatchError,
    ResidualDigestMismatchError,
    ResidualLayoutError,
    ResidualSizeMismatchError,
)
from coldsnap_core.format.allocation import AllocationMap
from coldsnap_core.format.manifest import NativeManifest, PackRef, ResidualRef
from coldsnap_core.format.pack_layout import PackEntry, PackLayout

VERIFIER_VERSION = "coldsnap-verifier/1"
"""Recorded in validation records; a record written by another verifier version is not trusted."""


# --- the manifest alone ---------------------------------------------------------------------------


def check_manifest(manifest: NativeManifest, *, file: str | None = None) -> PackLayout:
    """Check every rule that needs no file besides the manifest; return the pack layout it implies.

    Raises:
        LayoutMismatchError: ``layout_fingerprint`` is not the fingerprint of ``allocations``
            (e.g. an allocation's ``size_bytes`` was edited).
        PackPathMismatchError: ``pack.path`` is not ``model-payloads/sha256/<pack.sha256>.pack``.
        ExtentBoundsError: an extent names a missing allocation or ends beyond its allocation.
        ExtentOrderError: an extent map is not sorted by (allocation_index, offset_bytes).
        ExtentOverlapError: two extents cover the same byte.
        CoverageGapError: a byte is covered by no extent.
        PackLayoutError: the model extents do not describe the canonical pack of ``pack.size_bytes``.
        ResidualLayoutError: the residual extents do not describe the blob.
    """
    actual = manifest.allocations.layout_fingerprint()
    if actual != manifest.layout_fingerprint:
        raise LayoutMismatchError(
            f"the allocation map hashes to {actual}, the manifest records {manifest.layout_fingerprint}", file=file
        )
    if manifest.pack.path != pack_relpath(manifest.pack.sha256):
        raise PackPathMismatchError(
            f"pack path {manifest.pack.path!r} is not the path of its SHA-256 ({pack_relpath(manifest.pack.sha256)!r})",
            file=file,
        )
    check_coverage(manifest, file=file)
    layout = check_pack_layout(manifest, file=file)
    check_residual_layout(manifest.residual_extents, manifest.residual, file=file)
    return layout


def check_coverage(manifest: NativeManifest, *, file: str | None = None) -> None:
    """Bounds, order, disjointness and coverage of the two maps over every allocation."""
    allocations = manifest.allocations
    per_allocation: list[list[tuple[int, int, str]]] = [[] for _ in allocations.allocations]
    for kind, extents in (("model", manifest.model_extents), ("residual", manifest.residual_extents)):
        previous = (-1, -1)
        for i, extent in enumerate(extents):
            key = (extent.allocation_index, extent.offset_bytes)
            if key <= previous:
                raise ExtentOrderError(
                    f"{kind} extent {i} is not after extent {i - 1} in (allocation_index, offset_bytes) order",
                    file=file,
                    allocation=extent.allocation_index,
                    offset_bytes=extent.offset_bytes,
                )
            previous = key
            if extent.allocation_index >= len(allocations):
                raise ExtentBoundsError(
                    f"{kind} extent {i} names allocation {extent.allocation_index}, but there are {len(allocations)}",
                    file=file,
                    allocation=extent.allocation_index,
                    offset_bytes=extent.offset_bytes,
                )
            size = allocations[extent.allocation_index].size_bytes
            if extent.end_bytes > size:
                raise ExtentBoundsError(
                    f"{kind} extent {i} ends at byte {extent.end_bytes}, beyond the allocation's {size} bytes",
                    file=file,
                    allocation=extent.allocation_index,
                    offset_bytes=extent.offset_bytes,
                )
            per_allocation[extent.allocation_index].append((extent.offset_bytes, extent.end_bytes, f"{kind} extent {i}"))
    for allocation, intervals in zip(allocations.allocations, per_allocation, strict=True):
        intervals.sort()
        position, last = 0, None
        for start, end, name in intervals:
            if start < position:
                raise ExtentOverlapError(
                    f"{name} starts at byte {start}, inside {last} which ends at byte {position}",
                    file=file,
                    allocation=allocation.index,
                    offset_bytes=start,
                )
            if start > position:
                raise CoverageGapError(
                    f"bytes [{position}, {start}) are in neither map",
                    file=file,
                    allocation=allocation.index,
                    offset_bytes=position,
                )
            position, last = end, name
        if position < allocation.size_bytes:
            raise CoverageGapError(
                f"bytes [{position}, {allocation.size_bytes}) are in neither map",
                file=file,
                allocation=allocation.index,
                offset_bytes=position,
            )


def check_pack_layout(manifest: NativeManifest, *, file: str | None = None) -> PackLayout:
    """The model extents must describe the canonical pack (``coldsnap_core.format.pack_layout``)."""
    layout = PackLayout.plan((e.sha256, e.size_bytes) for e in manifest.model_extents)
    offsets = layout.offsets()
    for i, extent in enumerate(manifest.model_extents):
        expected = offsets[(extent.sha256, extent.size_bytes)]
        if extent.pack_offset_bytes != expected:
            raise PackLayoutError(
                f"model extent {i} is at pack offset {extent.pack_offset_bytes}; the canonical layout puts it at {expected}",
                file=file,
                allocation=extent.allocation_index,
                offset_bytes=extent.offset_bytes,
            )
    if manifest.pack.size_bytes != layout.size_bytes:
        raise PackLayoutError(
            f"pack size_bytes is {manifest.pack.size_bytes}; the canonical layout of the model extents is {layout.size_bytes}",
            file=file,
        )
    return layout


def check_residual_layout(extents: Sequence, residual: ResidualRef, *, file: str | None = None) -> None:
    """Residual extents are stored back to back in map order from blob offset 0."""
    position = 0
    for i, extent in enumerate(extents):
        if extent.blob_offset_bytes != position:
            raise ResidualLayoutError(
                f"residual extent {i} is at blob offset {extent.blob_offset_bytes}, expected {position}",
                file=file,
                allocation=extent.allocation_index,
                offset_bytes=extent.offset_bytes,
            )
        position += extent.size_bytes
    if position != residual.size_bytes:
        raise ResidualLayoutError(
            f"residual extents hold {position} bytes, the blob's size_bytes is {residual.size_bytes}", file=file
        )


# --- the manifest against the live allocations ----------------------------------------------------


def check_live_layout(
    manifest_allocations: AllocationMap,
    live: AllocationMap | None,
    allocations: Sequence[LiveAllocation],
    *,
    file: str | None = None,
) -> None:
    """The live model must have the captured layout, allocation for allocation.

    Args:
        manifest_allocations: the manifest's allocation map.
        live: the live model's allocation map (names, dtypes, shapes, ...), or ``None`` when only
            sizes are known (the native capture point compares segments by size).
        allocations: the live allocations' addresses and sizes.

    Raises:
        LayoutMismatchError: the fingerprints differ (names the first differing allocation/tensor)
            or the number of allocations differs.
        AllocationSizeMismatchError: a live allocation's size differs from the manifest's.
    """
    if live is not None and live.layout_fingerprint() != manifest_allocations.layout_fingerprint():
        raise LayoutMismatchError(_first_layout_difference(manifest_allocations, live), file=file)
    if len(allocations) != len(manifest_allocations):
        raise LayoutMismatchError(
            f"the live model has {len(allocations)} allocations, the manifest {len(manifest_allocations)}", file=file
        )
    for expected, actual in zip(manifest_allocations.allocations, allocations, strict=True):
        if actual.index != expected.index or actual.size_bytes != expected.size_bytes:
            raise AllocationSizeMismatchError(
                f"live allocation is {actual.size_bytes} bytes, the manifest records {expected.size_bytes}",
                file=file,
                allocation=expected.index,
                offset_bytes=0,
            )


def _first_layout_difference(expected: AllocationMap, actual: AllocationMap) -> str:
    for a, b in zip(expected.allocations, actual.allocations, strict=False):
        if a.size_bytes != b.size_bytes or a.tag != b.tag or len(a.tensors) != len(b.tensors):
            names = a.tensors[0].name if a.tensors else "?"
            return (
                f"layout differs at allocation {a.index} ({names}): manifest {a.size_bytes} bytes/{a.tag}/"
                f"{len(a.tensors)} tensors, live {b.size_bytes} bytes/{b.tag}/{len(b.tensors)} tensors"
            )
        for ta, tb in zip(a.tensors, b.tensors, strict=True):
            if ta != tb:
                return (
                    f"layout differs at allocation {a.index}: manifest tensor {ta.name} {ta.dtype}{list(ta.shape)}, "
                    f"live tensor {tb.name} {tb.dtype}{list(tb.shape)}"
                )
    return f"the manifest has {len(expected)} allocations, the live model {len(actual)}"


# --- files ----------------------------------------------------------------------------------------


def _require_size(path: Path, expected: int, error: type[Exception], what: str) -> None:
    try:
        actual = os.stat(path).st_size
    except FileNotFoundError as exc:
        raise MissingObjectError(f"{what} does not exist", file=path) from exc
    if actual != expected:
        state = "truncated" if actual < expected else "extended"
        raise error(f"{what} is {actual} bytes, expected {expected} ({state})", file=path)


def verify_pack_file(
    path: str | os.PathLike[str],
    pack: PackRef,
    layout: PackLayout | None = None,
    *,
    progress: Callable[[int], object] | None = None,
    extent_owner: Callable[[PackEntry], tuple[int | None, int | None]] | None = None,
) -> None:
    """Verify a pack object in full: size, SHA-256, and with ``layout`` its padding and extents.

    One sequential read: the main thread hashes the file while a helper thread hashes each stored
    extent, and padding bytes are compared with zeros as they stream past.

    Args:
        path: the pack file.
        pack: digest and size the file must have.
        layout: the canonical layout (from :func:`check_manifest`), or ``None`` for a bare object
            check (cache admission, publication).
        progress: called with the number of bytes read after each chunk.
        extent_owner: maps a stored entry to ``(allocation_index, offset_bytes)`` of one
            destination holding it, for error messages.

    Raises:
        MissingObjectError: no file at ``path``.
        PackSizeMismatchError: truncated or extended (checked before any hashing).
        NonZeroPaddingError: a padding byte is not zero.
        ExtentDigestMismatchError: a stored extent's bytes do not match its SHA-256.
        PackDigestMismatchError: the file's SHA-256 is not ``pack.sha256``.
    """
    path = Path(path)
    _require_size(path, pack.size_bytes, PackSizeMismatchError, "pack")
    entries = layout.entries if layout is not None else ()
    padding = list(layout.padding_ranges()) if layout is not None else []
    file_hash = hashlib.sha256()
    bad_padding: int | None = None
    bad_entry: tuple[PackEntry, str] | None = None
    entry_hashes = [hashlib.sha256() for _ in entries]
    zeros = bytes(HASH_CHUNK_BYTES)

    def hash_entries(chunk_offset: int, chunk: memoryview, first: int) -> int:
        """Feed the chunk's part of each stored extent into that extent's hash (helper thread)."""
        chunk_end = chunk_offset + len(chunk)
        i = first
        while i < len(entries) and entries[i].offset_bytes < chunk_end:
            entry = entries[i]
            lo = max(entry.offset_bytes, chunk_offset)
            hi = min(entry.end_bytes, chunk_end)
            if lo < hi:
                entry_hashes[i].update(chunk[lo - chunk_offset : hi - chunk_offset])
            if entry.end_bytes > chunk_end:
                break
            i += 1
        return i

    buffers = [bytearray(HASH_CHUNK_BYTES), bytearray(HASH_CHUNK_BYTES)]
    next_entry = 0
    pad_index = 0
    offset = 0
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(max_workers=1, thread_name_prefix="coldsnap-verify") as pool:
        pending = None
        turn = 0
        while True:
            view = memoryview(buffers[turn])
            n = f.readinto(view)
            if not n:
                break
            chunk = view[:n]
            if entries:
                if pending is not None:
                    next_entry = pending.result()
                pending = pool.submit(hash_entries, offset, chunk, next_entry)
            end = offset + n
            while pad_index < len(padding) and padding[pad_index][0] < end:
                pad_start, pad_size = padding[pad_index]
                lo, hi = max(pad_start, offset), min(pad_start + pad_size, end)
                if lo < hi and bad_padding is None and chunk[lo - offset : hi - offset] != zeros[: hi - lo]:
                    piece = bytes(chunk[lo - offset : hi - offset])
                    bad_padding = lo + next(i for i, b in enumerate(piece) if b)
                if pad_start + pad_size > end:
                    break
                pad_index += 1
            file_hash.update(chunk)
            if progress is not None:
                progress(n)
            offset = end
            turn ^= 1
        if pending is not None:
            pending.result()
    for entry, h in zip(entries, entry_hashes, strict=True):
        digest = h.hexdigest()
        if digest != entry.sha256:
            bad_entry = (entry, digest)
            break
    if bad_padding is not None:
        raise NonZeroPaddingError("a padding byte between pack extents is not zero", file=path, offset_bytes=bad_padding)
    if bad_entry is not None:
        entry, digest = bad_entry
        allocation, dest_offset = extent_owner(entry) if extent_owner else (None, None)
        raise ExtentDigestMismatchError(
            f"the extent stored at pack offset {entry.offset_bytes} ({entry.size_bytes} bytes) has SHA-256 {digest},"
            f" the manifest records {entry.sha256}",
            file=path,
            allocation=allocation,
            offset_bytes=dest_offset,
        )
    digest = file_hash.hexdigest()
    if digest != pack.sha256:
        raise PackDigestMismatchError(f"the pack's SHA-256 is {digest}, its digest and path say {pack.sha256}", file=path)


def check_pack_padding(path: str | os.PathLike[str], layout: PackLayout) -> None:
    """Read only the padding runs of an (already admitted) pack and require zeros.

    Raises:
        NonZeroPaddingError: a padding byte is not zero (names its file offset).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for start, size in layout.padding_ranges():
            data = os.pread(fd, size, start)
            if data.count(0) != size:
                first = next(i for i, b in enumerate(data) if b)
                raise NonZeroPaddingError(
                    "a padding byte between pack extents is not zero", file=path, offset_bytes=start + first
                )
    finally:
        os.close(fd)


def verify_blob_file(path: str | os.PathLike[str], residual: ResidualRef) -> None:
    """Verify a residual blob: size first, then SHA-256.

    Raises:
        MissingObjectError: no file at ``path``.
        ResidualSizeMismatchError: truncated or extended.
        ResidualDigestMismatchError: the SHA-256 differs from the manifest's.
    """
    from coldsnap_core._io import sha256_file

    path = Path(path)
    _require_size(path, residual.size_bytes, ResidualSizeMismatchError, "residual blob")
    digest, _ = sha256_file(path)
    if digest != residual.sha256:
        raise ResidualDigestMismatchError(
            f"the residual blob's SHA-256 is {digest}, the manifest records {residual.sha256}", file=path
        )


def extent_owner_map(manifest: NativeManifest) -> Callable[[PackEntry], tuple[int | None, int | None]]:
    """For error messages: the first destination (allocation, offset) holding each stored extent."""
    owners: dict[tuple[str, int], tuple[int, int]] = {}
    for extent in manifest.model_extents:
        owners.setdefault((extent.sha256, extent.size_bytes), (extent.allocation_index, extent.offset_bytes))

    def owner(entry: PackEntry) -> tuple[int | None, int | None]:
        return owners.get((entry.sha256, entry.size_bytes), (None, None))

    return owner
