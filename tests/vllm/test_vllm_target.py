"""Target qualification and target-local overlays through the real vLLM loader class, in-process.

The loader is vLLM's real ``DefaultModelLoader`` subclass on the real SmolLM2 2-layer checkpoint (the
``Consumer`` model of ``test_vllm_loader_unit.py``: three checkpoint parameters and a float32 buffer,
which lands in the residual). A capsule's ``target.json`` is edited and re-pinned in ``artifact.json``
the way an artifact captured on another runtime would look (docs/format.md §15).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from test_vllm_loader_unit import Consumer, make_loader
from vllm.config import ModelConfig

from coldsnap_core.artifact.overlay import OVERLAY_FILENAME, OVERLAYS_DIRNAME, list_overlays
from coldsnap_core.cli.main import main as coldsnap_main
from coldsnap_core.errors import TargetMismatchError
from coldsnap_core.format.target import INFORMATIONAL_FIELDS, QUALIFYING_FIELDS
from coldsnap_vllm.loader import last_outcome
from tests.support.files import permissions_enforced

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]

CAPSULE = "workers/worker-0-of-1"


@pytest.fixture(scope="module")
def model_config(smollm2_2layer: Path) -> ModelConfig:
    return ModelConfig(model=str(smollm2_2layer), dtype="bfloat16")


@pytest.fixture(autouse=True)
def current_vllm_config(model_config):
    """``DefaultModelLoader.load_weights`` reads the current vLLM config (expert-parallel filter)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(model_config=model_config)):
        yield


@pytest.fixture(scope="module")
def exported(model_config, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, bytes]]:
    """One export of the Consumer: (artifact folder, state root, the plain load's bytes). Read only."""
    from vllm.config import VllmConfig, set_current_vllm_config

    root = tmp_path_factory.mktemp("target-export")
    loaded = Consumer()
    env = {"COLDSNAP_ARTIFACT_DIR": str(root / "artifact"), "COLDSNAP_STATE_ROOT": str(root / "state")}
    with pytest.MonkeyPatch.context() as mp, set_current_vllm_config(VllmConfig(model_config=model_config)):
        for k, v in {**env, "COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"}.items():
            mp.setenv(k, v)
        make_loader().load_weights(loaded, model_config)
    assert last_outcome().kind == "captured"
    return root / "artifact", root / "state", loaded.snapshot()


def _copy_artifact(exported, tmp_path: Path) -> Path:
    artifact = tmp_path / "artifact"
    shutil.copytree(exported[0], artifact)
    return artifact


