"""The OCI store beyond the shared contract: what another OCI client reads of what coldsnap pushed (the ``oras``
client), the artifact's manifest, cross-repository mounts, and the ``oci://`` URL and Docker config rules. Every
test runs Debian's ``docker-registry`` on 127.0.0.1 (``store_processes.Registry``)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
from pathlib import Path

import pytest
from cache_support import capture, sha256_of

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.errors import ConfigurationError, StoreError
from coldsnap_core.restore.staging import stage_payload
from coldsnap_core.stores import from_env, parse_store_spec
from coldsnap_core.stores.oci import (
    ARTIFACT_TYPE,
    FILE_MEDIA_TYPE,
    PACK_MEDIA_TYPE,
    TITLE_ANNOTATION,
    OciPayloadStore,
    load_credentials,
    parse_oci_url,
)
from coldsnap_core.stores.publish import artifact_listing, publish_native


@pytest.fixture
def two_worker_artifact(tmp_path: Path, tiny_checkpoint: Path, other_checkpoint: Path) -> tuple[Path, Path, list]:
    """An artifact of two workers with two different packs: worker 1 is captured from the other checkpoint into a
    scratch artifact and grafted in (the descriptor pins one model identity; packs are ordered by content)."""
    artifact, root = tmp_path / "smollm-art", tmp_path / "capture-root"
    r0 = capture(tiny_checkpoint, artifact, root, rank=0, world_size=2)
    scratch = tmp_path / "scratch"
    r1 = capture(other_checkpoint, scratch, root, rank=1, world_size=2)
    os.rename(scratch / "workers" / "worker-1-of-2", artifact / "workers" / "worker-1-of-2")
    descriptor = json.loads((artifact / "artifact.json").read_text())
    descriptor["workers"].append(json.loads((scratch / "artifact.json").read_text())["workers"][0])
    (artifact / "artifact.json").write_text(json.dumps(descriptor))
    packs = [r0.manifest.pack, r1.manifest.pack]
    assert len({p.sha256 for p in packs}) == 2
    return artifact, root, packs


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from store_processes import Registry

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    server = Registry(tmp_path / "registry")
    server.start()
    yield server
    server.stop()


def test_oras_pulls_the_packs_coldsnap_pushed_byte_identical(registry, two_worker_artifact, tmp_path, capsys) -> None:
    """``coldsnap publish-native ART --repo oci://...:TAG`` pushes each pack as a blob and one manifest for the
    artifact; the independent ``oras`` client reads that manifest (coldsnap's artifactType, one pack layer per
    pack, the model identity and format version as annotations) and pulls every pack byte-identical. Fails if a
    layer is missing, a media type or digest differs, or the blob is not the pack's bytes."""
    import oras.client

    from coldsnap_core.cli.main import main

    artifact, root, packs = two_worker_artifact
    reference = f"{registry.registry}/models/smollm2:v1"
    assert main(["publish-native", str(artifact), "--repo", f"oci://{reference}", "--state-root", str(root)]) == 0
    assert f"manifest oci://{reference}@sha256:" in capsys.readouterr().out
    client = oras.client.OrasClient(hostname=registry.registry, insecure=True)
    manifest = client.get_manifest(reference)
    assert manifest["artifactType"] == ARTIFACT_TYPE
    pack_layers = [layer for layer in manifest["layers"] if layer["mediaType"] == PACK_MEDIA_TYPE]
    file_layers = [layer for layer in manifest["layers"] if layer["mediaType"] != PACK_MEDIA_TYPE]
    assert sorted((layer["digest"], layer["size"]) for layer in pack_layers) == sorted(
        (f"sha256:{p.sha256}", p.size_bytes) for p in packs
    )
    # the artifact's own files follow the packs, one layer each, titled with their path in the artifact folder
    listing = artifact_listing(artifact)
    assert {layer["mediaType"] for layer in file_layers} == {FILE_MEDIA_TYPE}
    assert [(layer["annotations"][TITLE_ANNOTATION], layer["digest"]) for layer in file_layers] == [
        (f.path, f"sha256:{f.sha256}") for f in listing.files
    ]
    annotations = manifest["annotations"]
    assert annotations["dev.coldsnap.format-version"] == "9"
    assert annotations["dev.coldsnap.model.source"] and len(annotations["dev.coldsnap.model.sha256"]) == 64
    pulled = client.pull(target=reference, outdir=str(tmp_path / "pulled"))
    assert sorted(sha256_of(Path(f)) for f in pulled) == sorted([*(p.sha256 for p in packs), *(f.sha256 for f in listing.files)])
    for file in listing.files:  # oras writes each file at its title: the artifact folder itself
        assert (tmp_path / "pulled" / file.path).read_bytes() == (artifact / file.path).read_bytes()
    for pack in packs:
        assert (tmp_path / "pulled" / f"{pack.sha256}.pack").read_bytes() == PayloadCache(root).object_path(
            pack.sha256
        ).read_bytes()


