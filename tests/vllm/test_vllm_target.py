"""Target qualification and target-local overlays through the real vLLM loader class, in-process.

The loader is vLLM's real ``DefaultModelLoader`` subclass on the real SmolLM2 2-layer checkpoint (the
``Consumer`` model of ``test_vllm_loader_unit.py``: three checkpoint parameters and a float32 buffer,
which lands in the residual). A capsule's ``target.json`` is edited and re-pinned in ``artifact.json``
the way an artifact captured on another runtime would look (docs/format.md §15).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("vllm")

from test_vllm_loader_unit import Consumer, make_loader
from vllm.config import ModelConfig

from coldsnap_core.artifact.derived_cache import SEED_ARCHIVE_FILENAME, SEED_DOCUMENT_FILENAME, SeedQualification
from coldsnap_core.artifact.overlay import OVERLAY_FILENAME, OVERLAYS_DIRNAME
from coldsnap_core.cache.overlays import list_overlays
from coldsnap_core.capture.derived_cache import attach_seed
from coldsnap_core.capture.overlay import attach_overlay_seed
from coldsnap_core.cli.main import main as coldsnap_main
from coldsnap_core.errors import OverlayError, TargetMismatchError
from coldsnap_core.format.target import INFORMATIONAL_FIELDS, QUALIFYING_FIELDS
from tests.support.files import flip_byte, permissions_enforced

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
        outcome = make_loader().load_weights(loaded, model_config)
    assert outcome.kind == "captured"
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
    # One record may reach pytest's capture twice (through vLLM's logger and directly), so count records; a refusal
    # is an ERROR, not a WARNING.
    records = {id(r): r for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("coldsnap")}
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
        fell_back = make_loader().load_weights(consumer, model_config)
    (warning,) = _coldsnap_warnings(caplog)
    assert "loading the checkpoint instead" in warning and field in warning
    assert fell_back.kind == "checkpoint" and fell_back.fallback.rule == "target-qualification"
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
    restored = make_loader().load_weights(fresh, model_config)
    assert (restored.kind, restored.capsule_source) == ("restored", "portable")
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
        fell_back = make_loader().load_weights(Consumer(dtype=torch.float16), config)
    assert fell_back.fallback.rule == "target-qualification" and fell_back.overlay is None
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
    outcome = make_loader().load_weights(Consumer(), model_config)
    assert outcome.kind == "checkpoint" and outcome.fallback.rule == "target-qualification"
    assert outcome.overlay is not None and outcome.overlay.kind == "qualified"
    assert sorted(p.name for p in outcome.overlay.path.iterdir()) == [OVERLAY_FILENAME]
    assert os.stat(outcome.overlay.path / OVERLAY_FILENAME).st_mode & 0o777 == 0o444

    monkeypatch.setenv("COLDSNAP_RESTORE", "native")
    fresh = Consumer()
    restored = make_loader().load_weights(fresh, model_config)
    assert (restored.kind, restored.capsule_source) == ("restored", "qualified")
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
    fell_back = make_loader().load_weights(Consumer(), model_config)
    overlay = fell_back.overlay
    assert fell_back.fallback.rule == "target-qualification" and overlay.kind == "overlay"
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
    restored = make_loader().load_weights(fresh, model_config)
    assert (restored.kind, restored.capsule_source) == ("restored", "overlay")
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


OTHER_UID = 54321
"""A uid with no passwd entry: another user, for ``chown`` (the tests run as root)."""


def _owners(root: Path) -> set[int]:
    return {p.lstat().st_uid for p in [root, *root.rglob("*")]}


def _records(state: Path) -> dict[Path, tuple[int, bytes]]:
    return {p: (p.lstat().st_uid, p.read_bytes()) for p in state.rglob("*.pack.record")}


def test_another_users_cache_gc_and_verify_remove_and_re_own_nothing(overlaid, capsys) -> None:
    """Catches ``coldsnap cache gc`` run by another user (root's cron, ``sudo``) removing the engine user's current
    overlays (another uid's ``overlay.json`` is untrusted, so it was listed ``invalid`` and removed) and ``cache
    verify --full`` rewriting that user's validation records as its own (that user's next restore then hashes in
    full): over a state root another uid owns both refuse before touching anything (exit 4, naming the uid); in a
    state root of their own, another user's overlay is kept and named (``foreign``) and another user's object and
    record are left unverified and named, exit 4, bytes and owners unchanged."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give files to another uid")
    _, state, path = overlaid
    records = _records(state)
    assert records
    shutil.chown(state, OTHER_UID, OTHER_UID)
    for p in state.rglob("*"):
        os.chown(p, OTHER_UID, OTHER_UID, follow_symlinks=False)
    for command in (["cache", "gc"], ["cache", "verify", "--full"]):
        assert coldsnap_main([*command, "--state-root", str(state)]) == 4, command
        assert f"the state root belongs to uid {OTHER_UID}" in capsys.readouterr().err
    assert path.is_dir() and _owners(state) == {OTHER_UID} and _records(state).keys() == records.keys()

    # a state root of this user's own, holding another user's overlay, object and record
    for p in [state, *state.rglob("*")]:
        os.chown(p, 0, 0, follow_symlinks=False)
    for p in [path, *path.iterdir(), *records]:
        os.chown(p, OTHER_UID, OTHER_UID, follow_symlinks=False)
    object_path = next(iter(records)).with_name(next(iter(records)).name.removesuffix(".record"))
    os.chown(object_path, OTHER_UID, OTHER_UID)
    records = _records(state)
    assert coldsnap_main(["cache", "gc", "--state-root", str(state)]) == 4
    err = capsys.readouterr().err
    assert f"kept overlay {path} (foreign: it belongs to uid {OTHER_UID}" in err and "kept 1 overlay(s)" in err
    assert path.is_dir() and [o.status for o in list_overlays(state)] == ["foreign"]
    assert coldsnap_main(["cache", "verify", "--full", "--state-root", str(state)]) == 4
    assert f"it belongs to uid {OTHER_UID}, not 0: left unverified" in capsys.readouterr().err
    assert _records(state) == records and object_path.lstat().st_uid == OTHER_UID


