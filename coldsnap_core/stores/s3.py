"""A payload store ``s3://bucket[/prefix]`` through ``boto3`` (the extra ``coldsnap[s3]``; ``docs/format.md`` §12.2):
an object is created once, ``If-None-Match: *`` (S3 User Guide, "Add preconditions to S3 operations with conditional
requests"), the server checking its SHA-256."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from coldsnap_core.errors import (
    ConfigurationError,
    PayloadUnavailableError,
    StoreError,
    redact_store_spec,
)
from coldsnap_core.settings import StoreClientSettings
from coldsnap_core.stores._ranged import (
    ANSWER_MAX_BYTES,
    DEFAULT_CONCURRENCY,
    ObjectStat,
    RangedStore,
    byte_ranges,
    hashing_reader,
    read1_chunks,
    request_failure,
)
from coldsnap_core.stores.base import ProgressCallback, StoreObject, checked_prefix

logger = logging.getLogger(__name__)

S3_SCHEME = "s3://"
PART_SIZE_BYTES = 64 << 20
"""Bytes per multipart part and per ranged GET (64 MiB; S3 parts are 5 MiB to 5 GiB, at most 10,000)."""
MAX_PARTS = 10_000
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}
_CONDITION_FAILED_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


def _error_code(exc: Exception) -> str | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None if code is None else str(code)


def parse_s3_url(spec: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` -> ``(bucket, prefix)``; ``ConfigurationError`` for another URL, a bucket name
    outside 3-63 characters of ``a-z 0-9 . -`` or a prefix :func:`~coldsnap_core.stores.base.checked_prefix` refuses."""
    if not spec.startswith(S3_SCHEME):
        raise ConfigurationError(f"{spec!r} is not an s3://bucket/prefix URL")
    bucket, _, prefix = spec[len(S3_SCHEME) :].partition("/")
    if not (3 <= len(bucket) <= 63) or not all(c.isascii() and (c.islower() or c.isdigit() or c in ".-") for c in bucket):
        raise ConfigurationError(f"{spec!r}: {bucket!r} is not an S3 bucket name (3-63 characters of a-z, 0-9, '.', '-')")
    return bucket, checked_prefix(prefix, spec=repr(spec), what="key prefix")


S3_CLIENT_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_S3_ADDRESSING_STYLE",
    "AWS_RETRY_MODE",
    "AWS_MAX_ATTEMPTS",
)


