"""Golden digests of the fixed SmolLM2 2-layer slab capture.

The pack digest depends only on the set of tensor bytes, so it is also derived here from the
checkpoint alone with the ``safetensors`` library and the documented layout rules: an independent
implementation that must agree with the canonical writer.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from core_support import REPO, Captured
from safetensors import deserialize

GOLDEN_PACK_SHA256 = "b5a02a03cd57b72df32f33a3822006fb012818690d609dfca6a8e0265a05d407"
GOLDEN_PACK_SIZE_BYTES = 70_799_360
GOLDEN_LAYOUT_FINGERPRINT = "43fcdc0da716a73b59380b7b369413957ee83effc236345d4cb40578dc84c39c"
GOLDEN_RESIDUAL_SHA256 = "7e016693e917d7aade31b69555dc0a706240fd86a60ff9e44658829843e0f353"
"""Of ``stage_checkpoint(<smollm2 2-layer>)`` with its defaults (4 slabs, 512-byte gaps, file order)."""

CAPTURE_IN_A_FRESH_PROCESS = """
import json, sys, tempfile
from pathlib import Path
from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.capture.worker import capture_worker
from coldsnap_core.copy.host import HostCopyBackend
from coldsnap_core.format.manifest import CheckpointFile, ModelIdentity, WorkerIdentity
sys.path.insert(0, "tools")  # cwd is the repository; the test-only slabs live in tools/
from slabs import stage_checkpoint

slabs = stage_checkpoint(Path(sys.argv[1]))
root = Path(sys.argv[2])
result = capture_worker(
    allocation_map=slabs.allocation_map, allocations=slabs.allocations, model_ranges=slabs.model_ranges,
    worker=WorkerIdentity("worker", 0, 1, 0, 1), capture_point="portable",
    model=ModelIdentity("golden", None, (CheckpointFile("model.safetensors", 1, "0" * 64),)),
    cache=PayloadCache(root / "state"), artifact_dir=root / "artifact", backend=HostCopyBackend(),
)
m = result.manifest
print(json.dumps([m.pack.sha256, m.pack.size_bytes, m.layout_fingerprint, m.residual.sha256]))
"""


@pytest.mark.slow  # about 13 s: two fresh interpreters capture the same bytes
def test_golden_digests_are_the_same_in_two_separate_processes(smollm2_2layer: Path, tmp_path: Path) -> None:
    """Catches nondeterminism (hash randomization, dict or thread-completion order, addresses) leaking into the
    pack, the layout fingerprint or the residual blob, and any change to the canonical layout: two
    fresh interpreters capture the same staging and print the pinned values."""
    outputs = []
    for n in range(2):
        done = subprocess.run(
            [sys.executable, "-c", CAPTURE_IN_A_FRESH_PROCESS, str(smollm2_2layer), str(tmp_path / f"run{n}")],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            check=False,
            env={"PYTHONHASHSEED": str(n), "PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout))
    assert outputs[0] == outputs[1]
    assert outputs[0] == [GOLDEN_PACK_SHA256, GOLDEN_PACK_SIZE_BYTES, GOLDEN_LAYOUT_FINGERPRINT, GOLDEN_RESIDUAL_SHA256]
    assert (tmp_path / "run0/state/model-payloads/sha256" / f"{GOLDEN_PACK_SHA256}.pack").read_bytes() == (
        tmp_path / "run1/state/model-payloads/sha256" / f"{GOLDEN_PACK_SHA256}.pack"
    ).read_bytes()


def test_golden_pack_matches_an_independent_construction_from_the_checkpoint(smollm2_2layer: Path) -> None:
    """Catches the canonical writer drifting from docs/format.md: the pinned digest equals the SHA-256
    of the tensors' bytes (read by the safetensors library, not by coldsnap) laid out by the
    documented rules: distinct contents sorted by (SHA-256 hex, size), 4096-byte aligned, zero padded,
    the end rounded up to 4096."""
    tensors = deserialize((smollm2_2layer / "model.safetensors").read_bytes())
    contents = {(hashlib.sha256(t["data"]).hexdigest(), len(t["data"])): bytes(t["data"]) for _, t in tensors if t["data"]}
    pack = hashlib.sha256()
    size = 0
    for key in sorted(contents):
        data = contents[key]
        pack.update(data)
        pack.update(bytes(-len(data) % 4096))
        size += len(data) + (-len(data) % 4096)
    assert (pack.hexdigest(), size) == (GOLDEN_PACK_SHA256, GOLDEN_PACK_SIZE_BYTES)


def test_session_capture_has_the_golden_digests(captured_2layer: Captured) -> None:
    """Catches the in-process capture used by the other tests differing from the pinned one."""
    manifest = captured_2layer.manifest
    assert (manifest.pack.sha256, manifest.pack.size_bytes) == (GOLDEN_PACK_SHA256, GOLDEN_PACK_SIZE_BYTES)
    assert manifest.layout_fingerprint == GOLDEN_LAYOUT_FINGERPRINT
    assert manifest.residual.sha256 == GOLDEN_RESIDUAL_SHA256