def test_explicit_overlay_capture(exported, model_config, tmp_path: Path, monkeypatch) -> None:
    """Catches ``COLDSNAP_OVERLAY=capture`` restoring instead of capturing: on a qualified target it loads
    the checkpoint and records the target qualified (the capture is identical), and it refuses to run
    with export on."""
    from coldsnap_core.errors import ConfigurationError

    artifact = _copy_artifact(exported, tmp_path)
    state = tmp_path / "state"
    shutil.copytree(exported[1], state)
    _env(monkeypatch, artifact, state, overlay="capture")
    outcome = make_loader().load_weights(Consumer(), model_config)
    assert outcome.kind == "checkpoint" and outcome.overlay.kind == "qualified"
    monkeypatch.setenv("COLDSNAP_EXPORT_MODEL_PAYLOAD", "1")
    with pytest.raises(ConfigurationError, match="COLDSNAP_OVERLAY=capture"):
        make_loader()


def test_publish_native_never_uploads_overlays(overlaid, tmp_path: Path) -> None:
    """Catches an overlay (a target-local acceleration cache) reaching a payload store: publishing the
    artifact while this node holds an overlay uploads the one pack object, the artifact's own files (what
    ``artifact.json`` pins, docs/format.md §12.9) and its name, and nothing else."""
    from coldsnap_core.stores.publish import artifact_listing

    artifact, state, _ = overlaid
    store = tmp_path / "store"
    assert coldsnap_main(["publish-native", str(artifact), "--repo", str(store), "--state-root", str(state)]) == 0
    uploaded = sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())
    listing = artifact_listing(artifact)
    files = [f"artifacts/sha256/{listing.artifact.sha256}/{f.path}" for f in listing.files]
    assert uploaded == sorted([f"model-payloads/sha256/{_pack_objects(state)[0]}", *files, f"refs/{listing.name}.json"])


# -- an overlay's own derived-cache seed (docs/format.md §15.3, §17) -----------------------------------


