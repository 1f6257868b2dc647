"""A payload store ``gs://bucket[/prefix]`` through ``google-cloud-storage`` (the extra ``coldsnap[gcs]``;
``docs/format.md`` §12.7): an object is created once (``if_generation_match=0``; Cloud Storage documentation, "Request
preconditions"), a corrupt one replaced under ``if_generation_match=<its generation>``."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from coldsnap_core.errors import (
    ConfigurationError,
    PayloadUnavailableError,
)
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

GCS_SCHEME = "gs://"
RETRY_BACKOFF_MAX_S = 4.0
"""The longest wait between two attempts of a request (google-cloud-storage's default retry waits up to 60 s)."""
GCS_CLIENT_VARIABLES = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST")


def parse_gs_url(spec: str) -> tuple[str, str]:
    """``gs://bucket[/prefix]`` -> ``(bucket, prefix)``; ``ConfigurationError`` for another URL, a bucket name that
    ``docs/format.md`` §12.7 refuses or a prefix :func:`~coldsnap_core.stores.base.checked_prefix` refuses."""
    if not spec.startswith(GCS_SCHEME):
        raise ConfigurationError(f"{spec!r} is not a gs://bucket/prefix URL")
    bucket, _, prefix = spec[len(GCS_SCHEME) :].partition("/")
    valid = 3 <= len(bucket) <= 63 and all(c.isascii() and (c.islower() or c.isdigit() or c in ".-_") for c in bucket)
    if not valid or not (bucket[0].isalnum() and bucket[-1].isalnum()):
        raise ConfigurationError(f"{spec!r}: {bucket!r} is not a GCS bucket name (3-63 characters of a-z, 0-9, '.', '-', '_')")
    return bucket, checked_prefix(prefix, spec=repr(spec), what="object prefix")


class GcsPayloadStore(RangedStore):
    """Objects at ``gs://<bucket>/<prefix>/<relpath>`` (coldsnap never creates the bucket); ``chunk_size_bytes``: per
    ranged read and resumable-upload chunk, a positive multiple of 256 KiB (else ``ConfigurationError``)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        chunk_size_bytes: int = RANGE_SIZE_BYTES,
        concurrency: int = DEFAULT_CONCURRENCY,
        client_settings: StoreClientSettings | None = None,
    ) -> None:
        if chunk_size_bytes % (256 << 10):
            raise ConfigurationError(f"GCS store: chunk_size_bytes ({chunk_size_bytes}) must be a multiple of 256 KiB")
        self.bucket_name = bucket
        self.url = f"{GCS_SCHEME}{bucket}"
        self.prefix = prefix.strip("/")
        self.chunk_size_bytes = chunk_size_bytes
        if client is not None:
            self.client = client
        name = f"gcs {bucket}/{self.prefix}" if self.prefix else f"gcs {bucket}"
        super().__init__(name, range_size_bytes=chunk_size_bytes, concurrency=concurrency, client_settings=client_settings)
        self._timeout_s = (self.client_settings.connect_timeout_s, self.client_settings.read_timeout_s)

    @classmethod
    def from_url(cls, spec: str, **kwargs: Any) -> GcsPayloadStore:
        return cls(*parse_gs_url(spec), **kwargs)

    def __repr__(self) -> str:
        return f"GcsPayloadStore({self.bucket_name!r}, {self.prefix!r})"

    @property
    def _retry(self) -> Any:
        """A fresh retry policy for one request: google-cloud-storage's predicate for at most ``retries`` retries (its
        ``Retry`` counts time, not attempts), back-off 1 s doubling up to :data:`RETRY_BACKOFF_MAX_S`."""
        from google.cloud.storage.retry import DEFAULT_RETRY

        settings = self.client_settings
        retryable = DEFAULT_RETRY._predicate  # google-cloud-storage's own choice of what to retry
        retry_number = itertools.count(1)

        def predicate(exc: Exception) -> bool:
            return retryable(exc) and next(retry_number) <= settings.retries

        deadline_s = (settings.retries + 1) * (settings.connect_timeout_s + settings.read_timeout_s + RETRY_BACKOFF_MAX_S)
        return (
            DEFAULT_RETRY.with_predicate(predicate)
            .with_delay(initial=1.0, maximum=RETRY_BACKOFF_MAX_S, multiplier=2.0)
            .with_timeout(deadline_s)
        )

    @functools.cached_property
    def client(self) -> Any:
        """The ``google.cloud.storage.Client`` (made on first use unless given: parsing a URL needs no google import);
        ``ConfigurationError`` when the library is missing or no client can be built (naming the variables set)."""
        try:
            import google.auth.exceptions
            from google.cloud import storage
        except ImportError as exc:
            raise ConfigurationError("a gs:// payload store needs google-cloud-storage: pip install 'coldsnap[gcs]'") from exc
        try:
            return storage.Client()
        except (google.auth.exceptions.GoogleAuthError, ValueError, OSError) as exc:
            given = ", ".join(f"{v}={os.environ[v]!r}" for v in GCS_CLIENT_VARIABLES if v in os.environ) or "none of GOOGLE_* set"
            raise ConfigurationError(
                f"{self.name}: the GCS client cannot be built from the environment ({given}): {exc}"
            ) from exc

    def stat(self, obj: StoreObject) -> ObjectStat | None:
        """The live object's size and generation, or ``None``; ``StoreError`` when the bucket does not exist."""
        bucket = self.client.bucket(self.bucket_name)
        blob = bucket.get_blob(self.key(obj), timeout=self._timeout_s, retry=self._retry)
        if blob is None and not bucket.exists(timeout=self._timeout_s, retry=self._retry):
            raise self.missing(f"bucket {self.bucket_name!r}", obj)
        return None if blob is None else ObjectStat(int(blob.size), int(blob.generation))

    @contextlib.contextmanager
    def open_range(self, obj: StoreObject, stat: ObjectStat, start: int, end: int) -> Iterator[tuple[Iterable[bytes], bool]]:
        """One ranged media download of the generation with the client's retry policy, read as it arrives."""
        url = (
            f"{self.client.api_endpoint}/download/storage/v1/b/{self.bucket_name}/o/{urllib.parse.quote(self.key(obj), safe='')}"
        )
        params = {"alt": "media", "generation": str(stat.version)}
        with self._retry(self._get)(obj, url, params, {"Range": f"bytes={start}-{end - 1}"}) as response:
            yield read1_chunks(response.raw), response.status_code == 200

    def _get(self, obj: StoreObject, url: str, params: dict[str, str], headers: dict[str, str]) -> Any:
        """The streamed response of one GET; a refusal raises google-api-core's exception for its status (retried for
        429 and 5xx), or ``PayloadUnavailableError`` for 404 (the generation is gone)."""
        from google.api_core.exceptions import from_http_status

        response = self.client._http.request("GET", url, params=params, headers=headers, stream=True, timeout=self._timeout_s)
        if response.status_code in (200, 206):
            return response
        with response:
            message = read_answer(self, self.location(obj), read1_chunks(response.raw)).decode(errors="replace")
        if response.status_code == 404:
            raise PayloadUnavailableError(
                f"{self.name} no longer holds generation {params['generation']} of the {obj.what}", file=self.location(obj)
            )
        raise from_http_status(response.status_code, message)

    def create(
        self, path: Path, obj: StoreObject, size_bytes: int, progress: ProgressCallback | None, replacing: ObjectStat | None
    ) -> bool:
        """Write the object if its live generation is ``replacing``'s (``None``: none); ``False`` when that failed."""
        blob = self.client.bucket(self.bucket_name).blob(self.key(obj), chunk_size=self.chunk_size_bytes)
        try:
            with hashing_reader(path, obj.sha256, size_bytes, progress) as reader:
                blob.upload_from_file(
                    reader,
                    size=size_bytes,
                    content_type="application/octet-stream",
                    if_generation_match=0 if replacing is None else replacing.version,
                    checksum="md5",
                    timeout=self._timeout_s,
                    retry=self._retry,  # a create under if_generation_match is idempotent
                )
        except Exception as exc:
            if class_named(exc, "PreconditionFailed") or getattr(exc, "code", None) == 412:
                return False
            raise
        return True
