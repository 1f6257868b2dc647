"""The verifier: every rule a payload must pass before a single byte of it is served.

One set of functions serves the CLI (``coldsnap verify``), the loaders (hydration), staging, the
cache's first-use admission and publication (``docs/format.md`` §7, "Verification rules and errors").

* :func:`check_manifest`: the manifest alone (no files): fingerprint, pack path, extent bounds,
  order, disjointness, coverage, canonical pack and blob layout.
* :func:`check_live_layout`: the manifest against the live allocations (layout fingerprint, sizes).
* :func:`verify_pack_file`: the pack object: size first, then one streaming pass that computes the
  file's SHA-256, checks the zero padding and, given a layout, each stored extent's SHA-256 (on a
  second thread). The file's SHA-256 decides who is wrong: a pack that hashes to its name is intact,
  and a layout or extent digest that does not describe it is a manifest error (exit code 2).
* :func:`pack_matches_layout`: whether an open pack is exactly the canonical pack of a layout (every
  stored extent's SHA-256 and every padding byte, on a pool of threads): the first-use admission of
  a restore; its failures are judged by :func:`verify_pack_file`.
* :func:`verify_blob_file`: the residual blob: size, then SHA-256.
* :func:`check_pack_padding`: the padding of an already admitted pack (a few KiB of reads).

Each failure raises its own :mod:`coldsnap_core.errors` class naming file, allocation, offset, rule.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from coldsnap_core._io import HASH_CHUNK_BYTES, open_regular, os_error, sha256_file
from coldsnap_core.digests import pack_relpath
from coldsnap_core.errors import (
    AllocationSizeMismatchError,
    CoverageGapError,
    ExtentBoundsError,
    ExtentDigestMismatchError,
    ExtentOrderError,
    ExtentOverlapError,
    LayoutMismatchError,
    ManifestExtentDigestError,
    ManifestPaddingError,
    MissingObjectError,
    NonZeroPaddingError,
    NotRegularFileError,
    PackDigestMismatchError,
    PackLayoutError,
    PackPathMismatchError,
    PackSizeMismatchError,
    ResidualDigestMismatchError,
    ResidualLayoutError,
    ResidualSizeMismatchError,
    size_mismatch,
)
from coldsnap_core.format.allocation import AllocationMap, LiveAllocation
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
    sizes = [a.size_bytes for a in allocations.allocations]
    count = len(sizes)
    per_allocation: list[list[tuple[int, int, str]]] = [[] for _ in sizes]
    for kind, extents in (("model", manifest.model_extents), ("residual", manifest.residual_extents)):
        previous = (-1, -1)
        for i, extent in enumerate(extents):
            key = (extent.allocation_index, extent.offset_bytes)
            if key <= previous:
                raise ExtentOrderError(
                    f"{kind} extent {i} starts at ({key[0]}, {key[1]}), not after {kind} extent {i - 1} at"
                    f" ({previous[0]}, {previous[1]}) in (allocation_index, offset_bytes) order",
                    file=file,
                    allocation=extent.allocation_index,
                    offset_bytes=extent.offset_bytes,
                )
            previous = key
            if extent.allocation_index >= count:
                raise ExtentBoundsError(
                    f"{kind} extent {i} names allocation {extent.allocation_index}, but there are {count}",
                    file=file,
                    allocation=extent.allocation_index,
                    offset_bytes=extent.offset_bytes,
                )
            size = sizes[extent.allocation_index]
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
    manifest_fingerprint: str | None = None,
) -> None:
    """The live model must have the captured layout, allocation for allocation.

    Args:
        manifest_allocations: the manifest's allocation map.
        live: the live model's allocation map (names, dtypes, shapes, ...), or ``None`` when only
            sizes are known (the native capture point compares segments by size).
        allocations: the live allocations' addresses and sizes, ``allocations[i].index == i``.
        file: the manifest's path, for error messages.
        manifest_fingerprint: the manifest's layout fingerprint when the caller already checked it
            (:func:`check_manifest`); computed from ``manifest_allocations`` otherwise.

    Raises:
        LayoutMismatchError: the fingerprints differ (names the first differing allocation/tensor),
            the number of allocations differs, or ``allocations`` is not in index order.
        AllocationSizeMismatchError: a live allocation's size differs from the manifest's.
    """
    if live is not None:
        expected = manifest_fingerprint or manifest_allocations.layout_fingerprint()
        # Equal maps have equal fingerprints: the manifest's, computed once and kept for check_manifest.
        same = live.allocations == manifest_allocations.allocations
        actual = manifest_allocations.layout_fingerprint() if same else live.layout_fingerprint()
        if actual != expected:
            raise LayoutMismatchError(_first_layout_difference(manifest_allocations, live), file=file)
    if len(allocations) != len(manifest_allocations):
        raise LayoutMismatchError(
            f"the live model has {len(allocations)} allocations, the manifest {len(manifest_allocations)}", file=file
        )
    for expected_allocation, actual in zip(manifest_allocations.allocations, allocations, strict=True):
        if actual.index != expected_allocation.index:
            raise LayoutMismatchError(
                f"live allocation at position {expected_allocation.index} has index {actual.index}",
                file=file,
                allocation=expected_allocation.index,
            )
        if actual.size_bytes != expected_allocation.size_bytes:
            raise AllocationSizeMismatchError(
                f"live allocation is {actual.size_bytes} bytes, the manifest records {expected_allocation.size_bytes}",
                file=file,
                allocation=expected_allocation.index,
                offset_bytes=min(actual.size_bytes, expected_allocation.size_bytes),
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


def _require_size(path: Path, expected: int, error: type[Exception], what: str, *, opened: str | None = None) -> None:
    """``path`` must be a regular file (symbolic links followed) of ``expected`` bytes.

    Raises:
        MissingObjectError: nothing at ``path``.
        NotRegularFileError: a folder, device, socket or FIFO at ``path`` (its ``st_size`` says
            nothing about content, so it must not be reported as truncated or extended).
        FileAccessError: ``path`` cannot be examined (``EACCES``, ``ELOOP``, ``EIO``, ...).
        ``error``: the size differs.
    """
    try:
        st = os.stat(opened if opened is not None else path)
    except FileNotFoundError as exc:
        raise MissingObjectError(f"{what} does not exist", file=path) from exc
    except OSError as exc:
        raise os_error(f"cannot examine the {what}", exc, path) from exc
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(f"the {what} is not a regular file ({stat.filemode(st.st_mode)})", file=path)
    mismatch = size_mismatch(error, what, st.st_size, expected, file=path)
    if mismatch is not None:
        raise mismatch


def verify_pack_file(
    path: str | os.PathLike[str],
    pack: PackRef,
    layout: PackLayout | None = None,
    *,
    progress: Callable[[int], object] | None = None,
    extent_owner: Callable[[PackEntry], tuple[int | None, int | None]] | None = None,
    chunk_bytes: int = HASH_CHUNK_BYTES,
    manifest_file: str | os.PathLike[str] | None = None,
) -> None:
    """Verify a pack object in full: size, SHA-256, and with ``layout`` its padding and extents.

    One sequential read in ``chunk_bytes`` chunks (two buffers, so at most ``2 * chunk_bytes`` of
    the pack is in memory): the main thread hashes the file and compares the padding bytes with zero
    as they stream past, while a helper thread feeds each stored extent's bytes into that extent's
    own SHA-256 (an extent may span any number of chunks).

    Checks, and the error raised first, in this order: the file exists and is a regular file, its
    size; then, after the one read, who is wrong is decided by the file's SHA-256, because the pack
    is content addressed (its name is the SHA-256 of its bytes):

    * the file's SHA-256 differs from ``pack.sha256``: the **object is corrupt** (exit code 1) and
      the most precise error is raised: its padding (:class:`NonZeroPaddingError`), else the first
      bad stored extent in pack order (:class:`ExtentDigestMismatchError`), else
      :class:`PackDigestMismatchError`;
    * the file's SHA-256 matches but a padding run or a stored extent does not match ``layout``:
      the object holds exactly the bytes its name promises and **the manifest is wrong** about them
      (exit code 2, :class:`ManifestPaddingError` / :class:`ManifestExtentDigestError`); callers do
      not quarantine the object for that, so other artifacts naming the same digest keep it.

    Args:
        path: the pack file.
        pack: digest and size the file must have.
        layout: the canonical layout (from :func:`check_manifest`), or ``None`` for a bare object
            check (cache admission, publication).
        progress: called with the number of bytes read after each chunk.
        extent_owner: maps a stored entry to ``(allocation_index, offset_bytes)`` of one
            destination holding it, for error messages.
        chunk_bytes: bytes per read (default 8 MiB), > 0.
        manifest_file: the manifest ``layout`` comes from, named by the manifest errors (default:
            they name the pack).

    Raises:
        MissingObjectError: no file at ``path``.
        NotRegularFileError: ``path`` is a folder or another non-regular file.
        FileAccessError: ``path`` cannot be opened or read (``EACCES``, ``ELOOP``, ``EIO``, ...).
        PackSizeMismatchError: truncated or extended (checked before any hashing).
        NonZeroPaddingError: the object is corrupt and a padding byte is not zero (names its pack offset).
        ExtentDigestMismatchError: the object is corrupt and a stored extent's bytes do not match its
            SHA-256 (names the destination allocation and offset from ``extent_owner``).
        PackDigestMismatchError: the file's SHA-256 is not ``pack.sha256``.
        ManifestPaddingError: the object is intact, but the manifest's layout puts padding on a
            non-zero byte.
        ManifestExtentDigestError: the object is intact, but a stored extent's bytes do not match
            the SHA-256 the manifest records for it.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    path = Path(path)
    _require_size(path, pack.size_bytes, PackSizeMismatchError, "pack")
    read = _read_pack(path, layout, chunk_bytes, progress)
    mismatch = size_mismatch(
        PackSizeMismatchError, "pack changed while being read: what was read", read.size_bytes, pack.size_bytes, file=path
    )
    if mismatch is not None:
        raise mismatch
    entries = layout.entries if layout is not None else ()
    bad_extent = next(((e, d) for e, d in zip(entries, read.extent_sha256, strict=True) if d != e.sha256), None)
    where = extent_owner(bad_extent[0]) if bad_extent is not None and extent_owner else (None, None)
    if read.sha256 != pack.sha256:
        _raise_corrupt_pack(path, pack, read, bad_extent, where)
    _raise_wrong_manifest(path, read.bad_padding, bad_extent, where, path if manifest_file is None else manifest_file)