def _seed_files(folder: Path, name: str) -> list[tuple[str, Path]]:
    """One compiled file, as a seed's ``(member path, file)`` list: its bytes say whose seed it is."""
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(f"kernel compiled for {name}\n".encode() * 40)
    return [(f"vllm-cache/torch_compile_cache/{name}", path)]


def _qualification(target) -> SeedQualification:
    return SeedQualification.for_target(target, model_config_sha256="1" * 64, compilation_sha256="2" * 64)


def _seed_the_portable_capsule(artifact: Path, tmp_path: Path) -> None:
    """A seed in the portable capsule, qualified for the engine version the capsule will record (0.31.0)."""
    from coldsnap_core.artifact.capsules import read_descriptor

    (entry,) = read_descriptor(artifact).workers
    recorded = msgspec.structs.replace(_current_qualification(), engine_version="0.31.0")
    attach_seed(artifact, entry.worker, entry.payload.sha256, recorded, _seed_files(tmp_path / "portable-node-cache", "portable"))


@pytest.fixture
def placing_seeds(monkeypatch, tmp_path: Path) -> Path:
    """The loader's seed placement as in an engine that compiles (the in-process loader has no
    ``VllmConfig``): qualified as the overlay captured below, placed into an empty cache root (returned)."""
    import coldsnap_vllm.derived_cache as seeds

    roots = {"vllm-cache": tmp_path / "fresh-node" / "vllm", "inductor-cache": tmp_path / "fresh-node" / "inductor"}
    monkeypatch.setattr(seeds, "compile_skip_reason", lambda vllm_config: None)
    monkeypatch.setattr(seeds, "qualification", lambda vllm_config, engine, version, config: _current_qualification())
    monkeypatch.setattr(seeds, "cache_roots", lambda: roots)
    return roots["vllm-cache"]


def _current_qualification() -> SeedQualification:
    from coldsnap_core.identity.target import collect_target, engine_version

    return _qualification(collect_target("vllm", engine_version("vllm"), device=torch.device("cpu")))


def _overlay_with_seed(exported, model_config, tmp_path: Path, monkeypatch, *, perturb: bool):
    """A portable capsule with its own seed, from another engine version (residual perturbed or not),
    after one ``auto`` load on this node, and a seed attached to the overlay that load stored (as the
    loader does once vLLM has compiled): (artifact, state root, overlay capture)."""
    artifact = _copy_artifact(exported, tmp_path)
    _seed_the_portable_capsule(artifact, tmp_path)
    if perturb:
        _perturb_residual(artifact)
    _edit_target(artifact, engine_version="0.31.0")
    state = tmp_path / "state"
    shutil.copytree(exported[1], state)
    _env(monkeypatch, artifact, state, restore="auto")
    fell_back = make_loader().load_weights(Consumer(), model_config)
    capture = fell_back.overlay
    assert fell_back.fallback.rule == "target-qualification" and capture is not None
    # the portable seed was recorded for 0.31.0: this start skips it on qualification
    assert fell_back.derived_cache.status == "skipped" and "engine_version" in fell_back.derived_cache.reason
    attach_overlay_seed(capture, _current_qualification(), _seed_files(tmp_path / "this-node-cache", "overlay"))
    return artifact, state, capture


