"""Payload stores: a real folder store, and the Hugging Face store with the real ``huggingface_hub``
client over HTTP to the local Hub (``local_hub.py``, the ``local_hub`` fixture). The contract every store
meets is in ``test_store_contract.py``; these are store-specific behaviours.

Two tests still drive the HF store through ``create_autospec(HfApi, instance=True)``: a connection
reset and an unreachable endpoint, which the real client answers only after its retry back-off (tens
of seconds). One test uses a real ``HfApi`` in offline mode.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from unittest.mock import create_autospec

import huggingface_hub
import pytest
from cache_support import flip_byte, sha256_of
from huggingface_hub import HfApi
from huggingface_hub.hf_api import RepoFile

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.digests import pack_relpath
from coldsnap_core.errors import (
    ConfigurationError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    PayloadUnavailableError,
    StoreError,
    UnsafePathError,
)
from coldsnap_core.restore.staging import stage_payload
from coldsnap_core.stores import from_env, parse_store_spec
from coldsnap_core.stores.base import PayloadStore
from coldsnap_core.stores.hf import HfPayloadStore
from coldsnap_core.stores.local import LocalFolderStore
from coldsnap_core.stores.publish import publish_native

REPO_ID = "coldsnap-test/payloads"


def repo_file(path: str, size: int, sha256: str | None) -> RepoFile:
    """A RepoFile as huggingface_hub builds it from a paths-info response."""
    lfs = {"size": size, "oid": sha256, "pointerSize": 134} if sha256 else None
    return RepoFile(path=path, size=size, oid="0" * 40, lfs=lfs)


@pytest.fixture
def api():
    return create_autospec(HfApi, instance=True)


# --- folder store ----------------------------------------------------------------------------------


def test_folder_store_upload_is_atomic_and_read_only(captured, tmp_path: Path) -> None:
    """After an upload the object is at model-payloads/sha256/<digest>.pack, mode 0444, correct, and
    no temporary remains; ``has`` checks the size."""
    store = LocalFolderStore(tmp_path / "store")
    assert isinstance(store, PayloadStore)
    digest, size = captured.pack.sha256, captured.pack.size_bytes
    assert not store.has(digest, size)
    store.upload(captured.pack_path, digest, size)
    path = tmp_path / "store" / pack_relpath(digest)
    assert store.object_path(digest) == path
    assert sha256_of(path) == digest and stat.S_IMODE(os.lstat(path).st_mode) == 0o444
    assert list((tmp_path / "store" / "model-payloads" / "tmp").iterdir()) == []
    assert store.has(digest, size) and store.has(digest)


def test_folder_store_upload_of_wrong_bytes_publishes_nothing(captured, tmp_path: Path) -> None:
    """Uploading a file whose bytes do not hash to the digest fails in the store's own verification
    of its copy: nothing at the object path, no temporary left."""
    bad = tmp_path / "bad.pack"
    bad.write_bytes(captured.pack_path.read_bytes())
    flip_byte(bad, 1)
    store = LocalFolderStore(tmp_path / "store")
    with pytest.raises(PackDigestMismatchError):
        store.upload(bad, captured.pack.sha256, captured.pack.size_bytes)
    assert not store.has(captured.pack.sha256)
    assert list((tmp_path / "store" / "model-payloads" / "tmp").iterdir()) == []


def test_folder_store_wrong_size_counts_as_absent(captured, tmp_path: Path, caplog) -> None:
    """An object of the wrong size is reported absent with a WARNING (publication then replaces it)."""
    store = LocalFolderStore(tmp_path / "store")
    path = store.object_path(captured.pack.sha256)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"short")
    with caplog.at_level(logging.WARNING):
        assert not store.has(captured.pack.sha256, captured.pack.size_bytes)
    assert "treating it as absent" in caplog.text


def test_folder_store_verify_finds_a_same_size_corrupt_object(captured, tmp_path: Path, caplog) -> None:
    """``has(verify=True)`` hashes the object: one flipped byte (same size) makes it absent, with a
    WARNING; ``has()`` without ``verify`` still checks the size only."""
    store = LocalFolderStore(tmp_path / "store")
    digest, size = captured.pack.sha256, captured.pack.size_bytes
    store.upload(captured.pack_path, digest, size)
    assert store.has(digest, size, verify=True)
    flip_byte(store.object_path(digest), 1000)
    assert store.has(digest, size)
    with caplog.at_level(logging.WARNING):
        assert not store.has(digest, size, verify=True)
    assert "is corrupt" in caplog.text
    assert store.location(digest) == str(store.object_path(digest))


def test_stage_from_a_corrupt_store_object_names_the_store_object(captured, tmp_path: Path) -> None:
    """A same-size corrupt object in a folder store: staging fails with PackDigestMismatchError
    naming the store object (and the store), not the cache's ``tmp/<digest>.<hex>.partial``."""
    store = LocalFolderStore(tmp_path / "store")
    store.upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    flip_byte(store.object_path(captured.pack.sha256), 1000)
    with pytest.raises(PackDigestMismatchError) as info:
        stage_payload(captured.pack, cache=PayloadCache(tmp_path / "state"), store=store)
    assert info.value.file == str(store.object_path(captured.pack.sha256))
    assert store.name in info.value.detail and ".partial" not in str(info.value.file)


