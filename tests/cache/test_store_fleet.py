"""Many nodes, one store: real ``coldsnap`` processes, one state root each, racing on each store kind.

A "node" is a child process with its own state root (``store_servers.node_command``); the nodes are
released together by a start file. The store is the same server for all of them (a folder, the local
Hub, moto, the OCI registry, fake-gcs-server or azurite, over HTTP).
"""

from __future__ import annotations

import pytest
from cache_support import capture, eligible_objects, sha256_of, temporaries
from store_servers import node_command, run_nodes

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.stores.publish import publish_native

pytestmark = pytest.mark.slow


def test_four_nodes_stage_one_digest_at_once(any_store, captured_once, tmp_path) -> None:
    """Four nodes run ``coldsnap stage`` of the same artifact at the same moment: every node exits 0 with
    one verified object in its cache, nothing partial in any cache or in the store, and the store still
    holds exactly one object (a fetch never writes to the store). Fails if concurrent fetches share or
    corrupt a temporary, or a store fetch leaves partial state behind."""
    pack = captured_once.pack
    publish_native([captured_once.artifact_dir], any_store.store, PayloadCache(captured_once.capture_root))
    writes = any_store.writes(pack.sha256)
    nodes = [tmp_path / f"node-{i}" for i in range(4)]
    start = tmp_path / "start"
    commands = [
        node_command(start, "stage", str(captured_once.artifact_dir), "--repo", any_store.spec, "--state-root", str(node))
        for node in nodes
    ]
    results = run_nodes(commands, any_store.env, start)
    assert [rc for rc, _, _ in results] == [0, 0, 0, 0], [err[-2000:] for _, _, err in results]
    for node in nodes:
        objects = eligible_objects(node)
        assert list(objects) == [pack.sha256] and sha256_of(objects[pack.sha256]) == pack.sha256
        assert temporaries(node) == []
    assert any_store.objects() == [f"{pack.sha256}.pack"]
    assert any_store.writes(pack.sha256) == writes
    assert any_store.leftovers() == []


def test_two_nodes_publish_one_digest_at_once(any_store, tmp_path, tiny_checkpoint) -> None:
    """Two nodes, each with its own artifact (different layouts, the same pack digest) and state root,
    run ``publish-native`` at the same moment: both exit 0, the store holds one object at the digest's
    path. With a conditional create (folder: no-replace link; S3: ``If-None-Match: *``) the object is
    written once: one node reports ``uploaded``, the other ``present``, and S3 keeps a single object
    version. The Hub has no conditional create: both may commit, and the Hub keeps one LFS object for the
    SHA-256, and a registry one blob per digest. Fails if the loser of the race fails, or (folder, S3) overwrites the winner's object."""
    roots = [tmp_path / "root-a", tmp_path / "root-b"]
    a = capture(tiny_checkpoint, tmp_path / "a", roots[0])
    b = capture(tiny_checkpoint, tmp_path / "b", roots[1], reverse=True)
    assert a.manifest.pack == b.manifest.pack and a.manifest.layout_fingerprint != b.manifest.layout_fingerprint
    digest = a.manifest.pack.sha256
    start = tmp_path / "start"
    commands = [
        node_command(start, "publish-native", str(tmp_path / name), "--repo", any_store.spec, "--state-root", str(root))
        for name, root in zip(("a", "b"), roots, strict=True)
    ]
    results = run_nodes(commands, any_store.env, start)
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    actions = sorted(out.split()[0] for _, out, _ in results)
    assert any_store.objects() == [f"{digest}.pack"]
    assert any_store.leftovers() == []
    if any_store.kind in ("hf", "oci"):  # no conditional create; the Hub and a registry keep one object per digest
        assert set(actions) <= {"uploaded", "present"} and "uploaded" in actions
        assert 1 <= any_store.writes(digest) <= 2
    else:
        assert actions == ["present", "uploaded"]
        assert any_store.writes(digest) == 1
