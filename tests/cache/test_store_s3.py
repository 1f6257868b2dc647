"""The S3 store's own behaviour (the contract it shares with the other stores is in test_store_contract.py):
the URL form, the single-``PutObject`` path with the digest as its SHA-256 checksum, multipart uploads
with per-part SHA-256, and parallel ranged reads. Real boto3 over HTTP to moto in server mode."""

from __future__ import annotations

import base64

import pytest
from cache_support import sha256_of

from coldsnap_core.cache.payload_cache import PayloadCache
from coldsnap_core.errors import ConfigurationError
from coldsnap_core.restore.staging import stage_payload
from coldsnap_core.stores import from_env, parse_store_spec
from coldsnap_core.stores.s3 import S3PayloadStore, _default_client, parse_s3_url


@pytest.mark.parametrize(
    ("url", "bucket", "prefix", "key_start"),
    [
        ("s3://payloads", "payloads", "", "model-payloads/sha256/"),
        ("s3://payloads/", "payloads", "", "model-payloads/sha256/"),
        ("s3://pay.loads-1/fleet/a/", "pay.loads-1", "fleet/a", "fleet/a/model-payloads/sha256/"),
    ],
)
def test_s3_url_form(url: str, bucket: str, prefix: str, key_start: str) -> None:
    """``s3://bucket[/prefix]``: objects at ``<prefix>/model-payloads/sha256/<digest>.pack``; parsing
    needs no network and no boto3 client."""
    store = parse_store_spec(url)
    assert isinstance(store, S3PayloadStore) and (store.bucket, store.prefix) == (bucket, prefix)
    assert store.key("a" * 64) == f"{key_start}{'a' * 64}.pack"
    assert store.location("a" * 64) == f"s3://{bucket}/{key_start}{'a' * 64}.pack"
    assert isinstance(from_env({"COLDSNAP_PAYLOAD_REPO": url}), S3PayloadStore)


@pytest.mark.parametrize(
    "url", ["s3://", "s3://ab", "s3://Payloads", "s3://pay_loads/x", "s3://payloads/a//b", "s3://payloads/../x"]
)
def test_s3_url_errors(url: str) -> None:
    """A bucket name S3 would refuse, or a prefix with an empty, ``.`` or ``..`` segment: ConfigurationError
    (also through COLDSNAP_PAYLOAD_REPO, naming the variable)."""
    with pytest.raises(ConfigurationError):
        parse_s3_url(url)
    with pytest.raises(ConfigurationError, match="COLDSNAP_PAYLOAD_REPO"):
        from_env({"COLDSNAP_PAYLOAD_REPO": url})


def _bucket(client) -> str:
    import os

    name = f"single-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name


def test_single_put_carries_the_digest_as_its_checksum_and_creates_once(s3_env, captured, tmp_path) -> None:
    """A pack no larger than one part goes up in one ``PutObject`` whose ``x-amz-checksum-sha256`` is the
    digest itself (a server that checks checksums refuses other bytes), under ``If-None-Match: *``: a
    second upload returns False and writes no second version. Then a fetch in 512 KiB ranges stages it."""
    client = _default_client()
    bucket = _bucket(client)
    store = S3PayloadStore(bucket, "p", client=client, part_size_bytes=8 << 20)
    digest, size = captured.pack.sha256, captured.pack.size_bytes
    sent: list[dict] = []
    client.meta.events.register("provide-client-params.s3.PutObject", lambda params, **_: sent.append(dict(params)))
    assert store.upload(captured.pack_path, digest, size) is True
    assert store.upload(captured.pack_path, digest, size) is False
    assert [p["ChecksumSHA256"] for p in sent] == [base64.b64encode(bytes.fromhex(digest)).decode()] * 2
    assert all(p["IfNoneMatch"] == "*" for p in sent)
    assert len(client.list_object_versions(Bucket=bucket)["Versions"]) == 1
    reader = S3PayloadStore(bucket, "p", client=client, part_size_bytes=512 << 10, concurrency=3)
    ranges: list[str] = []
    client.meta.events.register("provide-client-params.s3.GetObject", lambda params, **_: ranges.append(params["Range"]))
    path = stage_payload(captured.pack, cache=PayloadCache(tmp_path / "node"), store=reader)
    assert sha256_of(path) == digest
    assert sorted(ranges, key=lambda r: int(r[6:].split("-")[0])) == [
        f"bytes={a}-{min(a + (512 << 10), size) - 1}" for a in range(0, size, 512 << 10)
    ]