def _default_client(client_settings: StoreClientSettings | None = None) -> Any:
    """A boto3 S3 client with the timeouts and retries of ``client_settings`` (unless ``AWS_RETRY_MODE`` /
    ``AWS_MAX_ATTEMPTS`` say otherwise); ``ConfigurationError`` when boto3 is missing or the client cannot be built."""
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError
    except ImportError as exc:  # the optional extra is not installed
        raise ConfigurationError("an s3:// payload store needs boto3: pip install 'coldsnap[s3]'") from exc
    client_settings = client_settings or StoreClientSettings()
    style = os.environ.get("AWS_S3_ADDRESSING_STYLE", "path")
    retries: dict[str, Any] = {"mode": os.environ.get("AWS_RETRY_MODE", "standard")}
    if "AWS_MAX_ATTEMPTS" not in os.environ:  # botocore reads the variable itself when it is set
        retries["total_max_attempts"] = client_settings.retries + 1
    try:
        config = Config(
            s3={"addressing_style": style},
            max_pool_connections=DEFAULT_CONCURRENCY * 2,
            connect_timeout=client_settings.connect_timeout_s,
            read_timeout=client_settings.read_timeout_s,
            retries=retries,
            # boto3 >= 1.36 adds CRC checksums to every upload by default; the store sends SHA-256 itself.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        client = boto3.client("s3", config=config)
    except (ValueError, BotoCoreError) as exc:
        given = ", ".join(f"{v}={os.environ[v]!r}" for v in S3_CLIENT_VARIABLES if v in os.environ) or "no AWS_* variable set"
        # an endpoint's user:password@ (and botocore's message quoting it) never reaches a message, a log or an outcome
        raise ConfigurationError(
            redact_store_spec(f"the S3 client cannot be built from the environment ({given}): {exc}")
        ) from None
    client.meta.events.register("before-send.s3", _capped_answers(client))
    return client


def _capped_answers(client: Any) -> Callable[..., Any]:
    """A ``before-send`` handler reading at most :data:`~coldsnap_core.stores._ranged.ANSWER_MAX_BYTES` of every
    answer botocore would read whole (all but a ``GetObject``'s body): a proxy's endless error body costs 64 KiB."""

    def send(request: Any, **_: Any) -> Any:
        streaming, request.stream_output = request.stream_output, True  # botocore then leaves the body unread
        response = client._endpoint.http_session.send(request)
        if response.status_code >= 300 or not streaming:
            body = b"".join(itertools.islice(read1_chunks(response.raw), 64))  # 64 socket reads at most: no drip holds it
            response.raw.close()
            response._content = body[:ANSWER_MAX_BYTES]  # what AWSResponse.content returns from now on
        return response

    return send


class S3PayloadStore(RangedStore):
    """Objects at ``s3://<bucket>/<prefix>/<relpath>`` (the bucket is never created); ``part_size_bytes``: per part and GET."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        part_size_bytes: int = PART_SIZE_BYTES,
        concurrency: int = DEFAULT_CONCURRENCY,
        client_settings: StoreClientSettings | None = None,
    ) -> None:
        self.bucket = bucket
        self.url = f"{S3_SCHEME}{bucket}"
        self.prefix = prefix.strip("/")
        self.part_size_bytes = part_size_bytes
        self._client = client
        name = f"s3 {bucket}/{self.prefix}" if self.prefix else f"s3 {bucket}"
        super().__init__(name, range_size_bytes=part_size_bytes, concurrency=concurrency, client_settings=client_settings)

    @classmethod
    def from_url(cls, spec: str, **kwargs: Any) -> S3PayloadStore:
        return cls(*parse_s3_url(spec), **kwargs)

    def __repr__(self) -> str:
        return f"S3PayloadStore({self.bucket!r}, {self.prefix!r})"

    @property
    def client(self) -> Any:
        """The boto3 client, made on first use (so that parsing a URL needs no boto3 import)."""
        if self._client is None:
            self._client = _default_client(self.client_settings)
        return self._client

    def failure(self, action: str, obj: str | StoreObject, exc: BaseException) -> StoreError:
        value = os.environ.get("AWS_MAX_ATTEMPTS", "")
        try:  # botocore takes its attempts from the variable when it is set
            attempts = (int(value), f"AWS_MAX_ATTEMPTS={value.strip()}")
        except ValueError:  # unset, or refused by botocore when the client was built
            attempts = None
        return request_failure(self.name, action, exc, self.client_settings, where=self.location(obj), attempts_from=attempts)

    def stat(self, obj: StoreObject) -> ObjectStat | None:
        """``HeadObject``: size and ``ETag``, or ``None``; ``StoreError`` naming a bucket that does not exist."""
        client = self.client  # outside the try: a missing boto3 is a ConfigurationError, not a store failure
        try:
            head = client.head_object(Bucket=self.bucket, Key=self.key(obj))
            return ObjectStat(int(head["ContentLength"]), head.get("ETag"))
        except Exception as exc:
            if _error_code(exc) not in _NOT_FOUND_CODES:
                raise self.failure(f"looking up the {obj.what}", obj, exc) from exc
        # a HEAD's 404 has no body, so a missing bucket looks like a missing object: ask for the bucket
        try:
            client.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            if _error_code(exc) in _NOT_FOUND_CODES | {"NoSuchBucket"}:
                raise self.missing(f"bucket {self.bucket!r}", obj) from exc
            # HeadBucket needs s3:ListBucket; without it the object's 404 stands
            logger.debug("coldsnap: HeadBucket of %s after a 404: %s", self.bucket, exc)
        return None

    @contextlib.contextmanager
    def open_range(self, obj: StoreObject, stat: ObjectStat, start: int, end: int) -> Iterator[tuple[Iterable[bytes], bool]]:
        """One ranged ``GetObject`` pinned to the ``ETag`` (``If-Match``), its body read as it arrives."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(obj), "Range": f"bytes={start}-{end - 1}"}
        if stat.version:
            kwargs["IfMatch"] = stat.version
        try:
            response = self.client.get_object(**kwargs)
        except Exception as exc:
            if _error_code(exc) in _NOT_FOUND_CODES:
                raise PayloadUnavailableError(f"{self.name} no longer holds the {obj.what}", file=self.location(obj)) from exc
            if _error_code(exc) in _CONDITION_FAILED_CODES:
                raise StoreError(
                    f"{self.name}: the object changed while it was read (ETag {stat.version} no longer matches)",
                    file=self.location(obj),
                ) from exc
            raise
        with response["Body"] as raw:  # the urllib3 response itself (botocore's StreamingBody reads until full)
            yield read1_chunks(raw), response["ResponseMetadata"]["HTTPStatusCode"] == 200

    def create(
        self, path: Path, obj: StoreObject, size_bytes: int, progress: ProgressCallback | None, replacing: ObjectStat | None
    ) -> bool:
        """One ``PutObject`` up to a part, else a multipart upload (parts hashed in order, sent ``concurrency`` at a time,
        aborted unless the file hashed to the digest); ``If-None-Match: *``, or ``If-Match`` on ``replacing``'s ``ETag``."""
        condition = {"IfNoneMatch": "*"} if replacing is None else {"IfMatch": str(replacing.version)}
        if size_bytes > self.part_size_bytes:
            return self._multipart(path, obj, size_bytes, progress, condition)
        with hashing_reader(path, obj.sha256, size_bytes, None) as reader:
            data = reader.read()
        try:
            self.client.put_object(
                Bucket=self.bucket,
                Key=self.key(obj),
                Body=data,
                **condition,
                ChecksumSHA256=base64.b64encode(bytes.fromhex(obj.sha256)).decode(),
                ContentType="application/octet-stream",
            )
        except Exception as exc:
            if _error_code(exc) in _CONDITION_FAILED_CODES:
                return False
            raise
        if progress is not None:
            progress(size_bytes)
        return True

    def _multipart(
        self, path: Path, obj: StoreObject, size_bytes: int, progress: ProgressCallback | None, condition: dict[str, str]
    ) -> bool:
        ranges = byte_ranges(size_bytes, self.part_size_bytes)
        if len(ranges) > MAX_PARTS:
            raise StoreError(
                f"{self.name}: {size_bytes} bytes need {len(ranges)} parts of {self.part_size_bytes} bytes (S3 allows {MAX_PARTS})",
                file=path,
            )
        key = self.key(obj)
        try:
            upload_id = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=key, ChecksumAlgorithm="SHA256", ContentType="application/octet-stream"
            )["UploadId"]
        except Exception as exc:
            raise self.failure("starting a multipart upload", obj, exc) from exc
        completed = False
        try:
            parts: list[dict[str, Any]] = []
            lock = threading.Lock()

            def send(number: int, data: bytes) -> dict[str, Any]:
                checksum = base64.b64encode(hashlib.sha256(data).digest()).decode()
                with self.typed(f"uploading part {number}", obj):
                    response = self.client.upload_part(
                        Bucket=self.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=data,
                        ChecksumAlgorithm="SHA256",
                        ChecksumSHA256=checksum,
                    )
                if progress is not None:
                    with lock:
                        progress(len(data))
                return {"PartNumber": number, "ETag": response["ETag"], "ChecksumSHA256": checksum}

            with (
                hashing_reader(path, obj.sha256, size_bytes, None) as f,
                concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool,
            ):
                pending: set[concurrent.futures.Future[dict[str, Any]]] = set()
                for number, (start, end) in enumerate(ranges, start=1):
                    pending.add(pool.submit(send, number, f.read(end - start)))
                    if len(pending) >= self.concurrency:  # bounded read-ahead: at most `concurrency` parts in memory
                        done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                        parts += [future.result() for future in done]
                parts += [future.result() for future in concurrent.futures.as_completed(pending)]
            try:
                self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": sorted(parts, key=lambda part: part["PartNumber"])},
                    **condition,
                )
                completed = True
            except Exception as exc:
                if _error_code(exc) in _CONDITION_FAILED_CODES:
                    return False
                raise self.failure("completing the multipart upload", obj, exc) from exc
        finally:
            if not completed:
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
                except Exception as exc:  # the original error matters more; the bucket's lifecycle rule cleans up
                    logger.warning("coldsnap: aborting multipart upload %s of %s failed: %s", upload_id, key, exc)
        return True
