"""What binds a capsule to its artifact and its worker, on the real SmolLM2 2-layer capture.

``artifact.json`` pins each capsule's files; descriptor entry, folder name and manifests name one
worker; a capture with another world size leaves no stale capsule behind; a killed capsule write
leaves debris that the next capture of that capsule sweeps; a capture whose model bytes are few
says why. Every test names the QA defect it guards (1, 4, 6, 8, 10).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from core_support import REPO, Captured, capture, copy_capture, edit_json, repin, run_cli, run_cli_process
from slabs import Slabs

from coldsnap_core.artifact.capsules import read_descriptor, read_worker_capsule
from coldsnap_core.errors import ManifestValueError, ObserverError
from coldsnap_core.format.allocation import AllocationMap
from coldsnap_core.format.descriptor import ArtifactDescriptor
from coldsnap_core.format.manifest import WorkerIdentity

RANKS_OF_2 = [WorkerIdentity("worker", r, 2, r, 2) for r in range(2)]


def _capture_world_of_2(staged: Slabs, root: Path) -> Captured:
    """Ranks 0 and 1 of a world of 2 (the same slabs, so one shared pack) in one artifact."""
    for worker in RANKS_OF_2:
        captured = capture(root, staged.allocation_map, staged.allocations, staged.model_ranges, worker=worker)
    return captured


def test_capture_pins_every_capsule_file(captured_2layer: Captured) -> None:
    """Catches pins computed over other bytes than the files written (or missing): each worker entry
    of artifact.json pins the SHA-256 and size of both manifests, target.json and the residual blob as they are on
    disk, and reading the capsule through its entry succeeds (QA defect 1)."""
    (entry,) = read_descriptor(captured_2layer.artifact_dir).workers
    assert [p.name for p in entry.capsule_files] == [
        "native-manifest.json",
        "recovery-manifest.json",
        "target.json",
        "weights.blob",
    ]
    for pin in entry.capsule_files:
        data = (captured_2layer.capsule_dir / pin.name).read_bytes()
        assert (pin.size_bytes, pin.sha256) == (len(data), hashlib.sha256(data).hexdigest()), pin.name
    assert read_worker_capsule(captured_2layer.artifact_dir, entry).native == captured_2layer.manifest


def _descriptor_doc(captured: Captured) -> dict:
    return json.loads((captured.artifact_dir / "artifact.json").read_text())


def _two_world_sizes(doc: dict) -> None:
    other = copy.deepcopy(doc["workers"][0])
    other["worker"].update(rank=1, world_size=2, tensor_parallel_rank=1, tensor_parallel_size=2)
    other["capsule"] = "workers/worker-1-of-2"
    doc["workers"].append(other)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d["workers"][0]["capsule_files"].pop(), "capsule_files names"),
        (lambda d: d["workers"][0]["capsule_files"][2].update(name="native-manifest.json"), "capsule_files names"),
        (lambda d: d["workers"][0]["capsule_files"].reverse(), "capsule_files names"),
        (lambda d: d["workers"][0]["capsule_files"][2].update(name="../weights.blob"), "does not match"),
        (_two_world_sizes, "several world sizes"),
        (lambda d: d["model"].update(config_sha256="ABC"), "does not match"),
    ],
    ids=["pin-missing", "pin-twice", "pins-unsorted", "pin-name-escapes", "two-world-sizes", "config-digest-form"],
)
def test_descriptor_value_rules(captured_2layer: Captured, edit, words: str) -> None:
    """Catches a descriptor whose pins do not name exactly the capsule's four files (sorted, each once,
    plain file names), that mixes world sizes (QA defect 6), or whose configuration digest is not a
    digest: each is a ManifestValueError naming the field."""
    doc = _descriptor_doc(captured_2layer)
    edit(doc)
    with pytest.raises(ManifestValueError, match=words):
        ArtifactDescriptor.loads(json.dumps(doc), file="artifact.json")


def test_renamed_worker_capsules_are_refused(staged_2layer: Slabs, tmp_path: Path) -> None:
    """QA defect 4a: swapping ``workers/worker-0-of-2`` and ``workers/worker-1-of-2`` verified with exit 0
    and printed the wrong worker. Now the pins refuse it (exit 2, capsule-pin), and with the pins
    rewritten too, descriptor entry and manifests disagree on the worker (exit 2, manifests-agree)."""
    captured = _capture_world_of_2(staged_2layer, tmp_path / "tp2")
    assert run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root).returncode == 0
    workers = captured.artifact_dir / "workers"
    os.rename(workers / "worker-0-of-2", workers / "swap")
    os.rename(workers / "worker-1-of-2", workers / "worker-0-of-2")
    os.rename(workers / "swap", workers / "worker-1-of-2")
    done = run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root)
    assert done.returncode == 2 and "rule capsule-pin failed" in done.stderr, done.stderr
    assert "verified" not in done.stdout
    repin(captured)
    done = run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root)
    assert done.returncode == 2 and "rule manifests-agree failed" in done.stderr, done.stderr
    assert "belong to worker-1-of-2" in done.stderr and "verified" not in done.stdout


def test_tensor_parallel_rank_of_the_manifests_must_be_the_entrys(staged_2layer: Slabs, tmp_path: Path) -> None:
    """QA defect 4: the folder name says rank and world size only; manifests rewritten (and re-pinned) to
    another tensor parallel rank under the same folder name are refused because the descriptor entry
    names another worker (exit 2, manifests-agree)."""
    captured = _capture_world_of_2(staged_2layer, tmp_path / "tp2")
    capsule = captured.artifact_dir / "workers" / "worker-0-of-2"
    for name in ("native-manifest.json", "recovery-manifest.json"):
        edit_json(capsule / name, lambda d: d["worker"].update(tensor_parallel_rank=1))
    repin(captured)
    done = run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root)
    assert done.returncode == 2 and "rule manifests-agree failed" in done.stderr, done.stderr
    assert "tensor parallel rank 0 of 2), its manifests belong to worker-0-of-2 (tensor parallel rank 1 of 2)" in done.stderr


def test_capsule_of_another_world_copied_in_is_refused(staged_2layer: Slabs, captured_2layer: Captured, tmp_path: Path) -> None:
    """QA defect 4c: a ``worker-0-of-2`` capsule copied into an artifact as ``workers/worker-0-of-1``
    verified with exit 0. Now the pins refuse it, and with the pins rewritten the folder name and the
    manifests' worker disagree (exit 2 both times). The capsule folder named directly (inside the
    artifact) gets the same checks."""
    tp2 = _capture_world_of_2(staged_2layer, tmp_path / "tp2")
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    shutil.rmtree(captured.capsule_dir)
    shutil.copytree(tp2.artifact_dir / "workers" / "worker-0-of-2", captured.capsule_dir)
    for target in (captured.artifact_dir, captured.capsule_dir):
        done = run_cli("verify", target, "--state-root", captured.state_root)
        assert done.returncode == 2 and "rule capsule-pin failed" in done.stderr, done.stderr
    repin(captured)
    for target in (captured.artifact_dir, captured.capsule_dir, captured.manifest_path):
        done = run_cli("verify", target, "--state-root", captured.state_root)
        assert done.returncode == 2 and "rule manifests-agree failed" in done.stderr, done.stderr
        assert "named 'worker-0-of-1'" in done.stderr


def test_capsule_folder_outside_an_artifact_must_be_named_after_its_worker(captured_2layer: Captured, tmp_path: Path) -> None:
    """QA defect 4: a lone capsule folder (no artifact.json around it) whose name is another worker's
    is refused (exit 2); under its own name it verifies."""
    lone = tmp_path / "lone" / "worker-1-of-2"
    shutil.copytree(captured_2layer.capsule_dir, lone)
    done = run_cli("verify", lone, "--state-root", captured_2layer.state_root)
    assert done.returncode == 2 and "rule manifests-agree failed" in done.stderr, done.stderr
    os.rename(lone, lone.with_name("worker-0-of-1"))
    assert run_cli("verify", lone.with_name("worker-0-of-1"), "--state-root", captured_2layer.state_root).returncode == 0


def test_unlisted_capsule_folder_named_directly_is_refused(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches pins skipped for a capsule inside an artifact by naming the folder instead of the
    artifact: an unlisted capsule folder there exits 4 (rule artifact), an unpinned edit exits 2."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    stale = captured.artifact_dir / "workers" / "worker-0-of-2"
    shutil.copytree(captured.capsule_dir, stale)
    done = run_cli("verify", stale, "--state-root", captured.state_root)
    assert done.returncode == 4 and "rule artifact failed" in done.stderr, done.stderr
    edit_json(captured.recovery_path, lambda d: d["model"].update(source="elsewhere"))
    done = run_cli("verify", captured.capsule_dir, "--state-root", captured.state_root)
    assert done.returncode == 2 and "rule capsule-pin failed" in done.stderr, done.stderr


def test_capture_with_another_world_size_removes_the_old_world(
    staged_2layer: Slabs, captured_2layer: Captured, tmp_path: Path
) -> None:
    """QA defect 6a: rank 0 of 2 captured into an artifact holding ``worker-0-of-1`` left the old folder,
    and verify exited 4 on a fresh capture. Now the old world's entries and capsule folders go, and
    the artifact verifies."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    capture(
        captured.root, staged_2layer.allocation_map, staged_2layer.allocations, staged_2layer.model_ranges, worker=RANKS_OF_2[0]
    )
    assert sorted(p.name for p in (captured.artifact_dir / "workers").iterdir() if not p.name.startswith(".")) == [
        "worker-0-of-2"
    ]
    assert [e.capsule for e in read_descriptor(captured.artifact_dir).workers] == ["workers/worker-0-of-2"]
    done = run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root)
    assert done.returncode == 0, done.stderr
    # Rank 1 of the same world joins without touching rank 0.
    capture(
        captured.root, staged_2layer.allocation_map, staged_2layer.allocations, staged_2layer.model_ranges, worker=RANKS_OF_2[1]
    )
    assert [e.capsule for e in read_descriptor(captured.artifact_dir).workers] == [
        "workers/worker-0-of-2",
        "workers/worker-1-of-2",
    ]
    assert run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root).returncode == 0