@pytest.mark.parametrize("perturb", [True, False], ids=["overlay", "qualified"])
def test_an_overlay_carries_its_own_seed_and_a_restore_through_it_places_that_seed(
    exported, model_config, tmp_path: Path, monkeypatch, caplog, placing_seeds: Path, perturb: bool
) -> None:
    """Catches an overlay without a seed of its own, a restore through an overlay (or a qualification
    record) that places the portable capsule's seed (recorded for another target) or none, a portable
    seed's pins taken for capsule bytes (a capture identical but for them stored as an ``overlay``),
    and a corrupt overlay seed placed: overlay.json pins the seed's two files (read-only, still valid);
    the next restore on this node selects the overlay and places exactly its seed; after one flipped
    byte in the overlay's archive the restore still uses the overlay and skips the seed, naming the file."""
    _, state, capture = _overlay_with_seed(exported, model_config, tmp_path, monkeypatch, perturb=perturb)
    kind = "overlay" if perturb else "qualified"
    assert capture.kind == kind
    descriptor = json.loads((capture.path / OVERLAY_FILENAME).read_text())
    names = [p["name"] for p in descriptor["capsule_files"]]
    assert {SEED_DOCUMENT_FILENAME, SEED_ARCHIVE_FILENAME} <= set(names) and len(names) == (6 if perturb else 2)
    assert os.stat(capture.path / OVERLAY_FILENAME).st_mode & 0o777 == 0o444
    assert [o.status for o in list_overlays(state)] == ["current"]

    monkeypatch.setenv("COLDSNAP_RESTORE", "native")
    outcome = make_loader().load_weights(Consumer(), model_config)
    assert (outcome.kind, outcome.capsule_source, outcome.capsule_dir) == ("restored", kind, capture.path)
    assert (outcome.derived_cache.status, outcome.derived_cache.placed_files) == ("used", 1)
    placed = sorted(p.relative_to(placing_seeds).as_posix() for p in placing_seeds.rglob("*") if p.is_file())
    assert placed == ["torch_compile_cache/overlay"]

    shutil.rmtree(placing_seeds)
    archive = capture.path / SEED_ARCHIVE_FILENAME
    os.chmod(archive, 0o644)
    flip_byte(archive, 700)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        outcome = make_loader().load_weights(Consumer(), model_config)
    assert (outcome.kind, outcome.capsule_source, outcome.derived_cache.status) == ("restored", kind, "skipped")
    assert f"{SEED_ARCHIVE_FILENAME} is" in outcome.derived_cache.reason and str(archive) in outcome.derived_cache.reason
    assert not placing_seeds.exists()
    assert any("derived-cache seed skipped" in r.getMessage() for r in caplog.records)


def test_an_overlay_seed_is_attached_only_to_the_overlay_this_start_stored(
    exported, model_config, tmp_path: Path, monkeypatch, placing_seeds: Path
) -> None:
    """Catches a seed pinned into an overlay another capture replaced meanwhile, or one qualified for
    another target than the overlay's: both refused (``OverlayError``), overlay.json unchanged."""
    _, _, capture = _overlay_with_seed(exported, model_config, tmp_path, monkeypatch, perturb=True)
    before = (capture.path / OVERLAY_FILENAME).read_bytes()
    files = _seed_files(tmp_path / "again", "again")
    replaced = dataclasses.replace(
        capture, descriptor=msgspec.structs.replace(capture.descriptor, created_at="2000-01-01T00:00:00+00:00")
    )
    with pytest.raises(OverlayError, match="replaced since this start captured it"):
        attach_overlay_seed(replaced, _current_qualification(), files)
    other = msgspec.structs.replace(_current_qualification(), engine_version="0.31.0")
    with pytest.raises(OverlayError, match="not for the overlay's target"):
        attach_overlay_seed(capture, other, files)
    assert (capture.path / OVERLAY_FILENAME).read_bytes() == before


# -- the model-class inspection cache, placed when vLLM calls register() (docs/format.md §17.4) --------

MODELINFO = "vllm-cache/modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json"


def _seed_with_modelinfo(folder: Path) -> list[tuple[str, Path]]:
    """A compiled file and a modelinfos entry, as a seed's ``(member path, file)`` list."""
    info = folder / "modelinfo.json"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text('{"hash": "abc", "modelinfo": {"architecture": "LlamaForCausalLM"}}\n')
    return sorted([*_seed_files(folder, "kernel"), (MODELINFO, info)])


@pytest.fixture
def early(monkeypatch, tmp_path: Path):
    """:func:`coldsnap_vllm.early_seed.place_early` as a fresh process runs it: its once-per-process flag
    reset, ``VLLM_CACHE_ROOT`` an empty folder (returned with the function), vLLM's logging not configured."""
    import coldsnap_vllm.early_seed as early_seed

    cache = tmp_path / "fresh-node-cache"
    monkeypatch.setattr(early_seed, "_done", False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache))
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])  # as when vLLM calls register(): not configured yet
    return early_seed.place_early, cache


def _early_env(artifact: Path, state: Path, **more: str) -> dict[str, str]:
    return {"COLDSNAP_ARTIFACT_DIR": str(artifact), "COLDSNAP_STATE_ROOT": str(state), **more}