ADMIT_MAX_THREADS = 8
"""At most this many threads check a pack's extents (:func:`admission_threads`)."""


def admission_threads() -> int:
    """Threads of :func:`pack_matches_layout`: the usable cores (``os.sched_getaffinity``), at most
    :data:`ADMIT_MAX_THREADS`."""
    return max(1, min(ADMIT_MAX_THREADS, len(os.sched_getaffinity(0))))


def pack_matches_layout(
    fd: int,
    layout: PackLayout,
    *,
    file: str | os.PathLike[str],
    threads: int,
    chunk_bytes: int = HASH_CHUNK_BYTES,
    progress: Callable[[int], object] | None = None,
) -> bool:
    """Whether the file open at ``fd`` holds exactly the canonical pack of ``layout``.

    Each stored extent is read with ``os.preadv`` in ``chunk_bytes`` chunks together with the padding
    after it (up to the next extent, or the end of the pack) and hashed, on ``threads`` threads that take
    the extents largest first (``hashlib`` and ``preadv`` release the GIL). Extents and padding runs tile
    ``[0, layout.size_bytes)``, so when each extent's SHA-256 matches, every padding byte is zero and the
    file ends where the layout does, the file's bytes are the canonical pack of the layout's contents
    (``docs/format.md`` §10, "Admission"). Whether they also hash to the pack's name is not checked here.

    Returns ``False`` at the first disagreement without saying which: a caller judges a failure with
    :func:`verify_pack_file`, which names the extent or padding offset and decides who is wrong.

    Args:
        fd: the pack, open for reading; the caller checked its size.
        file: the pack's path, for error messages.
        layout: the canonical layout (from :func:`check_manifest`).
        threads: worker threads (:func:`admission_threads`), > 0.
        chunk_bytes: bytes per read (default 8 MiB), > 0.
        progress: called on the calling thread with the bytes of each extent and its padding once checked.

    Raises:
        FileAccessError: a read fails (``EIO``, ...).
    """
    entries = layout.entries
    if not entries or entries[0].offset_bytes != 0:
        return not entries and layout.size_bytes == 0
    ends = [*(e.offset_bytes for e in entries[1:]), layout.size_bytes]
    order = sorted(range(len(entries)), key=lambda i: -entries[i].size_bytes)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="coldsnap-admit")
    try:
        checked = pool.map(lambda i: _stored_extent_matches(fd, entries[i], ends[i], chunk_bytes, file), order)
        for i, matches in zip(order, checked, strict=True):
            if not matches:
                return False
            if progress is not None:
                progress(ends[i] - entries[i].offset_bytes)
    finally:
        pool.shutdown(cancel_futures=True)
    return True


