"""Hydration and capture never hold the model twice: allocate once, copy into views.

Measured in a fresh subprocess on the real 2-layer checkpoint (67.5 MiB of weights): the peak resident
set (``VmHWM``, reset through ``/proc/self/clear_refs`` right before the operation) may grow by far
less than the pack. Reading the whole pack into memory, mapping it, or staging it in a buffer would
add >= 67 MiB. No time is measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from core_support import REPO

PACK_MIB = 67.5
BOUND_MIB = 24.0
"""Growth allowed: the host backend's reads land in the destinations, the verifier's two 8 MiB
buffers, thread stacks and Python objects; an order of magnitude below a second copy of the model."""

MEASURE = """
import gc, json, sys, tempfile
from pathlib import Path
import numpy as np
import torch  # loaded in every engine process: its import is not capture's memory (the CLI imports it lazily)
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.format.allocation import LiveAllocation
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.manifest import CheckpointFile, ModelIdentity, WorkerIdentity
from coldsnap_core.restore.hydrate import hydrate
sys.path.insert(0, "tools")  # cwd is the repository; the test-only slabs live in tools/
from slabs import stage_checkpoint

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

def measure(run):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    run()
    return (status("VmHWM") - before) / 2**20

slabs = stage_checkpoint(Path(sys.argv[1]))
root = Path(sys.argv[2])
backend = HostCopyBackend()
cache = PayloadCache(root / "state")
out = {}
def capture():
    out["result"] = capture_worker(
        allocation_map=slabs.allocation_map, allocations=slabs.allocations, model_ranges=slabs.model_ranges,
        worker=WorkerIdentity("worker", 0, 1, 0, 1), capture_point="portable",
        model=ModelIdentity("m", None, (CheckpointFile("model.safetensors", 1, "0" * 64),)),
        cache=cache, artifact_dir=root / "artifact", backend=backend)
growth = {"capture": measure(capture)}
manifest = out["result"].manifest
blob = out["result"].capsule_dir / "weights.blob"
destinations = [np.empty(a.size_bytes, dtype=np.uint8) for a in slabs.allocation_map.allocations]
for d in destinations:
    d.fill(0)  # resident before the measurement: only hydration's own memory is counted
live = [LiveAllocation(i, int(d.ctypes.data), d.nbytes) for i, d in enumerate(destinations)]
for verify in (False, True):
    run = lambda: hydrate(manifest, blob_path=blob, cache=cache, allocations=live, backend=backend,
                          live_layout=slabs.allocation_map, verify_extents=verify)
    growth[f"hydrate verify_extents={verify}"] = measure(run)
cache.record_path(manifest.pack.sha256).unlink()  # next admission hashes the whole pack
growth["hydrate with full pack verification"] = measure(
    lambda: hydrate(manifest, blob_path=blob, cache=cache, allocations=live, backend=backend))
assert all(np.array_equal(a, b) for a, b in zip(destinations, slabs.arrays))
print(json.dumps(growth))
"""


def test_peak_memory_of_capture_and_hydration_is_bounded(smollm2_2layer: Path, tmp_path: Path) -> None:
    """Catches a whole-pack read (``read_bytes``, ``mmap``, a staging buffer the size of the model or
    of an extent) in hydration, pack admission or capture: the peak RSS growth of each stays below
    24 MiB while the pack is 67.5 MiB (and the hydrated bytes are still checked to be exact)."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(smollm2_2layer), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    growth = json.loads(done.stdout)
    assert len(growth) == 4
    for what, mib in growth.items():
        assert mib < BOUND_MIB < PACK_MIB, (what, growth)