KILLED_WRITER = """
import sys, time
from pathlib import Path
from coldsnap_core.artifact.capsules import write_capsule
from coldsnap_core.format.manifest import WorkerIdentity

def fill(staging):
    (staging / "weights.blob").write_bytes(b"half a capsule")
    print("filling", flush=True)
    time.sleep(600)

write_capsule(Path(sys.argv[1]), WorkerIdentity("worker", 0, 1, 0, 1), fill)
"""


def test_killed_capsule_write_leaves_debris_that_the_next_capture_sweeps(
    staged_2layer: Slabs, captured_2layer: Captured, tmp_path: Path
) -> None:
    """QA defect 6b: ``kill -9`` during the capsule write left ``workers/.worker-0-of-1.<hex>.partial/``
    forever. A real writer process is killed while it fills its staging folder; the next capture of
    that capsule (holding the capsule's lock) removes the debris, and leaves another capsule's alone."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    workers = captured.artifact_dir / "workers"
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(captured.artifact_dir)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "filling"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    debris = sorted(p.name for p in workers.glob(".worker-0-of-1.*.partial"))
    assert len(debris) == 1
    other = workers / ".worker-1-of-2.0123456789abcdef.partial"
    other.mkdir()
    capture(captured.root, staged_2layer.allocation_map, staged_2layer.allocations, staged_2layer.model_ranges)
    assert not list(workers.glob(".worker-0-of-1.*.partial")) and not list(workers.glob(".worker-0-of-1.*.old"))
    assert other.is_dir()
    assert run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root).returncode == 0


def test_capture_warns_when_model_bytes_are_few(staged_2layer: Slabs, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """QA defect 10: a capture whose model bytes were 0 (``--dtype float32`` of a bf16 checkpoint: every
    copy converts) said so only at INFO. Now one WARNING names the byte split and the likely cause;
    the normal capture of the same slabs logs none."""
    with caplog.at_level(logging.INFO, logger="coldsnap_core.capture.worker"):
        capture(tmp_path / "normal", staged_2layer.allocation_map, staged_2layer.allocations, staged_2layer.model_ranges)
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        few = capture(tmp_path / "few", staged_2layer.allocation_map, staged_2layer.allocations, ())
    # One record may reach pytest's capture twice once vLLM has configured logging in this process.
    (warning,) = {r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING}
    assert few.manifest.model_bytes == 0
    assert f"only 0 of {staged_2layer.allocation_map.total_bytes} allocation bytes" in warning
    assert "converted the checkpoint's dtype" in warning and "converted_copies=residual" in warning


def test_capture_refuses_addresses_that_do_not_fit_the_capture_point(staged_2layer: Slabs, tmp_path: Path) -> None:
    """QA defect 8, at the writer: a portable capture with addresses, or a native one without, is an
    ObserverError before anything is written (the reader refuses both as ManifestValueError)."""
    with_addresses = AllocationMap(
        tuple(
            a.__class__(a.index, a.size_bytes, a.tag, live.address, a.tensors)
            for a, live in zip(staged_2layer.allocation_map.allocations, staged_2layer.allocations, strict=True)
        )
    )
    for allocation_map, point in ((with_addresses, "portable"), (staged_2layer.allocation_map, "native")):
        root = tmp_path / point
        with pytest.raises(ObserverError, match=f"the {point} capture point records"):
            capture(root, allocation_map, staged_2layer.allocations, staged_2layer.model_ranges, capture_point=point)
        assert not root.exists()


# --- QA pass 2 (helper-8): hostile files at document paths, messages, CLI targets -----------------


def _state_root_option(command: str, captured: Captured) -> tuple[str, ...]:
    return () if command == "inspect" else ("--state-root", str(captured.state_root))


@pytest.mark.parametrize("name", ["native-manifest.json", "recovery-manifest.json", "artifact.json"])
@pytest.mark.parametrize("command", ["verify", "inspect", "stage"])
def test_named_pipe_at_a_document_is_refused_not_waited_on(
    captured_2layer: Captured, tmp_path: Path, name: str, command: str
) -> None:
    """Catches a document opened without checking what it is: a named pipe at a manifest or at
    ``artifact.json`` made verify, inspect, stage and a restore hang forever (or, for artifact.json,
    exit 3 "nothing here"). It is rule regular-file (exit 4), naming the file, and nothing waits."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    fifo = (captured.artifact_dir if name == "artifact.json" else captured.capsule_dir) / name
    fifo.unlink()
    os.mkfifo(fifo)
    done = run_cli_process(command, captured.artifact_dir, *_state_root_option(command, captured))
    assert done.returncode == 4 and "rule regular-file failed" in done.stderr, done.stderr
    assert str(fifo) in done.stderr