_read_buffers = threading.local()


def _stored_extent_matches(fd: int, entry: PackEntry, end_bytes: int, chunk_bytes: int, file: str | os.PathLike[str]) -> bool:
    """Whether the pack bytes ``[entry.offset_bytes, end_bytes)`` are the extent's content (its SHA-256) followed
    by zeros (one task of :func:`pack_matches_layout`, on a pool thread; one reused buffer per thread)."""
    buffer = getattr(_read_buffers, "buffer", None)
    if buffer is None or len(buffer) != chunk_bytes:
        buffer = _read_buffers.buffer = memoryview(bytearray(chunk_bytes))
    digest = hashlib.sha256()
    position = entry.offset_bytes
    while position < end_bytes:
        try:
            n = os.preadv(fd, [buffer[: min(chunk_bytes, end_bytes - position)]], position)
        except OSError as exc:
            raise os_error(f"reading the pack at offset {position} failed", exc, file) from exc
        if not n:
            return False  # the file ends early
        content = max(0, min(n, entry.end_bytes - position))
        digest.update(buffer[:content])
        if buffer[content:n].tobytes().lstrip(b"\0"):  # padding: under 4096 bytes per extent
            return False
        position += n
    return digest.hexdigest() == entry.sha256


@dataclass(frozen=True, slots=True)
class _PackRead:
    """What one pass over a pack found: bytes read, the file's SHA-256, the pack offset of the first non-zero padding
    byte (``None``: all zero) and the SHA-256 of each stored extent, in layout order."""

    size_bytes: int
    sha256: str
    bad_padding: int | None
    extent_sha256: list[str]


