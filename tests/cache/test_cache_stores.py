"""Payload stores: a real folder store, and the Hugging Face store through huggingface_hub's real API surface.

The Hub is unreachable here, so the HF store is driven by ``create_autospec(HfApi, instance=True)``:
a wrong method or argument name fails exactly as it would against the real class. The objects the
fake download returns and the ``CommitOperationAdd`` the upload builds are real (real files, real
``huggingface_hub`` hashing). One test also uses a real ``HfApi`` in offline mode.
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
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.hf_api import RepoFile

from coldsnap_core.cache import PayloadCache
from coldsnap_core.digests import pack_relpath
from coldsnap_core.errors import (
    ConfigurationError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    PayloadUnavailableError,
    StoreError,
    UnsafePathError,
)
from coldsnap_core.publish import publish_native
from coldsnap_core.staging import stage_payload
from coldsnap_core.stores import from_env, parse_store_spec
from coldsnap_core.stores.base import PayloadStore
from coldsnap_core.stores.hf import HfPayloadStore
from coldsnap_core.stores.local import LocalFolderStore

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


def test_hf_has_uses_paths_info_and_checks_size_and_lfs_sha256(api, captured) -> None:
    """``has`` asks get_paths_info for exactly the digest's path; a wrong size or LFS SHA-256 is absent."""
    digest, size = captured.pack.sha256, captured.pack.size_bytes
    relpath = pack_relpath(digest)
    store = HfPayloadStore(REPO_ID, revision="main", api=api)
    api.get_paths_info.return_value = [repo_file(relpath, size, digest)]
    assert store.has(digest, size)
    api.get_paths_info.assert_called_with(REPO_ID, [relpath], repo_type="model", revision="main")
    api.get_paths_info.return_value = [repo_file(relpath, size + 1, digest)]
    assert not store.has(digest, size)
    api.get_paths_info.return_value = [repo_file(relpath, size, "e" * 64)]
    assert not store.has(digest, size)
    api.get_paths_info.return_value = []
    assert not store.has(digest, size)


def test_hf_fetch_stages_into_the_cache(api, captured, tmp_path: Path) -> None:
    """Staging through the HF store: hf_hub_download (called with its real argument names) lands
    the file in a scratch folder beside the cache temporary; the cache verifies and commits it, and
    the scratch folder is gone."""
    digest, size = captured.pack.sha256, captured.pack.size_bytes
    relpath = pack_relpath(digest)

    def download(repo_id, filename, *, repo_type=None, revision=None, local_dir=None, **_):
        assert (repo_id, filename, repo_type, revision) == (REPO_ID, relpath, "model", "v1")
        target = Path(local_dir) / filename
        target.parent.mkdir(parents=True)
        target.write_bytes(captured.pack_path.read_bytes())
        return str(target)

    api.hf_hub_download.side_effect = download
    cache = PayloadCache(tmp_path / "state")
    path = stage_payload(captured.pack, cache=cache, store=HfPayloadStore(REPO_ID, revision="v1", api=api))
    assert sha256_of(path) == digest
    assert cache.temporaries() == []
    api.hf_hub_download.assert_called_once()
    assert size == os.path.getsize(path)


def test_hf_fetch_of_corrupt_object_keeps_nothing(api, captured, tmp_path: Path) -> None:
    """A Hub object with other bytes fails the cache's verification; nothing is eligible or left."""

    def download(repo_id, filename, *, local_dir=None, **_):
        target = Path(local_dir) / "x.pack"
        data = bytearray(captured.pack_path.read_bytes())
        data[77] ^= 1
        target.write_bytes(bytes(data))
        return str(target)

    api.hf_hub_download.side_effect = download
    cache = PayloadCache(tmp_path / "state")
    with pytest.raises(PackDigestMismatchError):
        stage_payload(captured.pack, cache=cache, store=HfPayloadStore(REPO_ID, api=api))
    assert cache.digests() == [] and cache.temporaries() == []


