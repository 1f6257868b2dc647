"""The canonical pack writer: the only code that ever produces a ``model-weights.pack``.

Capture and materialization both call :func:`write_pack`, so a pack built from a capture and a pack
rebuilt after a recovery load are byte-identical whenever their model extents hold the same bytes
(``docs/format.md`` §2 and §13: materialization uses the exact canonical writer used during capture).

Internal logic:

* the layout comes from :meth:`PackLayout.plan` (sorted by (SHA-256, size), 4096-byte aligned, each
  distinct content once, zero padding, size rounded up to 4096);
* the bytes stream from the live allocations through the copy backend, chunk by chunk (each
  distinct content read from the first destination holding it, zero chunks for the padding), into a
  uniquely named temporary file; the file's SHA-256 is computed on a helper thread while it is
  written (:func:`coldsnap_core._io.write_hashed`: the helper walks its own copy of the stream when
  the backend's chunks are stable host views, and goes in lockstep with the writer otherwise).
  Memory: the backend's chunks (zero-copy for host memory) and a 1 MiB zero buffer; never a
  whole-model or whole-extent buffer;
* :meth:`PayloadCache.commit` then fsyncs, checks size, checks the digest (against the expected one
  when materializing), renames to ``model-payloads/sha256/<digest>.pack``, fsyncs the folder and
  writes the validation record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from coldsnap_core._io import write_hashed, zero_chunks
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.copy.base import CopyBackend, stable_chunks
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.manifest import PackRef
from coldsnap_core.format.pack_layout import PackLayout


def write_pack(
    layout: PackLayout,
    locate: Mapping[tuple[str, int], tuple[LiveAllocation, int]],
    backend: CopyBackend,
    cache: PayloadCache,
    *,
    expected_sha256: str | None = None,
    progress: Callable[[int], object] | None = None,
) -> PackRef:
    """Write the pack described by ``layout`` into ``cache`` and return its reference.

    Args:
        layout: the canonical layout of the distinct extent contents.
        locate: for each ``(sha256, size_bytes)`` of the layout, one live allocation and the byte
            offset within it where that content is resident.
        backend: reads the allocation bytes (host views, or device-to-host copies).
        cache: the node-local cache the object is committed to.
        expected_sha256: when materializing, the digest the pack must have; a different result is
            discarded and raises.
        progress: called with the number of bytes written after each chunk.

    Returns:
        The pack's :class:`PackRef` (digest, size, derived path).

    Raises:
        PackDigestMismatchError: ``expected_sha256`` given and not produced (nothing is kept).
        InsufficientSpaceError: the file system filled up (the temporary file is removed).
    """

    def stream() -> Iterator[memoryview]:
        position = 0
        for entry in layout.entries:
            yield from zero_chunks(entry.offset_bytes - position)
            allocation, offset_bytes = locate[(entry.sha256, entry.size_bytes)]
            yield from backend.read_chunks(allocation, offset_bytes, entry.size_bytes)
            position = entry.end_bytes
        yield from zero_chunks(layout.size_bytes - position)

    label = expected_sha256 or "capture"
    with cache.temporary(label) as (fd, temp_path):
        digest, _ = write_hashed(fd, stream, file=temp_path, stable=stable_chunks(backend), progress=progress)
        cache.commit(fd, temp_path, sha256=digest, size_bytes=layout.size_bytes, expected_sha256=expected_sha256)
    return PackRef.for_digest(digest, layout.size_bytes)
