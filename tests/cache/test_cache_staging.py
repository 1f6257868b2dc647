"""Staging: from the cache, else from a real folder store, else PayloadUnavailableError."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
from cache_support import capture, flip_byte, sha256_of

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cache.records import record_state
from coldsnap_core.cli.stage_cmd import stage_entries
from coldsnap_core.errors import (
    ArtifactError,
    MissingObjectError,
    PackDigestMismatchError,
    PackPathMismatchError,
    PackSizeMismatchError,
    PayloadUnavailableError,
    StoreError,
    UnsafePathError,
)
from coldsnap_core.format.manifest import PackRef, WorkerIdentity
from coldsnap_core.restore.staging import stage_payload, worker_entries
from coldsnap_core.stores.local import LocalFolderStore


@pytest.fixture
def store(tmp_path: Path, captured) -> LocalFolderStore:
    """A real folder store holding the captured pack."""
    store = LocalFolderStore(tmp_path / "store")
    store.upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    return store


def test_stage_from_cache_uses_the_record(captured) -> None:
    """A cached pack with a trusted record is returned without hashing or touching a store."""
    hashed = []
    path = stage_payload(captured.pack, cache=PayloadCache(captured.capture_root), progress=hashed.append)
    assert path == captured.pack_path and hashed == []


def test_stage_from_folder_store(captured, store: LocalFolderStore, cache: PayloadCache) -> None:
    """Absent from the cache: fetched from the store, verified by the one verifier, committed with a
    trusted record, no temporary left; the fetch reports each byte once, as it is hashed (a progress that counted
    the bytes copied too showed twice the pack, at twice its rate)."""
    moved = []
    path = stage_payload(captured.pack, cache=cache, store=store, progress=moved.append)
    assert path == cache.object_path(captured.pack.sha256)
    assert sha256_of(path) == captured.pack.sha256
    assert record_state(cache, captured.pack.sha256) == "trusted"
    assert sum(moved) == captured.pack.size_bytes
    assert cache.temporaries() == []
    assert stage_payload(captured.pack, cache=cache, store=store) == path


def test_stage_without_any_source(captured, cache: PayloadCache, tmp_path: Path) -> None:
    """Neither cache nor store: PayloadUnavailableError (exit code 3, auto falls back), naming the object path."""
    with pytest.raises(PayloadUnavailableError, match="no payload store is configured") as info:
        stage_payload(captured.pack, cache=cache)
    assert info.value.file == str(cache.object_path(captured.pack.sha256))
    (tmp_path / "empty-store").mkdir()
    with pytest.raises(PayloadUnavailableError, match="does not hold the pack"):
        stage_payload(captured.pack, cache=cache, store=LocalFolderStore(tmp_path / "empty-store"))
    assert cache.digests() == []


def test_a_missing_store_folder_is_named_as_missing(captured, cache: PayloadCache, tmp_path: Path) -> None:
    """Catches a mistyped folder store reported as a store that "does not hold the pack": a store folder that does not
    exist is ``payload-store`` (``auto`` falls back) saying so, with the settings to check; a pull from it too."""
    missing = LocalFolderStore(tmp_path / "no-such-store")
    with pytest.raises(StoreError, match=r"payload store folder .*no-such-store does not exist") as info:
        stage_payload(captured.pack, cache=cache, store=missing)
    assert "does not hold" not in str(info.value) and "remedy: check the store path" in str(info.value)
    with pytest.raises(StoreError, match="does not exist"):
        missing.resolve_artifact("llama")
    assert cache.digests() == []


def test_corrupt_store_object_is_refused_and_nothing_kept(captured, store: LocalFolderStore, cache: PayloadCache) -> None:
    """A flipped byte in the store's copy: the verifier's PackDigestMismatchError, no eligible object,
    no temporary (catches staging that commits what it fetched without verifying it)."""
    flip_byte(store.object_path(captured.pack.sha256), 9000)
    with pytest.raises(PackDigestMismatchError):
        stage_payload(captured.pack, cache=cache, store=store)
    assert cache.digests() == [] and cache.temporaries() == []


def test_truncated_store_object_is_refused_before_copying(captured, store: LocalFolderStore, cache: PayloadCache) -> None:
    """A truncated store object fails on size first (OCI), before any byte is copied."""
    path = store.object_path(captured.pack.sha256)
    os.chmod(path, 0o644)
    os.truncate(path, 4096)
    with pytest.raises(PackSizeMismatchError, match="truncated"):
        stage_payload(captured.pack, cache=cache, store=store)
    assert cache.digests() == [] and cache.temporaries() == []


def test_corrupt_cached_object_is_repaired_from_the_store(captured, store: LocalFolderStore) -> None:
    """A corrupt cached pack is quarantined and replaced by the store's verified copy."""
    cache = PayloadCache(captured.capture_root)
    flip_byte(captured.pack_path, 12)
    path = stage_payload(captured.pack, cache=cache, store=store)
    assert sha256_of(path) == captured.pack.sha256
    assert len(cache.quarantined()) == 1
    assert record_state(cache, captured.pack.sha256) == "trusted"


