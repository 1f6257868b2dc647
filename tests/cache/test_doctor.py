"""``coldsnap doctor ARTIFACT``: a healthy node exits 0; each broken node exits with its check's code and names it.

Every node is real: a capture of a real safetensors checkpoint (``cache_support.capture``) recording vLLM's target
on this machine (the installed vLLM's version, as a ``vllm serve`` capture records it), its pack in the state root
with its validation record, the same pack in a real folder store, a real S3 server (moto on 127.0.0.1) that is
stopped, real uids (the tests run as root and ``chown`` to another), vLLM's real plugin variable and the installed
distributions' metadata (``importlib.metadata``, what vLLM's plugin loader reads).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from cache_support import REPO, capture

from coldsnap_core.cli.doctor_cmd import CHECK_EXIT_CODES
from coldsnap_core.cli.main import main
from coldsnap_core.identity.target import collect_target, engine_version
from coldsnap_core.stores.local import LocalFolderStore

OTHER_UID = 4242


@dataclass
class Node:
    """One node: a checkpoint folder, an artifact captured from it, the state root holding its pack, a folder store."""

    checkpoint: Path
    artifact: Path
    state_root: Path
    store: Path
    pack_sha256: str

    def args(self, *extra: str | Path) -> list[str]:
        return ["doctor", str(self.artifact), "--state-root", str(self.state_root), "--repo", str(self.store), *map(str, extra)]


def doctor(capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, dict[str, object]]:
    """Run ``coldsnap doctor ... --json`` in this process; returns the exit code and the document."""
    code = main([*args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def statuses(doc: dict[str, object]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for check in doc["checks"]:  # type: ignore[union-attr]
        found.setdefault(check["check"], set()).add(check["status"])
    return found


def failed(doc: dict[str, object]) -> list[dict[str, object]]:
    return [c for c in doc["checks"] if c["status"] == "failed"]  # type: ignore[union-attr]


@pytest.fixture
def vllm_target():
    """This machine's target as vLLM records it (the installed vLLM's version, the CPU)."""
    version = engine_version("vllm")
    if version is None:
        pytest.skip("vLLM is not installed: the plugin checks need its distribution")
    return collect_target("vllm", version)


def make_node(root: Path, checkpoint: Path, target) -> Node:
    folder = root / "checkpoint"
    shutil.copytree(checkpoint, folder)
    result = capture(folder, root / "artifact", root / "state", target=target)
    pack = result.manifest.pack
    store = root / "store"
    LocalFolderStore(store).upload(result.pack_path, pack.sha256, pack.size_bytes)
    return Node(folder, root / "artifact", root / "state", store, pack.sha256)


@pytest.fixture
def node(tmp_path: Path, tiny_checkpoint: Path, vllm_target) -> Node:
    return make_node(tmp_path, tiny_checkpoint, vllm_target)


@pytest.mark.vllm
def test_a_healthy_node_exits_0_with_every_check_ok(node: Node, capsys) -> None:
    """Every check passes (plugin registered for the installed vLLM, state root owned by this user, the folder store
    holds the pack, the portable capsule qualifies, the checkpoint matches, the pack is staged and trusted): exit 0,
    one line per check, ``ready``. Fails if any check misjudges a healthy node."""
    code, doc = doctor(capsys, node.args())
    assert code == 0, doc
    assert statuses(doc) == {name: {"ok"} for name in CHECK_EXIT_CODES}, doc
    assert doc["ready"] is True and doc["exit_code"] == 0
    assert main(node.args()) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[:-1]] == [["ok", f"{name}:"] for name in CHECK_EXIT_CODES]
    assert out[-1] == f"ready: this node will restore {node.artifact}"


@pytest.mark.vllm
def test_a_state_root_of_another_owner_exits_11(node: Node, capsys) -> None:
    """The state root belongs to another uid than the engine's (here: this process's): exit 11 naming both uids and
    the ``chown`` remedy. Fails if ownership is not checked (a restore as this user would trust no record and write
    nothing there)."""
    for path in [node.state_root, *node.state_root.rglob("*")]:
        os.lchown(path, OTHER_UID, -1)
    code, doc = doctor(capsys, node.args())
    assert code == CHECK_EXIT_CODES["state-root"] == 11, doc
    (state_root,) = [c for c in failed(doc) if c["check"] == "state-root"]
    assert f"belongs to uid {OTHER_UID}" in state_root["message"] and f"uid {os.geteuid()}" in state_root["message"]
    assert state_root["remedy"].startswith(f"chown -R {os.geteuid()} {node.state_root}")


@pytest.mark.vllm
def test_a_state_root_its_owner_cannot_write_exits_11(node: Node, capsys) -> None:
    """The state root is this user's but mode 0500: exit 11 naming the mode. Fails if only the owner is checked."""
    node.state_root.chmod(0o500)
    try:
        code, doc = doctor(capsys, node.args())
    finally:
        node.state_root.chmod(0o700)
    assert code == 11 and "dr-x------" in failed(doc)[0]["message"], doc


