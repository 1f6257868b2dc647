"""The payload-store extension point: where packs live beyond the node-local cache.

A store holds content-addressed objects at ``model-payloads/sha256/<digest>.pack`` (the same relative
path as the cache; :func:`coldsnap_core.digests.pack_relpath`), so every path is derived from the
digest alone: recipes and capture IDs cannot choose the committed object path (``docs/format.md`` §1).
Implementations (each also an :class:`ArtifactIndex`): :class:`coldsnap_core.stores.local.LocalFolderStore` (a local or shared folder),
:class:`coldsnap_core.stores.hf.HfPayloadStore` (a Hugging Face repository),
:class:`coldsnap_core.stores.s3.S3PayloadStore` (an S3-compatible bucket),
:class:`coldsnap_core.stores.gcs.GcsPayloadStore` (Google Cloud Storage),
:class:`coldsnap_core.stores.azure.AzurePayloadStore` (Azure Blob) and
:class:`coldsnap_core.stores.oci.OciPayloadStore` (an OCI registry: the blob ``sha256:<digest>`` of a
repository, no path).

Beside the packs a store holds the files of every artifact published to it (:func:`artifact_object`:
``artifacts/sha256/<SHA-256 of artifact.json>/<path in the artifact>``, immutable) and one name per artifact,
written last (:class:`ArtifactIndex`: ``refs/<name>.json``; an OCI registry's tag), ``docs/format.md`` §12.9. Every
method that moves an object takes a pack's digest or a :class:`StoreObject`.

A store moves bytes; it never decides whether they are right. Staging hashes every fetched object in full, as its
bytes land, before the cache commits it, publication runs the one verifier
(:func:`coldsnap_core.format.verify.verify_pack_file`) on every local object before upload, and a pull checks every
file against its pin.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from coldsnap_core.digests import PAYLOADS_DIRNAME, check_digest, pack_relpath
from coldsnap_core.errors import ConfigurationError, UnsafePathError

ProgressCallback = Callable[[int], object]
"""Called with a number of bytes moved since the previous call."""
LandedCallback = Callable[[int, int], object]
"""``landed(offset_bytes, size_bytes)``: those bytes of the fetched object are now written to the target file."""


NO_SUCH_NAME_REMEDY = (
    "check the name in REF (what publish-native printed: STORE/NAME), or publish the artifact under it:"
    " coldsnap publish-native ARTIFACT --repo STORE --name NAME"
)
"""The remedy of a name (or OCI tag) the store records no artifact under: the missing-pack remedy would send the
operator to stage a pack the name does not lead to."""

ARTIFACTS_DIRNAME = "artifacts"
"""Top folder of the published artifacts' files in a store: ``artifacts/sha256/<digest>/...``."""
REFS_DIRNAME = "refs"

NOT_IN_STORE_REMEDY = (
    "check the store and its prefix (the object is looked up at the location named here), or publish the artifact"
    " there (coldsnap publish-native)"
)
"""The remedy of a store that does not hold an object (``payload-available``): a wrong prefix or store is the usual
cause, an artifact never published the other one."""
"""Top folder of the artifacts' names in a store: ``refs/<name>.json``."""
_ARTIFACT_PATH_RE = re.compile(r"(?:workers/[A-Za-z0-9._-]+/|model/)?[A-Za-z0-9._-]+")
ARTIFACT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
"""An artifact's name in a store: the OCI distribution spec's tag grammar (1-128 characters of ``A-Za-z0-9._-``, not
starting with ``.`` or ``-``), so one name is a tag, a ``refs/<name>.json`` object and a path segment everywhere."""


@dataclass(frozen=True, slots=True)
class StoreObject:
    """One object of a store: its path under the store root (or key prefix) and the SHA-256 of its bytes.

    A pack is ``StoreObject.pack(digest)`` (``model-payloads/sha256/<digest>.pack``); a file of a published artifact
    is :func:`artifact_object`. An OCI registry addresses both as the blob of their SHA-256.

    Attributes:
        relpath: the object's path relative to the store root (``/``-separated, no ``.`` or ``..``).
        sha256: the SHA-256 (lowercase hex) of its bytes; empty for a name's reference document read before its
            content is known.
    """

    relpath: str
    sha256: str

    @classmethod
    def pack(cls, digest: str) -> StoreObject:
        """The pack ``digest``.

        Raises:
            InvalidDigestError: bad digest (before any path is built).
        """
        return cls(pack_relpath(digest), digest)

    @property
    def what(self) -> str:
        """``pack`` or ``file`` (of an artifact), for messages."""
        return "pack" if self.relpath.startswith(f"{PAYLOADS_DIRNAME}/") else "file"


def as_object(target: str | StoreObject) -> StoreObject:
    """``target`` itself, or the pack it names by digest.

    Raises:
        InvalidDigestError: a digest that is not 64 lowercase hex characters.
    """
    return target if isinstance(target, StoreObject) else StoreObject.pack(target)


