"""The verifier: every rule a payload must pass before a single byte of it is served (``docs/format.md`` §7), each
failure its own :mod:`coldsnap_core.errors` class naming file, allocation, offset and rule.
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
from coldsnap_core.format.extents import ModelExtent, ResidualExtent
from coldsnap_core.format.manifest import NativeManifest, PackRef, ResidualRef
from coldsnap_core.format.pack_layout import PackEntry, PackLayout

VERIFIER_VERSION = "coldsnap-verifier/1"
"""Recorded in validation records; a record written by another verifier version is not trusted."""


def check_manifest(manifest: NativeManifest, *, file: str | None = None) -> PackLayout:
    """Check every rule that needs no file besides the manifest; return the pack layout it implies.

    Raises:
        LayoutMismatchError: ``layout_fingerprint`` is not the fingerprint of ``allocations``.
        PackPathMismatchError: ``pack.path`` is not ``model-payloads/sha256/<pack.sha256>.pack``.
        ExtentBoundsError, ExtentOrderError, ExtentOverlapError, CoverageGapError: :func:`check_coverage`.
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
            at = _where(extent, file)
            if key <= previous:
                raise ExtentOrderError(
                    f"{kind} extent {i} starts at ({key[0]}, {key[1]}), not after {kind} extent {i - 1} at"
                    f" ({previous[0]}, {previous[1]}) in (allocation_index, offset_bytes) order",
                    **at,
                )
            previous = key
            if extent.allocation_index >= count:
                raise ExtentBoundsError(
                    f"{kind} extent {i} names allocation {extent.allocation_index}, but there are {count}", **at
                )
            size = sizes[extent.allocation_index]
            if extent.end_bytes > size:
                raise ExtentBoundsError(
                    f"{kind} extent {i} ends at byte {extent.end_bytes}, beyond the allocation's {size} bytes", **at
                )
            per_allocation[extent.allocation_index].append((extent.offset_bytes, extent.end_bytes, f"{kind} extent {i}"))
    for allocation, intervals in zip(allocations.allocations, per_allocation, strict=True):
        position, last = 0, None
        end_of_allocation = (allocation.size_bytes, allocation.size_bytes, "")  # a gap before it is a gap at the end
        for start, end, name in [*sorted(intervals), end_of_allocation]:
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


def _where(extent: ModelExtent | ResidualExtent, file: str | None) -> dict:
    """An extent's error keywords: the file, and the extent's allocation and offset."""
    return {"file": file, "allocation": extent.allocation_index, "offset_bytes": extent.offset_bytes}


def check_pack_layout(manifest: NativeManifest, *, file: str | None = None) -> PackLayout:
    """The model extents must describe the canonical pack (``coldsnap_core.format.pack_layout``)."""
    layout = PackLayout.plan((e.sha256, e.size_bytes) for e in manifest.model_extents)
    offsets = layout.offsets()
    for i, extent in enumerate(manifest.model_extents):
        expected = offsets[(extent.sha256, extent.size_bytes)]
        if extent.pack_offset_bytes != expected:
            raise PackLayoutError(
                f"model extent {i} is at pack offset {extent.pack_offset_bytes}; the canonical layout puts it at {expected}",
                **_where(extent, file),
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
                f"residual extent {i} is at blob offset {extent.blob_offset_bytes}, expected {position}", **_where(extent, file)
            )
        position += extent.size_bytes
    if position != residual.size_bytes:
        raise ResidualLayoutError(
            f"residual extents hold {position} bytes, the blob's size_bytes is {residual.size_bytes}", file=file
        )


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
        live: the live model's allocation map, or ``None`` when only sizes are known (native capture point).
        allocations: the live allocations' addresses and sizes, ``allocations[i].index == i``.
        manifest_fingerprint: the manifest's layout fingerprint when the caller already checked it.

    Raises:
        LayoutMismatchError: the fingerprints differ (names the first differing allocation/tensor),
            the number of allocations differs, or ``allocations`` is not in index order.
        AllocationSizeMismatchError: a live allocation's size differs from the manifest's.
    """
    if live is not None:
        expected = manifest_fingerprint or manifest_allocations.layout_fingerprint()
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


def _require_size(path: Path, expected: int, error: type[Exception], what: str, *, opened: str | None = None) -> None:
    """``path`` (or ``opened``) must be a regular file (symbolic links followed) of ``expected`` bytes, else
    MissingObjectError, NotRegularFileError, FileAccessError or ``error``."""
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
    """Verify a pack object in full, in one sequential read: size, SHA-256, and with ``layout`` its padding and extents.

    The file's SHA-256 decides who is wrong: when it is not ``pack.sha256`` the object is corrupt (the most precise
    error: padding, else the first bad stored extent, else the digest); when it matches, a padding run or extent the
    layout gets wrong is the manifest's error, named by ``manifest_file`` (default: the pack).

    Args:
        layout: the canonical layout (from :func:`check_manifest`), or ``None`` for a bare object check.
        progress: called with the number of bytes read after each chunk.
        extent_owner: maps a stored entry to ``(allocation_index, offset_bytes)`` of one destination, for messages.

    Raises:
        MissingObjectError, NotRegularFileError, FileAccessError: the file is absent, not regular, or unreadable.
        PackSizeMismatchError: truncated or extended (checked before any hashing).
        NonZeroPaddingError, ExtentDigestMismatchError, PackDigestMismatchError: the object is corrupt.
        ManifestPaddingError, ManifestExtentDigestError: the object is intact and the manifest's layout is wrong.
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
    _raise_pack_error(path, pack, read, bad_extent, where, path if manifest_file is None else manifest_file)


