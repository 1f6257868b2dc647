"""The payload-store contract, run against every store kind over real I/O (in the manner of containerd's
content-store test suite, ``content/testsuite``): a folder, the Hugging Face store with the real
``huggingface_hub`` client over HTTP to the local Hub, and the S3 store with the real boto3 client over
HTTP to moto in server mode.

Every test here runs once per store kind (``any_store``: ``folder``, ``hf``, ``s3``, ``oci``, ``gcs``, ``azure``;
the OCI registry, fake-gcs-server and azurite are processes on 127.0.0.1) and says which regression it catches. The objects are always at ``model-payloads/sha256/<digest>.pack`` (under the S3 prefix).
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import re
import threading
from pathlib import Path

import pytest
from cache_support import eligible_objects, sha256_of

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.cli.main import main
from coldsnap_core.digests import pack_relpath
from coldsnap_core.errors import (
    CapsulePinMismatchError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    PayloadUnavailableError,
    StoreError,
)
from coldsnap_core.restore.staging import stage_payload
from coldsnap_core.stores import artifact_ref, parse_artifact_ref
from coldsnap_core.stores.base import PayloadStore, artifact_object
from coldsnap_core.stores.publish import PublishedFile, artifact_listing, publish_native
from coldsnap_core.stores.pull import pull_artifact


def _flipped(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0xFF
    return bytes(out)


def _nothing_kept(cache: PayloadCache) -> None:
    assert cache.digests() == [] and cache.temporaries() == []


def test_publish_then_stage_on_another_node(any_store, captured_once, tmp_path) -> None:
    """publish-native uploads the pack to the digest's path; a second node (another state root, another
    client) stages it, verified, and nothing partial is left in the store or the cache. Fails if a store
    writes elsewhere than ``model-payloads/sha256/<digest>.pack``, loses or alters bytes on the way, or
    leaves a temporary (a folder ``.partial``, an unfinished multipart upload)."""
    pack = captured_once.pack
    assert isinstance(any_store.store, PayloadStore)
    assert not any_store.store.has(pack.sha256, pack.size_bytes)
    results = publish_native([captured_once.artifact_dir], any_store.store, PayloadCache(captured_once.capture_root))
    assert [r.action for r in results] == ["uploaded"]
    assert any_store.objects() == [f"{pack.sha256}.pack"]
    # an OCI registry addresses the pack as the blob sha256:<digest>; every other store at its derived path
    expected = f"@sha256:{pack.sha256}" if any_store.kind == "oci" else pack_relpath(pack.sha256)
    assert any_store.store.location(pack.sha256).endswith(expected)
    node = any_store.new_store()
    assert node.has(pack.sha256, pack.size_bytes) and node.has(pack.sha256, pack.size_bytes, verify=True)
    cache = PayloadCache(tmp_path / "node-2")
    path = stage_payload(pack, cache=cache, store=node)
    assert sha256_of(path) == pack.sha256 and cache.temporaries() == []
    assert any_store.leftovers() == []


def test_publishing_a_present_digest_uploads_nothing(any_store, captured_once) -> None:
    """A second publication of the same digest finds it present and sends no bytes (no new S3 object
    version, no LFS upload, the folder object untouched). Fails if ``has`` misses a present object."""
    cache = PayloadCache(captured_once.capture_root)
    digest = captured_once.pack.sha256
    publish_native([captured_once.artifact_dir], any_store.store, cache)
    writes = any_store.writes(digest)
    again = publish_native([captured_once.artifact_dir], any_store.new_store(), cache)
    assert [r.action for r in again] == ["present"]
    assert any_store.writes(digest) == writes == 1


def test_missing_object_is_unavailable(any_store, captured_once, tmp_path) -> None:
    """An object the store does not hold: ``has`` is False and staging raises PayloadUnavailableError
    (exit 3; ``auto`` falls back), not a generic store failure."""
    pack = captured_once.pack
    if any_store.kind == "hf":
        any_store.backend.create("coldsnap-test/payloads")
    assert not any_store.store.has(pack.sha256, pack.size_bytes)
    cache = PayloadCache(tmp_path / "node")
    with pytest.raises(PayloadUnavailableError):
        stage_payload(pack, cache=cache, store=any_store.store)
    _nothing_kept(cache)


@pytest.mark.parametrize("change", ["truncated", "extended"])
def test_truncated_or_extended_object_is_refused(any_store, captured_once, tmp_path, change: str) -> None:
    """An object of the wrong size in the store: absent for ``has`` (so publication replaces it), and
    staging refuses it with PackSizeMismatchError naming the store object, before any byte is admitted.
    Fails if a store trusts the digest in the name, or hands a short read to the cache."""
    pack = captured_once.pack
    data = captured_once.pack_path.read_bytes()
    any_store.put_raw(pack.sha256, data[:-4096] if change == "truncated" else data + b"\0" * 4096)
    assert not any_store.store.has(pack.sha256, pack.size_bytes)
    cache = PayloadCache(tmp_path / "node")
    with pytest.raises(PackSizeMismatchError, match=change) as info:
        stage_payload(pack, cache=cache, store=any_store.store)
    assert pack.sha256 in str(info.value.file)
    _nothing_kept(cache)


def test_same_size_wrong_bytes_are_refused_and_never_admitted(any_store, captured_once, tmp_path) -> None:
    """An object of the right size with one byte changed: the cache's full verification refuses it with
    PackDigestMismatchError naming the object in the store (not the cache temporary); nothing is
    admitted; ``has(verify=True)`` reports it absent. Fails if a fetched object is committed unverified."""
    pack = captured_once.pack
    any_store.put_raw(pack.sha256, _flipped(captured_once.pack_path.read_bytes(), 5000))
    assert not any_store.store.has(pack.sha256, pack.size_bytes, verify=True)
    cache = PayloadCache(tmp_path / "node")
    with pytest.raises(PackDigestMismatchError) as info:
        stage_payload(pack, cache=cache, store=any_store.store)
    assert info.value.file == any_store.store.location(pack.sha256)
    _nothing_kept(cache)


def test_publication_replaces_a_corrupt_store_object(any_store, captured_once, tmp_path) -> None:
    """A same-size corrupt object in the store is replaced by publication (S3: the conditional create
    fails, the existing object is hashed, found corrupt and replaced with ``If-Match`` on its ETag), and a
    node then stages the right bytes. Fails if a conditional create takes any existing object as good."""
    pack = captured_once.pack
    any_store.put_raw(pack.sha256, _flipped(captured_once.pack_path.read_bytes(), 5000))
    if any_store.kind == "oci":
        # a registry never replaces a blob it holds: publication refuses, naming the blob, instead of reporting success
        with pytest.raises(StoreError, match="never replaces") as info:
            publish_native([captured_once.artifact_dir], any_store.store, PayloadCache(captured_once.capture_root))
        assert info.value.file == any_store.store.location(pack.sha256)
        return
    results = publish_native([captured_once.artifact_dir], any_store.store, PayloadCache(captured_once.capture_root))
    assert [r.action for r in results] == ["uploaded"]
    path = stage_payload(pack, cache=PayloadCache(tmp_path / "node"), store=any_store.new_store())
    assert sha256_of(path) == pack.sha256
    assert any_store.leftovers() == []


def test_upload_of_bytes_that_are_not_the_digest_publishes_nothing(any_store, captured_once, tmp_path) -> None:
    """``upload`` of a file whose bytes do not hash to the digest (it changed after verification) raises
    PackDigestMismatchError and leaves no object and nothing partial (S3: the multipart upload is
    aborted; Hub: nothing is committed). Fails if a store publishes first and checks afterwards."""
    bad = tmp_path / "bad.pack"
    bad.write_bytes(_flipped(captured_once.pack_path.read_bytes(), 77))
    pack = captured_once.pack
    with pytest.raises(PackDigestMismatchError):
        any_store.store.upload(bad, pack.sha256, pack.size_bytes)
    assert any_store.objects() == [] and any_store.leftovers() == []


@pytest.mark.parametrize(("damage", "exit_code"), [("missing", 3), ("corrupt", 1)])
def test_cli_stage_exit_codes(any_store, captured_once, tmp_path, capsys, damage: str, exit_code: int) -> None:
    """``coldsnap stage ARTIFACT --repo <store>``: a missing object exits 3 (payload-available), a corrupt
    one exits 1 (pack-sha256) naming the store object, whatever the store kind."""
    from coldsnap_core.cli.main import main

    pack = captured_once.pack
    if damage == "corrupt":
        any_store.put_raw(pack.sha256, _flipped(captured_once.pack_path.read_bytes(), 5000))
    elif any_store.kind == "hf":
        any_store.backend.create("coldsnap-test/payloads")
    node = tmp_path / "node"
    assert main(["stage", str(captured_once.artifact_dir), "--repo", any_store.spec, "--state-root", str(node)]) == exit_code
    err = capsys.readouterr().err
    assert ("payload-available" if damage == "missing" else "pack-sha256") in err
    assert eligible_objects(node) == {}


@pytest.mark.parametrize("kind", ["s3", "gcs", "azure", "folder"])
def test_a_pack_deleted_from_the_cache_and_a_wrong_store_prefix_name_where_it_was_looked_up(
    kind, captured_once, tmp_path, request, monkeypatch, capsys
) -> None:
    """The pack is published under one prefix, deleted from the node's cache, and staged with another prefix: exit 3
    (``payload-available``), naming the object where it was looked up (under the wrong prefix) and the remedy to
    check the store and its prefix. Fails if a wrong prefix reads as a corrupt cache, a store failure, or a bare
    "unavailable" with no place and no remedy."""
    from store_servers import store_under_test

    from coldsnap_core.cli.main import main
    from coldsnap_core.stores import parse_store_spec

    target = store_under_test(kind, request, tmp_path, monkeypatch)
    pack = captured_once.pack
    target.store.upload(captured_once.pack_path, pack.sha256, pack.size_bytes)
    node = tmp_path / "node"
    assert main(["stage", str(captured_once.artifact_dir), "--repo", target.spec, "--state-root", str(node)]) == 0
    assert main(["cache", "rm", pack.sha256, "--state-root", str(node)]) == 0
    wrong = f"{target.spec}-old"
    if kind == "folder":
        os.mkdir(wrong)
    capsys.readouterr()
    assert main(["stage", str(captured_once.artifact_dir), "--repo", wrong, "--state-root", str(node)]) == 3
    err = capsys.readouterr().err
    assert "payload-available" in err and parse_store_spec(wrong).location(pack.sha256) in err, err
    assert "remedy: check the store and its prefix" in err, err


@pytest.mark.parametrize("kind", ["s3", "gcs", "azure"])
def test_a_missing_bucket_or_container_is_a_store_error_naming_it(
    kind, captured_once, tmp_path, request, monkeypatch, capsys
) -> None:
    """A store URL whose bucket (S3, GCS) or container (Azure) does not exist on the real server is a
    ``payload-store`` error naming it, from ``has`` and from ``coldsnap stage`` (exit 4), not a missing pack
    (``payload-available``, exit 3: "publish it" would be the wrong advice). Fails if the service's "not found" for
    the lookup (``get_blob`` gives ``None``, a HEAD's 404 has no body) is taken for the object's."""
    from store_servers import store_under_test

    from coldsnap_core.cli.main import main
    from coldsnap_core.stores import parse_store_spec

    target = store_under_test(kind, request, tmp_path, monkeypatch)  # the server and the client's environment
    missing = f"missing-{target.bucket}"
    spec = target.spec.replace(target.bucket, missing)
    store = parse_store_spec(spec)
    if kind == "s3":
        store._client = target.backend
    with pytest.raises(StoreError, match=f"'{missing}' does not exist") as raised:
        store.has(captured_once.pack.sha256)
    assert raised.value.exit_code == 4 and store.name in str(raised.value)
    node = tmp_path / "node"
    assert main(["stage", str(captured_once.artifact_dir), "--repo", spec, "--state-root", str(node)]) == 4
    err = capsys.readouterr().err
    assert "payload-store" in err and f"'{missing}' does not exist" in err and "payload-available" not in err
    assert eligible_objects(node) == {}


def test_cli_progress_is_lines_off_a_terminal_and_a_bar_on_one(any_store, captured_once, tmp_path, capsys, monkeypatch) -> None:
    """Off a terminal (a pipe, a log) ``stage`` writes plain progress lines (bytes, GB/s, ETA) and no bar: no
    carriage return from coldsnap's or huggingface_hub's bars; on a terminal the stage bar is drawn. Fails if a bar
    is forced into a log, or progress is left out of either."""
    from coldsnap_core.cli.main import main

    publish_native([captured_once.artifact_dir], any_store.store, PayloadCache(captured_once.capture_root))
    capsys.readouterr()  # huggingface_hub's upload bar above ran outside the CLI
    args = ["stage", str(captured_once.artifact_dir), "--repo", any_store.spec]
    assert main([*args, "--state-root", str(tmp_path / "lines")]) == 0
    err = capsys.readouterr().err
    desc = f"stage {captured_once.pack.sha256[:12]} (fetch and hash): "
    assert "\r" not in err and any(line.startswith(desc) and " GB/s, done in " in line for line in err.splitlines()), err

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main([*args, "--state-root", str(tmp_path / "drawn")]) == 0
    assert f"stage {captured_once.pack.sha256[:12]}" in terminal.getvalue() and "\r" in terminal.getvalue()


def test_two_uploads_of_one_digest_at_once_create_it_once(any_store, captured_once) -> None:
    """Two clients call ``upload`` for the same digest at the same moment (both past their ``has`` check,
    as two publishing nodes can be): neither fails and the store ends with one object. Where the store has
    a conditional create (folder: no-replace ``link``; S3: ``If-None-Match: *``) exactly one call creates
    it (returns True), the other keeps it (False) and S3 keeps one object version. Fails if the create is
    unconditional (both return True, S3 writes a second version) or the loser raises."""
    pack = captured_once.pack
    clients = [any_store.new_store(), any_store.new_store()]
    barrier = threading.Barrier(2)

    def upload(store):
        barrier.wait()
        return store.upload(captured_once.pack_path, pack.sha256, pack.size_bytes)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        created = sorted(pool.map(upload, clients))
    assert any_store.objects() == [f"{pack.sha256}.pack"] and any_store.leftovers() == []
    if any_store.kind in ("hf", "oci"):
        # no conditional create on the Hub or in the distribution API: both may send the bytes; the Hub keeps one
        # LFS object per SHA-256, a registry one blob per digest (it hashes each upload itself)
        assert created in ([True, True], [False, True])
    else:
        assert created == [False, True]
        assert any_store.writes(pack.sha256) == 1


def test_server_stopped_mid_fetch_leaves_nothing_eligible_and_a_retry_succeeds(ranged_store, captured_once, tmp_path) -> None:
    """The store's server stops after the first range of a fetch reached the cache (the other ranges find nothing
    listening): staging fails with StoreError naming the store object, the node keeps no eligible pack and no
    temporary; once the server is back (same port, same objects), staging again admits the verified pack. Fails if
    a partial fetch is committed, a temporary is left behind, or the failure is not the store's typed error."""
    pack = captured_once.pack
    publish_native([captured_once.artifact_dir], ranged_store.store, PayloadCache(captured_once.capture_root))
    # one range at a time, 256 KiB each: the server stops while the pack's later ranges are still to be read
    node_store = ranged_store.new_store_with(chunk_size_bytes=256 << 10, concurrency=1, **_few_retries(ranged_store.kind))
    cache = PayloadCache(tmp_path / "node")
    seen: list[int] = []

    def stop_after_first_range(n: int) -> None:
        seen.append(n)
        if len(seen) == 1:
            ranged_store.server.stop()

    try:
        with pytest.raises(StoreError) as info:
            stage_payload(pack, cache=cache, store=node_store, progress=stop_after_first_range)
    finally:
        if not ranged_store.server.running:
            ranged_store.server.start()
    assert info.value.file == node_store.location(pack.sha256)
    assert eligible_objects(tmp_path / "node") == {} and cache.temporaries() == []
    path = stage_payload(pack, cache=cache, store=node_store)
    assert sha256_of(path) == pack.sha256 and cache.temporaries() == []