def test_folder_store_refuses_symlinks(captured, tmp_path: Path) -> None:
    store = LocalFolderStore(tmp_path / "store")
    path = store.object_path(captured.pack.sha256)
    path.parent.mkdir(parents=True)
    os.symlink(captured.pack_path, path)
    with pytest.raises(UnsafePathError):
        store.has(captured.pack.sha256)


# --- Hugging Face store (huggingface_hub API surface, no network) --------------------------------------


def hub_store(hub, **kwargs) -> HfPayloadStore:
    """The HF store with a real HfApi talking HTTP to the local Hub."""
    return HfPayloadStore(REPO_ID, api=HfApi(endpoint=hub.url), **kwargs)


def test_hf_has_checks_size_and_the_lfs_sha256_the_hub_reports(local_hub, captured) -> None:
    """``has`` asks paths-info for the digest's path: a file there whose LFS SHA-256 (as the Hub reports
    it) is not the digest counts as absent even at the right size; the right one is present. Fails if
    ``has`` trusts the path's name or checks the size only."""
    digest, size = captured.pack.sha256, captured.pack.size_bytes
    data = captured.pack_path.read_bytes()
    store = hub_store(local_hub)
    local_hub.plant(REPO_ID, pack_relpath(digest), data, claimed_sha256="e" * 64)
    assert not store.has(digest, size)
    local_hub.plant(REPO_ID, pack_relpath(digest), data)
    assert store.has(digest, size) and not store.has(digest, size + 1)


def test_hf_stage_from_a_pinned_commit(local_hub, captured, tmp_path: Path) -> None:
    """``org/name@<commit>`` reads that commit even after the branch moved on to a bad object: staging
    from the pinned commit gets the good pack, from ``main`` the bad one is refused. Fails if the
    revision is dropped on the way to hf_hub_download (X-Repo-Commit pinning)."""
    from huggingface_hub import HfApi

    digest = captured.pack.sha256
    publish_native([captured.artifact_dir], hub_store(local_hub), PayloadCache(captured.capture_root))
    commit = HfApi(endpoint=local_hub.url).model_info(REPO_ID).sha
    data = bytearray(captured.pack_path.read_bytes())
    data[100] ^= 1
    local_hub.plant(REPO_ID, pack_relpath(digest), bytes(data))  # main now names other bytes
    pinned = parse_store_spec(f"{REPO_ID}@{commit}")
    assert isinstance(pinned, HfPayloadStore) and pinned.revision == commit
    assert sha256_of(stage_payload(captured.pack, cache=PayloadCache(tmp_path / "a"), store=pinned)) == digest
    with pytest.raises(PackDigestMismatchError):
        stage_payload(captured.pack, cache=PayloadCache(tmp_path / "b"), store=hub_store(local_hub))