def _hash_extents(entries: Sequence[PackEntry], hashes: list[Any], chunk_offset: int, chunk: memoryview, first: int) -> int:
    """Feed the chunk's part of each stored extent into that extent's hash; return the index of the first extent not
    finished by this chunk (run on the helper thread)."""
    chunk_end = chunk_offset + len(chunk)
    i = first
    while i < len(entries) and entries[i].offset_bytes < chunk_end:
        entry = entries[i]
        lo, hi = max(entry.offset_bytes, chunk_offset), min(entry.end_bytes, chunk_end)
        if lo < hi:
            hashes[i].update(chunk[lo - chunk_offset : hi - chunk_offset])
        if entry.end_bytes > chunk_end:
            break
        i += 1
    return i


def _nonzero_padding(padding: list[tuple[int, int]], index: int, chunk: memoryview, offset: int) -> tuple[int, int | None]:
    """Compare the chunk's part of each padding run from ``padding[index]`` on with zero; return the index of the first
    run not finished by this chunk and the pack offset of the first non-zero byte (``None``: all zero)."""
    end, bad = offset + len(chunk), None
    while index < len(padding) and padding[index][0] < end:
        pad_start, pad_size = padding[index]
        lo, hi = max(pad_start, offset), min(pad_start + pad_size, end)
        piece = chunk[lo - offset : hi - offset].tobytes()  # a run is shorter than the 4096-byte alignment
        rest = piece.lstrip(b"\0")
        if rest and bad is None:
            bad = lo + len(piece) - len(rest)
        if pad_start + pad_size > end:
            break
        index += 1
    return index, bad


