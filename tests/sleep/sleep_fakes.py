"""Host-memory stand-ins with the real contracts, for the level-1 sleep backend's CPU tests.

* :class:`FakeCuMemAllocator`: vLLM's ``CuMemAllocator`` contract (``vllm/device_allocator/cumem.py``)
  over host memory at fixed virtual addresses. Each segment is a reserved virtual range
  (``mmap(PROT_NONE)``, like ``cuMemAddressReserve``); "create and map" maps fresh anonymous memory
  at the same address (``MAP_FIXED``) and fills it with garbage (CUDA leaves new physical memory
  undefined); "unmap and release" drops the pages and makes the range inaccessible again (any read of
  a released segment crashes the test, loudly). ``sleep``/``wake_up``/``discard`` follow vLLM's code
  line by line, host backups for offloaded tags included. ``AllocationData`` is vLLM's own class.
* :class:`FakeDeviceOps`: :class:`coldsnap_core.copy.cuda.DeviceOps` over host memory with CUDA's
  asynchronous contract: copies are queued per stream and run only when an event recorded after them
  or the stream is synchronized; a staging buffer changed while a copy from it is pending, a copy
  from non-pinned memory, or a pinned buffer freed with copies pending is recorded as a violation.
* :func:`load_checkpoint`: what the coldsnap loader leaves behind on a GPU with sleep mode: real
  checkpoint tensors copied into "weights" segments (big tensors in their own segment, small ones
  packed into shared 2 MiB segments, 512-byte aligned, as PyTorch's caching allocator does), buffers
  and allocator slack filled with non-checkpoint bytes, and the observed writes.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from coldsnap_core.copy.host import host_view
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import ModelIdentity, PackRef, WorkerIdentity
from coldsnap_core.format.safetensors_header import read_header
from coldsnap_core.load_policy import ModelWrite as ObservedModelWrite
from coldsnap_vllm.state import WorkerLoadState

try:
    from vllm.device_allocator import DEFERRABLE_TAGS, AllocationData
except ImportError:  # vLLM absent: a same-shaped stand-in
    DEFERRABLE_TAGS = ("weights", "kv_cache")

    @dataclass
    class AllocationData:  # type: ignore[no-redef]
        handle: tuple[int, int, int, int]
        tag: str
        cpu_backup_tensor: torch.Tensor | None = None
        is_asleep: bool = False


GRANULARITY_BYTES = 2 << 20
"""CUDA's allocation granularity on current GPUs; CuMem segment sizes are multiples of it."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mmap(address: int | None, size: int, prot: int, flags: int) -> int:
    result = _libc.mmap(address, size, prot, flags, -1, 0)
    if result is None or result == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap failed: {os.strerror(errno)}")
    if address is not None and result != address:
        raise OSError(f"mmap placed {result:#x}, not {address:#x}")
    return result


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def garbage(address: int, size: int, seed: int) -> None:
    """Fill ``[address, address + size)`` with seeded pseudo-random bytes."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    ctypes.memmove(address, data.ctypes.data, size)


def digest_at(address: int, size: int) -> str:
    return hashlib.sha256(host_view(address, size)).hexdigest()


class FakeCuMemAllocator:
    """``CuMemAllocator``'s contract over host memory (see the module docstring).

    Attributes:
        pointer_to_data: ``{segment base address: AllocationData}``, as vLLM's.
        calls: ``("sleep", offload_tags)``, ``("wake_up", tags)``, ``("discard", tags)`` in order.
        fail_map: addresses whose next create-and-map raises (fault injection, one shot each).
    """

    def __init__(self) -> None:
        self.pointer_to_data: dict[int, AllocationData] = {}
        self.calls: list[tuple[str, object]] = []
        self.fail_map: set[int] = set()
        self._handles = itertools.count(1)
        self._maps = itertools.count(1)

    # -- allocation (what the pluggable allocator's malloc does) ------------------------------------

    def allocate(self, size_bytes: int, tag: str) -> int:
        aligned = align_up(size_bytes, GRANULARITY_BYTES)
        address = _mmap(None, aligned, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
        handle = (0, aligned, address, next(self._handles))
        self._create_and_map(handle)
        self.pointer_to_data[address] = AllocationData(handle, tag)
        return address

    def close(self) -> None:
        for address, data in list(self.pointer_to_data.items()):
            _libc.munmap(address, data.handle[1])
        self.pointer_to_data.clear()

    def _create_and_map(self, handle: tuple[int, int, int, int]) -> None:
        _, size, address, _ = handle
        if address in self.fail_map:
            self.fail_map.discard(address)
            raise RuntimeError(f"CUDA Error: out of memory at cumem_allocator.cpp (fake create_and_map of {address:#x})")
        _mmap(address, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED)
        garbage(address, size, seed=next(self._maps))  # new physical memory holds undefined bytes

    def _unmap_and_release(self, handle: tuple[int, int, int, int]) -> None:
        _, size, address, _ = handle
        _mmap(address, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE)

    # -- the MemAllocator contract (vllm/device_allocator/cumem.py) ---------------------------------

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        self.calls.append(("sleep", offload_tags))
        if offload_tags is None:
            offload_tags = ("default",)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        for ptr, data in self.pointer_to_data.items():
            if data.is_asleep:
                continue
            size = data.handle[1]
            if data.tag in offload_tags:
                backup = torch.empty(size, dtype=torch.uint8, device="cpu")
                ctypes.memmove(backup.data_ptr(), ptr, size)
                data.cpu_backup_tensor = backup
            try:
                self._unmap_and_release(data.handle)
            finally:
                data.is_asleep = True

    def discard(self, tags: tuple[str, ...] | str) -> None:
        self.calls.append(("discard", tags))
        if isinstance(tags, str):
            tags = (tags,)
        for data in self.pointer_to_data.values():
            if data.tag in tags and not data.is_asleep:
                self._unmap_and_release(data.handle)
                data.is_asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", None if tags is None else list(tags)))
        for ptr, data in self.pointer_to_data.items():
            if not data.is_asleep:
                continue
            if tags is None or data.tag in tags or data.tag not in DEFERRABLE_TAGS:
                self._create_and_map(data.handle)
                data.is_asleep = False
                if data.cpu_backup_tensor is not None:
                    backup = data.cpu_backup_tensor
                    ctypes.memmove(ptr, backup.data_ptr(), backup.numel())
                    data.cpu_backup_tensor = None

    def get_current_usage(self) -> int:
        return sum(d.handle[1] for d in self.pointer_to_data.values())

    # -- test helpers -------------------------------------------------------------------------------

    def addresses(self, tag: str) -> list[int]:
        return sorted(a for a, d in self.pointer_to_data.items() if d.tag == tag)

    def digests(self, tag: str = "weights") -> dict[int, str]:
        """SHA-256 of every segment with ``tag`` (they must be mapped)."""
        return {a: digest_at(a, self.pointer_to_data[a].handle[1]) for a in self.addresses(tag)}

    def contains(self, address: int, size: int) -> bool:
        """Whether ``[address, address + size)`` lies in one mapped segment ("device memory")."""
        for base, data in self.pointer_to_data.items():
            if base <= address and address + size <= base + data.handle[1]:
                return not data.is_asleep
        return False


# --- a model loaded into weights segments --------------------------------------------------------


@dataclass
class LoadedModel:
    """What the coldsnap loader leaves in a sleep-mode worker (see :func:`load_checkpoint`).

    Attributes:
        allocator: the fake allocator holding the segments.
        writes: the observed model writes (one per checkpoint tensor), sorted by address.
        tensors: ``name -> (address, size_bytes)`` of each checkpoint tensor.
        buffers: ``name -> (address, size_bytes)`` of each non-checkpoint buffer.
    """

    allocator: FakeCuMemAllocator
    writes: tuple[ObservedModelWrite, ...]
    tensors: dict[str, tuple[int, int]] = field(default_factory=dict)
    buffers: dict[str, tuple[int, int]] = field(default_factory=dict)


def load_checkpoint(allocator: FakeCuMemAllocator, checkpoint_dir: Path, *, block_bytes: int = 512) -> LoadedModel:
    """Copy every tensor of a safetensors checkpoint into "weights" segments of ``allocator``.

    Tensors of 1 MiB or more get their own segment; smaller ones share 2 MiB segments, each block
    ``block_bytes`` aligned; after every 8 small tensors a 4 KiB buffer of non-checkpoint floats is
    placed (a rotary cache, a scale). Every unused segment byte holds seeded garbage (slack). A
    "runtime" (2 MiB) and a "kv_cache" (4 MiB) segment are allocated too.
    """
    locations = sorted(
        (loc for f in sorted(Path(checkpoint_dir).glob("*.safetensors")) for loc in read_header(f).values()),
        key=lambda loc: (loc.file.name, loc.offset_bytes),
    )
    model = LoadedModel(allocator, ())
    writes = []
    shared: tuple[int, int] | None = None  # (segment address, next free offset)
    fds: dict[Path, int] = {}
    small_count = 0

    def place_small(size: int) -> int:
        nonlocal shared
        size = align_up(size, block_bytes)
        if shared is None or shared[1] + size > GRANULARITY_BYTES:
            shared = (allocator.allocate(GRANULARITY_BYTES, "weights"), 0)
        address = shared[0] + shared[1]
        shared = (shared[0], shared[1] + size)
        return address

    try:
        for loc in locations:
            if loc.size_bytes >= 1 << 20:
                address = allocator.allocate(loc.size_bytes, "weights")
            else:
                address = place_small(loc.size_bytes)
                small_count += 1
                if small_count % 8 == 0:
                    buffer_address = place_small(4096)
                    values = np.cos(np.arange(1024, dtype=np.float32) * (small_count + 1) / 997.0)
                    ctypes.memmove(buffer_address, values.ctypes.data, 4096)
                    model.buffers[f"buffer.{small_count // 8}"] = (buffer_address, 4096)
            fd = fds.get(loc.file) or fds.setdefault(loc.file, os.open(loc.file, os.O_RDONLY))
            view = host_view(address, loc.size_bytes)
            done = 0
            while done < loc.size_bytes:
                done += os.preadv(fd, [view[done:]], loc.offset_bytes + done)
            provenance = ExtentProvenance(
                loc.file.name, loc.name, loc.offset_bytes, loc.size_bytes, loc.size_bytes, loc.size_bytes, False
            )
            writes.append(ObservedModelWrite(address, loc.size_bytes, provenance))
            model.tensors[loc.name] = (address, loc.size_bytes)
    finally:
        for fd in fds.values():
            os.close(fd)
    # Slack: every weights byte no tensor or buffer uses holds garbage, which a sleep must preserve.
    used = sorted([*model.tensors.values(), *model.buffers.values()])
    for i, address in enumerate(allocator.addresses("weights")):
        size = allocator.pointer_to_data[address].handle[1]
        position = address
        for start, length in [*(u for u in used if address <= u[0] < address + size), (address + size, 0)]:
            if start > position:
                garbage(position, start - position, seed=10_000 + i * 131 + (position - address))
            position = max(position, start + length)
    garbage(allocator.allocate(GRANULARITY_BYTES, "runtime"), GRANULARITY_BYTES, seed=7)
    garbage(allocator.allocate(2 * GRANULARITY_BYTES, "kv_cache"), 2 * GRANULARITY_BYTES, seed=8)
    model.writes = tuple(sorted(writes, key=lambda w: w.address))
    return model


def load_state(
    model: LoadedModel,
    identity: ModelIdentity | None,
    root: Path,
    *,
    pack: PackRef | None = None,
    writes: Iterable[ObservedModelWrite] | None = None,
    hf_cache_dir: Path | None = None,
) -> WorkerLoadState:
    """The state the coldsnap loader would publish for ``model`` (artifact and state root under ``root``)."""
    return WorkerLoadState(
        worker=WorkerIdentity("worker", 0, 1, 0, 1),
        model=identity,
        writes=tuple(model.writes if writes is None else writes),
        pack=pack,
        artifact_dir=root / "artifact",
        state_root=root / "state",
        hf_cache_dir=hf_cache_dir,
    )


# --- DeviceOps over host memory ----------------------------------------------------------------------


@dataclass
class _Pending:
    kind: str
    destination: int
    source: int
    size_bytes: int
    crc: int


class FakeDeviceOps:
    """:class:`coldsnap_core.copy.cuda.DeviceOps` over host memory, asynchronous (module docstring).

    Args:
        is_device: ``(address, size) -> bool``: whether a range is device memory (default: anything).
        eager_dtoh: run device-to-host copies at once (the earliest a GPU may; a buffer the caller
            still uses is overwritten as early as possible) instead of at synchronization.
        region_of: ``address -> hashable`` naming the allocation a destination is in, for the
            overlap statistics (default: the address itself).

    Attributes:
        log: ``(operation, ...)`` tuples in call order.
        violations: contract violations seen (a correct pipeline leaves it empty).
        fail_htod: ``(device_address, size) -> bool``; the first matching copy raises (one shot).
        max_pending_events: most events recorded and not yet synchronized at one time.
        max_pending_regions: most distinct destination regions among pending copies at one time.
    """

    device = 0

    def __init__(
        self,
        *,
        is_device: Callable[[int, int], bool] | None = None,
        region_of: Callable[[int], object] | None = None,
        eager_dtoh: bool = True,
    ) -> None:
        self.eager_dtoh = eager_dtoh
        self.is_device = is_device or (lambda address, size: True)
        self.region_of = region_of or (lambda address: address)
        self.log: list[tuple] = []
        self.violations: list[str] = []
        self.fail_htod: Callable[[int, int], bool] | None = None
        self.pinned: dict[int, int] = {}
        self.queues: dict[int, list[_Pending | tuple[str, int]]] = {}
        self.events: dict[int, int | None] = {}
        self.max_pending_events = 0
        self.max_pending_regions = 0
        self._ids = itertools.count(1)

    def _in_pinned(self, address: int, size: int) -> bool:
        return any(base <= address and address + size <= base + n for base, n in self.pinned.items())

    def alloc_pinned(self, size_bytes: int) -> int:
        address = _mmap(None, align_up(size_bytes, 4096), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)
        self.pinned[address] = align_up(size_bytes, 4096)
        self.log.append(("alloc_pinned", address, size_bytes))
        return address

    def free_pinned(self, address: int) -> None:
        size = self.pinned.pop(address)
        for queue in self.queues.values():
            for item in queue:
                if isinstance(item, _Pending) and (
                    address <= item.source < address + size or address <= item.destination < address + size
                ):
                    self.violations.append(f"pinned buffer {address:#x} freed with a copy pending")
        _libc.munmap(address, size)

    def create_stream(self) -> int:
        stream = next(self._ids)
        self.queues[stream] = []
        return stream

    def destroy_stream(self, stream: int) -> None:
        if any(isinstance(i, _Pending) for i in self.queues.get(stream, [])):
            self.violations.append(f"stream {stream} destroyed with copies pending")
        self.queues.pop(stream, None)

    def create_event(self) -> int:
        event = next(self._ids)
        self.events[event] = None
        return event

    def destroy_event(self, event: int) -> None:
        self.events.pop(event, None)

    def memcpy_htod_async(self, device_address: int, host_address: int, size_bytes: int, stream: int) -> None:
        self.log.append(("htod", device_address, size_bytes, stream))
        if self.fail_htod is not None and self.fail_htod(device_address, size_bytes):
            self.fail_htod = None
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered (fake)")
        if not self._in_pinned(host_address, size_bytes):
            self.violations.append(f"host-to-device copy from unpinned memory {host_address:#x}")
        if not self.is_device(device_address, size_bytes):
            self.violations.append(f"host-to-device copy to {device_address:#x}, which is not mapped device memory")
        crc = zlib.crc32(host_view(host_address, size_bytes))
        self.queues[stream].append(_Pending("htod", device_address, host_address, size_bytes, crc))
        self._measure()

    def memcpy_dtoh_async(self, host_address: int, device_address: int, size_bytes: int, stream: int) -> None:
        self.log.append(("dtoh", device_address, size_bytes, stream))
        if not self._in_pinned(host_address, size_bytes):
            self.violations.append(f"device-to-host copy into unpinned memory {host_address:#x}")
        if not self.is_device(device_address, size_bytes):
            self.violations.append(f"device-to-host copy from {device_address:#x}, which is not mapped device memory")
        pending = _Pending("dtoh", host_address, device_address, size_bytes, 0)
        if self.eager_dtoh and not any(isinstance(i, _Pending) for i in self.queues[stream]):
            self._execute(pending)
        else:
            self.queues[stream].append(pending)

    def record_event(self, event: int, stream: int) -> None:
        self.log.append(("record", event))
        for queue in self.queues.values():  # an event stands for its latest record only
            queue[:] = [i for i in queue if not (isinstance(i, tuple) and i[1] == event)]
        self.queues[stream].append(("event", event))
        self.events[event] = stream
        self._measure()

    def synchronize_event(self, event: int) -> None:
        self.log.append(("sync_event", event))
        stream = self.events.get(event)
        if stream is None:
            return
        queue = self.queues[stream]
        while queue:
            item = queue.pop(0)
            if isinstance(item, tuple):
                if item[1] == event:
                    break
                continue
            self._execute(item)

    def synchronize_stream(self, stream: int) -> None:
        self.log.append(("sync_stream", stream))
        queue = self.queues[stream]
        while queue:
            item = queue.pop(0)
            if isinstance(item, _Pending):
                self._execute(item)

    def _execute(self, item: _Pending) -> None:
        if item.kind == "htod" and zlib.crc32(host_view(item.source, item.size_bytes)) != item.crc:
            self.violations.append(f"staging bytes at {item.source:#x} changed while a copy from them was pending")
        ctypes.memmove(item.destination, item.source, item.size_bytes)

    def _measure(self) -> None:
        events = sum(1 for q in self.queues.values() for i in q if isinstance(i, tuple))
        regions = {
            self.region_of(i.destination) for q in self.queues.values() for i in q if isinstance(i, _Pending) and i.kind == "htod"
        }
        self.max_pending_events = max(self.max_pending_events, events)
        self.max_pending_regions = max(self.max_pending_regions, len(regions))

    def close(self) -> None:
        for address in list(self.pinned):
            self.free_pinned(address)
