#!/usr/bin/env python3
"""What the checkpoint content fingerprint costs, against the restore it guards.

Restore checks each checkpoint file's content fingerprint (``docs/format.md`` §10.2: SHA-256 over the
safetensors header and 16 sampled 128 KiB blocks) wherever this node has no checkpoint record. For the
full SmolLM2 (269 MB, one file) and a synthetic multi-GB checkpoint (``--synthetic-gib``, written here
by a small streaming safetensors writer: 64 MiB bf16 tensors, each with distinct bytes so the pack
holds all of them) this script

1. stages the checkpoint into host slabs and captures a pack + residual blob;
2. then, alternating, several times:

   * ``restore``: the model identity check without a checkpoint record (so the fingerprints are
     computed) followed by :func:`coldsnap_core.restore.hydrate.hydrate` into pre-touched destinations, with
     pack, blob and checkpoint page-cached (``warm``: the fastest restore, so the least favourable
     reference) and after ``POSIX_FADV_DONTNEED`` on all of them (``cold``: a restore after a reboot);
   * ``fingerprint``: :func:`coldsnap_core.identity.fingerprint.checkpoint_fingerprint` of every file, with
     the files page-cached (``warm``) and after ``POSIX_FADV_DONTNEED`` (``cold``: read from disk);

and prints medians and the fingerprint's share of the restore (goal < 2 %). Nothing is asserted.
Usage (a multi-GB run needs about 3x ``--synthetic-gib`` of memory; run it under the bigmem lock)::

    .venv/bin/python benchmarks/fingerprint.py [--repetitions 5] [--synthetic-gib 4] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
from _common import MiB, checkpoint, drop_file_from_page_cache, machine_line, median_seconds, print_table, warm_page_cache
from slabs import checkpoint_files, stage_checkpoint

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.format.manifest import WorkerIdentity
from coldsnap_core.identity.fingerprint import checkpoint_fingerprint
from coldsnap_core.identity.model_identity import LoadedModel, check_model_identity, identify_checkpoint
from coldsnap_core.restore.hydrate import hydrate

TENSOR_ROWS, TENSOR_COLUMNS = 8192, 4096  # bf16: 64 MiB per tensor


def write_synthetic_checkpoint(folder: Path, size_gib: float) -> Path:
    """A ``model.safetensors`` of about ``size_gib`` GiB: ``layers.<i>.weight`` bf16 tensors of
    ``[8192, 4096]``, streamed to disk (never all in memory). Every tensor is one random 64 MiB block
    whose first 8 bytes hold its index, so no two tensors share bytes."""
    tensor_bytes = TENSOR_ROWS * TENSOR_COLUMNS * 2
    count = max(1, round(size_gib * 2**30 / tensor_bytes))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for i in range(count):
        header[f"layers.{i}.weight"] = {
            "dtype": "BF16",
            "shape": [TENSOR_ROWS, TENSOR_COLUMNS],
            "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header with spaces to 8 bytes
    block = np.random.default_rng(0).integers(0, 256, tensor_bytes, dtype=np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for i in range(count):
            block[:8] = np.frombuffer(struct.pack("<Q", i), dtype=np.uint8)
            f.write(block.data)
    (folder / "config.json").write_text("{}")
    return path


def bench(name: str, folder: Path, repetitions: int, tmp: str | None) -> list[object]:
    files = checkpoint_files(folder)
    slabs = stage_checkpoint(folder)
    root = Path(tempfile.mkdtemp(prefix="coldsnap-bench-fingerprint.", dir=tmp))
    try:
        cache = PayloadCache(root / "state")
        backend = HostCopyBackend()
        identity = identify_checkpoint(files, source=str(folder), root=folder)  # no records: as on another node
        result = capture_worker(
            allocation_map=slabs.allocation_map,
            allocations=slabs.allocations,
            model_ranges=slabs.model_ranges,
            worker=WorkerIdentity("worker", 0, 1, 0, 1),
            capture_point="portable",
            model=identity,
            cache=cache,
            artifact_dir=root / "artifact",
            backend=backend,
        )
        del slabs
        manifest = result.manifest
        blob = result.capsule_dir / manifest.residual.file
        for path in (result.pack_path, blob):
            warm_page_cache(path)
        destinations = tuple(np.empty(a.size_bytes, dtype=np.uint8) for a in manifest.allocations.allocations)
        for d in destinations:
            d.fill(0xA5)
        live = [LiveAllocation(i, int(d.ctypes.data), d.nbytes) for i, d in enumerate(destinations)]
        loaded = LoadedModel.from_config(str(folder), None)

        def restore() -> None:
            check_model_identity(identity, loaded)  # no records: every file's fingerprint is computed
            hydrate(
                manifest,
                blob_path=blob,
                cache=cache,
                allocations=live,
                backend=backend,
                live_layout=manifest.allocations,
            )

        def fingerprints() -> None:
            for f in files:
                checkpoint_fingerprint(f)

        def drop() -> None:
            for f in files:
                drop_file_from_page_cache(f)

        def drop_all() -> None:
            drop()
            drop_file_from_page_cache(result.pack_path)
            drop_file_from_page_cache(blob)

        def warm_all() -> None:
            for f in (*files, result.pack_path, blob):
                warm_page_cache(f)

        restore()
        times: dict[str, list[float]] = {"restore": [], "restore_cold": [], "warm": [], "cold": []}
        for _ in range(repetitions):
            times["restore"].append(median_seconds(restore, 1, setup=warm_all))
            times["warm"].append(median_seconds(fingerprints, 1))
            times["cold"].append(median_seconds(fingerprints, 1, setup=drop))
            times["restore_cold"].append(median_seconds(restore, 1, setup=drop_all))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        size = sum(f.stat().st_size for f in files)
        return [
            name,
            f"{size / MiB:.0f}",
            len(files),
            f"{1e3 * med['restore']:.1f}",
            f"{1e3 * med['restore_cold']:.1f}",
            f"{1e3 * med['warm']:.2f}",
            f"{1e3 * med['cold']:.2f}",
            f"{100 * med['warm'] / med['restore']:.2f} %",
            f"{100 * med['cold'] / med['restore_cold']:.2f} %",
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--synthetic-gib", type=float, default=4.0, help="size of the synthetic checkpoint (0: skip it)")
    parser.add_argument("--tmp", default=None, help="folder for the state root and the synthetic checkpoint")
    args = parser.parse_args()
    print(f"coldsnap fingerprint benchmark: {machine_line()}")
    print(f"median of {args.repetitions} alternating runs; restore = identity check (no record) + hydrate, warm\n")
    rows = [bench("smollm2-full", checkpoint("smollm2-full"), args.repetitions, args.tmp)]
    if args.synthetic_gib > 0:
        folder = Path(tempfile.mkdtemp(prefix="coldsnap-bench-synthetic.", dir=args.tmp))
        try:
            write_synthetic_checkpoint(folder, args.synthetic_gib)
            rows.append(bench(f"synthetic-{args.synthetic_gib:g}GiB", folder, args.repetitions, args.tmp))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    print_table(
        [
            "checkpoint",
            "MiB",
            "files",
            "restore warm ms",
            "cold ms",
            "fingerprint warm ms",
            "cold ms",
            "warm/warm",
            "cold/cold",
        ],
        rows,
    )
    print("\neach restore includes its fingerprints; goal: fingerprint < 2 % of the restore (warm/warm, cold/cold)")


if __name__ == "__main__":
    main()