def artifact_object(artifact_sha256: str, path: str, sha256: str) -> StoreObject:
    """The file ``path`` of the artifact whose ``artifact.json`` hashes to ``artifact_sha256``, with content
    ``sha256``: ``artifacts/sha256/<artifact_sha256>/<path>``.

    Raises:
        InvalidDigestError: a digest that is not 64 lowercase hex characters.
        UnsafePathError: ``path`` is not ``artifact.json``, ``workers/<capsule>/<file>`` or ``model/<file>`` of
            names of ``A-Za-z0-9._-`` (never ``.`` or ``..``).
    """
    check_digest(artifact_sha256)
    check_digest(sha256)
    if not _ARTIFACT_PATH_RE.fullmatch(path) or any(part in (".", "..") for part in path.split("/")):
        raise UnsafePathError(f"{path!r} is not a file of an artifact (artifact.json, workers/<capsule>/<file>, model/<file>)")
    return StoreObject(f"{ARTIFACTS_DIRNAME}/sha256/{artifact_sha256}/{path}", sha256)


def check_artifact_name(name: str) -> str:
    """``name`` if it is an artifact name (:data:`ARTIFACT_NAME_RE`).

    Raises:
        ConfigurationError: anything else.
    """
    if not ARTIFACT_NAME_RE.fullmatch(name):
        raise ConfigurationError(
            f"{name!r} is not an artifact name: 1-128 characters of A-Za-z0-9._-, not starting with '.' or '-' (an OCI tag)"
        )
    return name


