"""The host-memory copy backend: allocations are plain process memory (CPU tensors' storages).

Hydration ``os.preadv``s each source range straight into its destination, one batch per thread: the plan's bytes
split evenly (:func:`split_even`), or with ``verify_extents`` whole extents dealt largest first
(:func:`deal_largest_first`) and hashed as they land. Each chunk is faulted in just before its read
(:func:`prefault_for_write`), so one thread's faults overlap the others' copies; huge pages are advised only when
:func:`huge_pages_pay` (measurements: benchmarks/README.md). A failed batch stops the others at their next chunk.
"""

from __future__ import annotations

import ctypes
import hashlib
import heapq
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from coldsnap_core._io import advise_sequential
from coldsnap_core.copy.base import CopyOp, SourceName, check_range
from coldsnap_core.errors import CopyBackendError, ExtentDigestMismatchError
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.pack_layout import align_up

DEFAULT_CHUNK_BYTES = 4 << 20
"""Bytes per ``preadv`` call (4 MiB): large enough for throughput, small enough to hash cache-hot."""

MAX_DEFAULT_THREADS = 8
"""Upper bound of the default thread count (the usable CPUs)."""


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
HUGE_PAGE_BYTES = 2 << 20
"""Size of a transparent huge page on x86-64 and on arm64 with 4 KiB base pages (2 MiB, PMD size)."""
MADV_HUGEPAGE = 14
"""``madvise`` advice: back the range with transparent huge pages where possible (``mm/madvise.c``)."""
MADV_POPULATE_WRITE = 23
"""Linux >= 5.14 ``madvise`` advice: fault the range in for writing in one call (``mm/madvise.c``)."""
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def advise_huge_pages(address: int, size_bytes: int) -> bool:
    """Advise ``MADV_HUGEPAGE`` on the whole 2 MiB pages inside ``[address, address + size_bytes)`` (a straddling one
    would cover memory the caller does not own); ``False`` when there is none or the kernel refuses the advice."""
    start = align_up(address, HUGE_PAGE_BYTES)
    end = (address + size_bytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    return _libc.madvise(start, end - start, MADV_HUGEPAGE) == 0


BUDDYINFO = Path("/proc/buddyinfo")
"""The kernel's free-block counts per zone and order (``Documentation/filesystems/proc.rst``)."""


def free_huge_block_bytes(buddyinfo: str | None = None) -> int | None:
    """Bytes of free memory the kernel holds in blocks of at least one huge page (2 MiB), all zones.

    ``buddyinfo``: the text of ``/proc/buddyinfo`` (read when ``None``), lines ``Node N, zone NAME c0 ... c10`` where
    ``ck`` counts free blocks of ``2**k`` base pages. ``None`` when it cannot be read or parsed.
    """
    try:
        text = BUDDYINFO.read_text() if buddyinfo is None else buddyinfo
        total = 0
        for line in text.splitlines():
            fields = line.split()
            if len(fields) < 5 or fields[2] != "zone":
                continue
            counts = [int(field) for field in fields[4:]]  # every order parsed: a malformed line is None
            total += sum(
                count * (PAGE_BYTES << order) for order, count in enumerate(counts) if PAGE_BYTES << order >= HUGE_PAGE_BYTES
            )
        return total
    except (OSError, ValueError):
        return None


VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
"""The virtio devices, one folder each with ``device`` and ``features`` files (``drivers/virtio/virtio.c``)."""
VIRTIO_ID_BALLOON = 5
"""The virtio device id of a memory balloon (``include/uapi/linux/virtio_ids.h``)."""
VIRTIO_BALLOON_F_REPORTING = 5
"""The balloon feature bit for free page reporting (``include/uapi/linux/virtio_balloon.h``)."""


def free_page_reporting(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether a virtio balloon of this (virtual) machine reports free pages to the hypervisor (which then discards
    free 2 MiB blocks, ``mm/page_reporting.c``: a huge-page fault costs 512 host faults). ``devices/*/features``
    holds one ``0``/``1`` per feature bit, bit 0 first; ``False`` where the files cannot be read."""
    try:
        folders = sorted(devices.iterdir())
    except OSError:
        return False
    for folder in folders:
        try:
            device_id = int((folder / "device").read_text().strip(), 16)
            features = (folder / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if device_id == VIRTIO_ID_BALLOON and features[VIRTIO_BALLOON_F_REPORTING : VIRTIO_BALLOON_F_REPORTING + 1] == "1":
            return True
    return False


def huge_pages_pay(destination_bytes: int, free_block_bytes: int | None, *, page_reporting: bool = False) -> bool:
    """Whether advising huge pages on ``destination_bytes`` of fresh memory is expected to pay: the free 2 MiB
    blocks cover twice the destination (no synchronous compaction) and are not reported to a hypervisor."""
    if page_reporting:
        return False
    return free_block_bytes is not None and destination_bytes > 0 and 2 * destination_bytes <= free_block_bytes


def prefault_for_write(address: int, size_bytes: int) -> bool:
    """Fault in the pages under ``[address, address + size_bytes)`` for writing in one system call, without changing
    a byte; ``False`` where the kernel lacks it (older than 5.14) or refuses the range."""
    if size_bytes <= 0:
        return True
    start = address - address % PAGE_BYTES
    end = address + size_bytes
    return _libc.madvise(start, end - start, MADV_POPULATE_WRITE) == 0


def host_view(address: int, size_bytes: int) -> memoryview:
    """A writable byte view of ``size_bytes`` bytes of this process's memory at ``address`` (a raw pointer)."""
    if size_bytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * size_bytes).from_address(address)).cast("B")


@dataclass(frozen=True, slots=True)
class _Piece:
    """A part of one op: ``size_bytes`` bytes starting ``skip_bytes`` into the op."""

    op: CopyOp
    skip_bytes: int
    size_bytes: int


def split_even(ops: Sequence[CopyOp], parts: int, align_bytes: int) -> list[list[_Piece]]:
    """Cut the concatenation of ``ops`` into at most ``parts`` contiguous runs of nearly equal size, each cut
    inside an op ``k * align_bytes`` after its start (aligned reads); empty runs are dropped."""
    total = sum(op.size_bytes for op in ops)
    target = max(1, -(-total // max(1, parts)))
    batches: list[list[_Piece]] = [[]]
    room = target
    for op in ops:
        skip = 0
        while skip < op.size_bytes:
            if room <= 0 and len(batches) < parts:
                batches.append([])
                room = target
            end = op.size_bytes if room <= 0 else min(op.size_bytes, skip + room)
            if end < op.size_bytes:
                end = max(skip + align_bytes, end // align_bytes * align_bytes)
                end = min(end, op.size_bytes)
            batches[-1].append(_Piece(op, skip, end - skip))
            room -= end - skip
            skip = end
    return [b for b in batches if b]


def deal_largest_first(ops: Sequence[CopyOp], parts: int) -> list[list[_Piece]]:
    """Deal whole ops to ``parts`` batches, largest first to the least loaded; each batch in plan order."""
    heap = [(0, i) for i in range(max(1, parts))]
    chosen: list[list[tuple[int, CopyOp]]] = [[] for _ in heap]
    for position, op in sorted(enumerate(ops), key=lambda p: -p[1].size_bytes):
        load, i = heapq.heappop(heap)
        chosen[i].append((position, op))
        heapq.heappush(heap, (load + op.size_bytes, i))
    return [[_Piece(op, 0, op.size_bytes) for _, op in sorted(batch, key=lambda p: p[0])] for batch in chosen if batch]


class HostCopyBackend:
    """Copy backend for allocations in host memory.

    Args:
        threads: worker threads for :meth:`fill` (default: the usable CPUs, at most :data:`MAX_DEFAULT_THREADS`).
        chunk_bytes: bytes per read call and per hash update, > 0.
        huge_pages: advise ``MADV_HUGEPAGE`` on the destinations: ``None`` when :func:`huge_pages_pay`, else always/never.
    """

    name = "host"
    stable_chunks = True

    def __init__(
        self, *, threads: int | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES, huge_pages: bool | None = None
    ) -> None:
        if chunk_bytes <= 0 or (threads is not None and threads <= 0):
            raise ValueError(f"threads ({threads}) and chunk_bytes ({chunk_bytes}) must be positive")
        self.threads = threads or max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0))))
        self.chunk_bytes = chunk_bytes
        self.huge_pages = huge_pages

    def fill(
        self,
        ops: Sequence[CopyOp],
        sources: Mapping[SourceName, Path],
        allocations: Sequence[LiveAllocation],
        *,
        verify_extents: bool,
    ) -> None:
        """See :meth:`coldsnap_core.copy.base.CopyBackend.fill`."""
        batches = deal_largest_first(ops, self.threads) if verify_extents else split_even(ops, self.threads, self.chunk_bytes)
        # Before any thread faults its range: a 2 MiB page that straddles two threads' pieces is
        # advised here once, per destination allocation, so neither piece falls back to 4 KiB pages.
        destinations = [allocations[index] for index in sorted({op.allocation_index for op in ops})]
        huge = self.huge_pages
        if huge is None:
            huge = huge_pages_pay(
                sum(a.size_bytes for a in destinations), free_huge_block_bytes(), page_reporting=free_page_reporting()
            )
        if huge:
            for allocation in destinations:
                advise_huge_pages(allocation.address, allocation.size_bytes)
        stop = threading.Event()
        fds: dict[SourceName, int] = {}
        try:
            for name, path in sources.items():
                try:
                    fds[name] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    advise_sequential(fds[name])
                except OSError as exc:
                    raise CopyBackendError(f"cannot open the {name}: {exc}", file=path) from exc
            if len(batches) <= 1:
                for batch in batches:
                    self._run_batch(batch, fds, sources, allocations, verify_extents, stop)
                return
            with ThreadPoolExecutor(max_workers=len(batches), thread_name_prefix="coldsnap-fill") as pool:
                futures = [
                    pool.submit(self._run_batch, batch, fds, sources, allocations, verify_extents, stop) for batch in batches
                ]
                try:
                    wait(futures, return_when=FIRST_EXCEPTION)
                except BaseException:  # interrupted: let the other batches stop at their next chunk
                    stop.set()
                    raise
                for future in futures:
                    error = future.exception() if future.done() else None
                    if error is not None:
                        stop.set()
                        raise error
        finally:
            for fd in fds.values():
                os.close(fd)

    def _run_batch(
        self,
        batch: Sequence[_Piece],
        fds: Mapping[SourceName, int],
        sources: Mapping[SourceName, Path],
        allocations: Sequence[LiveAllocation],
        verify: bool,
        stop: threading.Event,
    ) -> None:
        for piece in batch:
            op = piece.op
            destination_address = allocations[op.allocation_index].address + op.offset_bytes + piece.skip_bytes
            destination = host_view(destination_address, piece.size_bytes)
            digest = hashlib.sha256() if verify and op.sha256 is not None else None
            source_offset = op.source_offset_bytes + piece.skip_bytes
            done = 0
            while done < piece.size_bytes:
                if stop.is_set():
                    return
                view = destination[done : done + self.chunk_bytes]
                # this chunk only, not the whole piece: the other threads copy while this one faults
                prefault_for_write(destination_address + done, len(view))
                try:
                    n = os.preadv(fds[op.source], [view], source_offset + done)
                except OSError as exc:
                    raise CopyBackendError(
                        f"reading the {op.source} at offset {source_offset + done} failed: {exc}",
                        file=sources[op.source],
                        allocation=op.allocation_index,
                        offset_bytes=op.offset_bytes + piece.skip_bytes + done,
                    ) from exc
                if n == 0:
                    raise CopyBackendError(
                        f"the {op.source} ends at offset {source_offset + done}, inside {op.source} extent {op.extent_index}",
                        file=sources[op.source],
                        allocation=op.allocation_index,
                        offset_bytes=op.offset_bytes + piece.skip_bytes + done,
                    )
                if digest is not None:
                    digest.update(view[:n])
                done += n
            if digest is not None and digest.hexdigest() != op.sha256:
                raise ExtentDigestMismatchError(
                    f"model extent {op.extent_index} has SHA-256 {digest.hexdigest()} after copying, the manifest records {op.sha256}",
                    file=sources[op.source],
                    allocation=op.allocation_index,
                    offset_bytes=op.offset_bytes,
                )

    def read_chunks(self, allocation: LiveAllocation, offset_bytes: int, size_bytes: int) -> Iterator[memoryview]:
        """Zero-copy views of the allocation's bytes ``[offset_bytes, offset_bytes + size_bytes)``, ``chunk_bytes`` each.

        Raises:
            CopyBackendError: the range is not within the allocation.
        """
        check_range(allocation, offset_bytes, size_bytes)
        view = host_view(allocation.address + offset_bytes, size_bytes)
        for start in range(0, size_bytes, self.chunk_bytes):
            yield view[start : start + self.chunk_bytes]
