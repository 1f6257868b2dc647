"""A payload store in a Hugging Face repository, through ``huggingface_hub``.

Objects live at ``model-payloads/sha256/<digest>.pack`` in the repository (LFS/Xet files). The
repository id and revision come from ``COLDSNAP_PAYLOAD_REPO=org/name[@revision]`` (see
:func:`coldsnap_core.stores.from_env`); the token and the endpoint come from the usual Hugging Face
variables (``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, ...), which ``huggingface_hub`` reads
itself. Calls used (``huggingface_hub`` >= 1.31):

* ``HfApi.get_paths_info``: presence, size and the LFS SHA-256 of an object;
* ``HfApi.hf_hub_download(..., local_dir=...)``: download into a scratch folder next to the cache's
  temporary file, then a kernel copy into it (the cache verifies and commits);
* ``HfApi.create_repo(exist_ok=True, private=...)`` when the repository does not exist yet (private
  unless the store was made with ``private=False``, as ``hf upload`` does), then
  ``HfApi.create_commit`` with one ``CommitOperationAdd`` per object.

Xet: ``huggingface_hub`` uploads through Xet whenever ``hf_xet`` is importable (it is a dependency of
``huggingface_hub`` 2.x) unless ``HF_HUB_DISABLE_XET=1``. coldsnap leaves that choice to the client:
against the Hugging Face Hub (which offers Xet) uploads go through Xet and ``paths-info`` still
reports the file's SHA-256 (``lfs.oid``); against a Hub without Xet (a self-hosted or test Hub) set
``HF_HUB_DISABLE_XET=1`` for the classic LFS upload. Downloads need no switch. Either way the cache
verifies every fetched byte itself.

Errors from the Hub are wrapped: a missing object (the Hub answered "not found") is
:class:`~coldsnap_core.errors.PayloadUnavailableError`; a Hub that did not answer (unreachable
endpoint, ``HF_HUB_OFFLINE=1``: ``huggingface_hub`` raises ``LocalEntryNotFoundError``, a subclass of
``EntryNotFoundError``, when it could neither reach the Hub nor find a local copy) and anything else
is a :class:`~coldsnap_core.errors.StoreError` naming the repository and the path.
"""

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
from coldsnap_core.stores.base import NOT_IN_STORE_REMEDY, LandedCallback, ProgressCallback, StoreObject, as_object

logger = logging.getLogger(__name__)

REPO_TYPES = ("model", "dataset")


