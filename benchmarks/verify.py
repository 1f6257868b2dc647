#!/usr/bin/env python3
"""First-use verification and the validation-record fast path, against one hashlib pass over the same file.

The script writes one pack of ``--size-mib`` MiB (default 256) with the canonical writer into a fresh
state root: random bytes resident in host memory, cut into extents of 4 MiB minus 123 bytes (so the
pack has zero padding between them, like a real one). The pack is read once so that every
measurement below reads it from the page cache. Then, alternating, ``--repetitions`` times:

* ``hashlib``: the reference, one ``hashlib.sha256`` pass over the file (``readinto`` of 8 MiB chunks
  into one buffer): the least work any full check can do;
* ``first use``: :meth:`PayloadCache.admit` on the object with its validation record removed
  beforehand (untimed): the record check fails, the digest lock is taken, the one verifier
  (:func:`coldsnap_core.format.verify.verify_pack_file`) hashes the file, and a new record is written and
  fsynced;
* ``first use + layout``: the same with the manifest's layout, so the single pass also checks the
  zero padding and every stored extent's SHA-256 on a helper thread (what hydration's fallback and
  ``coldsnap verify`` do);
* ``record fast path``: :meth:`PayloadCache.admit` with a trusted record (median of ``--fast-calls``
  calls): ``lstat`` of the folders, object and record, reading and parsing the record.

It prints medians and two ratios, each with its goal: ``hashlib time / first-use time`` (first-use
throughput relative to one hashlib pass, goal >= 0.9) and ``fast path / hashlib`` (goal <= 0.01).
Nothing is asserted. Usage::

    .venv/bin/python benchmarks/verify.py [--size-mib 256] [--repetitions 5] [--fast-calls 200] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import MiB, machine_line, median_seconds, print_table, warm_page_cache

from coldsnap_core._io import HASH_CHUNK_BYTES
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.pack_writer import write_pack
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.pack_layout import PackLayout

EXTENT_BYTES = 4 * MiB - 123


def build_pack(cache: PayloadCache, size_bytes: int) -> tuple[str, int, PackLayout]:
    """Write a pack of about ``size_bytes`` bytes of random content; return (digest, size, layout)."""
    memory = np.frombuffer(np.random.default_rng(0).bytes(size_bytes), dtype=np.uint8)
    allocation = LiveAllocation(0, int(memory.ctypes.data), memory.nbytes)
    backend = HostCopyBackend()
    contents = []
    locate = {}
    for offset in range(0, size_bytes - EXTENT_BYTES + 1, EXTENT_BYTES):
        digest = hashlib.sha256(memory[offset : offset + EXTENT_BYTES]).hexdigest()
        contents.append((digest, EXTENT_BYTES))
        locate[(digest, EXTENT_BYTES)] = (allocation, offset)
    layout = PackLayout.plan(contents)
    pack = write_pack(layout, locate, backend, cache)
    del memory
    return pack.sha256, pack.size_bytes, layout


def hashlib_pass(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            digest.update(view[:n])
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--fast-calls", type=int, default=200)
    parser.add_argument("--tmp", type=Path, default=None, help="folder for the state root (default: the system temp folder)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="coldsnap-bench-verify-", dir=args.tmp))
    try:
        cache = PayloadCache(root / "state")
        digest, size, layout = build_pack(cache, args.size_mib * MiB)
        path = cache.object_path(digest)
        record = cache.record_path(digest)
        warm_page_cache(path)
        assert hashlib_pass(path) == digest

        def drop_record() -> None:
            record.unlink(missing_ok=True)

        times: dict[str, list[float]] = {"hashlib": [], "first use": [], "first use + layout": []}
        for _ in range(args.repetitions):
            times["hashlib"].append(median_seconds(lambda: hashlib_pass(path), 1))
            times["first use"].append(median_seconds(lambda: cache.admit(digest, size), 1, setup=drop_record))
            times["first use + layout"].append(
                median_seconds(lambda: cache.admit(digest, size, layout=layout), 1, setup=drop_record)
            )
        cache.admit(digest, size)  # leave a trusted record
        fast = []
        for _ in range(args.fast_calls):
            started = time.perf_counter()
            cache.admit(digest, size)
            fast.append(time.perf_counter() - started)

        medians = {name: statistics.median(values) for name, values in times.items()}
        medians["record fast path"] = statistics.median(fast)
        reference = medians["hashlib"]
        print(machine_line())
        print(f"pack: {size / MiB:.1f} MiB, {len(layout.entries)} stored extents, page-cached; {args.repetitions} repetitions")
        print()
        rows = []
        for name, seconds in medians.items():
            rows.append(
                (
                    name,
                    f"{seconds * 1e3:.3f}",
                    f"{size / seconds / 1e9:.2f}" if name != "record fast path" else "-",
                    f"{reference / seconds:.3f}" if name != "record fast path" else "-",
                    f"{seconds / reference:.5f}",
                )
            )
        print_table(("measurement", "median ms", "GB/s", "throughput vs hashlib", "time / hashlib"), rows)
        print()
        print(f"first-use verification throughput / one hashlib pass: {reference / medians['first use']:.3f} (goal >= 0.9)")
        print(
            f"record fast path / full hash of the pack:               {medians['record fast path'] / reference:.5f} (goal <= 0.01)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
