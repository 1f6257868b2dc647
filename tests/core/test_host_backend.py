"""The host copy backend, the capture-side range checks, and the streaming writers, on real files.

Synthetic byte patterns make every misplaced byte visible; odd chunk sizes put chunk boundaries
inside extents; several threads exercise the batch split.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import platform
import re
from pathlib import Path

import numpy as np
import pytest
from core_support import SYNTHETIC_MODEL, WORKER, live_allocations

from coldsnap_core._io import HashingWriter, write_hashed
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.payload import ModelRange, check_model_ranges
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.base import CopyOp, stable_chunks
from coldsnap_core.copy.host import (
    PAGE_BYTES,
    HostCopyBackend,
    deal_largest_first,
    free_huge_block_bytes,
    free_page_reporting,
    huge_pages_pay,
    split_even,
)
from coldsnap_core.errors import CopyBackendError, ExtentDigestMismatchError, ObserverError
from coldsnap_core.format.allocation import Allocation, AllocationMap, LiveAllocation
from coldsnap_core.format.extents import ExtentProvenance

SOURCE_BYTES = 1 << 20


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, bytes]:
    data = hashlib.shake_256(b"coldsnap").digest(SOURCE_BYTES)
    path = tmp_path / "source.bin"
    path.write_bytes(data)
    return path, data


def _ops(data: bytes) -> list[CopyOp]:
    """Ops of assorted sizes (1 byte to 300 KiB) into two allocations, in source order."""
    sizes = [1, 4095, 4096, 4097, 300_000, 7, 100_000, 65_536]
    ops, source_offset, dest = [], 0, [0, 0]
    for i, size in enumerate(sizes):
        allocation = i % 2
        digest = hashlib.sha256(data[source_offset : source_offset + size]).hexdigest()
        ops.append(CopyOp("pack", source_offset, allocation, dest[allocation], size, digest, i))
        source_offset += size + 123
        dest[allocation] += size + 11
    return ops


def _expected(ops: list[CopyOp], data: bytes, sizes: list[int]) -> list[bytes]:
    out = [bytearray(n) for n in sizes]
    for op in ops:
        out[op.allocation_index][op.offset_bytes : op.offset_bytes + op.size_bytes] = data[
            op.source_offset_bytes : op.source_offset_bytes + op.size_bytes
        ]
    return [bytes(b) for b in out]


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("chunk_bytes", [4096, 5000, 1 << 20])
@pytest.mark.parametrize("verify", [False, True])
def test_fill_places_every_byte(source, threads: int, chunk_bytes: int, verify: bool) -> None:
    """Catches misplaced, skipped or doubled bytes when ops are split across threads and chunks (a
    chunk boundary inside an op, an op smaller than a chunk, more threads than ops' worth of bytes),
    and a verification that hashes the wrong bytes (a correct copy would then fail)."""
    path, data = source
    ops = _ops(data)
    sizes = [max(op.offset_bytes + op.size_bytes for op in ops if op.allocation_index == a) + 5 for a in (0, 1)]
    arrays = [np.zeros(n, dtype=np.uint8) for n in sizes]
    HostCopyBackend(threads=threads, chunk_bytes=chunk_bytes).fill(
        ops, {"pack": path}, live_allocations(arrays), verify_extents=verify
    )
    assert [a.tobytes() for a in arrays] == _expected(ops, data, sizes)


def test_split_even_cuts_contiguous_aligned_balanced_runs(source) -> None:
    """Catches an unbalanced split (one thread left with a whole embedding) or pieces that overlap or
    leave gaps: the runs cover every op byte once, in order, cut at multiples of the chunk size."""
    _, data = source
    ops = _ops(data)
    total = sum(op.size_bytes for op in ops)
    batches = split_even(ops, 3, 4096)
    assert len(batches) == 3
    loads = [sum(p.size_bytes for p in b) for b in batches]
    assert sum(loads) == total and max(loads) - min(loads) <= 2 * 4096 + max(loads) // 10
    flat = [p for b in batches for p in b]
    covered: dict[int, int] = {}
    for piece in flat:
        assert piece.skip_bytes % 4096 == 0
        assert covered.get(piece.op.extent_index, 0) == piece.skip_bytes
        covered[piece.op.extent_index] = piece.skip_bytes + piece.size_bytes
    assert covered == {op.extent_index: op.size_bytes for op in ops}
    assert split_even([], 4, 4096) == []


def test_deal_largest_first_keeps_whole_ops_and_balances(source) -> None:
    """Catches a verification split that cuts an extent (its SHA-256 could not be checked) or piles
    work on one thread: every op lands whole in exactly one batch; the largest goes alone."""
    _, data = source
    ops = _ops(data)
    batches = deal_largest_first(ops, 2)
    assert sorted(p.op.extent_index for b in batches for p in b) == list(range(len(ops)))
    assert all(p.skip_bytes == 0 and p.size_bytes == p.op.size_bytes for b in batches for p in b)
    assert [p.op.size_bytes for p in batches[0]] == [300_000]


def test_short_source_is_a_copy_error_naming_the_destination(source, tmp_path: Path) -> None:
    """Catches a short read silently leaving destination bytes unwritten (preadv returning 0)."""
    _, data = source
    short = tmp_path / "short.bin"
    short.write_bytes(data[:1000])
    ops = [CopyOp("blob", 500, 1, 64, 1000, None, 3)]
    arrays = [np.zeros(10, np.uint8), np.zeros(2000, np.uint8)]
    with pytest.raises(CopyBackendError) as info:
        HostCopyBackend(threads=1).fill(ops, {"blob": short}, live_allocations(arrays), verify_extents=False)
    assert (info.value.allocation, info.value.offset_bytes) == (1, 564)
    assert "blob extent 3" in str(info.value) and str(short) in str(info.value)


def test_missing_source_is_a_copy_error(tmp_path: Path) -> None:
    """Catches an untyped FileNotFoundError from the backend (exit code 4 with a message, not a traceback)."""
    with pytest.raises(CopyBackendError, match="cannot open the pack"):
        HostCopyBackend().fill([], {"pack": tmp_path / "gone.pack"}, [], verify_extents=False)


def test_extent_digest_mismatch_names_the_extent_and_stops(source) -> None:
    """Catches a wrong extent going unnoticed with ``verify_extents``: the bad extent raises
    ExtentDigestMismatchError naming its allocation and offset (here the 300 KiB extent 4)."""
    path, data = source
    ops = _ops(data)
    bad = ops[4]
    ops[4] = CopyOp(bad.source, bad.source_offset_bytes, bad.allocation_index, bad.offset_bytes, bad.size_bytes, "0" * 64, 4)
    sizes = [max(op.offset_bytes + op.size_bytes for op in ops if op.allocation_index == a) + 5 for a in (0, 1)]
    arrays = [np.zeros(n, dtype=np.uint8) for n in sizes]
    with pytest.raises(ExtentDigestMismatchError) as info:
        HostCopyBackend(threads=2).fill(ops, {"pack": path}, live_allocations(arrays), verify_extents=True)
    assert (info.value.allocation, info.value.offset_bytes) == (bad.allocation_index, bad.offset_bytes)
    assert "model extent 4" in str(info.value)


def test_host_backend_needs_a_thread() -> None:
    """Catches a host backend built with no thread (it would never copy). The ``read_chunks`` bounds
    and chunking are the ``CopyBackend`` contract: ``tests/sleep/test_copy_backend_contract.py``."""
    with pytest.raises(ValueError):
        HostCopyBackend(threads=0)


@pytest.mark.parametrize("stable", [True, False])
def test_write_hashed_digest_equals_the_file(tmp_path: Path, stable: bool) -> None:
    """Catches a streaming writer whose digest does not cover exactly the written bytes in order (in
    both the two-thread stable mode and the lockstep mode)."""
    pieces = [os.urandom(n) for n in (0, 1, 5000, 1 << 20, (8 << 20) + 3, 17)]
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        seen = []
        digest, size = write_hashed(fd, lambda: iter(pieces), file=path, stable=stable, progress=seen.append)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert (digest, size) == (hashlib.sha256(data).hexdigest(), len(data)) and data == b"".join(pieces)
    assert sum(seen) == size


def test_stable_chunks_is_opt_in() -> None:
    """Catches the two-thread writer being used for a backend that reuses its buffers (that would hash
    bytes other than those written): only backends declaring ``stable_chunks = True`` get it."""
    assert stable_chunks(HostCopyBackend())
    assert not stable_chunks(object())
    assert HashingWriter  # the lockstep writer remains for the others


def _provenance() -> ExtentProvenance:
    return ExtentProvenance("f.safetensors", "t", 0, 1, 1, 1, False)


@pytest.mark.parametrize(
    ("ranges", "words"),
    [
        ([ModelRange(0, 0, 0, _provenance())], "non-empty"),
        ([ModelRange(1, -8, 16, _provenance())], "start at >= 0"),
        ([ModelRange(2, 0, 4, _provenance())], "names allocation 2"),
        ([ModelRange(-1, 0, 4, _provenance())], "names allocation -1"),
        ([ModelRange(0, 60, 8, _provenance())], "beyond its allocation"),
        ([ModelRange(0, 8, 8, _provenance()), ModelRange(0, 12, 8, _provenance())], "sorted and disjoint"),
        ([ModelRange(1, 0, 8, _provenance()), ModelRange(0, 0, 8, _provenance())], "sorted and disjoint"),
    ],
    ids=["empty", "negative-offset", "unknown-allocation", "negative-allocation", "past-end", "overlap", "unsorted"],
)
def test_observer_ranges_are_checked_before_capture(ranges: list[ModelRange], words: str) -> None:
    """Catches an observer bug slipping into a manifest (a negative index would silently address the
    last allocation): each malformed model range raises ObserverError naming allocation and offset."""
    allocations = [LiveAllocation(0, 4096, 64), LiveAllocation(1, 8192, 64)]
    with pytest.raises(ObserverError) as info:
        check_model_ranges(ranges, allocations)
    assert words in str(info.value) and "allocation=" in str(info.value)


def test_capture_refuses_an_allocation_map_that_disagrees_with_the_live_allocations(tmp_path: Path) -> None:
    """Catches a manifest written for other allocations than the ones read: nothing is written."""
    arrays = [np.zeros(64, np.uint8), np.zeros(32, np.uint8)]
    allocation_map = AllocationMap((Allocation(0, 64, "buffer", None, ()), Allocation(1, 33, "buffer", None, ())))
    with pytest.raises(ObserverError) as info:
        capture_worker(
            allocation_map=allocation_map,
            allocations=live_allocations(arrays),
            model_ranges=[],
            worker=WORKER,
            capture_point="portable",
            model=SYNTHETIC_MODEL,
            cache=PayloadCache(tmp_path / "state"),
            artifact_dir=tmp_path / "artifact",
            backend=HostCopyBackend(),
        )
    assert info.value.allocation == 1
    assert not (tmp_path / "state").exists() and not (tmp_path / "artifact").exists()


def test_prefault_for_write_never_changes_bytes() -> None:
    """Catches a prefault that writes (or zeroes) memory: ``MADV_POPULATE_WRITE`` over a range whose
    first and last pages are shared with neighbouring bytes leaves every byte as it was, and it is
    supported on this kernel (>= 5.14), so the copy really takes the one-call path."""
    from coldsnap_core.copy.host import PAGE_BYTES, prefault_for_write

    block = np.frombuffer(np.random.default_rng(7).bytes(8 * PAGE_BYTES), dtype=np.uint8).copy()
    before = hashlib.sha256(block.tobytes()).hexdigest()
    address = block.ctypes.data
    supported = prefault_for_write(address + 100, 5 * PAGE_BYTES + 17)  # unaligned at both ends
    kernel = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])
    assert supported or kernel < (5, 14), f"MADV_POPULATE_WRITE refused on Linux {platform.release()}"
    assert prefault_for_write(address, 0)
    assert hashlib.sha256(block.tobytes()).hexdigest() == before


def _anon_huge_kib(start: int, end: int) -> int:
    """``AnonHugePages`` (KiB) of this process's mappings that overlap ``[start, end)`` (``/proc/self/smaps``;
    advice on part of a mapping splits it into several)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return re.search(r"\[(\w+)\]", text).group(1)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off on this kernel")