def test_a_huge_pinned_manifest_is_refused_by_its_size_unread(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches a manifest read whole before its pin is compared: a 3 GiB (sparse) native manifest made
    verify allocate 3 GiB. Its size differs from the pin, which is checked on ``fstat`` before any
    read: capsule-pin (exit 2) naming both sizes."""
    from coldsnap_core.artifact.capsules import read_worker_capsule
    from coldsnap_core.errors import CapsulePinMismatchError

    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    os.truncate(captured.manifest_path, 3 << 30)
    (entry,) = read_descriptor(captured.artifact_dir).workers
    with pytest.raises(CapsulePinMismatchError, match=f"is {3 << 30} bytes; artifact.json pins"):
        read_worker_capsule(captured.artifact_dir, entry)


def test_a_lone_document_above_the_size_limit_is_refused_unread(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches an unbounded read of an unpinned document (a lone capsule): one larger than
    MAX_DOCUMENT_BYTES (sparse) is manifest-json (exit 2) before it is read."""
    from coldsnap_core.format._strict import MAX_DOCUMENT_BYTES

    lone = tmp_path / "lone" / "worker-0-of-1"
    shutil.copytree(captured_2layer.capsule_dir, lone)
    os.truncate(lone / "native-manifest.json", MAX_DOCUMENT_BYTES + 1)
    done = run_cli_process("verify", lone, "--state-root", captured_2layer.state_root)
    assert done.returncode == 2 and "rule manifest-json failed" in done.stderr, done.stderr
    assert f"more than the {MAX_DOCUMENT_BYTES} bytes" in done.stderr


def test_an_artifact_without_workers_is_malformed(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches ``stage`` reporting success (exit 0, "0 worker(s) staged") for an artifact.json whose
    ``workers`` list is empty: the document is malformed (exit 2) for every command."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    edit_json(captured.artifact_dir / "artifact.json", lambda d: d.update(workers=[]))
    for command in ("stage", "verify", "inspect"):
        done = run_cli(command, captured.artifact_dir, *_state_root_option(command, captured))
        assert done.returncode == 2 and "workers is empty" in done.stderr, (command, done.stderr)


def test_artifact_json_itself_is_a_valid_target(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches ``coldsnap verify ART/artifact.json`` being refused as "no artifact.json here" (exit 3):
    the descriptor file names its artifact, for verify, inspect, stage and publish-native alike."""
    target = captured_2layer.artifact_dir / "artifact.json"
    for command in ("verify", "inspect", "stage"):
        done = run_cli(command, target, *_state_root_option(command, captured_2layer))
        assert done.returncode == 0, (command, done.stderr)
    store = tmp_path / "store"
    done = run_cli("publish-native", target, "--repo", store, "--state-root", captured_2layer.state_root)
    assert done.returncode == 0, done.stderr
    assert (store / captured_2layer.manifest.pack.path).is_file()


def test_stage_names_artifact_json_for_a_pack_path_not_derived_from_the_digest(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches ``stage`` blaming a relative traversal path (``[file=model-payloads/sha256/../..]``) for
    rule pack-path: the error names the artifact.json that holds the path (exit 1), before any store
    or cache path is built from it."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    bad = "model-payloads/sha256/../../../../etc/passwd"
    edit_json(captured.manifest_path, lambda d: d["pack"].update(path=bad))
    edit_json(captured.artifact_dir / "artifact.json", lambda d: d["workers"][0]["payload"].update(path=bad))
    repin(captured)
    done = run_cli("stage", captured.artifact_dir, "--state-root", captured.state_root)
    assert done.returncode == 1 and "rule pack-path failed" in done.stderr, done.stderr
    assert f"file={captured.artifact_dir / 'artifact.json'}" in done.stderr


def test_mismatch_messages_say_what_differs(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches messages that hide the difference: a pack path that differs between artifact.json and
    the manifest is shown (both sides printed identical digests before); a wrong blob pin is shown as
    size and digest, not a Python repr; manifests that disagree name the differing field."""
    from coldsnap_core.artifact.capsules import read_capsule, read_worker_capsule
    from coldsnap_core.errors import CapsulePinMismatchError, ManifestMismatchError

    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    edit_json(captured.artifact_dir / "artifact.json", lambda d: d["workers"][0]["payload"].update(path="elsewhere.pack"))
    (entry,) = read_descriptor(captured.artifact_dir).workers
    with pytest.raises(ManifestMismatchError, match=re.escape("path 'elsewhere.pack'")):
        read_worker_capsule(captured.artifact_dir, entry)

    captured = copy_capture(captured_2layer, tmp_path / "copy2", copy_pack=False)
    edit_json(captured.artifact_dir / "artifact.json", lambda d: d["workers"][0]["capsule_files"][3].update(sha256="0" * 64))
    (entry,) = read_descriptor(captured.artifact_dir).workers
    with pytest.raises(CapsulePinMismatchError, match=f"pins 12672 bytes with SHA-256 {'0' * 64} for the residual blob") as info:
        read_worker_capsule(captured.artifact_dir, entry)
    assert "CapsuleFile(" not in str(info.value)

    edit_json(captured.recovery_path, lambda d: d.update(layout_fingerprint="1" * 64))
    with pytest.raises(ManifestMismatchError, match=r"disagree on layout_fingerprint\b(?!,)"):
        read_capsule(captured.capsule_dir)


def test_version_and_usage_messages() -> None:
    """Catches a missing ``--version`` (exit 4, "COMMAND required") and an internal function name in a
    usage error (``invalid _seconds value``) of cache gc's ``--older-than`` and export's ``--timeout``/``--grace``,
    and an export timeout of 0 s taken."""
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.startswith("coldsnap ") and "artifact format 9" in done.stdout
    done = run_cli("cache", "gc", "--older-than", "abc")
    assert done.returncode == 4 and "'abc' is not a number of seconds" in done.stderr and "_seconds" not in done.stderr
    for option in ("--timeout", "--grace"):
        done = run_cli("export", option, "abc", "--", "true")
        assert done.returncode == 4 and "'abc' is not a number of seconds" in done.stderr and "_seconds" not in done.stderr
    done = run_cli("export", "--timeout", "0", "--", "true")
    assert done.returncode == 4 and "'0' is not a number of seconds > 0" in done.stderr


@pytest.mark.parametrize("where", ["artifact.json", "capsule folder"])
def test_a_symbolic_link_loop_is_an_io_error_not_a_missing_object(captured_2layer: Captured, tmp_path: Path, where: str) -> None:
    """Catches a link loop reported as "does not exist" (exit 3, as if the artifact were simply
    absent): a loop at artifact.json or at the capsule folder is rule io (exit 4), like one at a
    manifest (QA pass 3, defect 5)."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    path = captured.artifact_dir / "artifact.json" if where == "artifact.json" else captured.capsule_dir
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.symlink_to(path.name)  # points at itself
    done = run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root)
    assert done.returncode == 4 and "rule io failed" in done.stderr, done.stderr


def test_a_socket_at_a_document_is_not_a_regular_file(captured_2layer: Captured, tmp_path: Path, monkeypatch) -> None:
    """Catches a socket at a document reported as an I/O error (ENXIO from open, rule io): it is
    rule regular-file, like a folder or a named pipe there (QA pass 3, defect 6)."""
    import socket

    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    captured.recovery_path.unlink()
    monkeypatch.chdir(captured.capsule_dir)  # AF_UNIX paths are limited to 108 bytes
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(captured.recovery_path.name)
        done = run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root)
    assert done.returncode == 4 and "rule regular-file failed" in done.stderr, done.stderr