def test_register_places_the_seeds_modelinfos_once_and_only_them(exported, tmp_path: Path, early, capsys) -> None:
    """Catches a seed whose model-class inspection cache is placed only in ``load_weights`` (after vLLM read
    it), compiled files placed before their full qualification is known, a second placement in one process,
    an existing entry replaced, and a corrupt seed placed: the first call places exactly the modelinfos entry
    (one INFO line), a second does nothing; an entry already there is kept; a flipped archive byte skips
    with one INFO line naming the archive; ``COLDSNAP_DERIVED_CACHE=off`` and export place nothing. vLLM's logging
    is not configured yet here, as when vLLM calls ``register()``: each line is written at once to its stream."""
    place_early, cache = early
    artifact = _copy_artifact(exported, tmp_path)
    from coldsnap_core.artifact.capsules import read_descriptor

    (entry,) = read_descriptor(artifact).workers
    attach_seed(artifact, entry.worker, entry.payload.sha256, _current_qualification(), _seed_with_modelinfo(tmp_path / "c"))
    env = _early_env(artifact, tmp_path / "state")
    capsys.readouterr()
    placement = place_early(env)
    assert place_early(env) is None
    assert (placement.status, placement.placed_files, placement.present_files) == ("used", 1, 0)
    assert [p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()] == [MODELINFO.split("/", 1)[1]]
    lines = [line for line in capsys.readouterr().out.splitlines() if "inspection cache" in line]
    assert len(lines) == 1 and "placed from the seed: 1 files written" in lines[0]

    import coldsnap_vllm.early_seed as early_seed

    placed = cache / MODELINFO.split("/", 1)[1]
    placed.write_text("this node's own")
    early_seed._done = False
    assert (place_early(env).status, placed.read_text()) == ("used", "this node's own")

    placed.unlink()
    flip_byte(artifact / CAPSULE / SEED_ARCHIVE_FILENAME, 700)
    early_seed._done = False
    capsys.readouterr()
    skipped = place_early(env)
    assert skipped.status == "skipped" and f"{SEED_ARCHIVE_FILENAME} is" in skipped.reason and not placed.exists()
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "inspection cache" in line]
    assert "not placed from the seed" in line
    flip_byte(artifact / CAPSULE / SEED_ARCHIVE_FILENAME, 700)  # intact again
    for more in ({"COLDSNAP_DERIVED_CACHE": "off"}, {"COLDSNAP_EXPORT_MODEL_PAYLOAD": "1"}):
        early_seed._done = False
        assert place_early({**env, **more}) is None, more
    early_seed._done = False
    result = place_early({**env, "COLDSNAP_RESTORE": "nonsense"})  # a malformed setting: skipped, never raised
    assert result.status == "skipped" and "COLDSNAP_RESTORE" in result.reason
    assert not placed.exists()


def test_register_places_the_overlays_modelinfos_after_an_engine_upgrade(
    exported, model_config, tmp_path: Path, monkeypatch, early
) -> None:
    """Catches an early placement that takes the portable seed recorded for another engine version, or that
    ignores the node's overlay: the portable seed is skipped on ``engine_version``, the overlay's own seed
    places its entry."""
    place_early, cache = early
    artifact = _copy_artifact(exported, tmp_path)
    from coldsnap_core.artifact.capsules import read_descriptor
    from coldsnap_core.format.target import TargetIdentity

    (entry,) = read_descriptor(artifact).workers
    old = msgspec.structs.replace(_current_qualification(), engine_version="0.31.0")
    attach_seed(artifact, entry.worker, entry.payload.sha256, old, _seed_with_modelinfo(tmp_path / "old"))
    _perturb_residual(artifact)
    _edit_target(artifact, engine_version="0.31.0")
    state = tmp_path / "state"
    shutil.copytree(exported[1], state)
    env = _early_env(artifact, state)
    skipped = place_early(env)
    assert skipped.status == "skipped" and "engine_version: captured 0.31.0" in skipped.reason and not cache.exists()

    _env(monkeypatch, artifact, state, restore="auto")
    capture = make_loader().load_weights(Consumer(), model_config).overlay
    assert TargetIdentity.read(capture.path / "target.json") == capture.descriptor.target
    attach_overlay_seed(capture, _current_qualification(), _seed_with_modelinfo(tmp_path / "new"))
    import coldsnap_vllm.early_seed as early_seed

    early_seed._done = False
    assert place_early(env).status == "used"
    assert (cache / MODELINFO.split("/", 1)[1]).is_file()
    (cache / MODELINFO.split("/", 1)[1]).unlink()
    early_seed._done = False
    assert place_early({**env, "COLDSNAP_OVERLAY": "off"}).status == "skipped"
    assert not (cache / MODELINFO.split("/", 1)[1]).exists()


