"""The host-memory copy backend: allocations are plain process memory (CPU tensors' storages).

Hydration reads each source range straight into its destination with ``os.preadv`` (one copy, from
the page cache or the disk into the allocation; no staging buffer, no whole-pack read), spread over
worker threads (``preadv`` and ``hashlib`` release the GIL). With ``verify_extents`` each model
extent is hashed right after its bytes land, while they are still in the CPU cache.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coldsnap_core.copy.base import CopyOp, LiveAllocation, SourceName
from coldsnap_core.errors import CopyBackendError, ExtentDigestMismatchError

DEFAULT_CHUNK_BYTES = 4 << 20
"""Bytes per ``preadv`` call (4 MiB): large enough for throughput, small enough to hash cache-hot."""


def host_view(address: int, size_bytes: int) -> memoryview:
    """A writable byte view of ``size_bytes`` bytes of this process's memory at ``address``."""
    if size_bytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * size_bytes).from_address(address)).cast("B")


class HostCopyBackend:
    """Copy backend for allocations in host memory.

    Args:
        threads: worker threads for :meth:`fill` (default: the number of usable CPUs, at most 8).
        chunk_bytes: bytes per read call and per hash update.
    """

    name = "host"

    def __init__(self, *, threads: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.threads = threads or max(1, min(8, len(os.sched_getaffinity(0))))
        self.chunk_bytes = chunk_bytes

    def fill(
        self,
        ops: Sequence[CopyOp],
        sources: Mapping[SourceName, Path],
        allocations: Sequence[LiveAllocation],
        *,
        verify_extents: bool,
    ) -> None:
        """See :meth:`coldsnap_core.copy.base.CopyBackend.fill`."""
        fds = {name: os.open(path, os.O_RDONLY | os.O_CLOEXEC) for name, path in sources.items()}
        try:
            if self.threads == 1 or len(ops) < 2:
                for op in ops:
                    self._run(op, fds, sources, allocations, verify_extents)
                return
            with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="coldsnap-fill") as pool:
                # Largest first, so the threads finish together.
                ordered = sorted(ops, key=lambda op: -op.size_bytes)
                futures = [pool.submit(self._run, op, fds, sources, allocations, verify_extents) for op in ordered]
                for future in futures:
                    future.result()
        finally:
            for fd in fds.values():
                os.close(fd)

    def _run(
        self,
        op: CopyOp,
        fds: Mapping[SourceName, int],
        sources: Mapping[SourceName, Path],
        allocations: Sequence[LiveAllocation],
        verify: bool,
    ) -> None:
        allocation = allocations[op.allocation_index]
        destination = host_view(allocation.address + op.offset_bytes, op.size_bytes)
        digest = hashlib.sha256() if verify and op.sha256 is not None else None
        fd = fds[op.source]
        done = 0
        while done < op.size_bytes:
            piece = destination[done : done + self.chunk_bytes]
            try:
                n = os.preadv(fd, [piece], op.source_offset_bytes + done)
            except OSError as exc:
                raise CopyBackendError(
                    f"reading {op.source} at offset {op.source_offset_bytes + done} failed: {exc}",
                    file=sources[op.source],
                    allocation=op.allocation_index,
                    offset_bytes=op.offset_bytes + done,
                ) from exc
            if n == 0:
                raise CopyBackendError(
                    f"{op.source} ended at offset {op.source_offset_bytes + done} inside {op.source} extent {op.extent_index}",
                    file=sources[op.source],
                    allocation=op.allocation_index,
                    offset_bytes=op.offset_bytes + done,
                )
            if digest is not None:
                digest.update(piece[:n])
            done += n
        if digest is not None and digest.hexdigest() != op.sha256:
            raise ExtentDigestMismatchError(
                f"model extent {op.extent_index} has SHA-256 {digest.hexdigest()} after copying, the manifest records {op.sha256}",
                file=sources[op.source],
                allocation=op.allocation_index,
                offset_bytes=op.offset_bytes,
            )

    def read_chunks(self, allocation: LiveAllocation, offset_bytes: int, size_bytes: int) -> Iterator[memoryview]:
        """Zero-copy views of the allocation's bytes, ``chunk_bytes`` at a time."""
        view = host_view(allocation.address + offset_bytes, size_bytes)
        for start in range(0, size_bytes, self.chunk_bytes):
            yield view[start : start + self.chunk_bytes]