def _read_pack(path: Path, layout: PackLayout | None, chunk_bytes: int, progress: Callable[[int], object] | None) -> _PackRead:
    """One sequential read of the pack in ``chunk_bytes`` chunks, double-buffered: the calling thread hashes the file
    and checks the padding as it streams past while a helper thread hashes the stored extents (an extent may span any
    number of chunks), so at most ``2 * chunk_bytes`` of the pack is in memory.

    Raises:
        FileAccessError: the pack cannot be opened or read.
    """
    entries = layout.entries if layout is not None else ()
    padding = list(layout.padding_ranges()) if layout is not None else []
    file_hash, extent_hashes = hashlib.sha256(), [hashlib.sha256() for _ in entries]
    buffers = [bytearray(chunk_bytes), bytearray(chunk_bytes)]
    next_entry = pad_index = offset = turn = 0
    bad_padding: int | None = None
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by the with statement below)
    except OSError as exc:
        raise os_error("cannot open the pack", exc, path) from exc
    with f, ThreadPoolExecutor(max_workers=1, thread_name_prefix="coldsnap-verify") as pool:
        pending = None
        while True:
            # The helper may still hash buffers[turn ^ 1]; buffers[turn] was released by the
            # ``pending.result()`` of the previous round.
            view = memoryview(buffers[turn])
            try:
                n = f.readinto(view)
            except OSError as exc:
                raise os_error(f"reading the pack at offset {offset} failed", exc, path) from exc
            if not n:
                break
            chunk = view[:n]
            if entries:
                if pending is not None:
                    next_entry = pending.result()
                pending = pool.submit(_hash_extents, entries, extent_hashes, offset, chunk, next_entry)
            pad_index, bad = _nonzero_padding(padding, pad_index, chunk, offset)
            bad_padding = bad if bad_padding is None else bad_padding
            file_hash.update(chunk)
            if progress is not None:
                progress(n)
            offset += n
            turn ^= 1
        if pending is not None:
            pending.result()
    return _PackRead(offset, file_hash.hexdigest(), bad_padding, [h.hexdigest() for h in extent_hashes])


def _raise_corrupt_pack(
    path: Path,
    pack: PackRef,
    read: _PackRead,
    bad_extent: tuple[PackEntry, str] | None,
    where: tuple[int | None, int | None],
) -> NoReturn:
    """The object is corrupt (its SHA-256 is not its name): raise the most precise error (:func:`verify_pack_file`)."""
    if read.bad_padding is not None:
        raise NonZeroPaddingError(
            f"padding byte at pack offset {read.bad_padding} is not zero (padding runs from each extent's end to the next"
            " 4096-byte boundary)",
            file=path,
            offset_bytes=read.bad_padding,
        )
    if bad_extent is not None:
        entry, digest = bad_extent
        raise ExtentDigestMismatchError(
            f"the extent stored at pack offset {entry.offset_bytes} ({entry.size_bytes} bytes) has SHA-256 {digest},"
            f" the manifest records {entry.sha256}",
            file=path,
            allocation=where[0],
            offset_bytes=where[1],
        )
    raise PackDigestMismatchError(f"the pack's SHA-256 is {read.sha256}, its digest and path say {pack.sha256}", file=path)


def _raise_wrong_manifest(
    path: Path,
    bad_padding: int | None,
    bad_extent: tuple[PackEntry, str] | None,
    where: tuple[int | None, int | None],
    blame: str | os.PathLike[str],
) -> None:
    """The object holds exactly the bytes its name promises: any disagreement is the manifest's (``blame``)."""
    if bad_padding is not None:
        raise ManifestPaddingError(
            f"the manifest's layout puts padding at pack offset {bad_padding}, but the pack {path} (whose SHA-256"
            f" matches its name) holds a non-zero byte there: the manifest's extent sizes do not describe this pack;"
            " the pack is intact and kept",
            file=blame,
            offset_bytes=bad_padding,
        )
    if bad_extent is not None:
        entry, digest = bad_extent
        raise ManifestExtentDigestError(
            f"the manifest records SHA-256 {entry.sha256} for the extent stored at pack offset {entry.offset_bytes}"
            f" ({entry.size_bytes} bytes), but the pack {path} (whose SHA-256 matches its name) stores bytes with"
            f" SHA-256 {digest} there: the manifest is wrong; the pack is intact and kept",
            file=blame,
            allocation=where[0],
            offset_bytes=where[1],
        )