def test_hf_bit_rot_behind_correct_metadata_is_refused(local_hub, captured, tmp_path: Path) -> None:
    """The Hub's tree still reports the right size and LFS SHA-256 but serves other bytes: ``has`` cannot
    tell (it trusts the Hub's SHA-256), the cache's own verification refuses the fetch and keeps nothing.
    Fails if staging admitted a store object on the store's word."""
    digest = captured.pack.sha256
    store = hub_store(local_hub)
    publish_native([captured.artifact_dir], store, PayloadCache(captured.capture_root))
    data = bytearray(captured.pack_path.read_bytes())
    data[4242] ^= 0xFF
    local_hub.tamper(REPO_ID, pack_relpath(digest), bytes(data))
    assert store.has(digest, captured.pack.size_bytes)
    cache = PayloadCache(tmp_path / "node")
    with pytest.raises(PackDigestMismatchError, match="holds a corrupt copy"):
        stage_payload(captured.pack, cache=cache, store=store)
    assert cache.digests() == [] and cache.temporaries() == []


def test_hf_publish_to_a_missing_repository_creates_it_private(local_hub, captured) -> None:
    """publish-native to a repository that does not exist creates it, private (as ``hf upload`` does),
    and uploads; ``--public`` creates it public. Before, the lookup failed first with "looking up the
    pack failed: RepositoryNotFoundError"."""
    from coldsnap_core.cli.main import main

    results = publish_native([captured.artifact_dir], hub_store(local_hub), PayloadCache(captured.capture_root))
    assert [r.action for r in results] == ["uploaded"]
    assert local_hub.created == [("model", REPO_ID, True)]
    args = ["publish-native", str(captured.artifact_dir), "--state-root", str(captured.capture_root)]
    assert main([*args, "--repo", "coldsnap-test/public-payloads", "--public"]) == 0
    assert local_hub.created[-1] == ("model", "coldsnap-test/public-payloads", False)


def test_hf_upload_to_a_dataset_repository_at_a_revision(local_hub, captured) -> None:
    """A dataset repository and a branch: the object lands at ``model-payloads/sha256/<digest>.pack`` on
    that branch of the dataset, with the digest as its LFS SHA-256, in one commit of one LFS upload."""
    local_hub.create(REPO_ID, "dataset")
    store = hub_store(local_hub, repo_type="dataset", revision="main")
    assert store.upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes) is True
    entry = local_hub.objects(REPO_ID, "dataset")[pack_relpath(captured.pack.sha256)]
    assert (entry.sha256, entry.size) == (captured.pack.sha256, captured.pack.size_bytes)
    assert (local_hub.commits, local_hub.lfs_uploads) == (1, 1)
    assert ("model", REPO_ID) not in local_hub.repos


def test_hf_upload_refused_by_the_hub_is_a_store_error(local_hub, captured) -> None:
    """The Hub refuses the commit (403, a read-only token): StoreError naming the repository and the
    path; nothing is stored."""
    local_hub.create(REPO_ID)
    local_hub.refuse_commits = 403
    with pytest.raises(StoreError, match="rights to write") as info:
        hub_store(local_hub).upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    assert pack_relpath(captured.pack.sha256) in str(info.value.file)
    assert local_hub.objects(REPO_ID) == {}


def test_hf_upload_of_wrong_size_uploads_nothing(local_hub, captured) -> None:
    """A size that disagrees with the file: PackSizeMismatchError before any request (no repository
    created, no commit, no LFS upload)."""
    with pytest.raises(PackSizeMismatchError):
        hub_store(local_hub).upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes + 1)
    assert (local_hub.created, local_hub.commits, local_hub.lfs_uploads) == ([], 0, 0)


def test_hf_upload_with_xet_against_a_hub_without_xet_is_a_store_error(local_hub, captured, monkeypatch) -> None:
    """With Xet enabled (huggingface_hub's default while hf_xet is importable) a Hub that offers no Xet
    fails the upload; coldsnap reports it as a StoreError naming the store (set HF_HUB_DISABLE_XET=1
    for such a Hub), and nothing is stored."""
    import huggingface_hub.constants

    pytest.importorskip("hf_xet")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)
    local_hub.create(REPO_ID)
    with pytest.raises(StoreError, match="uploading the pack failed"):
        hub_store(local_hub).upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    assert local_hub.objects(REPO_ID) == {}