def test_multipart_upload_sends_each_part_with_its_sha256(s3_env, captured) -> None:
    """A pack larger than a part: a multipart upload created with ``ChecksumAlgorithm=SHA256``, each part
    with its own SHA-256, completed under ``If-None-Match: *``; nothing unfinished remains."""
    import hashlib

    client = _default_client()
    bucket = _bucket(client)
    store = S3PayloadStore(bucket, client=client, part_size_bytes=1 << 20)
    data = captured.pack_path.read_bytes()
    parts: dict[int, str] = {}
    completes: list[dict] = []
    client.meta.events.register(
        "provide-client-params.s3.UploadPart",
        lambda params, **_: parts.__setitem__(params["PartNumber"], params["ChecksumSHA256"]),
    )
    client.meta.events.register("provide-client-params.s3.CompleteMultipartUpload", lambda params, **_: completes.append(params))
    assert store.upload(captured.pack_path, captured.pack.sha256, len(data)) is True
    expected = {
        n + 1: base64.b64encode(hashlib.sha256(data[a : a + (1 << 20)]).digest()).decode()
        for n, a in enumerate(range(0, len(data), 1 << 20))
    }
    assert parts == expected and len(parts) >= 2
    assert completes[0]["IfNoneMatch"] == "*"
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_without_boto3_the_store_names_the_extra(monkeypatch) -> None:
    """An ``s3://`` store without boto3 installed: parsing works, the first request raises
    ConfigurationError naming ``coldsnap[s3]`` (not an ImportError traceback)."""
    import sys

    store = parse_store_spec("s3://payloads/x")
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(ConfigurationError, match=r"coldsnap\[s3\]"):
        store.has("a" * 64)


