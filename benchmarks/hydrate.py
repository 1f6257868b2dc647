#!/usr/bin/env python3
"""Hydration throughput against a plain copy of the same bytes into the same destinations.

For each real SmolLM2 checkpoint (the 2-layer cut, 71 MB, and the full model, 269 MB) this script

1. stages the checkpoint into host slabs (``slabs.stage_checkpoint``) and captures a
   pack + residual blob into a fresh state root;
2. reads the pack and the blob once, so both are in the page cache;
3. allocates fresh destination slabs and touches every page once (no first-touch faults in either
   measurement);
4. then, alternating, several times:

   * ``hydrate``: :func:`coldsnap_core.restore.hydrate.hydrate` with the host backend, everything included
     (manifest rules, live layout, pack admission through its validation record, padding check, blob
     SHA-256, the copy);
   * ``plain copy``: ``os.preadv`` of each extent's range of the same page-cached files into the same
     destination views, one thread, in manifest order: what a minimal loader without any checks does;
   * ``plain copy xN``: the same reads split into 4 MiB pieces over N threads (the best plain copy on
     this machine, for context).

It prints medians and the throughput ratio ``hydrate / plain copy`` (goal >= 0.9). Nothing
is asserted. Usage::

    .venv/bin/python benchmarks/hydrate.py [--repetitions 15] [--tmp /dev/shm] [--checkpoint smollm2-2layer ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from _common import CHECKPOINTS, MiB, checkpoint, machine_line, median_seconds, print_table, warm_page_cache
from slabs import checkpoint_files, stage_checkpoint

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.host import HostCopyBackend, host_view
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.manifest import NativeManifest, WorkerIdentity
from coldsnap_core.identity.model_identity import identify_checkpoint
from coldsnap_core.restore.hydrate import hydrate

PIECE_BYTES = 4 * MiB


def _preadv_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError("short file")
        done += n


def _copy_ranges(manifest: NativeManifest) -> list[tuple[str, int, int, int, int]]:
    """``(source, source_offset, allocation, offset, size)`` of every extent, in manifest order."""
    ranges = [("pack", e.pack_offset_bytes, e.allocation_index, e.offset_bytes, e.size_bytes) for e in manifest.model_extents]
    ranges += [("blob", e.blob_offset_bytes, e.allocation_index, e.offset_bytes, e.size_bytes) for e in manifest.residual_extents]
    return ranges


def plain_copy(ranges, sources: dict[str, Path], live: Sequence[LiveAllocation], threads: int = 1) -> None:
    """The reference: read each range straight into its destination view, no checks."""
    fds = {name: os.open(path, os.O_RDONLY) for name, path in sources.items()}
    try:
        if threads == 1:
            for source, source_offset, allocation, offset, size in ranges:
                _preadv_all(fds[source], host_view(live[allocation].address + offset, size), source_offset)
            return
        pieces = [
            (source, source_offset + start, allocation, offset + start, min(PIECE_BYTES, size - start))
            for source, source_offset, allocation, offset, size in ranges
            for start in range(0, size, PIECE_BYTES)
        ]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(
                pool.map(
                    lambda p: _preadv_all(fds[p[0]], host_view(live[p[2]].address + p[3], p[4]), p[1]),
                    pieces,
                )
            )
    finally:
        for fd in fds.values():
            os.close(fd)


def bench(name: str, repetitions: int, tmp: str) -> list[object]:
    folder = checkpoint(name)
    slabs = stage_checkpoint(folder)
    root = Path(tempfile.mkdtemp(prefix="coldsnap-bench-hydrate.", dir=tmp))
    try:
        cache = PayloadCache(root / "state")
        backend = HostCopyBackend()
        result = capture_worker(
            allocation_map=slabs.allocation_map,
            allocations=slabs.allocations,
            model_ranges=slabs.model_ranges,
            worker=WorkerIdentity("worker", 0, 1, 0, 1),
            capture_point="portable",
            model=identify_checkpoint(checkpoint_files(folder), source=str(folder)),
            cache=cache,
            artifact_dir=root / "artifact",
            backend=backend,
        )
        manifest = result.manifest
        blob = result.capsule_dir / manifest.residual.file
        sources = {"pack": result.pack_path, "blob": blob}
        for path in sources.values():
            warm_page_cache(path)
        destinations = tuple(np.empty(a.size_bytes, dtype=np.uint8) for a in slabs.allocation_map.allocations)
        for d in destinations:
            d.fill(0xA5)  # touch every page now, outside every measurement
        live = [LiveAllocation(i, int(d.ctypes.data), d.nbytes) for i, d in enumerate(destinations)]
        ranges = _copy_ranges(manifest)
        threads = backend.threads

        reports = []

        def run_hydrate(verify: bool = False) -> None:
            reports.append(
                hydrate(
                    manifest,
                    blob_path=blob,
                    cache=cache,
                    allocations=live,
                    backend=backend,
                    live_layout=slabs.allocation_map,
                    verify_extents=verify,
                )
            )

        run_hydrate()  # admission writes nothing new (capture wrote the record); one warm-up run
        exact = all(np.array_equal(a, b) for a, b in zip(destinations, slabs.arrays, strict=True))
        plain_copy(ranges, sources, live)
        times: dict[str, list[float]] = {"hydrate": [], "hydrate_verify": [], "copy1": [], "copyN": []}
        for _ in range(repetitions):  # alternate, so drift hits every variant alike
            times["hydrate"].append(median_seconds(run_hydrate, 1))
            times["copy1"].append(median_seconds(lambda: plain_copy(ranges, sources, live), 1))
            times["hydrate_verify"].append(median_seconds(lambda: run_hydrate(True), 1))
            times["copyN"].append(median_seconds(lambda: plain_copy(ranges, sources, live, threads), 1))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        copy_phase = sorted(r.copy_seconds for r in reports)[len(reports) // 2]
        check_phase = sorted(r.check_seconds for r in reports)[len(reports) // 2]
        total = manifest.model_bytes + manifest.residual_bytes
        gbps = {k: total / v / 1e9 for k, v in med.items()}
        return [
            name,
            f"{total / MiB:.1f}",
            f"{gbps['copy1']:.2f}",
            f"{gbps['copyN']:.2f}",
            f"{gbps['hydrate']:.2f}",
            f"{gbps['hydrate_verify']:.2f}",
            f"{1e3 * check_phase:.1f}/{1e3 * copy_phase:.1f}",
            f"{med['copy1'] / med['hydrate']:.2f}",
            f"{med['copyN'] / med['hydrate']:.2f}",
            f"{med['copy1'] / med['hydrate_verify']:.2f}",
            "yes" if exact else "NO",
            threads,
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--tmp", default=None, help="folder for the state root (default: the system temp folder)")
    parser.add_argument("--checkpoint", action="append", choices=sorted(CHECKPOINTS), help="default: all")
    args = parser.parse_args()
    print(f"coldsnap hydration benchmark: {machine_line()}; state root under {args.tmp or tempfile.gettempdir()}")
    print(f"median of {args.repetitions} alternating runs; pack and blob page-cached; destinations pre-touched\n")
    rows = [bench(name, args.repetitions, args.tmp) for name in args.checkpoint or CHECKPOINTS]
    print_table(
        [
            "checkpoint",
            "MiB",
            "copy GB/s",
            "copy xN GB/s",
            "hydrate GB/s",
            "hydrate+verify GB/s",
            "hydrate check/copy ms",
            "hydrate/copy",
            "hydrate/copy xN",
            "hydrate+verify/copy",
            "bytes equal",
            "threads",
        ],
        rows,
    )
    print("\nratios are throughput ratios (plain copy time / hydrate time); goal hydrate/copy >= 0.9")


if __name__ == "__main__":
    main()
