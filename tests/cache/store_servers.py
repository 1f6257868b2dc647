"""The payload stores under one test harness, each backed by a real server on 127.0.0.1.

* ``folder``: a :class:`LocalFolderStore` in a folder (a shared mount, as far as a node can tell);
* ``hf``: the :class:`HfPayloadStore` with a real ``huggingface_hub.HfApi`` talking HTTP to
  :class:`local_hub.LocalHub` (``HF_HUB_DISABLE_XET=1``: the local Hub has no Xet);
* ``s3``: the :class:`S3PayloadStore` with a real boto3 client talking HTTP to ``moto`` in server
  mode (``moto.server.ThreadedMotoServer``), bucket versioning on so the tests can count how many
  times a key was written;
* ``oci``: the :class:`OciPayloadStore` (httpx) against Debian's ``docker-registry`` (the distribution registry,
  a process; ``store_processes.Registry``), one repository per test;
* ``gcs``: the :class:`GcsPayloadStore` with the real ``google-cloud-storage`` client against ``fake-gcs-server``
  (``STORAGE_EMULATOR_HOST``), one bucket per test;
* ``azure``: the :class:`AzurePayloadStore` with the real ``azure-storage-blob`` client against ``azurite``
  (``az://devstoreaccount1/<container>/...`` with ``AZURE_STORAGE_BLOB_ENDPOINT`` and ``AZURE_STORAGE_KEY``), one
  container per test.

:class:`StoreUnderTest` gives the contract tests what they need beyond the :class:`PayloadStore`
protocol: put arbitrary bytes at a digest's place (a corrupt, truncated or extended object), count the
objects and writes on the server, list anything partial a store may leave, and the environment a
child process (another "node") needs to reach the same store through ``--repo``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store_processes import AZURITE_KEY

from coldsnap_core.digests import pack_relpath
from coldsnap_core.stores.base import PayloadStore, StoreObject, as_object

if TYPE_CHECKING:
    import pytest

REPO = Path(__file__).resolve().parent.parent.parent
STORE_KINDS = ("folder", "hf", "s3", "oci", "gcs", "azure")
REMOTE_KINDS = ("hf", "s3", "oci", "gcs", "azure")
"""The kinds with a server (a server can stop, a credential can be wrong)."""
HF_REPO = "coldsnap-test/payloads"
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class StoreUnderTest:
    kind: str
    store: PayloadStore
    spec: str  # the --repo value that names this store
    env: dict[str, str]  # what a child process needs to reach it
    backend: Any = None  # LocalHub, the boto3 client, the folder root, or the Registry / Azurite / FakeGcs process
    bucket: str = ""  # the S3 or GCS bucket, the Azure container, the OCI repository
    extra: dict[str, Any] = field(default_factory=dict)
    server: Any = None  # what can stop() and start() the server again (same port, same objects)

    def new_store_with(self, **kwargs: Any) -> PayloadStore:
        """Another client of the same store with other parameters (``chunk_size_bytes``, ``concurrency``)."""
        if self.kind == "oci":
            from coldsnap_core.stores.oci import OciPayloadStore

            return OciPayloadStore.from_url(self.spec, **kwargs)
        if self.kind == "gcs":
            from coldsnap_core.stores.gcs import GcsPayloadStore

            return GcsPayloadStore.from_url(self.spec, **kwargs)
        if self.kind == "azure":
            from coldsnap_core.stores.azure import AzurePayloadStore

            return AzurePayloadStore.from_url(self.spec, **kwargs)
        if self.kind == "s3":
            from coldsnap_core.stores.s3 import S3PayloadStore

            size = kwargs.pop("chunk_size_bytes", self.store.part_size_bytes)
            return S3PayloadStore.from_url(self.spec, client=self.backend, part_size_bytes=size, **kwargs)
        raise AssertionError(f"no parameters for {self.kind}")

    def new_store(self) -> PayloadStore:
        """Another client of the same store (another node's view)."""
        from coldsnap_core.stores import parse_store_spec

        if self.kind == "hf":
            from huggingface_hub import HfApi

            from coldsnap_core.stores.hf import HfPayloadStore

            return HfPayloadStore(HF_REPO, api=HfApi(endpoint=self.backend.url))
        if self.kind == "s3":
            from coldsnap_core.stores.s3 import S3PayloadStore

            return S3PayloadStore.from_url(self.spec, client=self.backend, part_size_bytes=self.store.part_size_bytes)
        if self.kind in ("oci", "gcs", "azure"):
            return self.new_store_with(chunk_size_bytes=self.extra["chunk_size_bytes"])
        return parse_store_spec(self.spec)

    def put_raw(self, digest: str | StoreObject, data: bytes) -> None:
        """Make the store's object for ``digest`` (a pack's, or any :class:`StoreObject`) hold ``data`` (as a broken
        writer or bit rot would)."""
        obj = as_object(digest)
        if self.kind == "folder":
            path = self.backend / obj.relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                os.chmod(path, 0o644)
            path.write_bytes(data)
        elif self.kind == "hf":
            # a commit of other bytes at the object's path: paths-info reports their real SHA-256
            self.backend.plant(HF_REPO, obj.relpath, data)
        elif self.kind == "oci":
            # a registry hashes every blob pushed to it, so other bytes under a digest come from its storage
            self.backend.plant(self.bucket, obj.sha256, data)
        elif self.kind == "gcs":
            self.extra["client"].bucket(self.bucket).blob(self.store.key(obj)).upload_from_string(data)
        elif self.kind == "azure":
            self.extra["service"].get_blob_client(self.bucket, self.store.key(obj)).upload_blob(data, overwrite=True)
        else:
            self.backend.put_object(Bucket=self.bucket, Key=self.store.key(obj), Body=data)

    def _keys(self) -> list[str]:
        """Every object path the store holds, relative to its root or prefix (not OCI)."""
        if self.kind == "folder":
            return sorted(str(p.relative_to(self.backend)) for p in self.backend.rglob("*") if p.is_file())
        if self.kind == "hf":
            return sorted(self.backend.objects(HF_REPO)) if ("model", HF_REPO) in self.backend.repos else []
        prefix = f"{self.store.prefix}/" if self.store.prefix else ""
        if self.kind == "gcs":
            names = [b.name for b in self.extra["client"].list_blobs(self.bucket)]
        elif self.kind == "azure":
            names = [b.name for b in self.extra["service"].get_container_client(self.bucket).list_blobs()]
        else:
            names = [o["Key"] for o in self.backend.list_objects_v2(Bucket=self.bucket).get("Contents", [])]
        return sorted(n.removeprefix(prefix) for n in names)

    def objects(self) -> list[str]:
        """The object names (``<digest>.pack``) of the packs the store holds."""
        if self.kind == "oci":
            from coldsnap_core.stores.oci import EMPTY_DIGEST

            files = {digest for _, digest in self.files()}
            return [f"{d}.pack" for d in self.backend.layers(self.bucket) if d != EMPTY_DIGEST and d not in files]
        return sorted(Path(k).name for k in self._keys() if k.startswith("model-payloads/sha256/"))

    def files(self) -> list[tuple[str, str]]:
        """``(path, where)`` of every published artifact's file the store holds: ``artifacts/sha256/<d>/<path>`` and
        ``refs/<name>.json`` with ``where`` the path itself; on OCI, ``(title, digest)`` of every file layer of every
        manifest."""
        if self.kind == "oci":
            from coldsnap_core.stores.oci import FILE_MEDIA_TYPE, TITLE_ANNOTATION

            return sorted(
                (layer["annotations"][TITLE_ANNOTATION], layer["digest"].removeprefix("sha256:"))
                for manifest in self.backend.manifests(self.bucket)
                for layer in manifest["layers"]
                if layer["mediaType"] == FILE_MEDIA_TYPE
            )
        return [(k, k) for k in self._keys() if k.startswith(("artifacts/", "refs/"))]

    def writes(self, digest: str) -> int:
        """How many times bytes were stored for ``digest``: object versions (S3), LFS uploads (Hub),
        links/renames (folder: 1 while the object's inode is the first one, counted by the caller)."""
        if self.kind == "s3":
            versions = self.backend.list_object_versions(Bucket=self.bucket, Prefix=self.store.key(digest))
            return len(versions.get("Versions", []))
        if self.kind == "hf":
            return self.backend.lfs_uploaded_oids.count(as_object(digest).sha256)
        if self.kind == "oci":
            return self.backend.completed_uploads(self.bucket, digest)
        if self.kind in ("gcs", "azure"):
            # the object versions seen so far (a GCS generation, an Azure ETag): each write makes a new one
            seen = self.extra.setdefault("versions_seen", set())
            if self.kind == "gcs":
                blob = self.extra["client"].bucket(self.bucket).get_blob(self.store.key(digest))
                version = None if blob is None else blob.generation
            else:
                try:
                    version = (
                        self.extra["service"].get_blob_client(self.bucket, self.store.key(digest)).get_blob_properties().etag
                    )
                except Exception:
                    version = None
            if version is not None:
                seen.add(version)
            return len(seen)
        return 1 if (self.backend / pack_relpath(digest)).exists() else 0

    def leftovers(self) -> list[str]:
        """Anything partial the store holds: folder ``model-payloads/tmp/*``, unfinished S3 multipart
        uploads, ``.partial`` files of the local Hub."""
        if self.kind == "folder":
            tmp = self.backend / "model-payloads" / "tmp"
            return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []
        if self.kind == "hf":
            return sorted(p.name for p in (self.backend.root / "lfs").glob("*.partial"))
        if self.kind == "oci":
            return self.backend.uploads_in_progress(self.bucket)
        if self.kind == "gcs":
            return []  # an unfinished resumable upload is invisible, and expires
        if self.kind == "azure":
            container = self.extra["service"].get_container_client(self.bucket)
            committed = {b.name for b in container.list_blobs()}
            return sorted({b.name for b in container.list_blobs(include=["uncommittedblobs"])} - committed)
        uploads = self.backend.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        return [u["Key"] for u in uploads]


def make_store(
    kind: str,
    tmp_path: Path,
    *,
    hub: Any = None,
    s3_endpoint: str | None = None,
    server: Any = None,
    part_size_bytes: int = 1 << 20,
):
    """A :class:`StoreUnderTest` of ``kind``; ``hub`` (a running LocalHub) for ``hf``, ``s3_endpoint`` for ``s3``,
    ``server`` (a running ``store_processes`` server) for ``oci``, ``gcs`` and ``azure``; the environment they
    need must already be set (the ``any_store`` fixture does it)."""
    name = f"payloads-{os.urandom(4).hex()}"
    if kind == "oci":
        from coldsnap_core.stores.oci import OciPayloadStore

        repository = f"coldsnap/{name}"
        spec = f"oci://{server.registry}/{repository}"
        store = OciPayloadStore.from_url(spec, chunk_size_bytes=part_size_bytes)
        env = {"DOCKER_CONFIG": str(tmp_path / "docker-config")}
        return StoreUnderTest(kind, store, spec, env, server, repository, {"chunk_size_bytes": part_size_bytes})
    if kind == "gcs":
        from google.cloud import storage

        from coldsnap_core.stores.gcs import GcsPayloadStore

        client = storage.Client()
        client.create_bucket(name)
        spec = f"gs://{name}/fleet/a"
        store = GcsPayloadStore.from_url(spec, chunk_size_bytes=part_size_bytes)
        env = {"STORAGE_EMULATOR_HOST": server.url}
        return StoreUnderTest(kind, store, spec, env, server, name, {"client": client, "chunk_size_bytes": part_size_bytes})
    if kind == "azure":
        from azure.storage.blob import BlobServiceClient

        from coldsnap_core.stores.azure import AzurePayloadStore

        service = BlobServiceClient.from_connection_string(server.connection_string)
        service.create_container(name)
        spec = f"az://devstoreaccount1/{name}/fleet/a"
        store = AzurePayloadStore.from_url(spec, chunk_size_bytes=part_size_bytes)
        env = {"AZURE_STORAGE_BLOB_ENDPOINT": server.endpoint, "AZURE_STORAGE_KEY": AZURITE_KEY}
        return StoreUnderTest(kind, store, spec, env, server, name, {"service": service, "chunk_size_bytes": part_size_bytes})
    if kind == "folder":
        from coldsnap_core.stores.local import LocalFolderStore

        root = tmp_path / "folder-store"
        root.mkdir()  # the store exists, as a bucket does; a missing folder is a store error of its own
        return StoreUnderTest(kind, LocalFolderStore(root), str(root), {}, root)
    if kind == "hf":
        from huggingface_hub import HfApi

        from coldsnap_core.stores.hf import HfPayloadStore

        env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0"}
        return StoreUnderTest(kind, HfPayloadStore(HF_REPO, api=HfApi(endpoint=hub.url)), HF_REPO, env, hub)
    from coldsnap_core.stores.s3 import S3PayloadStore, _default_client

    client = _default_client()
    bucket = f"payloads-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=bucket)
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    spec = f"s3://{bucket}/fleet/a"
    store = S3PayloadStore.from_url(spec, client=client, part_size_bytes=part_size_bytes)
    return StoreUnderTest(kind, store, spec, {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}, client, bucket)


_STORE_SERVERS = {"oci": "registry_server", "gcs": "gcs_server", "azure": "azurite_server"}


def store_under_test(kind: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A :class:`store_servers.StoreUnderTest` of ``kind`` on its server, with the environment its clients (and
    the CLI run in-process) need set for the test."""
    hub = request.getfixturevalue("local_hub") if kind == "hf" else None
    endpoint = request.getfixturevalue("s3_env") if kind == "s3" else None
    server = request.getfixturevalue(_STORE_SERVERS[kind]) if kind in _STORE_SERVERS else None
    if kind == "oci":
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))  # no credentials of the machine's user
    elif kind == "gcs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    elif kind == "azure":
        from store_processes import AZURITE_KEY

        monkeypatch.setenv("AZURE_STORAGE_BLOB_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", AZURITE_KEY)
    store = make_store(kind, tmp_path, hub=hub, s3_endpoint=endpoint, server=server)
    store.server = request.getfixturevalue("s3_moto") if kind == "s3" else server
    return store


class StallingEndpoint:
    """A real TCP server on 127.0.0.1 that accepts every connection, reads what the client sends and never
    answers (a store behind a hung load balancer, or a frozen server process): the clients' connect succeeds,
    their read times out. :attr:`requests` holds the request line of every HTTP request received (the attempts a
    client made; a client may also send requests of its own, such as google-cloud-storage's background fetch of
    the bucket's metadata)."""

    def __init__(self) -> None:
        import re
        import socket
        import threading

        self._request_line = re.compile(rb"(?m)^(?:GET|HEAD|PUT|POST|PATCH|DELETE) \S+ HTTP/1\.[01]\r$")
        self._socket = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self.host = self.url.removeprefix("http://")
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import threading

        self._socket.settimeout(0.1)
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._connections.append(connection)
            threading.Thread(target=self._read, args=(connection,), daemon=True).start()

    def _read(self, connection) -> None:
        connection.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data = connection.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.requests += [line.decode().strip() for line in self._request_line.findall(data)]

    def requests_naming(self, text: str) -> list[str]:
        """The request lines received that contain ``text`` (a digest: the requests for one object)."""
        with self._lock:
            return [line for line in self.requests if text in line]

    def close(self) -> None:
        self._stop.set()
        self._socket.close()
        with self._lock:
            for connection in self._connections:
                connection.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> StallingEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def client_environment(kind: str, url: str, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """The ``COLDSNAP_PAYLOAD_REPO`` value and the client variables that point ``kind``'s real client at the HTTP
    server ``url`` (``http://127.0.0.1:PORT``): S3 path-style under bucket ``payloads``, the OCI repository
    ``coldsnap/payloads`` (a loopback registry is spoken to over plain HTTP), GCS bucket ``payloads``, Azure
    container ``payloads`` of the account ``devstoreaccount1``; every prefix ``fleet``."""
    if kind == "s3":
        return "s3://payloads/fleet", {**S3_ENV, "AWS_ENDPOINT_URL": url}
    if kind == "oci":
        return f"oci://{url.removeprefix('http://')}/coldsnap/payloads", {"DOCKER_CONFIG": str(tmp_path / "docker-config")}
    if kind == "gcs":
        return "gs://payloads/fleet", {"STORAGE_EMULATOR_HOST": url}
    return "az://devstoreaccount1/payloads/fleet", {
        "AZURE_STORAGE_BLOB_ENDPOINT": f"{url}/devstoreaccount1",
        "AZURE_STORAGE_KEY": AZURITE_KEY,
    }


class ScriptedServer:
    """A real HTTP/1.1 server on 127.0.0.1, in threads, that answers every request with ``answer(handler)`` (the
    test's script: a misbehaving store, a registry, a redirect target). :attr:`requests` records each request's
    method, path and headers; :attr:`sent_bytes` counts what :meth:`write` sent; :attr:`stop` is set by
    :meth:`close`, so an endless or dripping answer ends with the test."""

    def __init__(self, answer: Callable[[Any], None]) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        owner = self
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.sent_bytes = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def handle_one(self) -> None:
                with owner._lock:
                    owner.requests.append((self.command, self.path, dict(self.headers)))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    answer(self)
                except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: what a test wants
                    self.close_connection = True

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = handle_one

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def write(self, handler: Any, data: bytes) -> None:
        """Send ``data`` on ``handler``'s connection, counted in :attr:`sent_bytes`."""
        handler.wfile.write(data)
        handler.wfile.flush()
        with self._lock:
            self.sent_bytes += len(data)

    def close(self) -> None:
        self.stop.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ScriptedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def answer(handler: Any, status: int, headers: dict[str, str] | None = None, body: bytes = b"") -> None:
    """A whole answer: ``status``, ``headers`` (``Content-Length`` added), ``body`` (not sent for ``HEAD``)."""
    handler.send_response(status)
    for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
        handler.send_header(name, value)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


ENDLESS_CAP_BYTES = 1 << 30
"""Where an "endless" answer of :func:`object_store_script` stops at the latest (a client that reads it all has
buffered 1 GiB: what a test watching for an unbounded read detects in :attr:`ScriptedServer.sent_bytes`)."""


def object_store_script(server_box: list[ScriptedServer], data: bytes, body: str, *, drip_interval_s: float = 0.05):
    """An ``answer`` for :class:`ScriptedServer` that speaks enough of S3 (path-style), the OCI distribution API,
    GCS's JSON API and Azure Blob for one object holding ``data``, as :func:`client_environment` points a client
    at it: every ``HEAD`` gives the object's size and version headers, a GCS metadata ``GET`` its JSON (size,
    generation 1), and a ranged ``GET`` is answered as ``body`` says:

    * ``ok``: ``206`` with the range;
    * ``drip``: ``206`` with the range's ``Content-Length``, then one byte every ``drip_interval_s``;
    * ``endless``: ``206`` with a chunked body of the range's bytes and then zeros that never end (up to
      :data:`ENDLESS_CAP_BYTES`);
    * ``huge-length``: ``206`` with ``Content-Length: 8 GiB``, the range's bytes and zeros until the cap;
    * ``error-endless``: ``500`` with a chunked error body that never ends;
    * ``ignore-range``: ``200`` with the whole object;
    * ``bad-size``: the object's size is ``many`` (``HEAD``'s ``Content-Length``, GCS's ``size``).

    ``server_box`` holds the server once it exists (the script counts through it)."""
    import json
    import urllib.parse

    def endless(handler: Any, status: int, headers: dict[str, str], chunked: bool, prefix: bytes = b"") -> None:
        """Answer ``prefix`` (the range's own bytes: a client that checks bytes as they land finds nothing wrong in
        them), then zeros that never end."""
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.end_headers()
        block, sent = b"\0" * (64 << 10), 0
        for piece in (prefix,) if prefix else ():
            server_box[0].write(handler, b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        while sent < ENDLESS_CAP_BYTES and not server_box[0].stop.is_set():
            server_box[0].write(handler, b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
            sent += len(block)

    def script(handler: Any) -> None:
        path = urllib.parse.urlsplit(handler.path).path
        if handler.command == "HEAD":
            headers = {"ETag": '"v1"', "Last-Modified": "Wed, 02 Dec 2026 00:00:00 GMT", "x-ms-blob-type": "BlockBlob"}
            handler.send_response(200)
            size = "many" if body == "bad-size" else str(len(data))
            for name, value in {"Content-Length": size, "Content-Type": "application/octet-stream", **headers}.items():
                handler.send_header(name, value)
            handler.end_headers()
            return
        if "/storage/v1/b/" in path and not path.startswith("/download/"):  # GCS: the object's metadata
            bucket, _, name = path.split("/storage/v1/b/", 1)[1].partition("/o/")
            size = "many" if body == "bad-size" else str(len(data))
            meta = {"kind": "storage#object", "bucket": bucket, "name": urllib.parse.unquote(name), "size": size}
            answer(
                handler,
                200,
                {"Content-Type": "application/json"},
                json.dumps({**meta, "generation": "1", "metageneration": "1"}).encode(),
            )
            return
        first, _, last = (
            (handler.headers.get("Range") or handler.headers.get("x-ms-range") or "bytes=0-")
            .removeprefix("bytes=")
            .partition("-")
        )
        start, end = int(first), int(last or len(data) - 1) + 1
        if body == "ignore-range":
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            server_box[0].write(handler, data)
        elif body in ("ok", "drip"):
            handler.send_response(206)
            handler.send_header("Content-Length", str(end - start))
            handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            handler.end_headers()
            if body == "ok":
                server_box[0].write(handler, data[start:end])
            for offset in range(start, end) if body == "drip" else ():
                if server_box[0].stop.wait(drip_interval_s):
                    return
                server_box[0].write(handler, data[offset : offset + 1])
        elif body == "huge-length":
            endless(
                handler,
                206,
                {"Content-Length": str(8 << 30), "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"},
                False,
                data[start:end],
            )
        elif body == "error-endless":
            endless(handler, 500, {"Transfer-Encoding": "chunked", "Content-Type": "application/xml"}, True)
        else:
            headers = {"Transfer-Encoding": "chunked", "Content-Type": "application/xml"}
            endless(handler, 206, headers, True, data[start:end])

    return script


def node_command(start_file: Path, *cli_args: str) -> list[str]:
    """A child process (another "node") that waits for ``start_file`` to exist, then runs ``coldsnap
    CLI_ARGS...`` in-process and exits with its code (all nodes start together)."""
    return [sys.executable, str(Path(__file__).resolve()), str(start_file), *cli_args]


def run_nodes(commands: list[list[str]], env: dict[str, str], start_file: Path, *, timeout_seconds: float = 120.0):
    """Start every command, release them at once, and return ``[(returncode, stdout, stderr)]``."""
    child_env = {**os.environ, **env}
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env, cwd=REPO)
        for cmd in commands
    ]
    time.sleep(0.2)
    start_file.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout_seconds)
        results.append((proc.returncode, out, err))
    return results


if __name__ == "__main__":
    start = Path(sys.argv[1])
    from coldsnap_core.cli.main import main  # imported before the wait: the nodes race on the store, not on imports

    deadline = time.monotonic() + 60
    while not start.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(main(sys.argv[2:]))
