#!/usr/bin/env python3
"""Host hydration into fresh memory against the machine's physical limits, side by side in one run.

A warm restore is one copy from the page cache into memory nobody has touched yet, so its cost is
the copy plus the first-touch faults (and zeroing) of the fresh pages. This script measures, on one
file of ``--size-mib`` MiB (a real pack when ``--file`` is given, else seeded bytes) and in
alternation, each variant ``--repetitions`` times into a fresh private anonymous mapping (as a large
torch CPU allocation is):

* ``fill, default``: :meth:`coldsnap_core.copy.host.HostCopyBackend.fill` as hydration runs it,
  every usable CPU (``MADV_POPULATE_WRITE`` then ``os.preadv``, 4 MiB at a time), huge pages advised
  only where :func:`coldsnap_core.copy.host.huge_pages_pay` says so (free 2 MiB blocks for twice the
  bytes, and no free page reporting to a hypervisor);
* ``fill, huge pages`` / ``fill, 4 KiB pages``: the same with the advice forced on / off;
* ``fill, 1 thread``: the same on one thread;
* ``read, first touch``: one ``os.preadv`` pass on one thread into the fresh mapping, faulting page
  by page: what a plain loader's copy into a new tensor costs;
* ``fault only``: ``MADV_POPULATE_WRITE`` of the fresh mapping, 4 MiB at a time on every CPU, with
  no copy (:func:`_common.fresh_fault_seconds`): the floor of any fill into fresh memory;

each after waiting :data:`_common.PAGE_REPORTING_SETTLE_S` so that the memory the previous variant
freed has been reported to the host where the machine does that (as the memory an engine starts
with has);

and the limits, each on already-faulted memory (no faults): ``memcpy`` (numpy copy between two
faulted buffers; the memory bandwidth one core gets), ``page cache read`` (``os.preadv`` from the
cached file into a faulted buffer) and ``disk read`` (the file evicted with ``POSIX_FADV_DONTNEED``,
then read on every CPU: the storage's rate). It prints medians, GB/s and each fill's time over the
memcpy time. Nothing is asserted. Usage::

    python benchmarks/host_fill.py [--size-mib 269] [--repetitions 5] [--file PACK] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from _common import (
    PAGE_REPORTING_SETTLE_S,
    MiB,
    drop_file_from_page_cache,
    fresh_fault_seconds,
    fresh_mapping,
    machine_line,
    print_table,
    warm_page_cache,
)

import coldsnap_core.copy.host as host
from coldsnap_core.copy.base import CopyOp
from coldsnap_core.copy.host import HostCopyBackend, host_view
from coldsnap_core.format.allocation import LiveAllocation


def timed(run: Callable[[int, int], object], size_bytes: int) -> float:
    time.sleep(PAGE_REPORTING_SETTLE_S)
    region, address = fresh_mapping(size_bytes)
    try:
        started = time.perf_counter()
        run(address, size_bytes)
        return time.perf_counter() - started
    finally:
        region.close()


def read_all(fd: int, address: int, size_bytes: int, threads: int, chunk_bytes: int = 4 * MiB) -> None:
    view = host_view(address, size_bytes)

    def one(part: int) -> None:
        for start in range(part * chunk_bytes, size_bytes, threads * chunk_bytes):
            os.preadv(fd, [view[start : start + chunk_bytes]], start)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=269)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--file", type=Path, default=None, help="an existing file to read (default: a seeded temporary file)")
    parser.add_argument("--tmp", type=Path, default=None, help="folder for the temporary file (default: the temp folder)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="coldsnap-host-fill-", dir=args.tmp))
    try:
        if args.file is not None:
            path = args.file
            size = path.stat().st_size
        else:
            size = args.size_mib * MiB
            path = work / "source.bin"
            rng = np.random.default_rng(12)
            with open(path, "wb") as f:
                for start in range(0, size, 64 * MiB):
                    f.write(rng.integers(0, 256, min(64 * MiB, size - start), dtype=np.uint8).tobytes())
        cpus = len(os.sched_getaffinity(0))
        print(f"host_fill: {machine_line()}")
        print(
            f"host_fill: {path} ({size / 1e6:.1f} MB), THP {Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()}"
        )
        ops = [CopyOp("pack", 0, 0, 0, size, None, 0)]
        fd = os.open(path, os.O_RDONLY)

        def fill(threads: int, huge: bool | None) -> Callable[[int, int], object]:
            def run(address: int, size_bytes: int) -> None:
                HostCopyBackend(threads=threads, huge_pages=huge).fill(
                    ops, {"pack": path}, [LiveAllocation(0, address, size_bytes)], verify_extents=False
                )

            return run

        free_blocks = host.free_huge_block_bytes()
        reporting = host.free_page_reporting()
        auto = host.huge_pages_pay(size, free_blocks, page_reporting=reporting)
        print(
            f"host_fill: free 2 MiB blocks now {(free_blocks or 0) / 1e9:.2f} GB, free page reporting"
            f" {'on' if reporting else 'off'}: the default fill"
            f" {'advises' if auto else 'does not advise'} huge pages for {size / 1e9:.2f} GB"
        )
        variants: dict[str, Callable[[int, int], object]] = {
            f"fill ({cpus} threads, default)": fill(cpus, None),
            f"fill ({cpus} threads, huge pages)": fill(cpus, True),
            f"fill ({cpus} threads, 4 KiB pages)": fill(cpus, False),
            "fill (1 thread, huge pages)": fill(1, True),
            "read, first touch (1 thread)": lambda a, n: read_all(fd, a, n, 1),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        times[f"fault only ({cpus} threads, no copy)"] = []
        limits: dict[str, list[float]] = {"memcpy (faulted buffers, 1 thread)": [], "page cache read (faulted buffer)": []}
        disk: list[float] = []
        source = np.empty(size, dtype=np.uint8)
        source[:] = 1
        target = np.empty(size, dtype=np.uint8)
        target[:] = 0
        warm_page_cache(path)
        for _ in range(args.repetitions):
            for name, run in variants.items():
                times[name].append(timed(run, size))
            times[f"fault only ({cpus} threads, no copy)"].append(fresh_fault_seconds(size))
            started = time.perf_counter()
            np.copyto(target, source)
            limits["memcpy (faulted buffers, 1 thread)"].append(time.perf_counter() - started)
            started = time.perf_counter()
            read_all(fd, target.ctypes.data, size, cpus)
            limits["page cache read (faulted buffer)"].append(time.perf_counter() - started)
        for _ in range(min(2, args.repetitions)):
            os.fdatasync(fd) if os.access(path, os.W_OK) else None
            drop_file_from_page_cache(path)
            started = time.perf_counter()
            read_all(fd, target.ctypes.data, size, cpus)
            disk.append(time.perf_counter() - started)
        warm_page_cache(path)
        os.close(fd)
        memcpy = statistics.median(limits["memcpy (faulted buffers, 1 thread)"])
        rows = []
        for name, values in [*times.items(), *limits.items(), (f"disk read ({cpus} threads, evicted)", disk)]:
            m = statistics.median(values)
            rows.append([name, f"{m:.4f}", f"{size / m / 1e9:.2f}", f"{m / memcpy:.2f}"])
        print(f"\nMedians of {args.repetitions} repetitions (disk: {len(disk)}), {size / 1e6:.1f} MB each:")
        print_table(["variant", "seconds", "GB/s", "x memcpy"], rows)
        huge = statistics.median(times[f"fill ({cpus} threads, huge pages)"])
        small = statistics.median(times[f"fill ({cpus} threads, 4 KiB pages)"])
        default = statistics.median(times[f"fill ({cpus} threads, default)"])
        plain = statistics.median(times["read, first touch (1 thread)"])
        fault = statistics.median(times[f"fault only ({cpus} threads, no copy)"])
        print(
            f"\nhuge pages / 4 KiB pages = {huge / small:.2f}; default fill / best of both = {default / min(huge, small):.2f};"
            f" default fill / plain first-touch read = {default / plain:.2f}; default fill / fault only = {default / fault:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