def test_hf_publish_replaces_an_object_whose_lfs_digest_is_wrong(local_hub, captured) -> None:
    """Publication to the Hub: a present object whose LFS SHA-256 (reported by paths-info) is not its
    name counts as absent and is committed again, after which paths-info reports the digest."""
    digest = captured.pack.sha256
    local_hub.plant(REPO_ID, pack_relpath(digest), captured.pack_path.read_bytes(), claimed_sha256="e" * 64)
    results = publish_native([captured.artifact_dir], hub_store(local_hub), PayloadCache(captured.capture_root))
    assert [r.action for r in results] == ["uploaded"]
    assert local_hub.objects(REPO_ID)[pack_relpath(digest)].sha256 == digest


def test_hf_publish_of_two_artifacts_sharing_a_digest_commits_once(local_hub, tmp_path: Path, tiny_checkpoint: Path) -> None:
    """Two artifacts whose workers share a digest: one commit with one LFS upload; a second publication
    finds it present and commits nothing."""
    from cache_support import capture

    root = tmp_path / "root"
    capture(tiny_checkpoint, tmp_path / "a", root)
    capture(tiny_checkpoint, tmp_path / "b", root, reverse=True)
    store = hub_store(local_hub)
    results = publish_native([tmp_path / "a", tmp_path / "b"], store, PayloadCache(root))
    assert [r.action for r in results] == ["uploaded"] and len(results[0].owners) == 2
    # the pack once; the artifacts' own files and names are further commits (docs/format.md §12.9)
    digest = results[0].pack.sha256
    assert local_hub.lfs_uploaded_oids.count(digest) == 1
    counts = (local_hub.commits, local_hub.lfs_uploads)
    again = publish_native([tmp_path / "b"], store, PayloadCache(root))
    assert [r.action for r in again] == ["present"]
    assert local_hub.lfs_uploaded_oids.count(digest) == 1
    assert local_hub.lfs_uploads == counts[1] and local_hub.commits == counts[0] + 1  # b's name, written again


def test_hf_failure_is_a_store_error_and_staging_keeps_it(api, captured, tmp_path: Path) -> None:
    """Any other Hub failure is a StoreError naming the repository and path; staging raises it as a
    StoreError (exit 4: the store failed), with the cause chained, not as "unavailable" (exit 3)."""
    api.hf_hub_download.side_effect = ConnectionError("connection reset")
    store = HfPayloadStore(REPO_ID, api=api)
    with pytest.raises(StoreError, match="connection reset") as info:
        stage_payload(captured.pack, cache=PayloadCache(tmp_path / "state"), store=store)
    assert not isinstance(info.value, PayloadUnavailableError)
    assert isinstance(info.value.__cause__, StoreError)
    api.get_paths_info.side_effect = ConnectionError("down")
    with pytest.raises(StoreError, match=REPO_ID):
        store.has(captured.pack.sha256)


def test_hf_unreachable_hub_is_a_store_error_not_a_missing_pack(api, captured, tmp_path: Path, monkeypatch) -> None:
    """``hf_hub_download`` raising LocalEntryNotFoundError (what it raises when the endpoint does not
    answer and no local copy exists; a subclass of EntryNotFoundError) is "the store did not answer"
    (StoreError, naming the endpoint and the cause), not "the store does not hold the pack"
    (PayloadUnavailableError, exit 3), which is what catching EntryNotFoundError alone reported."""
    import huggingface_hub.constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    # Online mode whatever the environment says (scripts/test.sh exports HF_HUB_OFFLINE=1, which
    # makes the message name offline mode instead of the endpoint and its cause).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as exc:
            raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub") from exc

    api.hf_hub_download.side_effect = unreachable
    with pytest.raises(StoreError, match="did not answer") as info:
        stage_payload(captured.pack, cache=PayloadCache(tmp_path / "state"), store=HfPayloadStore(REPO_ID, api=api))
    assert not isinstance(info.value, PayloadUnavailableError)
    assert "ConnectionRefusedError" in info.value.detail and "does not hold" not in info.value.detail


