"""The canonical pack writer: the only code that ever produces a ``model-weights.pack`` (``docs/format.md`` §2, §13),
streamed from the live allocations through the copy backend, never through a whole-model buffer."""

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
    """Write the pack of ``layout`` into ``cache`` (each content read where ``locate`` says) and return its reference.

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

    with cache.temporary(expected_sha256 or "capture") as (fd, temp_path):
        digest, _ = write_hashed(fd, stream, file=temp_path, stable=stable_chunks(backend), progress=progress)
        cache.commit(fd, temp_path, sha256=digest, size_bytes=layout.size_bytes, expected_sha256=expected_sha256)
    return PackRef.for_digest(digest, layout.size_bytes)
