"""Exit codes of ``coldsnap cache ls|verify|gc``, ``coldsnap stage`` and ``coldsnap publish-native``.

0 ok, 1 content mismatch or corruption, 2 malformed manifest, 3 missing object, 4 any other error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from cache_support import REPO, capture, child_command, flip_byte, run_child

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli.main import main
from coldsnap_core.stores.local import LocalFolderStore


def coldsnap(*args: str) -> int:
    return main([str(a) for a in args])


# --- cache ls -----------------------------------------------------------------------------------------


def test_cache_ls(captured, capsys) -> None:
    root = captured.capture_root
    assert coldsnap("cache", "ls", "--state-root", root) == 0
    out = capsys.readouterr().out
    assert f"{captured.pack.sha256}" in out and "trusted" in out
    assert coldsnap("cache", "ls", "--state-root", root, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    (listed,) = doc["objects"]
    assert listed.pop("verified_at") is not None and 0 <= listed.pop("verified_age_s") < 3600
    assert listed.pop("last_used_at") is not None and 0 <= listed.pop("last_used_age_s") < 3600  # committed just now
    assert listed.pop("in_use") is False and listed.pop("artifacts") == []  # no load, no outcome log
    assert listed == {"digest": captured.pack.sha256, "size_bytes": captured.pack.size_bytes, "record": "trusted"}
    assert doc["temporaries"] == doc["quarantined"] == doc["foreign"] == []


def test_cache_ls_shows_untrusted_and_unsafe(captured, capsys, tmp_path: Path) -> None:
    cache = PayloadCache(captured.capture_root)
    os.chmod(cache.record_path(captured.pack.sha256), 0o666)
    assert coldsnap("cache", "ls", "--state-root", captured.capture_root) == 0
    assert "untrusted: record mode" in capsys.readouterr().out
    other = cache.objects_dir / f"{'c' * 64}.pack"
    os.symlink(captured.pack_path, other)
    assert coldsnap("cache", "ls", "--state-root", captured.capture_root, "--json") == 0
    states = {o["digest"]: o["record"] for o in json.loads(capsys.readouterr().out)["objects"]}
    assert states["c" * 64].startswith("unsafe:")


def test_cache_ls_refuses_a_symlinked_folder(captured, tmp_path: Path, capsys) -> None:
    """Exit 4 when a cache folder is a symbolic link."""
    objects = captured.capture_root / "model-payloads" / "sha256"
    os.rename(objects, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", objects)
    assert coldsnap("cache", "ls", "--state-root", captured.capture_root) == 4
    assert "rule no-symlinks" in capsys.readouterr().err


@pytest.mark.parametrize("action", [("ls",), ("verify",), ("gc",), ("rm", "0" * 64)])
def test_a_cache_action_on_a_missing_state_root_says_it_is_missing(tmp_path: Path, capsys, action) -> None:
    """Catches ``cache ls`` on a mistyped state root printing "0 objects" (and the other actions acting on nothing):
    a state root that does not exist is named as missing, exit 3, with the settings to check; nothing is created.
    An existing empty state root lists 0 objects."""
    assert coldsnap("cache", *action, "--state-root", tmp_path / "none") == 3
    err = capsys.readouterr().err
    assert f"the state root {tmp_path / 'none'} does not exist" in err and "remedy: check --state-root" in err
    assert not (tmp_path / "none").exists()
    (tmp_path / "empty").mkdir()
    if action == ("ls",):
        assert coldsnap("cache", "ls", "--state-root", tmp_path / "empty") == 0
        assert "0 object(s)" in capsys.readouterr().out


# --- cache verify --------------------------------------------------------------------------------------


def test_cache_verify_ok(captured, capsys) -> None:
    assert coldsnap("cache", "verify", "--state-root", captured.capture_root) == 0
    assert "trusted validation record" in capsys.readouterr().out
    assert coldsnap("cache", "verify", "--full", captured.pack.sha256, "--state-root", captured.capture_root) == 0
    assert "full SHA-256" in capsys.readouterr().out


def test_cache_verify_corrupt_exits_1_and_quarantines(captured, capsys) -> None:
    """A flipped byte (mtime moved) is caught: exit 1, the object is quarantined."""
    flip_byte(captured.pack_path, 33)
    assert coldsnap("cache", "verify", "--state-root", captured.capture_root) == 1
    assert "rule pack-sha256 failed" in capsys.readouterr().err
    assert PayloadCache(captured.capture_root).digests() == []


def test_cache_verify_full_catches_what_the_record_cannot(captured) -> None:
    """``--full`` ignores the record: an edit re-bound into the record is still caught (exit 1)."""
    from coldsnap_core.cache.records import write_record

    cache = PayloadCache(captured.capture_root)
    flip_byte(captured.pack_path, 33)
    write_record(cache, captured.pack.sha256, os.lstat(captured.pack_path))
    assert coldsnap("cache", "verify", "--state-root", captured.capture_root) == 0
    assert coldsnap("cache", "verify", "--full", "--state-root", captured.capture_root) == 1


def _age_record(cache: PayloadCache, digest: str, verified_at: str) -> None:
    """Rewrite the object's validation record with another ``verified_at`` (the same binding): a
    record written by a full verification long ago."""

    from coldsnap_core.cache.records import ValidationRecord, read_trusted_record
    from coldsnap_core.format._strict import dump_document

    record = read_trusted_record(cache, digest)
    old = msgspec.structs.replace(record, verified_at=verified_at)
    path = cache.record_path(digest)
    os.chmod(path, 0o644)
    path.write_bytes(dump_document(old.to_json()))
    os.chmod(path, 0o444)
    assert isinstance(record, ValidationRecord)


def test_same_stat_corruption_of_a_cached_pack_is_served(captured, capsys) -> None:
    """Reliability defect: a pack byte changed with device, inode, size, mtime and ctime unchanged (bit
    rot; simulated by re-binding the record to the edited file) passes ``cache verify`` on the record
    fast path, which stays. The policy: ``cache ls`` shows when each object was last fully verified
    (``verified_at``, ``verified_age_s``), ``cache verify --full`` is the scrub that refreshes it, and a
    scrub that finds corruption quarantines the object. Fails if ``cache ls`` does not show the age, if
    ``--full`` leaves the age, or if the corrupt object stays eligible."""
    from coldsnap_core.cache.records import write_record

    root, digest = captured.capture_root, captured.pack.sha256
    cache = PayloadCache(root)
    _age_record(cache, digest, "2000-01-01T00:00:00+00:00")
    assert coldsnap("cache", "ls", "--state-root", root, "--json") == 0
    (listed,) = json.loads(capsys.readouterr().out)["objects"]
    assert listed["verified_at"] == "2000-01-01T00:00:00+00:00" and listed["verified_age_s"] > 20 * 365 * 86400
    assert coldsnap("cache", "ls", "--state-root", root) == 0
    assert "last fully verified 2000-01-01T00:00:00+00:00" in capsys.readouterr().out
    assert coldsnap("cache", "verify", "--full", "--state-root", root) == 0  # the scrub refreshes the age
    capsys.readouterr()
    assert coldsnap("cache", "ls", "--state-root", root, "--json") == 0
    (listed,) = json.loads(capsys.readouterr().out)["objects"]
    assert listed["verified_at"] != "2000-01-01T00:00:00+00:00" and 0 <= listed["verified_age_s"] < 3600
    flip_byte(captured.pack_path, 33)
    write_record(cache, digest, os.lstat(captured.pack_path))  # the edit the record cannot see
    assert coldsnap("cache", "verify", "--state-root", root) == 0  # the fast path is kept
    capsys.readouterr()
    assert coldsnap("cache", "verify", "--full", "--state-root", root) == 1
    assert "rule pack-sha256 failed" in capsys.readouterr().err
    assert cache.digests() == [] and len(cache.quarantined()) == 1


def test_cache_verify_missing_digest_exits_3(captured) -> None:
    assert coldsnap("cache", "verify", "0" * 64, "--state-root", captured.capture_root) == 3


@pytest.mark.parametrize("digest", ["../x", "F" * 64])
def test_cache_verify_invalid_digest_exits_4_without_touching_files(tmp_path: Path, digest: str, capsys) -> None:
    assert coldsnap("cache", "verify", digest, "--state-root", tmp_path / "untouched") == 4
    assert "rule digest-form failed" in capsys.readouterr().err
    assert not (tmp_path / "untouched").exists()


# --- cache gc -----------------------------------------------------------------------------------------


def test_cache_gc(captured, tmp_path: Path, capsys) -> None:
    state = tmp_path / "state"
    rc, _, _ = run_child(child_command(captured.checkpoint, captured.artifact_dir, state, "--kill-at-byte", "5000"))
    assert rc == -9
    assert coldsnap("cache", "gc", "--state-root", state, "--older-than", "0", "--dry-run") == 0
    assert "would remove temporary" in capsys.readouterr().out
    assert coldsnap("cache", "gc", "--state-root", state, "--older-than", "0") == 0
    assert "removed temporary" in capsys.readouterr().out
    assert PayloadCache(state).temporaries() == []


def test_cache_gc_refuses_a_symlinked_folder(captured, tmp_path: Path) -> None:
    """Exit 4 when ``tmp/`` is a symbolic link: gc never deletes through a link."""
    tmp = captured.capture_root / "model-payloads" / "tmp"
    os.rename(tmp, tmp_path / "elsewhere")
    (tmp_path / "elsewhere" / "x.partial").write_bytes(b"keep")
    os.symlink(tmp_path / "elsewhere", tmp)
    assert coldsnap("cache", "gc", "--state-root", captured.capture_root, "--older-than", "0") == 4
    assert (tmp_path / "elsewhere" / "x.partial").exists()


def test_cache_gc_rejects_negative_age(tmp_path: Path) -> None:
    """A negative ``--older-than`` is a usage error: exit 4 ("other error"), never argparse's 2, which
    would read as "malformed manifest"; and nothing is created under the state root."""
    with pytest.raises(SystemExit) as info:
        coldsnap("cache", "gc", "--state-root", tmp_path / "root", "--older-than", "-1")
    assert info.value.code == 4
    assert not (tmp_path / "root").exists()


# --- stage --------------------------------------------------------------------------------------------


def test_stage_exit_codes(captured, tmp_path: Path, capsys) -> None:
    """0 staged from the store; 0 again from the cache; 3 unavailable; 3 unknown rank; 4 bad --repo."""
    store = tmp_path / "store"
    LocalFolderStore(store).upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    state = tmp_path / "state"
    assert coldsnap("stage", captured.artifact_dir, "--state-root", state, "--repo", store) == 0
    assert f"worker-0-of-1: {state}" in capsys.readouterr().out
    assert coldsnap("stage", captured.artifact_dir, "--rank", "0", "--state-root", state) == 0
    assert coldsnap("stage", captured.artifact_dir, "--state-root", tmp_path / "empty") == 3
    assert "rule payload-available failed" in capsys.readouterr().err
    assert coldsnap("stage", captured.artifact_dir, "--rank", "5", "--state-root", state) == 3
    assert coldsnap("stage", captured.artifact_dir, "--state-root", state, "--repo", "org/") == 4


def test_stage_names_the_store_only_when_it_sent_a_pack(captured, tmp_path: Path, capsys) -> None:
    """Catches ``staged (store: WRONG)`` for a pack the cache already held: the store a pack came from is named only
    when it sent one; staging again with a wrong store (one that does not even exist) says the pack was already
    cached and the store not contacted, and ``--json`` counts the fetched packs."""
    store = tmp_path / "store"
    LocalFolderStore(store).upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    state = tmp_path / "state"
    assert coldsnap("stage", captured.artifact_dir, "--state-root", state, "--repo", store) == 0
    assert f"1 distinct pack(s) staged: 1 fetched from folder {store}" in capsys.readouterr().err
    wrong = tmp_path / "wrong-store"
    assert coldsnap("stage", captured.artifact_dir, "--state-root", state, "--repo", wrong) == 0
    err = capsys.readouterr().err
    assert f"1 distinct pack(s) already cached, store not contacted (folder {wrong})" in err and "staged (store" not in err
    assert coldsnap("stage", captured.artifact_dir, "--state-root", state, "--repo", wrong, "--json") == 0
    assert json.loads(capsys.readouterr().out)["fetched_packs"] == 0


def test_stage_uses_the_environment(captured, tmp_path: Path, monkeypatch) -> None:
    store = tmp_path / "store"
    LocalFolderStore(store).upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    monkeypatch.setenv("COLDSNAP_PAYLOAD_DIR", str(store))
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", str(tmp_path / "env-state"))
    assert coldsnap("stage", captured.artifact_dir) == 0
    assert PayloadCache(tmp_path / "env-state").digests() == [captured.pack.sha256]


def test_stage_corrupt_store_object_exits_1(captured, tmp_path: Path) -> None:
    store = LocalFolderStore(tmp_path / "store")
    store.upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    flip_byte(store.object_path(captured.pack.sha256), 5000)
    assert coldsnap("stage", captured.artifact_dir, "--state-root", tmp_path / "s", "--repo", tmp_path / "store") == 1


def test_stage_malformed_manifest_exits_2(captured, tmp_path: Path) -> None:
    (captured.artifact_dir / "workers" / "worker-0-of-1" / "native-manifest.json").write_text("{")
    assert coldsnap("stage", captured.artifact_dir, "--state-root", tmp_path / "s") == 2


def test_stage_missing_artifact_exits_3(tmp_path: Path) -> None:
    assert coldsnap("stage", tmp_path / "no-artifact", "--state-root", tmp_path / "s") == 3


# --- publish-native -----------------------------------------------------------------------------------


def test_publish_native_exit_codes(captured, tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    """0 uploaded; 0 present on a second run (with another artifact sharing the digest); 0 dry run."""
    store = tmp_path / "store"
    other = tmp_path / "other"
    capture(tiny_checkpoint, other, captured.capture_root, reverse=True)
    root = captured.capture_root
    assert coldsnap("publish-native", captured.artifact_dir, "--repo", store, "--state-root", root, "--dry-run") == 0
    assert f"would-upload {captured.pack.sha256}" in capsys.readouterr().out
    assert not store.exists()
    assert coldsnap("publish-native", captured.artifact_dir, other, "--repo", store, "--state-root", root) == 0
    out = capsys.readouterr().out
    assert out.count("uploaded ") == 1
    assert coldsnap("publish-native", other, "--repo", store, "--state-root", root) == 0
    assert f"present {captured.pack.sha256}" in capsys.readouterr().out
    assert sorted(p.name for p in (store / "model-payloads" / "sha256").iterdir()) == [f"{captured.pack.sha256}.pack"]


def test_publish_native_corrupt_exits_1(captured, tmp_path: Path) -> None:
    flip_byte(captured.pack_path, 300)
    assert (
        coldsnap("publish-native", captured.artifact_dir, "--repo", tmp_path / "store", "--state-root", captured.capture_root)
        == 1
    )


def test_publish_native_missing_local_object_exits_3(captured, tmp_path: Path) -> None:
    assert coldsnap("publish-native", captured.artifact_dir, "--repo", tmp_path / "store", "--state-root", tmp_path / "e") == 3


def test_publish_native_malformed_manifest_exits_2(captured, tmp_path: Path) -> None:
    (captured.artifact_dir / "workers" / "worker-0-of-1" / "native-manifest.json").write_text("[]")
    assert (
        coldsnap("publish-native", captured.artifact_dir, "--repo", tmp_path / "store", "--state-root", captured.capture_root)
        == 2
    )


def test_publish_native_bad_repo_exits_4(captured) -> None:
    assert coldsnap("publish-native", captured.artifact_dir, "--repo", "not a repo") == 4


def test_publish_native_store_failure_exits_4(captured, tmp_path: Path) -> None:
    """A store folder that cannot be created (a file is in the way): StoreError, exit 4."""
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    assert (
        coldsnap("publish-native", captured.artifact_dir, "--repo", blocker / "store", "--state-root", captured.capture_root) == 4
    )


def test_console_script_wiring(captured) -> None:
    """The real entry point in a real process: ``python -m coldsnap_core.cli.main cache ls``."""
    proc = subprocess.run(
        [sys.executable, "-m", "coldsnap_core.cli.main", "cache", "verify", "--state-root", str(captured.capture_root)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert captured.pack.sha256 in proc.stdout