@pytest.fixture
def other_users_node(tiny_checkpoint: Path, vllm_target):
    """A node in a folder every user can reach (pytest's are 0700), everything in it owned by uid 4242."""
    root = Path(tempfile.mkdtemp(prefix="coldsnap-doctor-", dir="/tmp"))
    try:
        root.chmod(0o755)
        node = make_node(root, tiny_checkpoint, vllm_target)
        for path in [root, *root.rglob("*")]:
            os.lchown(path, OTHER_UID, OTHER_UID)
        yield node
    finally:
        shutil.rmtree(root)


def _process(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *args]
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=environ, cwd=REPO, timeout=300)


@pytest.mark.vllm
def test_the_engines_user_is_checked_with_its_own_uid(other_users_node: Node, capsys) -> None:
    """``--user 4242`` run as root: every check runs with uid 4242's effective ids (its state root, its validation
    records, its permission to read the checkpoint): no check fails (the pack's record, chowned with the rest, no
    longer matches its object's ctime: a warning). The same node checked as root fails the state root (exit 11) and
    reads the record as another user's. Runs as its own process (the command switches its effective uid). Fails if
    ``--user`` is ignored, or the records are read as root's."""
    done = _process("-m", "coldsnap_core.cli.main", *other_users_node.args("--user", str(OTHER_UID), "--json"))
    doc = json.loads(done.stdout)
    assert done.returncode == 0 and doc["uid"] == OTHER_UID, doc
    packs = next(c for c in doc["checks"] if c["check"] == "packs")
    assert packs["status"] == "warning" and "no longer matches" in packs["message"], packs
    code, doc = doctor(capsys, other_users_node.args())
    assert code == 11, doc
    packs = next(c for c in doc["checks"] if c["check"] == "packs")
    assert f"record belongs to uid {OTHER_UID}, not 0" in packs["message"], packs


def test_another_user_is_checked_only_by_root(other_users_node: Node) -> None:
    """Run as uid 4242 (not root), ``--user 0`` is refused: exit 4 naming what to do. Fails if a non-root run claims
    to have checked as another user."""
    script = (
        "import os, sys\n"
        "from coldsnap_core.cli.main import build_parser, main\n"
        "import torch\n"  # imported as root: this Python's files are root's alone on the test machine
        "build_parser()\n"
        f"os.setegid({OTHER_UID}); os.seteuid({OTHER_UID})\n"
        f"sys.exit(main({other_users_node.args('--user', '0', '--json')!r}))\n"
    )
    done = _process("-c", script)
    assert done.returncode == 4, done.stderr[-2000:]
    error = json.loads(done.stdout)["error"]
    assert error["rule"] == "configuration" and "only root checks as another user" in error["message"]