def test_corrupt_cached_object_without_store_raises_the_verifiers_error(captured) -> None:
    """No store to repair from: the caller gets the verifier's error and the object is quarantined."""
    cache = PayloadCache(captured.capture_root)
    flip_byte(captured.pack_path, 12)
    with pytest.raises(PackDigestMismatchError):
        stage_payload(captured.pack, cache=cache)
    assert cache.digests() == []


def test_pack_path_must_be_derived_from_the_digest(captured, cache: PayloadCache, store) -> None:
    """A PackRef whose path is not model-payloads/sha256/<digest>.pack is refused before anything is read."""
    bad = msgspec.structs.replace(captured.pack, name="model-payloads/sha256/../../evil.pack")
    with pytest.raises(PackPathMismatchError):
        stage_payload(bad, cache=cache, store=store)
    assert not cache.state_root.exists()


def test_symlinked_store_object_is_refused(captured, store: LocalFolderStore, cache: PayloadCache, tmp_path: Path) -> None:
    """A link at the store's object path is refused (the store never follows links)."""
    path = store.object_path(captured.pack.sha256)
    real = tmp_path / "real.pack"
    os.rename(path, real)
    os.symlink(real, path)
    with pytest.raises(UnsafePathError):
        stage_payload(captured.pack, cache=cache, store=store)
    assert cache.digests() == []


def test_two_workers_sharing_a_digest_stage_it_once(tmp_path: Path, tiny_checkpoint: Path) -> None:
    """Two data-parallel workers with one digest (``coldsnap stage``'s ``stage_entries``): one staged path, the store
    asked for it, one object in the cache (catches the second worker's entry refused as a duplicate, or its pack
    staged under a second path)."""
    artifact = tmp_path / "dp"
    r0 = capture(tiny_checkpoint, artifact, tmp_path / "dp-root", rank=0, world_size=2)
    r1 = capture(tiny_checkpoint, artifact, tmp_path / "dp-root", rank=1, world_size=2, reverse=True)
    assert r0.manifest.pack == r1.manifest.pack
    store = LocalFolderStore(tmp_path / "store")
    store.upload(r0.pack_path, r0.manifest.pack.sha256, r0.manifest.pack.size_bytes)
    cache = PayloadCache(tmp_path / "host")
    fetched: set[str] = set()
    entries = worker_entries(artifact, [r0.manifest.worker, r1.manifest.worker])
    staged = stage_entries(entries, cache, store, fetched)
    assert list(staged) == [r0.manifest.pack.sha256] and fetched == {r0.manifest.pack.sha256}
    assert cache.digests() == [r0.manifest.pack.sha256]


# --- worker_entries ------------------------------------------------------------------------------------


def test_worker_entries_unknown_worker(captured, cache: PayloadCache) -> None:
    """A worker the artifact does not list: MissingObjectError naming its capsule."""
    with pytest.raises(MissingObjectError, match="worker-3-of-4"):
        worker_entries(captured.artifact_dir, [WorkerIdentity("worker", 3, 4, 3, 4)])


def test_worker_entries_descriptor_and_manifest_disagree(captured, cache: PayloadCache) -> None:
    """artifact.json naming another pack than the capsule's manifest is an ArtifactError; nothing staged."""
    path = captured.artifact_dir / "artifact.json"
    doc = json.loads(path.read_text())
    other = "f" * 64
    doc["workers"][0]["payload"] = PackRef.for_digest(other, captured.pack.size_bytes).to_json()
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError):
        worker_entries(captured.artifact_dir, [captured.manifest.worker])
    assert not cache.state_root.exists()