def test_fill_backs_fresh_destinations_with_huge_pages(tmp_path: Path) -> None:
    """Catches hydration into fresh memory losing its huge-page advice (``MADV_HUGEPAGE`` before the
    threads fault their ranges, ``benchmarks/host_fill.py`` measures what that buys): a fill of
    12 MiB into a fresh, unaligned anonymous mapping leaves it backed by transparent huge pages, the
    bytes are exact, and the bytes before and after the allocation (its neighbours) are untouched.
    Four threads cut the range so that a 2 MiB page straddles two threads' pieces. (Under THP mode
    ``always`` every fresh mapping gets huge pages anyway; the test then only checks the bytes.)"""
    import ctypes
    import mmap

    size = 12 << 20
    data = hashlib.shake_256(b"huge").digest(size)
    path = tmp_path / "pack"
    path.write_bytes(data)
    # Fresh private anonymous memory, never touched (as a large torch CPU allocation; a shared
    # mapping would be shmem, which the THP "enabled" mode does not cover).
    region = mmap.mmap(-1, size + (6 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        start = (-(-base // (2 << 20)) * (2 << 20)) + 12345 - base  # unaligned inside a huge page
        region[start - 1 : start] = b"\x01"
        region[start + size : start + size + 1] = b"\x02"
        ops = [CopyOp("pack", 0, 0, 0, size, None, 0)]
        HostCopyBackend(threads=4, chunk_bytes=1 << 20, huge_pages=True).fill(
            ops, {"pack": path}, [LiveAllocation(0, base + start, size)], verify_extents=False
        )
        assert region[start : start + size] == data
        assert region[start - 1 : start] == b"\x01" and region[start + size : start + size + 1] == b"\x02"
        assert _anon_huge_kib(base, base + len(region)) >= 4 * 2048, "transparent huge pages do not back the filled range"
    finally:
        del base
        region.close()


BUDDYINFO_TEXT = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32     21     20     17     17     14      8      3      8      7      7    746
Node 0, zone   Normal   8682   9383   6299  11029   9307  10032   5546   1630    210     77    536
"""


@pytest.mark.skipif(PAGE_BYTES != 4096, reason="the golden sum assumes 4 KiB base pages")
def test_free_huge_block_bytes_counts_orders_of_2_mib_and_up() -> None:
    """Catches the huge-page budget counting the wrong orders (order 9 = 2 MiB with 4 KiB pages) or
    one zone only: golden sum of orders 9 and 10 over the three zones of a real ``/proc/buddyinfo``
    (DMA 1 + 3 x 2, DMA32 7 + 746 x 2, Normal 77 + 536 x 2 blocks of 2 MiB); unreadable text gives
    ``None`` (no advice), a line that is not a zone is skipped."""
    assert free_huge_block_bytes(BUDDYINFO_TEXT) == (1 + 6 + 7 + 1492 + 77 + 1072) * (2 << 20)
    assert free_huge_block_bytes("Node 0, zone Normal 1 2 x") is None
    assert free_huge_block_bytes("garbage\n") == 0
    assert free_huge_block_bytes() is not None  # this kernel's own file parses


def test_huge_pages_pay_only_with_free_blocks_for_twice_the_bytes() -> None:
    """Catches the advice being given where it compacts memory synchronously (a 3.4 GB fill was
    1.2 x slower with it on a node full of page cache): advised only when free 2 MiB blocks cover
    twice the destination; never without a budget or for nothing."""
    assert huge_pages_pay(100 << 20, 200 << 20)
    assert not huge_pages_pay((100 << 20) + 1, 200 << 20)
    assert not huge_pages_pay(100 << 20, None)
    assert not huge_pages_pay(0, 1 << 30)


def test_huge_pages_never_pay_where_free_pages_are_reported_to_the_host() -> None:
    """Catches the advice being given in a virtual machine whose balloon hands free 2 MiB blocks back
    to the hypervisor (a 3.4 GB fill took 2.5-3 x as long with it there): with page reporting on, no
    budget is large enough."""
    assert huge_pages_pay(100 << 20, 1 << 40, page_reporting=False)
    assert not huge_pages_pay(100 << 20, 1 << 40, page_reporting=True)


def _virtio_device(root: Path, name: str, device_id: str, feature_bits: set[int]) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "device").write_text(f"{device_id}\n")
    (folder / "features").write_text("".join("1" if bit in feature_bits else "0" for bit in range(64)) + "\n")


def test_free_page_reporting_reads_the_balloon_reporting_bit(tmp_path: Path) -> None:
    """Catches the page-reporting probe reading the wrong device or the wrong bit: on a sysfs tree
    laid out as ``drivers/virtio/virtio.c`` writes it, only a balloon (device ``0x0005``) with
    feature bit 5 (``VIRTIO_BALLOON_F_REPORTING``) counts; a balloon with bits 0-4 only, a block
    device (``0x0002``) with bit 5, an unreadable device file and a missing tree do not."""
    root = tmp_path / "devices"
    _virtio_device(root, "virtio0", "0x0002", {5, 28, 32})
    _virtio_device(root, "virtio1", "0x0005", {0, 1, 2, 3, 4})
    (root / "virtio2").mkdir()  # no files: skipped, not an error
    assert not free_page_reporting(root)
    _virtio_device(root, "virtio3", "0x0005", {1, 2, 5, 7})
    assert free_page_reporting(root)
    assert not free_page_reporting(tmp_path / "absent")
    assert isinstance(free_page_reporting(), bool)  # this machine's own tree reads


def test_fill_faults_each_chunk_right_before_reading_it(source: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the prefault going back to a whole piece up front (all threads then fault at once and
    copy at once: a 3.4 GB fill was 1.8 x slower on 2 cores): every ``MADV_POPULATE_WRITE`` covers at
    most one chunk, the calls tile each piece's destination exactly once, and the bytes are exact."""
    import coldsnap_core.copy.host as host

    path, data = source
    calls: list[tuple[int, int]] = []
    real = host.prefault_for_write
    monkeypatch.setattr(host, "prefault_for_write", lambda a, n: calls.append((a, n)) or real(a, n))
    chunk = 64 << 10
    destination = np.zeros(SOURCE_BYTES, dtype=np.uint8)
    base = destination.ctypes.data
    ops = [CopyOp("pack", 0, 0, 0, SOURCE_BYTES, None, 0)]
    HostCopyBackend(threads=2, chunk_bytes=chunk, huge_pages=False).fill(
        ops, {"pack": path}, [LiveAllocation(0, base, SOURCE_BYTES)], verify_extents=False
    )
    assert destination.tobytes() == data
    assert calls and max(n for _, n in calls) <= chunk
    covered = sorted((a - base, a - base + n) for a, n in calls)
    assert covered[0][0] == 0 and covered[-1][1] == SOURCE_BYTES
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(covered)), "chunks overlap or leave a gap"


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only THP mode madvise makes the advice the difference")
@pytest.mark.parametrize(
    ("huge_pages", "budget_bytes", "reporting"),
    [(False, 1 << 40, False), (None, 0, False), (None, 1 << 40, True)],
    ids=["off", "no-budget", "reported"],
)
def test_fill_without_a_huge_page_budget_keeps_base_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, huge_pages: bool | None, budget_bytes: int, reporting: bool
) -> None:
    """Catches the huge-page advice being given when it was turned off (``huge_pages=False``), when
    the kernel has no free 2 MiB blocks for it (default, budget forced to 0) or when free blocks are
    reported to a hypervisor (default, a large budget but page reporting on): the filled mapping has
    no ``AnonHugePages`` and the bytes are exact."""
    import ctypes
    import mmap

    import coldsnap_core.copy.host as host

    monkeypatch.setattr(host, "free_huge_block_bytes", lambda: budget_bytes)
    monkeypatch.setattr(host, "free_page_reporting", lambda: reporting)
    size = 8 << 20
    data = hashlib.shake_256(b"small").digest(size)
    path = tmp_path / "pack"
    path.write_bytes(data)
    region = mmap.mmap(-1, size + (4 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        start = -(-base // (2 << 20)) * (2 << 20) - base
        ops = [CopyOp("pack", 0, 0, 0, size, None, 0)]
        HostCopyBackend(threads=2, huge_pages=huge_pages).fill(
            ops, {"pack": path}, [LiveAllocation(0, base + start, size)], verify_extents=False
        )
        assert region[start : start + size] == data
        assert _anon_huge_kib(base, base + len(region)) == 0, "huge pages were advised without a budget"
    finally:
        del base
        region.close()


@pytest.mark.parametrize("stable", [True, False])
def test_write_hashed_starts_writeback_each_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stable: bool) -> None:
    """Catches capture writing a whole pack into the page cache before the disk starts (the final
    fsync then waits for every byte, nothing overlapped with hashing): ``write_hashed`` of 2.5
    windows from offset 4096 starts the writeback of each full window, in order, on the kernel's
    real ``sync_file_range`` (which accepts it here), and the bytes and digest are exact."""
    import coldsnap_core._io as io_module

    calls: list[tuple[int, int, bool]] = []
    real = io_module.start_writeback

    def recording(fd: int, offset_bytes: int, size_bytes: int) -> bool:
        accepted = real(fd, offset_bytes, size_bytes)
        calls.append((offset_bytes, size_bytes, accepted))
        return accepted

    monkeypatch.setattr(io_module, "start_writeback", recording)
    window = io_module.WRITEBACK_WINDOW_BYTES
    data = np.random.default_rng(3).integers(0, 256, 5 * window // 2, dtype=np.uint8).tobytes()
    path = tmp_path / "out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, bytes(4096))
        chunk = 1 << 20
        digest, size = write_hashed(
            fd, lambda: (memoryview(data)[i : i + chunk] for i in range(0, len(data), chunk)), file=path, stable=stable
        )
    finally:
        os.close(fd)
    assert (digest, size) == (hashlib.sha256(data).hexdigest(), len(data))
    assert path.read_bytes()[4096:] == data
    assert calls == [(4096, window, True), (4096 + window, window, True)]