@pytest.mark.vllm
def test_a_stopped_store_server_exits_12(
    tmp_path: Path, tiny_checkpoint: Path, vllm_target, request, monkeypatch, capsys
) -> None:
    """The configured store is a real S3 server holding the pack, stopped: exit 12 naming the store, even though the
    pack is staged (a restore that must fetch again, after a quarantine, would fail). Fails if the store is not
    contacted or its failure is reported as anything but the store check."""
    from store_servers import store_under_test

    s3 = store_under_test("s3", request, tmp_path, monkeypatch)
    node = make_node(tmp_path, tiny_checkpoint, vllm_target)
    pack = node.state_root / "model-payloads" / "sha256" / f"{node.pack_sha256}.pack"
    s3.store.upload(pack, node.pack_sha256, pack.stat().st_size)
    monkeypatch.setenv("COLDSNAP_STORE_RETRIES", "0")
    args = ["doctor", str(node.artifact), "--state-root", str(node.state_root), "--repo", s3.spec]
    assert doctor(capsys, args)[0] == 0  # the server answers: healthy
    s3.server.stop()
    try:
        code, doc = doctor(capsys, args)
    finally:
        s3.server.start()
    assert code == CHECK_EXIT_CODES["store"] == 12, doc
    (store,) = failed(doc)
    assert store["check"] == "store" and s3.store.name in store["message"] and "did not answer" in store["message"]


@pytest.mark.vllm
def test_a_capsule_captured_on_another_target_exits_13(tmp_path: Path, tiny_checkpoint: Path, vllm_target, capsys) -> None:
    """The artifact was captured with another torch (its ``target.json`` says so) and this node holds no overlay for
    its target: exit 13 naming the field and both values. Fails if doctor does not run the restore's qualification."""
    other = msgspec.structs.replace(vllm_target, torch_version="2.0.0")
    node = make_node(tmp_path, tiny_checkpoint, other)
    code, doc = doctor(capsys, node.args())
    assert code == CHECK_EXIT_CODES["target"] == 13, doc
    (target,) = failed(doc)
    assert target["check"] == "target" and "torch_version" in target["message"] and "2.0.0" in target["message"]
    assert vllm_target.torch_version in target["message"]


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("damage", "rule"), [("flip", "residual-sha256"), ("truncate", "residual-size"), ("remove", "object-present")]
)
def test_a_damaged_residual_blob_exits_13_naming_it(node: Node, damage: str, rule: str, capsys) -> None:
    """The worker's ``weights.blob`` with one byte flipped, truncated or removed: the target check fails (exit 13, not
    ready) naming the blob and the rule a restore would refuse it by, with one remedy. Fails if doctor says "ready"
    for a node whose restore verifies the blob first and refuses it."""
    blob = next(node.artifact.rglob("weights.blob"))
    if damage == "flip":
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0x01
        blob.write_bytes(bytes(data))
    elif damage == "truncate":
        blob.write_bytes(blob.read_bytes()[:-1])
    else:
        blob.unlink()
    code, doc = doctor(capsys, node.args())
    assert code == CHECK_EXIT_CODES["target"] and doc["ready"] is False, doc
    [target] = failed(doc)
    assert target["check"] == "target" and str(blob) in target["message"] and rule in target["message"], target
    assert target["remedy"]


@pytest.mark.vllm
def test_a_changed_checkpoint_exits_14(node: Node, other_checkpoint: Path, capsys) -> None:
    """The checkpoint file was replaced by another fine-tune's (same name, same size, other bytes): exit 14 naming the
    file, with one remedy (the error's own is left out of the message); the other checkpoint given as ``--model``
    likewise; a folder that is gone says so. Fails if doctor does not run the restore's model identity check, or its
    line says two remedies."""
    shutil.copyfile(other_checkpoint / "model.safetensors", node.checkpoint / "model.safetensors")
    code, doc = doctor(capsys, node.args())
    assert code == CHECK_EXIT_CODES["model"] == 14, doc
    (model,) = failed(doc)
    assert model["check"] == "model" and "model-identity" in model["message"] and "model.safetensors" in model["message"]
    # one remedy, the check's own (the message quotes the error without the error's remedy)
    assert "remedy" not in model["message"] and model["remedy"].startswith("start the engine with the checkpoint")
    assert main(node.args()) == 14
    (line,) = [t for t in capsys.readouterr().out.splitlines() if t.startswith("FAILED  model:")]
    assert line.count("remedy:") == 1, line
    code, doc = doctor(capsys, node.args("--model", other_checkpoint))
    assert code == 14 and "content fingerprint" in failed(doc)[0]["message"], doc
    shutil.rmtree(node.checkpoint)
    code, doc = doctor(capsys, node.args())
    assert code == 14 and f"{node.checkpoint} does not exist on this node" in failed(doc)[0]["message"], doc


