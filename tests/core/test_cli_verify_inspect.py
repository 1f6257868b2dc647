"""The real ``coldsnap`` command line (its ``main``, in process; ``--help``, the console script and the
torch-free start as processes): ``--help``, ``inspect`` (text and ``--json``) and ``verify`` with its
documented exit code for every rule (0 verified, 1 content mismatch or corruption, 2 malformed or
unsupported manifest, 3 missing object, 4 other error)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from core_support import Captured, copy_capture, edit_json, flip_byte, repin, run_cli, run_cli_process

from coldsnap_core.digests import pack_relpath
from coldsnap_core.format.verify import check_manifest


def _both_manifests(edit: Callable[[dict], object]) -> Callable[[Captured], None]:
    """Apply the same edit to the native and the recovery manifest (so that they still agree)."""

    def corrupt(c: Captured) -> None:
        edit_json(c.manifest_path, edit)
        edit_json(c.recovery_path, edit)

    return corrupt


def _native(edit: Callable[[dict], object]) -> Callable[[Captured], None]:
    return lambda c: edit_json(c.manifest_path, edit)


def _repoint_pack(c: Captured, digest: str, *, path: str | None = None) -> None:
    """Make the native manifest and artifact.json name ``digest`` (and ``path``) as the payload."""

    def edit(ref: dict) -> None:
        ref["sha256"] = digest
        ref["path"] = path or pack_relpath(digest)

    edit_json(c.manifest_path, lambda d: edit(d["pack"]))
    edit_json(c.artifact_dir / "artifact.json", lambda d: edit(d["workers"][0]["payload"]))


def _pack_under_another_digest(c: Captured) -> None:
    """The real pack file, stored and named under a digest it does not have."""
    fake = "0" * 64
    os.link(c.pack_path, c.cache.object_path(fake))
    _repoint_pack(c, fake)


def _nonzero_padding(c: Captured) -> None:
    start, _ = next(iter(check_manifest(c.manifest).padding_ranges()))
    flip_byte(c.pack_path, start)


def _truncate(path_of: Callable[[Captured], Path]) -> Callable[[Captured], None]:
    def corrupt(c: Captured) -> None:
        path = path_of(c)
        os.chmod(path, 0o644)
        os.truncate(path, path.stat().st_size - 1)

    return corrupt


def _symlinked_pack(c: Captured) -> None:
    target = c.root / "elsewhere.pack"
    shutil.copy2(c.pack_path, target)
    c.pack_path.unlink()
    c.pack_path.symlink_to(target)


def _stale_capsule(c: Captured) -> None:
    shutil.copytree(c.capsule_dir, c.artifact_dir / "workers" / "worker-0-of-2")


def _swap_equal_sized_extents(doc: dict) -> None:
    """QA's attack: swap SHA-256, pack offset and provenance between two model extents of equal size
    (layer 0's and layer 1's ``gate_proj``): the manifest stays consistent with itself and with the
    pack, but each destination would receive the other layer's bytes."""
    by_name = {e["provenance"]["tensor_name"]: e for e in doc["model_extents"]}
    a, b = by_name["model.layers.0.mlp.gate_proj.weight"], by_name["model.layers.1.mlp.gate_proj.weight"]
    assert a["size_bytes"] == b["size_bytes"] and a["sha256"] != b["sha256"]
    for key in ("sha256", "pack_offset_bytes", "provenance"):
        a[key], b[key] = b[key], a[key]


def _as_another_world(doc: dict) -> None:
    doc["worker"].update(world_size=2, tensor_parallel_size=2)


def _model_files(edit: Callable[[list], object]) -> Callable[[Captured], None]:
    """Apply ``edit`` to ``model.files`` in the recovery manifest and in artifact.json alike."""

    def corrupt(c: Captured) -> None:
        edit_json(c.recovery_path, lambda d: edit(d["model"]["files"]))
        edit_json(c.artifact_dir / "artifact.json", lambda d: edit(d["model"]["files"]))

    return corrupt


def _native_without_addresses(doc: dict) -> None:
    doc["capture_point"] = "native"  # the allocations keep their portable tags and null addresses


def _symlinked_cache_folder(name: str) -> Callable[[Captured], None]:
    def corrupt(c: Captured) -> None:
        folder = c.state_root / "model-payloads"
        folder = folder / "sha256" if name == "sha256" else folder
        target = c.root / f"moved-{name}"
        os.rename(folder, target)
        folder.symlink_to(target)

    return corrupt