def test_publishing_twice_uploads_nothing_and_keeps_the_manifest(registry, two_worker_artifact) -> None:
    """A second publication finds every blob present (HEAD) and the tag already naming the same manifest: no blob
    upload completes and the manifest digest is unchanged. Fails if a present blob is sent again or the manifest
    is not deterministic."""
    artifact, root, packs = two_worker_artifact
    store = OciPayloadStore.from_url(f"oci://{registry.registry}/models/smollm2")
    references: list[str] = []
    first = publish_native([artifact], store, PayloadCache(root), on_artifact=references.append)
    uploads = [registry.completed_uploads("models/smollm2", p.sha256) for p in packs]
    again = publish_native(
        [artifact], OciPayloadStore.from_url(store_url(registry)), PayloadCache(root), on_artifact=references.append
    )
    assert [r.action for r in first] == ["uploaded", "uploaded"] and [r.action for r in again] == ["present", "present"]
    assert [registry.completed_uploads("models/smollm2", p.sha256) for p in packs] == uploads == [1, 1]
    assert references[0] == references[1] and references[0].startswith(
        f"oci://{registry.registry}/models/smollm2:smollm-art@sha256:"
    )


def store_url(registry) -> str:
    return f"oci://{registry.registry}/models/smollm2"


def test_a_blob_in_another_repository_is_mounted_not_sent(registry, two_worker_artifact, tmp_path, monkeypatch) -> None:
    """With ``COLDSNAP_OCI_MOUNT_FROM`` naming a repository that holds the packs, publishing to another repository
    of the same registry mounts each blob (POST ``?mount=&from=``, 201) and sends no pack byte; a node stages from
    the new repository. Fails if the mount is not tried, or its 201 is taken for an upload session."""
    artifact, root, packs = two_worker_artifact
    publish_native([artifact], OciPayloadStore.from_url(store_url(registry)), PayloadCache(root))
    monkeypatch.setenv("COLDSNAP_OCI_MOUNT_FROM", "models/smollm2")
    monkeypatch.setenv("COLDSNAP_PAYLOAD_REPO", f"oci://{registry.registry}/team-b/smollm2")
    sent: list[int] = []
    target = from_env()
    results = publish_native(
        [artifact],
        target,
        PayloadCache(root),
        progress=lambda what, _t: sent.append if what.startswith("upload") else (lambda _n: None),
    )
    assert [r.action for r in results] == ["uploaded", "uploaded"] and sent == []
    files = [f.sha256 for f in artifact_listing(artifact).files]  # the artifact's own files are sent: small, new
    assert registry.layers("team-b/smollm2") == sorted({*[p.sha256 for p in packs], _empty_digest(), *files})
    log = registry.log_text()
    assert all(f"mount=sha256%3A{p.sha256}&from=models%2Fsmollm2" in log for p in packs)
    staged = stage_payload(packs[1], cache=PayloadCache(tmp_path / "node"), store=target)
    assert sha256_of(staged) == packs[1].sha256


def _empty_digest() -> str:
    from coldsnap_core.stores.oci import EMPTY_DIGEST

    return EMPTY_DIGEST


@pytest.mark.parametrize(
    "spec",
    [
        "oci://127.0.0.1:5000",
        "oci://127.0.0.1:5000/",
        "oci://127.0.0.1:5000/Models/Upper",
        "oci://127.0.0.1:5000/models/x:-bad",
        "oci://127.0.0.1:5000/models/x@sha256:" + "a" * 64,
        "oci://bad host/models/x",
    ],
)
def test_an_invalid_oci_url_is_a_configuration_error(spec: str) -> None:
    """A URL without a repository, with a repository or tag outside the distribution spec's grammar, a digest
    reference or a bad host is refused before any request (ConfigurationError, exit 4), naming the URL."""
    with pytest.raises(ConfigurationError) as info:
        parse_store_spec(spec)
    assert spec.split("/")[2].split(" ")[0] in str(info.value)