def _few_retries(kind: str) -> dict[str, object]:
    """Store options that give up on a stopped server at once (no retry: a retry would wait up to 4 s)."""
    from coldsnap_core.settings import StoreClientSettings

    return {"client_settings": StoreClientSettings(retries=0)} if kind in ("gcs", "azure") else {}


@pytest.mark.parametrize("kind", ["oci", "gcs", "azure"])
def test_a_wrong_credential_is_an_error_naming_the_store(kind, captured_once, tmp_path, request, monkeypatch) -> None:
    """A credential the service refuses (OCI: a Docker config ``auths`` entry with the wrong password for a registry
    with htpasswd authentication; Azure: a wrong account key; GCS: a credentials file that is not one) fails the
    first call with a typed error naming the store and where the credential came from, and staging falls back on
    it; with the right credential (OCI) the same store publishes and stages. Fails if a refusal reads as "not
    found" (PayloadUnavailableError), or the message names neither the store nor the credential's source."""
    from store_servers import store_under_test

    from coldsnap_core.errors import ConfigurationError
    from coldsnap_core.stores import parse_store_spec

    pack = captured_once.pack
    if kind == "oci":
        import base64
        import json

        from store_processes import Registry

        registry = Registry(tmp_path / "auth-registry", users={"fleet": "right-password"})
        registry.start()
        request.addfinalizer(registry.stop)
        config = tmp_path / "docker-config"
        config.mkdir()

        def login(password: str) -> None:
            auth = base64.b64encode(f"fleet:{password}".encode()).decode()
            (config / "config.json").write_text(json.dumps({"auths": {registry.registry: {"auth": auth}}}))

        monkeypatch.setenv("DOCKER_CONFIG", str(config))
        spec = f"oci://{registry.registry}/coldsnap/private"
        login("wrong-password")
        with pytest.raises(StoreError, match=r"refused access \(401") as info:
            parse_store_spec(spec).has(pack.sha256)
        assert str(config / "config.json") in str(info.value) and "oci 127.0.0.1" in str(info.value)
        login("right-password")
        publish_native([captured_once.artifact_dir], parse_store_spec(spec), PayloadCache(captured_once.capture_root))
        staged = stage_payload(pack, cache=PayloadCache(tmp_path / "node"), store=parse_store_spec(spec))
        assert sha256_of(staged) == pack.sha256
        return
    target = store_under_test(kind, request, tmp_path, monkeypatch)
    if kind == "azure":
        from store_processes import AZURITE_KEY

        monkeypatch.setenv("AZURE_STORAGE_KEY", AZURITE_KEY[:-8] + "AAAAAAA=")
        expected, pattern = StoreError, r"refused the credential"
    else:
        bad = tmp_path / "credentials.json"
        bad.write_text('{"type": "service_account", "client_email": "nobody"}')
        monkeypatch.delenv("STORAGE_EMULATOR_HOST")
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(bad))
        expected, pattern = ConfigurationError, str(bad)
    store = parse_store_spec(target.spec)
    with pytest.raises(expected, match=pattern) as info:
        store.has(pack.sha256)
    assert target.store.name in str(info.value)
    with pytest.raises(expected):
        stage_payload(pack, cache=PayloadCache(tmp_path / "node"), store=store)