ADMIT_MAX_THREADS = 8
"""At most this many threads check a pack's extents."""


def admission_threads() -> int:
    """Threads of :func:`pack_matches_layout`: the usable cores, at most :data:`ADMIT_MAX_THREADS`."""
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
    """Whether the file open at ``fd`` holds exactly the canonical pack of ``layout`` (``docs/format.md`` §10): each
    stored extent and the padding after it, hashed on ``threads`` threads, largest first (the file's own SHA-256 is
    not checked). ``False`` at the first disagreement: a caller judges it with :func:`verify_pack_file`.

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
    """Whether the pack bytes ``[entry.offset_bytes, end_bytes)`` are the extent's content followed by zeros (one
    reused buffer per thread)."""
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
    """What one pass over a pack found: bytes read, SHA-256s, the first non-zero padding offset (``None``: all zero)."""

    size_bytes: int
    sha256: str
    bad_padding: int | None
    extent_sha256: list[str]


def _walk_runs(
    runs: Sequence[tuple[int, int]], first: int, chunk: memoryview, offset: int, visit: Callable[[int, int, memoryview], object]
) -> int:
    """Pass the chunk's part of each ``(start, end)`` run from ``runs[first]`` on to ``visit(index, start, piece)``;
    return the index of the first run this chunk does not finish."""
    end = offset + len(chunk)
    i = first
    while i < len(runs) and runs[i][0] < end:
        lo, hi = max(runs[i][0], offset), min(runs[i][1], end)
        if lo < hi:
            visit(i, lo, chunk[lo - offset : hi - offset])
        if runs[i][1] > end:
            break
        i += 1
    return i


def _read_pack(path: Path, layout: PackLayout | None, chunk_bytes: int, progress: Callable[[int], object] | None) -> _PackRead:
    """One sequential read of the pack in two ``chunk_bytes`` buffers: this thread hashes the file and checks the
    padding while a helper thread hashes the stored extents. Raises FileAccessError when it cannot be read."""
    entries = layout.entries if layout is not None else ()
    extents = [(e.offset_bytes, e.end_bytes) for e in entries]
    padding = [(start, start + size) for start, size in layout.padding_ranges()] if layout is not None else []
    file_hash, extent_hashes = hashlib.sha256(), [hashlib.sha256() for _ in entries]
    buffers = [bytearray(chunk_bytes), bytearray(chunk_bytes)]
    next_entry = pad_index = offset = turn = 0
    bad_padding: list[int] = []

    def check_zero(_: int, start: int, piece: memoryview) -> None:
        rest = piece.tobytes().lstrip(b"\0")  # a run is shorter than the 4096-byte alignment
        if rest:
            bad_padding.append(start + len(piece) - len(rest))

    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by the with statement below)
    except OSError as exc:
        raise os_error("cannot open the pack", exc, path) from exc
    with f, ThreadPoolExecutor(max_workers=1, thread_name_prefix="coldsnap-verify") as pool:
        pending = None
        while True:
            # the helper may still hash buffers[turn ^ 1]; buffers[turn] was released by the last pending.result()
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
                pending = pool.submit(_walk_runs, extents, next_entry, chunk, offset, lambda i, _, p: extent_hashes[i].update(p))
            pad_index = _walk_runs(padding, pad_index, chunk, offset, check_zero)
            file_hash.update(chunk)
            if progress is not None:
                progress(n)
            offset += n
            turn ^= 1
        if pending is not None:
            pending.result()
    first_bad = bad_padding[0] if bad_padding else None
    return _PackRead(offset, file_hash.hexdigest(), first_bad, [h.hexdigest() for h in extent_hashes])


def _raise_pack_error(
    path: Path,
    pack: PackRef,
    read: _PackRead,
    bad_extent: tuple[PackEntry, str] | None,
    where: tuple[int | None, int | None],
    blame: str | os.PathLike[str],
) -> None:
    """The most precise error (:func:`verify_pack_file`): the object's when its SHA-256 is not its name, else the
    manifest's (named by ``blame``), or none."""
    corrupt = read.sha256 != pack.sha256
    if read.bad_padding is not None and corrupt:
        raise NonZeroPaddingError(
            f"padding byte at pack offset {read.bad_padding} is not zero (padding runs from each extent's end to the next"
            " 4096-byte boundary)",
            file=path,
            offset_bytes=read.bad_padding,
        )
    if read.bad_padding is not None:
        raise ManifestPaddingError(
            f"the manifest's layout puts padding at pack offset {read.bad_padding}, but the pack {path} (whose SHA-256"
            f" matches its name) holds a non-zero byte there: the manifest's extent sizes do not describe this pack;"
            " the pack is intact and kept",
            file=blame,
            offset_bytes=read.bad_padding,
        )
    if bad_extent is not None:
        entry, digest = bad_extent
        if corrupt:
            raise ExtentDigestMismatchError(
                f"the extent stored at pack offset {entry.offset_bytes} ({entry.size_bytes} bytes) has SHA-256 {digest},"
                f" the manifest records {entry.sha256}",
                file=path,
                allocation=where[0],
                offset_bytes=where[1],
            )
        raise ManifestExtentDigestError(
            f"the manifest records SHA-256 {entry.sha256} for the extent stored at pack offset {entry.offset_bytes}"
            f" ({entry.size_bytes} bytes), but the pack {path} (whose SHA-256 matches its name) stores bytes with"
            f" SHA-256 {digest} there: the manifest is wrong; the pack is intact and kept",
            file=blame,
            allocation=where[0],
            offset_bytes=where[1],
        )
    if corrupt:
        raise PackDigestMismatchError(f"the pack's SHA-256 is {read.sha256}, its digest and path say {pack.sha256}", file=path)