@dataclass(frozen=True)
class Case:
    id: str
    corrupt: Callable[[Captured], None]
    code: int
    rule: str
    copy_pack: bool = False
    names_extent: bool = False
    repin: bool = True
    """Rewrite artifact.json's pins after the edit (so the rule behind the pins is what is tested)."""


CASES = [
    Case(
        "gap",
        _both_manifests(lambda d: d["residual_extents"].pop(2)),
        2,
        "maps-cover-allocation",
        names_extent=True,
    ),
    Case(
        "overlap",
        _both_manifests(lambda d: d["residual_extents"][0].update(size_bytes=d["residual_extents"][0]["size_bytes"] + 2)),
        2,
        "maps-disjoint",
        names_extent=True,
    ),
    Case(
        "allocation-size-change",
        _both_manifests(lambda d: d["allocations"][3].update(size_bytes=d["allocations"][3]["size_bytes"] + 1)),
        2,
        "layout-fingerprint",
    ),
    Case(
        "out-of-bounds-extent",
        _native(lambda d: d["model_extents"][-1].update(offset_bytes=d["allocations"][-1]["size_bytes"])),
        2,
        "extent-within-allocation",
        names_extent=True,
    ),
    Case(
        "unsorted-extents",
        _native(lambda d: d["model_extents"].insert(0, d["model_extents"].pop(1))),
        2,
        "extent-order",
        names_extent=True,
    ),
    Case(
        "non-canonical-pack-offset",
        _native(lambda d: d["model_extents"][2].update(pack_offset_bytes=d["model_extents"][2]["pack_offset_bytes"] + 4096)),
        2,
        "pack-canonical-layout",
        names_extent=True,
    ),
    Case("unknown-version", _native(lambda d: d.update(format_version=10)), 2, "format-version"),
    Case("mistyped-field", _native(lambda d: d["pack"].update(size_bytes=True)), 2, "manifest-schema"),
    Case("negative-offset", _native(lambda d: d["model_extents"][0].update(offset_bytes=-1)), 2, "manifest-value"),
    Case("malformed-json", lambda c: c.manifest_path.write_text("{"), 2, "manifest-json"),
    Case(
        "path-mismatch",
        lambda c: _repoint_pack(c, c.manifest.pack.sha256, path=pack_relpath("1" * 64)),
        1,
        "pack-path",
    ),
    Case("digest-mismatch", _pack_under_another_digest, 1, "pack-sha256"),
    Case("non-zero-padding", _nonzero_padding, 1, "pack-padding-zero", copy_pack=True),
    Case(
        "extent-digest-mismatch",
        lambda c: flip_byte(c.pack_path, c.manifest.model_extents[4].pack_offset_bytes + 1),
        1,
        "extent-sha256",
        copy_pack=True,
        names_extent=True,
    ),
    Case("truncated-pack", _truncate(lambda c: c.pack_path), 1, "pack-size", copy_pack=True),
    Case("truncated-blob", _truncate(lambda c: c.blob_path), 1, "residual-size"),
    Case("blob-byte-flipped", lambda c: flip_byte(c.blob_path, 0), 1, "residual-sha256"),
    Case("missing-pack", lambda c: c.pack_path.unlink(), 3, "object-present"),
    Case("missing-blob", lambda c: c.blob_path.unlink(), 3, "object-present"),
    Case("missing-recovery-manifest", lambda c: c.recovery_path.unlink(), 3, "object-present"),
    Case(
        "descriptor-disagrees-with-capsule",
        lambda c: edit_json(c.artifact_dir / "artifact.json", lambda d: d["workers"][0]["payload"].update(size_bytes=0)),
        2,
        "manifests-agree",
    ),
    Case(
        "native-and-recovery-disagree",
        _native(lambda d: d["residual_extents"].pop(2)),
        2,
        "manifests-agree",
    ),
    Case("symlinked-pack", _symlinked_pack, 4, "no-symlinks"),
    Case("stale-capsule", _stale_capsule, 4, "artifact"),
    # artifact.json pins each capsule's files (QA defect 1): an unpinned edit of either manifest, even
    # one that keeps the capsule consistent with itself and with its pack, is refused.
    Case("self-consistent-extent-swap", _native(_swap_equal_sized_extents), 2, "capsule-pin", repin=False),
    Case(
        "recovery-manifest-edited",
        lambda c: edit_json(c.recovery_path, lambda d: d["residual_extents"][0].update(size_bytes=1)),
        2,
        "capsule-pin",
        repin=False,
    ),
    Case(
        "residual-pin-disagrees",
        lambda c: edit_json(
            c.artifact_dir / "artifact.json", lambda d: d["workers"][0]["capsule_files"][3].update(sha256="0" * 64)
        ),
        2,
        "capsule-pin",
        repin=False,
    ),
    # The worker of the descriptor entry, the folder name and the manifests agree (QA defect 4b).
    Case("manifests-of-another-world", _both_manifests(_as_another_world), 2, "manifests-agree"),
    # Malformed content (QA defect 8).
    Case("native-capture-point-without-addresses", _native(_native_without_addresses), 2, "manifest-value"),
    Case("model-file-name-escapes", _model_files(lambda f: f[0].update(name="../../etc/passwd")), 2, "manifest-value"),
    Case("model-file-name-absolute", _model_files(lambda f: f[0].update(name="/etc/passwd")), 2, "manifest-value"),
    Case("model-files-empty", _model_files(lambda f: f.clear()), 2, "manifest-value"),
    Case("model-files-duplicate", _model_files(lambda f: f.append(dict(f[0]))), 2, "manifest-value"),
    Case(
        "provenance-not-in-model-identity",
        _native(lambda d: d["model_extents"][3]["provenance"].update(checkpoint_file="other.safetensors")),
        2,
        "manifests-agree",
        names_extent=True,
    ),
    # verify checks the cache folders as the cache commands do (QA defect 7).
    Case("symlinked-model-payloads-folder", _symlinked_cache_folder("model-payloads"), 4, "no-symlinks"),
    Case("symlinked-sha256-folder", _symlinked_cache_folder("sha256"), 4, "no-symlinks"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_verify_exit_code_and_message_for_each_rule(captured_2layer: Captured, tmp_path: Path, case: Case) -> None:
    """Catches a rule mapped to the wrong exit code, an exception escaping untyped (a traceback and
    exit 1 from Python), or a message that does not name the rule and file: ``coldsnap verify`` on
    the corrupted artifact exits with the documented code and prints ``rule <id> failed`` with the
    file (and allocation and offset for per-extent rules) on stderr, nothing on stdout."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=case.copy_pack)
    case.corrupt(captured)
    if case.repin:
        repin(captured)
    done = run_cli("verify", captured.artifact_dir, "--state-root", captured.state_root)
    assert done.returncode == case.code, done.stderr
    assert f"rule {case.rule} failed" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert "file=" in done.stderr and str(tmp_path / "copy") in done.stderr
    if case.names_extent:
        assert "allocation=" in done.stderr and "offset_bytes=" in done.stderr, done.stderr
    assert "verified" not in done.stdout


def test_verify_passes_on_a_good_capture_for_each_target_form(captured_2layer: Captured) -> None:
    """Catches a broken happy path: the artifact folder, the capsule folder and the native manifest
    each verify with exit code 0, naming the pack digest; verify writes nothing."""
    before = sorted(p.name for p in captured_2layer.state_root.rglob("*"))
    digest = captured_2layer.manifest.pack.sha256
    for target in (captured_2layer.artifact_dir, captured_2layer.capsule_dir, captured_2layer.manifest_path):
        done = run_cli("verify", target, "--state-root", captured_2layer.state_root)
        assert done.returncode == 0, done.stderr
        assert f"worker-0-of-1: verified pack {digest}" in done.stdout
        assert "ok: 1 worker(s), 1 distinct payload(s)" in done.stderr
    assert sorted(p.name for p in captured_2layer.state_root.rglob("*")) == before


def test_verify_reads_the_state_root_from_the_environment(captured_2layer: Captured) -> None:
    """Catches ``--state-root`` being the only way to find packs (COLDSNAP_STATE_ROOT is documented)."""
    done = run_cli("verify", captured_2layer.artifact_dir, env={"COLDSNAP_STATE_ROOT": str(captured_2layer.state_root)})
    assert done.returncode == 0, done.stderr


def test_verify_of_a_missing_artifact_is_exit_3(tmp_path: Path) -> None:
    """Catches a missing target reported as a crash or as another family."""
    done = run_cli("verify", tmp_path / "nothing", "--state-root", tmp_path)
    assert done.returncode == 3 and "rule object-present failed" in done.stderr


def test_help_lists_the_commands_and_exit_codes() -> None:
    """Catches a broken ``python -m coldsnap_core.cli.main`` entry point or undocumented exit codes."""
    done = run_cli_process("--help")
    assert done.returncode == 0
    assert "inspect" in done.stdout and "verify" in done.stdout
    assert "3 missing object" in " ".join(done.stdout.split())
    verify_help = run_cli("verify", "--help")
    assert verify_help.returncode == 0 and "--state-root" in verify_help.stdout
    assert "2 malformed or unsupported manifest" in " ".join(verify_help.stdout.split())


def test_console_script_runs(captured_2layer: Captured) -> None:
    """Catches a missing or broken ``coldsnap`` console script in the environment."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "coldsnap"
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (not installed in this environment)")
    done = subprocess.run([script, "inspect", captured_2layer.artifact_dir], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and captured_2layer.manifest.pack.sha256 in done.stdout


def test_inspect_json_summarizes_the_capture(captured_2layer: Captured) -> None:
    """Catches wrong byte accounting in ``inspect --json``: allocations, model vs residual bytes (which
    add up to the allocation bytes), the pack digest, stored extents and the provenance summary."""
    done = run_cli("inspect", captured_2layer.artifact_dir, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    manifest = captured_2layer.manifest
    assert doc["distinct_payloads"] == [manifest.pack.sha256]
    (worker,) = doc["workers"]
    assert worker["capsule"] == "worker-0-of-1" and worker["capture_point"] == "portable"
    assert worker["allocations"] == 4 and worker["tensors"] == 20
    assert worker["model_bytes"] + worker["residual_bytes"] == worker["allocation_bytes"] == manifest.allocations.total_bytes
    assert worker["model_bytes"] == 70_784_640  # every tensor byte of the 2-layer checkpoint
    assert worker["pack"] == {
        "sha256": manifest.pack.sha256,
        "size_bytes": manifest.pack.size_bytes,
        "path": manifest.pack.path,
        "stored_extents": 20,
        "stored_bytes": 70_784_640,
    }
    assert worker["provenance"] == {"model.safetensors": {"extents": 20, "bytes": 70_784_640, "dtype_converted": 0}}
    assert (
        doc["model"]["files"][0]["sha256"]
        == hashlib.sha256((Path(doc["model"]["source"]) / "model.safetensors").read_bytes()).hexdigest()
    )


def test_inspect_text_names_digest_and_byte_split(captured_2layer: Captured) -> None:
    """Catches a text summary missing the facts an operator looks for."""
    done = run_cli("inspect", captured_2layer.capsule_dir)
    assert done.returncode == 0, done.stderr
    assert captured_2layer.manifest.pack.sha256 in done.stdout
    assert "model bytes:" in done.stdout and "residual bytes:" in done.stdout and "provenance model.safetensors" in done.stdout


def test_inspect_of_a_bad_manifest_uses_the_same_exit_codes(captured_2layer: Captured, tmp_path: Path) -> None:
    """Catches ``inspect`` crashing instead of reporting: a newer format version exits 2, nothing exits 3."""
    captured = copy_capture(captured_2layer, tmp_path / "copy", copy_pack=False)
    edit_json(captured.manifest_path, lambda d: d.update(format_version=10))
    repin(captured)
    done = run_cli("inspect", captured.artifact_dir)
    assert done.returncode == 2 and "rule format-version failed" in done.stderr
    assert run_cli("inspect", tmp_path / "nothing").returncode == 3


def _commands() -> list[str]:
    """Every ``coldsnap`` subcommand the parser has (a new command is checked without being listed here)."""
    from coldsnap_core.cli.main import build_parser

    return sorted(next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices)


@pytest.mark.parametrize("command", _commands())
def test_a_command_that_needs_no_tensor_starts_without_torch(command: str, tmp_path: Path) -> None:
    """Parsing any command and running ``verify`` of a folder without an artifact import no torch (about
    2 s of start-up on this machine, and every test that runs the CLI paid it; ``pip install coldsnap`` has
    no torch at all: tests/core/test_install.py). Fails if a command module, or a module it imports at its
    top, imports torch again."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from coldsnap_core.cli.main import main\n"
        f"try:\n    main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
        f"main(['verify', {str(tmp_path)!r}])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.parametrize(
    ("document", "encode"),
    [
        ("recovery-manifest.json", "lone-surrogate"),
        ("target.json", "lone-surrogate"),
        ("recovery-manifest.json", "utf-8-bom"),
        ("recovery-manifest.json", "utf-16"),
    ],
)
def test_verify_and_inspect_refuse_a_document_that_is_not_utf8_text(
    captured_2layer: Captured, tmp_path: Path, document: str, encode: str
) -> None:
    """docs/format.md §4: every document is UTF-8 JSON. A re-pinned capsule document with a lone surrogate
    escape (``"\\ud800"``, valid JSON syntax, not text), a UTF-8 byte-order mark, or UTF-16 was accepted by
    ``verify`` (``json.loads`` of bytes takes all three) and crashed ``inspect`` with ``UnicodeEncodeError``.
    Both now refuse it with the ``manifest-json`` rule (exit 2) naming the file."""
    c = copy_capture(captured_2layer, tmp_path / "copy")
    path = c.capsule_dir / document
    text = path.read_text(encoding="utf-8")
    if encode == "lone-surrogate":
        doc = json.loads(text)
        key = "model" if "model" in doc else sorted(k for k, v in doc.items() if isinstance(v, str) and k != "format")[0]
        if key == "model":
            doc["model"]["source"] = "\ud800-model"
        else:
            doc[key] = "\ud800" + doc[key]
        path.write_bytes((json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=True) + "\n").encode("ascii"))
    elif encode == "utf-8-bom":
        path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    else:
        path.write_bytes(text.encode("utf-16"))
    repin(c)
    for command in ("verify", "inspect"):
        done = run_cli(command, c.artifact_dir)
        assert done.returncode == 2, (command, done.stdout[-2000:], done.stderr[-2000:])
        assert "manifest-json" in done.stderr and document in done.stderr, (command, done.stderr[-2000:])
        assert "Traceback" not in done.stderr


def test_an_artifact_json_over_its_cap_is_refused_before_it_is_parsed(captured_2layer: Captured, tmp_path: Path) -> None:
    """``artifact.json`` is the one document no pin bounds, and parsing JSON costs about 30 times its size
    (a 40 MiB descriptor took ``verify`` to 1.3 GB RSS): above ``MAX_DESCRIPTOR_BYTES`` (8 MiB) it is refused
    by its size alone, with ``manifest-json`` (exit 2) naming the file and the cap, whatever it contains; the
    same descriptor padded to just under the cap still verifies. Fails if the cap is raised or dropped."""
    from coldsnap_core.format._strict import MAX_DESCRIPTOR_BYTES

    c = copy_capture(captured_2layer, tmp_path / "copy")
    descriptor = c.artifact_dir / "artifact.json"
    text = descriptor.read_text(encoding="utf-8").rstrip("\n")
    descriptor.write_text(text + " " * (MAX_DESCRIPTOR_BYTES - len(text.encode()) - 1) + "\n", encoding="utf-8")
    assert descriptor.stat().st_size == MAX_DESCRIPTOR_BYTES
    ok = run_cli("verify", c.artifact_dir, "--state-root", c.state_root)
    assert ok.returncode == 0, ok.stderr[-2000:]
    descriptor.write_text(text + " " * MAX_DESCRIPTOR_BYTES + "\n", encoding="utf-8")
    done = run_cli("verify", c.artifact_dir, "--state-root", c.state_root)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "manifest-json" in done.stderr and f"more than the {MAX_DESCRIPTOR_BYTES} bytes" in done.stderr
    assert "artifact.json" in done.stderr


def test_inspect_without_torch_says_what_it_cannot_tell(captured_2layer: Captured) -> None:
    """Catches ``inspect`` on the slim install (no torch) ending in a raw ``ModuleNotFoundError``: with torch not
    importable it still prints the artifact (workers, digests, byte split), exit 0, and says which part it cannot
    tell (the capsule a restore on this node would use: no engine can run here) and what to install, instead of
    guessing; ``--json`` likewise."""
    import subprocess
    import sys

    script = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def no_torch(name, *args, **kwargs):\n"
        "    if name == 'torch' or name.startswith('torch.'):\n"
        "        raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = no_torch\n"
        "from coldsnap_core.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-c", script, "inspect", str(captured_2layer.artifact_dir), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "ModuleNotFoundError" not in done.stdout + done.stderr
        assert captured_2layer.result.manifest.pack.sha256 in done.stdout
        assert "no engine can run here" in done.stdout and "coldsnap[torch]" in done.stdout, done.stdout
