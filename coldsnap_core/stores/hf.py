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
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import validate_repo_id

from coldsnap_core._io import refuse_symlink
from coldsnap_core.digests import check_digest, pack_relpath
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
from coldsnap_core.stores.base import LandedCallback, ProgressCallback

logger = logging.getLogger(__name__)

REPO_TYPES = ("model", "dataset")


class HfPayloadStore:
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

    def _where(self, digest: str) -> str:
        return f"{self.repo_id}/{pack_relpath(digest)}"

    def location(self, digest: str) -> str:
        """See :meth:`coldsnap_core.stores.base.PayloadStore.location`: ``org/name/model-payloads/sha256/<digest>.pack``."""
        return self._where(digest)

    def _fail(self, action: str, digest: str, exc: Exception) -> StoreError:
        return StoreError(f"{self.name}: {action} failed: {type(exc).__name__}: {exc}", file=self._where(digest))

    def _no_answer(self, digest: str, exc: Exception) -> StoreError:
        """The Hub could not be asked: offline mode, or the endpoint did not answer."""
        if hf_constants.HF_HUB_OFFLINE:
            why = "huggingface_hub is offline, HF_HUB_OFFLINE=1"
        else:
            endpoint = getattr(self.api, "endpoint", None)
            endpoint = endpoint if isinstance(endpoint, str) and endpoint else hf_constants.ENDPOINT
            cause = exc.__cause__ or exc.__context__
            why = f"endpoint {endpoint}" + (f": {type(cause).__name__}: {cause}" if cause is not None else "")
        return StoreError(f"{self.name} did not answer ({why}); nothing was fetched", file=self._where(digest))

    def has(self, digest: str, size_bytes: int | None = None, *, verify: bool = False) -> bool:
        """See :meth:`coldsnap_core.stores.base.PayloadStore.has` (``HfApi.get_paths_info``).

        The LFS SHA-256 the Hub reports is always compared with ``digest`` (``verify`` adds nothing:
        the Hub computed it from the stored bytes); a file without LFS metadata is judged by size.
        A repository that does not exist (``RepositoryNotFoundError``) holds nothing: ``False``, and
        :meth:`upload` creates it. (The Hub answers the same for a private repository the token
        cannot read; creating it then fails with the Hub's own error, a :class:`StoreError`.)
        """
        relpath = pack_relpath(digest)
        try:
            infos: list[Any] = self.api.get_paths_info(self.repo_id, [relpath], repo_type=self.repo_type, revision=self.revision)
        except RepositoryNotFoundError:
            logger.info("coldsnap: %s does not exist (yet); it holds no pack", self.name)
            return False
        except Exception as exc:
            raise self._fail("looking up the pack", digest, exc) from exc
        found = [info for info in infos if isinstance(info, RepoFile) and info.path == relpath]
        if not found:
            return False
        info = found[0]
        mismatch = (
            None
            if size_bytes is None
            else size_mismatch(PackSizeMismatchError, "stored pack", info.size, size_bytes, file=self._where(digest))
        )
        if mismatch is not None:
            logger.warning("coldsnap: %s; treating it as absent", mismatch)
            return False
        if info.lfs is not None and info.lfs.sha256 != digest:
            logger.warning(
                "coldsnap: %s has LFS SHA-256 %s, not its name; treating it as absent", self._where(digest), info.lfs.sha256
            )
            return False
        return True

    def fetch(
        self,
        digest: str,
        size_bytes: int,
        fd: int,
        *,
        file: Path,
        progress: ProgressCallback | None = None,
        landed: LandedCallback | None = None,
    ) -> None:
        """See :meth:`coldsnap_core.stores.base.PayloadStore.fetch` (``HfApi.hf_hub_download`` into ``<file>.d``, then
        one kernel copy into ``fd``: the bytes land as that copy writes them)."""
        relpath = pack_relpath(digest)
        scratch = file.with_name(file.name + ".d")
        scratch.mkdir(mode=0o700)
        try:
            try:
                downloaded = self.api.hf_hub_download(
                    self.repo_id, relpath, repo_type=self.repo_type, revision=self.revision, local_dir=scratch
                )
            except LocalEntryNotFoundError as exc:  # a subclass of EntryNotFoundError: the Hub did not answer
                raise self._no_answer(digest, exc) from exc
            except EntryNotFoundError as exc:
                raise PayloadUnavailableError(f"{self.name} does not hold the pack", file=self._where(digest)) from exc
            except ColdsnapError:
                raise
            except Exception as exc:
                raise self._fail("downloading the pack", digest, exc) from exc
            local = Path(downloaded)
            st = refuse_symlink(local)
            if st is None:
                raise StoreError(f"{self.name}: hf_hub_download returned a path that does not exist", file=local)
            mismatch = size_mismatch(PackSizeMismatchError, "stored pack", st.st_size, size_bytes, file=self._where(digest))
            if mismatch is not None:
                raise mismatch
            copy_file(local, fd, size_bytes, target=file, progress=progress, landed=landed)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def upload(self, path: Path, digest: str, size_bytes: int, *, progress: ProgressCallback | None = None) -> bool:
        """See :meth:`coldsnap_core.stores.base.PayloadStore.upload` (``HfApi.create_commit``).

        Before anything is sent, the SHA-256 that ``huggingface_hub`` computed of the file (it needs
        it for LFS and Xet anyway) is compared with ``digest``. A missing repository is created
        first (``create_repo(exist_ok=True)``, private unless ``private=False``). The Hub has no
        conditional create: two publishers committing one digest at once both commit (the Hub keeps
        one LFS object for the SHA-256; the second may send the bytes again), so this returns ``True``.

        Raises:
            PackSizeMismatchError: ``path`` does not have ``size_bytes`` bytes (nothing uploaded).
            PackDigestMismatchError: the file does not hash to ``digest`` (it changed after it was
                verified; nothing uploaded).
            StoreError: the Hub refused or failed.
        """
        relpath = pack_relpath(check_digest(digest))
        operation = CommitOperationAdd(path_in_repo=relpath, path_or_fileobj=str(path))
        mismatch = size_mismatch(PackSizeMismatchError, "the file to upload", operation.upload_info.size, size_bytes, file=path)
        if mismatch is not None:
            raise mismatch
        # huggingface_hub hashed the file when it built the operation (it sends that SHA-256 as the LFS
        # oid, and the Hub refuses bytes that hash otherwise): compare before anything is committed.
        uploaded = operation.upload_info.sha256.hex()
        if uploaded != digest:
            raise PackDigestMismatchError(
                f"the file to upload to {self.name} hashes to {uploaded}, not {digest}; it changed after verification"
                " (nothing was uploaded)",
                file=path,
            )
        try:
            # exist_ok: a no-op (409) when the repository exists; creates it, private by default, when not
            self.api.create_repo(self.repo_id, repo_type=self.repo_type, private=self.private, exist_ok=True)
        except Exception as exc:
            raise self._fail(f"creating the repository {self.repo_id}", digest, exc) from exc
        try:
            self.api.create_commit(
                self.repo_id,
                [operation],
                commit_message=f"coldsnap: add model payload {digest}",
                repo_type=self.repo_type,
                revision=self.revision,
            )
        except Exception as exc:
            raise self._fail("uploading the pack", digest, exc) from exc
        if progress is not None:
            progress(size_bytes)
        logger.info("coldsnap: uploaded %s to %s", digest, self.name)
        return True