def test_hf_fetch_of_wrong_size_is_refused(api, captured, tmp_path: Path) -> None:
    def download(repo_id, filename, *, local_dir=None, **_):
        target = Path(local_dir) / "x.pack"
        target.write_bytes(b"\0" * 4096)
        return str(target)

    api.hf_hub_download.side_effect = download
    cache = PayloadCache(tmp_path / "state")
    with pytest.raises(PackSizeMismatchError, match=REPO_ID):
        stage_payload(captured.pack, cache=cache, store=HfPayloadStore(REPO_ID, api=api))
    assert cache.temporaries() == []


def test_hf_missing_object_is_unavailable(api, captured, tmp_path: Path) -> None:
    """EntryNotFoundError from the Hub means PayloadUnavailableError (auto restore falls back)."""
    api.hf_hub_download.side_effect = EntryNotFoundError("404 Client Error: Entry Not Found")
    with pytest.raises(PayloadUnavailableError, match="does not hold the pack"):
        stage_payload(captured.pack, cache=PayloadCache(tmp_path / "state"), store=HfPayloadStore(REPO_ID, api=api))


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


def test_hf_upload_commits_one_operation_with_the_digest_path(api, captured) -> None:
    """upload builds a real CommitOperationAdd for model-payloads/sha256/<digest>.pack and calls
    create_commit with its real argument names; huggingface_hub's own SHA-256 of the file matches."""
    store = HfPayloadStore(REPO_ID, revision="main", repo_type="dataset", api=api)
    store.upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)
    api.create_commit.assert_called_once()
    args, kwargs = api.create_commit.call_args
    assert args[0] == REPO_ID
    (operation,) = args[1]
    assert isinstance(operation, CommitOperationAdd)
    assert operation.path_in_repo == pack_relpath(captured.pack.sha256)
    assert operation.upload_info.sha256.hex() == captured.pack.sha256
    assert kwargs["repo_type"] == "dataset" and kwargs["revision"] == "main"
    assert captured.pack.sha256 in kwargs["commit_message"]


def test_hf_upload_failure_is_a_store_error(api, captured) -> None:
    api.create_commit.side_effect = OSError("403 Forbidden")
    with pytest.raises(StoreError, match="403 Forbidden"):
        HfPayloadStore(REPO_ID, api=api).upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes)


def test_hf_upload_of_wrong_size_uploads_nothing(api, captured) -> None:
    with pytest.raises(PackSizeMismatchError):
        HfPayloadStore(REPO_ID, api=api).upload(captured.pack_path, captured.pack.sha256, captured.pack.size_bytes + 1)
    api.create_commit.assert_not_called()


def test_hf_publish_replaces_an_object_whose_lfs_digest_is_wrong(api, captured) -> None:
    """Publication to the Hub: a present object whose LFS SHA-256 (reported by get_paths_info) is not
    its name counts as absent and is uploaded again."""
    relpath = pack_relpath(captured.pack.sha256)
    api.get_paths_info.return_value = [repo_file(relpath, captured.pack.size_bytes, "e" * 64)]
    results = publish_native([captured.artifact_dir], HfPayloadStore(REPO_ID, api=api), PayloadCache(captured.capture_root))
    assert [r.action for r in results] == ["uploaded"]
    api.create_commit.assert_called_once()


def test_hf_publish_of_two_artifacts_sharing_a_digest_commits_once(api, tmp_path: Path, tiny_checkpoint: Path) -> None:
    """Two artifacts whose workers share a digest: one create_commit, the second artifact finds it present."""
    from cache_support import capture

    root = tmp_path / "root"
    a = capture(tiny_checkpoint, tmp_path / "a", root)
    capture(tiny_checkpoint, tmp_path / "b", root, reverse=True)
    api.get_paths_info.return_value = []
    store = HfPayloadStore(REPO_ID, api=api)
    results = publish_native([tmp_path / "a", tmp_path / "b"], store, PayloadCache(root))
    assert [r.action for r in results] == ["uploaded"]
    assert len(results[0].owners) == 2
    api.create_commit.assert_called_once()
    relpath = pack_relpath(a.manifest.pack.sha256)
    api.get_paths_info.return_value = [repo_file(relpath, a.manifest.pack.size_bytes, a.manifest.pack.sha256)]
    again = publish_native([tmp_path / "b"], store, PayloadCache(root))
    assert [r.action for r in again] == ["present"]
    api.create_commit.assert_called_once()


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
