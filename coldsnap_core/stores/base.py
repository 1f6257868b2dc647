"""The payload-store extension point: where packs live beyond the node-local cache (``docs/format.md`` §12).

A store holds the packs, the files of every published artifact (:func:`artifact_object`) and one name per artifact,
written last (:class:`ArtifactIndex`, §12.9). A store moves bytes; it never decides whether they are right.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from coldsnap_core.digests import PAYLOADS_DIRNAME, check_digest, pack_relpath
from coldsnap_core.errors import ConfigurationError, PackSizeMismatchError, UnsafePathError, size_mismatch

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int], object]
"""Called with a number of bytes moved since the previous call."""
LandedCallback = Callable[[int, int], object]
"""``landed(offset_bytes, size_bytes)``: those bytes of the fetched object are now written to the target file."""

NO_SUCH_NAME_REMEDY = (
    "check the name in REF (what publish-native printed: STORE/NAME), or publish the artifact under it:"
    " coldsnap publish-native ARTIFACT --repo STORE --name NAME"
)
NOT_IN_STORE_REMEDY = (
    "check the store and its prefix (the object is looked up at the location named here), or publish the artifact"
    " there (coldsnap publish-native)"
)
"""The remedy of a store that does not hold an object (``payload-available``)."""
ARTIFACTS_DIRNAME = "artifacts"
"""Top folder of the published artifacts' files in a store: ``artifacts/sha256/<digest>/...``."""
REFS_DIRNAME = "refs"
"""Top folder of the artifacts' names in a store: ``refs/<name>.json``."""
_ARTIFACT_PATH_RE = re.compile(r"(?:workers/[A-Za-z0-9._-]+/|model/)?[A-Za-z0-9._-]+")
ARTIFACT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""An artifact's name: the OCI distribution spec's tag grammar (one name is a tag, a ``refs/<name>.json``, a folder)."""


@dataclass(frozen=True, slots=True)
class StoreObject:
    """A pack (:meth:`pack`) or a published artifact's file (:func:`artifact_object`) at ``relpath`` under the store
    root; ``sha256`` of its bytes is empty when unknown (a name's reference document)."""

    relpath: str
    sha256: str

    @classmethod
    def pack(cls, digest: str) -> StoreObject:
        """The pack ``digest`` (``InvalidDigestError`` for a bad one, before any path is built)."""
        return cls(pack_relpath(digest), digest)

    @property
    def what(self) -> str:
        """``pack`` or ``file`` (of an artifact), for messages."""
        return "pack" if self.relpath.startswith(f"{PAYLOADS_DIRNAME}/") else "file"


def as_object(target: str | StoreObject) -> StoreObject:
    """``target`` itself, or the pack it names by digest (raises ``InvalidDigestError`` for a bad one)."""
    return target if isinstance(target, StoreObject) else StoreObject.pack(target)


def wrong_size(obj: StoreObject, stored_bytes: int, size_bytes: int | None, *, file: str | Path) -> bool:
    """Whether the stored ``obj`` is not ``size_bytes`` long (``None``: any size), with a WARNING: it counts as absent."""
    if size_bytes is None:
        return False
    if mismatch := size_mismatch(PackSizeMismatchError, f"stored {obj.what}", stored_bytes, size_bytes, file=file):
        logger.warning("coldsnap: %s; treating it as absent", mismatch)
    return mismatch is not None


def artifact_object(artifact_sha256: str, path: str, sha256: str) -> StoreObject:
    """``artifacts/sha256/<artifact_sha256>/<path>``, the file ``path`` of the artifact whose ``artifact.json`` hashes
    to ``artifact_sha256``; ``InvalidDigestError`` for a bad digest, ``UnsafePathError`` for a bad ``path``."""
    check_digest(artifact_sha256)
    check_digest(sha256)
    if not _ARTIFACT_PATH_RE.fullmatch(path) or any(part in (".", "..") for part in path.split("/")):
        raise UnsafePathError(f"{path!r} is not a file of an artifact (artifact.json, workers/<capsule>/<file>, model/<file>)")
    return StoreObject(f"{ARTIFACTS_DIRNAME}/sha256/{artifact_sha256}/{path}", sha256)


def check_artifact_name(name: str) -> str:
    """``name`` if it is an artifact name (:data:`ARTIFACT_NAME_RE`), else ``ConfigurationError``."""
    if not ARTIFACT_NAME_RE.fullmatch(name):
        raise ConfigurationError(
            f"{name!r} is not an artifact name: 1-128 characters of A-Za-z0-9._-, not starting with '.' or '-' (an OCI tag)"
        )
    return name


def artifact_name(folder_name: str) -> str:
    """The artifact name of a folder named ``folder_name`` (``latest`` when nothing of it is left)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", folder_name).lstrip(".-")[:128] or "latest"


def reference_relpath(name: str) -> str:
    """``refs/<name>.json``: where a store (but an OCI registry) records the artifact ``name`` (checked)."""
    return f"{REFS_DIRNAME}/{check_artifact_name(name)}.json"


@dataclass(frozen=True, slots=True)
class ListedPack:
    """One pack of an artifact, with the capsule names of the workers that name it (``worker-0-of-1``, ...)."""

    sha256: str
    size_bytes: int
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ListedFile:
    """One file of an artifact (its path in the artifact folder, its pin) published beside the packs."""

    path: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class PublishedArtifact:
    """What a name resolves to: the artifact whose ``artifact.json`` has ``sha256`` and ``size_bytes``."""

    sha256: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class ArtifactListing:
    """What a store's artifact index records of one published artifact (``annotations``: the model identity's
    ``(key, value)`` pairs; ``files``: ``artifact.json`` first, then every file it pins)."""

    name: str
    format_version: int
    annotations: tuple[tuple[str, str], ...]
    packs: tuple[ListedPack, ...]
    artifact: PublishedArtifact
    files: tuple[ListedFile, ...]


@runtime_checkable
class ArtifactIndex(Protocol):
    """A store's names of its published artifacts (``docs/format.md`` §12.9); ``record_kind``: ``manifest`` or ``name``."""

    record_kind: str

    def check_artifact(self, listing: ArtifactListing) -> None:
        """``ConfigurationError`` now, reading only, where :meth:`publish_artifact` would refuse ``listing``."""

    def publish_artifact(self, listing: ArtifactListing) -> str:
        """Record ``listing`` under its name; returns a reference to the record (``StoreError``: refused or failed)."""

    def resolve_artifact(self, name: str) -> PublishedArtifact:
        """The artifact recorded under ``name``; ``PayloadUnavailableError`` when none is, ``ManifestError`` for a
        malformed record, ``StoreError``."""