def check_pack_padding(path: str | os.PathLike[str], layout: PackLayout, runs: Iterable[tuple[int, int]] | None = None) -> None:
    """Read only the padding runs of an (already admitted) pack and require zeros.

    The padding is less than 4096 bytes per stored extent, so this reads a few KiB per extent. ``runs``: only these
    ``(offset_bytes, size_bytes)`` runs (default: every one of ``layout``; a fetch checks each as it lands).

    Raises:
        MissingObjectError: no file at ``path``.
        PackSizeMismatchError: the file ends inside a padding run (it was truncated after admission).
        NonZeroPaddingError: a padding byte is not zero (names its file offset).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise MissingObjectError("pack does not exist", file=path) from exc
    except OSError as exc:
        raise os_error("cannot open the pack", exc, path) from exc
    try:
        for start, size in layout.padding_ranges() if runs is None else runs:
            try:
                data = os.pread(fd, size, start)
            except OSError as exc:
                raise os_error(f"reading the pack's padding at offset {start} failed", exc, path) from exc
            if len(data) != size:
                raise PackSizeMismatchError(
                    f"the pack ends at byte {start + len(data)}, inside the padding run [{start}, {start + size})"
                    f" (expected {layout.size_bytes} bytes; truncated)",
                    file=path,
                    offset_bytes=start + len(data),
                )
            if data.count(0) != size:
                first = next(i for i, b in enumerate(data) if b)
                raise NonZeroPaddingError(
                    f"padding byte at pack offset {start + first} is {data[first]:#04x}, not zero",
                    file=path,
                    offset_bytes=start + first,
                )
    finally:
        os.close(fd)


def verify_blob_file(path: str | os.PathLike[str], residual: ResidualRef, *, opened: str | None = None) -> None:
    """Verify a residual blob: size first, then SHA-256.

    Args:
        path: the blob (named in every error).
        residual: what the manifest records of it.
        opened: where to read it instead, when the caller holds it open: the ``/proc/self/fd/<n>`` of
            :func:`pinned_file`, so the bytes verified are the bytes a copy through that name reads.

    Raises:
        MissingObjectError: no file at ``path``.
        NotRegularFileError: ``path`` is a folder or another non-regular file.
        FileAccessError: ``path`` cannot be examined or read (``EACCES``, ``ELOOP``, ``EIO``, ...).
        ResidualSizeMismatchError: truncated or extended.
        ResidualDigestMismatchError: the SHA-256 differs from the manifest's.
    """
    path = Path(path)
    _require_size(path, residual.size_bytes, ResidualSizeMismatchError, "residual blob", opened=opened)
    try:
        digest, _ = sha256_file(opened if opened is not None else path)
    except OSError as exc:
        raise os_error("cannot read the residual blob", exc, path) from exc
    if digest != residual.sha256:
        raise ResidualDigestMismatchError(
            f"the residual blob's SHA-256 is {digest}, the manifest records {residual.sha256}", file=path
        )


@contextlib.contextmanager
def pinned_file(path: str | os.PathLike[str], what: str) -> Iterator[str]:
    """Open ``path`` once and yield ``/proc/self/fd/<n>``: opening that name again (a copy backend does, with
    flags of its own such as ``O_DIRECT``) opens the same inode whatever is renamed onto ``path`` meanwhile,
    so what is verified through it is what is copied through it (proc(5), ``/proc/pid/fd``).

    Opened by :func:`coldsnap_core._io.open_regular`, following a symbolic link (a capsule file may be one;
    the pack was refused as one when it was admitted): a named pipe there, or at a link's end, is refused
    at once instead of blocking the restore.

    Raises:
        MissingObjectError: nothing at ``path``.
        NotRegularFileError: a folder, named pipe, device or socket at ``path``.
        FileAccessError: it cannot be opened.
    """
    with open_regular(path, what, follow_links=True) as (fd, _):
        yield f"/proc/self/fd/{fd}"


def extent_owner_map(manifest: NativeManifest) -> Callable[[PackEntry], tuple[int | None, int | None]]:
    """For error messages: the first destination (allocation, offset) holding each stored extent."""
    owners: dict[tuple[str, int], tuple[int, int]] = {}
    for extent in manifest.model_extents:
        owners.setdefault((extent.sha256, extent.size_bytes), (extent.allocation_index, extent.offset_bytes))

    def owner(entry: PackEntry) -> tuple[int | None, int | None]:
        return owners.get((entry.sha256, entry.size_bytes), (None, None))

    return owner