def _publish_named(any_store, captured_once, name: str = "tiny", on_file=None) -> str:
    """Publish the captured artifact as ``name``; returns the REF ``coldsnap pull`` takes."""
    cache = PayloadCache(captured_once.capture_root)
    publish_native([captured_once.artifact_dir], any_store.store, cache, name=name, on_file=on_file)
    return artifact_ref(any_store.spec, any_store.store, name)


def _folder_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_publish_then_pull_the_whole_artifact_on_another_node(any_store, captured_once, tmp_path, capsys) -> None:
    """publish-native pushes the artifact's own files beside the pack, under the SHA-256 of artifact.json, and its
    name last; ``coldsnap pull REF DIR`` on another node (another state root, another client) writes the artifact
    folder byte-identical (artifact.json and every file it pins, nothing else) and stages the pack, verified; a second
    publication uploads no file and a second pull fetches none. Fails if a file is not published, lands at another
    path, the name is missing or written before the files, or a pull loses, adds or alters a file."""
    listing = artifact_listing(captured_once.artifact_dir, "tiny")
    published: list[PublishedFile] = []
    ref = _publish_named(any_store, captured_once, on_file=published.append)
    assert [(f.file.path, f.action) for f in published] == [(f.path, "uploaded") for f in listing.files]
    if any_store.kind == "oci":
        assert [title for title, _ in any_store.files()] == sorted(f.path for f in listing.files)
    else:
        prefix = f"artifacts/sha256/{listing.artifact.sha256}/"
        assert [path for path, _ in any_store.files()] == sorted([*(prefix + f.path for f in listing.files), "refs/tiny.json"])
    again: list[PublishedFile] = []
    _publish_named(any_store, captured_once, on_file=again.append)
    assert {f.action for f in again} == {"present"}
    dest, node = tmp_path / "node-2" / "artifact", tmp_path / "node-2" / "state"
    assert main(["pull", ref, str(dest), "--state-root", str(node), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["artifact_sha256"], document["fetched_files"]) == (listing.artifact.sha256, len(listing.files))
    assert _folder_files(dest) == {
        p: data for p, data in _folder_files(captured_once.artifact_dir).items() if p in {f.path for f in listing.files}
    }
    assert sorted(_folder_files(dest)) == sorted(f.path for f in listing.files)
    assert list(eligible_objects(node)) == [captured_once.pack.sha256]
    assert sorted(p.name for p in dest.parent.iterdir()) == [".artifact.lock", "artifact", "state"]
    assert main(["pull", ref, str(dest), "--state-root", str(node), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fetched_files"] == 0
    assert any_store.leftovers() == []


def test_a_changed_byte_in_any_pulled_file_is_refused_naming_it(any_store, captured_once, tmp_path) -> None:
    """Each file of a published artifact in turn holds one flipped byte in the store: the pull stops with
    CapsulePinMismatchError naming that file (artifact.json: against the name's SHA-256; any other: against its pin)
    and nothing is at DIR, not even a temporary. Then, pulled intact, each pinned file flipped in DIR is refused by
    the next pull the same way. Fails if a file is put in place unchecked, or a refusal leaves a partial folder."""
    ref = _publish_named(any_store, captured_once)
    store, name = parse_artifact_ref(ref)
    listing = artifact_listing(captured_once.artifact_dir, "tiny")
    for i, file in enumerate(listing.files):
        obj = artifact_object(listing.artifact.sha256, file.path, file.sha256)
        original = (captured_once.artifact_dir / file.path).read_bytes()
        any_store.put_raw(obj, _flipped(original, len(original) // 2))
        dest = tmp_path / f"pull-{i}"
        with pytest.raises(CapsulePinMismatchError, match=re.escape(file.path)):
            pull_artifact(store, name, dest)
        assert not dest.exists() and list(tmp_path.glob(f".pull-{i}.pull-*")) == []
        any_store.put_raw(obj, original)
    dest = tmp_path / "intact"
    assert pull_artifact(store, name, dest).fetched_files == len(listing.files)
    for file in listing.files[1:]:
        original = (dest / file.path).read_bytes()
        (dest / file.path).write_bytes(_flipped(original, 0))
        with pytest.raises(CapsulePinMismatchError, match=re.escape(Path(file.path).name)):
            pull_artifact(store, name, dest)
        (dest / file.path).write_bytes(original)
    assert pull_artifact(store, name, dest).fetched_files == 0


def test_a_name_the_store_does_not_record_is_unavailable(any_store, captured_once, tmp_path) -> None:
    """Pulling a name nobody published: PayloadUnavailableError (exit 3) naming the name, nothing written. Fails if
    a missing reference is read as an empty or default artifact."""
    _publish_named(any_store, captured_once)
    store, _ = parse_artifact_ref(artifact_ref(any_store.spec, any_store.store, "tiny"))
    with pytest.raises(PayloadUnavailableError, match="other"):
        pull_artifact(store, "other", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