def test_plain_http_only_for_loopback_or_when_set(monkeypatch) -> None:
    """A loopback registry is spoken to over plain HTTP, any other over HTTPS unless COLDSNAP_OCI_PLAIN_HTTP=1;
    the tag and nested namespaces parse. Fails if credentials could go over plain HTTP to a remote host."""
    monkeypatch.delenv("COLDSNAP_OCI_PLAIN_HTTP", raising=False)
    ref = parse_oci_url("oci://registry.example.com:443/org/team/model:v2")
    assert (ref.registry, ref.repository, ref.tag) == ("registry.example.com:443", "org/team/model", "v2")
    assert OciPayloadStore.from_url("oci://registry.example.com/org/model").base_url == "https://registry.example.com"
    assert OciPayloadStore.from_url("oci://localhost:5000/org/model").base_url == "http://localhost:5000"
    assert OciPayloadStore.from_url("oci://[::1]:5000/org/model").base_url == "http://[::1]:5000"
    monkeypatch.setenv("COLDSNAP_OCI_PLAIN_HTTP", "1")
    monkeypatch.setenv("COLDSNAP_PAYLOAD_REPO", "oci://registry.internal:5000/org/model")
    assert from_env().base_url == "http://registry.internal:5000"


def test_docker_config_auths_are_matched_by_host(tmp_path, monkeypatch) -> None:
    """The ``auths`` entry for ``HOST:PORT`` is found under the spellings docker and oras write (``HOST:PORT``,
    ``https://HOST:PORT``, ``http://HOST:PORT/v2/``); ``auth`` is base64 ``user:password``; a malformed entry is
    a ConfigurationError naming the file."""
    config = tmp_path / "config.json"
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    for key in ("reg.example:5000", "https://reg.example:5000", "http://reg.example:5000/v2/"):
        config.write_text(
            json.dumps({"auths": {"other:1": {"auth": "eDp5"}, key: {"auth": base64.b64encode(b"u:p:q").decode()}}})
        )
        creds = load_credentials("reg.example:5000")
        assert creds is not None and (creds.username, creds.password, creds.source) == ("u", "p:q", str(config))
    assert load_credentials("reg.example:5001") is None
    config.write_text(json.dumps({"auths": {"reg.example:5000": {"auth": "not base64!"}}}))
    with pytest.raises(ConfigurationError, match="auth is not base64") as info:
        load_credentials("reg.example:5000")
    assert info.value.file == str(config)


def test_the_bearer_token_challenge_is_answered_with_the_docker_config_credentials(tmp_path, monkeypatch, captured) -> None:
    """A registry with token authentication answers 401 ``WWW-Authenticate: Bearer realm=...,service=...,scope=...``;
    the store fetches a token from the realm with the Docker config's credentials (Basic) for that scope, retries
    with it, and publishes and stages. With a wrong password the token service refuses and the error names the
    store, the realm and the config file. Fails if the challenge's realm, service or scope is not followed, or the
    token is not sent."""
    from store_processes import Registry, TokenService

    token = TokenService(tmp_path / "token", {"fleet": "s3cret"})
    registry = Registry(tmp_path / "registry", token=token)
    registry.start()
    try:
        config = tmp_path / "docker-config"
        config.mkdir()
        monkeypatch.setenv("DOCKER_CONFIG", str(config))
        spec = f"oci://{registry.registry}/models/private"

        def login(password: str) -> None:
            auth = base64.b64encode(f"fleet:{password}".encode()).decode()
            (config / "config.json").write_text(json.dumps({"auths": {f"https://{registry.registry}": {"auth": auth}}}))

        login("wrong")
        with pytest.raises(StoreError, match="token service") as info:
            parse_store_spec(spec).has(captured.pack.sha256)
        assert token.realm in str(info.value) and str(config / "config.json") in str(info.value)
        login("s3cret")
        publish_native([captured.artifact_dir], parse_store_spec(spec), PayloadCache(captured.capture_root))
        staged = stage_payload(captured.pack, cache=PayloadCache(tmp_path / "node"), store=parse_store_spec(spec))
        assert sha256_of(staged) == captured.pack.sha256
        scopes = {scope for _user, scope in token.requests}
        assert "repository:models/private:pull" in scopes and any(
            s.startswith("repository:models/private:") and "push" in s for s in scopes
        )
    finally:
        registry.stop()
        token.stop()