@pytest.mark.vllm
def test_a_pack_neither_staged_nor_in_the_store_exits_15(node: Node, capsys) -> None:
    """A fresh state root and a store without the pack: exit 15 naming the pack (the store check fails too, 12 comes
    first); with no store configured at all, exit 15 alone. Fails if a missing pack is not found before a start."""
    fresh = node.state_root.parent / "fresh"
    (node.store / "model-payloads" / "sha256" / f"{node.pack_sha256}.pack").unlink()
    args = ["doctor", str(node.artifact), "--state-root", str(fresh)]
    code, doc = doctor(capsys, [*args, "--repo", str(node.store)])
    assert code == 12 and {c["check"] for c in failed(doc)} == {"store", "packs"}, doc
    code, doc = doctor(capsys, args)
    assert code == CHECK_EXIT_CODES["packs"] == 15, doc
    (packs,) = failed(doc)
    assert node.pack_sha256 in packs["message"] and "no payload store is configured" in packs["message"]
    assert "coldsnap stage" in packs["remedy"]


@pytest.mark.vllm
def test_a_plugin_vllm_does_not_load_exits_10(node: Node, monkeypatch, capsys) -> None:
    """``VLLM_PLUGINS`` names other plugins only (vLLM then loads none of coldsnap's, and ``--load-format coldsnap``
    is unknown): exit 10 naming the variable. ``VLLM_PLUGINS=coldsnap`` passes. Fails if doctor does not apply vLLM's
    own allow-list rule."""
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    code, doc = doctor(capsys, node.args())
    assert code == CHECK_EXIT_CODES["plugin"] == 10, doc
    (plugin,) = failed(doc)
    assert "VLLM_PLUGINS='lora_filesystem_resolver'" in plugin["message"] and "add coldsnap to VLLM_PLUGINS" in plugin["remedy"]
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,coldsnap")
    assert doctor(capsys, node.args())[0] == 0


def _distribution(folder: Path, name: str, version: str, entry_points: str | None = None) -> None:
    """An installed distribution's metadata (``<name>-<version>.dist-info``), as pip writes it."""
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)


