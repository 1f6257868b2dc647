"""The CUDA copy backend: allocations are device memory (CUDA virtual addresses), reached from files through
pinned host staging buffers.

:meth:`CudaCopyBackend.fill` pipelines chunks of one source file (:func:`plan_chunks`) through ``staging_buffers``
pinned buffers, one event each: chunk ``k + 1`` is read while the DMA engine copies chunk ``k``. The device is
reached through :class:`DeviceOps`: :class:`CupyDeviceOps` (``cupy.cuda.runtime``, imported lazily), or the CPU
tests' host-memory fake. Sources: the CUDA runtime API (enum values in ``driver_types.h``), cupy
``cupy_backends/cuda/api/runtime.pyx``; a ``CuMemAllocator`` address is reachable from any host pointer under unified
virtual addressing (``docs/format.md`` §6.2).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from coldsnap_core._io import advise_sequential
from coldsnap_core.copy.base import CopyOp, SourceName, check_range
from coldsnap_core.copy.host import host_view
from coldsnap_core.errors import ConfigurationError, CopyBackendError, ExtentDigestMismatchError
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.pack_layout import align_up

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20
"""Bytes per staging buffer and file read for hydration (64 MiB)."""

DEFAULT_READ_CHUNK_BYTES = 16 << 20
"""Bytes per device-to-host copy in :meth:`CudaCopyBackend.read_chunks` (16 MiB)."""

DEFAULT_MAX_GAP_BYTES = 1 << 20
"""Two ops of one source share a chunk when the bytes between them are at most this many (1 MiB)."""

READ_BUFFERS = 3
"""Pinned buffers per :meth:`CudaCopyBackend.read_chunks` lane (the caller's chunk, the previous one, the next)."""

IO_ALIGNMENT_BYTES = 4096
"""File offset, length and buffer alignment of ``O_DIRECT`` reads (the pack's extent alignment)."""

# CUDA runtime enum values (driver_types.h); stable ABI constants.
CUDA_MEMCPY_HOST_TO_DEVICE = 1
CUDA_MEMCPY_DEVICE_TO_HOST = 2
CUDA_HOST_ALLOC_PORTABLE = 1
CUDA_STREAM_NON_BLOCKING = 1
CUDA_EVENT_DISABLE_TIMING = 2


@runtime_checkable
class DeviceOps(Protocol):
    """The device operations the copy pipeline needs, each the CUDA runtime call of its name (``cudaHostAlloc``,
    ``cudaMemcpyAsync``, ``cudaEventRecord``, ``cudaEventSynchronize``, ...).

    Addresses are integers (host pointers, CUDA virtual addresses); streams and events are opaque handles. An
    asynchronous copy may run at any time until its stream (or a later event) is synchronized: its source must not
    change nor its destination be read until then. Every method raises (any exception) on failure.
    """

    device: int

    def alloc_pinned(self, size_bytes: int) -> int: ...

    def free_pinned(self, address: int) -> None: ...

    def create_stream(self) -> Any: ...

    def destroy_stream(self, stream: Any) -> None: ...

    def create_event(self) -> Any: ...

    def destroy_event(self, event: Any) -> None: ...

    def memcpy_htod_async(self, device_address: int, host_address: int, size_bytes: int, stream: Any) -> None: ...

    def memcpy_dtoh_async(self, host_address: int, device_address: int, size_bytes: int, stream: Any) -> None: ...

    def record_event(self, event: Any, stream: Any) -> None: ...

    def synchronize_event(self, event: Any) -> None: ...

    def synchronize_stream(self, stream: Any) -> None: ...


class CupyDeviceOps:
    """:class:`DeviceOps` through ``cupy.cuda.runtime`` on CUDA device ``device`` (default: the current one).

    Raises:
        ConfigurationError: cupy is not installed, or no CUDA device is usable; the message says which.
    """

    def __init__(self, device: int | None = None) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise ConfigurationError(
                "the CUDA copy backend needs cupy (pip install 'coldsnap[cuda]': cupy-cuda13x for CUDA 13,"
                " or 'coldsnap[cuda12]': cupy-cuda12x for CUDA 12)"
            ) from exc
        self._cupy = cupy
        self._rt = cupy.cuda.runtime
        try:
            count = self._rt.getDeviceCount()
            self.device = self._rt.getDevice() if device is None else int(device)
        except Exception as exc:  # cupy raises CUDARuntimeError without a driver
            raise ConfigurationError(f"no usable CUDA device for the CUDA copy backend: {exc}") from exc
        if not 0 <= self.device < count:
            raise ConfigurationError(f"CUDA device {self.device} does not exist ({count} devices)")

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        with self._cupy.cuda.Device(self.device):  # so that a thread whose current device is another one is right
            return function(*args)

    def alloc_pinned(self, size_bytes: int) -> int:
        return int(self._call(self._rt.hostAlloc, size_bytes, CUDA_HOST_ALLOC_PORTABLE))

    def free_pinned(self, address: int) -> None:
        self._call(self._rt.freeHost, address)

    def create_stream(self) -> int:
        return int(self._call(self._rt.streamCreateWithFlags, CUDA_STREAM_NON_BLOCKING))

    def destroy_stream(self, stream: int) -> None:
        self._call(self._rt.streamDestroy, stream)

    def create_event(self) -> int:
        return int(self._call(self._rt.eventCreateWithFlags, CUDA_EVENT_DISABLE_TIMING))

    def destroy_event(self, event: int) -> None:
        self._call(self._rt.eventDestroy, event)

    def memcpy_htod_async(self, device_address: int, host_address: int, size_bytes: int, stream: int) -> None:
        self._call(self._rt.memcpyAsync, device_address, host_address, size_bytes, CUDA_MEMCPY_HOST_TO_DEVICE, stream)

    def memcpy_dtoh_async(self, host_address: int, device_address: int, size_bytes: int, stream: int) -> None:
        self._call(self._rt.memcpyAsync, host_address, device_address, size_bytes, CUDA_MEMCPY_DEVICE_TO_HOST, stream)

    def record_event(self, event: int, stream: int) -> None:
        self._call(self._rt.eventRecord, event, stream)

    def synchronize_event(self, event: int) -> None:
        self._call(self._rt.eventSynchronize, event)

    def synchronize_stream(self, stream: int) -> None:
        self._call(self._rt.streamSynchronize, stream)


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA copy backend cannot run here (``None`` when it can): for skips and clear errors."""
    try:
        CupyDeviceOps()
    except ConfigurationError as exc:
        return exc.detail
    return None


@dataclass(frozen=True, slots=True)
class Piece:
    """The ``size_bytes`` of ``op`` from ``op_offset_bytes`` that one chunk carries at ``chunk_offset_bytes``."""

    op: CopyOp
    op_offset_bytes: int
    chunk_offset_bytes: int
    size_bytes: int


@dataclass(slots=True)
class Chunk:
    """One read: ``[file_offset_bytes, file_offset_bytes + size_bytes)`` of ``source``, and the
    pieces it feeds (in file order)."""

    source: SourceName
    file_offset_bytes: int
    size_bytes: int
    pieces: list[Piece] = field(default_factory=list)


def plan_chunks(ops: Sequence[CopyOp], chunk_bytes: int, max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES) -> list[Chunk]:
    """Cut ``ops`` into chunks of at most ``chunk_bytes`` bytes of one source file, in (source, offset) order: ops
    at the same offset or at most ``max_gap_bytes`` apart share a chunk; each op byte is in one piece, in op order."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
    chunks: list[Chunk] = []
    current: Chunk | None = None
    for op in sorted(ops, key=lambda o: (o.source, o.source_offset_bytes)):
        position = op.source_offset_bytes
        end = op.source_offset_bytes + op.size_bytes
        while position < end:
            fits = (
                current is not None
                and current.source == op.source
                and current.file_offset_bytes <= position < current.file_offset_bytes + chunk_bytes
                and position - (current.file_offset_bytes + current.size_bytes) <= max_gap_bytes
            )
            if not fits:
                current = Chunk(op.source, position, 0)
                chunks.append(current)
            assert current is not None
            take = min(end, current.file_offset_bytes + chunk_bytes) - position
            chunk_offset = position - current.file_offset_bytes
            current.pieces.append(Piece(op, position - op.source_offset_bytes, chunk_offset, take))
            current.size_bytes = max(current.size_bytes, chunk_offset + take)
            position += take
    return chunks


def _release(ops: DeviceOps, stream: Any, buffers: list[int], events: list[Any]) -> None:
    """Destroy ``events``, free ``buffers`` and destroy ``stream`` (unless ``None``), ignoring failures."""
    for event in events:
        with contextlib.suppress(Exception):
            ops.destroy_event(event)
    for address in buffers:
        with contextlib.suppress(Exception):
            ops.free_pinned(address)
    if stream is not None:
        with contextlib.suppress(Exception):
            ops.destroy_stream(stream)


def describe_op(op: CopyOp) -> str:
    """``model extent 3`` / ``residual extent 7``: how errors name an op."""
    kind = "model" if op.source == "pack" else "residual"
    return f"{kind} extent {op.extent_index}"


@dataclass(slots=True)
class _Lane:
    """A stream with its pinned buffers and one event per buffer."""

    stream: Any
    buffers: list[int]
    events: list[Any]


class CudaCopyBackend:
    """Copy backend for allocations in CUDA device memory (see the module docstring).

    Args:
        ops: the device operations (default: :class:`CupyDeviceOps` on ``device``, created on first use).
        device: the CUDA device ordinal for the default ``ops``.
        chunk_bytes: bytes per hydration chunk (staging buffer size).
        staging_buffers: number of hydration staging buffers (2: double buffering).
        read_threads: parallel ``preadv`` calls per chunk (default: usable CPUs, at most 8).
        read_chunk_bytes: bytes per device-to-host copy in :meth:`read_chunks`.
        max_read_lanes: concurrent :meth:`read_chunks` generators (default: usable CPUs, at most 8); more wait.
        direct_io: open sources with ``O_DIRECT`` (buffered reads where the file system refuses it).

    The pinned buffers and streams are created on first use and kept until :meth:`close`.
    """

    name = "cuda"

    def __init__(
        self,
        *,
        ops: DeviceOps | None = None,
        device: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging_buffers: int = 2,
        read_threads: int | None = None,
        read_chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES,
        max_read_lanes: int | None = None,
        direct_io: bool = False,
    ) -> None:
        if staging_buffers < 2:
            raise ValueError("the pipeline needs at least 2 staging buffers")
        if chunk_bytes % IO_ALIGNMENT_BYTES or read_chunk_bytes % IO_ALIGNMENT_BYTES:
            raise ValueError(f"chunk sizes must be multiples of {IO_ALIGNMENT_BYTES}")
        self._ops = ops
        self._device = device
        self.chunk_bytes = chunk_bytes
        self.staging_buffers = staging_buffers
        self.read_threads = max(1, read_threads or min(8, len(os.sched_getaffinity(0))))
        self.read_chunk_bytes = read_chunk_bytes
        self.max_read_lanes = max(1, max_read_lanes or min(8, len(os.sched_getaffinity(0))))
        self.direct_io = direct_io
        self._lock = threading.Lock()
        self._fill_lock = threading.Lock()
        self._fill_lane: _Lane | None = None
        self._read_lanes: queue.LifoQueue[_Lane] = queue.LifoQueue()
        self._read_lanes_created = 0
        self._all_lanes: list[_Lane] = []

    @property
    def ops(self) -> DeviceOps:
        """The device operations (created on first use; see :class:`CupyDeviceOps` for errors)."""
        if self._ops is None:
            self._ops = CupyDeviceOps(self._device)
        return self._ops

    def _new_lane(self, count: int, buffer_bytes: int) -> _Lane:
        ops = self.ops
        buffers: list[int] = []
        events: list[Any] = []
        stream = None
        try:
            stream = ops.create_stream()
            for _ in range(count):
                buffers.append(ops.alloc_pinned(buffer_bytes))
                events.append(ops.create_event())
        except Exception as exc:
            _release(ops, stream, buffers, events)
            raise CopyBackendError(f"allocating {count} pinned staging buffers of {buffer_bytes} bytes failed: {exc}") from exc
        lane = _Lane(stream, buffers, events)
        self._all_lanes.append(lane)
        return lane

    def _acquire_read_lane(self) -> _Lane:
        with self._lock:
            try:
                return self._read_lanes.get_nowait()
            except queue.Empty:
                if self._read_lanes_created < self.max_read_lanes:
                    self._read_lanes_created += 1
                    try:
                        return self._new_lane(READ_BUFFERS, self.read_chunk_bytes)
                    except BaseException:
                        self._read_lanes_created -= 1
                        raise
        return self._read_lanes.get()

    def close(self) -> None:
        """Wait for outstanding copies, then free every pinned buffer, event and stream."""
        with self._lock:
            lanes, self._all_lanes = self._all_lanes, []
            self._fill_lane = None
            self._read_lanes = queue.LifoQueue()
            self._read_lanes_created = 0
        for lane in lanes:
            with contextlib.suppress(Exception):
                self.ops.synchronize_stream(lane.stream)
            _release(self.ops, lane.stream, lane.buffers, lane.events)

    def prepare(self) -> None:
        """Allocate the hydration staging buffers and stream now (a sleep does, so that the wake does not pay for it).

        Raises:
            ConfigurationError: the device operations cannot be created (cupy or the GPU missing).
            CopyBackendError: pinned allocation failed.
        """
        with self._fill_lock:
            self._prepared_fill_lane()

    def _prepared_fill_lane(self) -> _Lane:
        with self._lock:
            if self._fill_lane is None:
                self._fill_lane = self._new_lane(self.staging_buffers, self.chunk_bytes + 2 * IO_ALIGNMENT_BYTES)
            return self._fill_lane

    def fill(
        self,
        ops: Sequence[CopyOp],
        sources: Mapping[SourceName, Path],
        allocations: Sequence[LiveAllocation],
        *,
        verify_extents: bool,
    ) -> None:
        """See :meth:`coldsnap_core.copy.base.CopyBackend.fill`; outstanding copies are drained before a raise.

        Raises:
            CopyBackendError: a read failed or ended early, or a device copy failed (names the extent, the
                allocation and the offset).
            ExtentDigestMismatchError: ``verify_extents`` and a model extent's staged bytes lack its SHA-256.
        """
        if not ops:
            return
        with self._fill_lock:
            self._fill(plan_chunks(ops, self.chunk_bytes), sources, allocations, verify_extents)

    def _fill(
        self, chunks: list[Chunk], sources: Mapping[SourceName, Path], allocations: Sequence[LiveAllocation], verify_extents: bool
    ) -> None:
        lane = self._prepared_fill_lane()
        device = self.ops
        hashes: dict[int, Any] = {}
        fds: dict[SourceName, tuple[int, bool]] = {}
        pool = (
            ThreadPoolExecutor(max_workers=self.read_threads, thread_name_prefix="coldsnap-read")
            if self.read_threads > 1
            else None
        )
        try:
            for name, path in sources.items():
                fds[name] = self._open(path)
            for k, chunk in enumerate(chunks):
                slot = k % len(lane.buffers)
                if k >= len(lane.buffers):  # the copies from this buffer, chunk k - len(buffers)'s, must be done
                    try:
                        device.synchronize_event(lane.events[slot])
                    except Exception as exc:
                        raise self._copy_error(chunks[k - len(lane.buffers)], exc) from exc
                fd, direct = fds[chunk.source]
                lead = self._read_chunk(pool, fd, direct, lane.buffers[slot], chunk, sources)
                staged = lane.buffers[slot] + lead
                for piece in chunk.pieces:
                    op = piece.op
                    if verify_extents and op.sha256 is not None:
                        digest = hashes.setdefault(id(op), hashlib.sha256())
                        digest.update(host_view(staged + piece.chunk_offset_bytes, piece.size_bytes))
                        if piece.op_offset_bytes + piece.size_bytes == op.size_bytes:
                            self._check_digest(hashes.pop(id(op)), op, sources)
                    destination = allocations[op.allocation_index].address + op.offset_bytes + piece.op_offset_bytes
                    try:
                        device.memcpy_htod_async(destination, staged + piece.chunk_offset_bytes, piece.size_bytes, lane.stream)
                    except Exception as exc:
                        raise CopyBackendError(
                            f"copying {describe_op(op)} ({piece.size_bytes} bytes at byte {piece.op_offset_bytes} of the extent)"
                            f" to device address {destination:#x} failed: {exc}",
                            file=sources[op.source],
                            allocation=op.allocation_index,
                            offset_bytes=op.offset_bytes + piece.op_offset_bytes,
                        ) from exc
                try:
                    device.record_event(lane.events[slot], lane.stream)
                except Exception as exc:
                    raise self._copy_error(chunk, exc) from exc
            try:
                device.synchronize_stream(lane.stream)
            except Exception as exc:
                raise CopyBackendError(f"the host-to-device copies failed: {exc}") from exc
        except BaseException:
            with contextlib.suppress(Exception):  # every enqueued copy ends before the staging buffers are reused
                device.synchronize_stream(lane.stream)
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            for fd, _ in fds.values():
                os.close(fd)

    def _open(self, path: Path) -> tuple[int, bool]:
        flags = os.O_RDONLY | os.O_CLOEXEC
        if self.direct_io and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, flags | os.O_DIRECT), True
            except OSError as exc:
                logger.debug("coldsnap: O_DIRECT refused for %s (%s); reading through the page cache", path, exc)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise CopyBackendError(f"cannot open the source: {exc}", file=path) from exc
        advise_sequential(fd)
        return fd, False

    def _read_chunk(
        self,
        pool: ThreadPoolExecutor | None,
        fd: int,
        direct: bool,
        buffer: int,
        chunk: Chunk,
        sources: Mapping[SourceName, Path],
    ) -> int:
        """Read the chunk's bytes into ``buffer``; return where they start in it (the O_DIRECT lead)."""
        lead = chunk.file_offset_bytes % IO_ALIGNMENT_BYTES if direct else 0
        start = chunk.file_offset_bytes - lead
        length = align_up(lead + chunk.size_bytes, IO_ALIGNMENT_BYTES) if direct else chunk.size_bytes
        part_bytes = align_up(max(1 << 20, -(-length // self.read_threads)), IO_ALIGNMENT_BYTES)
        parts = [(offset, min(part_bytes, length - offset)) for offset in range(0, length, part_bytes)]

        def read(part: tuple[int, int]) -> int:
            offset, size = part
            view = host_view(buffer + offset, size)
            done = 0
            while done < size:
                n = os.preadv(fd, [view[done:]], start + offset + done)
                if n == 0:
                    break
                done += n
            return done

        try:
            counts = [read(p) for p in parts] if pool is None or len(parts) == 1 else list(pool.map(read, parts))
        except OSError as exc:
            op = chunk.pieces[0].op
            raise CopyBackendError(
                f"reading {chunk.source} bytes [{chunk.file_offset_bytes}, {chunk.file_offset_bytes + chunk.size_bytes})"
                f" for {describe_op(op)} failed: {exc}",
                file=sources[chunk.source],
                allocation=op.allocation_index,
                offset_bytes=op.offset_bytes,
            ) from exc
        available = 0
        for (offset, size), n in zip(parts, counts, strict=True):
            available = offset + n
            if n < size:
                break
        available -= lead
        if available < chunk.size_bytes:
            short = next(p for p in chunk.pieces if p.chunk_offset_bytes + p.size_bytes > available)
            op = short.op
            raise CopyBackendError(
                f"{chunk.source} ended at offset {chunk.file_offset_bytes + max(available, 0)} inside {describe_op(op)}"
                f" (needs bytes up to {op.source_offset_bytes + op.size_bytes})",
                file=sources[chunk.source],
                allocation=op.allocation_index,
                offset_bytes=op.offset_bytes,
            )
        return lead

    def _check_digest(self, digest: Any, op: CopyOp, sources: Mapping[SourceName, Path]) -> None:
        actual = digest.hexdigest()
        if actual != op.sha256:
            raise ExtentDigestMismatchError(
                f"{describe_op(op)} has SHA-256 {actual} in the staging buffer, the manifest records {op.sha256}",
                file=sources[op.source],
                allocation=op.allocation_index,
                offset_bytes=op.offset_bytes,
            )

    def _copy_error(self, chunk: Chunk, exc: BaseException) -> CopyBackendError:
        first, last = chunk.pieces[0].op, chunk.pieces[-1].op
        names = describe_op(first) if first is last else f"{describe_op(first)} .. {describe_op(last)}"
        return CopyBackendError(
            f"the host-to-device copies of {names} failed: {exc}",
            allocation=first.allocation_index,
            offset_bytes=first.offset_bytes,
        )

    def read_chunks(self, allocation: LiveAllocation, offset_bytes: int, size_bytes: int) -> Iterator[memoryview]:
        """Yield the allocation's bytes ``[offset_bytes, offset_bytes + size_bytes)`` in host memory,
        ``read_chunk_bytes`` at a time, chunk ``k + 1`` copied while the caller uses chunk ``k``.

        A chunk stays valid until two further chunks are requested (the last one is a private copy), so a consumer
        may hash chunk ``k`` on a helper thread while it requests ``k + 1``. Safe on several threads (each
        generator holds one of at most ``max_read_lanes`` lanes).

        Raises:
            CopyBackendError: the range lies outside the allocation, or a device-to-host copy failed
                (names the allocation and the offset).
        """
        check_range(allocation, offset_bytes, size_bytes)
        if size_bytes == 0:
            return
        pieces = [
            (start, min(self.read_chunk_bytes, offset_bytes + size_bytes - start))
            for start in range(offset_bytes, offset_bytes + size_bytes, self.read_chunk_bytes)
        ]
        lane = self._acquire_read_lane()
        device = self.ops
        slots = len(lane.buffers)

        def enqueue(i: int) -> None:
            start, n = pieces[i]
            try:
                device.memcpy_dtoh_async(lane.buffers[i % slots], allocation.address + start, n, lane.stream)
                device.record_event(lane.events[i % slots], lane.stream)
            except Exception as exc:
                raise CopyBackendError(
                    f"copying {n} bytes from device address {allocation.address + start:#x} to the host failed: {exc}",
                    allocation=allocation.index,
                    offset_bytes=start,
                ) from exc

        try:
            enqueue(0)
            for i, (start, n) in enumerate(pieces):
                if i + 1 < len(pieces):
                    enqueue(i + 1)  # into the buffer of chunk i - 2, which the caller is done with
                try:
                    device.synchronize_event(lane.events[i % slots])
                except Exception as exc:
                    raise CopyBackendError(
                        f"the device-to-host copy of {n} bytes failed: {exc}", allocation=allocation.index, offset_bytes=start
                    ) from exc
                view = host_view(lane.buffers[i % slots], n)
                # The lane goes back to the pool when this generator ends: the last chunk is a copy.
                yield view if i + 1 < len(pieces) else memoryview(bytes(view))
        finally:
            with contextlib.suppress(Exception):
                device.synchronize_stream(lane.stream)
            self._read_lanes.put(lane)