def test_one_tag_names_one_artifact(registry, tmp_path, tiny_checkpoint) -> None:
    """Two artifacts published in one call to a URL with a tag: the first manifest is pushed under the tag and the
    second is refused (ConfigurationError naming both) instead of silently replacing it; without a tag each
    artifact gets its folder name as tag. Fails if a second manifest overwrites the first under one tag."""
    root = tmp_path / "root"
    capture(tiny_checkpoint, tmp_path / "art-a", root)
    capture(tiny_checkpoint, tmp_path / "art-b", root, reverse=True)
    tagged = OciPayloadStore.from_url(f"oci://{registry.registry}/models/x:v1")
    with pytest.raises(ConfigurationError, match="'art-a' and 'art-b'"):
        publish_native([tmp_path / "art-a", tmp_path / "art-b"], tagged, PayloadCache(root))
    references: list[str] = []
    publish_native(
        [tmp_path / "art-a", tmp_path / "art-b"],
        OciPayloadStore.from_url(f"oci://{registry.registry}/models/x"),
        PayloadCache(root),
        on_artifact=references.append,
    )
    assert [r.split("@")[0] for r in references] == [
        f"oci://{registry.registry}/models/x:art-a",
        f"oci://{registry.registry}/models/x:art-b",
    ]


def test_a_tag_naming_another_artifact_is_refused_before_any_pack_is_uploaded_and_in_a_dry_run(
    registry, tmp_path, tiny_checkpoint, other_checkpoint
) -> None:
    """Publishing art-b to a tag that names art-a in the registry is refused before art-b's pack is uploaded (no
    wasted upload, no orphan blob), and ``--dry-run`` reports the same refusal (exit 4 from the CLI, as the real
    run). Fails if the tag is checked only after the packs are uploaded (the old order: art-b's pack was in the
    registry after the refusal) or if a dry run says "ok"."""
    from coldsnap_core.cli.main import main
    from coldsnap_core.stores.publish import collect_payloads

    root = tmp_path / "root"
    capture(tiny_checkpoint, tmp_path / "art-a", root)
    capture(other_checkpoint, tmp_path / "art-b", root)  # another model: another pack
    pack_a = collect_payloads([tmp_path / "art-a"])[0].pack
    pack_b = collect_payloads([tmp_path / "art-b"])[0].pack
    assert pack_a.sha256 != pack_b.sha256
    url = f"oci://{registry.registry}/models/x:v1"
    publish_native([tmp_path / "art-a"], OciPayloadStore.from_url(url), PayloadCache(root))
    with pytest.raises(ConfigurationError, match=r"names the coldsnap artifact 'art-a'"):
        publish_native([tmp_path / "art-b"], OciPayloadStore.from_url(url), PayloadCache(root), dry_run=True)
    with pytest.raises(ConfigurationError, match=r"names the coldsnap artifact 'art-a'"):
        publish_native([tmp_path / "art-b"], OciPayloadStore.from_url(url), PayloadCache(root))
    assert not OciPayloadStore.from_url(url).has(pack_b.sha256, pack_b.size_bytes)
    cli = ["publish-native", str(tmp_path / "art-b"), "--repo", url, "--state-root", str(root)]
    assert main([*cli, "--dry-run"]) == 4
    assert main(cli) == 4
    assert not OciPayloadStore.from_url(url).has(pack_b.sha256, pack_b.size_bytes)


def test_a_tag_naming_another_artifact_in_the_registry_is_refused_and_a_recapture_moves_it_with_a_warning(
    registry, tmp_path, tiny_checkpoint, other_checkpoint, caplog
) -> None:
    """A later publication to a tag that already names another artifact's manifest (another folder name) is refused
    with a ConfigurationError naming the tag and that artifact, and the tag keeps its manifest; a new capture of the
    same artifact folder moves the tag with a WARNING naming both manifest digests. Fails if a second publication
    moves the tag silently (``oras pull :tag`` then gets another model than the one tagged)."""
    import logging
    import shutil

    import httpx

    root = tmp_path / "root"
    capture(tiny_checkpoint, tmp_path / "art-a", root)
    capture(tiny_checkpoint, tmp_path / "art-b", root, reverse=True)
    url = f"oci://{registry.registry}/models/x:v1"
    manifest_url = f"http://{registry.registry}/v2/models/x/manifests/v1"

    def tagged_digest() -> str:
        headers = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
        return httpx.head(manifest_url, headers=headers).headers["Docker-Content-Digest"]

    first: list[str] = []
    publish_native([tmp_path / "art-a"], OciPayloadStore.from_url(url), PayloadCache(root), on_artifact=first.append)
    before = tagged_digest()
    assert first[0].endswith(before)
    with pytest.raises(ConfigurationError, match=r"names the coldsnap artifact 'art-a'.*one tag names one artifact"):
        publish_native([tmp_path / "art-b"], OciPayloadStore.from_url(url), PayloadCache(root))
    assert tagged_digest() == before
    shutil.rmtree(tmp_path / "art-a")
    capture(other_checkpoint, tmp_path / "art-a", root)  # a new capture into the same folder: another pack
    with caplog.at_level(logging.WARNING, logger="coldsnap_core"):
        publish_native([tmp_path / "art-a"], OciPayloadStore.from_url(url), PayloadCache(root))
    after = tagged_digest()
    assert after != before
    moves = [r.getMessage() for r in caplog.records if "moving" in r.getMessage()]
    assert len(moves) == 1 and before in moves[0] and after in moves[0] and "'art-a'" in moves[0]


