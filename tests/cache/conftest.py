"""Fixtures for the node-local cache, staging, store, materialization and publication tests."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache_support import capture, make_checkpoint

from coldsnap_core.cache.payload_cache import PayloadCache


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2.3 MB safetensors checkpoint (5 tensors, one content duplicated), seed 0."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"), seed=0)


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another real checkpoint of the same shapes with other bytes (seed 1): another pack digest."""
    return make_checkpoint(tmp_path_factory.mktemp("other-checkpoint"), seed=1)


@dataclass(frozen=True)
class Captured:
    """One captured worker: its artifact, the state root the capture wrote its pack to, the result."""

    checkpoint: Path
    artifact_dir: Path
    capture_root: Path
    result: object

    @property
    def manifest(self):
        return self.result.manifest

    @property
    def pack(self):
        return self.result.manifest.pack

    @property
    def pack_path(self) -> Path:
        return self.result.pack_path


@pytest.fixture
def captured(tmp_path: Path, tiny_checkpoint: Path) -> Captured:
    """The tiny checkpoint captured as worker 0 of 1 into ``tmp_path/artifact`` (pack in ``tmp_path/capture-root``)."""
    artifact = tmp_path / "artifact"
    root = tmp_path / "capture-root"
    return Captured(tiny_checkpoint, artifact, root, capture(tiny_checkpoint, artifact, root))


@pytest.fixture
def cache(tmp_path: Path) -> PayloadCache:
    """An empty cache under ``tmp_path/state``."""
    return PayloadCache(tmp_path / "state")


# --- payload store servers on 127.0.0.1 (store_servers.py) ----------------------------------------------


@pytest.fixture
def local_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A running :class:`local_hub.LocalHub`; ``huggingface_hub`` pointed at it, online, without Xet
    (the suite runs with ``HF_HUB_OFFLINE=1``; huggingface_hub read its variables at import)."""
    import huggingface_hub.constants as hf_constants
    from local_hub import LocalHub

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    with LocalHub(tmp_path / "hub") as hub:
        # HF_ENDPOINT as huggingface_hub derived it at import: the endpoint and the download URL template
        monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        yield hub


class MotoServer:
    """``moto.server.ThreadedMotoServer`` on 127.0.0.1 that can be stopped (its socket closed) and started again
    on the same port; moto keeps its buckets in the process, so they survive a restart."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, self.port = self._server.get_host_and_port()
        self.url = f"http://{host}:{self.port}"
        self.running = True

    def stop(self) -> None:
        self.running = False
        self._server.stop()
        self._server._server.server_close()  # stop() leaves the socket listening; a stopped server refuses connections

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.running = True


@pytest.fixture(scope="session")
def s3_moto():
    """``moto`` in server mode on 127.0.0.1 (a thread of this process, real HTTP), for the session.

    S3's 5 MiB minimum part size is lowered to 256 KiB so the 1.3 MB test pack takes the multipart path
    with 1 MiB parts (moto reads the minimum from ``moto.s3.models.S3_UPLOAD_PART_MIN_SIZE``)."""
    import logging

    import moto.s3.models

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    minimum = moto.s3.models.S3_UPLOAD_PART_MIN_SIZE
    moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = 256 << 10
    # S3 evaluates a conditional write atomically; moto 5.2's threaded server checks If-None-Match and then
    # writes, unlocked (S3Response.put_object, _key_response_post), so two racing creates could both win.
    # One lock around those two handlers gives the tests S3's semantics.
    import threading

    import moto.s3.responses

    write_lock = threading.Lock()
    originals = {}
    for name in ("put_object", "_key_response_post"):
        original = originals[name] = getattr(moto.s3.responses.S3Response, name)

        def locked(self, *args, _original=original, **kwargs):
            with write_lock:
                return _original(self, *args, **kwargs)

        setattr(moto.s3.responses.S3Response, name, locked)
    server = MotoServer()
    yield server
    server.stop()
    moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = minimum
    for name, original in originals.items():
        setattr(moto.s3.responses.S3Response, name, original)


@pytest.fixture(scope="session")
def s3_server(s3_moto) -> str:
    """The endpoint of :func:`s3_moto`."""
    return s3_moto.url


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The AWS variables a boto3 client needs to reach the moto server; returns the endpoint."""
    from store_servers import S3_ENV

    for name, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def registry_server(tmp_path: Path):
    """Debian's ``docker-registry`` (the distribution registry) on 127.0.0.1, for one test: a registry keeps one
    copy of a blob for all its repositories, so a test that damages a stored blob must have its own."""
    from store_processes import Registry

    server = Registry(tmp_path / "registry")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory):
    """``fake-gcs-server`` on 127.0.0.1, for the session."""
    from store_processes import FakeGcs

    server = FakeGcs(tmp_path_factory.mktemp("fake-gcs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory):
    """``azurite-blob`` on 127.0.0.1, for the session."""
    from store_processes import Azurite

    server = Azurite(tmp_path_factory.mktemp("azurite"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=["folder", "hf", "s3", "oci", "gcs", "azure"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each payload store kind in turn (:class:`store_servers.StoreUnderTest`), on its own server."""
    from store_servers import store_under_test

    return store_under_test(request.param, request, tmp_path, monkeypatch)


@pytest.fixture(params=["s3", "oci", "gcs", "azure"])
def ranged_store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each store kind that fetches by parallel ranged reads from a server the test can stop and start, in turn."""
    from store_servers import store_under_test

    return store_under_test(request.param, request, tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def captured_once(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Captured:
    """One capture shared by a module's tests (they only read its artifact and pack)."""
    base = tmp_path_factory.mktemp("captured-once")
    return Captured(
        tiny_checkpoint,
        base / "artifact",
        base / "capture-root",
        capture(tiny_checkpoint, base / "artifact", base / "capture-root"),
    )
