"""A store can slow a node down but never take it down: each remote store's real client (boto3, httpx,
google-cloud-storage, azure-storage-blob) against a small misbehaving server on 127.0.0.1 started by the test
(:class:`store_servers.ScriptedServer` with :func:`store_servers.object_store_script`): a body that drips, never ends,
claims 8 GiB, an endless error body, a server that ignores ``Range``. Every rule is the one ranged-fetch core's
(:class:`coldsnap_core.stores._ranged.RangedStore`, ``docs/format.md`` §12), so each test runs on all four stores."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from store_servers import ScriptedServer, client_environment, object_store_script

from coldsnap_core.errors import PackSizeMismatchError, StoreError
from coldsnap_core.settings import StoreClientSettings

KINDS = ["s3", "oci", "gcs", "azure"]
SLACK_S = 10.0
"""What a test allows beyond the configured timeouts for the client's own work (never a measured time)."""


def _store(kind: str, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: StoreClientSettings, **kwargs: Any):
    """``kind``'s store pointed at ``url`` by its own variables, with 1 MiB ranges, 2 in flight."""
    from coldsnap_core.stores.azure import AzurePayloadStore
    from coldsnap_core.stores.gcs import GcsPayloadStore
    from coldsnap_core.stores.oci import OciPayloadStore
    from coldsnap_core.stores.s3 import S3PayloadStore

    spec, env = client_environment(kind, url, tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cls = {"s3": S3PayloadStore, "oci": OciPayloadStore, "gcs": GcsPayloadStore, "azure": AzurePayloadStore}[kind]
    size = {"part_size_bytes" if kind == "s3" else "chunk_size_bytes": 1 << 20}
    return cls.from_url(spec, **size, concurrency=2, client_settings=client, **kwargs)


def _serve(data: bytes, body: str, **kwargs: Any) -> ScriptedServer:
    box: list[ScriptedServer] = []
    box.append(ScriptedServer(object_store_script(box, data, body, **kwargs)))
    return box[0]


def _fetch_within(seconds: float, store: Any, data: bytes, target: Path) -> BaseException | None:
    """Fetch the object holding ``data`` into ``target`` on a thread; the error it ended with (``None``: success).
    Fails the test when the fetch is still running after ``seconds`` (the old failure: held for ever)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            store.fetch(hashlib.sha256(data).hexdigest(), len(data), fd, file=target)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            os.close(fd)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{store.name}: the fetch was still running after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_dripping_store_fails_the_range_under_the_minimum_rate_naming_the_store_range_and_rate(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Headers, then one byte every 50 ms: each socket read gets a byte well within the read timeout, so only the
    minimum rate ends it. The fetch fails as a StoreError naming the store, the range, the rate and
    ``COLDSNAP_STORE_MIN_RATE``, within the read-timeout window plus slack. Fails if a drip holds a fetch (the old
    clients: for ever, 20 bytes/s, holding the digest's lock)."""
    data = os.urandom(256 << 10)
    client = StoreClientSettings(connect_timeout_s=2, read_timeout_s=0.5, retries=0, min_rate_bytes_per_s=10_000)
    with _serve(data, "drip") as server:
        store = _store(kind, server.url, tmp_path, monkeypatch, client)
        error = _fetch_within(client.read_timeout_s + SLACK_S, store, data, tmp_path / "fetched")
    assert isinstance(error, StoreError), error
    message = str(error)
    assert store.name in message and f"bytes 0-{len(data) - 1}" in message, message
    assert "bytes/s" in message and "under the minimum of 10000 bytes/s (COLDSNAP_STORE_MIN_RATE)" in message, message


@pytest.mark.parametrize("kind", KINDS)
def test_a_range_past_its_deadline_fails_naming_the_store_range_and_rate(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that keeps coming, one byte every 50 ms, with no minimum rate: the range deadline ends it, as a
    StoreError naming the store, the range, the rate and ``COLDSNAP_STORE_RANGE_DEADLINE``, within the deadline plus
    slack. Fails if a request has no deadline (a read timeout counts per socket read)."""
    data = os.urandom(256 << 10)
    client = StoreClientSettings(connect_timeout_s=2, read_timeout_s=2, retries=0, min_rate_bytes_per_s=0, range_deadline_s=1)
    with _serve(data, "drip") as server:
        store = _store(kind, server.url, tmp_path, monkeypatch, client)
        error = _fetch_within(client.range_deadline_s + SLACK_S, store, data, tmp_path / "fetched")
    assert isinstance(error, StoreError), error
    message = str(error)
    assert store.name in message and f"bytes 0-{len(data) - 1}" in message and "bytes/s" in message, message
    assert "(COLDSNAP_STORE_RANGE_DEADLINE)" in message, message


@pytest.mark.parametrize("body", ["endless", "huge-length"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_body_longer_than_its_range_is_refused_past_the_range_and_never_buffered(
    kind: str, body: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``206`` whose body never ends (chunked) or claims ``Content-Length: 8 GiB``: the read stops at the first
    byte past the range (PackSizeMismatchError naming the range), so the server gets to send no more than the range
    and what the sockets buffer. Fails if a store reads a response whole (the old clients read until the server's
    1 GiB cap, per range: an endless body grew the process until the kernel killed it)."""
    data = os.urandom(1 << 20)
    client = StoreClientSettings(connect_timeout_s=2, read_timeout_s=5, retries=0)
    with _serve(data, body) as server:
        store = _store(kind, server.url, tmp_path, monkeypatch, client)
        error = _fetch_within(60, store, data, tmp_path / "fetched")
        sent = server.sent_bytes
    assert isinstance(error, PackSizeMismatchError) and "returned more than 1048576 bytes" in str(error), error
    assert sent < 64 << 20, f"the server sent {sent} bytes for a 1 MiB range"


@pytest.mark.parametrize("kind", KINDS)
def test_an_endless_error_body_is_cut_and_the_failure_is_a_store_error(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``500`` whose error body never ends: the store reads at most 64 KiB of it for the message and fails as a
    StoreError naming the store (``auto`` falls back). Fails if an error body is read whole (OCI's client read
    every answer whole, and botocore every error's: the process grew until killed, or ``MemoryError`` escaped
    untyped)."""
    data = os.urandom(1 << 20)
    client = StoreClientSettings(connect_timeout_s=2, read_timeout_s=5, retries=0)
    with _serve(data, "error-endless") as server:
        store = _store(kind, server.url, tmp_path, monkeypatch, client)
        error = _fetch_within(60, store, data, tmp_path / "fetched")
        sent = server.sent_bytes
    assert isinstance(error, StoreError) and store.name in str(error), error
    assert sent < 64 << 20, f"the server sent {sent} bytes of an error body"


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_that_ignores_range_is_read_once_in_one_stream(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry or proxy that answers every ranged GET with ``200`` and the whole object: the fetch reads the
    object once, in one stream, into the file (byte-identical), with one WARNING naming the store; the server sends
    about one object's worth of bytes. Fails if each range buffers the whole object (the old OCI store: 32 full
    transfers of a 32 MiB object, each held in memory) or takes it for a range."""
    import logging

    data = os.urandom(32 << 20)
    client = StoreClientSettings(connect_timeout_s=2, read_timeout_s=5, retries=0)
    with _serve(data, "ignore-range") as server, caplog.at_level(logging.WARNING, logger="coldsnap_core"):
        store = _store(kind, server.url, tmp_path, monkeypatch, client)
        error = _fetch_within(120, store, data, tmp_path / "fetched")
        sent = server.sent_bytes
    assert error is None, error
    assert (tmp_path / "fetched").read_bytes() == data
    assert sent < 2 * len(data), f"the server sent {sent} bytes for a {len(data)}-byte object"
    warnings = [r.getMessage() for r in caplog.records if "ignores Range" in r.getMessage()]
    assert len(warnings) == 1 and store.name in warnings[0], warnings


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_that_keeps_to_the_rules_is_fetched_byte_identical(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same server answering every range correctly (``206``) in 1 MiB ranges: the fetch is byte-identical and
    every range was asked for once. Fails if the scripted server, not the store, made the tests above fail."""
    data = os.urandom(3 << 20)
    with _serve(data, "ok") as server:
        store = _store(kind, server.url, tmp_path, monkeypatch, StoreClientSettings(connect_timeout_s=2, read_timeout_s=5))
        assert _fetch_within(60, store, data, tmp_path / "fetched") is None
        asked = [{k.lower(): v for k, v in h.items()} for m, _p, h in server.requests if m == "GET"]
        ranges = sorted(h.get("range") or h.get("x-ms-range") for h in asked if "range" in h or "x-ms-range" in h)
    assert (tmp_path / "fetched").read_bytes() == data
    assert ranges == [f"bytes={a}-{a + (1 << 20) - 1}" for a in range(0, len(data), 1 << 20)]


@pytest.mark.parametrize("kind", KINDS)
def test_an_unexpected_answer_from_a_store_is_a_store_error_so_auto_falls_back(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that gives the object's size as ``many``: ``has`` and ``fetch`` fail as a StoreError naming the store
    (``payload-store``, on which ``auto`` falls back), whatever the client raised underneath. Fails if a client's
    exception escapes untyped (GCS's ``int(blob.size)`` raised ``ValueError``: exit 1, the corruption code, and no
    fallback)."""
    data = os.urandom(1 << 20)
    with _serve(data, "bad-size") as server:
        store = _store(
            kind, server.url, tmp_path, monkeypatch, StoreClientSettings(connect_timeout_s=2, read_timeout_s=5, retries=0)
        )
        with pytest.raises(StoreError) as raised:
            store.has(hashlib.sha256(data).hexdigest())
        error = _fetch_within(60, store, data, tmp_path / "fetched")
    assert store.name in str(raised.value) and raised.value.exit_code == 4
    assert isinstance(error, StoreError) and store.name in str(error), error