def _repin(artifact: Path) -> None:
    """Re-pin every capsule file in artifact.json (an edit a re-signing operator would make)."""
    doc = json.loads((artifact / "artifact.json").read_text())
    for entry in doc["workers"]:
        capsule = artifact / entry["capsule"]
        native = json.loads((capsule / "native-manifest.json").read_text())
        for pin in entry["capsule_files"]:
            data = (capsule / pin["name"]).read_bytes()
            pin.update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
            if pin["name"] == native["residual"]["file"]:
                assert (pin["size_bytes"], pin["sha256"]) == (native["residual"]["size_bytes"], native["residual"]["sha256"])
    (artifact / "artifact.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _edit_target(artifact: Path, **fields) -> dict:
    path = artifact / CAPSULE / "target.json"
    doc = json.loads(path.read_text())
    old = dict(doc)
    doc.update(fields)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    _repin(artifact)
    return old


def _perturb_residual(artifact: Path) -> None:
    """Flip one residual byte and record the new blob digest in both manifests (consistently re-pinned):
    a portable capsule whose residual differs from what this target computes."""
    capsule = artifact / CAPSULE
    blob = bytearray((capsule / "weights.blob").read_bytes())
    blob[0] ^= 0x40
    (capsule / "weights.blob").write_bytes(bytes(blob))
    digest = hashlib.sha256(blob).hexdigest()
    for name in ("native-manifest.json", "recovery-manifest.json"):
        doc = json.loads((capsule / name).read_text())
        doc["residual"]["sha256"] = digest
        (capsule / name).write_text(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    _repin(artifact)


def _other_value(field: str, value):
    if field == "accelerator_count":
        return value + 2
    return ("NVIDIA H200" if field == "accelerator_model" else "9.9.9") if value is None else f"{value}-other"


def _env(monkeypatch, artifact: Path, state: Path, restore: str = "native", overlay: str = "auto") -> None:
    monkeypatch.setenv("COLDSNAP_ARTIFACT_DIR", str(artifact))
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", str(state))
    monkeypatch.setenv("COLDSNAP_RESTORE", restore)
    monkeypatch.setenv("COLDSNAP_OVERLAY", overlay)
    monkeypatch.delenv("COLDSNAP_EXPORT_MODEL_PAYLOAD", raising=False)


def _coldsnap_warnings(caplog) -> list[str]:
    # One record may reach pytest's capture twice (through vLLM's logger and directly), so count records.
    records = {id(r): r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("coldsnap")}
    return [r.getMessage() for r in records.values()]


def _pack_objects(state: Path) -> list[str]:
    return sorted(p.name for p in (state / "model-payloads" / "sha256").glob("*.pack"))


@pytest.mark.parametrize("field", QUALIFYING_FIELDS)
def test_each_qualifying_field_stops_replay(field: str, exported, model_config, tmp_path: Path, monkeypatch, caplog) -> None:
    """Catches a qualifying field left out of the comparison: a capsule that differs from this target only
    in ``field`` is refused by ``native`` naming the field with its captured and current values, and
    ``auto`` loads the checkpoint with one WARNING naming it (nothing hydrated)."""
    artifact = _copy_artifact(exported, tmp_path)
    recorded = json.loads((artifact / CAPSULE / "target.json").read_text())
    value = _other_value(field, recorded[field])
    _edit_target(artifact, **{field: value})
    _env(monkeypatch, artifact, exported[1], overlay="off")
    with pytest.raises(TargetMismatchError) as raised:
        make_loader().load_weights(Consumer(), model_config)
    assert (raised.value.rule, raised.value.exit_code) == ("target-qualification", 5)
    assert field in [d[0] for d in raised.value.differences]
    if field not in ("engine",):
        assert f"{field}: {value!r} -> {recorded[field]!r}" in str(raised.value)

    monkeypatch.setenv("COLDSNAP_RESTORE", "auto")
    consumer = Consumer()
    with caplog.at_level(logging.INFO):
        make_loader().load_weights(consumer, model_config)
    (warning,) = _coldsnap_warnings(caplog)
    assert "loading the checkpoint instead" in warning and field in warning
    assert last_outcome().kind == "checkpoint" and last_outcome().fallback.rule == "target-qualification"
    assert consumer.snapshot() == exported[2]


@pytest.mark.parametrize("field", INFORMATIONAL_FIELDS)
def test_an_informational_field_is_replayed(field: str, exported, model_config, tmp_path: Path, monkeypatch) -> None:
    """Catches an informational field (coldsnap version, accelerator count, host) that blocks replay: a
    capsule differing only in it is restored from the portable capsule, bytes equal to a plain load."""
    artifact = _copy_artifact(exported, tmp_path)
    recorded = json.loads((artifact / CAPSULE / "target.json").read_text())
    _edit_target(artifact, **{field: _other_value(field, recorded[field])})
    _env(monkeypatch, artifact, exported[1])
    fresh = Consumer()
    make_loader().load_weights(fresh, model_config)
    assert (last_outcome().kind, last_outcome().capsule_source) == ("restored", "portable")
    assert fresh.snapshot() == exported[2]


def test_another_engine_is_named_before_the_layout(exported, tmp_path: Path, monkeypatch, caplog, smollm2_2layer) -> None:
    """Catches the engine check coming after the layout check (a layout count instead of the engine), or
    an overlay captured for another engine's capsule: a capsule whose target.json says SGLang, restored
    by vLLM into a model of another layout (float16), is refused naming both engines; ``auto`` falls
    back and captures no overlay."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    artifact = _copy_artifact(exported, tmp_path)
    _edit_target(artifact, engine="sglang", engine_version="0.5.23")
    _env(monkeypatch, artifact, tmp_path / "state")
    config = ModelConfig(model=str(smollm2_2layer), dtype="float16")
    with set_current_vllm_config(VllmConfig(model_config=config)):
        with pytest.raises(TargetMismatchError, match=r"captured by sglang 0\.5\.23; this engine is vllm 0\.3\d"):
            make_loader().load_weights(Consumer(dtype=torch.float16), config)
        monkeypatch.setenv("COLDSNAP_RESTORE", "auto")
        make_loader().load_weights(Consumer(dtype=torch.float16), config)
    assert last_outcome().fallback.rule == "target-qualification" and last_outcome().overlay is None
    assert not (tmp_path / "state" / OVERLAYS_DIRNAME).exists()


def test_identical_capture_is_discarded_and_the_target_recorded_qualified(
    exported,
    model_config,
    tmp_path: Path,
    monkeypatch,
    caplog,
) -> None:
    """Catches an overlay that copies the pack or stores a capture identical to the portable one, and a
    qualification record that is not used: a capsule whose recorded engine version differs falls back
    once, the capture on this target is byte-identical (same residual and manifests), so only a
    ``qualified`` overlay.json is kept; the next restore on this node replays the portable capsule; a
    second state root (another node) without it falls back again; one pack object throughout."""
    artifact = _copy_artifact(exported, tmp_path)
    _edit_target(artifact, engine_version="0.31.0")
    state = tmp_path / "state"
    shutil.copytree(exported[1], state)
    _env(monkeypatch, artifact, state, restore="auto")
    make_loader().load_weights(Consumer(), model_config)
    outcome = last_outcome()
    assert outcome.kind == "checkpoint" and outcome.fallback.rule == "target-qualification"
    assert outcome.overlay is not None and outcome.overlay.kind == "qualified"
    assert sorted(p.name for p in outcome.overlay.path.iterdir()) == [OVERLAY_FILENAME]
    assert os.stat(outcome.overlay.path / OVERLAY_FILENAME).st_mode & 0o777 == 0o444

    monkeypatch.setenv("COLDSNAP_RESTORE", "native")
    fresh = Consumer()
    make_loader().load_weights(fresh, model_config)
    assert (last_outcome().kind, last_outcome().capsule_source) == ("restored", "qualified")
    assert fresh.snapshot() == exported[2]
    assert len(_pack_objects(state)) == 1

    other_node = tmp_path / "node2"
    shutil.copytree(exported[1], other_node)
    _env(monkeypatch, artifact, other_node)
    with pytest.raises(TargetMismatchError, match=r"engine_version: '0\.31\.0' -> .*no overlay for this target"):
        make_loader().load_weights(Consumer(), model_config)
    assert len(_pack_objects(other_node)) == 1


@pytest.fixture
def overlaid(exported, model_config, tmp_path: Path, monkeypatch):
    """A portable capsule from another engine version whose residual differs from this target's, after
    one ``auto`` load on this node: (artifact, state root, overlay folder)."""
    artifact = _copy_artifact(exported, tmp_path)
    _perturb_residual(artifact)
    _edit_target(artifact, engine_version="0.31.0")
    state = tmp_path / "state"
    shutil.copytree(exported[1], state)
    _env(monkeypatch, artifact, state, restore="auto")
    make_loader().load_weights(Consumer(), model_config)
    overlay = last_outcome().overlay
    assert last_outcome().fallback.rule == "target-qualification" and overlay.kind == "overlay"
    return artifact, state, overlay.path


def test_overlay_is_used_on_this_target(overlaid, exported, model_config, monkeypatch, tmp_path: Path) -> None:
    """Catches a restore that replays the portable residual (here: one flipped byte of the buffer) or
    that ignores the overlay: the next restore on this node hydrates from the overlay, bytes equal to a
    plain load, with the shared pack (no second pack object, none in the overlay folder)."""
    artifact, state, path = overlaid
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [OVERLAY_FILENAME, "native-manifest.json", "recovery-manifest.json", "target.json", "weights.blob"]
    )
    monkeypatch.setenv("COLDSNAP_RESTORE", "native")
    fresh = Consumer()
    make_loader().load_weights(fresh, model_config)
    assert (last_outcome().kind, last_outcome().capsule_source) == ("restored", "overlay")
    assert fresh.snapshot() == exported[2]
    assert len(_pack_objects(state)) == 1
    descriptor = json.loads((path / OVERLAY_FILENAME).read_text())
    assert descriptor["portable_descriptor_sha256"] == hashlib.sha256((artifact / "artifact.json").read_bytes()).hexdigest()
    assert descriptor["target"]["engine_version"] != "0.31.0"


def _loosen(path: Path) -> None:
    os.chmod(path / OVERLAY_FILENAME, 0o666)


def _bad_json(path: Path) -> None:
    os.chmod(path / OVERLAY_FILENAME, 0o644)
    (path / OVERLAY_FILENAME).write_text("{")
    os.chmod(path / OVERLAY_FILENAME, 0o444)


def _symlink(path: Path) -> None:
    os.rename(path / OVERLAY_FILENAME, path.parent / "elsewhere.json")
    os.symlink(path.parent / "elsewhere.json", path / OVERLAY_FILENAME)


def _bad_pin(path: Path) -> None:
    manifest = path / "recovery-manifest.json"
    manifest.write_text(manifest.read_text().replace('"worker"', ' "worker"', 1))


@pytest.mark.parametrize(
    ("spoil", "why", "warns"),
    [
        (_loosen, "group- or world-writable", True),
        (_bad_json, "malformed", True),
        (_symlink, "symbolic link", True),
        (_bad_pin, "capsule-pin", True),
        (lambda path: shutil.rmtree(path), "no overlay for this target", False),
    ],
    ids=["loose-mode", "bad-json", "symlink", "bad-pin", "missing"],
)
def test_invalid_or_missing_overlay_falls_back(overlaid, model_config, monkeypatch, caplog, spoil, why: str, warns: bool) -> None:
    """Catches an invalid overlay being used, or dropped silently: each spoiled overlay (loose mode, bad
    JSON, a symbolic link, a capsule file off its pin) is ignored with a WARNING that says why, and the
    restore falls back to the portable artifact (not qualified here: ``native`` refuses naming the
    reason); a missing one says so without a WARNING."""
    _, _, path = overlaid
    spoil(path)
    caplog.clear()
    monkeypatch.setenv("COLDSNAP_RESTORE", "native")
    with caplog.at_level(logging.INFO), pytest.raises(TargetMismatchError, match=re.escape(why)):
        make_loader().load_weights(Consumer(), model_config)
    warnings = _coldsnap_warnings(caplog)
    assert len(warnings) == int(warns) and all(why in w and "using the portable artifact" in w for w in warnings)


def test_stale_overlay_falls_back(overlaid, model_config, monkeypatch, caplog) -> None:
    """Catches an overlay outliving its binding: after the portable artifact.json changes the overlay is
    stale (INFO, no WARNING) and the restore falls back naming why; on another target (here another
    coldsnap version, part of the exact target) the overlay is not selected and the message names how
    its target differs."""
    import coldsnap_core.identity.target as target

    artifact, _, path = overlaid
    monkeypatch.setenv("COLDSNAP_RESTORE", "native")
    monkeypatch.setattr(target, "coldsnap_version", lambda: "99.0")
    with pytest.raises(
        TargetMismatchError, match=r"overlays of this worker are for other targets: coldsnap_version: '.*' -> '99.0'"
    ):
        make_loader().load_weights(Consumer(), model_config)
    monkeypatch.undo()
    _env(monkeypatch, artifact, path.parents[3], restore="native")

    doc = json.loads((artifact / "artifact.json").read_text())
    (artifact / "artifact.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")  # same content, other bytes
    caplog.clear()
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(TargetMismatchError, match=re.escape("artifact.json changed since it was captured")),
    ):
        make_loader().load_weights(Consumer(), model_config)
    assert _coldsnap_warnings(caplog) == []


def _gc_with_an_unreadable_descriptor_keeps_the_overlay(artifact: Path, state: Path, overlay: Path) -> None:
    """``coldsnap cache gc`` while the portable artifact.json exists but cannot be read (EACCES, as during
    an NFS outage): the overlay is kept, named as unreadable, and gc exits 4. As root the command runs with
    the file-permission capabilities dropped (``setpriv``), so mode 000 is refused as it is for a user."""
    descriptor = artifact / "artifact.json"
    mode = descriptor.stat().st_mode & 0o7777
    command = permissions_enforced([sys.executable, "-m", "coldsnap_core.cli.main", "cache", "gc", "--state-root", str(state)])
    os.chmod(descriptor, 0)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        os.chmod(descriptor, mode)
    assert done.returncode == 4, done.stdout + done.stderr
    assert f"kept overlay {overlay} (unreadable" in done.stderr
    assert overlay.is_dir() and [o.status for o in list_overlays(state)] == ["current"]


def test_cache_ls_gc_and_inspect_show_overlays(overlaid, capsys) -> None:
    """Catches gc removing a current overlay or keeping one whose portable descriptor is gone, and
    inspect not saying which capsule a restore on this node uses: ``cache ls`` lists the overlay,
    ``inspect`` names it, ``cache gc`` keeps it while artifact.json exists and removes it after."""
    artifact, state, path = overlaid
    assert coldsnap_main(["cache", "ls", "--state-root", str(state), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["overlays"]
    assert [(o["path"], o["status"], o["kind"]) for o in listed] == [(str(path), "current", "overlay")]
    assert coldsnap_main(["inspect", str(artifact), "--state-root", str(state)]) == 0
    out = capsys.readouterr().out
    assert f"restore on this node (vllm): overlay {path}" in out
    assert coldsnap_main(["inspect", str(artifact), "--state-root", str(state / "elsewhere")]) == 0
    assert "restore on this node (vllm): checkpoint load (auto) or refusal (native)" in capsys.readouterr().out

    assert coldsnap_main(["cache", "gc", "--state-root", str(state)]) == 0
    assert path.is_dir() and [o.status for o in list_overlays(state)] == ["current"]
    _gc_with_an_unreadable_descriptor_keeps_the_overlay(artifact, state, path)
    os.unlink(artifact / "artifact.json")
    assert coldsnap_main(["cache", "gc", "--state-root", str(state), "--dry-run"]) == 0
    assert path.is_dir()
    assert coldsnap_main(["cache", "gc", "--state-root", str(state)]) == 0
    assert f"removed overlay {path}" in capsys.readouterr().out
    assert not path.exists() and list_overlays(state) == []


def test_explicit_overlay_capture(exported, model_config, tmp_path: Path, monkeypatch) -> None:
    """Catches ``COLDSNAP_OVERLAY=capture`` restoring instead of capturing: on a qualified target it loads
    the checkpoint and records the target qualified (the capture is identical), and it refuses to run
    with export on."""
    from coldsnap_core.errors import ConfigurationError

    artifact = _copy_artifact(exported, tmp_path)
    state = tmp_path / "state"
    shutil.copytree(exported[1], state)
    _env(monkeypatch, artifact, state, overlay="capture")
    make_loader().load_weights(Consumer(), model_config)
    assert last_outcome().kind == "checkpoint" and last_outcome().overlay.kind == "qualified"
    monkeypatch.setenv("COLDSNAP_EXPORT_MODEL_PAYLOAD", "1")
    with pytest.raises(ConfigurationError, match="COLDSNAP_OVERLAY=capture"):
        make_loader()


def test_publish_native_never_uploads_overlays(overlaid, tmp_path: Path) -> None:
    """Catches an overlay (a target-local acceleration cache) reaching a payload store: publishing the
    artifact while this node holds an overlay uploads the one pack object and nothing else."""
    artifact, state, _ = overlaid
    store = tmp_path / "store"
    assert coldsnap_main(["publish-native", str(artifact), "--repo", str(store), "--state-root", str(state)]) == 0
    uploaded = sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())
    assert uploaded == [f"model-payloads/sha256/{_pack_objects(state)[0]}"]