def _doctor_process(node: Node, shadow: Path) -> subprocess.CompletedProcess[str]:
    """``coldsnap doctor --json`` as its own process with ``shadow`` first on its path (its distributions are found
    before the installed ones of the same name, as ``importlib.metadata`` searches ``sys.path`` in order)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(REPO)]), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "coldsnap_core.cli.main", *node.args(), "--json"]
    # Not cwd=REPO: ``-m`` puts the working folder first on sys.path, and an editable install leaves
    # ``coldsnap.egg-info`` (with its entry points) there, which would be found before the shadow.
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=shadow.parent, timeout=300)


@pytest.mark.vllm
def test_a_coldsnap_without_its_entry_point_exits_10(node: Node, tmp_path: Path) -> None:
    """The coldsnap distribution vLLM's environment finds first declares no ``vllm.general_plugins`` entry point (a
    copy of coldsnap put on the path instead of installed): exit 10, "will not load coldsnap". Fails if doctor only
    imports the plugin module instead of looking for the entry point vLLM loads."""
    _distribution(tmp_path / "shadow", "coldsnap", "0.1.0")
    done = _doctor_process(node, tmp_path / "shadow")
    doc = json.loads(done.stdout)
    assert done.returncode == 10, doc
    assert "will not load coldsnap" in failed(doc)[0]["message"]


@pytest.mark.vllm
def test_a_vllm_outside_the_supported_range_exits_10(node: Node, tmp_path: Path) -> None:
    """The vLLM installed is 0.31.0, below the range coldsnap's ``vllm`` extra declares: exit 10 naming the version
    and the range (the target check fails too: the capsule was captured by another vLLM). Fails if the version is not
    compared with the declared range."""
    _distribution(tmp_path / "shadow", "vllm", "0.31.0")
    done = _doctor_process(node, tmp_path / "shadow")
    doc = json.loads(done.stdout)
    assert done.returncode == 10, doc
    plugin, target = failed(doc)
    assert "vLLM 0.31.0 is outside the versions this coldsnap supports (<0.34,>=0.32)" in plugin["message"]
    assert target["check"] == "target"


def test_an_engine_not_installed_here_is_a_warning(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    """An artifact captured by SGLang, checked in an environment without SGLang: the plugin and target checks say
    they cannot tell and name the extra, as warnings; nothing fails (exit 0). Fails if a missing engine crashes the
    command or fails it."""
    if engine_version("sglang") is not None:
        pytest.skip("SGLang is installed here")
    node = make_node(tmp_path, tiny_checkpoint, collect_target("sglang", "0.5.23"))
    code, doc = doctor(capsys, node.args())
    assert code == 0, doc
    warnings = {c["check"]: c for c in doc["checks"] if c["status"] == "warning"}
    assert set(warnings) == {"plugin", "target"}
    assert "cannot tell without SGLang" in warnings["plugin"]["message"] and "coldsnap[sglang]" in warnings["plugin"]["remedy"]


def test_an_unknown_user_is_a_configuration_error(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    """``--user`` naming no user: exit 4 (rule ``configuration``) as a JSON error document."""
    node = make_node(tmp_path, tiny_checkpoint, None)
    code, doc = doctor(capsys, node.args("--user", "no-such-user-here"))
    assert code == 4 and doc["error"]["rule"] == "configuration" and "no such user" in doc["error"]["message"]


def test_an_invalid_store_reference_fails_the_store_check(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    """``--repo s3://`` (no bucket: a ``ConfigurationError`` where the store is made): doctor reports it as the store
    check (exit 12) and still runs the others. Fails if a bad store reference stops the whole report."""
    node = make_node(tmp_path, tiny_checkpoint, None)
    code, doc = doctor(capsys, ["doctor", str(node.artifact), "--state-root", str(node.state_root), "--repo", "s3://"])
    assert code == 12, doc
    (store,) = failed(doc)
    assert store["check"] == "store" and "is not an S3 bucket name" in store["message"]
    assert statuses(doc)["packs"] == {"ok"}


@pytest.mark.vllm
def test_a_pulled_node_checks_the_artifacts_model_folder_by_default(node: Node, capsys) -> None:
    """A pulled node: the artifact holds ``model/`` (the model's non-weight files, pinned) and the folder the
    artifact was captured from is not on this node. Without ``--model`` the model check is the artifact's ``model/``
    folder (what the engine serves there): ok, every model byte from the pack. Fails if doctor checks the export
    host's checkpoint path by default (exit 14: "does not exist on this node")."""
    from coldsnap_core.artifact.model_files import attach_model_files

    (node.checkpoint / "config.json").write_text('{"model_type": "llama"}')  # a non-weight file of the model
    assert attach_model_files(node.artifact, node.checkpoint)
    shutil.rmtree(node.checkpoint)
    code, doc = doctor(capsys, node.args())
    assert code == 0, failed(doc)
    (model,) = [c for c in doc["checks"] if c["check"] == "model"]
    assert model["status"] == "ok" and model["message"].startswith(f"{node.artifact / 'model'}: no checkpoint weights")


def _untrusted(node: Node, *, corrupt: bool) -> None:
    """Remove the pack's validation record (a restore then hashes the pack in full); with ``corrupt``, flip a byte."""
    objects = node.state_root / "model-payloads" / "sha256"
    (objects / f"{node.pack_sha256}.pack.record").unlink()
    if corrupt:
        pack = objects / f"{node.pack_sha256}.pack"
        pack.chmod(0o644)
        data = bytearray(pack.read_bytes())
        data[len(data) // 2] ^= 0xFF
        pack.write_bytes(bytes(data))


@pytest.mark.vllm
def test_a_staged_pack_without_a_trusted_record_is_hashed_and_reported_intact(node: Node, capsys) -> None:
    """A staged pack whose validation record is gone: doctor hashes it now (a progress line on stderr), says it is
    intact and that a restore hashes it again (a warning, exit 0), and writes no record. Fails if doctor reports such
    a pack ready without reading it (a corrupt one was then found only by the start)."""
    _untrusted(node, corrupt=False)
    code, doc = doctor(capsys, node.args())
    assert code == 0, doc
    (packs,) = [c for c in doc["checks"] if c["check"] == "packs"]
    assert packs["status"] == "warning" and "is staged and intact (hashed in full now)" in packs["message"], packs
    assert main(node.args()) == 0
    err = capsys.readouterr().err
    assert f"verify {node.pack_sha256[:12]}: " in err and "done in" in err
    assert not (node.state_root / "model-payloads" / "sha256" / f"{node.pack_sha256}.pack.record").exists()


@pytest.mark.vllm
def test_a_corrupt_staged_pack_fails_without_a_store_and_warns_with_one(node: Node, capsys) -> None:
    """A staged pack without a trusted record and with a flipped byte: with no payload store doctor fails the packs
    check (exit 15, "not ready") naming the corruption and the rule; with a store that holds the pack it is a warning
    (the restore quarantines it and fetches it again). Each line says one remedy. Fails if doctor says "ready" for a
    pack the start would refuse."""
    _untrusted(node, corrupt=True)
    args = ["doctor", str(node.artifact), "--state-root", str(node.state_root)]
    code, doc = doctor(capsys, args)
    assert code == CHECK_EXIT_CODES["packs"] == 15, doc
    (packs,) = failed(doc)
    assert packs["check"] == "packs" and "is staged but corrupt (rule pack-sha256 failed" in packs["message"], packs
    assert "remedy" not in packs["message"] and "--repo STORE" in packs["remedy"]
    assert main(args) == 15 and capsys.readouterr().out.splitlines()[-1].startswith("not ready: packs failed")
    code, doc = doctor(capsys, node.args())
    assert code == 0, doc
    (packs,) = [c for c in doc["checks"] if c["check"] == "packs"]
    assert packs["status"] == "warning" and "fetches it again from" in packs["message"], packs


@pytest.mark.vllm
def test_a_symbolic_link_in_place_of_the_staged_pack_fails_the_packs_check(node: Node, capsys) -> None:
    """The staged pack replaced by a symbolic link to an intact copy: a restore refuses it (rule ``no-symlinks``), so
    doctor fails the packs check (exit 15) naming the link, even with a store that holds the pack. Fails if doctor
    follows the link and says "ready" (it hashed the copy and called it intact)."""
    objects = node.state_root / "model-payloads" / "sha256"
    pack = objects / f"{node.pack_sha256}.pack"
    copy = node.state_root.parent / "copy.pack"
    shutil.copyfile(pack, copy)
    pack.unlink()
    pack.symlink_to(copy)
    code, doc = doctor(capsys, node.args())
    assert code == CHECK_EXIT_CODES["packs"] == 15, doc
    (packs,) = failed(doc)
    assert packs["check"] == "packs" and "rule no-symlinks failed: refusing a symbolic link" in packs["message"], packs
    assert str(pack) in packs["message"] and packs["remedy"] == "remove what is there, then coldsnap stage ARTIFACT"


def test_an_artifact_of_an_engine_without_a_plugin_fails_the_plugin_check(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    """An artifact captured by a third engine through the public engine contract (``target.json`` engine ``toyeng``):
    the plugin check fails (exit 10) naming the engine, the target check says it cannot tell, as a JSON document.
    Fails if doctor looks the engine up among vLLM and SGLang only (a KeyError traceback, exit 1, no JSON)."""
    node = make_node(tmp_path, tiny_checkpoint, collect_target("toyeng", "0.0.1"))
    code, doc = doctor(capsys, node.args())
    assert code == CHECK_EXIT_CODES["plugin"] == 10, doc
    (plugin,) = failed(doc)
    assert plugin["message"] == "captured by 'toyeng', an engine coldsnap has no plugin for", plugin
    (target,) = [c for c in doc["checks"] if c["check"] == "target"]
    assert target["status"] == "warning" and target["message"].startswith("cannot tell without toyeng ("), target