def test_the_loser_of_two_repairs_of_a_corrupt_object_reports_it_present(s3_env, captured) -> None:
    """Two publishers find the same corrupt object and both replace it conditionally on its ``ETag``; the
    one whose ``If-Match`` loses finds the digest's bytes there and returns False (present, §12.4) instead
    of failing with "the object changed", since the store holds the right bytes. A loser that finds other
    bytes still fails. The other publisher is a real second upload to the moto server, made right before
    this one's replacement."""
    from coldsnap_core.errors import StoreError

    client = _default_client()
    bucket = _bucket(client)
    digest, size = captured.pack.sha256, captured.pack.size_bytes
    good = captured.pack_path.read_bytes()

    class RacedStore(S3PayloadStore):
        def __init__(self, *args, other_bytes: bytes, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.other_bytes, self.creates = other_bytes, 0

        def create(self, path, digest, size_bytes, progress, replacing):
            self.creates += 1
            if replacing is not None:  # the other publisher's repair (If-Match on the same ETag) lands first
                client.put_object(Bucket=bucket, Key=self.key(digest), Body=self.other_bytes)
            return super().create(path, digest, size_bytes, progress, replacing)

    corrupt = bytes(b ^ 0x01 for b in good)
    client.put_object(Bucket=bucket, Key=S3PayloadStore(bucket, "p").key(digest), Body=corrupt)
    store = RacedStore(bucket, "p", client=client, part_size_bytes=8 << 20, other_bytes=good)
    assert store.upload(captured.pack_path, digest, size) is False
    assert store.creates == 2
    got = client.get_object(Bucket=bucket, Key=store.key(digest))["Body"].read()
    assert got == good

    client.put_object(Bucket=bucket, Key=store.key(digest), Body=corrupt)
    worse = RacedStore(bucket, "p", client=client, part_size_bytes=8 << 20, other_bytes=corrupt[::-1])
    with pytest.raises(StoreError, match="changed while a corrupt copy was replaced"):
        worse.upload(captured.pack_path, digest, size)


class _StallingS3:
    """A real HTTP server on 127.0.0.1 that answers like an S3 endpoint whose reads stall: ``HEAD`` gives the
    object's size and ETag, a ranged ``GET`` sends its headers and the first 1,000 bytes of the range, then
    nothing more until the server stops (a stalled connection, as a dead load balancer leaves it)."""

    def __init__(self, size_bytes: int) -> None:
        import http.server
        import threading

        self.stop = threading.Event()
        self.gets = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _headers(self, status: int, length: int, extra: dict[str, str]) -> None:
                self.send_response(status)
                for name, value in {"Content-Length": str(length), "ETag": '"stalled"', **extra}.items():
                    self.send_header(name, value)
                self.end_headers()

            def do_HEAD(self) -> None:
                self._headers(200, size_bytes, {"Last-Modified": "Wed, 02 Dec 2026 00:00:00 GMT"})

            def do_GET(self) -> None:
                owner.gets += 1
                start, end = (int(x) for x in self.headers["Range"].removeprefix("bytes=").split("-"))
                self._headers(206, end - start + 1, {"Content-Range": f"bytes {start}-{end}/{size_bytes}"})
                self.wfile.write(b"\0" * 1000)
                self.wfile.flush()
                owner.stop.wait(120)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_stalled_fetch_says_what_it_waits_for_and_ends_as_a_store_error(
    captured, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An S3 endpoint that stops sending in the middle of a ranged GET: while nothing arrives, staging logs
    INFO lines naming the pack, the store and the bytes so far; the client's read timeout (real boto3) ends the
    fetch as a StoreError naming the object, and no pack becomes eligible in the cache. Fails if a fetch that makes no progress is silent (the stalled endpoint would
    hold the digest's lock with nothing logged) or if a stall is retried without end."""
    import logging

    import boto3
    from botocore.config import Config

    from coldsnap_core.errors import StoreError
    from coldsnap_core.restore import staging

    monkeypatch.setattr(staging, "FETCH_NOTICE_INTERVAL_S", 0.5)
    for name, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    server = _StallingS3(captured.pack.size_bytes)
    try:
        config = Config(
            s3={"addressing_style": "path"},
            read_timeout=2,
            connect_timeout=2,
            retries={"mode": "standard", "total_max_attempts": 2},
        )
        client = boto3.client("s3", endpoint_url=server.url, config=config)
        store = S3PayloadStore("payloads", client=client, concurrency=1)
        cache = PayloadCache(tmp_path / "node")
        with caplog.at_level(logging.INFO, logger="coldsnap_core"), pytest.raises(StoreError) as raised:
            stage_payload(captured.pack, cache=cache, store=store)
    finally:
        server.close()
    assert store.location(captured.pack.sha256) in str(raised.value)
    # botocore retries a failed request, not a body read that timed out (urllib3's ReadTimeoutError from
    # StreamingBody.read): the stall ends after one read timeout, not after every attempt's.
    assert server.gets == 1
    notices = [r.getMessage() for r in caplog.records if "still fetching pack" in r.getMessage()]
    assert notices, [r.getMessage() for r in caplog.records]
    assert all(captured.pack.sha256 in n and store.name in n and f"of {captured.pack.size_bytes} bytes" in n for n in notices)
    assert cache.digests() == [] and not cache.object_path(captured.pack.sha256).exists()
    assert cache.temporaries() == []  # the partial fetch was removed