def check_pack_padding(path: str | os.PathLike[str], layout: PackLayout, runs: Iterable[tuple[int, int]] | None = None) -> None:
    """Read only the padding runs of an admitted pack (or only ``runs``, ``(offset_bytes, size_bytes)``) and require zeros.

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
    """Verify a residual blob (named ``path``; read at ``opened``, a :func:`pinned_file` name, when given): size, SHA-256.

    Raises:
        MissingObjectError, NotRegularFileError, FileAccessError: the file is absent, not regular, or unreadable.
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
    """Open ``path`` once (:func:`coldsnap_core._io.open_regular`, links followed) and yield ``/proc/self/fd/<n>``:
    opening that name again opens the same inode whatever is renamed onto ``path`` (proc(5)), so what is verified
    through it is what is copied through it. Raises as :func:`~coldsnap_core._io.open_regular`."""
    with open_regular(path, what, follow_links=True) as (fd, _):
        yield f"/proc/self/fd/{fd}"


def extent_owner_map(manifest: NativeManifest) -> Callable[[PackEntry], tuple[int | None, int | None]]:
    """For error messages: the first destination (allocation, offset) holding each stored extent."""
    owners: dict[tuple[str, int], tuple[int, int]] = {}
    for extent in manifest.model_extents:
        owners.setdefault((extent.sha256, extent.size_bytes), (extent.allocation_index, extent.offset_bytes))
    return lambda entry: owners.get((entry.sha256, entry.size_bytes), (None, None))
