"""A payload store ``az://account/container[/prefix]`` (or a connection string ending ``;Container=NAME[/prefix]``,
its key never shown) through ``azure-storage-blob`` (the extra ``coldsnap[azure]``; ``docs/format.md`` §12.8): a blob
is created once (``If-None-Match: *``), a corrupt one replaced under ``If-Match: <its ETag>``."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from coldsnap_core.errors import ConfigurationError, PayloadUnavailableError, StoreError
from coldsnap_core.settings import StoreClientSettings
from coldsnap_core.stores._ranged import (
    DEFAULT_CONCURRENCY,
    RANGE_SIZE_BYTES,
    ObjectStat,
    RangedStore,
    class_named,
    hashing_reader,
    read1_chunks,
    read_answer,
)
from coldsnap_core.stores.base import ProgressCallback, StoreObject, checked_prefix

logger = logging.getLogger(__name__)

AZURE_SCHEME = "az://"
ENDPOINT_ENV = "AZURE_STORAGE_BLOB_ENDPOINT"
KEY_ENV = "AZURE_STORAGE_KEY"
SAS_ENV = "AZURE_STORAGE_SAS_TOKEN"
RETRY_BACKOFF_S = 1.0
"""Seconds before the first retry (azure-storage-blob's ``ExponentialRetry`` waits 15 s, then 18 s, 24 s, ...)."""
RETRY_BACKOFF_MAX_S = 4.0
"""The longest wait between two attempts (a hanging account fails within seconds of back-off, not minutes)."""


def _split_container(value: str, spec_for_errors: str) -> tuple[str, str]:
    # no stripping of "/": "cont//p" and "/cont" name an empty segment, refused below, not "cont/p" and "cont"
    container, _, prefix = value.strip().partition("/")
    if not (3 <= len(container) <= 63) or not all(c.isascii() and (c.islower() or c.isdigit() or c == "-") for c in container):
        raise ConfigurationError(
            f"{spec_for_errors}: {container!r} is not an Azure container name (3-63 characters of a-z, 0-9, '-')"
        )
    return container, checked_prefix(prefix, spec=spec_for_errors, what="blob prefix")


def parse_azure_spec(spec: str) -> tuple[str, str | None, str, str]:
    """``az://account/container[/prefix]`` -> ``(account, None, container, prefix)``; a connection string ->
    ``(account, the string without Container=, container, prefix)`` (the account as ``docs/format.md`` §12.8 says).
    ``ConfigurationError``: no account, a bad container name or prefix, not one ``Container=`` (never naming the key)."""
    if spec.startswith(AZURE_SCHEME):
        account, _, rest = spec[len(AZURE_SCHEME) :].partition("/")
        if not account or not all(c.isascii() and (c.islower() or c.isdigit()) for c in account):
            raise ConfigurationError(f"{spec!r}: {account!r} is not an Azure storage account name (a-z, 0-9)")
        container, prefix = _split_container(rest, repr(spec))
        return account, None, container, prefix
    parts = [p for p in spec.strip().split(";") if p.strip()]
    container_parts = [p for p in parts if p.split("=", 1)[0].strip().lower() == "container"]
    if len(container_parts) != 1:
        raise ConfigurationError(
            "the Azure connection string needs exactly one ';Container=NAME[/prefix]' (the key is not shown)"
        )
    container, prefix = _split_container(container_parts[0].split("=", 1)[1], "the Azure connection string")
    rest = ";".join(p for p in parts if p not in container_parts)
    values = {p.split("=", 1)[0].strip().lower(): p.split("=", 1)[1].strip() for p in parts if "=" in p}
    account = values.get("accountname")
    if account is None and values.get("usedevelopmentstorage", "").lower() == "true":
        account = "devstoreaccount1"
    if account is None and values.get("blobendpoint"):
        # named by its endpoint (host[:port][/path], never a user or query): no account is not "azure ?/container"
        endpoint = urllib.parse.urlsplit(values["blobendpoint"])
        account = f"{endpoint.netloc.rpartition('@')[2]}{endpoint.path}".strip("/") or None
    if account is None:
        raise ConfigurationError(
            "the Azure connection string names no account: it needs AccountName=, BlobEndpoint= or"
            " UseDevelopmentStorage=true (the key is not shown)"
        )
    return account, rest, container, prefix


def _retry_policy(retries: int) -> Any:
    """azure-storage-blob's ``ExponentialRetry`` with ``retries`` retries of every kind, its back-off capped at
    :data:`RETRY_BACKOFF_MAX_S` (the policy has no cap of its own)."""
    from azure.storage.blob import ExponentialRetry

    class CappedExponentialRetry(ExponentialRetry):
        def get_backoff_time(self, settings: dict[str, Any]) -> float:
            return min(super().get_backoff_time(settings), RETRY_BACKOFF_MAX_S)

    return CappedExponentialRetry(
        initial_backoff=RETRY_BACKOFF_S,
        increment_base=2,
        random_jitter_range=0.5,
        retry_total=retries,
        retry_connect=retries,
        retry_read=retries,
        retry_status=retries,
    )


class AzurePayloadStore(RangedStore):
    """Block blobs at ``<container>/<prefix>/<relpath>`` of the storage ``account`` (the container is never created);
    ``connection_string`` (without ``Container=``) replaces its endpoint; ``chunk_size_bytes``: per range and block."""

    hash_before_sending = True  # staged blocks cannot be taken back

    def __init__(
        self,
        container: str,
        prefix: str = "",
        *,
        account: str,
        connection_string: str | None = None,
        service: Any = None,
        chunk_size_bytes: int = RANGE_SIZE_BYTES,
        concurrency: int = DEFAULT_CONCURRENCY,
        client_settings: StoreClientSettings | None = None,
    ) -> None:
        self.container = container
        self.prefix = prefix.strip("/")
        self.account = account
        self.url = f"{AZURE_SCHEME}{account}/{container}"
        self.chunk_size_bytes = chunk_size_bytes
        self._connection_string = connection_string
        if service is not None:
            self.service = service
        name = f"azure {account}/{container}/{self.prefix}" if self.prefix else f"azure {account}/{container}"
        super().__init__(name, range_size_bytes=chunk_size_bytes, concurrency=concurrency, client_settings=client_settings)

    @classmethod
    def from_url(cls, spec: str, **kwargs: Any) -> AzurePayloadStore:
        account, connection_string, container, prefix = parse_azure_spec(spec)
        return cls(container, prefix, account=account, connection_string=connection_string, **kwargs)

    def __repr__(self) -> str:
        return f"AzurePayloadStore({self.account!r}, {self.container!r}, {self.prefix!r})"

    @functools.cached_property
    def service(self) -> Any:
        """The ``BlobServiceClient`` (made on first use unless given) with the timeouts of ``client_settings``;
        ``ConfigurationError`` when the library is missing, or the connection string or endpoint is invalid."""
        try:
            from azure.storage.blob import BlobServiceClient
        except ImportError as exc:
            raise ConfigurationError("an az:// payload store needs azure-storage-blob: pip install 'coldsnap[azure]'") from exc
        timeouts = {
            "connection_timeout": self.client_settings.connect_timeout_s,
            "read_timeout": self.client_settings.read_timeout_s,
            "max_block_size": self.chunk_size_bytes,  # bytes per staged block
            "max_single_put_size": self.chunk_size_bytes,  # up to this, one Put Blob; beyond, blocks and Put Block List
            "retry_policy": _retry_policy(self.client_settings.retries),
        }
        connection_string = self._connection_string
        try:
            if connection_string is not None:
                return BlobServiceClient.from_connection_string(connection_string, **timeouts)
            url = os.environ.get(ENDPOINT_ENV) or f"https://{self.account}.blob.core.windows.net"
            credential: Any
            if os.environ.get(KEY_ENV):
                credential = {"account_name": self.account, "account_key": os.environ[KEY_ENV]}
            elif os.environ.get(SAS_ENV):
                credential = os.environ[SAS_ENV]
            else:
                try:
                    from azure.identity import DefaultAzureCredential
                except ImportError:
                    credential = None
                else:
                    credential = DefaultAzureCredential()
            return BlobServiceClient(url, credential=credential, **timeouts)
        except (ValueError, TypeError) as exc:
            where = (
                "the connection string" if connection_string is not None else f"{ENDPOINT_ENV}={os.environ.get(ENDPOINT_ENV)!r}"
            )
            raise ConfigurationError(f"the Azure Blob client cannot be built from {where}: {type(exc).__name__}") from exc

    def _blob(self, obj: str | StoreObject) -> Any:
        return self.service.get_blob_client(self.container, self.key(obj))

    def _refused(self, action: str, obj: str | StoreObject, code: object) -> StoreError:
        return StoreError(
            f"{self.name}: {action} failed: the storage account refused the credential ({code}); check {KEY_ENV}, "
            f"{SAS_ENV}, the connection string's AccountKey or the identity's role",
            file=self.location(obj),
        )

    def failure(self, action: str, obj: str | StoreObject, exc: BaseException) -> StoreError:
        if class_named(exc, "ClientAuthenticationError") or getattr(exc, "status_code", None) in (401, 403):
            code = getattr(exc, "error_code", None) or getattr(getattr(exc, "response", None), "status_code", "")
            return self._refused(action, obj, code)
        return super().failure(action, obj, exc)

    def _check_container(self, obj: str | StoreObject, error_code: object) -> None:
        """After a "not found": ``StoreError`` naming the container when it is what does not exist."""
        if error_code == "BlobNotFound":
            return
        if error_code != "ContainerNotFound":  # a HEAD's answer may carry no error code: ask for the container
            try:
                if self.service.get_container_client(self.container).exists():
                    return
            except Exception as exc:
                raise self.failure("looking up the container", obj, exc) from exc
        raise self.missing(f"container {self.container!r}", obj)

    def stat(self, obj: StoreObject) -> ObjectStat | None:
        """The blob's size and ETag, or ``None`` when there is none."""
        blob = self._blob(obj)  # outside the try: a missing library is a ConfigurationError
        try:
            props = blob.get_blob_properties()
        except Exception as exc:
            if class_named(exc, "ResourceNotFoundError"):
                self._check_container(obj, getattr(exc, "error_code", None))
                return None
            raise self.failure(f"looking up the {obj.what}", obj, exc) from exc
        return ObjectStat(int(props.size), str(props.etag))

    @contextlib.contextmanager
    def open_range(self, obj: StoreObject, stat: ObjectStat, start: int, end: int) -> Iterator[tuple[Iterable[bytes], bool]]:
        """One ranged ``Get Blob`` pinned to the ETag, read as it arrives (``download_blob`` would hold it whole)."""
        from azure.core.rest import HttpRequest

        blob, where = self._blob(obj), self.location(obj)
        headers = {"x-ms-range": f"bytes={start}-{end - 1}", "If-Match": str(stat.version), "x-ms-version": blob.api_version}
        response = blob._client._send_request(HttpRequest("GET", blob.url, headers=headers), stream=True)
        with contextlib.closing(response):
            raw, status = response.internal_response.raw, response.status_code
            code = response.headers.get("x-ms-error-code", "")
            if status == 404:
                raise PayloadUnavailableError(f"{self.name} no longer holds the {obj.what}", file=where)
            if status == 412:
                raise StoreError(
                    f"{self.name}: the blob changed while it was read (ETag {stat.version} no longer matches)", file=where
                )
            if status in (401, 403):
                raise self._refused(f"reading bytes {start}-{end - 1}", obj, code or status)
            if status not in (200, 206):
                message = read_answer(self, where, read1_chunks(raw)).decode(errors="replace").splitlines()
                raise StoreError(
                    f"{self.name}: reading bytes {start}-{end - 1} failed: HTTP {status} {code} {message[:1]}", file=where
                )
            yield read1_chunks(raw), status == 200

    def create(
        self, path: Path, obj: StoreObject, size_bytes: int, progress: ProgressCallback | None, replacing: ObjectStat | None
    ) -> bool:
        """Create the blob only if absent (``replacing`` ``None``) or still at ``replacing``'s ETag; ``False`` if not."""
        from azure.core import MatchConditions
        from azure.storage.blob import ContentSettings

        blob = self._blob(obj)
        condition: dict[str, Any] = (
            {"overwrite": False}
            if replacing is None
            else {"overwrite": True, "etag": replacing.version, "match_condition": MatchConditions.IfNotModified}
        )
        try:
            with hashing_reader(path, obj.sha256, size_bytes, progress) as reader:
                blob.upload_blob(
                    reader,
                    length=size_bytes,
                    max_concurrency=1,  # the reader is sequential: it hashes in order and refuses the last read on a mismatch
                    content_settings=ContentSettings(content_type="application/octet-stream"),
                    **condition,
                )
        except Exception as exc:
            if class_named(exc, "ResourceExistsError", "ResourceModifiedError"):
                return False
            raise
        return True
