"""A payload store in a local or shared folder (NFS, a mounted bucket, a second disk): layout, atomic upload and
consistency in ``docs/format.md`` §12.1."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from coldsnap_core._io import fsync_dir, fsync_fd, refuse_symlink, replace_file_durably
from coldsnap_core.cache.partials import create_locked_partial, sweep_dead_partials
from coldsnap_core.digests import PAYLOADS_DIRNAME, check_digest
from coldsnap_core.errors import (
    IntegrityError,
    MissingObjectError,
    NotRegularFileError,
    PackSizeMismatchError,
    PayloadUnavailableError,
    StoreError,
    UnsafePathError,
    size_mismatch,
)
from coldsnap_core.format._strict import read_document_bytes
from coldsnap_core.format.manifest import PackRef
from coldsnap_core.format.verify import verify_pack_file
from coldsnap_core.stores._copy import copy_fd, copy_file
from coldsnap_core.stores._references import ReferenceIndex
from coldsnap_core.stores.base import NOT_IN_STORE_REMEDY, LandedCallback, ProgressCallback, StoreObject, as_object, wrong_size

logger = logging.getLogger(__name__)


class LocalFolderStore(ReferenceIndex):
    """Objects at ``<root>/<relpath>`` (``root`` is created by the first upload)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.name = f"folder {self.root}"

    def __repr__(self) -> str:
        return f"LocalFolderStore({str(self.root)!r})"

    def _require_root(self) -> None:
        """``StoreError`` when the store folder does not exist (a mistyped path)."""
        if not os.path.lexists(self.root):
            raise StoreError(
                f"the payload store folder {self.root} does not exist",
                file=self.root,
                remedy="check the store path (--repo, COLDSNAP_PAYLOAD_DIR or COLDSNAP_PAYLOAD_REPO); a folder store is"
                " created by its first coldsnap publish-native",
            )

    def object_path(self, obj: str | StoreObject) -> Path:
        return self.root / as_object(obj).relpath

    def location(self, obj: str | StoreObject) -> str:
        return str(self.object_path(obj))

    def has(self, obj: str | StoreObject, size_bytes: int | None = None, *, verify: bool = False) -> bool:
        """``verify`` hashes the object in full; ``UnsafePathError``, ``NotRegularFileError`` or ``FileAccessError``
        for a symbolic link, a non-regular file or one that cannot be read."""
        obj = as_object(obj)
        path = self.object_path(obj)
        st = refuse_symlink(path)
        if st is None:
            return False
        if wrong_size(obj, st.st_size, size_bytes, file=path):
            return False
        if verify:
            try:
                verify_pack_file(path, PackRef.for_digest(obj.sha256, st.st_size))
            except MissingObjectError:
                return False
            except IntegrityError as exc:
                logger.warning("coldsnap: %s is corrupt (%s); treating it as absent", path, exc.detail)
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
        """One kernel copy, 64 MiB at a time, in order."""
        obj = as_object(obj)
        path = self.object_path(obj)
        try:
            source_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            self._require_root()
            raise PayloadUnavailableError(
                f"{self.name} does not hold the {obj.what}",
                file=path,
                remedy=NOT_IN_STORE_REMEDY,
            ) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError("refusing a symbolic link in the payload store", file=path) from exc
            raise StoreError(f"cannot open the stored pack: {exc.strerror or exc}", file=path) from exc
        try:
            st = os.fstat(source_fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegularFileError(f"the stored {obj.what} is not a regular file ({stat.filemode(st.st_mode)})", file=path)
            if mismatch := size_mismatch(PackSizeMismatchError, f"stored {obj.what}", st.st_size, size_bytes, file=path):
                raise mismatch
            copy_fd(source_fd, fd, size_bytes, source=path, target=file, progress=progress, landed=landed)
        finally:
            os.close(source_fd)

    def upload(self, path: Path, obj: str | StoreObject, size_bytes: int, *, progress: ProgressCallback | None = None) -> bool:
        """The atomic upload of ``docs/format.md`` §12.1 (``False``: another publisher's verified object was kept);
        ``IntegrityError``, ``InsufficientSpaceError`` or ``StoreError`` leave nothing published or behind."""
        obj = as_object(obj)
        digest, final = obj.sha256, self.object_path(obj)
        tmp_dir = self.root / PAYLOADS_DIRNAME / "tmp"
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store folders: {exc}", file=final.parent) from exc
        temp = tmp_dir / f"{check_digest(digest)}.{secrets.token_hex(8)}.partial"
        try:
            fd = create_locked_partial(temp)  # flock-held while this upload lives
        except OSError as exc:
            raise StoreError(f"cannot create a temporary file in the store: {exc.strerror or exc}", file=temp) from exc
        try:
            sweep_dead_partials(tmp_dir, temp)  # uploads killed earlier (their flock is free)
            copy_file(path, fd, size_bytes, target=temp, progress=progress)
            fsync_fd(fd, file=temp)
            verify_pack_file(temp, PackRef.for_digest(digest, size_bytes))
            os.fchmod(fd, 0o444)
            refuse_symlink(final)
            created = self._link_or_keep(temp, final, obj, size_bytes)
            fsync_dir(final.parent)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        logger.info("coldsnap: %s %s to %s", "uploaded" if created else "kept another publisher's", final, self.name)
        return created

    def _link_or_keep(self, temp: Path, final: Path, obj: StoreObject, size_bytes: int) -> bool:
        """Publish ``temp`` at ``final`` without replacing a good object; ``False`` when one was kept."""
        try:
            os.link(temp, final)
            return True
        except FileExistsError:
            if self.has(obj, size_bytes, verify=True):
                return False
            logger.warning("coldsnap: replacing the corrupt store object %s", final)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV):
                raise StoreError(f"cannot publish the object: {exc.strerror or exc}", file=final) from exc
        os.rename(temp, final)
        return True

    def put_reference(self, relpath: str, data: bytes) -> None:
        """Replace ``<root>/<relpath>`` with ``data`` durably; ``StoreError`` when the folder cannot be written."""
        path = self.root / relpath
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_file_durably(path, data, before_rename=refuse_symlink)
        except OSError as exc:
            raise StoreError(f"cannot write the name: {exc.strerror or exc}", file=path) from exc

    def get_reference(self, relpath: str, max_bytes: int) -> bytes | None:
        """The bytes of ``<root>/<relpath>``, or ``None`` when it does not exist; ``ManifestError`` over ``max_bytes``,
        ``StoreError`` without a store folder, else as :func:`~coldsnap_core.format._strict.read_document_bytes`."""
        try:
            return read_document_bytes(self.root / relpath, max_bytes=max_bytes)
        except MissingObjectError:
            self._require_root()
            return None