PLAIN_START = "import sys; from vllm.engine.arg_utils import EngineArgs; EngineArgs(model=sys.argv[1], load_format='safetensors')"
"""What a plain ``--load-format safetensors`` start does before vLLM configures its logging: ``EngineArgs`` calls the
general plugins, coldsnap's ``register()`` among them (``vllm/engine/arg_utils.py``)."""


def _plain_start(model: Path, artifact: Path, tmp_path: Path) -> list[str]:
    """Run :data:`PLAIN_START` in a fresh process with ``COLDSNAP_ARTIFACT_DIR`` set; its lines about the seed."""
    env = {
        **os.environ,
        "COLDSNAP_ARTIFACT_DIR": str(artifact),
        "COLDSNAP_STATE_ROOT": str(tmp_path / "state"),
        "VLLM_CACHE_ROOT": str(tmp_path / "fresh-node-cache"),
    }
    done = subprocess.run([sys.executable, "-c", PLAIN_START, str(model)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in (done.stdout + done.stderr).splitlines() if "inspection cache" in line]


@pytest.mark.slow  # about 45 s: a fresh interpreter imports vLLM's EngineArgs
def test_register_reads_artifact_json_within_its_cap_and_says_itself_that_it_skipped(
    smollm2_2layer: Path, tmp_path: Path
) -> None:
    """A 9 MiB ``artifact.json`` (over the 8 MiB cap of an artifact descriptor) named by ``COLDSNAP_ARTIFACT_DIR``, in a
    plain ``safetensors`` start: ``register()`` refuses it unparsed and says so itself, one INFO line naming the cap.
    Fails if the document is parsed without the cap (a 150 MiB one took a plain start to 4.66 GB and 21 s), or if the
    line waits for a flush that only coldsnap's loader makes (a start of another load format said nothing)."""
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "artifact.json").write_bytes(b"{" + b" " * (9 << 20) + b"}")
    (line,) = _plain_start(smollm2_2layer, artifact, tmp_path)
    assert "INFO" in line and "not placed from the seed" in line and f"more than the {8 << 20} bytes" in line, line


@pytest.mark.slow  # about 45 s: a fresh interpreter imports vLLM's EngineArgs
def test_register_says_it_placed_a_seed_for_a_start_of_any_load_format(exported, smollm2_2layer: Path, tmp_path: Path) -> None:
    """A seeded artifact named by ``COLDSNAP_ARTIFACT_DIR``, in a plain ``safetensors`` start (not coldsnap's load
    format): ``register()`` places the seed's model-class inspection cache and says so in one INFO line, naming why
    (the variable, whatever the load format) and how to turn seeds off. Fails if a placement for a start of
    another load format goes unsaid (a seed's files are the artifact author's, docs/format.md §17)."""
    artifact = _copy_artifact(exported, tmp_path)
    from coldsnap_core.artifact.capsules import read_descriptor

    (entry,) = read_descriptor(artifact).workers
    attach_seed(artifact, entry.worker, entry.payload.sha256, _current_qualification(), _seed_with_modelinfo(tmp_path / "c"))
    (line,) = _plain_start(smollm2_2layer, artifact, tmp_path)
    assert "INFO" in line and "placed from the seed: 1 files written" in line, line
    assert "whatever its load format" in line and "COLDSNAP_DERIVED_CACHE=off" in line, line
    assert (tmp_path / "fresh-node-cache" / MODELINFO.split("/", 1)[1]).is_file()
