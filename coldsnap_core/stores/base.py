"""The payload-store extension point: where packs live beyond the node-local cache.

A store holds content-addressed objects at ``model-payloads/sha256/<digest>.pack`` (the same relative
path as the cache; :func:`coldsnap_core.digests.pack_relpath`), so every path is derived from the
digest alone: recipes and capture IDs cannot choose the committed object path (``docs/format.md`` §1).
Implementations: :class:`coldsnap_core.stores.local.LocalFolderStore` (a local or shared folder),
:class:`coldsnap_core.stores.hf.HfPayloadStore` (a Hugging Face repository),
:class:`coldsnap_core.stores.s3.S3PayloadStore` (an S3-compatible bucket),
:class:`coldsnap_core.stores.gcs.GcsPayloadStore` (Google Cloud Storage),
:class:`coldsnap_core.stores.azure.AzurePayloadStore` (Azure Blob) and
:class:`coldsnap_core.stores.oci.OciPayloadStore` (an OCI registry: the blob ``sha256:<digest>`` of a
repository, no path; it is also an :class:`ArtifactIndex`).

A store moves bytes; it never decides whether they are right. Staging hashes every fetched object in full, as its
bytes land, before the cache commits it, and publication runs the one verifier
(:func:`coldsnap_core.format.verify.verify_pack_file`) on every local object before upload.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from coldsnap_core.errors import ConfigurationError

ProgressCallback = Callable[[int], object]
"""Called with a number of bytes moved since the previous call."""
LandedCallback = Callable[[int, int], object]
"""``landed(offset_bytes, size_bytes)``: those bytes of the fetched object are now written to the target file."""


@runtime_checkable
class PayloadStore(Protocol):
    """A place packs can be fetched from and uploaded to.

    Attributes:
        name: a short human-readable description for logs (``folder /mnt/payloads``,
            ``hf org/name@main``).
    """

    name: str

    def has(self, digest: str, size_bytes: int | None = None, *, verify: bool = False) -> bool:
        """Whether the store holds ``digest`` (with ``size_bytes`` bytes, when given).

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

    def location(self, digest: str) -> str:
        """Where the object ``digest`` lives in this store, for error messages (a path or
        ``org/name/model-payloads/sha256/<digest>.pack``).

        Raises:
            InvalidDigestError: bad digest.
        """
        ...

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
        """Write the object's bytes to ``fd`` (open for writing, at offset 0) of the file ``file``.

        ``file`` is a unique temporary file in the node-local cache's ``tmp/``; a store that needs
        scratch space uses the folder ``<file>.d`` (removed by the cache with the temporary). ``landed`` is
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

    def upload(self, path: Path, digest: str, size_bytes: int, *, progress: ProgressCallback | None = None) -> bool:
        """Store the (already verified) local file ``path`` as the object ``digest``, atomically.

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
class ArtifactListing:
    """What a store's artifact index records of one published artifact.

    Attributes:
        name: the artifact folder's name.
        format_version: the artifact format version (``docs/format.md`` §16).
        annotations: ``(key, value)`` pairs naming the model identity (``model.source``,
            ``model.revision``, ``model.config-sha256``, ``model.sha256``: the SHA-256 of the identity's JSON).
        packs: every distinct pack the artifact's workers name.
    """

    name: str
    format_version: int
    annotations: tuple[tuple[str, str], ...]
    packs: tuple[ListedPack, ...]


@runtime_checkable
class ArtifactIndex(Protocol):
    """A store that also records which packs make up an artifact (an OCI registry: one manifest per
    artifact, ``docs/format.md`` §12.6). Publication calls it once per artifact, after every pack is in
    the store; staging never needs it (packs are fetched by digest)."""

    def check_artifact(self, listing: ArtifactListing) -> None:
        """Refuse now, reading only, what :meth:`publish_artifact` would refuse for ``listing`` (a tag naming
        another artifact): publication calls it for every artifact before it uploads any pack, and a dry run too.

        Raises:
            ConfigurationError: the record would be refused.
            StoreError: the store failed.
        """
        ...

    def publish_artifact(self, listing: ArtifactListing) -> str:
        """Record ``listing``; returns a reference to the record (for the log and the CLI).

        Raises:
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