def artifact_name(folder_name: str) -> str:
    """The artifact name of an artifact folder named ``folder_name``: characters outside ``A-Za-z0-9._-`` become
    ``-``, leading ``.`` and ``-`` are dropped, at most 128 characters (``latest`` when nothing is left)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", folder_name).lstrip(".-")[:128] or "latest"


def reference_relpath(name: str) -> str:
    """``refs/<name>.json``: where a store (but an OCI registry) records the artifact named ``name``.

    Raises:
        ConfigurationError: ``name`` is not an artifact name.
    """
    return f"{REFS_DIRNAME}/{check_artifact_name(name)}.json"


@dataclass(frozen=True, slots=True)
class ListedPack:
    """One pack of an artifact, as a store's artifact index lists it.

    Attributes:
        sha256: the pack's digest (lowercase hex, 64 characters).
        size_bytes: its size in bytes.
        workers: the capsule names of the workers that name it (``worker-0-of-1``, ...).
    """

    sha256: str
    size_bytes: int
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ListedFile:
    """One file of an artifact as it is published beside the packs (``docs/format.md`` §12.9).

    Attributes:
        path: its path in the artifact folder (``artifact.json``, ``workers/<capsule>/<file>``, ``model/<file>``).
        sha256: the SHA-256 of its bytes (its pin in ``artifact.json``; for ``artifact.json`` itself, the artifact's
            digest).
        size_bytes: its size in bytes.
    """

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
    """What a store's artifact index records of one published artifact.

    Attributes:
        name: the artifact's name (``publish-native --name``, else the artifact folder's name).
        format_version: the artifact format version (``docs/format.md`` §16).
        annotations: ``(key, value)`` pairs naming the model identity (``model.source``,
            ``model.revision``, ``model.config-sha256``, ``model.sha256``: the SHA-256 of the identity's JSON).
        packs: every distinct pack the artifact's workers name.
        artifact: what the name designates: the SHA-256 and size of the artifact's ``artifact.json``.
        files: the artifact's own files (``artifact.json`` first, then every file it pins).
    """

    name: str
    format_version: int
    annotations: tuple[tuple[str, str], ...]
    packs: tuple[ListedPack, ...]
    artifact: PublishedArtifact
    files: tuple[ListedFile, ...]


@runtime_checkable
class ArtifactIndex(Protocol):
    """A store's names of the artifacts published to it (``docs/format.md`` §12.9): a small reference document
    ``refs/<name>.json`` (:mod:`coldsnap_core.stores._references`), or an OCI registry's tag of one manifest per
    artifact (§12.6). Publication records each artifact after its packs and files are in the store, so a reader that
    finds the name finds everything it names; staging never needs it (packs are fetched by digest), a pull starts
    from it.

    Attributes:
        record_kind: what a record is called in the command's output (``manifest``, ``name``).
    """

    record_kind: str

    def check_artifact(self, listing: ArtifactListing) -> None:
        """Refuse now, reading only, what :meth:`publish_artifact` would refuse for ``listing`` (a tag naming
        another artifact): publication calls it for every artifact before it uploads any pack, and a dry run too.

        Raises:
            ConfigurationError: the record would be refused.
            StoreError: the store failed.
        """
        ...

    def publish_artifact(self, listing: ArtifactListing) -> str:
        """Record ``listing`` under its name; returns a reference to the record (for the log and the CLI).

        Raises:
            StoreError: the store refused or failed.
        """
        ...

    def resolve_artifact(self, name: str) -> PublishedArtifact:
        """The artifact recorded under ``name``.

        Raises:
            PayloadUnavailableError: nothing is recorded under ``name``.
            ManifestError: the record is malformed.
            StoreError: the store failed.
        """
        ...


@runtime_checkable
class PayloadStore(ArtifactIndex, Protocol):
    """A place packs (and the published artifacts' files) can be fetched from and uploaded to, and whose artifact
    index names the artifacts published to it.

    Attributes:
        name: a short human-readable description for logs (``folder /mnt/payloads``,
            ``hf org/name@main``).
    """

    name: str

    def has(self, obj: str | StoreObject, size_bytes: int | None = None, *, verify: bool = False) -> bool:
        """Whether the store holds ``obj`` (a pack's digest, or a :class:`StoreObject`) with ``size_bytes`` bytes,
        when given.

        An object whose size (or store-reported SHA-256) disagrees is reported absent, with a
        WARNING, so that publication replaces it. With ``verify``, the store also checks the
        object's content as far as it can (a folder store hashes it in full; the Hugging Face
        store compares the LFS SHA-256 the Hub reports, which it always does): a corrupt object is
        reported absent, with a WARNING.

        Raises:
            InvalidDigestError: bad digest (before any path or URL is built).
            UnsafePathError: the object path is a symbolic link or not a regular file.
            StoreError: the store cannot be queried.
        """
        ...

    def location(self, obj: str | StoreObject) -> str:
        """Where the object ``obj`` lives in this store, for error messages (a path or
        ``org/name/model-payloads/sha256/<digest>.pack``).

        Raises:
            InvalidDigestError: bad digest.
        """
        ...

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
        """Write the bytes of ``obj`` to ``fd`` (open for writing, at offset 0) of the file ``file``.

        ``file`` is a unique temporary file (in the node-local cache's ``tmp/``, or a pull's staging folder); a store
        that needs scratch space uses the folder ``<file>.d`` (removed by the caller with the temporary). ``landed`` is
        called with ``(offset_bytes, size_bytes)`` once those bytes are written to ``fd``, from any of the fetch's
        threads, in any order across ranges and in order within one; whatever it raises stops the fetch and is
        raised (staging hashes the bytes in order right behind the landed prefix).

        Raises:
            InvalidDigestError: bad digest.
            PayloadUnavailableError: the store does not hold the object.
            PackSizeMismatchError: the stored object does not have ``size_bytes`` bytes.
            InsufficientSpaceError: the local file system filled up.
            StoreError: any other failure of the store.
        """
        ...

    def upload(self, path: Path, obj: str | StoreObject, size_bytes: int, *, progress: ProgressCallback | None = None) -> bool:
        """Store the (already verified) local file ``path`` as the object ``obj``, atomically.

        Returns:
            ``True`` when this call created (or replaced a corrupt) object; ``False`` when another
            publisher created the same digest meanwhile and it was kept (a store with a conditional
            create: the folder store's no-replace link, S3's ``If-None-Match: *``).

        Raises:
            InvalidDigestError: bad digest.
            IntegrityError: the bytes that reached the store do not hash to ``digest``.
            StoreError: the store refused or failed.
        """
        ...


PACK_NAME_BYTES = len("/model-payloads/sha256/") + 64 + len(".pack")
"""Bytes a pack's object name adds after a key prefix (``/model-payloads/sha256/<digest>.pack``)."""
OBJECT_NAME_MAX_BYTES = 1024
"""The longest object name S3, Cloud Storage and Azure Blob take (UTF-8 bytes; Azure counts characters, the same
for the ASCII a pack's name is)."""


URL_REFUSED_CHARACTERS = re.compile(r"[?#%\\\s\x00-\x1f\x7f]")
"""What a store URL or key prefix never holds: a query string or fragment (a SAS token or a presigned signature
would be kept as part of the key prefix), a percent-escape (``%2F..%2F`` is not decoded), a backslash, whitespace
or a control character (``docs/format.md`` §12)."""


def refused_character_message(what: str, text: str) -> str | None:
    """Why ``text`` (``what``: a store URL, a prefix) is refused by :data:`URL_REFUSED_CHARACTERS`, or ``None``.
    The message names the character and its position, never ``text`` (it may hold a signature)."""
    bad = URL_REFUSED_CHARACTERS.search(text)
    if bad is None:
        return None
    return (
        f"{what} must not hold {bad.group()!r} (character {bad.start()}): no query string ('?'), fragment ('#'),"
        " percent-escape ('%'), backslash, whitespace or control character"
    )


def checked_prefix(prefix: str, *, spec: str, what: str) -> str:
    """A store URL's key prefix (what follows the bucket or container and its ``/``) without its one optional
    trailing ``/``.

    Every segment must be non-empty and neither ``.`` nor ``..``: ``gs://bucket//p`` names the object prefix ``/p``,
    which is not ``p``, so it is refused rather than silently read as ``p``.

    Raises:
        ConfigurationError: a character of :data:`URL_REFUSED_CHARACTERS`, an empty, ``.`` or ``..`` segment
            (``what`` names the prefix, ``spec`` the setting),
            or a prefix too long for an object name of at most :data:`OBJECT_NAME_MAX_BYTES` bytes.
    """
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