@runtime_checkable
class PayloadStore(ArtifactIndex, Protocol):
    """Where packs and published artifacts' files are fetched from and uploaded to; ``name`` is for logs."""

    name: str

    def has(self, obj: str | StoreObject, size_bytes: int | None = None, *, verify: bool = False) -> bool:
        """Whether the store holds ``obj`` (of ``size_bytes``, when given); another size or (``verify``) content is
        absent, with a WARNING, so publication replaces it. Raises ``InvalidDigestError`` (before any path or URL is
        built), ``UnsafePathError`` (a symbolic link or non-regular file), ``StoreError``."""

    def location(self, obj: str | StoreObject) -> str:
        """Where ``obj`` lives in this store, for messages (raises ``InvalidDigestError`` for a bad digest)."""

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
        """Write the bytes of ``obj`` to ``fd`` of the temporary ``file`` (scratch space: ``<file>.d``); ``landed``
        follows each write, from any thread; what it raises stops the fetch.

        Raises:
            InvalidDigestError: bad digest.
            PayloadUnavailableError: the store does not hold the object.
            PackSizeMismatchError: the stored object does not have ``size_bytes`` bytes.
            InsufficientSpaceError: the local file system filled up.
            StoreError: any other failure of the store.
        """

    def upload(self, path: Path, obj: str | StoreObject, size_bytes: int, *, progress: ProgressCallback | None = None) -> bool:
        """Store the verified local file ``path`` as ``obj``, atomically; ``False`` when another publisher's was kept.
        Raises ``InvalidDigestError``, ``IntegrityError`` (the bytes sent do not hash to the digest), ``StoreError``."""


PACK_NAME_BYTES = len("/model-payloads/sha256/") + 64 + len(".pack")
"""Bytes a pack's object name adds after a key prefix (``/model-payloads/sha256/<digest>.pack``)."""
OBJECT_NAME_MAX_BYTES = 1024
"""The longest object name S3, Cloud Storage and Azure Blob take (UTF-8 bytes)."""
URL_REFUSED_CHARACTERS = re.compile(r"[?#%\\\s\x00-\x1f\x7f]")
"""What a store URL or key prefix never holds (``docs/format.md`` §12)."""


def refused_character_message(what: str, text: str) -> str | None:
    """Why ``text`` (``what``: a store URL, a prefix) is refused, naming the character, never ``text``; or ``None``."""
    bad = URL_REFUSED_CHARACTERS.search(text)
    if bad is None:
        return None
    return (
        f"{what} must not hold {bad.group()!r} (character {bad.start()}): no query string ('?'), fragment ('#'),"
        " percent-escape ('%'), backslash, whitespace or control character"
    )


def checked_prefix(prefix: str, *, spec: str, what: str) -> str:
    """A store URL's key prefix without its optional trailing ``/``; ``ConfigurationError`` for a refused character,
    an empty, ``.`` or ``..`` segment (``gs://b//p`` is not ``p``), or one too long with a pack's name."""
    refused = refused_character_message(f"the {what}", prefix)
    if refused:
        raise ConfigurationError(refused)
    trimmed = prefix.removesuffix("/")
    if prefix and (not trimmed or any(part in ("", ".", "..") for part in trimmed.split("/"))):
        raise ConfigurationError(f"{spec}: the {what} {prefix!r} has an empty, '.' or '..' segment")
    if len(trimmed.encode()) + PACK_NAME_BYTES > OBJECT_NAME_MAX_BYTES:
        raise ConfigurationError(
            f"{spec}: the {what} is {len(trimmed.encode())} bytes long; with a pack's name"
            f" ({PACK_NAME_BYTES} bytes) it must fit the {OBJECT_NAME_MAX_BYTES}-byte object name limit"
        )
    return trimmed