def test_hf_real_api_offline_is_a_store_error(captured, tmp_path: Path, monkeypatch) -> None:
    """A real HfApi with HF_HUB_OFFLINE: the download cannot happen; staging says the store did not
    answer because huggingface_hub is offline (StoreError), and keeps nothing."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    store = HfPayloadStore(REPO_ID)
    cache = PayloadCache(tmp_path / "state")
    with pytest.raises(StoreError, match="HF_HUB_OFFLINE=1") as info:
        stage_payload(captured.pack, cache=cache, store=store)
    assert not isinstance(info.value, PayloadUnavailableError)
    assert cache.temporaries() == []
    with pytest.raises(StoreError, match="OfflineModeIsEnabled"):
        store.has(captured.pack.sha256)


def test_cli_stage_from_an_offline_hub_exits_4(captured, tmp_path: Path, monkeypatch, capsys) -> None:
    """``coldsnap stage --repo org/name@main`` with the Hub offline: exit 4, rule payload-store, "did
    not answer" (was exit 3, payload-available, "does not hold the pack")."""
    from coldsnap_core.cli.main import main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = ["stage", str(captured.artifact_dir), "--repo", f"{REPO_ID}@main", "--state-root", str(tmp_path / "x")]
    assert main(args) == 4
    err = capsys.readouterr().err
    assert "rule payload-store failed" in err and "did not answer" in err


# --- configuration ------------------------------------------------------------------------------------


def test_from_env(tmp_path: Path) -> None:
    """COLDSNAP_PAYLOAD_DIR gives a folder store, COLDSNAP_PAYLOAD_REPO an HF store (org/name[@revision],
    type from COLDSNAP_PAYLOAD_REPO_TYPE) or a folder when it is a path; nothing set gives None."""
    assert from_env({}) is None
    folder = from_env({"COLDSNAP_PAYLOAD_DIR": str(tmp_path)})
    assert isinstance(folder, LocalFolderStore) and folder.root == tmp_path
    hf = from_env({"COLDSNAP_PAYLOAD_REPO": "org/name@refs/pr/3", "COLDSNAP_PAYLOAD_REPO_TYPE": "dataset"})
    assert isinstance(hf, HfPayloadStore)
    assert (hf.repo_id, hf.revision, hf.repo_type) == ("org/name", "refs/pr/3", "dataset")
    plain = from_env({"COLDSNAP_PAYLOAD_REPO": "org/name"})
    assert (plain.revision, plain.repo_type) == (None, "model")
    assert isinstance(from_env({"COLDSNAP_PAYLOAD_REPO": f"file://{tmp_path}"}), LocalFolderStore)


@pytest.mark.parametrize(
    "environ",
    [
        {"COLDSNAP_PAYLOAD_DIR": "/x", "COLDSNAP_PAYLOAD_REPO": "org/name"},
        {"COLDSNAP_PAYLOAD_REPO": "org/name@"},
        {"COLDSNAP_PAYLOAD_REPO": "org/na me"},
        {"COLDSNAP_PAYLOAD_REPO": "a/b/c"},
        {"COLDSNAP_PAYLOAD_REPO": "org/name", "COLDSNAP_PAYLOAD_REPO_TYPE": "space"},
    ],
)
def test_from_env_rejects_bad_configuration(environ: dict[str, str]) -> None:
    """Both variables, an empty revision, an invalid repository id or type: ConfigurationError naming the variable."""
    with pytest.raises(ConfigurationError, match="COLDSNAP_PAYLOAD"):
        from_env(environ)


@pytest.mark.parametrize(
    ("spec", "kind"),
    [("/abs/path", LocalFolderStore), ("./rel", LocalFolderStore), ("~/p", LocalFolderStore), ("org/name", HfPayloadStore)],
)
def test_parse_store_spec(spec: str, kind: type) -> None:
    assert isinstance(parse_store_spec(spec), kind)


def test_parse_store_spec_empty() -> None:
    with pytest.raises(ConfigurationError):
        parse_store_spec("  ")