@pytest.mark.parametrize(
    ("status", "body", "again"),
    [
        (400, {"errors": [{"code": "MANIFEST_BLOB_UNKNOWN", "message": "blob unknown to registry"}]}, True),
        (400, {"errors": [{"code": "BLOB_UNKNOWN", "message": "blob unknown"}]}, True),
        (503, {}, True),
        (400, {"errors": [{"code": "MANIFEST_INVALID", "message": "manifest invalid"}]}, False),
        (404, {"errors": [{"code": "NAME_UNKNOWN", "message": "repository name not known"}]}, False),
    ],
    ids=["manifest-blob-unknown", "blob-unknown", "unavailable", "invalid", "no-repository"],
)
def test_only_a_manifest_refused_for_an_unknown_blob_or_a_5xx_is_pushed_again(status: int, body: dict, again: bool) -> None:
    """Two nodes pushing one pack at once: a registry's filesystem storage replaces the blob's file when the other
    push commits, and a manifest checked meanwhile names an unknown blob. Such a refusal (and a 5xx) is tried again;
    any other refusal fails at once. Fails if a malformed manifest is retried, or an unknown-blob refusal is not."""
    import httpx

    from coldsnap_core.stores.oci import _transient_manifest_refusal

    response = httpx.Response(status, json=body)
    assert _transient_manifest_refusal(response) is again


