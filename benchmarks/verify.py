#!/usr/bin/env python3
"""First-use verification and the validation-record fast path, against one hashlib pass over the same file.

The script writes one pack of ``--size-mib`` MiB (default 256) with the canonical writer into a fresh
state root: random bytes resident in host memory, cut into extents of 4 MiB minus 123 bytes (so the
pack has zero padding between them, like a real one). The pack is read once so that every
measurement below reads it from the page cache (``--cold``: its pages are dropped with
``posix_fadvise(DONTNEED)`` before each timed read instead, so each reads the disk). Then, alternating,
``--repetitions`` times:

* ``hashlib``: the reference, one ``hashlib.sha256`` pass over the file (``readinto`` of 8 MiB chunks
  into one buffer): the least work any full check can do;
* ``first use``: :meth:`PayloadCache.admit` on the object with its validation record removed
  beforehand (untimed): the record check fails, the digest lock is taken, the one verifier
  (:func:`coldsnap_core.format.verify.verify_pack_file`) hashes the file, and a new record is written and
  fsynced;
* ``disk read``: one sequential read of the file (``readinto`` of 8 MiB chunks), no hashing;
* ``hashlib on N threads``: the file cut into N equal parts, each read and hashed by its own thread (not
  the file's digest: what SHA-256 over N threads achieves on this machine now, where other processes
  may hold cores), for N = :func:`coldsnap_core.format.verify.admission_threads`;
* ``one pass + layout``: :func:`coldsnap_core.format.verify.verify_pack_file` with the manifest's layout
  (the file's SHA-256 and the padding on one thread, the stored extents on a helper thread, one read:
  what ``coldsnap verify`` and the judging of a failed first use do, and what a restore's first use did);
* ``first use by extents``: :meth:`PayloadCache.admit` with the layout, by a fresh ``PayloadCache``, the
  record removed: the restore's first use (every stored extent and padding byte on
  :func:`coldsnap_core.format.verify.admission_threads` threads; the whole-file hash and the record that
  follow on a daemon thread after the load are not timed);
* ``record fast path``: :meth:`PayloadCache.admit` with a trusted record (median of ``--fast-calls``
  calls): ``lstat`` of the folders, object and record, reading and parsing the record.

It prints medians and three ratios, each with its goal: ``hashlib time / first-use time`` (first-use
throughput relative to one hashlib pass, goal >= 0.9), ``first use by extents / max(disk read, hashlib /
threads)`` (goal <= 1.25; also against the measured ``hashlib on N threads``) and ``fast path /
hashlib`` (goal <= 0.01). Nothing is asserted. Usage::

    .venv/bin/python benchmarks/verify.py [--size-mib 256] [--repetitions 5] [--fast-calls 200] [--cold] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from _common import MiB, machine_line, median_seconds, print_table, warm_page_cache

from coldsnap_core._io import HASH_CHUNK_BYTES
from coldsnap_core.cache.payload_cache import ADMIT_CHUNK_BYTES, PayloadCache
from coldsnap_core.capture.payload import write_pack
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.manifest import PackRef
from coldsnap_core.format.pack_layout import PackLayout
from coldsnap_core.format.verify import admission_threads, verify_pack_file

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


def hashlib_pass(path: Path, *, hash_bytes: bool = True) -> str:
    """One sequential read of ``path`` in 8 MiB chunks, hashed (``hash_bytes=False``: only read)."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            if hash_bytes:
                digest.update(view[:n])
    return digest.hexdigest()


def hashlib_on_threads(path: Path, threads: int) -> None:
    """The file cut into ``threads`` equal parts, each read (``preadv``, 1 MiB) and hashed on its own thread."""
    size = path.stat().st_size
    step = -(-size // threads)

    def part(start: int) -> None:
        digest, view = hashlib.sha256(), memoryview(bytearray(ADMIT_CHUNK_BYTES))
        for offset in range(start, min(size, start + step), ADMIT_CHUNK_BYTES):
            n = os.preadv(fd, [view[: min(ADMIT_CHUNK_BYTES, start + step - offset)]], offset)
            digest.update(view[:n])

    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(0, size, step)))
    finally:
        os.close(fd)


def drop_pages(path: Path) -> None:
    """Drop the file's pages from the page cache (``posix_fadvise(DONTNEED)``; the file is clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--fast-calls", type=int, default=200)
    parser.add_argument("--cold", action="store_true", help="drop the pack's pages before each timed read")
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

        def cold() -> None:
            if args.cold:
                drop_pages(path)

        def drop_record() -> None:
            record.unlink(missing_ok=True)
            cold()

        fresh = [cache]

        def fresh_cache() -> None:
            drop_record()
            fresh[0] = PayloadCache(root / "state")  # remembers no earlier admission

        times: dict[str, list[float]] = {
            name: []
            for name in ("hashlib", "disk read", "hashlib on N threads", "first use", "one pass + layout", "first use by extents")
        }
        threads = admission_threads()
        for _ in range(args.repetitions):
            times["hashlib"].append(median_seconds(lambda: hashlib_pass(path), 1, setup=cold))
            times["disk read"].append(median_seconds(lambda: hashlib_pass(path, hash_bytes=False), 1, setup=cold))
            times["hashlib on N threads"].append(median_seconds(lambda: hashlib_on_threads(path, threads), 1, setup=cold))
            times["first use"].append(median_seconds(lambda: cache.admit(digest, size), 1, setup=drop_record))
            times["one pass + layout"].append(
                median_seconds(
                    lambda: verify_pack_file(path, PackRef.for_digest(digest, size), layout, chunk_bytes=ADMIT_CHUNK_BYTES),
                    1,
                    setup=cold,
                )
            )
            times["first use by extents"].append(
                median_seconds(lambda: fresh[0].admit(digest, size, layout=layout), 1, setup=fresh_cache)
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
        where = "read from disk (pages dropped before each)" if args.cold else "page-cached"
        print(
            f"pack: {size / 1e6:.0f} MB ({size / MiB:.1f} MiB), {len(layout.entries)} stored extents, {where};"
            f" {args.repetitions} repetitions; first use by extents on {threads} threads"
        )
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
        bound = max(medians["disk read"], reference / threads)
        print(f"first-use verification throughput / one hashlib pass: {reference / medians['first use']:.3f} (goal >= 0.9)")
        print(
            f"first use by extents / max(disk read, hashlib / {threads}):  {medians['first use by extents'] / bound:.3f}"
            " (goal <= 1.25)"
        )
        measured = max(medians["disk read"], medians["hashlib on N threads"])
        print(
            f"first use by extents / max(disk read, hashlib on {threads} threads): {medians['first use by extents'] / measured:.3f}"
            " (measured bound)"
        )
        print(
            f"first use by extents / one pass + layout:             {medians['first use by extents'] / medians['one pass + layout']:.3f}"
        )
        print(
            f"record fast path / full hash of the pack:               {medians['record fast path'] / reference:.5f} (goal <= 0.01)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