class HfPayloadStore(ReferenceIndex):
    """Objects in a Hugging Face repository.

    Args:
        repo_id: ``org/name``.
        revision: branch, tag or commit to read from and commit to (``None``: the default branch).
        repo_type: ``model`` (default) or ``dataset``.
        api: the ``HfApi`` to use (default: ``HfApi()``, configured from the environment).
        private: visibility of the repository if an upload has to create it (default private).

    Raises:
        ConfigurationError: the repository id or type is invalid.
    """

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

    def _where(self, obj: str | StoreObject) -> str:
        return f"{self.repo_id}/{as_object(obj).relpath}"

    def location(self, obj: str | StoreObject) -> str:
        """See :meth:`coldsnap_core.stores.base.PayloadStore.location`: ``org/name/<relpath>`` (a pack: ``org/name/model-payloads/sha256/<digest>.pack``)."""
        return self._where(obj)

    def _fail(self, action: str, obj: str | StoreObject, exc: Exception) -> StoreError:
        return StoreError(f"{self.name}: {action} failed: {type(exc).__name__}: {exc}", file=self._where(obj))

    def _no_answer(self, obj: str | StoreObject, exc: Exception) -> StoreError:
        """The Hub could not be asked: offline mode, or the endpoint did not answer."""
        if hf_constants.HF_HUB_OFFLINE:
            why = "huggingface_hub is offline, HF_HUB_OFFLINE=1"
        else:
            endpoint = getattr(self.api, "endpoint", None)
            endpoint = endpoint if isinstance(endpoint, str) and endpoint else hf_constants.ENDPOINT
            cause = exc.__cause__ or exc.__context__
            why = f"endpoint {endpoint}" + (f": {type(cause).__name__}: {cause}" if cause is not None else "")
        return StoreError(f"{self.name} did not answer ({why}); nothing was fetched", file=self._where(obj))

    def has(self, obj: str | StoreObject, size_bytes: int | None = None, *, verify: bool = False) -> bool:
        """See :meth:`coldsnap_core.stores.base.PayloadStore.has` (``HfApi.get_paths_info``).

        The LFS SHA-256 the Hub reports is always compared with the object's (``verify`` adds nothing:
        the Hub computed it from the stored bytes); a file without LFS metadata is judged by size.
        A repository that does not exist (``RepositoryNotFoundError``) holds nothing: ``False``, and
        :meth:`upload` creates it. (The Hub answers the same for a private repository the token
        cannot read; creating it then fails with the Hub's own error, a :class:`StoreError`.)
        """
        obj = as_object(obj)
        relpath = obj.relpath
        try:
            infos: list[Any] = self.api.get_paths_info(self.repo_id, [relpath], repo_type=self.repo_type, revision=self.revision)
        except RepositoryNotFoundError:
            logger.info("coldsnap: %s does not exist (yet); it holds nothing", self.name)
            return False
        except Exception as exc:
            raise self._fail(f"looking up the {obj.what}", obj, exc) from exc
        found = [info for info in infos if isinstance(info, RepoFile) and info.path == relpath]
        if not found:
            return False
        info = found[0]
        mismatch = (
            None
            if size_bytes is None
            else size_mismatch(PackSizeMismatchError, f"stored {obj.what}", info.size, size_bytes, file=self._where(obj))
        )
        if mismatch is not None:
            logger.warning("coldsnap: %s; treating it as absent", mismatch)
            return False
        if info.lfs is not None and info.lfs.sha256 != obj.sha256:
            logger.warning(
                "coldsnap: %s has LFS SHA-256 %s, not its name; treating it as absent", self._where(obj), info.lfs.sha256
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
        """See :meth:`coldsnap_core.stores.base.PayloadStore.fetch` (``HfApi.hf_hub_download`` into ``<file>.d``, then
        one kernel copy into ``fd``: the bytes land as that copy writes them)."""
        obj = as_object(obj)
        relpath = obj.relpath
        scratch = file.with_name(file.name + ".d")
        scratch.mkdir(mode=0o700)
        try:
            try:
                downloaded = self.api.hf_hub_download(
                    self.repo_id, relpath, repo_type=self.repo_type, revision=self.revision, local_dir=scratch
                )
            except LocalEntryNotFoundError as exc:  # a subclass of EntryNotFoundError: the Hub did not answer
                raise self._no_answer(obj, exc) from exc
            except EntryNotFoundError as exc:
                raise PayloadUnavailableError(
                    f"{self.name} does not hold the {obj.what}", file=self._where(obj), remedy=NOT_IN_STORE_REMEDY
                ) from exc
            except ColdsnapError:
                raise
            except Exception as exc:
                raise self._fail(f"downloading the {obj.what}", obj, exc) from exc
            local = Path(downloaded)
            st = refuse_symlink(local)
            if st is None:
                raise StoreError(f"{self.name}: hf_hub_download returned a path that does not exist", file=local)
            mismatch = size_mismatch(PackSizeMismatchError, f"stored {obj.what}", st.st_size, size_bytes, file=self._where(obj))
            if mismatch is not None:
                raise mismatch
            copy_file(local, fd, size_bytes, target=file, progress=progress, landed=landed)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def upload(self, path: Path, obj: str | StoreObject, size_bytes: int, *, progress: ProgressCallback | None = None) -> bool:
        """See :meth:`coldsnap_core.stores.base.PayloadStore.upload` (``HfApi.create_commit``).

        Before anything is sent, the SHA-256 that ``huggingface_hub`` computed of the file (it needs
        it for LFS and Xet anyway) is compared with the object's. A missing repository is created
        first (``create_repo(exist_ok=True)``, private unless ``private=False``). The Hub has no
        conditional create: two publishers committing one obj at once both commit (the Hub keeps
        one LFS object for the SHA-256; the second may send the bytes again), so this returns ``True``.

        Raises:
            PackSizeMismatchError: ``path`` does not have ``size_bytes`` bytes (nothing uploaded).
            PackDigestMismatchError: the file does not hash to the object's SHA-256 (it changed after it was
                verified; nothing uploaded).
            StoreError: the Hub refused or failed.
        """
        obj = as_object(obj)
        relpath = obj.relpath
        operation = CommitOperationAdd(path_in_repo=relpath, path_or_fileobj=str(path))
        mismatch = size_mismatch(PackSizeMismatchError, "the file to upload", operation.upload_info.size, size_bytes, file=path)
        if mismatch is not None:
            raise mismatch
        # huggingface_hub hashed the file when it built the operation (it sends that SHA-256 as the LFS
        # oid, and the Hub refuses bytes that hash otherwise): compare before anything is committed.
        uploaded = operation.upload_info.sha256.hex()
        if uploaded != obj.sha256:
            raise PackDigestMismatchError(
                f"the file to upload to {self.name} hashes to {uploaded}, not {obj.sha256}; it changed after verification"
                " (nothing was uploaded)",
                file=path,
            )
        try:
            # exist_ok: a no-op (409) when the repository exists; creates it, private by default, when not
            self.api.create_repo(self.repo_id, repo_type=self.repo_type, private=self.private, exist_ok=True)
        except Exception as exc:
            raise self._fail(f"creating the repository {self.repo_id}", obj, exc) from exc
        try:
            self.api.create_commit(
                self.repo_id,
                [operation],
                commit_message=f"coldsnap: add {relpath}",
                repo_type=self.repo_type,
                revision=self.revision,
            )
        except Exception as exc:
            raise self._fail(f"uploading the {obj.what}", obj, exc) from exc
        if progress is not None:
            progress(size_bytes)
        logger.info("coldsnap: uploaded %s to %s", relpath, self.name)
        return True

    def put_reference(self, relpath: str, data: bytes) -> None:
        """Commit ``data`` at ``relpath`` (a commit is atomic for a reader of the revision).

        Raises:
            StoreError: the Hub refused or failed.
        """
        where = f"{self.repo_id}/{relpath}"
        try:
            self.api.create_commit(
                self.repo_id,
                [CommitOperationAdd(path_in_repo=relpath, path_or_fileobj=data)],
                commit_message=f"coldsnap: name {relpath}",
                repo_type=self.repo_type,
                revision=self.revision,
            )
        except Exception as exc:
            raise StoreError(f"{self.name}: writing the name failed: {type(exc).__name__}: {exc}", file=where) from exc

    def get_reference(self, relpath: str, max_bytes: int) -> bytes | None:
        """The bytes of ``relpath`` in the repository (at most ``max_bytes``), or ``None`` when it is absent.

        Raises:
            StoreError: the Hub did not answer or failed, or the file is over ``max_bytes``.
        """
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
                raise StoreError(f"{self.name}: reading the name failed: {type(exc).__name__}: {exc}", file=where) from exc
            with open(downloaded, "rb") as f:
                data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise StoreError(f"{self.name}: the name is over {max_bytes} bytes", file=where)
        return data