def _login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: str, password: str = "s3cret-pw") -> None:
    """A Docker config with ``fleet:<password>`` for ``registry``, as ``DOCKER_CONFIG``."""
    config = tmp_path / "docker-config"
    config.mkdir(exist_ok=True)
    auth = base64.b64encode(f"fleet:{password}".encode()).decode()
    (config / "config.json").write_text(json.dumps({"auths": {registry: {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(config))


def _authorizations(server) -> list[str]:
    return [h.get("Authorization", "") for _m, _p, h in server.requests if "Authorization" in h]


def test_an_upload_location_on_another_origin_gets_no_credentials(tmp_path, monkeypatch, captured) -> None:
    """A registry with Basic authentication that answers the upload ``POST`` with a ``Location`` on another origin (a
    second server on 127.0.0.1): the blob goes there without the registry's credentials, and the registry itself
    gets them. Fails if the store adds the registry's ``Authorization`` to whatever URL a ``Location`` names (it
    sent ``user:password`` to any origin, over plain HTTP too)."""
    from store_servers import ScriptedServer, answer

    digest = captured.pack.sha256
    with ScriptedServer(lambda h: answer(h, 201, {"Docker-Content-Digest": f"sha256:{digest}"})) as elsewhere:

        def registry_script(h) -> None:
            if "Authorization" not in h.headers:
                answer(h, 401, {"WWW-Authenticate": 'Basic realm="coldsnap-test"'})
            elif h.command == "HEAD":
                answer(h, 404)
            else:  # the upload POST
                answer(h, 202, {"Location": f"{elsewhere.url}/uploads/1?_state=abc"})

        with ScriptedServer(registry_script) as registry:
            host = registry.url.removeprefix("http://")
            _login(tmp_path, monkeypatch, host)
            store = OciPayloadStore.from_url(f"oci://{host}/coldsnap/payloads")
            assert store.upload(captured.pack_path, digest, captured.pack.size_bytes) is True
            assert any(m == "POST" for m, _p, _h in registry.requests) and _authorizations(registry)
        assert [m for m, _p, _h in elsewhere.requests] == ["PUT"]
        assert _authorizations(elsewhere) == []


def test_a_bearer_realm_over_plain_http_on_another_host_gets_no_credentials(tmp_path, monkeypatch) -> None:
    """A registry whose ``Bearer`` challenge names a realm over plain HTTP on another host (``localhost``, not the
    registry's ``127.0.0.1``): the store refuses (a StoreError naming the realm and the rule) and the realm gets no
    request carrying the credentials. Fails if the Docker config's ``user:password`` go to any realm the registry
    names."""
    from store_servers import ScriptedServer, answer

    with ScriptedServer(lambda h: answer(h, 200, {"Content-Type": "application/json"}, b'{"token": "t"}')) as tokens:
        realm = tokens.url.replace("127.0.0.1", "localhost") + "/token"
        challenge = f'Bearer realm="{realm}",service="registry",scope="repository:coldsnap/payloads:pull"'
        with ScriptedServer(lambda h: answer(h, 401, {"WWW-Authenticate": challenge})) as registry:
            host = registry.url.removeprefix("http://")
            _login(tmp_path, monkeypatch, host)
            with pytest.raises(StoreError, match="plain HTTP on another host") as raised:
                OciPayloadStore.from_url(f"oci://{host}/coldsnap/payloads").has("ab" * 32)
        assert realm in str(raised.value) and "s3cret-pw" not in str(raised.value)
        assert _authorizations(tokens) == []


SIGNATURE = "5ec7e75ec7e7" * 5


@contextlib.contextmanager
def _presigned_registry(data: bytes, storage_script=None):
    """A registry on 127.0.0.1 that answers a blob ``GET`` with a ``307`` to a presigned URL (``X-Amz-Signature``) on
    a second server, which serves the blob's ranges (or answers with ``storage_script``); yields both servers."""
    from store_servers import ScriptedServer, answer, object_store_script

    box: list = []
    box.append(ScriptedServer(storage_script or object_store_script(box, data, "ok")))
    storage = box[0]

    def registry_script(h) -> None:
        if h.command == "HEAD":
            answer(h, 200, {"Content-Length": str(len(data))})
        else:
            answer(h, 307, {"Location": f"{storage.url}/blob?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature={SIGNATURE}"})

    with storage, ScriptedServer(registry_script) as registry:
        yield registry, storage


def _fetch(store: OciPayloadStore, data: bytes, target: Path) -> None:
    import hashlib

    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        store.fetch(hashlib.sha256(data).hexdigest(), len(data), fd, file=target)
    finally:
        os.close(fd)


def test_a_presigned_redirect_is_followed_and_its_signature_never_logged(tmp_path, monkeypatch, caplog) -> None:
    """A blob ``GET`` redirected to a presigned URL is followed and the blob fetched byte-identical, and no log
    record, at any level of any logger (httpx logs every request's URL at INFO, which ``-v`` shows; httpcore the
    ``Location`` at DEBUG), holds the signature. Fails if a client's log keeps a presigned URL's query."""
    import logging

    data = os.urandom(1 << 20)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    with _presigned_registry(data) as (registry, _storage), caplog.at_level(logging.DEBUG):
        store = OciPayloadStore.from_url(f"oci://{registry.url.removeprefix('http://')}/coldsnap/payloads")
        _fetch(store, data, tmp_path / "fetched")
    assert (tmp_path / "fetched").read_bytes() == data
    assert any("HTTP Request" in r.getMessage() for r in caplog.records)  # httpx did log the requests
    assert SIGNATURE not in caplog.text and not any(SIGNATURE in r.getMessage() for r in caplog.records)


def test_a_403_from_a_redirect_target_is_not_blamed_on_the_registry_credentials(tmp_path, monkeypatch) -> None:
    """The redirect target refuses (``403``, a presigned URL that expired): the StoreError names the target's origin
    and says the registry's credentials were not sent there, never quotes the signature, and does not send the user
    to the Docker config. Fails if the target's ``403`` reads as the registry refusing its credentials."""
    from store_servers import answer

    data = os.urandom(1 << 20)
    expired = b"<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    with _presigned_registry(data, lambda h: answer(h, 403, {"Content-Type": "application/xml"}, expired)) as (registry, storage):
        store = OciPayloadStore.from_url(f"oci://{registry.url.removeprefix('http://')}/coldsnap/payloads")
        with pytest.raises(StoreError) as raised:
            _fetch(store, data, tmp_path / "fetched")
    message = str(raised.value)
    assert storage.url in message and "not the cause" in message, message
    assert "credentials for" not in message and "refused access" not in message and SIGNATURE not in message, message
