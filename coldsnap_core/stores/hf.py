"""A payload store in a Hugging Face repository through ``huggingface_hub`` (``docs/format.md`` §12.3): objects at
their relative path in the repository (LFS/Xet files); token, endpoint and offline mode as ``huggingface_hub`` reads them."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import validate_repo_id

from coldsnap_core._io import refuse_symlink
from coldsnap_core.errors import (
    ColdsnapError,
    ConfigurationError,
    PackDigestMismatchError,
    PackSizeMismatchError,
    PayloadUnavailableError,
    StoreError,
    size_mismatch,
)
from coldsnap_core.stores._copy import copy_file
from coldsnap_core.stores._references import ReferenceIndex
from coldsnap_core.stores.base import NOT_IN_STORE_REMEDY, LandedCallback, ProgressCallback, StoreObject, as_object, wrong_size

logger = logging.getLogger(__name__)

REPO_TYPES = ("model", "dataset")


class HfPayloadStore(ReferenceIndex):
    """Objects in the Hugging Face repository ``repo_id`` at ``revision`` (``None``: the default branch); ``private``:
    the visibility of a repository an upload creates. Raises ``ConfigurationError`` for an invalid id or type."""

    def __init__(
        self,
        repo_id: str,
        *,
        revision: str | None = None,
        repo_type: str = "model",
        api: HfApi | None = None,
        private: bool = True,
    ) -> None:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as exc:
            raise ConfigurationError(f"{repo_id!r} is not a Hugging Face repository id: {exc}") from exc
        if repo_type not in REPO_TYPES:
            raise ConfigurationError(f"payload repository type {repo_type!r} is not one of {', '.join(REPO_TYPES)}")
        if revision is not None and not revision:
            raise ConfigurationError("an empty revision was given for the payload repository")
        self.repo_id = repo_id
        self.revision = revision
        self.repo_type = repo_type
        self.api = api if api is not None else HfApi()
        self.private = private
        self.name = f"hf {repo_type}s/{repo_id}@{revision or 'default branch'}"

    def __repr__(self) -> str:
        return f"HfPayloadStore({self.repo_id!r}, revision={self.revision!r}, repo_type={self.repo_type!r})"

    def location(self, obj: str | StoreObject) -> str:
        return f"{self.repo_id}/{as_object(obj).relpath}"

    def _fail(self, action: str, obj: str | StoreObject, exc: Exception) -> StoreError:
        return StoreError(f"{self.name}: {action} failed: {type(exc).__name__}: {exc}", file=self.location(obj))

    def _no_answer(self, obj: str | StoreObject, exc: Exception) -> StoreError:
        """The Hub could not be asked (offline mode, or the endpoint did not answer)."""
        if hf_constants.HF_HUB_OFFLINE:
            why = "huggingface_hub is offline, HF_HUB_OFFLINE=1"
        else:
            endpoint = getattr(self.api, "endpoint", None)
            endpoint = endpoint if isinstance(endpoint, str) and endpoint else hf_constants.ENDPOINT
            cause = exc.__cause__ or exc.__context__
            why = f"endpoint {endpoint}" + (f": {type(cause).__name__}: {cause}" if cause is not None else "")
        return StoreError(f"{self.name} did not answer ({why}); nothing was fetched", file=self.location(obj))

    def has(self, obj: str | StoreObject, size_bytes: int | None = None, *, verify: bool = False) -> bool:
        """``HfApi.get_paths_info``: the size, and the LFS SHA-256 the Hub computed (always; ``verify`` adds nothing).
        A repository that does not exist (or that the token cannot read) holds nothing: :meth:`upload` creates it."""
        obj = as_object(obj)
        relpath = obj.relpath
        try:
            infos: list[Any] = self.api.get_paths_info(self.repo_id, [relpath], repo_type=self.repo_type, revision=self.revision)
        except RepositoryNotFoundError:
            logger.info("coldsnap: %s does not exist (yet); it holds nothing", self.name)
            return False
        except Exception as exc:
            raise self._fail(f"looking up the {obj.what}", obj, exc) from exc
        info = next((info for info in infos if isinstance(info, RepoFile) and info.path == relpath), None)
        if info is None or wrong_size(obj, info.size, size_bytes, file=self.location(obj)):
            return False
        if info.lfs is not None and info.lfs.sha256 != obj.sha256:
            logger.warning(
                "coldsnap: %s has LFS SHA-256 %s, not its name; treating it as absent", self.location(obj), info.lfs.sha256
            )
            return False
        return True

    def fetch(
        self,
        obj: str | StoreObject,
        size_bytes: int,
        fd: int,
        *,
        file: Path,
        progress: ProgressCallback | None = None,
        landed: LandedCallback | None = None,
    ) -> None:
        """``HfApi.hf_hub_download`` into ``<file>.d``, then one kernel copy into ``fd``."""
        obj = as_object(obj)
        scratch = file.with_name(file.name + ".d")
        scratch.mkdir(mode=0o700)
        try:
            try:
                downloaded = self.api.hf_hub_download(
                    self.repo_id, obj.relpath, repo_type=self.repo_type, revision=self.revision, local_dir=scratch
                )
            except LocalEntryNotFoundError as exc:  # a subclass of EntryNotFoundError: the Hub did not answer
                raise self._no_answer(obj, exc) from exc
            except EntryNotFoundError as exc:
                raise PayloadUnavailableError(
                    f"{self.name} does not hold the {obj.what}", file=self.location(obj), remedy=NOT_IN_STORE_REMEDY
                ) from exc
            except ColdsnapError:
                raise
            except Exception as exc:
                raise self._fail(f"downloading the {obj.what}", obj, exc) from exc
            local = Path(downloaded)
            st = refuse_symlink(local)
            if st is None:
                raise StoreError(f"{self.name}: hf_hub_download returned a path that does not exist", file=local)
            if mismatch := size_mismatch(
                PackSizeMismatchError, f"stored {obj.what}", st.st_size, size_bytes, file=self.location(obj)
            ):
                raise mismatch
            copy_file(local, fd, size_bytes, target=file, progress=progress, landed=landed)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def upload(self, path: Path, obj: str | StoreObject, size_bytes: int, *, progress: ProgressCallback | None = None) -> bool:
        """``HfApi.create_commit`` once the SHA-256 ``huggingface_hub`` computed is the object's; ``True`` (the Hub has
        no conditional create). Raises ``PackSizeMismatchError`` or ``PackDigestMismatchError`` (the file changed after
        it was verified; nothing uploaded), ``StoreError`` (the Hub refused or failed)."""
        obj = as_object(obj)
        relpath = obj.relpath
        operation = CommitOperationAdd(path_in_repo=relpath, path_or_fileobj=str(path))
        mismatch = size_mismatch(PackSizeMismatchError, "the file to upload", operation.upload_info.size, size_bytes, file=path)
        if mismatch is not None:
            raise mismatch
        uploaded = operation.upload_info.sha256.hex()
        if uploaded != obj.sha256:
            raise PackDigestMismatchError(
                f"the file to upload to {self.name} hashes to {uploaded}, not {obj.sha256}; it changed after verification"
                " (nothing was uploaded)",
                file=path,
            )
        try:
            self.api.create_repo(self.repo_id, repo_type=self.repo_type, private=self.private, exist_ok=True)
        except Exception as exc:
            raise self._fail(f"creating the repository {self.repo_id}", obj, exc) from exc
        self._commit(operation, f"coldsnap: add {relpath}", f"uploading the {obj.what}", obj)
        if progress is not None:
            progress(size_bytes)
        logger.info("coldsnap: uploaded %s to %s", relpath, self.name)
        return True

    def put_reference(self, relpath: str, data: bytes) -> None:
        """Commit ``data`` at ``relpath`` (atomic for a reader of the revision); ``StoreError`` when the Hub failed."""
        operation = CommitOperationAdd(path_in_repo=relpath, path_or_fileobj=data)
        self._commit(operation, f"coldsnap: name {relpath}", "writing the name", StoreObject(relpath, ""))

    def _commit(self, operation: CommitOperationAdd, message: str, action: str, obj: StoreObject) -> None:
        try:
            self.api.create_commit(
                self.repo_id, [operation], commit_message=message, repo_type=self.repo_type, revision=self.revision
            )
        except Exception as exc:
            raise self._fail(action, obj, exc) from exc

    def get_reference(self, relpath: str, max_bytes: int) -> bytes | None:
        """The bytes of ``relpath``, or ``None``; ``StoreError`` when the Hub failed or it is over ``max_bytes``."""
        where = f"{self.repo_id}/{relpath}"
        with tempfile.TemporaryDirectory(prefix="coldsnap-ref-") as scratch:
            try:
                downloaded = self.api.hf_hub_download(
                    self.repo_id, relpath, repo_type=self.repo_type, revision=self.revision, local_dir=scratch
                )
            except LocalEntryNotFoundError as exc:
                raise StoreError(f"{self.name} did not answer: {exc}", file=where) from exc
            except (EntryNotFoundError, RepositoryNotFoundError):
                return None
            except Exception as exc:
                raise self._fail("reading the name", StoreObject(relpath, ""), exc) from exc
            with open(downloaded, "rb") as f:
                data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise StoreError(f"{self.name}: the name is over {max_bytes} bytes", file=where)
        return data
