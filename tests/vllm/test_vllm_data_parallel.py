"""``vllm serve MODEL --data-parallel-size 2 --load-format coldsnap``: two replicas, two capsules, one pack.

vLLM runs each data parallel replica of a dense model as its own engine process with its own worker
(``vllm/v1/engine/core.py`` ``run_engine_core``), so the two replicas capture and restore
concurrently on one artifact and one state root. ``LLM(data_parallel_size=2)`` is refused for
single-process use ("not supported for single-process usage and may hang"), so this goes through
``vllm serve``. One server with export on, ``coldsnap publish-native`` to a folder store, a second
server that restores both replicas, compared with a plain load's greedy completion (the session's,
``vllm_two_layer`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support import PROMPTS, coldsnap_env, serve_completion

from coldsnap_core.artifact.capsules import read_descriptor
from coldsnap_core.stores.publish import artifact_listing
from tests.support.servers import scraped

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

PROMPT = PROMPTS[0]  # "The capital of France is"
REPLICAS = ["worker-0-of-1-dp-0-of-2", "worker-0-of-1-dp-1-of-2"]


def _serve_dp2(model: Path, workdir: Path, name: str, env: dict[str, str]) -> tuple[str, str]:
    """``vllm serve --data-parallel-size 2`` with ``env``: the greedy completion of :data:`PROMPT` and the server's
    ``/metrics``; the log is ``<name>.log``."""
    text, _, metrics = serve_completion(model, workdir, name, env, prompt=PROMPT, extra_args=("--data-parallel-size", "2"))
    return text, metrics


def _outcomes(state: Path) -> list[dict]:
    return [json.loads(line) for line in (state / "load-outcomes.jsonl").read_text().splitlines()]


def _publish(artifact: Path, state: Path, store: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coldsnap_core.cli.main", "publish-native", str(artifact), "--repo", str(store)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "COLDSNAP_STATE_ROOT": str(state)},
        check=False,
    )


def test_data_parallel_serve_captures_two_capsules_one_pack_and_restores_both(
    vllm_two_layer: dict, smollm2_2layer: Path, tmp_path: Path
) -> None:
    """Export with ``--data-parallel-size 2``: two capsules (one per replica, each naming its data parallel
    rank), one pack digest, one cached object; ``publish-native`` uploads that pack once beside the artifact's own files (a second
    publication uploads nothing); a second ``--data-parallel-size 2`` server restores both replicas, each
    from its own capsule (two ``restored`` outcome lines, one per replica), and answers what a plain load
    answers; its own ``/metrics`` counts both restores. Fails if the replicas share a capsule name (they would
    race on one capsule folder and leave one capsule), if a replica restores another replica's capsule or none,
    if the pack is stored twice, or if a replica's load does not reach vLLM's multiprocess registry."""
    artifact, state, store = tmp_path / "artifact", tmp_path / "state", tmp_path / "store"
    env = coldsnap_env(artifact, state)

    _serve_dp2(smollm2_2layer, tmp_path, "export", {**env, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"})
    descriptor = read_descriptor(artifact)
    assert [w.worker.capsule_name for w in descriptor.workers] == REPLICAS
    assert sorted(p.name for p in (artifact / "workers").iterdir() if not p.name.startswith(".")) == REPLICAS
    (pack,) = descriptor.distinct_payloads()
    assert [p.name for p in (state / "model-payloads" / "sha256").glob("*.pack")] == [f"{pack.sha256}.pack"]
    captured = sorted((o["worker"], o["outcome"], o["pack_sha256"]) for o in _outcomes(state))
    assert captured == [(name, "captured", pack.sha256) for name in REPLICAS]

    first = _publish(artifact, state, store)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("uploaded ") == 1 and pack.sha256 in first.stdout, first.stdout
    # The store holds the one pack object, the artifact's own files (both replicas' capsules, docs/format.md
    # §12.9) and its name: one pack for two replicas.
    listing = artifact_listing(artifact)
    stored = sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file())
    files = [f"artifacts/sha256/{listing.artifact.sha256}/{f.path}" for f in listing.files]
    assert stored == sorted([f"model-payloads/sha256/{pack.sha256}.pack", *files, f"refs/{listing.name}.json"])
    assert {f.path.split("/")[1] for f in listing.files if f.path.startswith("workers/")} == set(REPLICAS)
    again = _publish(artifact, state, store)
    assert again.returncode == 0 and "uploaded " not in again.stdout, again.stdout

    restore_state = tmp_path / "restore-state"  # another node: its cache is empty, the store has the pack
    restored_text, metrics = _serve_dp2(
        smollm2_2layer,
        tmp_path,
        "restore",
        {**coldsnap_env(artifact, restore_state), "COLDSNAP_RESTORE": "native", "COLDSNAP_PAYLOAD_REPO": str(store)},
    )
    restored = sorted((o["worker"], o["outcome"], o["pack_sha256"]) for o in _outcomes(restore_state))
    assert restored == [(name, "restored", pack.sha256) for name in REPLICAS]
    assert [p.name for p in (restore_state / "model-payloads" / "sha256").glob("*.pack")] == [f"{pack.sha256}.pack"]
    log = (tmp_path / "restore.log").read_text()
    assert all(f"coldsnap: restored {name} from pack" in log for name in REPLICAS)
    assert "could not restore" not in log

    plain = vllm_two_layer["plain"]  # the session's plain load: PROMPT is its first prompt, 8 greedy tokens
    assert plain.outputs and restored_text == plain.outputs[0]
    # More than one API server: vLLM itself collects its processes' samples from PROMETHEUS_MULTIPROC_DIR, so its
    # /metrics counts both replicas' restores with no setting of ours (the test's environment has no such variable).
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    assert scraped(metrics, "coldsnap_load_total", engine="vllm", outcome="restored", rule="") == 2
    assert scraped(metrics, "coldsnap_load_seconds_count", engine="vllm", outcome="restored") == 2
