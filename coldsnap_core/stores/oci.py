"""A payload store ``oci://HOST[:PORT]/NAMESPACE/NAME[:TAG]`` in an OCI registry (Distribution Specification v1.1)
through ``httpx`` (the extra ``coldsnap[oci]``), as ``docs/format.md`` §12.6 describes it: a pack or an artifact's file
is a blob, an artifact one image manifest under its tag; credentials from the Docker config's ``auths`` entry."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import ipaddress
import json
import logging
import os
import re
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coldsnap_core.digests import check_digest
from coldsnap_core.errors import (
    ColdsnapError,
    ConfigurationError,
    MissingObjectError,
    PackDigestMismatchError,
    PayloadUnavailableError,
    StoreError,
)
from coldsnap_core.format._strict import read_document_bytes
from coldsnap_core.format.descriptor import DESCRIPTOR_FILENAME
from coldsnap_core.settings import OCI_MOUNT_FROM_ENV, StoreClientSettings
from coldsnap_core.stores._ranged import (
    ANSWER_MAX_BYTES,
    DEFAULT_CONCURRENCY,
    ObjectStat,
    RangedStore,
    byte_ranges,
    hashing_reader,
    read_answer,
    request_failure,
)
from coldsnap_core.stores.base import (
    ARTIFACT_NAME_RE,
    NO_SUCH_NAME_REMEDY,
    ArtifactListing,
    ProgressCallback,
    PublishedArtifact,
    StoreObject,
    as_object,
    check_artifact_name,
)

logger = logging.getLogger(__name__)

OCI_SCHEME = "oci://"
PACK_MEDIA_TYPE = "application/vnd.coldsnap.pack.v1"
"""The media type of a pack layer (uncompressed bytes; the layer digest is the pack's SHA-256)."""
FILE_MEDIA_TYPE = "application/vnd.coldsnap.artifact.file.v1"
"""The media type of a layer holding one file of the artifact folder, titled with its path in the folder."""
TITLE_ANNOTATION = "org.opencontainers.image.title"
ARTIFACT_TYPE = "application/vnd.coldsnap.artifact.v1"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG = b"{}"
EMPTY_DIGEST = hashlib.sha256(EMPTY_CONFIG).hexdigest()
ANNOTATION_PREFIX = "dev.coldsnap."
DOCKER_CONFIG_ENV = "DOCKER_CONFIG"
CHUNK_SIZE_BYTES = 64 << 20
"""Bytes per upload request (one ``PUT`` up to this size, ``PATCH`` chunks of this size beyond)."""
MANIFEST_MAX_BYTES = 4 << 20
"""The largest manifest read (the limit the OCI distribution spec lets registries put on manifests)."""
DOCKER_CONFIG_MAX_BYTES = 4 << 20
"""The largest Docker config file read (it holds one short entry per registry)."""
REFERENCE_NAME_MAX_CHARS = 255
"""The longest ``HOST[:PORT]/NAME`` (OCI Distribution Specification, "Pulling manifests": a limit clients impose)."""

_NAME_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REPOSITORY_RE = re.compile(rf"^{_NAME_COMPONENT}(?:/{_NAME_COMPONENT})*$")
_HOST_RE = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?$")


@dataclass(frozen=True, slots=True)
class OciReference:
    """A parsed ``oci://HOST[:PORT]/NAMESPACE/NAME[:TAG]`` (``tag`` ``None``: each artifact is tagged by its name)."""

    registry: str
    repository: str
    tag: str | None


def parse_oci_url(spec: str) -> OciReference:
    """``oci://HOST[:PORT]/NAMESPACE/NAME[:TAG]`` -> :class:`OciReference`; ``ConfigurationError`` for what
    ``docs/format.md`` §12.6 refuses (the grammar, the length, the port, ``user:password@``, a digest reference)."""
    if not spec.startswith(OCI_SCHEME):
        raise ConfigurationError(f"{spec!r} is not an oci://HOST/NAMESPACE/NAME[:TAG] URL")
    rest = spec[len(OCI_SCHEME) :]
    if "@" in rest.partition("/")[0]:
        raise ConfigurationError(
            f"{spec!r}: credentials do not go in the URL; they come from the Docker config ({docker_config_path()},"
            f" its auths entry for the registry)"
        )
    if "@" in rest:
        raise ConfigurationError(f"{spec!r}: a payload store is a repository (and tag), not a digest reference")
    registry, _, path = rest.partition("/")
    if not registry or not _HOST_RE.match(registry):
        raise ConfigurationError(f"{spec!r}: {registry!r} is not a registry HOST[:PORT]")
    port = registry.rpartition("]")[2].rpartition(":")[2] if ":" in registry.rpartition("]")[2] else None
    if port is not None and not 1 <= int(port) <= 65535:
        raise ConfigurationError(f"{spec!r}: port {port} of {registry!r} is outside 1-65535")
    path = path.strip("/")
    tag = None
    if ":" in path.rsplit("/", 1)[-1]:
        path, _, tag = path.rpartition(":")
        if not ARTIFACT_NAME_RE.fullmatch(tag):
            raise ConfigurationError(
                f"{spec!r}: {tag!r} is not an OCI tag (1-128 characters of A-Za-z0-9._-, not starting with . or -)"
            )
    if not path or not _REPOSITORY_RE.match(path):
        raise ConfigurationError(
            f"{spec!r}: {path!r} is not an OCI repository name (lowercase a-z 0-9 components separated by '.', '_', '__' or '-', joined by '/')"
        )
    if len(f"{registry}/{path}") > REFERENCE_NAME_MAX_CHARS:
        raise ConfigurationError(
            f"{spec!r}: HOST[:PORT]/NAME is {len(f'{registry}/{path}')} characters; the distribution spec lets clients"
            f" limit it to {REFERENCE_NAME_MAX_CHARS}"
        )
    return OciReference(registry, path, tag)


def _is_loopback(registry: str) -> bool:
    host = registry.rsplit(":", 1)[0] if not registry.startswith("[") else registry[1:].split("]", 1)[0]
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def docker_config_path() -> Path:
    """``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``."""
    folder = os.environ.get(DOCKER_CONFIG_ENV)
    return Path(folder) / "config.json" if folder else Path.home() / ".docker" / "config.json"


@dataclass(frozen=True, slots=True)
class RegistryCredentials:
    """Credentials for one registry from a Docker config file's ``auths`` entry (``source``: that file);
    ``identity_token``: an OAuth2 refresh token used instead of the password at a Bearer realm."""

    username: str | None
    password: str | None
    identity_token: str | None
    source: str


def load_credentials(registry: str, config_path: Path | None = None) -> RegistryCredentials | None:
    """The ``auths`` entry for ``registry`` (``HOST[:PORT]``, also with a scheme or a path) in the Docker config
    file, or ``None`` when the file or the entry is absent; ``ConfigurationError`` for a file or an entry that
    ``docs/format.md`` §12.6 refuses (entries for other registries are not judged)."""
    path = config_path or docker_config_path()
    try:
        data = read_document_bytes(path, max_bytes=DOCKER_CONFIG_MAX_BYTES)
    except MissingObjectError:
        return None
    except ColdsnapError as exc:
        raise ConfigurationError(f"the Docker config file cannot be read: {exc.detail}", file=path) from exc
    try:
        auths = json.loads(data).get("auths", {})
    except (ValueError, AttributeError) as exc:
        raise ConfigurationError(f"the Docker config file is not a JSON object: {exc}", file=path) from exc
    if not isinstance(auths, dict):
        raise ConfigurationError(f"the Docker config file's 'auths' is not an object: {type(auths).__name__}", file=path)
    for key, entry in auths.items():
        host = urllib.parse.urlsplit(key).netloc if "://" in key else key.split("/", 1)[0]
        if host != registry:
            continue
        if not isinstance(entry, dict):
            raise ConfigurationError(f"auths[{key!r}] is a {type(entry).__name__}, not an object", file=path)
        fields = {name: entry.get(name) for name in ("auth", "username", "password", "identitytoken")}
        for name, value in fields.items():
            if value is not None and not isinstance(value, str):
                raise ConfigurationError(f"auths[{key!r}].{name} is a {type(value).__name__}, not a string", file=path)
        username, password = fields["username"], fields["password"]
        if fields["auth"]:
            try:
                decoded = base64.b64decode(fields["auth"], validate=True).decode()
            except (ValueError, UnicodeDecodeError) as exc:
                raise ConfigurationError(f"auths[{key!r}].auth is not base64 'user:password'", file=path) from exc
            if ":" not in decoded:
                raise ConfigurationError(f"auths[{key!r}].auth decodes to no 'user:password' (no ':')", file=path)
            username, _, password = decoded.partition(":")
        return RegistryCredentials(username or None, password or None, fields["identitytoken"] or None, str(path))
    return None


def _origin(url: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of ``url`` (RFC 6454's origin), the default port filled in."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, params = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in re.findall(r'([A-Za-z]+)="([^"]*)"', params)}


def _layer(media_type: str, digest: str, size_bytes: int, title: str, **annotations: str) -> dict[str, Any]:
    named = {TITLE_ANNOTATION: title, **{f"{ANNOTATION_PREFIX}{k}": v for k, v in annotations.items()}}
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": size_bytes, "annotations": named}


class OciPayloadStore(RangedStore):
    """Blobs of the repository ``repository`` (``NAMESPACE/NAME``) of ``registry`` (``HOST[:PORT]``); ``tag``: the
    manifest tag (``None``: each artifact's name); ``credentials`` default to the Docker config's. Raises
    ``ConfigurationError`` for an ``oci_mount_from`` entry that is not a repository name."""

    record_kind = "manifest"
    conditional_create = False  # the distribution API has none: presence is checked first
    hash_before_sending = True  # a cancelled upload session can leave its folder in the registry's storage
    replacement_refused = (
        "a registry never replaces a blob it holds: delete it (DELETE /v2/<name>/blobs/<digest>) and run the"
        " registry's garbage collection"
    )

    def __init__(
        self,
        registry: str,
        repository: str,
        *,
        tag: str | None = None,
        client: Any = None,
        credentials: RegistryCredentials | None = None,
        chunk_size_bytes: int = CHUNK_SIZE_BYTES,
        concurrency: int = DEFAULT_CONCURRENCY,
        client_settings: StoreClientSettings | None = None,
    ) -> None:
        name = f"oci {registry}/{repository}"
        super().__init__(name, range_size_bytes=chunk_size_bytes, concurrency=concurrency, client_settings=client_settings)
        for other in self.client_settings.oci_mount_from:
            if not _REPOSITORY_RE.match(other):
                raise ConfigurationError(
                    f"{OCI_MOUNT_FROM_ENV} (extra-config key 'oci_mount_from'): {other!r} is not an OCI repository name"
                )
        self.registry = registry
        self.repository = repository
        self.tag = tag
        self.base_url = f"{'http' if _is_loopback(registry) or self.client_settings.oci_plain_http else 'https'}://{registry}"
        self.mount_from = tuple(r for r in self.client_settings.oci_mount_from if r != repository)
        self.chunk_size_bytes = chunk_size_bytes
        if client is not None:
            self.client = client
        if credentials is not None:
            self._registry_credentials = credentials
        self._authorization: dict[str, str] = {}  # scope -> Authorization header value (one item set at a time: no lock)
        self._tagged: dict[str, str] = {}  # tag -> the artifact this store pushed under it

    @classmethod
    def from_url(cls, spec: str, **kwargs: Any) -> OciPayloadStore:
        ref = parse_oci_url(spec)
        return cls(ref.registry, ref.repository, tag=ref.tag, **kwargs)

    def __repr__(self) -> str:
        return f"OciPayloadStore({self.registry!r}, {self.repository!r})"

    @functools.cached_property
    def client(self) -> Any:
        """The ``httpx.Client``, made on first use unless given; ``ConfigurationError`` when httpx is missing."""
        try:
            import httpx
        except ImportError as exc:
            raise ConfigurationError("an oci:// payload store needs httpx: pip install 'coldsnap[oci]'") from exc
        timeouts = self.client_settings
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency * 2)
        return httpx.Client(
            timeout=httpx.Timeout(timeouts.read_timeout_s, connect=timeouts.connect_timeout_s),
            transport=httpx.HTTPTransport(retries=timeouts.retries, limits=limits),  # the transport takes the limits
            follow_redirects=True,  # blob GETs are often redirected to object storage; httpx drops Authorization across origins
        )

    def blob_url(self, digest: str) -> str:
        return f"{self.base_url}/v2/{self.repository}/blobs/sha256:{check_digest(digest)}"

    def location(self, obj: str | StoreObject) -> str:
        """``oci://HOST/NAME@sha256:<digest>`` (a pack and an artifact's file alike)."""
        digest = check_digest(as_object(obj).sha256)
        return f"{OCI_SCHEME}{self.registry}/{self.repository}@sha256:{digest}"

    @functools.cached_property
    def _registry_credentials(self) -> RegistryCredentials | None:
        return load_credentials(self.registry)

    def _send(self, method: str, url: str, where: str, **kwargs: Any) -> Any:
        """One request, its answer unread; ``StoreError`` when there is no answer (unreachable, a timeout, a bad URL)."""
        import httpx

        try:
            return self.client.send(self.client.build_request(method, url, **kwargs), stream=True)
        except (httpx.HTTPError, httpx.InvalidURL, OverflowError) as exc:  # OverflowError: a deadline past the clock's range
            raise request_failure(self.name, f"{method} {url}", exc, self.client_settings, where=where) from exc

    def _read(self, response: Any, where: str, max_bytes: int = ANSWER_MAX_BYTES) -> Any:
        """``response`` with at most ``max_bytes`` of its body read, then closed; ``StoreError`` when the body failed,
        dripped, or (a success) is longer."""
        import httpx

        with contextlib.closing(response):
            try:
                body = read_answer(self, where, response.iter_raw(), max_bytes)
            except httpx.HTTPError as exc:
                raise request_failure(
                    self.name, f"reading the answer of {response.request.url}", exc, self.client_settings, where=where
                ) from exc
        if len(body) > max_bytes and response.status_code < 300:
            raise StoreError(f"{self.name}: the answer to {response.request.url} is over {max_bytes} bytes", file=where)
        kept = [(k, v) for k, v in response.headers.multi_items() if k.lower() != "content-encoding"]  # the body is raw
        return httpx.Response(response.status_code, headers=kept, content=body[:max_bytes], request=response.request)

    def _request(
        self,
        method: str,
        url: str,
        *,
        where: str,
        scope_key: str = "",
        stream: bool = False,
        max_bytes: int = ANSWER_MAX_BYTES,
        **kwargs: Any,
    ) -> Any:
        """One request, answering the registry's ``401`` challenge once (credentials only to its own origin); the answer
        with at most ``max_bytes`` of its body read, or (``stream``) unread. ``StoreError``: no answer, or a 401/403."""
        _ = self._registry_credentials  # a broken Docker config entry is refused before any request, not at a 401
        headers = dict(kwargs.pop("headers", {}))
        for attempt in range(2):
            authorization = self._authorization.get(scope_key) if _origin(url) == _origin(self.base_url) else None
            if authorization:
                headers["Authorization"] = authorization
            response = self._send(method, url, where, headers=headers, **kwargs)
            from_registry = _origin(str(response.url)) == _origin(self.base_url)
            challenge = response.headers.get("WWW-Authenticate", "")
            if response.status_code != 401 or attempt or not challenge or not from_registry:
                break
            response.close()
            self._answer_challenge(challenge, scope_key, where=where)
        if response.status_code in (401, 403):
            raise self._refusal(method, url, self._read(response, where), from_registry, where)
        return response if stream else self._read(response, where, max_bytes)

    def _refusal(self, method: str, url: str, response: Any, from_registry: bool, where: str) -> StoreError:
        answer = f"{response.status_code} {_error_text(response)}"
        if not from_registry:  # a redirect target or an upload location elsewhere: never sent the credentials
            target = "{}://{}".format(*urllib.parse.urlsplit(str(response.url))[:2])
            return StoreError(
                f"{self.name}: {target}, where {method} {url} led, refused it ({answer}); coldsnap never sends it the"
                " registry's credentials, so they are not the cause (an expired presigned URL, the storage's own policy)",
                file=where,
            )
        creds = self._registry_credentials
        source = f"credentials from {creds.source}" if creds else f"no credentials for {self.registry} in {docker_config_path()}"
        return StoreError(f"{self.name}: the registry refused access ({answer}) to {method} {url} ({source})", file=where)

    def _answer_challenge(self, challenge: str, scope_key: str, *, where: str) -> None:
        """Keep the ``Authorization`` the challenge asks for (``docs/format.md`` §12.6); ``StoreError`` for an unsupported
        challenge, a realm the credentials may not go to, or a refusal by the token service."""
        scheme, params = _parse_challenge(challenge)
        creds = self._registry_credentials
        basic = None
        if creds is not None and creds.username is not None:
            basic = "Basic " + base64.b64encode(f"{creds.username}:{creds.password or ''}".encode()).decode()
        if scheme == "basic":
            if basic is not None:  # else the retry gets the same 401, reported with "no credentials"
                self._authorization[scope_key] = basic
            return
        if scheme != "bearer" or "realm" not in params:
            raise StoreError(f"{self.name}: the registry asks for an unsupported authentication: {challenge!r}", file=where)
        realm, registry = urllib.parse.urlsplit(params["realm"]), urllib.parse.urlsplit(self.base_url)
        safe = realm.scheme == "https" or (realm.scheme == registry.scheme == "http" and realm.hostname == registry.hostname)
        if creds is not None and (basic or creds.identity_token) and not safe:
            raise StoreError(
                f"{self.name}: the registry's token realm {params['realm']} is plain HTTP on another host, or a"
                f" downgrade from HTTPS: the credentials from {creds.source} go only over HTTPS or to the registry's own host",
                file=where,
            )
        query = {k: v for k, v in (("service", params.get("service")), ("scope", params.get("scope"))) if v}
        if creds is not None and creds.identity_token:
            form = {**query, "grant_type": "refresh_token", "refresh_token": creds.identity_token, "client_id": "coldsnap"}
            response = self._read(self._send("POST", params["realm"], where, data=form), where)
        else:
            headers = {"Authorization": basic} if basic else {}
            response = self._read(self._send("GET", params["realm"], where, params=query, headers=headers), where)
        if response.status_code != 200:
            source = f"credentials from {creds.source}" if creds else "anonymous"
            raise StoreError(
                f"{self.name}: the token service {params['realm']} refused ({response.status_code} {_error_text(response)}; {source})",
                file=where,
            )
        try:
            body = response.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not token:
            raise StoreError(f"{self.name}: the token service {params['realm']} answered without a token", file=where)
        self._authorization[scope_key] = f"Bearer {token}"

    def _fail(self, action: str, response: Any, where: str) -> StoreError:
        return StoreError(f"{self.name}: {action} failed: HTTP {response.status_code} {_error_text(response)}", file=where)

    def stat(self, obj: StoreObject) -> ObjectStat | None:
        """The blob's size from ``HEAD``, or ``None``."""
        where = self.location(obj)
        response = self._request("HEAD", self.blob_url(obj.sha256), where=where, scope_key="pull")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._fail("looking up the blob", response, where)
        try:
            return ObjectStat(int(response.headers["Content-Length"]))
        except (KeyError, ValueError) as exc:
            raise StoreError(f"{self.name}: HEAD of the blob gave no Content-Length", file=where) from exc

    @contextlib.contextmanager
    def open_range(self, obj: StoreObject, stat: ObjectStat, start: int, end: int) -> Iterator[tuple[Iterable[bytes], bool]]:
        """One ranged ``GET`` of the blob (redirects followed without the credentials), read as it arrives."""
        where = self.location(obj)
        headers = {"Range": f"bytes={start}-{end - 1}"}
        response = self._request("GET", self.blob_url(obj.sha256), where=where, scope_key="pull", stream=True, headers=headers)
        with contextlib.closing(response):
            if response.status_code == 404:
                raise PayloadUnavailableError(f"{self.name} no longer holds the blob", file=where)
            if response.status_code not in (200, 206):
                raise self._fail(f"reading bytes {start}-{end - 1}", self._read(response, where), where)
            yield response.iter_raw(), response.status_code == 200

    def create(
        self, path: Path, obj: StoreObject, size_bytes: int, progress: ProgressCallback | None, replacing: ObjectStat | None
    ) -> bool:
        """A mount from a ``mount_from`` repository, else an upload session (``replacing`` is always ``None``)."""
        where = self.location(obj)
        location = self._start_upload(obj.sha256, where)
        if location is None:
            logger.info("coldsnap: mounted %s into %s (no byte sent)", obj.sha256, self.name)
        else:
            self._push(location, path, obj.sha256, size_bytes, where, progress)
        return True

    def _absolute(self, location: str) -> str:
        return urllib.parse.urljoin(self.base_url + "/", location)

    def _start_upload(self, digest: str, where: str) -> str | None:
        """The absolute location of a new upload session, or ``None`` when a mount from ``mount_from`` did it."""
        url = f"{self.base_url}/v2/{self.repository}/blobs/uploads/"
        for other in self.mount_from:
            response = self._request(
                "POST", url, where=where, scope_key=f"mount:{other}", params={"mount": f"sha256:{digest}", "from": other}
            )
            if response.status_code == 201:
                return None
            if response.status_code == 202 and response.headers.get("Location"):
                return self._absolute(response.headers["Location"])
        response = self._request("POST", url, where=where, scope_key="push")
        if response.status_code != 202 or not response.headers.get("Location"):
            raise self._fail("starting a blob upload", response, where)
        return self._absolute(response.headers["Location"])

    def _cancel(self, location: str, where: str) -> None:
        try:
            self._request("DELETE", location, where=where, scope_key="push")
        except StoreError as exc:  # the original error matters more; the registry expires stale sessions
            logger.warning("coldsnap: cancelling the upload session %s failed: %s", location, exc)

    def _push(
        self, location: str, path: Path, digest: str, size_bytes: int, where: str, progress: ProgressCallback | None
    ) -> None:
        """One ``PUT`` up to ``chunk_size_bytes``, else ``PATCH`` chunks and a closing ``PUT``, the file hashed as it is
        read (the request completing a changed file is never sent); a failed session is cancelled."""
        try:
            with hashing_reader(path, digest, size_bytes, progress) as reader:
                if size_bytes <= self.chunk_size_bytes:
                    response = self._put(location, digest, reader.read(), where)
                else:
                    for offset, end in byte_ranges(size_bytes, self.chunk_size_bytes):
                        headers = {"Content-Type": "application/octet-stream", "Content-Range": f"{offset}-{end - 1}"}
                        data = reader.read(end - offset)
                        response = self._request("PATCH", location, where=where, scope_key="push", content=data, headers=headers)
                        if response.status_code != 202 or not response.headers.get("Location"):
                            raise self._fail(f"uploading bytes {offset}-{end - 1}", response, where)
                        location = self._absolute(response.headers["Location"])
                    response = self._put(location, digest, b"", where)
            if response.status_code == 400 and "DIGEST_INVALID" in response.text:
                raise PackDigestMismatchError(f"{self.name} refused the bytes: they do not hash to sha256:{digest}", file=path)
            if response.status_code != 201:
                raise self._fail("completing the blob upload", response, where)
        except BaseException:
            self._cancel(location, where)
            raise

    def _put(self, location: str, digest: str, data: bytes, where: str) -> Any:
        separator = "&" if "?" in location else "?"
        return self._request(
            "PUT",
            f"{location}{separator}digest=sha256:{digest}",
            where=where,
            scope_key="push",
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )

    def manifest_for(self, listing: ArtifactListing) -> bytes:
        """The OCI image manifest of ``listing`` (UTF-8 JSON, keys sorted; ``docs/format.md`` §12.6): one
        :data:`PACK_MEDIA_TYPE` layer per pack in digest order, then one :data:`FILE_MEDIA_TYPE` layer per file."""
        layers = [
            _layer(PACK_MEDIA_TYPE, pack.sha256, pack.size_bytes, f"{pack.sha256}.pack", workers=",".join(pack.workers))
            for pack in sorted(listing.packs, key=lambda p: p.sha256)
        ]
        layers += [_layer(FILE_MEDIA_TYPE, file.sha256, file.size_bytes, file.path) for file in listing.files]
        annotations = {f"{ANNOTATION_PREFIX}{key}": value for key, value in listing.annotations}
        annotations[f"{ANNOTATION_PREFIX}format-version"] = str(listing.format_version)
        annotations[TITLE_ANNOTATION] = listing.name
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": ARTIFACT_TYPE,
            "config": {
                "mediaType": EMPTY_MEDIA_TYPE,
                "digest": f"sha256:{EMPTY_DIGEST}",
                "size": len(EMPTY_CONFIG),
                "data": "e30=",
            },
            "layers": layers,
            "annotations": annotations,
        }
        return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()

    def _check_tag(self, listing: ArtifactListing, *, warn: bool) -> tuple[bytes, str, str, str, bool]:
        """The tag rules of :meth:`publish_artifact` for ``listing``, reading only (``warn``: log a move of the tag);
        returns ``(manifest, its digest, the tag's URL, where, whether the tag already names that manifest)``."""
        manifest = self.manifest_for(listing)
        manifest_digest = hashlib.sha256(manifest).hexdigest()
        tag = self.tag if self.tag is not None else listing.name
        if self._tagged.setdefault(tag, listing.name) != listing.name:
            raise ConfigurationError(
                f"{self.name}: the tag {tag!r} would name both {self._tagged[tag]!r} and {listing.name!r}; "
                "publish one artifact per tag, or leave the tag out of the URL (each artifact is then tagged by its folder name)"
            )
        url = f"{self.base_url}/v2/{self.repository}/manifests/{tag}"
        where = f"{OCI_SCHEME}{self.registry}/{self.repository}:{tag}"
        head = self._request("HEAD", url, where=where, scope_key="pull", headers={"Accept": MANIFEST_MEDIA_TYPE})
        current = head.headers.get("Docker-Content-Digest")
        if head.status_code != 200 or current == f"sha256:{manifest_digest}":
            return manifest, manifest_digest, url, where, head.status_code == 200
        # the tag names another manifest: it may move only between coldsnap's manifests of the same artifact name
        response = self._request(
            "GET", url, where=where, scope_key="pull", headers={"Accept": MANIFEST_MEDIA_TYPE}, max_bytes=MANIFEST_MAX_BYTES
        )
        if response.status_code != 200:
            raise self._fail("reading the manifest the tag names", response, where)
        try:
            document = response.json()
            title = (document.get("annotations") or {}).get(TITLE_ANNOTATION)
            artifact_type = document.get("artifactType")
        except (ValueError, AttributeError):
            title = artifact_type = None
        if artifact_type != ARTIFACT_TYPE or title != listing.name:
            what = "a manifest that is not a coldsnap artifact's"
            if artifact_type == ARTIFACT_TYPE:
                what = f"the coldsnap artifact {title!r}"
            raise ConfigurationError(
                f"{self.name}: the tag {where} names {what} ({current}); one tag names one artifact: publish {listing.name!r}"
                " under another tag (or none: each artifact is then tagged by its folder name), or delete the tag first"
            )
        if warn:  # not in a check before the upload: the move is logged once, when it happens
            logger.warning(
                "coldsnap: moving %s from %s to sha256:%s (a new capture of %r; pulls of the tag get the new one)",
                where,
                current,
                manifest_digest,
                listing.name,
            )
        return manifest, manifest_digest, url, where, False

    def check_artifact(self, listing: ArtifactListing) -> None:
        """Refuse now, reading only, what :meth:`publish_artifact` would refuse for ``listing``'s tag."""
        self._check_tag(listing, warn=False)

    def publish_artifact(self, listing: ArtifactListing) -> str:
        """Push the manifest of one artifact whose blobs are in the repository; returns
        ``oci://HOST/NAME:TAG@sha256:<manifest digest>``. Raises ``ConfigurationError`` for a tag naming another artifact
        or a manifest that is not coldsnap's (one tag, one artifact: ``docs/format.md`` §12.6), ``StoreError`` when the
        registry refused or failed, or answered with another manifest digest."""
        manifest, manifest_digest, url, where, named = self._check_tag(listing, warn=True)
        reference = f"{where}@sha256:{manifest_digest}"
        if named:
            logger.info("coldsnap: %s already names this manifest", where)
            return reference
        if self.stat(as_object(EMPTY_DIGEST)) is None:
            location = self._start_upload(EMPTY_DIGEST, where)
            if location is not None:
                response = self._put(location, EMPTY_DIGEST, EMPTY_CONFIG, where)
                if response.status_code != 201:
                    self._cancel(location, where)
                    raise self._fail("uploading the empty config blob", response, where)
        for attempt in range(_MANIFEST_PUSH_ATTEMPTS):
            response = self._request(
                "PUT", url, where=where, scope_key="push", content=manifest, headers={"Content-Type": MANIFEST_MEDIA_TYPE}
            )
            if response.status_code == 201:
                break
            if attempt + 1 == _MANIFEST_PUSH_ATTEMPTS or not _transient_manifest_refusal(response):
                raise self._fail("pushing the artifact's manifest", response, where)
            # Another node pushing the same content-addressed blob at this moment: a registry's filesystem storage
            # replaces the blob's file when that push commits, and a manifest checked meanwhile names an unknown blob.
            time.sleep(0.5 * (attempt + 1))
        answered = response.headers.get("Docker-Content-Digest")
        if answered and answered != f"sha256:{manifest_digest}":
            raise StoreError(
                f"{self.name}: the registry stored the manifest as {answered}, not sha256:{manifest_digest}", file=where
            )
        logger.info("coldsnap: pushed the manifest of %s as %s", listing.name, reference)
        return reference

    def resolve_artifact(self, name: str) -> PublishedArtifact:
        """The artifact the tag ``name`` names: its manifest's :data:`FILE_MEDIA_TYPE` layer titled ``artifact.json``.
        Raises ``ConfigurationError`` (not a tag), ``PayloadUnavailableError`` (no such tag), ``MissingObjectError`` (no
        coldsnap artifact with its files) or ``StoreError`` (the registry failed)."""
        tag = check_artifact_name(name)
        url = f"{self.base_url}/v2/{self.repository}/manifests/{tag}"
        where = f"{OCI_SCHEME}{self.registry}/{self.repository}:{tag}"
        headers = {"Accept": MANIFEST_MEDIA_TYPE}
        response = self._request("GET", url, where=where, scope_key="pull", headers=headers, max_bytes=MANIFEST_MAX_BYTES)
        if response.status_code == 404:
            raise PayloadUnavailableError(f"{self.name} has no tag {tag!r}", file=where, remedy=NO_SUCH_NAME_REMEDY)
        if response.status_code != 200:
            raise self._fail("reading the artifact's manifest", response, where)
        try:
            document = response.json()
            descriptors = [
                layer
                for layer in document["layers"]
                if layer.get("mediaType") == FILE_MEDIA_TYPE
                and (layer.get("annotations") or {}).get(TITLE_ANNOTATION) == DESCRIPTOR_FILENAME
            ]
            artifact = document.get("artifactType") == ARTIFACT_TYPE and len(descriptors) == 1
            if artifact:
                digest, size = descriptors[0]["digest"].removeprefix("sha256:"), int(descriptors[0]["size"])
        except (ValueError, KeyError, TypeError, AttributeError):
            artifact = False
        if not artifact:
            raise MissingObjectError(
                f"{self.name}: the tag {tag!r} names no coldsnap artifact with its files (no {FILE_MEDIA_TYPE} layer titled"
                f" {DESCRIPTOR_FILENAME}); publish the artifact again with this release",
                file=where,
            )
        return PublishedArtifact(check_digest(digest), size)


_MANIFEST_PUSH_ATTEMPTS = 3
"""Tries of a manifest push the registry refuses for a blob it does not know yet, or with a 5xx status."""


def _transient_manifest_refusal(response: Any) -> bool:
    """Whether a refused manifest push may succeed when tried again: a 5xx, or a 400 naming an unknown blob."""
    return response.status_code >= 500 or (response.status_code == 400 and "BLOB_UNKNOWN" in _error_text(response))


def _error_text(response: Any) -> str:
    """The registry's error codes and messages (``{"errors": [{"code", "message"}]}``), else the reason."""
    try:
        errors = response.json().get("errors") or []
        text = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
    except (ValueError, AttributeError):
        text = ""
    return text or response.reason_phrase or ""
