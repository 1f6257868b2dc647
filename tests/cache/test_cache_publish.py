"""publish-native to a real folder store: each distinct digest once, paths from digests, verification first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cache_support import capture, flip_byte, sha256_of

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.digests import pack_relpath
from coldsnap_core.errors import (
    ArtifactError,
    ExtentDigestMismatchError,
    MissingObjectError,
    PackPathMismatchError,
)
from coldsnap_core.stores.local import LocalFolderStore
from coldsnap_core.stores.publish import collect_payloads, publish_native


@pytest.fixture
def two_artifacts(tmp_path: Path, tiny_checkpoint: Path):
    """Artifact A (worker 0 of 1) and artifact B (workers 0 and 1 of 2, reversed layouts): every
    worker's pack has the same digest, because the pack orders extents by content."""
    root = tmp_path / "root"
    a = capture(tiny_checkpoint, tmp_path / "a", root)
    b0 = capture(tiny_checkpoint, tmp_path / "b", root, rank=0, world_size=2, reverse=True)
    b1 = capture(tiny_checkpoint, tmp_path / "b", root, rank=1, world_size=2, slab_count=3)
    assert a.manifest.pack == b0.manifest.pack == b1.manifest.pack
    assert a.manifest.layout_fingerprint != b0.manifest.layout_fingerprint
    return tmp_path / "a", tmp_path / "b", root, a.manifest.pack


def store_objects(store_root: Path) -> list[str]:
    folder = store_root / "model-payloads" / "sha256"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_two_artifacts_sharing_a_digest_publish_it_once(two_artifacts, tmp_path: Path) -> None:
    """One call with both artifacts: one upload, owned by all three workers; the store shows one
    object at the digest's path, byte-identical to the local one."""
    a, b, root, pack = two_artifacts
    store = LocalFolderStore(tmp_path / "store")
    results = publish_native([a, b], store, PayloadCache(root))
    assert [(r.pack, r.action) for r in results] == [(pack, "uploaded")]
    assert len(results[0].owners) == 3
    assert store_objects(tmp_path / "store") == [f"{pack.sha256}.pack"]
    assert sha256_of(tmp_path / "store" / pack_relpath(pack.sha256)) == pack.sha256


def test_second_publication_skips_present_digests(two_artifacts, tmp_path: Path) -> None:
    """Publishing A then B (separate runs): B finds the digest present and uploads nothing."""
    a, b, root, pack = two_artifacts
    store = LocalFolderStore(tmp_path / "store")
    assert [r.action for r in publish_native([a], store, PayloadCache(root))] == ["uploaded"]
    mtime = os.stat(store.object_path(pack.sha256)).st_mtime_ns
    assert [r.action for r in publish_native([b], store, PayloadCache(root))] == ["present"]
    assert os.stat(store.object_path(pack.sha256)).st_mtime_ns == mtime
    assert store_objects(tmp_path / "store") == [f"{pack.sha256}.pack"]


def test_present_does_not_need_the_local_object(two_artifacts, tmp_path: Path) -> None:
    """A digest already in the store is skipped even when this host's cache no longer has it."""
    a, _, root, _pack = two_artifacts
    store = LocalFolderStore(tmp_path / "store")
    publish_native([a], store, PayloadCache(root))
    assert [r.action for r in publish_native([a], store, PayloadCache(tmp_path / "empty"))] == ["present"]


def test_dry_run_uploads_nothing(two_artifacts, tmp_path: Path) -> None:
    a, b, root, _ = two_artifacts
    store = LocalFolderStore(tmp_path / "store")
    assert [r.action for r in publish_native([a, b], store, PayloadCache(root), dry_run=True)] == ["would-upload"]
    assert not (tmp_path / "store").exists()


def test_corrupt_local_object_is_quarantined_and_not_published(two_artifacts, tmp_path: Path) -> None:
    """Publication verifies in full against the manifest's layout (not on the record's word): a
    flipped byte is reported as the extent that holds it, the object is quarantined, the store
    stays empty."""
    a, _, root, pack = two_artifacts
    cache = PayloadCache(root)
    flip_byte(cache.object_path(pack.sha256), 200)
    store = LocalFolderStore(tmp_path / "store")
    with pytest.raises(ExtentDigestMismatchError) as info:
        publish_native([a], store, cache)
    assert info.value.allocation is not None
    assert store_objects(tmp_path / "store") == []
    assert cache.digests() == [] and len(cache.quarantined()) == 1


def test_missing_local_object(two_artifacts, tmp_path: Path) -> None:
    a, _, _, _ = two_artifacts
    with pytest.raises(MissingObjectError, match="cannot be published"):
        publish_native([a], LocalFolderStore(tmp_path / "store"), PayloadCache(tmp_path / "empty"))


def test_wrong_sized_store_object_is_replaced(two_artifacts, tmp_path: Path) -> None:
    """A store object of the wrong size counts as absent and is replaced by the verified one."""
    a, _, root, pack = two_artifacts
    store = LocalFolderStore(tmp_path / "store")
    path = store.object_path(pack.sha256)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"partial")
    assert [r.action for r in publish_native([a], store, PayloadCache(root))] == ["uploaded"]
    assert sha256_of(path) == pack.sha256


def test_same_size_corrupt_store_object_is_replaced(two_artifacts, tmp_path: Path, caplog) -> None:
    """A store object of the right size with one flipped byte: publication hashes what the store holds,
    finds it corrupt (WARNING), and replaces it with the verified local object (it said "present",
    and every later ``stage --repo`` failed with pack-sha256)."""
    import logging

    a, _, root, pack = two_artifacts
    store = LocalFolderStore(tmp_path / "store")
    publish_native([a], store, PayloadCache(root))
    flip_byte(store.object_path(pack.sha256), 4096 + 17)
    with caplog.at_level(logging.WARNING):
        assert [r.action for r in publish_native([a], store, PayloadCache(root))] == ["uploaded"]
    assert "is corrupt" in caplog.text
    assert sha256_of(store.object_path(pack.sha256)) == pack.sha256
    assert [r.action for r in publish_native([a], store, PayloadCache(root))] == ["present"]


def test_pack_path_not_derived_from_digest_is_refused(two_artifacts, tmp_path: Path) -> None:
    """A manifest whose pack path is not model-payloads/sha256/<digest>.pack is refused; the path is
    never used to place anything."""
    a, _, root, _pack = two_artifacts
    manifest_path = a / "workers" / "worker-0-of-1" / "native-manifest.json"
    doc = json.loads(manifest_path.read_text())
    doc["pack"]["path"] = "model-payloads/sha256/../../../evil.pack"
    manifest_path.write_text(json.dumps(doc))
    descriptor = a / "artifact.json"
    ddoc = json.loads(descriptor.read_text())
    ddoc["workers"][0]["payload"]["path"] = doc["pack"]["path"]
    descriptor.write_text(json.dumps(ddoc))
    with pytest.raises(PackPathMismatchError):
        publish_native([a], LocalFolderStore(tmp_path / "store"), PayloadCache(root))
    assert not (tmp_path / "store").exists()


def test_descriptor_and_manifest_disagree(two_artifacts) -> None:
    a, _, _, pack = two_artifacts
    descriptor = a / "artifact.json"
    doc = json.loads(descriptor.read_text())
    doc["workers"][0]["payload"]["size_bytes"] = pack.size_bytes + 4096
    descriptor.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError):
        collect_payloads([a])
